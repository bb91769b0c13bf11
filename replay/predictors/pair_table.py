"""``pair-table[d]``: from the experts chosen at MoE layer l-d in the current token, the experts
most likely at layer l (a cross-layer pair table; d = 1: one layer ahead).

Learned on the training split only (``LEARNS``; replay/predictors/training.py): for every training
token and MoE layer l with a routing at l-d, ``C[l][s, t]`` counts the tokens that chose s at l-d
and t at l, ``N[l][s]`` the tokens that chose s at l-d (with a routing at l). A routing at l is
ranked by

    score(t) = sum over s chosen at l-d in this token (router rank order) of (C[l][s, t] + 1) / (N[l][s] + E)

(add-one smoothing: an s never seen in training gives every t the same 1/E, so it changes no
ranking), ties broken by t's count at l over the training routings, then by expert id. The sum
runs in slot order in float64, so the ranking is reproducible bit for bit.

Unscored: the first d MoE layers (no source), a routing whose token has no routing at l-d, and a
layer the training split has no pair for.
"""

from __future__ import annotations

import numpy as np

from replay.predictors.base import NONE, Prediction
from traces.io.reader import RoutingArrays

NAME = "pair-table"
DESCRIPTION = "the experts that followed this token's layer l-{d} experts in the training tokens (pair counts, add-one smoothing)"
PARAM = "d"
LEARNS = True
ALPHA = 1.0  # add-one (Laplace) smoothing of P(t at l | s at l-d)


def param_problem(d: int) -> str | None:
    return "the pair-table depth must be >= 1" if d < 1 else None


def check(trace, d: int) -> str | None:
    n = len(trace.moe_layers)
    if d >= n:
        return (f"pair-table depth {d} scores nothing on {trace.path}, which has {n} MoE layer(s); a depth must be "
                f"below {n}.")
    return None


def ahead(d: int) -> int:
    return d


def _layer_index(trace, arr: RoutingArrays) -> np.ndarray:
    lut = np.full(max(trace.moe_layers) + 1, -1, np.int64)
    lut[list(trace.moe_layers)] = np.arange(len(trace.moe_layers))
    return lut[arr.layer.astype(np.int64)]


def source_rows(trace, arr: RoutingArrays, d: int, rows: np.ndarray) -> np.ndarray:
    """For each row of ``rows`` (indices), the row of the same token at the MoE layer d places
    earlier among ``rows``' token's rows in ``arr`` (any row of ``arr``), or -1."""
    from replay.predictors.training import token_index

    n_moe = len(trace.moe_layers)
    tok, _ = token_index(arr)
    lidx = _layer_index(trace, arr)
    at = np.full((int(tok.max()) + 1 if tok.size else 0) * n_moe, -1, np.int64)
    order = np.arange(arr.n_rows)
    at[tok * n_moe + lidx] = order  # one row per (token, layer) in a valid trace
    src = np.full(rows.size, -1, np.int64)
    li = lidx[rows]
    ok = li >= d
    src[ok] = at[tok[rows[ok]] * n_moe + li[ok] - d]
    return src


def fit(trace, training, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(C [n_moe, E, E], N [n_moe, E], M [n_moe, E]) int64 counts over the training rows."""
    arr, E, n_moe = training.arr, trace.n_expert, len(trace.moe_layers)
    C = np.zeros((n_moe, E, E), np.int64)
    N = np.zeros((n_moe, E), np.int64)
    M = np.zeros((n_moe, E), np.int64)
    rows = np.flatnonzero(training.rows)
    if not rows.size:
        return C, N, M
    lidx = _layer_index(training.trace, arr)
    ex = arr.experts
    ok = ex[rows] >= 0
    np.add.at(M, (np.repeat(lidx[rows], ex.shape[1])[ok.ravel()], ex[rows][ok]), 1)
    src = source_rows(training.trace, arr, d, rows)
    keep = src >= 0
    keep[keep] = training.rows[src[keep]]  # the source routing is a training routing too (same token)
    r, q = rows[keep], src[keep]
    k = ex.shape[1]
    j = np.repeat(lidx[r], k * k)
    s = np.repeat(ex[q], k, axis=1).ravel()
    t = np.tile(ex[r], (1, k)).ravel()
    good = (s >= 0) & (t >= 0)
    np.add.at(C, (j[good], s[good], t[good]), 1)
    js = np.repeat(lidx[r], k)
    ss = ex[q].ravel()
    np.add.at(N, (js[ss >= 0], ss[ss >= 0]), 1)
    return C, N, M


def predict(trace, arr: RoutingArrays, in_phase: np.ndarray, width: int, param: int = 1, training=None) -> Prediction:
    d = int(param)
    E = trace.n_expert
    C, N, M = fit(trace, training, d)
    ranked = np.full((arr.n_rows, width), NONE, np.int32)
    scored = np.zeros(arr.n_rows, bool)
    rows = np.flatnonzero(in_phase)
    src = source_rows(trace, arr, d, rows)
    lidx = _layer_index(trace, arr)
    has_pairs = N.sum(axis=1) > 0
    ok = (src >= 0)
    ok[ok] = has_pairs[lidx[rows[ok]]]
    rows, src = rows[ok], src[ok]
    ids = np.arange(E)
    for j in np.unique(lidx[rows]):
        sel = lidx[rows] == j
        r, q = rows[sel], src[sel]
        score = np.zeros((r.size, E), np.float64)
        for slot in range(arr.experts.shape[1]):  # slot order: the fixed summation order
            s = arr.experts[q, slot]
            v = s >= 0
            term = (C[j][np.maximum(s, 0)] + ALPHA) / (N[j][np.maximum(s, 0)] + ALPHA * E)[:, None]
            score = np.where(v[:, None], score + term, score)
        order = np.lexsort((np.broadcast_to(ids, score.shape), np.broadcast_to(-M[j], score.shape), -score), axis=-1)
        ranked[r] = order[:, :width].astype(np.int32)
        scored[r] = True
    return Prediction(f"pair-table[{d}]", ranked, scored)
