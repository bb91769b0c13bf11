"""Expert predictors: each names, per (token, MoE layer) routing, a ranked list of experts — or
says it cannot ("unscored"). One small module per predictor; :mod:`replay.predict` scores them.

- :mod:`.prev_token` — what this layer routed for the previous token of the turn;
- :mod:`.gate` — ``stale-gate[d]`` (layer l's router on the gate input of the MoE layer d places
  earlier) and ``ctrl`` (layer l's router on its own gate input: must reproduce the routing);
- :mod:`.static_hot` — the layer's most-routed experts (oracle over the scored phase, or learned
  from the prompt only).
"""

from replay.predictors.base import Prediction, parse_predictor

__all__ = ["Prediction", "parse_predictor"]
