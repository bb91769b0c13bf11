"""``belady``: evict the entry whose next load is furthest away (an entry no later load touches is
infinitely far); ties (e.g. several never-again entries) to the least recently used. This is the
offline optimum *for these replay semantics* at that budget with equal-size entries; with unequal
per-layer sizes it is the classic furthest-in-future rule, a strong bound but not a proven optimum.

Victim search: the lazy-deletion heap of :mod:`replay.policies._lazyheap` (a visit pushes the
entry's new next use; stale items are dropped when they surface).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from replay.cache_state import NEVER, NEXT_USE
from replay.policies import _lazyheap

PARTITION = "global"
UNBOUNDED = False
NEEDS_NEXT_USE = True
NEEDS_LAST_LOAD = False
NEEDS_FREQ = False


@njit(cache=True, inline="always")
def key(ent, e):
    # Furthest next use first: NEVER - next_use is 0 for a never-again entry, in [0, 2^31).
    return np.int64(NEVER) - np.int64(ent[NEXT_USE, e])


init = _lazyheap.init
on_admit, on_touch, pick_victim, on_evict = _lazyheap.make_lazy_heap_hooks(key)
