"""``ctrl``: layer l's router on its own gate input with the architecture's selection rule; on a
consistent trace it reproduces every routing (100.0%) — a check, not a predictor. Computed in
the same streaming pass as ``stale-gate`` (:mod:`.gate`)."""

from __future__ import annotations

from replay.predictors.gate import predict_many, unavailable  # noqa: F401 (hooks)

NAME = "ctrl"
DESCRIPTION = "layer l's router on its own gate input: must be 100.0% (a check, not a predictor)"
PREFETCH = False
