"""``lfu``: evict the entry touched by the fewest loads, ties to the least recently used.

Frequency = number of loads that looked the entry up since the start of the run (a repeat inside
one load counts once). The count survives eviction: an entry readmitted after eviction keeps its
history ("perfect LFU", as the reference replay behind the published cache curves counts).
A speculative fill neither raises the count nor erases it. ``lfu-incache`` restarts the count at
admission instead.
"""

from __future__ import annotations

import numpy as np

from replay.core.state import FREQ
from replay.policies import _heap
from traces.util.jit import njit

PARTITION = "global"
UNBOUNDED = False
NEEDS_NEXT_USE = False
NEEDS_LAST_LOAD = False
FREQ_SINCE = "run"


@njit(cache=True, inline="always")
def key(ent, e):
    return np.int64(ent[FREQ, e])


init = _heap.init
on_admit, on_touch, pick_victim, on_evict = _heap.make_heap_hooks(key)
