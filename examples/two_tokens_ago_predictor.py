"""``two-tokens-ago``: "the experts this layer routed two tokens ago" — an example predictor plugin.

Use it with::

    moe-replay predict TRACE --predictor-file examples/two_tokens_ago_predictor.py \
        --predictors prev-token,two-tokens-ago

or ``replay.predict(trace, predictors=["two-tokens-ago"], predictor_file="examples/two_tokens_ago_predictor.py")``.

"Two tokens ago" is counted per request when the trace has a ``request`` column (a server trace
interleaves requests), else over the whole trace; tokens are ordered by ``step`` within each MoE
layer (the row order breaks ties). The first two tokens of each request (or of the trace) have
nothing to copy: their rows are left at -1, so they are unscored, never "wrong".

A predictor module defines ``NAME``, ``DESCRIPTION`` and ``predict(trace, arr, in_phase, width)``
returning int32 guesses ``[routings, width]`` (expert ids best first, -1 = no guess) for every row
of ``arr`` (``arr.layer``, ``arr.step``, ``arr.experts`` [routings, k], ...); rows outside
``in_phase`` are not scored whatever they hold.
"""

import numpy as np

NAME = "two-tokens-ago"
DESCRIPTION = "this layer's experts two tokens earlier in the same request (temporal reuse at distance 2)"


def _request(trace, n_rows: int) -> np.ndarray:
    if not trace.has("request"):
        return np.zeros(n_rows, np.int64)  # one request: the whole trace
    return np.concatenate([t.column("request").to_numpy() for t in trace.iter_tables(["request"])]).astype(np.int64)


def predict(trace, arr, in_phase, width):
    n, k = arr.experts.shape
    out = np.full((n, width), -1, dtype=np.int32)
    req = _request(trace, n)
    rows = np.arange(n)
    order = np.lexsort((rows, arr.step, arr.layer, req))  # (request, layer, step, row)
    cur, back2 = order[2:], order[:-2]
    same = (req[cur] == req[back2]) & (arr.layer[cur] == arr.layer[back2])
    cur, back2 = cur[same], back2[same]
    m = min(k, width)
    out[cur, :m] = arr.experts[back2, :m]
    return out
