"""The expert cache's state, shared by the replay driver and every policy.

One *entry* is one (MoE layer, expert) pair, numbered ``entry = lidx * n_expert + expert`` where
``lidx`` is the layer's position in ``trace.moe_layers``; it costs ``ent[e, BYTES]`` bytes (the
layer's ``expert_bytes``; layers of one model differ). Entries are split into eviction *groups*:
one group for a global cache, one group per MoE layer for the partitioned policies (``layer``,
``layerlfu``); each group owns a contiguous segment of the resident list.

The state is two matrices (``ent`` int32, ``grp`` int64), one row per entry or group and one
column per field: Numba
passes one array to a hook for the price of a pointer, whereas a tuple of 16 arrays is copied and
reference-counted at every call (measured 25x slower); and all fields of one entry share one
64-byte cache line, which matters because entries are hit in router order, i.e. at random
(int64 fields spanning two lines measured 1.5-2x slower). int32 limits a replay to
:data:`MAX_SLOTS` routed slots (checked before replay).

- ``ent[e, FIELD]`` per entry, fields below; ``grp[g, FIELD]`` per group.

The driver (:mod:`replay.cache_kernel`) is the only writer of these fields; a policy keeps
whatever else it needs in its own int64 matrix ``ps``. Times are counted two ways:

- ``tick``: one per visited routed slot (repeats included), so recency inside a load is
  token-major, exactly as the engine visits it; ticks are unique per entry, so "least recent" is
  a total order and every tie-break is deterministic.
- ``load``: the index of the (batch, layer) group being replayed, 0-based over the whole trace
  (the *clock* LFRU ages by). ``ent[e, LAST_LOAD] == load`` means the current load touched ``e``;
  such an entry is never evicted after that load (DESIGN.md, "Replay semantics", rule 3).

Fields of the what-ifs (prefetch, retention, eviction guard; :mod:`replay.cache_kernel`):

- ``SPEC``: 1 while an entry was filled speculatively (prefetch) and not yet used by a demand
  lookup; the driver reports a demand hit on such an entry as residency code 2 and clears the
  flag; a victim with ``SPEC == 1`` was "evicted unused".
- ``PROTECT``: an entry with ``ent[e, PROTECT] == load`` is not evictable after that load
  (retention protects predicted entries). :func:`evictable` honours it, and every policy's victim search goes
  through :func:`evictable`.
- ``HEAT``: the eviction guard's demand heat (lifetime, unlike ``FREQ`` which restarts at
  admission); ``PRED_MARK``: dedupes the predictions of one speculative step.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# ent columns
RESIDENT = 0  # 1 while cached
LAST_TICK = 1  # tick of the last visit (recency, token-major inside a load); -1 never
LAST_LOAD = 2  # load index of the last visit; -1 never
FREQ = 3  # demand loads that touched it since it was admitted (LFU, LFRU)
NEXT_USE = 4  # next load touching it after its last visit (Belady); NEVER if none
OUTCOME = 5  # residency code of its lookup in its last load (a repeat reports the same)
SPEC = 6  # 1 = filled speculatively, not yet demanded (prefetch extension)
PROTECT = 7  # == load -> not evictable after that load (retention extension)
GROUP = 8  # eviction group
BYTES = 9  # bytes of the entry
RES_LIST = 10  # resident entries; group g in ent[BASE[g] : BASE[g] + COUNT[g], RES_LIST]
RES_POS = 11  # position of a resident entry in RES_LIST, -1 if not resident
HEAT = 12  # demand lookups over the whole replay, never reset, never raised by a speculative fill (eviction guard)
PRED_MARK = 13  # the load whose speculative step last considered it (dedupes predictions); -1 never
# 14..15 spare
N_ENT = 16  # 16 x int32 = 64 bytes: one entry, one cache line
# grp columns
BASE = 0  # first index of the group's resident-list segment
BUDGET = 1  # bytes the group may hold after a load
USED = 2  # bytes resident in the group
COUNT = 3  # resident entries in the group
N_GRP = 4

NEVER = (1 << 31) - 1  # next use of an entry no later load touches: infinitely far
MAX_SLOTS = (1 << 31) - 2  # ticks and load indexes are int32: a trace may hold this many routed slots


def new_state(entry_bytes: np.ndarray, group: np.ndarray, group_budget: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An empty cache: (ent, grp). ``group`` numbers groups 0..n-1, each group's entries contiguous."""
    n = entry_bytes.shape[0]
    n_groups = group_budget.shape[0]
    ent = _aligned_zeros(n, N_ENT)
    ent[:, LAST_TICK] = -1
    ent[:, LAST_LOAD] = -1
    ent[:, NEXT_USE] = NEVER
    ent[:, PROTECT] = -1
    ent[:, PRED_MARK] = -1
    ent[:, GROUP] = group
    ent[:, BYTES] = entry_bytes
    ent[:, RES_POS] = -1
    grp = np.zeros((n_groups, N_GRP), np.int64)
    counts = np.bincount(group, minlength=n_groups).astype(np.int64)
    grp[1:, BASE] = np.cumsum(counts)[:-1]
    grp[:, BUDGET] = group_budget
    return ent, grp


def _aligned_zeros(rows: int, cols: int) -> np.ndarray:
    """int32 [rows, cols] whose rows start on 64-byte boundaries (one entry = one cache line)."""
    buf = np.zeros(rows * cols + 16, np.int32)
    off = (-buf.ctypes.data % 64) // 4
    return buf[off: off + rows * cols].reshape(rows, cols)


@njit(cache=True, inline="always")
def evictable(ent, e, load):
    """May ``e`` be evicted after ``load``? Resident, not touched by this load, not protected."""
    return ent[e, RESIDENT] == 1 and ent[e, LAST_LOAD] != load and ent[e, PROTECT] != load
