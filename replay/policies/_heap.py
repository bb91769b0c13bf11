"""Victim search with an indexed binary min-heap per eviction group, ordered by (key, last tick).

For policies whose key changes only when the entry itself is touched (LFU: frequency; Belady:
next use), a heap gives the same victim as the scan in :mod:`replay.policies._scan` (the smallest
(key, last_tick) among evictable entries; the order is total, ticks being unique) in O(log n).
Entries the current load touched (or protected ones) are not evictable: ``pick_victim`` pops them
into a scratch stash until the top is evictable, then pushes them back, so the heap stays valid.

ps columns: HEAP (slot -> entry, group g's heap in rows BASE[g] ..), POS (entry -> slot, -1 if
absent), SIZE (row g: the group's heap size), STASH (scratch).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from replay.cache_state import BASE, GROUP, LAST_TICK, evictable

HEAP, POS, SIZE, STASH = 0, 1, 2, 3


def init(ent: np.ndarray, grp: np.ndarray, seed: int) -> np.ndarray:
    ps = np.zeros((max(ent.shape[0], grp.shape[0]), 4), np.int32)
    ps[:, POS] = -1
    return ps


def make_heap_hooks(key):
    @njit(cache=True, inline="always")
    def less(ent, a, b):
        ka = key(ent, a)
        kb = key(ent, b)
        return ka < kb or (ka == kb and ent[a, LAST_TICK] < ent[b, LAST_TICK])

    @njit(cache=True)
    def sift_up(ps, ent, base, i):
        e = ps[base + i, HEAP]
        while i > 0:
            parent = (i - 1) >> 1
            p = ps[base + parent, HEAP]
            if not less(ent, e, p):
                break
            ps[base + i, HEAP] = p
            ps[p, POS] = base + i
            i = parent
        ps[base + i, HEAP] = e
        ps[e, POS] = base + i

    @njit(cache=True)
    def sift_down(ps, ent, base, size, i):
        e = ps[base + i, HEAP]
        while True:
            c = 2 * i + 1
            if c >= size:
                break
            if c + 1 < size and less(ent, ps[base + c + 1, HEAP], ps[base + c, HEAP]):
                c += 1
            ce = ps[base + c, HEAP]
            if not less(ent, ce, e):
                break
            ps[base + i, HEAP] = ce
            ps[ce, POS] = base + i
            i = c
        ps[base + i, HEAP] = e
        ps[e, POS] = base + i

    @njit(cache=True)
    def push(ps, ent, grp, e):
        g = ent[e, GROUP]
        base = grp[g, BASE]
        n = ps[g, SIZE]
        ps[base + n, HEAP] = e
        ps[e, POS] = base + n
        ps[g, SIZE] = n + 1
        sift_up(ps, ent, base, n)

    @njit(cache=True)
    def remove(ps, ent, grp, e):
        g = ent[e, GROUP]
        base = grp[g, BASE]
        n = ps[g, SIZE] - 1
        i = ps[e, POS] - base
        ps[e, POS] = -1
        ps[g, SIZE] = n
        if i == n:
            return
        last = ps[base + n, HEAP]
        ps[base + i, HEAP] = last
        ps[last, POS] = base + i
        sift_up(ps, ent, base, i)
        sift_down(ps, ent, base, n, ps[last, POS] - base)

    @njit(cache=True, inline="always")
    def on_admit(ps, ent, grp, e):
        push(ps, ent, grp, e)

    @njit(cache=True, inline="always")
    def on_touch(ps, ent, grp, e):
        # The key and the tick may both have moved: restore the heap order around e.
        g = ent[e, GROUP]
        base = grp[g, BASE]
        sift_up(ps, ent, base, ps[e, POS] - base)
        sift_down(ps, ent, base, ps[g, SIZE], ps[e, POS] - base)

    @njit(cache=True, inline="always")
    def on_evict(ps, ent, grp, e):
        remove(ps, ent, grp, e)

    @njit(cache=True, inline="always")
    def pick_victim(ps, ent, grp, g, load):
        base = grp[g, BASE]
        n_stash = 0
        victim = -1
        while ps[g, SIZE] > 0:
            top = ps[base, HEAP]
            if evictable(ent, top, load):
                victim = top
                break
            remove(ps, ent, grp, top)
            ps[n_stash, STASH] = top
            n_stash += 1
        for i in range(n_stash):
            push(ps, ent, grp, ps[i, STASH])
        return victim

    return on_admit, on_touch, pick_victim, on_evict
