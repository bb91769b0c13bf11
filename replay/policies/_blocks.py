"""Victim search over the packed keys of the resident entries, in blocks with a per-block minimum.

For policies whose key changes only when the entry itself is visited (Belady: next use). The
victim is the evictable resident entry with the smallest (key, last tick), the same entry
:mod:`replay.policies._scan` or a heap would pick (the order is total, ticks being unique).

Layout (one eviction group; ``ps`` is one flat int64 array, offsets in a header): the resident
entries sit densely at positions ``0 .. CNT-1`` (``DENT[pos]`` = entry, ``POS[e]`` = position,
an eviction moves the last one into the hole) with their packed key ``DKEY[pos] = key << 32 |
last tick``; positions are cut into blocks of :data:`BLOCK` and ``BMIN[b]`` is exactly the
smallest key of block b (free positions hold KMAX). The victim search reduces the block minima to
the smallest, finds its block, then its position in the block: three branch-free loops that LLVM
vectorises (AVX2: four keys per compare), O(CNT / BLOCK + BLOCK), over state that stays in L1/L2
(about 24 bytes per resident entry, and ``POS``: 8 bytes per entry). A heap costs log2(size)
data-dependent branches per eviction (mispredicted about half the time) plus a sift per visit;
here a visit costs a few loads and stores.

Entries the current load visited are pinned (not evictable after it), and for Belady they are
often the furthest (a miss is usually a rarely used expert): a heap or a scan keeps finding them
first and setting them aside (a third of the evictions at 64 entries in
``benchmarks.vs_libcachesim``). So a visited entry is *pending*: its key is KMAX (never the
smallest) until the load is over, and it gets its real key, from ``ent`` as the driver left it,
at the first hook of a later load (a hook knows the current load from ``ent[PIN, e]``, which the
driver stamps before calling it; ``pick_victim`` is told). Entries pinned without a visit (a
what-if's retention) are still found; they are set aside (KMAX) while the search goes on and
restored after it.

Measured on the top-1 trace of ``benchmarks.vs_libcachesim`` (960,000 requests; noisy shared
2-core AMD EPYC; kernel time per request, best of 15 runs interleaved in one process): 49-54 /
41-45 / 28-31 ns at 64 / 512 / 2048 entries, where the lazy-deletion heap this replaced took
79-85 / 69-73 / 51-53 (LRU: 20-23); with another process doing random memory accesses on the
other core, 67-73 / 55-57 / 37-40 (heap: 97-104 / 82-91 / 64-66). Throughput against
libCacheSim's Belady in that benchmark, 10 runs: 3.6-5.2x / 4.2-5.8x / 4.7-7.3x (the heap:
2.5-4.8x over the three). On the 20,000-token 48 x 128 top-8 synthetic trace (7.7 M routed
slots, 179 to 4874 entries): 14-67 M slots/s, 2.3-2.9x the heap. Tried and dropped: blocks of
8/16/32/128 keys (no better than 64); computing a block's new minimum before writing it, to dodge
store-to-load forwarding stalls (a compare per key more, 5-8% slower); recomputing dirty block
minima lazily at the next search (slower: a branch per block); numbering visits in the policy
instead of reading the driver's ticks (3% faster at 64 entries, 3% slower at 2048: not worth the code).

Requires ``0 <= key < 2^31`` and ``NEEDS_TICK`` (the driver keeps ``ent[LAST_TICK]``).
"""

from __future__ import annotations

import numpy as np

from replay.core.state import LAST_TICK, PIN, evictable
from replay.policies._lists import make_pending
from traces.util.jit import njit

BLOCK = 64  # keys per block, a power of two (read by init at each replay: a test may shrink it)
KMAX = np.int64((1 << 63) - 1)  # free position, or pending entry
# header words
CNT, BLK, SHIFT, DKEY, DENT, POS, BMIN, STASH, PEND, PEND_N, PEND_LOAD = range(11)
HDR = 16


def init(ent: np.ndarray, grp: np.ndarray, seed: int) -> np.ndarray:
    if grp.shape[0] != 1:
        raise ValueError("the key blocks serve one eviction group (a global cache)")
    blk = int(BLOCK)
    if blk < 1 or blk & (blk - 1):
        raise ValueError(f"block size {blk}: must be a power of two")
    n = ent.shape[1]
    cap = -(-n // blk) * blk
    nb = cap // blk
    off = {}
    at = HDR
    for name, size in ((DKEY, cap), (DENT, cap), (POS, n), (BMIN, nb), (STASH, 2 * cap), (PEND, cap)):
        off[name] = at
        at += size
    ps = np.zeros(at, np.int64)
    for name, o in off.items():
        ps[name] = o
    ps[BLK] = blk
    ps[SHIFT] = blk.bit_length() - 1
    ps[PEND_LOAD] = -1
    ps[off[DKEY]:off[DKEY] + cap] = KMAX
    ps[off[BMIN]:off[BMIN] + nb] = KMAX
    return ps


@njit(cache=True, inline="always")
def _ix(i):
    """An index known >= 0, as unsigned: Numba then emits no negative-index wraparound."""
    return np.uint64(i)


@njit(cache=True, inline="always")
def _region_at(ps, region, i):
    """Index of item ``i`` of the region whose offset is header word ``region``."""
    return _ix(ps[region] + i)


@njit(cache=True, inline="always")
def _block_min(ps, b):
    # The trip count comes from ps on purpose: a constant one gets unrolled instead of vectorised.
    o = ps[DKEY] + (b << ps[SHIFT])
    m = KMAX
    for i in range(ps[BLK]):
        v = ps[_ix(o + i)]
        m = v if v < m else m
    ps[_ix(ps[BMIN] + b)] = m


@njit(cache=True, inline="always")
def _lower_bmin(ps, pos, k):
    bi = _ix(ps[BMIN] + (pos >> ps[SHIFT]))
    if k < ps[bi]:
        ps[bi] = k


def make_block_hooks(key):
    """Hooks for ``key(ent, e) -> int64`` in [0, 2^31): smallest (key, last tick) evicted first."""

    @njit(cache=True, inline="always")
    def _item_key(ent, e):
        return (key(ent, e) << 32) | np.int64(ent[LAST_TICK, e])

    @njit(cache=True, inline="always")
    def _key_visited(ps, ent, e):
        """A later load has begun: an entry the previous one visited gets its real key."""
        pos = ps[_ix(ps[POS] + e)]
        k = _item_key(ent, e)
        ps[_ix(ps[DKEY] + pos)] = k
        _lower_bmin(ps, pos, k)

    # The visited entries of the current load, keyed at the first hook of a later load.
    _pend, _flush = make_pending(_region_at, PEND, PEND_N, PEND_LOAD, _key_visited)

    @njit(cache=True, inline="always")
    def on_admit(ps, ent, grp, g, e):
        _flush(ps, ent, np.int64(ent[PIN, e]))
        _pend(ps, e)
        pos = ps[CNT]
        ps[CNT] = pos + 1
        ps[_ix(ps[DENT] + pos)] = e  # DKEY[pos] is already KMAX (free): pending
        ps[_ix(ps[POS] + e)] = pos

    @njit(cache=True, inline="always")
    def on_touch(ps, ent, grp, g, e):
        _flush(ps, ent, np.int64(ent[PIN, e]))
        pos = ps[_ix(ps[POS] + e)]
        ki = _ix(ps[DKEY] + pos)
        old = ps[ki]
        if old == KMAX:
            return  # a repeat inside this load: already pending
        _pend(ps, e)
        ps[ki] = KMAX
        b = pos >> ps[SHIFT]
        if old == ps[_ix(ps[BMIN] + b)]:
            _block_min(ps, b)

    @njit(cache=True, inline="always")
    def on_evict(ps, ent, grp, g, e):
        last = ps[CNT] - 1
        ps[CNT] = last
        pos = ps[_ix(ps[POS] + e)]
        moved = ps[_ix(ps[DENT] + last)]
        mk = ps[_ix(ps[DKEY] + last)]
        ps[_ix(ps[DKEY] + pos)] = mk
        ps[_ix(ps[DENT] + pos)] = moved
        ps[_ix(ps[POS] + moved)] = pos
        ps[_ix(ps[DKEY] + last)] = KMAX
        sh = ps[SHIFT]
        lb = last >> sh
        if lb != (pos >> sh) and mk == ps[_ix(ps[BMIN] + lb)]:
            _block_min(ps, lb)  # the moved key was its old block's smallest
        _block_min(ps, pos >> sh)  # e (the victim) was its block's smallest

    @njit(cache=True, inline="always")
    def pick_victim(ps, ent, grp, g, load):
        _flush(ps, ent, load)
        nb = (ps[CNT] + ps[BLK] - 1) >> ps[SHIFT]
        bo = ps[BMIN]
        n_stash = 0
        victim = -1
        while True:
            m = KMAX
            for b in range(nb):
                v = ps[_ix(bo + b)]
                m = v if v < m else m
            if m == KMAX:
                break  # nothing resident, or all of it pinned
            bsel = nb
            for b in range(nb):
                c = b if ps[_ix(bo + b)] == m else nb
                bsel = c if c < bsel else bsel
            o = ps[DKEY] + (bsel << ps[SHIFT])
            isel = ps[BLK]
            for i in range(ps[BLK]):
                c = i if ps[_ix(o + i)] == m else ps[BLK]
                isel = c if c < isel else isel
            pos = (bsel << ps[SHIFT]) + isel
            e = ps[_ix(ps[DENT] + pos)]
            if evictable(ent, e, load):
                victim = e
                break
            # Pinned without a visit (a what-if's retention): set aside while the search goes on.
            ps[_ix(ps[STASH] + 2 * n_stash)] = pos
            ps[_ix(ps[STASH] + 2 * n_stash + 1)] = m
            n_stash += 1
            ps[_ix(ps[DKEY] + pos)] = KMAX
            _block_min(ps, bsel)
        for s in range(n_stash):
            pos = ps[_ix(ps[STASH] + 2 * s)]
            k = ps[_ix(ps[STASH] + 2 * s + 1)]
            ps[_ix(ps[DKEY] + pos)] = k
            _lower_bmin(ps, pos, k)
        return victim

    return on_admit, on_touch, pick_victim, on_evict
