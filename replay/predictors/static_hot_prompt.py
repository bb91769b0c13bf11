"""``static-hot-prompt``: each layer's most-routed experts learned from the prompt (prefill rows of
every turn) only — what an engine could pin after prefill (see :mod:`.static_hot`)."""

from __future__ import annotations

import numpy as np

from replay.predictors.base import Prediction
from replay.predictors.static_hot import predict_static_hot_prompt, with_mean_weights
from traces.format.schema import PHASE_PREFILL
from traces.io.reader import RoutingArrays

NAME = "static-hot-prompt"
DESCRIPTION = "the layer's most-routed experts during prefill (pinnable after the prompt)"
WEIGHTS = True


def predict(trace, arr: RoutingArrays, in_phase: np.ndarray, width: int, with_weights: bool = False) -> Prediction:
    pred = predict_static_hot_prompt(arr, in_phase, trace.n_expert, width)
    return with_mean_weights(pred, arr, arr.phase == PHASE_PREFILL, trace.n_expert) if with_weights else pred


def note(trace, arr: RoutingArrays, in_phase: np.ndarray) -> str | None:
    if not (arr.phase == PHASE_PREFILL).any():
        return "static-hot-prompt: the trace has no prefill routings to learn from; all unscored"
    return None
