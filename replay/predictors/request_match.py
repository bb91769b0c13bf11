"""``request-match``: MoE-Infinity's activation-matrix matching. Each training request has an
activation matrix ``A[g][l, e]`` = how many of its training routings at MoE layer l chose e. A
routing of the scored trace is predicted from the current request's matrix *so far* — every
routing (any phase) of its tokens before the current one, in (turn, step) order — matched to the
nearest training request by cosine similarity ``dot / sqrt(|cur|^2 x |A[g]|^2)`` (ties: the lowest
request id); layer l is ranked by that request's ``A[g*][l, e]``, count descending, then expert id.

Learned on the training split only (``LEARNS``). A request never matches itself: with a training
split of this trace, the current request's own training tokens are left out of the candidates
(MoE-Infinity matches against *past* requests), so a trace of one request leaves it unscored.
Unscored also: a request's first token (nothing so far), no candidate with a non-zero matrix, and a
layer the matched request has no training routing at. The guess exists before the token starts
(lead 1 layer, counted like prev-token).
"""

from __future__ import annotations

import math

import numpy as np

from replay.predictors.base import NONE, Prediction
from traces.io.reader import RoutingArrays

NAME = "request-match"
DESCRIPTION = "the nearest training request's activation matrix (cosine over this request's routings so far; MoE-Infinity)"
LEARNS = True


def _lidx(trace, arr: RoutingArrays) -> np.ndarray:
    lut = np.full(max(trace.moe_layers) + 1, -1, np.int64)
    lut[list(trace.moe_layers)] = np.arange(len(trace.moe_layers))
    return lut[arr.layer.astype(np.int64)]


def fit(trace, training) -> tuple[np.ndarray, np.ndarray]:
    """(request ids [G] ascending, matrices [G, n_moe, E] int64) over the training rows."""
    arr, n_moe, E = training.arr, len(trace.moe_layers), trace.n_expert
    rows = np.flatnonzero(training.rows)
    req = arr.request_or_zero[rows]
    ids = np.unique(req)
    A = np.zeros((ids.size, n_moe, E), np.int64)
    if rows.size:
        g = np.searchsorted(ids, req)
        li = _lidx(training.trace, arr)[rows]
        k = arr.experts.shape[1]
        ex = arr.experts[rows].ravel()
        ok = ex >= 0
        np.add.at(A, (np.repeat(g, k)[ok], np.repeat(li, k)[ok], ex[ok]), 1)
    return ids, A


def predict(trace, arr: RoutingArrays, in_phase: np.ndarray, width: int, training=None) -> Prediction:
    from replay.predictors.training import token_index

    ids, A = fit(trace, training)
    n_moe, E = len(trace.moe_layers), trace.n_expert
    ranked = np.full((arr.n_rows, width), NONE, np.int32)
    scored = np.zeros(arr.n_rows, bool)
    if not ids.size or not in_phase.any():
        return Prediction(NAME, ranked, scored)
    self_trace = training.trace is trace
    flat = A.reshape(ids.size, -1)
    norm_g = (flat * flat).sum(axis=1).astype(np.float64)
    lidx = _lidx(trace, arr)
    tok, tok_req = token_index(arr)
    order = np.lexsort((np.arange(arr.n_rows), tok))  # rows grouped by token, tokens in (request, turn, step) order
    bounds = np.flatnonzero(np.r_[True, tok[order][1:] != tok[order][:-1], True])
    ex_ids = np.arange(E)
    cur = np.zeros((n_moe, E), np.int64)
    dots = np.zeros(ids.size, np.int64)
    ncur = 0
    prev_req = None
    for a, b in zip(bounds[:-1], bounds[1:]):
        rows = order[a:b]
        r_id = int(tok_req[tok[rows[0]]])
        if r_id != prev_req:  # a new request: nothing so far
            cur[:] = 0
            dots[:] = 0
            ncur = 0
            prev_req = r_id
        ev = rows[in_phase[rows]]
        if ev.size and ncur > 0:
            cand = norm_g > 0
            if self_trace:
                cand &= ids != r_id
            if cand.any():
                sim = np.full(ids.size, -math.inf)
                sim[cand] = dots[cand].astype(np.float64) / np.sqrt(float(ncur) * norm_g[cand])
                g = int(np.argmax(sim))  # first maximum: the lowest request id
                for r in ev:
                    row = A[g, lidx[r]]
                    if row.sum() == 0:
                        continue
                    ranked[r] = np.lexsort((ex_ids, -row))[:width]
                    scored[r] = True
        # the token joins "so far" after it is predicted; its (layer, expert) pairs are distinct
        # (one routing per layer, k distinct experts), so they update at once
        ex = arr.experts[rows].ravel()
        ls = np.repeat(lidx[rows], arr.experts.shape[1])
        ok = ex >= 0
        ls, ex = ls[ok], ex[ok]
        ncur += int((2 * cur[ls, ex] + 1).sum())
        cur[ls, ex] += 1
        dots += A[:, ls, ex].sum(axis=1)
    return Prediction(NAME, ranked, scored)


def note(trace, arr: RoutingArrays, in_phase: np.ndarray) -> str | None:
    if arr.request is None or np.unique(arr.request[in_phase]).size < 2:
        return ("request-match: the trace holds one request and a request is never matched to itself, so it scores "
                "only when trained on another trace (--train-trace)")
    return None
