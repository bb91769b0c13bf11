"""``belady``: evict the entry whose next load is furthest away (an entry no later load touches is
infinitely far); ties (e.g. several never-again entries) to the least recently used. This is the
offline optimum *for these replay semantics* at that budget with equal-size entries; with unequal
per-layer sizes it is the classic furthest-in-future rule, a strong bound but not a proven optimum.
"""

from __future__ import annotations

from numba import njit

from replay.cache_state import NEXT_USE
from replay.policies._scan import make_pick_victim, no_op, no_state

PARTITION = "global"
UNBOUNDED = False
NEEDS_NEXT_USE = True

init = no_state
on_admit = no_op
on_touch = no_op
on_evict = no_op


@njit(cache=True, inline="always")
def key(ps, ent, e, load):
    return -ent[e, NEXT_USE]  # furthest next use = smallest key


pick_victim = make_pick_victim(key)
