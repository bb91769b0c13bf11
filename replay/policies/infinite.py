"""``infinite``: nothing is ever evicted, so only compulsory misses remain (the first lookup of
each (layer, expert)): the bound for every policy at any budget. The budget is ignored."""

from __future__ import annotations

from replay.policies._scan import never_evict, no_op, no_state

PARTITION = "global"
BOUND = True  # offline bound, not an online policy
UNBOUNDED = True
NEEDS_NEXT_USE = False
NEEDS_LAST_LOAD = False
NEEDS_TICK = False
NEEDS_FREQ = False

init = no_state
on_admit = no_op
on_touch = no_op
on_evict = no_op
pick_victim = never_evict
