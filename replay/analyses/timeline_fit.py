"""The timeline's device parameters: a profile file, a named preset, or a fit on a run's recorded
metrics (docs/design.md, "Timeline").

A profile file is a JSON object (read with traces.util.bounded_json, never modified)::

    {"lanes": 4, "lane_mib_s": 800, "read_latency_ms": 0.08, "compute_ms_per_layer": 1.8,
     "overlap": true, "expert_share": 0.5, "token_overhead_ms": 8, "serial_ms_per_mib": 0}

(the last four optional: overlap true, expert share 0, no overhead, no serial cost; the meaning of
each is in replay.analyses.timeline). A preset is one of
:data:`PRESETS`: an assumption about a class of device, named ``preset:NAME`` wherever it is printed,
never a measurement.

The fit (:func:`fit_profile`) uses the engine's per-token metrics (``wall_ms``, ``io_ms`` summed over
lanes, ``compute_ms``, ``stall_ms``, ``mgmt_ms``) and the LRU replay at the recorded budget (which
reproduces the engine's misses): decoded tokens are split into alternating blocks of
:data:`BLOCK` tokens, even blocks fitted, odd blocks held out (drift within the run falls on both
sides). On the fitted tokens: per-read latency and per-lane bandwidth from ``io_ms = latency x
reads + MiB x 1000 / lane_mib_s`` (least squares, no intercept: io_ms is read time summed over
lanes); compute per layer = mean ``compute_ms`` / MoE layers; the serial cost from ``mgmt_ms = overhead
+ serial_ms_per_mib x MiB``; then lanes (1..32), the expert share of compute (0, 0.25 .. 1) and
overlap (on, off) by the smallest mean absolute error of the timeline's ``wall_ms`` (ties: the
first in that order, overlap on first). The held-out tokens give the errors reported (:func:`heldout`),
beside the linear model ``wall_ms = a + b x MiB`` fitted on the same tokens.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from replay.analyses.cost_sense import MAX_FLASH_MIB_S, MAX_MS
from replay.analyses.timeline import T_IO, T_STALL, T_WALL, Profile, time_replay
from traces.format.errors import UserError
from traces.util.units import MIB

BLOCK = 8
LANES_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
SHARE_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)
MAX_LANES = 1024

# Assumptions about classes of devices, not measurements: every figure under one says "preset:NAME".
PRESETS: dict[str, dict[str, Any]] = {
    # a 2025-26 phone: UFS 4 flash, a few read threads, an 8-core CPU computing a ~3B-active MoE
    "phone-ufs4": {"expert_share": 0.5, "lanes": 4, "lane_mib_s": 900.0, "read_latency_ms": 0.08, "compute_ms_per_layer": 2.0,
                   "overlap": True, "token_overhead_ms": 10.0, "serial_ms_per_mib": 0.0},
    # the same phone with reads serial with compute (no overlap, one lane)
    "phone-serial": {"expert_share": 0.5, "lanes": 1, "lane_mib_s": 2500.0, "read_latency_ms": 0.08, "compute_ms_per_layer": 2.0,
                     "overlap": False, "token_overhead_ms": 10.0, "serial_ms_per_mib": 0.0},
    # a discrete GPU streaming experts over PCIe 4.0 x16 with copy engines to spare
    "gpu-pcie4": {"expert_share": 0.7, "lanes": 2, "lane_mib_s": 12000.0, "read_latency_ms": 0.01, "compute_ms_per_layer": 0.15,
                  "overlap": True, "token_overhead_ms": 2.0, "serial_ms_per_mib": 0.0},
}
FIELDS = ("lanes", "lane_mib_s", "read_latency_ms", "compute_ms_per_layer", "overlap", "expert_share",
          "token_overhead_ms", "serial_ms_per_mib")
REQUIRED = FIELDS[:4]


def _number(where: str, d: dict, key: str, lo: float, hi: float, *, integer: bool = False, positive: bool = False) -> float:
    v = d[key]
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not math.isfinite(float(v)) or not (lo <= v <= hi) or (positive and v <= 0):
        kind = "an integer" if integer else "a number"
        raise UserError(f"{where}: {key} {v!r} is not {kind} in {'(' if positive else '['}{lo:g}, {hi:g}].")
    return v


def profile_from(d: Any, where: str, name: str, source: str) -> Profile:
    """A :class:`Profile` from a mapping, every field checked (one sentence naming ``where``)."""
    if not isinstance(d, dict):
        raise UserError(f"{where}: a device profile is a JSON object with {', '.join(REQUIRED)}.")
    unknown = sorted(set(d) - set(FIELDS))
    if unknown:
        raise UserError(f"{where}: unknown device-profile key {unknown[0]!r} (known: {', '.join(FIELDS)}).")
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        raise UserError(f"{where}: the device profile has no {missing[0]} (needed: {', '.join(REQUIRED)}).")
    overlap = d.get("overlap", True)
    if not isinstance(overlap, bool):
        raise UserError(f"{where}: overlap {overlap!r} is not true or false.")
    return Profile(
        lanes=int(_number(where, d, "lanes", 1, MAX_LANES, integer=True)),
        lane_mib_s=float(_number(where, d, "lane_mib_s", 0, MAX_FLASH_MIB_S, positive=True)),
        read_latency_ms=float(_number(where, d, "read_latency_ms", 0, MAX_MS)),
        compute_ms_per_layer=float(_number(where, d, "compute_ms_per_layer", 0, MAX_MS)),
        overlap=overlap,
        expert_share=float(_number(where, {**d, "expert_share": d.get("expert_share", 0.0)}, "expert_share", 0, 1)),
        token_overhead_ms=float(_number(where, {**d, "token_overhead_ms": d.get("token_overhead_ms", 0.0)},
                                        "token_overhead_ms", 0, MAX_MS)),
        serial_ms_per_mib=float(_number(where, {**d, "serial_ms_per_mib": d.get("serial_ms_per_mib", 0.0)},
                                        "serial_ms_per_mib", 0, MAX_MS)),
        name=name, source=source)


def load_profile(spec: str | Path) -> Profile:
    """``--device-profile``: a preset's name (:data:`PRESETS`) or a JSON file."""
    from traces.io.atomic import note_input
    from traces.util.bounded_json import read_bounded

    s = str(spec)
    if s in PRESETS:
        return profile_from(PRESETS[s], f"preset {s}", f"preset:{s}", "preset")
    p = Path(s)
    note_input(p)
    if not p.is_file():
        raise UserError(f"--device-profile {s!r}: no such file, and not a preset ({', '.join(PRESETS)}).")
    obj = read_bounded(p, what="device-profile", hint=" (expected a JSON object: lanes, lane_mib_s, read_latency_ms, "
                                                        "compute_ms_per_layer, ...)")
    return profile_from(obj, str(p), p.name, "file")


# -- the fit -----------------------------------------------------------------------------------

def recorded_series(trace, metrics=None) -> dict[str, np.ndarray]:
    """Per decoded token, the engine's recorded metrics (ms); ``metrics``: a frame given instead of
    the trace's own (as ``cost fit --metrics``)."""
    from replay.analyses.cost_model import recorded_token_features

    feats = recorded_token_features(trace, metrics)  # checks the metrics belong to this run
    m = metrics if metrics is not None else trace.metrics()
    out = {"wall_ms": feats["wall_ms"].to_numpy().astype(np.float64)}
    for c in ("io_ms", "compute_ms", "stall_ms", "mgmt_ms"):
        if c in m.columns:
            v = m[c].cast(float).to_numpy().astype(np.float64)
            if not np.all(np.isfinite(v)) or (v < 0).any() or (v > MAX_MS).any():
                raise UserError(f"{trace.path}: recorded {c} holds a value that is not a time in [0, 1 day].")
            out[c] = v
    if "compute_ms" not in out:
        raise UserError(f"{trace.path}: its metrics record no compute_ms per token; the timeline needs it to fit compute "
                        "(pass --device-profile FILE instead).")
    return out


def split(n: int, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Alternating blocks of ``block`` tokens: (fitted, held out) boolean masks."""
    fit = (np.arange(n) // block) % 2 == 0
    return fit, ~fit


def _lsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    c, *_ = np.linalg.lstsq(X, y, rcond=None)
    return c


def _baseline(trace):
    from replay.core.simulate import loads_of, replay

    budget = trace.recorded.get("budget_mib")
    if budget is None:
        raise UserError(f"{trace.path}: records no cache budget; the fit replays the engine's cache at it.")
    loads = loads_of(trace)
    return loads, replay(loads, "lru", float(budget), slots=True)


def fit_profile(trace, block: int = BLOCK, metrics=None) -> tuple[Profile, dict[str, Any]]:
    """Fit the timeline's parameters on ``trace``'s recorded metrics (module docstring). Returns the
    profile and its held-out scores (:func:`heldout`)."""
    rec = recorded_series(trace, metrics)
    loads, res = _baseline(trace)
    dec = loads.batch_phase == 1
    reads = (res.bacc[dec, 0] - res.bacc[dec, 1]).astype(np.float64)
    mib = res.bacc[dec, 2].astype(np.float64) / MIB
    n = rec["wall_ms"].shape[0]
    if reads.shape[0] != n:
        raise UserError(f"{trace.path}: the replay has {reads.shape[0]} decode steps, the metrics {n} tokens.")
    if n < 2 * block:
        raise UserError(f"{trace.path}: only {n} decoded tokens; the timeline fit needs at least {2 * block}.")
    fit, _ = split(n, block)
    L = len(loads.moe_layers)
    notes = []
    if "io_ms" in rec:
        c = _lsq(np.column_stack([reads[fit], mib[fit]]), rec["io_ms"][fit])
        if c[0] < 0 or c[1] <= 0:
            c = np.array([0.0, float(_lsq(mib[fit, None], rec["io_ms"][fit])[0])])
            notes.append("per-read latency fitted negative: set to 0, bandwidth fitted alone")
        lat, ms_per_mib = float(c[0]), float(c[1])
    else:
        raise UserError(f"{trace.path}: its metrics record no io_ms per token; the timeline needs it to fit the reads "
                        "(pass --device-profile FILE instead).")
    if ms_per_mib <= 0:
        raise UserError(f"{trace.path}: recorded io_ms does not grow with the bytes read; no read bandwidth can be fitted.")
    comp = float(rec["compute_ms"][fit].mean()) / L
    if "mgmt_ms" in rec:
        a, s = (float(x) for x in _lsq(np.column_stack([np.ones(int(fit.sum())), mib[fit]]), rec["mgmt_ms"][fit]))
        if s < 0:
            a, s = float(rec["mgmt_ms"][fit].mean()), 0.0
        if a < 0:
            a, s = 0.0, float(_lsq(mib[fit, None], rec["mgmt_ms"][fit])[0])
    else:
        rest = rec["wall_ms"] - rec["compute_ms"] - rec.get("stall_ms", 0.0)
        a, s = max(0.0, float(rest[fit].mean())), 0.0
        notes.append("no mgmt_ms recorded: the token overhead is wall - compute - stall on the fitted tokens")
    best = None
    for overlap in (True, False):
        for share in SHARE_GRID:
            for lanes in LANES_GRID:
                p = Profile(lanes=lanes, lane_mib_s=1000.0 / ms_per_mib, read_latency_ms=lat, compute_ms_per_layer=comp,
                            overlap=overlap, expert_share=share, token_overhead_ms=a, serial_ms_per_mib=s, name="fitted",
                            source="fitted")
                wall = time_replay(loads, res, p).tok[:, T_WALL]
                err = float(np.abs(wall[fit] - rec["wall_ms"][fit]).mean())
                if best is None or err < best[0] - 1e-9:
                    best = (err, p)
    prof = best[1]
    scores = heldout(trace, prof, block, loads=loads, res=res, rec=rec)
    scores["notes"] = notes
    return prof, scores


def _stats(pred: np.ndarray, rec: np.ndarray) -> dict[str, float | None]:
    err = pred - rec
    corr = float(np.corrcoef(pred, rec)[0, 1]) if pred.size > 1 and pred.std() > 0 and rec.std() > 0 else None
    return {"mean_err_ms": float(err.mean()), "mape_pct": float(np.mean(np.abs(err) / rec) * 100.0) if (rec > 0).all() else None,
            "corr": corr}


def heldout(trace, prof: Profile, block: int = BLOCK, *, loads=None, res=None, rec=None) -> dict[str, Any]:
    """The timeline (``prof``) and the linear model, both fitted on the even blocks, scored on the
    held-out odd blocks of decoded tokens: per figure mean error (ms, signed), per-token MAPE and
    correlation across tokens; the held-out run's recorded and predicted tok/s, and whether the
    recorded one lies within the held-out error (the 95% interval of the mean per-token error,
    t over the held-out blocks' means)."""
    from replay.analyses.paired import t975

    rec = rec if rec is not None else recorded_series(trace)
    if res is None:
        loads, res = _baseline(trace)
    n = rec["wall_ms"].shape[0]
    fit, held = split(n, block)
    tl = time_replay(loads, res, prof)
    dec = loads.batch_phase == 1
    mib = res.bacc[dec, 2].astype(np.float64) / MIB
    X = np.column_stack([np.ones(n), mib])
    lin = X @ _lsq(X[fit], rec["wall_ms"][fit])
    out: dict[str, Any] = {"profile": prof.row(), "tokens_fit": int(fit.sum()), "tokens_heldout": int(held.sum()),
                           "block_tokens": block, "split": f"alternating blocks of {block} decoded tokens: even fitted, odd held out"}
    pred = {"wall_ms": tl.tok[:, T_WALL], "io_ms": tl.tok[:, T_IO], "stall_ms": tl.tok[:, T_STALL]}
    for key in ("wall_ms", "io_ms", "stall_ms"):
        if key in rec:
            out[f"timeline_{key}"] = _stats(pred[key][held], rec[key][held])
    out["linear_wall_ms"] = _stats(lin[held], rec["wall_ms"][held])
    blocks = (np.arange(n) // block)[held]
    for name, p in (("timeline", pred["wall_ms"]), ("linear", lin)):
        err = (p - rec["wall_ms"])[held]
        bm = np.array([err[blocks == b].mean() for b in np.unique(blocks)])
        half = t975(bm.size - 1) * float(bm.std(ddof=1)) / math.sqrt(bm.size) if bm.size > 1 else float("nan")
        rec_tok_s = 1000.0 / float(rec["wall_ms"][held].mean())
        pred_tok_s = 1000.0 / float(p[held].mean())
        out[f"{name}_heldout_tok_s"] = pred_tok_s
        out[f"{name}_mean_err_ci95_ms"] = half
        out[f"{name}_reproduces_tok_s"] = bool(abs(float(err.mean())) <= half) if math.isfinite(half) else None
        out["recorded_heldout_tok_s"] = rec_tok_s
    t_mae = float(np.abs(pred["wall_ms"][held] - rec["wall_ms"][held]).mean())
    l_mae = float(np.abs(lin[held] - rec["wall_ms"][held]).mean())
    out["timeline_wall_mae_ms"], out["linear_wall_mae_ms"] = t_mae, l_mae
    out["better"] = "timeline" if t_mae < l_mae else "linear" if l_mae < t_mae else "tie"
    return out
