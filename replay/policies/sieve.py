"""``sieve``: SIEVE (Zhang et al., "SIEVE is Simpler than LRU", NSDI 2024), as libCacheSim
implements it (``libCacheSim/cache/eviction/Sieve.c``, the copy vendored by libcachesim 0.3.5).

One FIFO queue in admission order and one *visited* bit per entry. A hit sets the bit (nothing
moves). The *hand* starts at the oldest entry and moves towards the newest: a visited entry has
its bit cleared and is passed, the first unvisited one is the victim; the hand then rests on the
entry just newer than the victim (or, if the victim was the newest, goes back to the oldest at
the next eviction: libCacheSim's ``pointer = NULL``). Reaching the newest end wraps to the oldest.

Mapping onto this driver (byte budget, eviction once after each load, never an entry the load
touched):

- bytes: the queue holds entries of any size; eviction runs until the group's bytes fit the
  budget (libCacheSim's byte-sized cache does the same: it evicts until the request fits);
- the entries a load admits (misses, and a what-if's speculative fills) join the queue's newest
  end only after that load's eviction step, in admission order: libCacheSim evicts first and then
  inserts, so the hand never sees the incoming object (it is kept on a pending list and appended
  at the first hook of a later load);
- an entry the load touched (a hit) or one a what-if protects is not evictable: the hand treats
  it as any entry (a visited one has its bit cleared and is passed), an unvisited protected one is
  passed with its state unchanged;
- a repeat of an id inside one load is not a second lookup: it sets nothing (a repeat of a hit
  sets the already set bit; a repeat of a miss leaves the new entry unvisited);
- if a whole cycle finds nothing evictable the search gives up (-1: the load overflows), leaving
  the bits it cleared cleared and the hand where it was.

On a top-1, equal-size trace the hit counts equal libCacheSim's Sieve at every budget
(``benchmarks.policies_vs_libcachesim``).
"""

from __future__ import annotations

import numpy as np

from replay.core.state import PIN, evictable
from replay.policies._lists import make_list, make_pending, make_rows
from traces.util.jit import njit

PARTITION = "global"
UNBOUNDED = False
NEEDS_NEXT_USE = False
NEEDS_LAST_LOAD = False
NEEDS_TICK = False
NEEDS_FREQ = False

# ps int64, flat: a header, then per-entry rows NEXT (towards the newer end), PREV, VIS (visited
# bit), WHERE (0 absent, 1 queued, 2 pending), and the pending list PEND.
H_N, H_HEAD, H_TAIL, H_HAND, H_COUNT, H_PEND_N, H_PEND_LOAD = 0, 1, 2, 3, 4, 5, 6
HDR = 8
R_NEXT, R_PREV, R_VIS, R_WHERE, R_PEND = 0, 1, 2, 3, 4
ABSENT, QUEUED, PENDING = 0, 1, 2


def init(ent: np.ndarray, grp: np.ndarray, seed: int) -> np.ndarray:
    if grp.shape[0] != 1:
        raise ValueError("sieve serves one eviction group (a global cache)")
    n = ent.shape[1]
    ps = np.zeros(HDR + 5 * n, np.int64)
    ps[H_N] = n
    ps[HDR:HDR + 2 * n] = -1
    ps[H_HEAD] = ps[H_TAIL] = ps[H_HAND] = -1
    ps[H_PEND_LOAD] = -1
    return ps


_at, _prev_at, _next_at = make_rows(HDR, H_N, R_PREV, R_NEXT)


_push, _unlink = make_list(_prev_at, _next_at)


@njit(cache=True, inline="always")
def _join(ps, ent, e):
    """A held admission (a later load has begun) joins the newest end."""
    _push(ps, H_HEAD, H_TAIL, e)
    ps[_at(ps, R_WHERE, e)] = QUEUED
    ps[H_COUNT] += 1


_hold, _flush = make_pending(_at, R_PEND, H_PEND_N, H_PEND_LOAD, _join)


@njit(cache=True, inline="always")
def on_admit(ps, ent, grp, g, e):
    _flush(ps, ent, np.int64(ent[PIN, e]))
    _hold(ps, e)
    ps[_at(ps, R_WHERE, e)] = PENDING
    ps[_at(ps, R_VIS, e)] = 0


@njit(cache=True, inline="always")
def on_touch(ps, ent, grp, g, e):
    _flush(ps, ent, np.int64(ent[PIN, e]))
    if ps[_at(ps, R_WHERE, e)] == QUEUED:
        ps[_at(ps, R_VIS, e)] = 1


@njit(cache=True, inline="always")
def pick_victim(ps, ent, grp, g, load):
    _flush(ps, ent, load)
    e = ps[H_HAND]
    limit = 3 * ps[H_COUNT] + 3  # a partial pass, one pass clearing every bit, one pass finding any evictable
    for _ in range(limit):
        if e < 0:
            e = ps[H_HEAD]  # wrap to the oldest
            if e < 0:
                return -1
        vi = _at(ps, R_VIS, e)
        if ps[vi] != 0:
            ps[vi] = 0
        elif evictable(ent, e, load):
            return e
        e = ps[_at(ps, R_NEXT, e)]
    return -1


@njit(cache=True, inline="always")
def on_evict(ps, ent, grp, g, e):
    # the entry just newer than the victim; -1 (the victim was the newest): the oldest next time
    ps[H_HAND] = ps[_at(ps, R_NEXT, e)]
    _unlink(ps, H_HEAD, H_TAIL, e)
    ps[_at(ps, R_WHERE, e)] = ABSENT
    ps[_at(ps, R_VIS, e)] = 0
    ps[H_COUNT] -= 1


