"""Predictor accuracy per layer (docs/design.md, "Predictors and accuracy"): how much of each layer's
routing a predictor would have named, scored against what the router chose.

    evaluate(trace, ["prev-token", "stale-gate", "ctrl"], horizons=[1, 2]) -> PredictResult
    horizon_curve(trace, 8) -> PredictResult   # stale-gate[1..8]: how much anticipation costs

The frame has one row per (predictor, MoE layer) plus an overall row per predictor (``layer``
null), with the docs/design.md ``predict`` keys. Predictors whose inputs the trace lacks are listed in
``unavailable`` with the reason and the others still run. ``ctrl`` below 100.0% raises a loud
warning naming the failing layers and a likely cause (``warnings``, ``ctrl_failing_layers``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from replay import predictors as registry
from replay.core.phases import check_phase  # one --phase vocabulary for every verb
from replay.predictors import describe, parse_predictor  # noqa: F401 (describe: re-exported for the CLI and report)
from replay.predictors.base import Prediction
from replay.predictors.gate import CTRL, diagnose_ctrl
from replay.predictors.metrics import FRAME_SCHEMA, row_scores, score
from replay.predictors.training import make_split, token_index
from traces.format.errors import UserError
from traces.format.schema import PHASE_DECODE, PHASE_PREFILL
from traces.io.reader import Trace

# Every registered predictor (built-ins, then entry points and files added with --predictor-file),
# in print order; what each figure measures is the module's DESCRIPTION (:func:`describe`).
DEFAULT_PREDICTORS = None


@dataclass
class PredictResult:
    frame: pl.DataFrame  # FRAME_SCHEMA rows (+ ``horizon`` for a horizon curve)
    predictors: list[str]  # the ones evaluated, in print order
    unavailable: list[dict[str, str]] = field(default_factory=list)  # {predictor, reason}
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ctrl_failing_layers: list[int] | None = None  # None when ctrl did not run
    phase: str = "decode"
    width: int = 0
    k: int = 0
    routings: dict[int, int] = field(default_factory=dict)  # {layer: routings in the scored phase}
    train: str = "none"  # the held-out protocol in force (replay/predictors/training.py): "50%", "folds:5", ...
    train_text: str = ""  # one phrase: what was trained on, what scored ("" when nothing learns)
    in_sample: list[str] = field(default_factory=list)  # predictors scored on the tokens they learned from
    evaluated: int = 0  # routings of the scored phase held out for scoring (all of them when nothing learns)

    def overall(self) -> pl.DataFrame:
        return self.frame.filter(pl.col("layer").is_null())

    def per_layer(self) -> pl.DataFrame:
        return self.frame.filter(pl.col("layer").is_not_null())


def phase_mask(phase_col: np.ndarray, phase: str) -> np.ndarray:
    if phase == "decode":
        return phase_col == PHASE_DECODE
    if phase == "prefill":
        return phase_col == PHASE_PREFILL
    if phase == "all":
        return np.ones(phase_col.shape, dtype=bool)
    check_phase(phase)
    raise AssertionError(phase)


def expand(predictors: Sequence[str], horizons: Sequence[int], option: str = "--predictors") -> list[str]:
    """Predictor names in print order; a bare parametrised name (``stale-gate``) becomes one entry
    per horizon."""
    out: list[str] = []
    for p in predictors:
        fam, d = parse_predictor(p, option)
        names = [registry.full_name(fam, d)] if d is not None else (
            [registry.full_name(fam, h) for h in horizons] if getattr(registry.module(fam), "PARAM", None) else [fam])
        out += [n for n in names if n not in out]
    return out


def check_horizon(trace: Trace, d: int, option: str, family: str = "stale-gate") -> None:
    """Refuse a parameter ``d`` of ``family`` (a stale-gate horizon, a pair-table depth, a plugin's
    parameter) that its ``check`` hook says cannot run on ``trace`` (at once, not after a pass over
    the gate inputs)."""
    reason = registry.check(family, trace, d)
    if reason:
        raise UserError(f"{option} {registry.full_name(family, d)}: {reason.rstrip('.')}.")


def check_memory(trace: Trace, n_predictors: int, rank_w: int) -> None:
    """Refuse before allocating: per predictor an [R, w] ranking (+ weights, scores), and the
    static hot lists' per-(layer, expert) counts."""
    from traces.util.memory import check_fits

    need = n_predictors * trace.n_rows * rank_w * 16 + len(trace.moe_layers) * trace.n_expert * 24
    check_fits(need, f"{trace.path / 'trace.json'}: {trace.n_rows:,} routings x width {rank_w:,} for {n_predictors} "
                     f"predictor(s), n_expert {trace.n_expert:,} x {len(trace.moe_layers)} MoE layers")


def evaluate(trace: Trace, predictors: Sequence[str] | None = DEFAULT_PREDICTORS, horizons: Sequence[int] = (1,),
             width: int | None = None, phase: str = "decode", progress: Any = None, train: str | None = None,
             train_trace: Trace | None = None, seed: int = 0, byte_budget_mib: float | None = None) -> PredictResult:
    """Score ``predictors`` on ``trace``'s routings of ``phase`` at ``width`` (default top-k).

    ``predictors``: names (``None``: every registered predictor). ``progress``: optional tqdm-like
    object advanced once per part file read for gate inputs. ``train`` / ``train_trace`` / ``seed``:
    the held-out protocol (:mod:`replay.predictors.training`; default: the first 50% of each
    request's tokens train the learners and every predictor is scored on the rest, or no split when
    nothing learns). ``byte_budget_mib``: guesses read per routing for ``bytes_recall_pct``.
    """
    if predictors is None:
        predictors = registry.default_names()
    k, n_expert = trace.top_k, trace.n_expert
    width = k if width is None else int(width)
    if not 1 <= width <= n_expert:
        raise UserError(f"--width {width} must lie in 1..{n_expert} (the trace's n_expert).")
    bad = [h for h in horizons if int(h) < 1]
    if bad:
        raise UserError(f"--horizon {bad[0]}: a stale-gate horizon must be >= 1 (d=0 is ctrl).")
    names = expand(predictors, [int(h) for h in horizons])
    if not names:
        raise UserError("--predictors: no predictor named.")
    if byte_budget_mib is not None and not (np.isfinite(byte_budget_mib) and byte_budget_mib > 0):
        raise UserError(f"--byte-budget-mib {byte_budget_mib}: must be a positive number of MiB per routing.")
    n_budget = _budget_counts(trace, byte_budget_mib)
    rank_w = max(width, k, int(n_budget.max()) if n_budget is not None else 0)  # top-k, top-w, the byte budget's count
    check_memory(trace, len(names), rank_w)
    arr = trace.arrays(recorded=False)
    in_phase = phase_mask(arr.phase, phase)
    res = PredictResult(pl.DataFrame(schema=FRAME_SCHEMA), names, phase=phase, width=width, k=k)
    lay, cnt = np.unique(arr.layer[in_phase], return_counts=True)
    res.routings = {int(l): 0 for l in trace.moe_layers} | {int(a): int(b) for a, b in zip(lay, cnt)}
    if not in_phase.any():
        res.notes.append(f"the trace has no {phase} routings: nothing to score")

    preds: dict[str, Prediction] = {}
    requested: list[tuple[str, int | None]] = []
    why: dict[str, str | None] = {}
    for n in names:
        fam, d = parse_predictor(n)
        if fam not in why:
            why[fam] = registry.unavailable(fam, trace)
        if why[fam]:
            res.unavailable.append({"predictor": n, "reason": why[fam]})
        else:
            requested.append((fam, d))
    split = make_split(trace, arr, in_phase, train=train, train_trace=train_trace, seed=seed,
                       learns=any(registry.learns(f) for f, _ in requested),
                       phase_mask=lambda a: phase_mask(a.phase, phase))
    res.train, res.train_text = split.spec, split.text
    evaluated = split.evaluated
    res.evaluated = int(evaluated.sum())
    if split.in_sample:
        res.in_sample = [registry.full_name(f, d) for f, d in requested if registry.learns(f)]
    if phase != "decode" and ("static-hot-prompt", None) in requested:
        # it learns from the prompt: scoring prompt routings scores what it learned from
        res.in_sample.append("static-hot-prompt")
    preds.update(registry.run(trace, arr, in_phase, rank_w, requested, progress=progress, split=split))
    for fam in dict.fromkeys(f for f, _ in requested):
        msg = registry.note(fam, trace, arr, in_phase)
        if msg:
            res.notes.append(msg)
    frames = [score(preds[n], arr.experts, arr.weights, arr.layer, evaluated, trace.moe_layers, n_expert, width, phase)
              for n in names if n in preds]
    res.predictors = [n for n in names if n in preds]
    if frames:
        # prev-token, the reference every row's vs_prev_token compares with, computed when not asked
        # for: a predictor's figures do not depend on which others share the call (a sweep's cells)
        ref = preds.get("prev-token") or registry.run(trace, arr, in_phase, rank_w, [("prev-token", None)],
                                                      split=split)["prev-token"]
        res.frame = with_prefetch_scores(pl.concat(frames), trace, arr, evaluated, {**preds, "prev-token": ref}, res,
                                         n_budget, byte_budget_mib)
    if CTRL in preds:
        _check_ctrl(trace, res, trace.router_matrices())
    return res


EXTRA_SCHEMA = {
    "slot_acc_ci_low": pl.Float64, "slot_acc_ci_high": pl.Float64, "mass_ci_low": pl.Float64, "mass_ci_high": pl.Float64,
    "vs_prev_token_pp": pl.Float64, "vs_prev_token_ci_low": pl.Float64, "vs_prev_token_ci_high": pl.Float64,
    "vs_prev_token": pl.String, "lead_layers": pl.Int64, "unused_mib_per_token": pl.Float64,
    "byte_budget_mib": pl.Float64, "bytes_recall_pct": pl.Float64, "train": pl.String, "in_sample": pl.Boolean,
}


def _budget_counts(trace: Trace, byte_budget_mib: float | None) -> np.ndarray | None:
    """Experts of each layer (indexed by layer) whose bytes fit ``byte_budget_mib``, at most n_expert."""
    if byte_budget_mib is None:
        return None
    from traces.util.units import MIB

    eb = trace.expert_bytes.astype(np.float64)
    with np.errstate(divide="ignore"):
        n = np.where(eb > 0, np.floor(byte_budget_mib * MIB / np.maximum(eb, 1)), trace.n_expert)
    return np.minimum(n, trace.n_expert).astype(np.int64)


def with_prefetch_scores(frame: pl.DataFrame, trace: Trace, arr: Any, evaluated: np.ndarray,
                         preds: dict[str, Prediction], res: PredictResult, n_budget: np.ndarray | None,
                         byte_budget_mib: float | None) -> pl.DataFrame:
    """The overall rows gain (null on per-layer rows):

    - ``slot_acc_ci_low/high``, ``mass_ci_low/high``: 95% intervals of slot accuracy and weight-mass
      recall from the seeded block bootstrap of :mod:`replay.analyses.paired` over the evaluated
      tokens (whole requests when at least ``MIN_REQUESTS`` requests are scored), every predictor
      on the same resamples, cut to 0..100; ``vs_prev_token_pp`` (+ interval, ``vs_prev_token`` better | worse |
      tie): slot accuracy minus prev-token's on those resamples (each over its own scored routings);
    - ``lead_layers``: MoE layers ahead the guess exists (null for a check such as ctrl);
    - ``unused_mib_per_token``: MiB the top-w guesses name that the router did not choose, summed
      over scored routings, per evaluated token with a scored routing (what the guesses would read
      in vain if none were resident: residency is not modelled here, prefetch replays it);
    - ``bytes_recall_pct`` at ``byte_budget_mib``: guesses taken in rank order while their expert
      bytes fit the budget per routing; share of routed slots they name;
    - ``train`` (the protocol; "none" when nothing was split) and ``in_sample`` (True: a learner
      scored on the tokens it learned from; null for a predictor that learns nothing).
    """
    from replay.analyses.paired import MIN_REQUESTS, RESAMPLES, SEED, _interval, _resampled_sums, call
    from traces.util.units import MIB

    k = arr.experts.shape[1]
    tok, tok_req = token_index(arr)
    ev_tok = np.unique(tok[evaluated])
    unit_of = np.full(tok_req.shape[0], -1, np.int64)
    unit_of[ev_tok] = np.arange(ev_tok.size)
    _, req_units = np.unique(tok_req[ev_tok], return_inverse=True)
    requests = req_units.astype(np.int64) if ev_tok.size and int(req_units.max()) + 1 >= MIN_REQUESTS else None
    eb = trace.expert_bytes.astype(np.float64)
    names = res.predictors
    cols, extra = [], {}
    for n in [*names, *(["prev-token"] if "prev-token" not in names else [])]:
        p = preds[n]
        rows = np.flatnonzero(evaluated & p.scored)
        s = row_scores(p, arr.experts, arr.weights, rows, max(res.width, 1))
        u = unit_of[tok[rows]]
        has_mass = np.isfinite(s["mass_total"])
        per = np.zeros((ev_tok.size, 4), np.float64)
        np.add.at(per[:, 0], u, s["hits_k"].astype(np.float64))
        np.add.at(per[:, 1], u, float(k))
        np.add.at(per[:, 2], u[has_mass], s["mass_named"][has_mass])
        np.add.at(per[:, 3], u[has_mass], s["mass_total"][has_mass])
        cols.append(per)
        unused = float(((s["named_w"] - s["hits_w"]) * eb[arr.layer[rows]]).sum()) / MIB
        n_tok = np.unique(u).size
        b_recall = None
        if n_budget is not None and rows.size:
            hits = 0
            for layer in np.unique(arr.layer[rows]):
                lr = rows[arr.layer[rows] == layer]
                w = int(n_budget[layer])
                hits += int(row_scores(p, arr.experts, arr.weights, lr, w)["hits_w"].sum()) if w > 0 else 0
            b_recall = 100.0 * hits / (k * rows.size)
        if n not in names:
            continue  # the reference alone: its sums only
        fam, d = parse_predictor(n)
        mod = registry.module(fam)
        extra[n] = {
            "lead_layers": registry.ahead(fam, d) if getattr(mod, "PREFETCH", True) else None,
            "unused_mib_per_token": unused / n_tok if n_tok else None,
            "byte_budget_mib": byte_budget_mib, "bytes_recall_pct": b_recall,
            "train": res.train,
            "in_sample": (n in res.in_sample) if registry.learns(fam) or n in res.in_sample else None,
        }
    if ev_tok.size and names:
        draws, df = _resampled_sums(np.concatenate(cols, axis=1), np.random.default_rng(SEED), RESAMPLES, requests)
        order = [*names, *(["prev-token"] if "prev-token" not in names else [])]
        with np.errstate(divide="ignore", invalid="ignore"):
            acc = {n: (100.0 * draws[:, 4 * i] / draws[:, 4 * i + 1], 100.0 * draws[:, 4 * i + 2] / draws[:, 4 * i + 3])
                   for i, n in enumerate(order)}
        ov = {r["predictor"]: r for r in frame.filter(pl.col("layer").is_null()).iter_rows(named=True)}
        if "prev-token" not in ov:  # the reference's own point estimate (its rows are not in the frame)
            c = cols[-1].sum(axis=0)
            ov["prev-token"] = {"slot_acc_pct": 100.0 * c[0] / c[1] if c[1] else None}
        for n in names:
            e = extra[n]
            for key, col, j in (("slot_acc", "slot_acc_pct", 0), ("mass", "mass_pct", 1)):
                pt = ov[n][col]
                iv = _interval(pt, acc[n][j], ev_tok.size, df) if pt is not None else None
                # a share's interval is cut to its domain 0..100 (a short trace's t quantile can reach past it)
                ok = iv is not None and np.isfinite(iv.low) and np.isfinite(iv.high)
                e[f"{key}_ci_low"], e[f"{key}_ci_high"] = (max(0.0, iv.low), min(100.0, iv.high)) if ok else (None, None)
            pv = ov.get("prev-token")
            if pv is not None and n != "prev-token" and ov[n]["slot_acc_pct"] is not None and pv["slot_acc_pct"] is not None:
                dv = _interval(ov[n]["slot_acc_pct"] - pv["slot_acc_pct"], acc[n][0] - acc["prev-token"][0], ev_tok.size, df)
                e.update(vs_prev_token_pp=dv.delta, vs_prev_token_ci_low=dv.low, vs_prev_token_ci_high=dv.high,
                         vs_prev_token=call(dv))
    for e in extra.values():
        for c in ("slot_acc_ci_low", "slot_acc_ci_high", "mass_ci_low", "mass_ci_high"):
            if e.get(c) is not None and not np.isfinite(e[c]):
                e[c] = None
    out = []
    for r in frame.iter_rows(named=True):
        add = extra.get(r["predictor"], {}) if r["layer"] is None else {}
        out.append({**r, **{c: add.get(c) for c in EXTRA_SCHEMA}})
    return pl.DataFrame(out, schema={**FRAME_SCHEMA, **EXTRA_SCHEMA, **{c: frame.schema[c] for c in frame.columns
                                                                        if c not in FRAME_SCHEMA}})


def _check_ctrl(trace: Trace, res: PredictResult, mats: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
    """ctrl must reproduce every routing; anything else is said loudly, with the layers and a cause."""
    c = res.frame.filter(pl.col("predictor") == CTRL)
    per = c.filter(pl.col("layer").is_not_null() & (pl.col("scored") > 0))
    failing = per.filter(pl.col("whole_acc_pct") < 100.0)["layer"].to_list()
    res.ctrl_failing_layers = failing
    overall = c.filter(pl.col("layer").is_null())
    if not failing:
        if int(overall["scored"][0]) == 0:
            res.notes.append("ctrl scored no routing, so the trace's consistency is unchecked")
        return
    slot = overall["slot_acc_pct"][0]
    whole = overall["whole_acc_pct"][0]
    cause = diagnose_ctrl(trace, failing, mats)
    res.warnings.append(
        f"WARNING: ctrl reads {slot:.3f}% slot / {whole:.3f}% whole-routing accuracy, not 100.0%: "
        f"{len(failing)} layer(s) ({', '.join(map(str, failing))}) do not reproduce their own routings from their "
        "own router and gate input. This is a defect of the trace or of this tool; stale-gate and ctrl figures "
        f"for those layers are not trustworthy. Likely cause: {cause}.")


def horizon_curve(trace: Trace, max_horizon: int, width: int | None = None, phase: str = "decode",
                  progress: Any = None) -> PredictResult:
    """stale-gate[d] for d = 1..max_horizon in one pass over the gate inputs; ``horizon`` column added."""
    if max_horizon < 1:
        raise UserError(f"--horizon-curve {max_horizon} must be >= 1.")
    res = evaluate(trace, ["stale-gate"], horizons=range(1, max_horizon + 1), width=width, phase=phase,
                   progress=progress)
    res.frame = res.frame.with_columns(
        pl.col("predictor").str.extract(r"\[(\d+)\]").cast(pl.Int64).alias("horizon"))
    return res
