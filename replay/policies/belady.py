"""``belady``: evict the entry whose next load is furthest away (an entry no later load touches is
infinitely far); ties (e.g. several never-again entries) to the least recently used. This is the
offline optimum *for these replay semantics* at that budget with equal-size entries; with unequal
per-layer sizes it is the classic furthest-in-future rule, a heuristic and not a bound (another
replay can hit more: tests/test_opt_bound.py has one); ``opt-bound`` is the upper bound then.

Victim search: the key blocks of :mod:`replay.policies._blocks` (a vectorised minimum over the
packed (next use, last visit) keys of the resident entries, in blocks with a per-block minimum).
"""

from __future__ import annotations

import numpy as np

from replay.core.state import NEVER, NEXT_USE
from replay.policies import _blocks
from traces.util.jit import njit

PARTITION = "global"
BOUND = True  # offline bound, not an online policy
UNBOUNDED = False
NEEDS_NEXT_USE = True
NEEDS_LAST_LOAD = False
NEEDS_FREQ = False


@njit(cache=True, inline="always")
def key(ent, e):
    # Furthest next use first: NEVER - next_use is 0 for a never-again entry, in [0, 2^31).
    return np.int64(NEVER) - np.int64(ent[NEXT_USE, e])


init = _blocks.init
on_admit, on_touch, pick_victim, on_evict = _blocks.make_block_hooks(key)
