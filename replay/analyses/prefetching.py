"""Speculative prefetch and retention: a predictor's guesses read into (or kept in) the same cache.

Prefetch (docs/design.md, "Lossy and speculative what-ifs"; the what-if issue): after layer l's load
(and its eviction step), the predictor's guesses for the MoE layer d places ahead in the same
token are read speculatively into the cache (d = 1 for ``prev-token`` and ``static-hot``; d for
``stale-gate[d]``, whose guesses for layer l+d come from layer l's gate input, i.e. exist only
once layer l has run). Guesses are made for decode routings only (the predictors' decode mode), so
fills happen in decode; prefill runs as in the plain replay. The last d layers of a token get no
guesses from the layer before (no wrap into the next token).

- ``--cap N``: at most N predicted *misses* are attempted per layer; guesses already resident
  cost nothing and do not use the cap.
- ``--drop F``: a guess whose *predicted weight* is below F / k is not read, except the top-ranked
  guess of each routing. Predicted weight: for ``stale-gate[d]`` the weight layer l+d's router
  would give that expert from the stale gate input (the architecture's weight rule applied to the
  predicted top-k); for ``prev-token`` the weight the previous token's routing gave that expert at
  this layer; for ``static-hot`` (and ``static-hot-prompt``) the expert's mean applied weight over
  the routings of this layer it learned from. Only the demand side is unchanged: the replay does
  not drop demanded experts (use ``drop --mode closed`` for that).
- ``--guard``: the LFRU eviction guard (see :mod:`replay.core.driver`): a fill whose victim has
  demand heat >= 2 is refused unless score(victim) + score(victim)/4 + 4*256 <= score(candidate).
- ``--retain``: the guesses for the next d layers are protected from eviction (zero extra bytes).

Figures: demand hit % = demand hits / demand lookups (a speculative fill is not a lookup; a demand
hit on a prefetched entry is a hit), decode-only and cumulative; bytes are expert bytes read (demand
misses + speculative fills), per decoded token; bytes are not time (see the cost model).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from replay.core.driver import (
    ACC_SPEC_FILLS,
    ACC_SPEC_HITS,
    ACC_SPEC_READ,
    STAT_SPEC_CAPPED,
    STAT_SPEC_EVICTED_UNUSED,
    STAT_SPEC_FILLS,
    STAT_SPEC_HITS,
    STAT_SPEC_NO_ROOM,
    STAT_SPEC_REFUSED,
    STAT_SPEC_RESIDENT,
    STAT_SPEC_UNUSED_END,
)
from replay.core.simulate import (
    ACC_HITS,
    ACC_LOOKUPS,
    ACC_READ,
    Loads,
    ReplayResult,
    check_policies,
    prepare_loads,
    replay,
)
from replay.predictors.base import NONE
from traces.format.errors import UserError
from traces.format.schema import PHASE_DECODE
from traces.io.reader import RoutingArrays, Trace
from traces.util.units import MIB

PREFETCH_POLICIES = ("lru", "lfru")


@dataclass(frozen=True)
class Guesses:
    """A predictor's guesses, dense and aligned with the routing rows (the kernel's input).

    ``entries`` [R, k] int32: the (layer, expert) entries named for routing row r (the row the
    guess is *for*), best first, -1 where nothing is named (unscored rows, or cut by ``--drop``);
    ``ahead``: how many MoE layers before that row's layer the guess exists."""

    name: str
    ahead: int
    entries: np.ndarray
    weights: np.ndarray  # [R, k] float32 predicted weight per rank (NaN unknown)
    scored_rows: int
    dropped_guesses: int  # guesses removed by --drop
    train: str = "none"  # the held-out protocol a learner was fitted under (replay/predictors/training.py)
    train_text: str = ""


def guesses(trace: Trace, predictor: str, drop_frac: float | None = None, arr: RoutingArrays | None = None,
            option: str = "--predictor", drop_option: str = "--drop", train: str | None = None,
            train_trace: Trace | None = None, seed: int = 0) -> Guesses:
    """The predictor's top-k guesses for every decode routing, as entries aligned with the rows.

    A predictor that learns is fitted under the held-out protocol (``train`` / ``train_trace`` /
    ``seed``, :mod:`replay.predictors.training`; default: the first 50% of each request's decoded
    tokens): it guesses only for the evaluated tokens, never for one it learned from, so the
    training tokens replay without prefetch (folds:K or a training trace guess everywhere).

    ``option`` / ``drop_option``: the names the predictor and ``drop_frac`` came under (a CLI flag
    or the API's keyword), for messages."""
    from replay import predictors as registry
    from replay.analyses.drop_cold import check_drop_frac

    if drop_frac is not None:  # before any predictor runs
        drop_frac = check_drop_frac(drop_frac, drop_option)
    fam, d = registry.parse_predictor(predictor, option)
    if not getattr(registry.module(fam), "PREFETCH", True):
        raise UserError(f"{option} {predictor}: not a prefetch predictor (use one of {', '.join(registry.prefetch_names())}).")
    reason = registry.check(fam, trace, d)
    if reason:
        raise UserError(f"{option}: {trace.path}: {reason}")
    reason = registry.unavailable(fam, trace)
    if reason:
        raise UserError(f"{option} {predictor}: {trace.path}: {reason}.")
    arr = arr if arr is not None else trace.arrays(recorded=False)
    k, n_expert = trace.top_k, trace.n_expert
    dec = arr.phase == PHASE_DECODE
    from replay.predictors.training import make_split

    split = make_split(trace, arr, dec, train=train, train_trace=train_trace, seed=seed, learns=registry.learns(fam),
                       phase_mask=lambda a: a.phase == PHASE_DECODE)
    pred = registry.run(trace, arr, dec, k, [(fam, d)], with_weights=True, split=split)[registry.full_name(fam, d)]
    ahead = registry.ahead(fam, d)
    pw = pred.weights if pred.weights is not None else np.full(pred.ranked.shape, np.nan, np.float32)
    ranked = pred.ranked
    keep = (ranked != NONE) & pred.scored[:, None]
    n_dropped = 0
    if drop_frac is not None:
        # A guess the engine would drop-cold anyway is not read; the top-ranked guess always is.
        # NaN (unknown) predicted weight: not below the threshold, so read.
        below = np.zeros(ranked.shape, dtype=bool)
        below[:, 1:] = pw[:, 1:] < drop_frac / k
        n_dropped = int((keep & below).sum())
        keep &= ~below
    lidx_of = np.full(max(trace.moe_layers) + 1, -1, np.int64)
    lidx_of[list(trace.moe_layers)] = np.arange(len(trace.moe_layers))
    lidx = lidx_of[arr.layer.astype(np.int64)]
    entries = np.where(keep, lidx[:, None] * n_expert + ranked, -1).astype(np.int32)
    return Guesses(pred.name, ahead, np.ascontiguousarray(entries), pw, int(pred.scored.sum()), n_dropped, split.spec,
                   split.text)


def _totals(loads: Loads, res: ReplayResult) -> dict[str, float]:
    a = res.acc
    dec, cum = a[1].sum(axis=0), a.sum(axis=(0, 1))
    n_tok = loads.decode_tokens  # tokens, not decode batches: a batch may hold many requests' tokens
    out = {
        "hit_pct_decode": 100.0 * dec[ACC_HITS] / dec[ACC_LOOKUPS] if dec[ACC_LOOKUPS] else None,
        "hit_pct_cum": 100.0 * cum[ACC_HITS] / cum[ACC_LOOKUPS] if cum[ACC_LOOKUPS] else None,
        "read_mib_decode": float(dec[ACC_READ]) / MIB, "spec_mib_decode": float(dec[ACC_SPEC_READ]) / MIB,
        "read_mib": float(cum[ACC_READ]) / MIB, "spec_mib": float(cum[ACC_SPEC_READ]) / MIB,
        "misses_decode": int(dec[ACC_LOOKUPS] - dec[ACC_HITS]), "spec_fills_decode": int(dec[ACC_SPEC_FILLS]),
        "useful_decode": int(dec[ACC_SPEC_HITS]), "tokens_decode": n_tok,
    }
    tot = out["read_mib_decode"] + out["spec_mib_decode"]
    out["total_mib_per_token"] = tot / n_tok if n_tok else None
    return out


def prefetch(trace: Trace, predictor: str, budget_mib: float | None = None, policy: str = "lru", cap: int | None = None,
             guard: bool = False, drop_frac: float | None = None, retain: bool = False, model=None,
             profile=None, train: str | None = None, train_trace: Trace | None = None,
             seed: int = 0) -> pl.DataFrame:
    """One row: the prefetch replay against the no-prefetch replay at the same budget and policy.

    Keys: ``predictor``, ``ahead``, ``policy``, ``budget_mib``, ``cap``, ``guard``, ``drop``,
    ``retain``, ``train`` (the held-out protocol of a learning predictor, "none" otherwise) and
    ``train_text``; demand ``hit_pct_decode`` / ``hit_pct_cum`` (+ ``_baseline``); speculative
    ``spec_fills``, ``spec_mib``, ``spec_share_pct`` (of all bytes read, decode), ``useful``
    (fills demanded before eviction), ``useful_pct`` (of fills), ``evicted_unused``,
    ``unused_at_end``, ``refused_guard``, ``refused_no_room``, ``capped``, ``predicted_resident``;
    bytes per decoded token ``total_mib_per_token`` (demand + speculative) and its ``_baseline``,
    ``bytes_change_pct``; ``tokens_decode``, ``read_mib_decode``, ``misses_decode`` (+ baseline);
    the paired comparison with the baseline over decoded tokens (:func:`replay.analyses.paired.whatif_columns`:
    ``delta_hit_pp``, ``delta_mib_per_token`` with their 95% intervals and ``vs_baseline``; with
    ``model`` also ``delta_ms_per_token`` and ``vs_baseline_time``). With ``profile`` (a
    :class:`replay.analyses.timeline.Profile`; not with ``model``) both replays are timed on the timeline
    instead: :func:`replay.analyses.timeline_whatif.timeline_columns` (useful / late / wasted speculative
    bytes, ms per token with and without, the paired change and its interval)."""
    if drop_frac is not None:  # refused before any work (guesses() applies the same check)
        from replay.analyses.drop_cold import check_drop_frac

        check_drop_frac(drop_frac, "--drop")
    if policy not in PREFETCH_POLICIES:
        check_policies([policy], option="--policy")
        raise UserError(f"--policy {policy}: prefetch replays {' or '.join(PREFETCH_POLICIES)} only.")
    if budget_mib is None:
        budget_mib = trace.recorded.get("budget_mib")
        if budget_mib is None:
            raise UserError(f"{trace.path}: the trace records no cache budget; pass --budget-mib.")
    if cap is not None and not 0 <= cap < 1 << 31:
        raise UserError(f"--cap {cap}: must be >= 0 predicted misses per layer (and below 2^31).")
    from replay.analyses.info import require_routings
    from replay.core.simulate import check_state_fits

    require_routings(trace, "prefetch")
    check_state_fits(trace)
    arr = trace.arrays(recorded=False)
    if not (arr.phase == PHASE_DECODE).any():
        # Guesses are made for decode routings only: every figure would be null, so say so instead.
        raise UserError(f"{trace.path}: has no decoded tokens (prefill only), and prefetch guesses are made for decode "
                        "routings; use 'cache' for the prefill's hit rates.")
    g = guesses(trace, predictor, drop_frac, arr, train=train, train_trace=train_trace, seed=seed)
    loads = prepare_loads(arr, trace.moe_layers, trace.n_expert, trace.expert_bytes)
    timed = profile is not None
    base = replay(loads, policy, float(budget_mib), slots=timed)
    res = replay(loads, policy, float(budget_mib), pred=g.entries, ahead=g.ahead, cap=cap, guard=guard, retain=retain,
                 fill=True, slots=timed, fills=timed)
    b, t = _totals(loads, base), _totals(loads, res)
    st = res.stats
    fills = int(st[STAT_SPEC_FILLS])
    row = {
        "predictor": g.name, "ahead": g.ahead, "policy": policy, "budget_mib": float(budget_mib), "cap": cap,
        "guard": guard, "drop": drop_frac, "retain": retain, "train": g.train, "train_text": g.train_text,
        "hit_pct_decode": t["hit_pct_decode"], "hit_pct_decode_baseline": b["hit_pct_decode"],
        "hit_pct_cum": t["hit_pct_cum"], "hit_pct_cum_baseline": b["hit_pct_cum"],
        "spec_fills": fills, "spec_mib": t["spec_mib"],
        "spec_share_pct": (100.0 * t["spec_mib_decode"] / (t["spec_mib_decode"] + t["read_mib_decode"])
                           if t["spec_mib_decode"] + t["read_mib_decode"] > 0 else None),
        "useful": int(st[STAT_SPEC_HITS]), "useful_pct": 100.0 * int(st[STAT_SPEC_HITS]) / fills if fills else None,
        "evicted_unused": int(st[STAT_SPEC_EVICTED_UNUSED]), "unused_at_end": int(st[STAT_SPEC_UNUSED_END]),
        "refused_guard": int(st[STAT_SPEC_REFUSED]), "refused_no_room": int(st[STAT_SPEC_NO_ROOM]),
        "capped": int(st[STAT_SPEC_CAPPED]), "predicted_resident": int(st[STAT_SPEC_RESIDENT]),
        "guesses_dropped": g.dropped_guesses, "scored_routings": g.scored_rows,
        "total_mib_per_token": t["total_mib_per_token"], "total_mib_per_token_baseline": b["total_mib_per_token"],
        "bytes_change_pct": (100.0 * (t["total_mib_per_token"] / b["total_mib_per_token"] - 1.0)
                             if b["total_mib_per_token"] else None),
        "tokens_decode": t["tokens_decode"],
        "read_mib_decode": t["read_mib_decode"], "spec_mib_decode": t["spec_mib_decode"],
        "total_mib_decode": t["read_mib_decode"] + t["spec_mib_decode"],
        "misses_decode": t["misses_decode"],
        "read_mib_decode_baseline": b["read_mib_decode"], "misses_decode_baseline": b["misses_decode"],
        "overflow_loads": res.overflow_loads,
    }
    from replay.analyses.paired import request_units, whatif_columns

    row.update(whatif_columns(loads, base, res, model, requests=request_units(trace)))
    if timed:
        from replay.analyses.timeline_whatif import timeline_columns

        row.update(timeline_columns(loads, base, res, g.entries, predictor, g.ahead, profile, requests=request_units(trace)))
    return pl.DataFrame([row], infer_schema_length=None)


def with_prefetch_time(frame: pl.DataFrame, model) -> pl.DataFrame:
    """Add ``ms_per_token``/``tok_s``/``ms_per_token_ci95`` (prefetch: demand + speculative bytes
    and demand misses per decoded token) and the same ``_baseline`` columns (the ``verdict`` sentence
    is presentation: :func:`replay.present.whatif.with_verdict`)."""
    from replay.analyses.cost_model import add_time_columns

    f = add_time_columns(frame, model, "total_mib_decode", "misses_decode", "tokens_decode")
    base = add_time_columns(frame, model, "read_mib_decode_baseline", "misses_decode_baseline", "tokens_decode")
    return f.with_columns(ms_per_token_baseline=base["ms_per_token"], tok_s_baseline=base["tok_s"],
                          extrapolated_baseline=base["extrapolated"])



def best_plain(trace: Trace, budget_mib: float, model=None, loads: Loads | None = None) -> dict | None:
    """The best plain (no prefetch) online policy at ``budget_mib``: the cache row with the highest
    decode hit % among the registry's online policies (not the belady/infinite bounds), ties broken
    by policy name; a cell that overflowed its budget (``overflow_loads`` > 0, or a peak above it)
    is not a candidate. With ``model``, the row gains ``ms_per_token``/``tok_s``. None if no policy
    qualifies.

    A prefetch what-if is judged against this too: a prefetch "win" over LRU is no win when plain
    LFU already beats it at the same budget. The choice is the one rule of every "best"
    (:func:`replay.analyses.paired.decide` over :func:`replay.analyses.policy_set.online_policies`); the row gains
    ``tied_with`` (the online policies tied with it within noise) and the paired columns of
    :func:`replay.analyses.paired.annotate`."""
    from replay.analyses.cost_model import with_time
    from replay.analyses.paired import annotate, decide, with_requests
    from replay.analyses.policy_set import online_policies
    from replay.core.frames import rows_of
    from replay.core.simulate import loads_of, sweep

    loads = loads if loads is not None else loads_of(trace)
    series: dict = {}
    frame = sweep(loads, online_policies(), [float(budget_mib)], show_progress=False, series=series)
    if model is not None:
        frame = with_time(frame, model, loads.decode_tokens)
    rows = [r for r in rows_of(frame) if r["layer"] is None and r["hit_pct_decode"] is not None]
    annotate(rows, with_requests(series, trace), model)
    dec = decide(rows)
    if dec is None:
        return None
    return {**dec["best"], "tied_with": dec["tied"]}


def with_best_plain(frame: pl.DataFrame, plain: dict | None) -> pl.DataFrame:
    """Prefetch rows + the best plain policy at their budget: ``best_plain_policy``,
    ``best_plain_hit_pct_decode``, ``best_plain_mib_per_token`` (and ``best_plain_ms_per_token`` /
    ``best_plain_tok_s`` when it was timed)."""
    tokens = frame["tokens_decode"][0] if frame.height else 0
    cols = {
        "best_plain_policy": plain["policy"] if plain else None,
        "best_plain_hit_pct_decode": plain["hit_pct_decode"] if plain else None,
        "best_plain_mib_per_token": plain["read_mib_decode"] / tokens if plain and tokens else None,
        "best_plain_ms_per_token": plain.get("ms_per_token") if plain else None,
        "best_plain_tok_s": plain.get("tok_s") if plain else None,
    }
    dtypes = {"best_plain_policy": pl.String}
    return frame.with_columns(*(pl.lit(v, dtype=dtypes.get(k, pl.Float64)).alias(k) for k, v in cols.items()))


def retain_sweep(trace: Trace, loads: Loads, policies: list[str], budgets_mib: list[float], predictor: str,
                 per_layer: bool = False, seed: int = 0, policy_options: dict | None = None,
                 show_progress: bool = True, train: str | None = None, train_trace: Trace | None = None,
                 profile=None) -> pl.DataFrame:
    """Cache rows with retention (the predictor's guesses for the next layer(s) protected from
    eviction), plus ``hit_pct_decode_no_retain``, ``hit_pct_cum_no_retain`` and
    ``retain_gain_pp_decode`` / ``retain_gain_pp_cum`` (percentage points) from the same sweep
    without retention; on the overall rows the decode gain's 95% interval from the paired block
    bootstrap over decoded tokens (``retain_gain_ci_low`` / ``retain_gain_ci_high``) and its call
    ``retain_vs_no_retain`` (better | worse | tie, :mod:`replay.analyses.paired`). A learning
    predictor is fitted held out (``train`` / ``train_trace``, as :func:`guesses`; ``retain_train``
    says which). With ``profile`` (replay.analyses.timeline.Profile) the overall rows are also timed
    on the timeline, with retention and without (:func:`retain_timeline_columns`)."""
    from replay.analyses.paired import call, diff_hit_pp, with_requests
    from replay.core.simulate import sweep

    g = guesses(trace, predictor, train=train, train_trace=train_trace, seed=seed)
    s_with: dict = {}
    s_without: dict = {}
    with_r = sweep(loads, policies, budgets_mib, per_layer=per_layer, seed=seed, pred=g.entries, ahead=g.ahead,
                   retain=True, policy_options=policy_options, show_progress=show_progress, series=s_with)
    without = sweep(loads, policies, budgets_mib, per_layer=per_layer, seed=seed, show_progress=False,
                    policy_options=policy_options, series=s_without)
    s_with, s_without = with_requests(s_with, trace), with_requests(s_without, trace)
    diffs = [diff_hit_pp(s_with[(p, b)], s_without[(p, b)]) if layer is None else None
             for p, b, layer in zip(with_r["policy"], with_r["budget_mib"], with_r["layer"], strict=True)]
    out = with_r.with_columns(
        pl.lit(g.name).alias("retain_predictor"),
        pl.lit(g.train).alias("retain_train"),
        without["hit_pct_decode"].alias("hit_pct_decode_no_retain"),
        without["hit_pct_cum"].alias("hit_pct_cum_no_retain"),
        (with_r["hit_pct_decode"] - without["hit_pct_decode"]).alias("retain_gain_pp_decode"),
        (with_r["hit_pct_cum"] - without["hit_pct_cum"]).alias("retain_gain_pp_cum"),
        pl.Series("retain_gain_ci_low", [d.low if d else None for d in diffs], dtype=pl.Float64),
        pl.Series("retain_gain_ci_high", [d.high if d else None for d in diffs], dtype=pl.Float64),
        pl.Series("retain_vs_no_retain", [call(d) if d else None for d in diffs], dtype=pl.String),
    )
    if profile is not None:
        out = retain_timeline_columns(trace, loads, out, g, profile, seed=seed, policy_options=policy_options)
    return out


RETAIN_TIME_COLUMNS = ("ms_per_token", "ms_per_token_no_retain", "tok_s", "tok_s_no_retain", "stall_ms_per_token",
                       "stall_ms_per_token_no_retain", "lane_busy_pct", "lane_busy_pct_no_retain",
                       "retain_ms_saved_per_token", "retain_ms_ci_low", "retain_ms_ci_high")


def retain_timeline_columns(trace: Trace, loads: Loads, frame: pl.DataFrame, g, profile, *, seed: int = 0,
                            policy_options: dict | None = None) -> pl.DataFrame:
    """Retention rows timed on the timeline (replay.analyses.timeline): per overall row (``layer``
    None) the replay with retention and the plain one, each replayed again with per-slot codes:
    ``ms_per_token`` / ``ms_per_token_no_retain``, ``tok_s`` / ``tok_s_no_retain``,
    ``stall_ms_per_token`` / ``stall_ms_per_token_no_retain``, ``lane_busy_pct`` (and ``_no_retain``),
    ``retain_ms_saved_per_token`` (without
    minus with) with its 95% interval (``retain_ms_ci_low`` / ``_high``, paired block bootstrap over
    decoded tokens) and ``retain_vs_no_retain_time`` (better = faster; tie unless the interval
    excludes 0); ``time_model`` and the profile (``time_*``). A computed bound (opt-bound): None."""
    from replay.analyses.paired import call, diff_ms, request_units
    from replay.analyses.timeline import time_replay
    from replay.core.simulate import replay
    from replay.policies import policy_module

    units = request_units(trace)
    cols: dict[str, list] = {c: [] for c in (*RETAIN_TIME_COLUMNS, "retain_vs_no_retain_time")}
    for r in frame.to_dicts():
        if r.get("layer") is not None or hasattr(policy_module(r["policy"]), "solve"):
            for c in cols:
                cols[c].append(None)
            continue
        opts = (policy_options or {}).get(r["policy"])
        b = float(r["budget_mib"])
        with_r = time_replay(loads, replay(loads, r["policy"], b, seed=seed, slots=True, pred=g.entries, ahead=g.ahead,
                                           retain=True, policy_options=opts), profile)
        plain = time_replay(loads, replay(loads, r["policy"], b, seed=seed, slots=True, policy_options=opts), profile)
        sw, sp = with_r.summary(), plain.summary()
        u = units if units is not None and units.shape[0] == plain.tok.shape[0] else None
        d = diff_ms(plain.ms_per_batch, with_r.ms_per_batch, plain.tokens, requests=u)
        vals = (sw["ms_per_token"], sp["ms_per_token"], sw["tok_s"], sp["tok_s"], sw["stall_ms_per_token"],
                sp["stall_ms_per_token"], sw["lane_busy_pct"], sp["lane_busy_pct"], d.delta, d.low, d.high)
        for c, v in zip(RETAIN_TIME_COLUMNS, vals, strict=True):
            cols[c].append(v)
        cols["retain_vs_no_retain_time"].append(call(d, higher_is_better=True))
    prof = {f"time_{k}": v for k, v in profile.row().items()}
    return frame.with_columns(
        *(pl.Series(c, v, dtype=pl.String if c == "retain_vs_no_retain_time" else pl.Float64) for c, v in cols.items()),
        pl.lit("fitted" if profile.source == "fitted" else "profile").alias("time_model"),
        *(pl.lit(v).alias(k) for k, v in prof.items()))


