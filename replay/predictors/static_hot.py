"""``static-hot`` and ``static-hot-prompt``: each layer's most-routed experts, one list per layer.

- ``static-hot`` learns the counts over the training split of the scored phase (held out:
  replay/predictors/training.py) and is scored on the evaluated tokens, which it never saw. With
  ``--train in-sample`` it learns over the scored routings themselves: an oracle (it has seen the
  answers), the ceiling of any fixed per-layer list, and every figure says "in-sample";
- ``static-hot-prompt`` learns them from the prompt (prefill rows of every turn) only — what an
  engine could pin after prefill. A trace (or a layer) without prefill rows leaves it unscored.
  With ``--phase prefill`` it is scored on what it learned from, so it equals ``static-hot``.

Ranking: count descending, then expert id ascending (experts never routed fill the tail in id
order, so every layer's list is deterministic and always ``width`` long).
"""

from __future__ import annotations

import numpy as np

from replay.predictors.base import NONE, Prediction
from traces.format.schema import PHASE_PREFILL
from traces.io.reader import RoutingArrays


def hot_lists(arr: RoutingArrays, learn: np.ndarray, n_expert: int, width: int) -> dict[int, np.ndarray]:
    """{layer: the ``width`` most-routed experts over rows ``learn``} for layers that have such rows."""
    rows = np.flatnonzero(learn)
    out: dict[int, np.ndarray] = {}
    if not rows.size:
        return out
    lay = arr.layer[rows].astype(np.int64)
    layers = np.unique(lay)
    pos = np.searchsorted(layers, lay)
    counts = np.bincount((pos[:, None] * n_expert + arr.experts[rows]).ravel(),
                         minlength=layers.size * n_expert).reshape(layers.size, n_expert)
    ids = np.arange(n_expert)
    for i, l in enumerate(layers):
        order = np.lexsort((ids, -counts[i]))  # count desc, id asc
        out[int(l)] = order[:width].astype(np.int32)
    return out


def _predict(name: str, arr: RoutingArrays, in_phase: np.ndarray, learn: np.ndarray, n_expert: int,
             width: int, learn_arr: RoutingArrays | None = None) -> Prediction:
    n = arr.n_rows
    ranked = np.full((n, width), NONE, dtype=np.int32)
    scored = np.zeros(n, dtype=bool)
    for layer, ids in hot_lists(learn_arr if learn_arr is not None else arr, learn, n_expert, width).items():
        rows = in_phase & (arr.layer == layer)
        ranked[rows, : ids.size] = ids
        scored[rows] = True
    return Prediction(name, ranked, scored)


def predict_static_hot(arr: RoutingArrays, in_phase: np.ndarray, n_expert: int, width: int) -> Prediction:
    """Oracle: learned over the scored rows themselves."""
    return _predict("static-hot", arr, in_phase, in_phase, n_expert, width)


def predict_static_hot_prompt(arr: RoutingArrays, in_phase: np.ndarray, n_expert: int, width: int) -> Prediction:
    """Learned from the prefill rows of the whole trace only."""
    return _predict("static-hot-prompt", arr, in_phase, arr.phase == PHASE_PREFILL, n_expert, width)


NAME = "static-hot"
DESCRIPTION = "the layer's most-routed experts over the training tokens (held out; --train in-sample: an oracle)"
WEIGHTS = True
LEARNS = True  # fitted on the training split; scored in-sample only when asked for, and then marked


def mean_weights(arr: RoutingArrays, learn: np.ndarray, n_expert: int) -> dict[int, np.ndarray]:
    """{layer: mean applied weight of each expert over the rows ``learn`` that routed it} (NaN never)."""
    out = {}
    rows = np.flatnonzero(learn)
    for layer in np.unique(arr.layer[rows]):
        r = rows[arr.layer[rows] == layer]
        ex = arr.experts[r].ravel()
        w = arr.weights[r].astype(np.float64).ravel()
        s = np.bincount(ex, weights=w, minlength=n_expert)
        c = np.bincount(ex, minlength=n_expert)
        with np.errstate(invalid="ignore", divide="ignore"):
            out[int(layer)] = np.where(c > 0, s / np.maximum(c, 1), np.nan)
    return out


def with_mean_weights(pred: Prediction, arr: RoutingArrays, learn: np.ndarray, n_expert: int) -> Prediction:
    """``pred`` with, per guess, the mean weight the learning rows gave that expert (prefetch --drop)."""
    pw = np.full(pred.ranked.shape, np.nan, np.float32)
    for layer, m in mean_weights(arr, learn, n_expert).items():
        rows = pred.scored & (arr.layer == layer)
        ids = pred.ranked[rows]
        pw[rows] = np.where(ids >= 0, m[np.maximum(ids, 0)], np.nan)
    return Prediction(pred.name, pred.ranked, pred.scored, pw)


def predict(trace, arr: RoutingArrays, in_phase: np.ndarray, width: int, with_weights: bool = False,
            training=None) -> Prediction:
    """Hot lists counted over ``training.rows`` (of ``training.arr``), applied to the rows ``in_phase``."""
    pred = _predict("static-hot", arr, in_phase, training.rows, trace.n_expert, width, training.arr)
    if not with_weights:
        return pred
    pw = np.full(pred.ranked.shape, np.nan, np.float32)
    for layer, m in mean_weights(training.arr, training.rows, trace.n_expert).items():
        rows = pred.scored & (arr.layer == layer)
        ids = pred.ranked[rows]
        pw[rows] = np.where(ids >= 0, m[np.maximum(ids, 0)], np.nan)
    return Prediction(pred.name, pred.ranked, pred.scored, pw)
REPORT_PREFETCH = True
