"""The expert cache's state, shared by the replay driver and every policy.

One *entry* is one (MoE layer, expert) pair, numbered ``entry = lidx * n_expert + expert`` where
``lidx`` is the layer's position in ``trace.moe_layers``; it costs ``ent[BYTES, e]`` bytes (the
layer's ``expert_bytes``; layers of one model differ). Entries are split into eviction *groups*:
one group for a global cache, one group per MoE layer for the partitioned policies (``layer``,
``layerlfu``, ``layerlfu-incache``); each group owns a contiguous segment of the resident list.

The state is two matrices (``ent`` int32, field-major: one row per field, one column per entry;
``grp`` int64, one row per group), so a hook gets the whole state for the price of a pointer (a
tuple of 16 arrays is copied and reference-counted at every call: measured 25x slower), and each
field is one contiguous row: the hot ones a replay touches per routed slot (``PIN``,
``RESIDENT``, and ``LAST_TICK`` / ``FREQ`` / ``LAST_LOAD`` only where they are read) stay in a few
KiB of cache whichever entries the router names, instead of one 64-byte line per entry for all
16 fields of an entry-major matrix (measured on the 48 x 128 top-8 LRU benchmark: entry-major 69-86
M slots/s for a bare LRU loop, field-major 95-118). int32 limits a replay to
:data:`MAX_SLOTS` routed slots (checked before replay).

- ``ent[FIELD, e]`` per entry, fields below; ``grp[g, FIELD]`` per group.

The driver (:mod:`replay.core.driver`) is the only writer of these fields; a policy keeps
whatever else it needs in its own int64 matrix ``ps``. Times are counted two ways:

- ``tick``: one per visited routed slot (repeats included), so recency inside a load is
  token-major, exactly as the engine visits it; ticks are unique per entry, so "least recent" is
  a total order and every tie-break is deterministic.
- ``load``: the index of the (batch, layer) group being replayed, 0-based over the whole trace
  (the *clock* LFRU ages by). ``ent[PIN, e] == load`` means the current load touched ``e`` (or,
  in a what-if, filled or protected it); such an entry is never evicted after that load
  (docs/design.md, "Replay semantics", rule 3). During a load's lookups it is also the driver's
  "already looked up in this load" stamp (fills and retention write it only after the lookups).

Fields of the what-ifs (prefetch, retention, eviction guard; :mod:`replay.core.driver`):

- ``SPEC``: 1 while an entry was filled speculatively (prefetch) and not yet used by a demand
  lookup; the driver reports a demand hit on such an entry as residency code 2 and clears the
  flag; a victim with ``SPEC == 1`` was "evicted unused".
- ``PIN``: retention protects predicted entries by setting ``ent[PIN, e] = load``, so one field
  says "not evictable after this load" for all three reasons; every policy's victim search goes
  through :func:`evictable`.
- ``HEAT``: the eviction guard's demand heat (lifetime, whatever the policy's ``FREQ_SINCE``);
  ``PRED_MARK``: dedupes the predictions of one speculative step.
"""

from __future__ import annotations

import numpy as np

from traces.util.jit import njit

# ent rows (fields)
RESIDENT = 0  # 1 while cached
LAST_TICK = 1  # tick of the last visit (recency, token-major inside a load); -1 never. Kept only for a policy with NEEDS_TICK
LAST_LOAD = 2  # load of the last demand lookup or fill; -1 never. Kept only in what-ifs (guard) or for NEEDS_LAST_LOAD
FREQ = 3  # demand loads that looked it up, since the run began or since its admission (the policy's FREQ_SINCE). Only with NEEDS_FREQ
NEXT_USE = 4  # next load touching it after its last visit (Belady); NEVER if none
OUTCOME = 5  # residency code of its lookup in its last load (a repeat reports the same)
SPEC = 6  # 1 = filled speculatively, not yet demanded (prefetch extension)
PIN = 7  # == load -> not evictable after that load (looked up, filled, or protected by retention then); -1 never
GROUP = 8  # eviction group
BYTES = 9  # bytes of the entry
RES_LIST = 10  # resident entries; group g in ent[RES_LIST, BASE[g] : BASE[g] + COUNT[g]]
RES_POS = 11  # position of a resident entry in RES_LIST, -1 if not resident
HEAT = 12  # demand lookups over the whole replay, never reset, never raised by a speculative fill (eviction guard)
PRED_MARK = 13  # the load whose speculative step last considered it (dedupes predictions); -1 never
N_ENT = 14
# grp columns
BASE = 0  # first index of the group's resident-list segment
BUDGET = 1  # bytes the group may hold after a load
USED = 2  # bytes resident in the group
COUNT = 3  # resident entries in the group
BATCH_LOAD = 4  # first load of the batch being replayed (written once per batch, only for a policy with NEEDS_BATCH)
N_GRP = 5

NEVER = (1 << 31) - 1  # next use of an entry no later load touches: infinitely far
MAX_SLOTS = (1 << 31) - 2  # ticks and load indexes are int32: a trace may hold this many routed slots


def new_state(entry_bytes: np.ndarray, group: np.ndarray, group_budget: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An empty cache: (ent, grp). ``group`` numbers groups 0..n-1, each group's entries contiguous.
    ``ent`` has :func:`row_length` columns, at least one per entry; a policy's own field-major
    matrix should use ``ent.shape[1]`` columns too (the same padding)."""
    n = entry_bytes.shape[0]
    n_groups = group_budget.shape[0]
    ent = np.zeros((N_ENT, row_length(n)), np.int32)
    ent[LAST_TICK] = -1
    ent[LAST_LOAD] = -1
    ent[NEXT_USE] = NEVER
    ent[PIN] = -1
    ent[PRED_MARK] = -1
    ent[GROUP, :n] = group
    ent[BYTES, :n] = entry_bytes
    ent[RES_POS] = -1
    grp = np.zeros((n_groups, N_GRP), np.int64)
    counts = np.bincount(group, minlength=n_groups).astype(np.int64)
    grp[1:, BASE] = np.cumsum(counts)[:-1]
    grp[:, BUDGET] = group_budget
    grp[:, BATCH_LOAD] = -1
    return ent, grp


def row_length(n: int) -> int:
    """Columns of a field-major state matrix for ``n`` entries: ``n`` rounded up to whole 64-byte
    lines, and to an odd number of them. Rows a multiple of 4 KiB long (48 x 128 entries x 4 bytes
    = 6 x 4 KiB) put every field of one entry in the same L1 set (8 ways for 14+ fields) and make
    loads 4K-alias stores to other fields: that measured 2x slower on the LRU benchmark. With an odd
    line count, rows 0..63 of one column fall in distinct sets. The extra columns are never
    entries (never resident, never named by a routing)."""
    lines = -(-max(n, 1) // 16)
    return 16 * (lines | 1)


def preload(ent: np.ndarray, grp: np.ndarray, e: int) -> None:
    """Make entry ``e`` resident before the replay starts (a policy's ``setup``, e.g. ``pin``): it
    is counted in its group's bytes and entries and listed in its resident-list segment, as an
    admitted entry would be, but no load read it (no miss, no read bytes)."""
    if ent[RESIDENT, e]:
        raise ValueError(f"entry {e} is preloaded twice")
    g = int(ent[GROUP, e])
    ent[RESIDENT, e] = 1
    grp[g, USED] += int(ent[BYTES, e])
    grp[g, COUNT] += 1
    pos = int(grp[g, BASE] + grp[g, COUNT] - 1)
    ent[RES_LIST, pos] = e
    ent[RES_POS, e] = pos


@njit(cache=True, inline="always")
def evictable(ent, e, load):
    """May the *resident* entry ``e`` be evicted after ``load``? Not touched, filled or protected
    then. (Every victim search walks resident entries only, so residency is not re-read here.)"""
    return ent[PIN, e] != load
