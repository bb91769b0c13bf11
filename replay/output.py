"""Compatibility names: what this module used to define now lives where it belongs.

- numbers, cells, tables and the ``--json`` object: :mod:`replay.present.format` (presentation);
- the ``--phase`` vocabulary: :mod:`replay.phases`; frames to rows: :mod:`replay.frames`;
- progress bars and the first-run compile notice: :mod:`replay.progress`.

Library (computation) modules import those modules directly, never this one (tests/test_layering.py).
"""

from replay.frames import clean as _clean  # noqa: F401
from replay.frames import rows_of  # noqa: F401
from replay.phases import PHASE_CODES, PHASE_HIT_KEY, PHASES, check_phase  # noqa: F401
from replay.present.format import PARAMETERS, PRECISION, cell, digits_for, exact, fmt, fmt_q, json_object, text_table  # noqa: F401
from replay.progress import COMPILE_NOTICE, compile_notice, progress  # noqa: F401
