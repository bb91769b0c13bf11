"""Victim search with an indexed binary min-heap per eviction group, ordered by (key, last tick).

For policies whose key ``key(ent, e)`` changes only when the entry itself is touched (``lfu``,
``lfu-incache`` and ``lfru``: the frequency; Belady uses the blocks of :mod:`._blocks` instead),
a heap gives the same victim as the scan in :mod:`replay.policies._scan` (the smallest
(key, last_tick) among evictable entries; the order is total, ticks being unique) in O(log n).
Entries the current load touched (or protected ones) are not evictable: ``pick_victim`` pops them
into a scratch stash until the top is evictable, then pushes them back, so the heap stays valid.

``ps`` int32 [4, max(entries, groups)], field-major as ``ent``: row HEAP (slot -> entry, group
g's heap in columns ``grp[g, BASE]`` ..), POS (entry -> slot, -1 if absent), SIZE (column g: the
group's heap size), STASH (scratch for the entries popped while searching).
"""

from __future__ import annotations

import numpy as np

from replay.core.state import BASE, LAST_TICK, evictable
from traces.util.jit import njit

HEAP, POS, SIZE, STASH = 0, 1, 2, 3


def init(ent: np.ndarray, grp: np.ndarray, seed: int) -> np.ndarray:
    ps = np.zeros((4, max(ent.shape[1], grp.shape[0])), np.int32)
    ps[POS] = -1
    return ps


@njit(cache=True, inline="always")
def _place(ps, base, i, e):
    """Entry ``e`` into heap slot ``i`` (of the group's heap at column ``base``), and its position."""
    ps[HEAP, base + i] = e
    ps[POS, e] = base + i


def make_heap_hooks(key):
    @njit(cache=True, inline="always")
    def less(ent, a, b):
        ka = key(ent, a)
        kb = key(ent, b)
        return ka < kb or (ka == kb and ent[LAST_TICK, a] < ent[LAST_TICK, b])

    @njit(cache=True)
    def sift_up(ps, ent, base, i):
        e = ps[HEAP, base + i]
        while i > 0:
            parent = (i - 1) >> 1
            p = ps[HEAP, base + parent]
            if not less(ent, e, p):
                break
            _place(ps, base, i, p)
            i = parent
        _place(ps, base, i, e)

    @njit(cache=True)
    def sift_down(ps, ent, base, size, i):
        e = ps[HEAP, base + i]
        while True:
            c = 2 * i + 1
            if c >= size:
                break
            if c + 1 < size and less(ent, ps[HEAP, base + c + 1], ps[HEAP, base + c]):
                c += 1
            ce = ps[HEAP, base + c]
            if not less(ent, ce, e):
                break
            _place(ps, base, i, ce)
            i = c
        _place(ps, base, i, e)

    @njit(cache=True)
    def push(ps, ent, grp, g, e):
        base = grp[g, BASE]
        n = ps[SIZE, g]
        _place(ps, base, n, e)
        ps[SIZE, g] = n + 1
        sift_up(ps, ent, base, n)

    @njit(cache=True)
    def remove(ps, ent, grp, g, e):
        base = grp[g, BASE]
        n = ps[SIZE, g] - 1
        i = ps[POS, e] - base
        ps[POS, e] = -1
        ps[SIZE, g] = n
        if i == n:
            return
        last = ps[HEAP, base + n]
        _place(ps, base, i, last)
        sift_up(ps, ent, base, i)
        sift_down(ps, ent, base, n, ps[POS, last] - base)

    @njit(cache=True, inline="always")
    def on_admit(ps, ent, grp, g, e):
        push(ps, ent, grp, g, e)

    @njit(cache=True, inline="always")
    def on_touch(ps, ent, grp, g, e):
        # The key and the tick may both have moved: restore the heap order around e.
        base = grp[g, BASE]
        sift_up(ps, ent, base, ps[POS, e] - base)
        sift_down(ps, ent, base, ps[SIZE, g], ps[POS, e] - base)

    @njit(cache=True, inline="always")
    def on_evict(ps, ent, grp, g, e):
        remove(ps, ent, grp, g, e)

    @njit(cache=True, inline="always")
    def pick_victim(ps, ent, grp, g, load):
        base = grp[g, BASE]
        n_stash = 0
        victim = -1
        while ps[SIZE, g] > 0:
            top = ps[HEAP, base]
            if evictable(ent, top, load):
                victim = top
                break
            remove(ps, ent, grp, g, top)
            ps[STASH, n_stash] = top
            n_stash += 1
        for i in range(n_stash):
            push(ps, ent, grp, g, ps[STASH, i])
        return victim

    return on_admit, on_touch, pick_victim, on_evict
