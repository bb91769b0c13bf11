"""What every predictor hands back (the names the tool knows are in :mod:`replay.predictors`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the CLI lists the predictors before any array exists
    import numpy as np

NONE = -1  # "nothing named at this rank" in a ranked prediction


@dataclass(frozen=True)
class Prediction:
    """One predictor's output over all R rows of a trace (the rows of :meth:`Trace.arrays`).

    ``ranked`` is ``[R, width]`` int32: expert ids, best first, :data:`NONE` where the predictor
    names fewer than ``width`` experts (prev-token names at most k). ``scored`` is ``[R]`` bool:
    False where the predictor could not rank that routing (no previous token, no source layer,
    no prompt to learn from). An unscored routing is never "wrong": it is counted apart and never
    enters a denominator.
    """

    name: str
    ranked: np.ndarray
    scored: np.ndarray
    weights: np.ndarray | None = None  # [R, width] float32 predicted routing weight per rank, if the predictor has one


def stale_gate_name(d: int) -> str:
    return f"stale-gate[{d}]"


def empty_prediction(name: str, n_rows: int, width: int) -> Prediction:
    import numpy as np

    return Prediction(name, np.full((n_rows, width), NONE, dtype=np.int32), np.zeros(n_rows, dtype=bool))
