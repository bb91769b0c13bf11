"""``lfu``: evict the entry touched by the fewest loads, ties to the least recently used.

Frequency = number of loads that touched the entry since it was last admitted (in-cache LFU: it
restarts at 1 on re-admission; a repeat inside one load does not count twice).
"""

from __future__ import annotations

from numba import njit

from replay.cache_state import FREQ
from replay.policies._scan import make_pick_victim, no_op, no_state

PARTITION = "global"
UNBOUNDED = False
NEEDS_NEXT_USE = False

init = no_state
on_admit = no_op
on_touch = no_op
on_evict = no_op


@njit(cache=True, inline="always")
def key(ps, ent, e, load):
    return ent[e, FREQ]


pick_victim = make_pick_victim(key)
