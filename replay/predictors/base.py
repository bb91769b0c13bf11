"""What every predictor hands back, and the predictor names the tool knows."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from traces.errors import UserError

# Predictor families, in the order they print. ``stale-gate`` takes a horizon: ``stale-gate[d]``.
FAMILIES = ("prev-token", "stale-gate", "ctrl", "static-hot", "static-hot-prompt")
NONE = -1  # "nothing named at this rank" in a ranked prediction

_STALE = re.compile(r"^stale-gate\[(\d+)\]$")


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


def parse_predictor(name: str, option: str = "--predictors") -> tuple[str, int | None]:
    """``'stale-gate[2]'`` -> ``('stale-gate', 2)``; ``'ctrl'`` -> ``('ctrl', None)``; bad -> UserError
    naming ``option``, the flag the name came from."""
    name = name.strip()
    m = _STALE.match(name)
    if m:
        d = int(m.group(1))
        if d < 1:
            raise UserError(f"{option} {name}: the stale-gate horizon must be >= 1 (d=0 is ctrl).")
        return "stale-gate", d
    if name in FAMILIES:
        return name, None
    raise UserError(f"{option}: unknown predictor {name!r} (known: {', '.join(FAMILIES)}, stale-gate[d]).")


def empty_prediction(name: str, n_rows: int, width: int) -> Prediction:
    return Prediction(name, np.full((n_rows, width), NONE, dtype=np.int32), np.zeros(n_rows, dtype=bool))
