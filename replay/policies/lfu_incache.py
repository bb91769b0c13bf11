"""``lfu-incache``: ``lfu`` with the count restarted at admission (in-cache LFU).

Frequency = number of loads that looked the entry up since it was last admitted (it restarts at 1
on re-admission; a repeat inside one load does not count twice; a speculative fill sets it to 0).
Ties to the least recently used. This was ``lfu`` before it counted over the whole run.
"""

from __future__ import annotations

from replay.policies.lfu import init, key, on_admit, on_evict, on_touch, pick_victim  # noqa: F401

PARTITION = "global"
UNBOUNDED = False
NEEDS_NEXT_USE = False
NEEDS_LAST_LOAD = False
FREQ_SINCE = "admission"
