"""``learned-gate[d]``: a ridge regression from MoE layer l-d's router input (gate input) to layer
l's router logits, fitted on the training split — the learned counterpart of ``stale-gate[d]``
(which applies layer l's router to the stale input unchanged).

Per target MoE layer l (the first d have no source and are unscored), over the training tokens
with routings at both l-d and l:

    X = [gate input at l-d, 1]  (float64, n_embd + 1 columns),  Y = layer l's logits on its own gate input
    B = solve(X^T X + lambda I, X^T Y),  lambda = 1e-6 x mean(diag(X^T X))  (ridge; scale-free)

and a routing at l is ranked by the architecture's selection rule (activation, selection bias,
groups: :func:`replay.predictors.gate.rank`) on ``[x_(l-d), 1] @ B``. A layer with fewer training
pairs than n_embd + 1 columns is still fitted (the ridge term keeps the system solvable), but a
layer with none is unscored. When layer l's gate input equals layer l-d's, the fit reproduces the
router exactly (up to the ridge term) and the accuracy is ctrl's.

Memory: the gate inputs of the whole trace are read as float64 ([routings, n_embd]); meant for
captured or tiny-model traces, not for a multi-gigabyte capture.
"""

from __future__ import annotations

import numpy as np

from replay.predictors.base import NONE, Prediction
from replay.predictors.gate import gate_unavailable, matrix_problem
from traces.io.reader import RoutingArrays, fixed_list_to_numpy

NAME = "learned-gate"
DESCRIPTION = ("layer l's router logits regressed (ridge) on the gate input {d} MoE layer(s) earlier, fitted on the "
               "training tokens (prefetch {d} layer(s) ahead)")
PARAM = "d"
LEARNS = True
REPORT = False  # reads every gate input as float64 at once: asked for by name (predict), not by every report
RIDGE = 1e-6  # lambda = RIDGE x mean(diag(X^T X))


def unavailable(trace) -> str | None:
    return gate_unavailable(trace) or matrix_problem(trace, trace.router_matrices())


def param_problem(d: int) -> str | None:
    return "the learned-gate horizon must be >= 1 (d=0 is ctrl)" if d < 1 else None


def check(trace, d: int) -> str | None:
    n = len(trace.moe_layers)
    if d >= n:
        return (f"learned-gate horizon {d} scores nothing on {trace.path}, which has {n} MoE layer(s); a horizon must be "
                f"below {n}.")
    return None


def ahead(d: int) -> int:
    return d


def gate_inputs(trace) -> np.ndarray:
    """float64 [routings, n_embd] in the rows' order (:meth:`Trace.arrays`); refused before reading
    when it would not fit in memory."""
    from traces.util.memory import check_fits

    n_embd = int(trace.model.get("n_embd") or 0)
    check_fits(trace.n_rows * max(n_embd, 1) * 12, f"{trace.path / 'trace.json'}: learned-gate reads all "
               f"{trace.n_rows:,} gate inputs x n_embd {n_embd:,} as float64")
    t = trace.table(["gate_input"])
    return fixed_list_to_numpy(t.column("gate_input")).astype(np.float64)


def own_logits(trace, arr: RoutingArrays, g: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Layer l's logits on its own gate input for ``rows`` (float64 [len(rows), E])."""
    mats = trace.router_matrices()
    lb = trace.router_logit_bias() if trace.has_router_logit_bias else {}
    out = np.empty((rows.size, trace.n_expert), np.float64)
    for layer in np.unique(arr.layer[rows]):
        sel = arr.layer[rows] == layer
        W = mats[int(layer)][0].astype(np.float64)
        out[sel] = g[rows[sel]] @ W.T + (lb[int(layer)].astype(np.float64) if int(layer) in lb else 0.0)
    return out


def fit_layer(X: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """Ridge coefficients [n_embd + 1, E] of Y on [X, 1]."""
    Xa = np.concatenate([X, np.ones((X.shape[0], 1))], axis=1)
    G = Xa.T @ Xa
    lam = RIDGE * float(np.mean(np.diag(G))) if G.size else 0.0
    return np.linalg.solve(G + max(lam, 1e-300) * np.eye(G.shape[0]), Xa.T @ Y)


def predict(trace, arr: RoutingArrays, in_phase: np.ndarray, width: int, param: int = 1, training=None) -> Prediction:
    from replay.predictors.gate import rank
    from replay.predictors.pair_table import _layer_index, source_rows

    d = int(param)
    ranked = np.full((arr.n_rows, width), NONE, np.int32)
    scored = np.zeros(arr.n_rows, bool)
    g = gate_inputs(trace)
    tg = g if training.trace is trace else gate_inputs(training.trace)
    tarr = training.arr
    t_rows = np.flatnonzero(training.rows)
    t_src = source_rows(training.trace, tarr, d, t_rows)
    ok = t_src >= 0
    ok[ok] = training.rows[t_src[ok]]
    t_rows, t_src = t_rows[ok], t_src[ok]
    t_li = _layer_index(training.trace, tarr)[t_rows]
    e_rows = np.flatnonzero(in_phase)
    e_src = source_rows(trace, arr, d, e_rows)
    e_rows, e_src = e_rows[e_src >= 0], e_src[e_src >= 0]
    e_li = _layer_index(trace, arr)[e_rows]
    bias_by_layer = {l: b for l, (_, b) in trace.router_matrices().items()}
    for j in np.unique(e_li):
        tr_sel = t_li == j
        if not tr_sel.any():
            continue  # nothing learned for this layer: unscored
        Y = own_logits(training.trace, tarr, tg, t_rows[tr_sel])
        B = fit_layer(tg[t_src[tr_sel]], Y)
        sel = e_li == j
        r, q = e_rows[sel], e_src[sel]
        logits = np.concatenate([g[q], np.ones((q.size, 1))], axis=1) @ B
        layer = trace.moe_layers[int(j)]
        ranked[r] = rank(logits, trace.gating, bias_by_layer[layer], width).astype(np.int32)
        scored[r] = True
    return Prediction(f"learned-gate[{d}]", ranked, scored)
