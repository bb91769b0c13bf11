"""``lfru``: colibri-style frequency-then-recency score, lowest score evicted.

score = freq << 8 | recency, recency = max(0, 255 - (clock - last_load)), where freq is the
in-cache demand frequency (loads that looked the entry up since it was last admitted, as in
``lfu-incache``; not ``lfu``'s whole-run count), and the clock counts
*loads* ((batch, layer) groups, 0-based over the trace): eviction after load ``c`` uses clock
``c``. An entry untouched for 255 loads (about 255 / MoE-layers tokens) has lost all recency
credit. Ties (equal score) go to the least recently used.

Said out loud: with frequency in the high bits and this tie-break, the victim order is exactly
``lfu-incache``'s (the recency byte falls with the last load, and saturated bytes tie and fall back
to the same least-recent rule), so ``lfru`` replays identically to ``lfu-incache``; it would differ
only with a frequency that saturates or decays, which the specification does not give.
"""

from __future__ import annotations

import numpy as np

from replay.core.state import FREQ
from replay.policies import _heap
from traces.util.jit import njit

PARTITION = "global"
UNBOUNDED = False
NEEDS_NEXT_USE = False
FREQ_SINCE = "admission"  # the in-cache count (lfu-incache's), not lfu's whole-run count


@njit(cache=True, inline="always")
def _order(ent, e):
    # Victim search: the minimum of (score, last_tick) equals the minimum of (freq, last_tick)
    # (see the module docstring), and freq changes only when the entry is touched, so the
    # indexed heap applies; the naive twin computes the score itself and must agree exactly.
    return np.int64(ent[FREQ, e])


init = _heap.init
on_admit, on_touch, pick_victim, on_evict = _heap.make_heap_hooks(_order)
