"""``lfu``: evict the entry touched by the fewest loads, ties to the least recently used.

Frequency = number of loads that touched the entry since it was last admitted (in-cache LFU: it
restarts at 1 on re-admission; a repeat inside one load does not count twice).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from replay.cache_state import FREQ
from replay.policies import _heap

PARTITION = "global"
UNBOUNDED = False
NEEDS_NEXT_USE = False
NEEDS_LAST_LOAD = False



@njit(cache=True, inline="always")
def key(ent, e):
    return np.int64(ent[FREQ, e])


init = _heap.init
on_admit, on_touch, pick_victim, on_evict = _heap.make_heap_hooks(key)
