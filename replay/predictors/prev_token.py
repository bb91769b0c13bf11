"""``prev-token``: predict that a layer routes what it routed for the previous token of the turn.

"Previous token" is the previous token *in step order within the same request and turn, among the
tokens of the scored phase(s)*, at the same MoE layer (a trace without a request column is one
request; with one, the tokens of other requests batched alongside are never "previous"):

- ``--phase decode`` (the default): the previous decoded token; the first decoded token of each
  turn (of each request) has none and is unscored (the last prompt token is not used: in decode the predictor is
  meant as "what the engine just did for this layer");
- ``--phase prefill``: the previous prompt token. The engine computes a prompt batch all at once,
  so this measures how persistent routing is along the prompt, not a prefetch an engine could
  issue in time;
- ``--phase all``: the previous token of the turn whatever its phase (the first decoded token is
  predicted by the last prompt token); only the first token of each turn is unscored.

The prediction names exactly the k routed experts in router rank order; at a width w > k it
still names only k (the rest of the ranked list is empty), at w < k the top-w of them.
"""

from __future__ import annotations

import numpy as np

from replay.predictors.base import NONE, Prediction
from traces.io.reader import RoutingArrays


def predict_prev_token(arr: RoutingArrays, in_phase: np.ndarray, width: int) -> Prediction:
    """Ranked ``[R, width]`` prediction; rows outside ``in_phase`` and first tokens are unscored."""
    n, k = arr.experts.shape
    ranked = np.full((n, width), NONE, dtype=np.int32)
    weights = np.full((n, width), np.nan, dtype=np.float32)  # the previous token's applied weights
    scored = np.zeros(n, dtype=bool)
    rows = np.flatnonzero(in_phase)
    if rows.size:
        # (request, turn, layer, step, row) order: a row's predecessor is the row just before it in
        # this order when it has the same request, turn and layer. With many requests in one batch
        # the previous row of the file is another request's token: the previous token is the
        # previous one *of this request*. The row index breaks ties between equal steps.
        req = arr.request_or_zero
        order = rows[np.lexsort((rows, arr.step[rows], arr.layer[rows], arr.turn[rows], req[rows]))]
        cur, prev = order[1:], order[:-1]
        same = (req[cur] == req[prev]) & (arr.turn[cur] == arr.turn[prev]) & (arr.layer[cur] == arr.layer[prev])
        cur, prev = cur[same], prev[same]
        m = min(k, width)
        ranked[cur, :m] = arr.experts[prev, :m]
        weights[cur, :m] = arr.weights[prev, :m]
        scored[cur] = True
    return Prediction("prev-token", ranked, scored, weights)


NAME = "prev-token"
DESCRIPTION = "this layer's experts for the previous token of the turn (temporal reuse)"
WEIGHTS = True


def predict(trace, arr: RoutingArrays, in_phase: np.ndarray, width: int, with_weights: bool = False) -> Prediction:
    """The registry hook (the weights are the previous token's applied weights, always computed)."""
    return predict_prev_token(arr, in_phase, width)
REPORT_PREFETCH = True
