"""Victim search with a lazy-deletion binary min-heap per eviction group, ordered by (key, last tick).

For policies whose key changes only when the entry itself is visited (Belady: next use), every
visit *pushes* a fresh item ``(key << 32 | tick, entry)`` and nothing is ever updated in place:
the item an entry got at its last visit is its only *current* one (ticks are unique per visit),
all older ones are stale and are discarded when they reach the top. An item is current iff the
entry is resident and ``ent[LAST_TICK, e]`` equals the item's tick (a re-admitted entry has a new
tick, so an item from before its eviction is stale too; ``on_evict`` therefore does nothing).

The victim is the current item with the smallest (key, tick) among evictable entries: the same
entry :mod:`replay.policies._heap` (indexed heap) and :mod:`replay.policies._scan` would pick, the
order being total. Compared with the indexed heap, a touch is one push of a packed int64 (compared
in one contiguous row, no random reads of ``ent`` per comparison, no sift-down) instead of a
re-sort around the entry: in ``benchmarks.vs_libcachesim`` Belady went from 1.7-2.4x
libCacheSim's throughput to 2.5-4.8x (noisy shared 2-core machine; 64 entries is the weakest).

Requires ``0 <= key < 2^31`` and ``NEEDS_TICK`` (the driver keeps ``ent[LAST_TICK]``). Stale
items are bounded: when a group's heap reaches its threshold, only the current items (at most one
per resident entry) are kept and re-heapified in O(size), and the next threshold is twice what
was kept plus 64 (never above the segment, ``2 x entries + 16``), so a push costs O(1) amortised
plus the sift, and the heap stays a small multiple of the resident count (a small cache keeps a
shallow heap; stale items mostly sink, since an entry's old item predicted the visit that made it
stale, i.e. the nearest possible next use).

ps int64, rows: KEY (packed key), ITEM (entry), META (group g: base, size, capacity, threshold at
columns 4g .. 4g + 3), STASH_KEY / STASH_ITEM (scratch for entries the current load pins).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from replay.cache_state import GROUP, LAST_TICK, RESIDENT, evictable

KEY, ITEM, META, STASH_KEY, STASH_ITEM = 0, 1, 2, 3, 4
BASE_, SIZE_, CAP_, THRESH_ = 0, 1, 2, 3  # META columns 4g + these
TICK_MASK = (1 << 32) - 1


def init(ent: np.ndarray, grp: np.ndarray, seed: int) -> np.ndarray:
    n_groups = grp.shape[0]
    counts = np.bincount(ent[GROUP], minlength=n_groups)[:n_groups] if n_groups else np.zeros(0, np.int64)
    # ent's padding columns are counted in group 0 (GROUP 0): harmless, they only add capacity.
    caps = 2 * counts.astype(np.int64) + 16
    total = max(int(caps.sum()), 4 * n_groups, 1)
    ps = np.zeros((5, total), np.int64)
    bases = np.concatenate([[0], np.cumsum(caps)[:-1]]).astype(np.int64)
    for g in range(n_groups):
        ps[META, 4 * g + BASE_] = bases[g]
        ps[META, 4 * g + CAP_] = caps[g]
        ps[META, 4 * g + THRESH_] = min(int(caps[g]), 64)
    return ps


@njit(cache=True, inline="always")
def _current(ps, ent, i):
    e = ps[ITEM, i]
    return ent[RESIDENT, e] == 1 and ent[LAST_TICK, e] == (ps[KEY, i] & TICK_MASK)


@njit(cache=True)
def _sift_up(ps, base, i):
    key = ps[KEY, base + i]
    item = ps[ITEM, base + i]
    while i > 0:
        parent = (i - 1) >> 1
        pk = ps[KEY, base + parent]
        if pk <= key:
            break
        ps[KEY, base + i] = pk
        ps[ITEM, base + i] = ps[ITEM, base + parent]
        i = parent
    ps[KEY, base + i] = key
    ps[ITEM, base + i] = item


@njit(cache=True)
def _sift_down(ps, base, size, i):
    key = ps[KEY, base + i]
    item = ps[ITEM, base + i]
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        ck = ps[KEY, base + c]
        if c + 1 < size and ps[KEY, base + c + 1] < ck:
            c += 1
            ck = ps[KEY, base + c]
        if key <= ck:
            break
        ps[KEY, base + i] = ck
        ps[ITEM, base + i] = ps[ITEM, base + c]
        i = c
    ps[KEY, base + i] = key
    ps[ITEM, base + i] = item


@njit(cache=True)
def _compact(ps, ent, g):
    """Keep only the current items of group g's segment and restore the heap order."""
    base = ps[META, 4 * g + BASE_]
    size = ps[META, 4 * g + SIZE_]
    n = 0
    for i in range(base, base + size):
        if _current(ps, ent, i):
            ps[KEY, base + n] = ps[KEY, i]
            ps[ITEM, base + n] = ps[ITEM, i]
            n += 1
    ps[META, 4 * g + SIZE_] = n
    ps[META, 4 * g + THRESH_] = min(ps[META, 4 * g + CAP_], 2 * n + 64)
    for i in range(n // 2 - 1, -1, -1):
        _sift_down(ps, base, n, i)


@njit(cache=True, inline="always")
def _push(ps, ent, g, key, e):
    if ps[META, 4 * g + SIZE_] >= ps[META, 4 * g + THRESH_]:
        _compact(ps, ent, g)
    base = ps[META, 4 * g + BASE_]
    n = ps[META, 4 * g + SIZE_]
    ps[KEY, base + n] = key
    ps[ITEM, base + n] = e
    ps[META, 4 * g + SIZE_] = n + 1
    _sift_up(ps, base, n)


@njit(cache=True, inline="always")
def _pop(ps, g):
    base = ps[META, 4 * g + BASE_]
    n = ps[META, 4 * g + SIZE_] - 1
    ps[META, 4 * g + SIZE_] = n
    if n > 0:
        ps[KEY, base] = ps[KEY, base + n]
        ps[ITEM, base] = ps[ITEM, base + n]
        _sift_down(ps, base, n, 0)


def make_lazy_heap_hooks(key):
    """Hooks for ``key(ent, e) -> int64`` in [0, 2^31): smallest (key, last tick) evicted first."""

    @njit(cache=True, inline="always")
    def _item_key(ent, e):
        return (key(ent, e) << 32) | np.int64(ent[LAST_TICK, e])

    @njit(cache=True, inline="always")
    def on_admit(ps, ent, grp, g, e):
        _push(ps, ent, g, _item_key(ent, e), e)

    @njit(cache=True, inline="always")
    def on_touch(ps, ent, grp, g, e):
        _push(ps, ent, g, _item_key(ent, e), e)  # the previous item of e is stale from now on

    @njit(cache=True, inline="always")
    def on_evict(ps, ent, grp, g, e):
        pass  # its item turns stale when the driver clears ent[RESIDENT, e]

    @njit(cache=True, inline="always")
    def pick_victim(ps, ent, grp, g, load):
        base = ps[META, 4 * g + BASE_]
        n_stash = 0
        victim = -1
        while ps[META, 4 * g + SIZE_] > 0:
            if not _current(ps, ent, base):
                _pop(ps, g)
                continue
            e = ps[ITEM, base]
            if evictable(ent, e, load):
                victim = e
                break
            # Pinned by this load: set aside, put back below (its item stays current).
            ps[STASH_KEY, n_stash] = ps[KEY, base]
            ps[STASH_ITEM, n_stash] = e
            n_stash += 1
            _pop(ps, g)
        for i in range(n_stash):
            _push(ps, ent, g, ps[STASH_KEY, i], ps[STASH_ITEM, i])
        return victim

    return on_admit, on_touch, pick_victim, on_evict
