"""The ``--phase`` vocabulary, the same values and meaning in every verb that has it: which
routings (or loads) a figure is about. ``all`` = prefill and decode together (the engine's
cumulative figures)."""

from __future__ import annotations

from traces.format.errors import UserError

PHASES = ("decode", "prefill", "all")
PHASE_CODES = {"decode": (1,), "prefill": (0,), "all": (0, 1)}
# The hit-% key of a phase, as docs/design.md names them ("all" is the cumulative figure).
PHASE_HIT_KEY = {"decode": "hit_pct_decode", "prefill": "hit_pct_prefill", "all": "hit_pct_cum"}


def check_phase(phase: str) -> str:
    """``phase`` if it is one of ``PHASES``, else one sentence saying what is accepted."""
    if phase not in PHASES:
        raise UserError(f"--phase {phase!r} is not one of decode (decode routings only), prefill (prompt routings only), "
                        "all (both).")
    return phase
