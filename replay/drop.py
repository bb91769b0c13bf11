"""Drop-cold what-ifs against the run as it happened (static mode) and the static top-k cut.

Drop-cold F skips a routed expert when it is a cache miss and its router weight is below
``F / k``; the routing's top-weighted expert is never skipped. *Static* mode asks: on this
recorded run, with the engine's own residency, what would that have saved and discarded?

Bytes are counted as the engine recorded them (per-slot ``read_bytes``): inside one load (one
(batch, layer) group) an expert is read once, by its first miss; its bytes are saved only if
*every* slot that routes it in that load is dropped. A dropped repeat alone saves nothing (the
read happened for another token), which is what makes prefill savings small.

Weight mass is the sum of applied router weights; dropping loses it. Mass is a proxy, not a
quality measurement: it says nothing about perplexity or task accuracy. Bytes are not time
(see the cost model).
"""

from __future__ import annotations

import numpy as np
import polars as pl

from traces.errors import UserError
from traces.reader import RoutingArrays, Trace

MIB = float(1 << 20)
PHASES = {"decode": (1,), "prefill": (0,), "all": (0, 1)}


def _check_fracs(fracs: list[float]) -> None:
    for f in fracs:
        if not (f >= 0 and np.isfinite(f)):
            raise UserError(f"--fracs: {f} is not a non-negative fraction (F in 'weight < F / k').")


def phase_rows(a: RoutingArrays, phase: str) -> np.ndarray:
    if phase not in PHASES:
        raise UserError(f"--phase {phase!r} is not one of decode, prefill, all.")
    return np.isin(a.phase, PHASES[phase])


def top_weight_slot(weights: np.ndarray) -> np.ndarray:
    """Per routing, the slot holding the largest weight (ties: the lower slot)."""
    return np.argmax(weights, axis=1)


def load_ids(a: RoutingArrays, rows: np.ndarray) -> np.ndarray:
    """A dense id per (batch, layer) group for the selected rows."""
    key = a.batch[rows].astype(np.int64) * 65536 + a.layer[rows].astype(np.int64)
    _, inv = np.unique(key, return_inverse=True)
    return inv.reshape(-1)


def saved_bytes(load: np.ndarray, experts: np.ndarray, read_bytes: np.ndarray, dropped: np.ndarray) -> float:
    """Bytes not read: per (load, expert), its recorded reads count only if every slot routing it
    in that load is dropped."""
    n_expert = int(experts.max()) + 1 if experts.size else 1
    key = (np.repeat(load, experts.shape[1]) * n_expert + experts.reshape(-1)).astype(np.int64)
    _, inv = np.unique(key, return_inverse=True)
    n = int(inv.max()) + 1 if inv.size else 0
    kept = np.bincount(inv, weights=(~dropped.reshape(-1)).astype(np.float64), minlength=n)
    rb = np.bincount(inv, weights=read_bytes.reshape(-1).astype(np.float64), minlength=n)
    return float(rb[kept == 0].sum())


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
        "routings_dropped_pct": float(dropped.any(axis=1).sum()) / n * 100.0 if n else None,
        "slots_dropped": int(dropped.sum()),
        "survivors_mean": float(survivors.mean()) if n else None,
    }
    for s in range(1, k + 1):
        row[f"survivors_{s}_pct"] = float(hist[s]) / n * 100.0 if n else None
    return row


def static_drop(trace: Trace, fracs: list[float], phase: str = "decode",
                keep_ks: list[int] | None = None) -> pl.DataFrame:
    """Static drop-cold rows (mode ``static``, one per F) and static top-k cut rows (mode
    ``static-k``, one per keep_k in k-1..1 unless given), on the recorded residency."""
    _check_fracs(fracs)
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
    for f in fracs:
        dropped = (res == 0) & (w < f / k) & ~top
        out.append(_summary("static", float(f), None, phase, dropped, w, total_read, saved_bytes(load, ex, rb, dropped), k))
    if keep_ks is None:
        keep_ks = list(range(k - 1, 0, -1))
    for kk in keep_ks:
        if not 1 <= kk < k:
            raise UserError(f"keep_k {kk} must lie in 1..{k - 1} (the trace routes top-{k}).")
        dropped = np.zeros_like(ex, dtype=bool)
        dropped[:, kk:] = True  # every slot at rank >= keep_k loses its weight, hit or miss
        out.append(_summary("static-k", None, kk, phase, dropped, w, total_read, saved_bytes(load, ex, rb, dropped), k))
    frame = pl.DataFrame(out)
    return with_equal_read_comparison(frame)


def with_equal_read_comparison(frame: pl.DataFrame) -> pl.DataFrame:
    """Add ``static_k_mass_lost_at_equal_io_pct`` to drop-cold rows: the mass the static top-k
    cut would lose for the same share of reads avoided (linear between its keep_k points; null
    outside their range)."""
    sk = frame.filter(pl.col("mode") == "static-k").sort("io_saved_pct")
    xs = np.array([0.0] + sk["io_saved_pct"].fill_null(0.0).to_list())
    ys = np.array([0.0] + sk["mass_lost_pct"].fill_null(0.0).to_list())
    vals = []
    for mode, io in zip(frame["mode"].to_list(), frame["io_saved_pct"].to_list()):
        if mode == "static-k" or io is None or sk.height == 0 or io > xs.max():
            vals.append(None)
        else:
            vals.append(float(np.interp(io, xs, ys)))
    return frame.with_columns(pl.Series("static_k_mass_lost_at_equal_io_pct", vals, dtype=pl.Float64))
