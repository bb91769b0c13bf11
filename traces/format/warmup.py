"""Engine warm-up rows found (docs/design.md, "Warm-up rows"): an engine's profiling or dummy pass
(vLLM's profile run, a CUDA-graph capture) routes made-up inputs, and its rows look like routing.

A token is *warm-up-like* when its routing is constant across layers (the same expert set at every
MoE layer it routes, with at least two MoE layers) or its weights are exactly uniform (every slot
the same finite weight at every layer, with k >= 2). A real router does either by chance about
never; a dummy pass does both. A *warm-up run* is at least :data:`MIN_RUN` consecutive warm-up-like
tokens in trace order (batch, then position). Runs are reported with their tokens and rows; an
import keeps them and marks the trace unless asked to drop them (``--drop-warmup``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from traces.util.rows import unique_rows

MIN_RUN = 8  # consecutive tokens: 8 tokens of one set at every layer by chance is below 1e-9 on any real model


def _set_hash(experts: np.ndarray) -> np.ndarray:
    """An order-free hash of each row's expert set (equal sets, equal hashes)."""
    ids = experts.astype(np.uint64)
    x = (ids + np.uint64(0x9E3779B97F4A7C15)) * np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(31)
    x *= np.uint64(0x94D049BB133111EB)
    return x.sum(axis=1, dtype=np.uint64)


def find_runs(*, turn: np.ndarray, step: np.ndarray, layer: np.ndarray, experts: np.ndarray, weights: np.ndarray,
              order: np.ndarray | None = None, request: np.ndarray | None = None,
              moe_layers: int) -> tuple[list[dict[str, Any]], np.ndarray]:
    """(runs, warm-up row mask). Rows may come in any order; ``order`` ranks them in trace order
    (default: as given). Each run: ``tokens``, ``rows`` (row indices as given, first and last),
    ``request``, ``turn``, ``steps`` (first, last), ``constant`` and ``uniform`` (how many of its
    tokens showed each sign)."""
    n = step.shape[0]
    mask = np.zeros(n, bool)
    k = experts.shape[1] if experts.ndim == 2 else 0
    if n == 0 or (moe_layers < 2 and k < 2):
        return [], mask
    req = np.zeros(n, np.int64) if request is None else np.asarray(request, np.int64)
    keys = np.stack([req, np.asarray(turn, np.int64), np.asarray(step, np.int64)], axis=1)
    uniq, inv = unique_rows(keys)  # np.unique(keys, axis=0, return_inverse=True), by one lexsort
    T = uniq.shape[0]
    h = _set_hash(experts)
    hmin = np.full(T, np.iinfo(np.uint64).max, np.uint64)
    hmax = np.zeros(T, np.uint64)
    np.minimum.at(hmin, inv, h)
    np.maximum.at(hmax, inv, h)
    nrows = np.bincount(inv, minlength=T)
    constant = (hmin == hmax) & (nrows >= 2) if moe_layers >= 2 else np.zeros(T, bool)
    if k >= 2:
        w = np.asarray(weights, np.float64)
        row_uniform = np.isfinite(w).all(axis=1) & (w == w[:, :1]).all(axis=1)
        uniform = np.bincount(inv, weights=row_uniform.astype(np.float64), minlength=T) == nrows
    else:
        uniform = np.zeros(T, bool)
    warm = constant | uniform
    if not warm.any():
        return [], mask
    rank = np.arange(n) if order is None else np.asarray(order)
    first = np.full(T, np.iinfo(np.int64).max, np.int64)
    np.minimum.at(first, inv, rank.astype(np.int64))
    tok_order = np.argsort(first, kind="stable")
    w_in_order = warm[tok_order]
    runs: list[dict[str, Any]] = []
    i = 0
    while i < T:
        if not w_in_order[i]:
            i += 1
            continue
        j = i
        while j + 1 < T and w_in_order[j + 1]:
            j += 1
        if j - i + 1 >= MIN_RUN:
            toks = tok_order[i:j + 1]
            rows = np.flatnonzero(np.isin(inv, toks))
            mask[rows] = True
            r0, t0, s0 = (int(x) for x in uniq[toks[0]])
            _, _, s1 = (int(x) for x in uniq[toks[-1]])
            runs.append({"tokens": int(toks.size), "rows": [int(rows.min()), int(rows.max())],
                         "request": r0 if request is not None else None, "turn": t0, "steps": [s0, s1],
                         "constant": int(constant[toks].sum()), "uniform": int(uniform[toks].sum())})
        i = j + 1
    return runs, mask


def describe(runs: list[dict[str, Any]], *, rows_of: Any = None, label: str = "rows") -> str:
    """One phrase per run: 'tokens 0-2047 (2,048 tokens, rows 0-16383; 2,048 constant across
    layers, 2,048 with uniform weights)'. ``rows_of(i)`` names a row index as the source does."""
    out = []
    for r in runs:
        a, b = r["rows"]
        where = f"{label} {rows_of(a) if rows_of else a}-{rows_of(b) if rows_of else b}"
        who = (f"request {r['request']}, " if r["request"] is not None else "") + (f"turn {r['turn']}, " if r["turn"] else "")
        out.append(f"{who}steps {r['steps'][0]}-{r['steps'][1]} ({r['tokens']:,} tokens, {where}; {r['constant']:,} "
                   f"routed alike at every layer, {r['uniform']:,} with exactly uniform weights)")
    return "; ".join(out)
