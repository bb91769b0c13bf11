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
from replay.predictors.metrics import FRAME_SCHEMA, score
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


def check_horizon(trace: Trace, d: int, option: str) -> None:
    """Refuse a stale-gate horizon that cannot score anything on ``trace`` (at once, not after a
    pass over the gate inputs)."""
    reason = registry.check("stale-gate", trace, d)
    if reason:
        raise UserError(f"{option}: {reason}")


def check_memory(trace: Trace, n_predictors: int, rank_w: int) -> None:
    """Refuse before allocating: per predictor an [R, w] ranking (+ weights, scores), and the
    static hot lists' per-(layer, expert) counts."""
    from traces.util.memory import check_fits

    need = n_predictors * trace.n_rows * rank_w * 16 + len(trace.moe_layers) * trace.n_expert * 24
    check_fits(need, f"{trace.path / 'trace.json'}: {trace.n_rows:,} routings x width {rank_w:,} for {n_predictors} "
                     f"predictor(s), n_expert {trace.n_expert:,} x {len(trace.moe_layers)} MoE layers")


def evaluate(trace: Trace, predictors: Sequence[str] | None = DEFAULT_PREDICTORS, horizons: Sequence[int] = (1,),
             width: int | None = None, phase: str = "decode", progress: Any = None) -> PredictResult:
    """Score ``predictors`` on ``trace``'s routings of ``phase`` at ``width`` (default top-k).

    ``predictors``: names (``None``: every registered predictor). ``progress``: optional tqdm-like
    object advanced once per part file read for gate inputs.
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
    check_memory(trace, len(names), max(width, k))
    arr = trace.arrays(recorded=False)
    in_phase = phase_mask(arr.phase, phase)
    rank_w = max(width, k)  # slot/whole accuracy need the top-k, recall/precision/mass the top-w
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
    preds.update(registry.run(trace, arr, in_phase, rank_w, requested, progress=progress))
    for fam in dict.fromkeys(f for f, _ in requested):
        note = getattr(registry.module(fam), "note", None)
        msg = note(trace, arr, in_phase) if note is not None else None
        if msg:
            res.notes.append(msg)
    frames = [score(preds[n], arr.experts, arr.weights, arr.layer, in_phase, trace.moe_layers, n_expert, width, phase)
              for n in names if n in preds]
    if frames:
        res.frame = pl.concat(frames)
    res.predictors = [n for n in names if n in preds]
    if CTRL in preds:
        _check_ctrl(trace, res, trace.router_matrices())
    return res


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
