"""A what-if timed on the timeline (replay.analyses.timeline): the columns ``prefetch`` and ``cache``
add under ``--time-model fitted|profile``, and the choice of time model (docs/design.md, "Timeline").

``--time-model``: ``linear`` (the cost model: ``--cost-model FILE``, else fitted on the trace's own
metrics), ``fitted`` (the timeline with parameters fitted on the trace's own metrics,
replay.analyses.timeline_fit), ``profile`` (the timeline on ``--device-profile FILE|PRESET``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from replay.analyses.timeline import Profile, Timeline, issue_ahead_of, time_replay
from traces.format.errors import UserError

TIME_MODELS = ("linear", "fitted", "profile")


def check_time_model(time_model: str | None, device_profile: Any) -> None:
    if time_model is not None and time_model not in TIME_MODELS:
        raise UserError(f"--time-model {time_model!r}: not one of {', '.join(TIME_MODELS)}.")
    if time_model == "profile" and device_profile is None:
        raise UserError("--time-model profile needs --device-profile FILE or a preset name.")
    if device_profile is not None and time_model != "profile":
        raise UserError("--device-profile is read only with --time-model profile.")


def timeline_profile(trace: Any, time_model: str | None, device_profile: Any) -> tuple[Profile | None, dict | None]:
    """The profile a timeline time model uses (None for ``linear`` or no time model) and, when fitted,
    its held-out scores."""
    check_time_model(time_model, device_profile)
    if time_model == "fitted":
        from replay.analyses.timeline_fit import fit_profile

        return fit_profile(trace)
    if time_model == "profile":
        from replay.analyses.timeline_fit import load_profile

        return (device_profile if isinstance(device_profile, Profile) else load_profile(device_profile)), None
    return None, None


def _pct(a: float, b: float) -> float | None:
    return 100.0 * a / b if b > 0 else None


def timeline_columns(loads: Any, base: Any, res: Any, pred: np.ndarray, predictor: str, ahead: int, profile: Profile, *,
                     requests: np.ndarray | None = None) -> dict[str, Any]:
    """``res`` (a prefetch replay with ``slots`` and ``fills``) and ``base`` (the same cache without
    prefetch, ``slots``) timed on ``profile``: per decoded token ``ms_per_token``, ``tok_s``,
    ``stall_ms_per_token``, ``lane_busy_pct`` (each with ``_baseline``), the paired change
    ``delta_ms_per_token`` with its 95% interval and ``vs_baseline_time`` (better = faster, tie
    unless the interval excludes 0), and the speculative bytes: ``useful_mib``, ``late_mib`` (part
    of useful), ``wasted_mib``, ``useful_lead_ms_mean``."""
    from replay.analyses.paired import call, diff_ms

    issue = issue_ahead_of(predictor, ahead)
    tb: Timeline = time_replay(loads, base, profile)
    tp: Timeline = time_replay(loads, res, profile, pred, issue)
    sb, sp = tb.summary(), tp.summary()
    units = requests if requests is not None and requests.shape[0] == tp.tok.shape[0] else None
    d = diff_ms(tp.ms_per_batch, tb.ms_per_batch, tp.tokens, requests=units)
    row = {f"time_{k}": v for k, v in profile.row().items()}
    row["time_model"] = "fitted" if profile.source == "fitted" else "profile"
    row["spec_issue"] = "at the token's start" if issue == 0 else f"when the router of the layer {issue} before has run"
    row.update({
        "ms_per_token": sp["ms_per_token"], "ms_per_token_baseline": sb["ms_per_token"],
        "tok_s": sp["tok_s"], "tok_s_baseline": sb["tok_s"],
        "stall_ms_per_token": sp["stall_ms_per_token"], "stall_ms_per_token_baseline": sb["stall_ms_per_token"],
        "lane_busy_pct": sp["lane_busy_pct"], "lane_busy_pct_baseline": sb["lane_busy_pct"],
        "demand_mib_timed": sp["demand_mib"], "spec_mib_timed": sp["spec_mib"],
        "useful_mib": sp["useful_mib"], "late_mib": sp["late_mib"], "wasted_mib": sp["wasted_mib"],
        "useful_lead_ms_mean": sp["useful_lead_ms_mean"],
        "delta_ms_per_token": d.delta, "delta_ms_ci_low": d.low, "delta_ms_ci_high": d.high,
        "vs_baseline_time": call(d, higher_is_better=False),
    })
    return row


def cache_columns(loads: Any, frame: Any, profile: Profile, *, seed: int = 0, policy_options: dict | None = None,
                  requests: np.ndarray | None = None) -> Any:
    """Cache rows + the timeline's ``ms_per_token``, ``tok_s``, ``stall_ms_per_token``,
    ``lane_busy_pct`` for every overall row (``layer`` None) of a replayed cell, and against LRU at
    the same budget (when LRU is among the rows) ``delta_ms_vs_lru`` with its paired interval
    (``delta_ms_ci_low`` / ``_high``) and ``vs_lru_time`` (better = faster; tie unless the interval
    excludes 0); ``time_model`` and the profile (``time_*``). A computed bound (opt-bound) has no
    per-slot codes to time: None. Each cell is replayed again with per-slot codes."""
    import polars as pl

    from replay.analyses.paired import call, diff_ms
    from replay.core.simulate import replay
    from replay.policies import policy_module

    rows = frame.to_dicts()
    timed: dict[tuple[str, float], Timeline] = {}
    for r in rows:
        key = (r["policy"], float(r["budget_mib"]))
        if r.get("layer") is not None or key in timed or hasattr(policy_module(r["policy"]), "solve"):
            continue
        opts = (policy_options or {}).get(r["policy"])
        res = replay(loads, r["policy"], key[1], seed=seed, slots=True, policy_options=opts)
        timed[key] = time_replay(loads, res, profile)
    cols: dict[str, list] = {c: [] for c in ("ms_per_token", "tok_s", "stall_ms_per_token", "lane_busy_pct",
                                              "delta_ms_vs_lru", "delta_ms_ci_low", "delta_ms_ci_high", "vs_lru_time")}
    for r in rows:
        tl = timed.get((r["policy"], float(r["budget_mib"]))) if r.get("layer") is None else None
        s = tl.summary() if tl is not None else {}
        for c in ("ms_per_token", "tok_s", "stall_ms_per_token", "lane_busy_pct"):
            cols[c].append(s.get(c))
        lru = timed.get(("lru", float(r["budget_mib"])))
        if tl is None or lru is None or r["policy"] == "lru":
            for c in ("delta_ms_vs_lru", "delta_ms_ci_low", "delta_ms_ci_high", "vs_lru_time"):
                cols[c].append(None)
            continue
        units = requests if requests is not None and requests.shape[0] == tl.tok.shape[0] else None
        d = diff_ms(tl.ms_per_batch, lru.ms_per_batch, tl.tokens, requests=units)
        cols["delta_ms_vs_lru"].append(d.delta)
        cols["delta_ms_ci_low"].append(d.low)
        cols["delta_ms_ci_high"].append(d.high)
        cols["vs_lru_time"].append(call(d, higher_is_better=False))
    out = frame.with_columns(*(pl.Series(c, v, dtype=pl.String if c == "vs_lru_time" else pl.Float64) for c, v in cols.items()))
    prof = {f"time_{k}": v for k, v in profile.row().items()}
    return out.with_columns(pl.lit("fitted" if profile.source == "fitted" else "profile").alias("time_model"),
                            *(pl.lit(v).alias(k) for k, v in prof.items()))
