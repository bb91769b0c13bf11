"""``stale-gate[d]``: MoE layer l's router on the gate input of the MoE layer d places earlier
(d=1 is the FATE mechanism). The computation (one streaming pass shared with ``ctrl``) is in
:mod:`.gate`."""

from __future__ import annotations

from replay.predictors.gate import predict_many, unavailable  # noqa: F401 (hooks)

NAME = "stale-gate"
DESCRIPTION = "layer l's router on the gate input {d} MoE layer(s) earlier (prefetch {d} layer(s) ahead)"
PARAM = "d"
REPORT_PREFETCH = 1  # the report shows stale-gate[1] prefetch
ISSUE = "layer"  # a guess for layer l exists once layer l - d starts (replay.analyses.timeline); default "token"


def param_problem(d: int) -> str | None:
    return "the stale-gate horizon must be >= 1 (d=0 is ctrl)" if d < 1 else None


def check(trace, d: int) -> str | None:
    """stale-gate[d] predicts MoE layer i from MoE layer i-d's gate input, so with L MoE layers
    only d < L reaches any layer."""
    n = len(trace.moe_layers)
    if d >= n:
        return (f"stale-gate horizon {d} scores nothing on {trace.path}, which has {n} MoE layer(s); a horizon must be "
                f"below {n} (stale-gate[d] predicts a layer from the gate input d MoE layers earlier).")
    return None


def ahead(d: int) -> int:
    return d
