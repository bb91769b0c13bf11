"""Units and phase codes, defined once for the whole distribution.

- :data:`MIB`: bytes in one MiB (2^20), an int: multiply MiB by it for bytes, divide bytes by it
  for MiB (Python's ``/`` gives a float either way, exactly rounded).
- :data:`PHASE_PREFILL` / :data:`PHASE_DECODE`: the ``phase`` column's codes (0 prompt, 1 decode).
"""

MIB = 1 << 20
PHASE_PREFILL = 0
PHASE_DECODE = 1
