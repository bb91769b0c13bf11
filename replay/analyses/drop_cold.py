"""Drop-cold what-ifs: against the run as it happened (static mode), replayed with the cache in the
loop (closed mode), and the top-k cut beside each.

Drop-cold F skips a routed expert when it is a cache miss and its router weight is below
``F / k``; the routing's top-weighted expert is never skipped. *Static* mode asks: on this
recorded run, with the engine's own residency, what would that have saved and discarded?

Bytes are counted as the engine recorded them (per-slot ``read_bytes``): inside one load (one
(batch, layer) group) an expert is read once, by its first miss; its bytes are saved only if
*every* slot that routes it in that load is dropped. A dropped repeat alone saves nothing (the
read happened for another token), which is what makes prefill savings small.

*Closed* mode replays the cache (any policy, a byte budget) with dropping in the loop: at the
moment a slot is visited, it is skipped iff its entry is not resident, its weight < F / k and it is
not the routing's top-weighted slot. A skipped slot is neither looked up, nor read, nor admitted,
so the cache holds other things later; reads avoided are counted against the no-drop replay at the
same budget and policy, over the same phase. The cache's own hit rate (hits / lookups) is reported
apart: dropped slots never look the cache up, so that figure can rise without the cache serving
more. The closed top-k cut (mode ``closed-k``) skips every slot at rank >= keep_k, resident or not.

Weight mass is the sum of applied router weights; dropping loses it. Mass is a proxy, not a
quality measurement: it says nothing about perplexity or task accuracy. Bytes are not time
(see the cost model).
"""

from __future__ import annotations

import numpy as np
import polars as pl

from replay.core.phases import PHASE_CODES as PHASES
from replay.core.phases import check_phase
from traces.format.errors import UserError
from traces.io.reader import RoutingArrays, Trace
from traces.util.units import MIB


def check_drop_frac(value: object, where: str) -> float:
    """Drop-cold F as a float, or one sentence naming ``where`` (the option, keyword or grid key it
    came under) and the value. The one check of F: ``drop`` (``--fracs``), ``prefetch --drop``, the
    report, sweeps, ``quality --drop-frac`` and the API all call it.

    F scales the uniform share: a miss is skipped when its router weight is below ``F / k``, never
    the routing's top expert. Valid: any finite number >= 0. F = 0 skips nothing (the undropped
    run); F = 1 skips a miss below the uniform share 1/k; F > 1 is meaningful too (the report's 1.5),
    and once ``F / k`` exceeds every non-top weight (F >= k/2 when the weights sum to 1: a non-top
    weight is at most 1/2) every miss but the top is skipped, so a larger F changes nothing more.
    Negative, NaN and infinite values are refused: they are no threshold."""
    import math

    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    if not ok or not math.isfinite(float(value)) or float(value) < 0:
        raise UserError(f"{where}: {value!r} is not a drop-cold F, a finite number >= 0 (a miss whose router weight "
                        "is below F / k is skipped; F = 0 skips none, F = 1 those below the uniform share).")
    return float(value)


def _check_fracs(fracs: list[float]) -> None:
    for f in fracs:
        check_drop_frac(f, "--fracs")


def phase_rows(a: RoutingArrays, phase: str) -> np.ndarray:
    check_phase(phase)
    return np.isin(a.phase, PHASES[phase])


def top_weight_slot(weights: np.ndarray) -> np.ndarray:
    """Per routing, the slot holding the largest weight (ties: the lower slot)."""
    return np.argmax(weights, axis=1)


def load_ids(a: RoutingArrays, rows: np.ndarray) -> np.ndarray:
    """A dense id per (batch, layer) group for the selected rows."""
    key = a.batch[rows].astype(np.int64) * 65536 + a.layer[rows].astype(np.int64)
    _, inv = np.unique(key, return_inverse=True)
    return inv.reshape(-1)


def saved_bytes_and_misses(load: np.ndarray, experts: np.ndarray, read_bytes: np.ndarray,
                           dropped: np.ndarray) -> tuple[float, int]:
    """(bytes not read, recorded misses still read): per (load, expert), its recorded reads are
    saved only if every slot routing it in that load is dropped."""
    n_expert = int(experts.max()) + 1 if experts.size else 1
    key = (np.repeat(load, experts.shape[1]) * n_expert + experts.reshape(-1)).astype(np.int64)
    _, inv = np.unique(key, return_inverse=True)
    n = int(inv.max()) + 1 if inv.size else 0
    kept = np.bincount(inv, weights=(~dropped.reshape(-1)).astype(np.float64), minlength=n)
    rb = np.bincount(inv, weights=read_bytes.reshape(-1).astype(np.float64), minlength=n)
    return float(rb[kept == 0].sum()), int(((rb > 0) & (kept > 0)).sum())


def _summary(mode: str, frac: float | None, keep_k: int | None, phase: str, dropped: np.ndarray, w: np.ndarray,
             total_read: float, saved: float, k: int) -> dict:
    survivors = k - dropped.sum(axis=1)
    hist = np.bincount(survivors, minlength=k + 1)
    total_mass = float(w.sum())
    n = dropped.shape[0]
    row = {
        "mode": mode, "frac": frac, "keep_k": keep_k, "phase": phase, "routings": n,
        "io_saved_pct": saved / total_read * 100.0 if total_read > 0 else None,
        "io_saved_mib": saved / MIB,
        "read_mib_baseline": total_read / MIB,
        "mass_lost_pct": float(w[dropped].sum()) / total_mass * 100.0 if total_mass > 0 else None,
        # Two different shares, both kept and labelled apart: routings (token, layer) with at least
        # one expert skipped, and routed experts skipped (what an engine's telemetry calls "routings
        # dropped"). At top-8 the first is several times the second; comparing one with the other
        # across tools is a wrong answer.
        "routings_dropped_pct": float(dropped.any(axis=1).sum()) / n * 100.0 if n else None,
        "experts_dropped_pct": float(dropped.sum()) / dropped.size * 100.0 if dropped.size else None,
        "slots_dropped": int(dropped.sum()),
        "survivors_mean": float(survivors.mean()) if n else None,
    }
    for s in range(1, k + 1):
        row[f"survivors_{s}_pct"] = float(hist[s]) / n * 100.0 if n else None
    return row


def static_drop(trace: Trace, fracs: list[float], phase: str = "decode",
                keep_ks: list[int] | None = None, profile=None) -> pl.DataFrame:
    """Static drop-cold rows (mode ``static``, one per F) and static top-k cut rows (mode
    ``static-k``, one per keep_k in k-1..1 unless given), on the recorded residency. With
    ``profile`` (replay.analyses.timeline.Profile) every row is also timed on the timeline
    (:func:`timeline_drop`): the recorded misses with and without the dropped slots."""
    _check_fracs(fracs)
    _check_timeline_phase(profile, phase)
    a = trace.arrays()
    if a.residency is None or a.read_bytes is None:
        raise UserError(f"{trace.path}: static drop needs the recorded residency and read_bytes columns "
                        "(an engine-recorded trace); use --mode closed to replay the cache instead.")
    rows = phase_rows(a, phase)
    if not rows.any():
        raise UserError(f"{trace.path}: has no {phase} routings.")
    w = a.weights[rows].astype(np.float64)
    if np.isnan(w).any():
        raise UserError(f"{trace.path}: the engine recorded no routing weights (NaN), so drop-cold cannot be judged.")
    k = trace.top_k
    ex = a.experts[rows]
    res = a.residency[rows]
    rb = a.read_bytes[rows].astype(np.float64)
    load = load_ids(a, rows)
    total_read = float(rb.sum())
    top = np.zeros_like(ex, dtype=bool)
    top[np.arange(ex.shape[0]), top_weight_slot(w)] = True
    out = []
    base_misses = saved_bytes_and_misses(load, ex, rb, np.zeros_like(ex, dtype=bool))[1]
    n_tok = _n_tokens(a, rows)
    timer = _static_timer(trace, a, rows, profile) if profile is not None else None

    def summary(mode, f, kk, dropped):
        saved, misses = saved_bytes_and_misses(load, ex, rb, dropped)
        row = _summary(mode, f, kk, phase, dropped, w, total_read, saved, k)
        row.update(read_mib=(total_read - saved) / MIB, misses=misses, misses_baseline=base_misses, tokens=n_tok)
        if timer is not None:
            row.update(timer(dropped))
        return row

    for f in fracs:
        out.append(summary("static", float(f), None, (res == 0) & (w < f / k) & ~top))
    for kk in _keep_ks(keep_ks, k):
        dropped = np.zeros_like(ex, dtype=bool)
        dropped[:, kk:] = True  # every slot at rank >= keep_k loses its weight, hit or miss
        out.append(summary("static-k", None, kk, dropped))
    frame = pl.DataFrame(out)
    return with_equal_read_comparison(frame)


def _keep_ks(keep_ks: list[int] | None, k: int) -> list[int]:
    if keep_ks is None:
        return list(range(k - 1, 0, -1))
    for kk in keep_ks:
        if not 1 <= kk < k:
            raise UserError(f"keep_k {kk} must lie in 1..{k - 1} (the trace routes top-{k}).")
    return list(keep_ks)


def _n_tokens(a: RoutingArrays, rows: np.ndarray) -> int:
    """Tokens (distinct (request, turn, step)) among the selected rows."""
    key = a.turn[rows].astype(np.int64) << 32 | a.step[rows].astype(np.int64)
    if a.request is None:
        return int(np.unique(key).size)
    return int(np.unique(np.stack([a.request[rows], key], axis=1), axis=0).shape[0])


def closed_drop(trace: Trace, fracs: list[float], budget_mib: float | None = None, policy: str = "lru",
                phase: str = "decode", keep_ks: list[int] | None = None, seed: int = 0, profile=None) -> pl.DataFrame:
    """Closed-loop drop-cold rows (mode ``closed``, one per F) and closed top-k cut rows (mode
    ``closed-k``, one per keep_k in k-1..1 unless given): the cache replayed with dropping in the
    loop at ``budget_mib`` (default: the trace's recorded budget) under ``policy``.

    Per row, over the routings of ``phase``: ``io_saved_pct`` (with ``phase`` decode, its 95% interval
    ``io_saved_ci_low`` / ``io_saved_ci_high`` from the paired block bootstrap over decoded tokens,
    :mod:`replay.analyses.paired`; None otherwise) (bytes the misses read, against the
    no-drop replay at the same budget and policy; negative if dropping made the cache read more),
    ``mass_lost_pct``, ``routings_dropped_pct`` (routings with at least one expert skipped),
    ``experts_dropped_pct`` (routed experts skipped), ``survivors_*``; the cache's own hit rate
    with and without dropping (``hit_pct_decode``, ``hit_pct_prefill``, ``hit_pct_cum`` and their
    ``_baseline``: hits / lookups of decode loads, prefill loads, all loads; dropped slots are not
    lookups), ``lookups`` and ``lookups_baseline`` (of ``phase``); ``read_mib_decode`` /
    ``misses_decode`` / ``tokens_decode`` for the cost model. With ``profile``
    (replay.analyses.timeline.Profile) every row is also timed on the timeline
    (:func:`timeline_drop`): the replay with dropping against the no-drop replay."""
    from replay.core.simulate import ACC_HITS, ACC_LOOKUPS, ACC_READ, check_policies, check_state_fits, prepare_loads, replay

    _check_fracs(fracs)
    _check_timeline_phase(profile, phase)
    check_policies([policy], option="--policy")
    if budget_mib is None:
        budget_mib = trace.recorded.get("budget_mib")
        if budget_mib is None:
            raise UserError(f"{trace.path}: the trace records no cache budget; pass --budget-mib for --mode closed.")
    a = trace.arrays(recorded=False)
    rows = phase_rows(a, phase)
    if not rows.any():
        raise UserError(f"{trace.path}: has no {phase} routings.")
    k = trace.top_k
    w_all = a.weights.astype(np.float64)
    if np.isnan(w_all[rows]).any():
        raise UserError(f"{trace.path}: the engine recorded no routing weights (NaN), so drop-cold cannot be judged.")
    check_state_fits(trace)
    loads = prepare_loads(a, trace.moe_layers, trace.n_expert, trace.expert_bytes)
    phases = list(PHASES[phase])
    top = np.zeros(a.experts.shape, dtype=bool)
    top[np.arange(a.experts.shape[0]), top_weight_slot(np.nan_to_num(w_all, nan=-1.0))] = True
    in_phase = rows[:, None]

    def totals(res):
        acc = res.acc[phases].sum(axis=(0, 1))
        dec = res.acc[1].sum(axis=0)
        return acc, dec

    def hit_pcts(res, suffix=""):
        by = {"decode": res.acc[1].sum(axis=0), "prefill": res.acc[0].sum(axis=0), "cum": res.acc.sum(axis=(0, 1))}
        return {f"hit_pct_{name}{suffix}": _pct(t[ACC_HITS], t[ACC_LOOKUPS]) for name, t in by.items()}

    base = replay(loads, policy, float(budget_mib), seed=seed, slots=profile is not None)
    import dataclasses

    from replay.analyses.paired import diff_saved_pct, request_units, series_of

    units = request_units(trace)

    def paired_series(res):  # each decode batch's request, when requests are resampled whole
        s = series_of(loads, res)
        return dataclasses.replace(s, requests=units) if units is not None and len(s) == units.shape[0] else s

    b_series = paired_series(base)
    b_acc, b_dec = totals(base)
    b_hits = hit_pcts(base, "_baseline")
    total_read = float(b_acc[ACC_READ])
    w = w_all[rows]
    n_tok_dec = loads.decode_tokens  # tokens, not decode batches: a batch may hold many requests' tokens
    base_tl = _time(loads, base.slots, profile) if profile is not None else None

    def summary(mode, f, kk, flags):
        res = replay(loads, policy, float(budget_mib), seed=seed, slots=True, drop=flags)
        acc, dec = totals(res)
        dropped = res.slots[rows] == 3
        row = _summary(mode, f, kk, phase, dropped, w, total_read, total_read - float(acc[ACC_READ]), k)
        row.update(
            policy=policy, budget_mib=float(budget_mib), **hit_pcts(res), **b_hits,
            lookups=int(acc[ACC_LOOKUPS]), lookups_baseline=int(b_acc[ACC_LOOKUPS]),
            read_mib=float(acc[ACC_READ]) / MIB,
            read_mib_decode=float(dec[ACC_READ]) / MIB, misses_decode=int(dec[ACC_LOOKUPS] - dec[ACC_HITS]),
            read_mib_decode_baseline=float(b_dec[ACC_READ]) / MIB,
            misses_decode_baseline=int(b_dec[ACC_LOOKUPS] - b_dec[ACC_HITS]), tokens_decode=n_tok_dec,
        )
        # reads avoided against the same replay without dropping, paired over decoded tokens (replay.analyses.paired)
        d = diff_saved_pct(b_series, paired_series(res)) if phase == "decode" else None
        row.update(io_saved_ci_low=d.low if d else None, io_saved_ci_high=d.high if d else None)
        if base_tl is not None:
            row.update(timeline_drop(base_tl, _time(loads, res.slots, profile), profile, units))
        return row

    out = []
    for f in fracs:
        flags = ((w_all < f / k) & ~top & in_phase).astype(np.uint8)  # 1: skip if not resident then
        out.append(summary("closed", float(f), None, flags))
    for kk in _keep_ks(keep_ks, k):
        flags = np.zeros(a.experts.shape, np.uint8)
        flags[:, kk:] = 2  # skip always, resident or not
        flags[~rows] = 0
        out.append(summary("closed-k", None, kk, flags))
    frame = pl.DataFrame(out)
    return with_equal_read_comparison(frame, cut_mode="closed-k", column="closed_k_mass_lost_at_equal_io_pct")


def _check_timeline_phase(profile, phase: str) -> None:
    if profile is not None and phase != "decode":
        raise UserError(f"--time-model: the timeline times decoded tokens; use --phase decode, not {phase!r}.")


def _time(loads, slots: np.ndarray, profile):
    from types import SimpleNamespace

    from replay.analyses.timeline import time_replay

    return time_replay(loads, SimpleNamespace(slots=slots, fills=None), profile)


def _static_timer(trace: Trace, a: RoutingArrays, rows: np.ndarray, profile):
    """For static mode on the timeline: the recorded residency as per-slot codes (0 miss, 1 hit; 3
    dropped) in the replay's load order, and a function timing a dropped mask (over ``rows``)."""
    from replay.analyses.paired import request_units
    from replay.core.simulate import loads_of

    loads = loads_of(trace)
    if loads.entries.shape != a.experts.shape:
        raise UserError(f"{trace.path}: the recorded residency does not line up with the replay's loads; "
                        "use --mode closed to time drop-cold on the timeline.")
    slots = np.where(a.residency == 0, 0, 1).astype(np.int8)
    base = _time(loads, slots, profile)
    units = request_units(trace)

    def timer(dropped: np.ndarray) -> dict:
        s = slots.copy()
        sub = s[rows]
        sub[dropped] = 3
        s[rows] = sub
        return timeline_drop(base, _time(loads, s, profile), profile, units)

    return timer


def timeline_drop(base, dropped, profile, units: np.ndarray | None = None) -> dict:
    """One drop row's time on the timeline (replay.analyses.timeline): ``ms_per_token`` and
    ``ms_per_token_baseline`` (no drop), ``tok_s`` (and ``_baseline``), ``stall_ms_per_token`` (and
    ``_baseline``), ``ms_saved_per_token`` (baseline minus with drop) with its 95% interval
    (``ms_saved_ci_low`` / ``_high``: paired block bootstrap over decoded tokens,
    replay.analyses.paired) and ``vs_baseline_time`` (better = faster; tie unless the interval
    excludes 0), ``time_model`` and the profile (``time_*``)."""
    from replay.analyses.paired import call, diff_ms

    sb, sd = base.summary(), dropped.summary()
    u = units if units is not None and units.shape[0] == base.tok.shape[0] else None
    d = diff_ms(base.ms_per_batch, dropped.ms_per_batch, base.tokens, requests=u)  # saved: baseline - with drop
    row = {"time_model": "fitted" if profile.source == "fitted" else "profile",
           **{f"time_{k}": v for k, v in profile.row().items()},
           "ms_per_token": sd["ms_per_token"], "ms_per_token_baseline": sb["ms_per_token"],
           "tok_s": sd["tok_s"], "tok_s_baseline": sb["tok_s"],
           "stall_ms_per_token": sd["stall_ms_per_token"], "stall_ms_per_token_baseline": sb["stall_ms_per_token"],
           "ms_saved_per_token": d.delta, "ms_saved_ci_low": d.low, "ms_saved_ci_high": d.high,
           "vs_baseline_time": call(d, higher_is_better=True)}
    return row


def _pct(h, n) -> float | None:
    return 100.0 * float(h) / float(n) if n else None


def with_equal_read_comparison(frame: pl.DataFrame, cut_mode: str = "static-k",
                               column: str = "static_k_mass_lost_at_equal_io_pct") -> pl.DataFrame:
    """Add ``column`` to drop-cold rows: the mass the top-k cut (rows of ``cut_mode``) would lose
    for the same share of reads avoided (linear between its keep_k points; null outside their
    range)."""
    sk = frame.filter(pl.col("mode") == cut_mode).sort("io_saved_pct")
    xs = np.array([0.0] + sk["io_saved_pct"].fill_null(0.0).to_list())
    ys = np.array([0.0] + sk["mass_lost_pct"].fill_null(0.0).to_list())
    vals = []
    for mode, io in zip(frame["mode"].to_list(), frame["io_saved_pct"].to_list()):
        if mode == cut_mode or io is None or io < 0 or sk.height == 0 or io > xs.max():
            vals.append(None)
        else:
            vals.append(float(np.interp(io, xs, ys)))
    return frame.with_columns(pl.Series(column, vals, dtype=pl.Float64))


def drop_time_columns(frame, model, mode: str):
    """ms/token of each drop row and of the no-drop baseline (decode tokens)."""
    import polars as pl

    from replay.analyses.cost_model import add_time_columns

    if mode == "static":
        f = add_time_columns(frame, model, "read_mib", "misses", "tokens")
        base = add_time_columns(frame, model, "read_mib_baseline", "misses_baseline", "tokens")
    else:
        f = add_time_columns(frame, model, "read_mib_decode", "misses_decode", "tokens_decode")
        base = add_time_columns(frame, model, "read_mib_decode_baseline", "misses_decode_baseline", "tokens_decode")
    return f.with_columns(ms_per_token_baseline=base["ms_per_token"], tok_s_baseline=base["tok_s"],
                          extrapolated_baseline=base["extrapolated"],
                          ms_saved_per_token=base["ms_per_token"] - f["ms_per_token"]).with_columns(
        pl.col("ms_saved_per_token").cast(pl.Float64))
