"""``s3fifo``: S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023),
as libCacheSim implements it (``libCacheSim/cache/eviction/S3FIFO.c`` in the copy vendored by
libcachesim 0.3.5, the version ``make bench`` installs), with its default parameters
``small-size-ratio=0.10, ghost-size-ratio=0.90, move-to-main-threshold=2``.

Three FIFO queues, in bytes (``budget`` = the group's byte budget):

- *small* S, capacity ``budget // 10`` bytes (libCacheSim: ``(int64_t)(cache_size * 0.10)``);
- *main* M, capacity ``budget - budget // 10``;
- *ghost* G: keys (no data) of entries evicted from S, a FIFO of capacity ``budget * 9 // 10``
  bytes, each key counting its entry's bytes (libCacheSim's ghost is a FIFO cache of
  ``(int64_t)(cache_size * 0.90)`` bytes fed the evicted object's size: sized in *bytes*, 90% of
  the whole cache, which is one byte less than M's capacity when ``budget`` is not a multiple of 10).

Frequency: a 2-bit counter per entry, 0 at admission, +1 per load that looks the entry up while
it is resident (a hit; a repeat of an id inside one load counts once), saturating at 3
(libCacheSim counts without bound but only ever tests ``>= 2`` in S and uses ``min(freq, 3) - 1``
in M: the same decisions).

Admission (a miss, or a what-if's speculative fill): an entry whose key is in G leaves G and goes
to M; otherwise to S, except before the cache has first been full: while no eviction has been
needed yet and S already holds ``>= budget // 10`` bytes, it goes to M (libCacheSim 0.3.5's
``has_evicted`` rule; "full" here = this admission brings the resident bytes over the budget).

Eviction (each victim): if M holds more than its capacity or S is empty, evict from M, else from
S. From S: walk from the oldest; an entry with frequency >= 2 moves to M's newest end with
frequency 0 (libCacheSim inserts a fresh object); the first other one is the victim, and its key
enters G (G drops its oldest keys until it fits). From M: walk from the oldest; an entry with
frequency >= 1 is reinserted at M's newest end with frequency - 1 (CLOCK with a 2-bit counter),
the first with frequency 0 is the victim. If the chosen queue yields no victim, the other is tried
(and M again after S, for the entries S just moved).

Mapping onto this driver (byte budget, eviction once after each load, never an entry the load
touched):

- the entries a load admits join their queue (chosen at admission) only after that load's eviction
  step, in admission order (a pending list appended at the first hook of a later load), and their
  bytes do not count in S's or M's occupancy until then: libCacheSim evicts first and inserts the
  request after, so the queues it evicts from never hold the incoming object;
- an entry the load touched, or one a what-if protects, is not evictable: the walks treat it as
  any entry as far as moving goes (S: frequency >= 2 moves it to M; M: frequency >= 1 reinserts
  it one lower) and otherwise pass it in place, unchanged;
- libCacheSim refuses to cache an object of ``>= budget // 10`` bytes (its ``S3FIFO_insert``
  returns without inserting); this driver admits every miss, so at budgets under ten to twenty
  entries the two differ (such a cache keeps cycling entries through S);
- a search that finds nothing evictable returns -1 (the load overflows); moves it made stay.

On the top-1, equal-size trace of ``benchmarks.policies_vs_libcachesim`` the hit counts equal
libCacheSim's S3FIFO at every budget measured from 16 entries up; at 8 entries its small queue
holds 0 bytes and libCacheSim caches nothing at all.
"""

from __future__ import annotations

import numpy as np

from replay.core.state import BYTES, PIN, evictable
from replay.policies._lists import make_list, make_pending, make_rows
from traces.util.jit import njit

PARTITION = "global"
UNBOUNDED = False
NEEDS_NEXT_USE = False
NEEDS_LAST_LOAD = False
NEEDS_TICK = False
NEEDS_FREQ = False

SMALL_RATIO_TENTHS = 1  # small queue: budget * 1 // 10 bytes
GHOST_RATIO_TENTHS = 9  # ghost: budget * 9 // 10 bytes
MOVE_TO_MAIN = 2  # frequency at which an entry leaving S goes to M
FREQ_MAX = 3  # 2-bit counter

SMALL, MAIN, GHOST = 0, 1, 2
ABSENT, IN_SMALL, IN_MAIN, IN_GHOST, PEND_SMALL, PEND_MAIN = 0, 1, 2, 3, 4, 5
# header: per queue head / tail / bytes / capacity, then scalars
H_N, H_HEAD, H_TAIL, H_BYTES, H_CAP = 0, 1, 4, 7, 10
H_HAS_EVICTED, H_PEND_N, H_PEND_LOAD, H_BUDGET, H_PEND_SMALL, H_PEND_MAIN = 13, 14, 15, 16, 17, 18
HDR = 20
R_NEXT, R_PREV, R_FREQ, R_WHERE, R_LASTL, R_PEND = 0, 1, 2, 3, 4, 5


def init(ent: np.ndarray, grp: np.ndarray, seed: int) -> np.ndarray:
    if grp.shape[0] != 1:
        raise ValueError("s3fifo serves one eviction group (a global cache)")
    n = ent.shape[1]
    ps = np.zeros(HDR + 6 * n, np.int64)
    ps[H_N] = n
    ps[HDR:HDR + 2 * n] = -1
    ps[HDR + 4 * n:HDR + 5 * n] = -1
    for q in (SMALL, MAIN, GHOST):
        ps[H_HEAD + q] = ps[H_TAIL + q] = -1
    budget = int(grp[0, 1])
    small = budget * SMALL_RATIO_TENTHS // 10
    ps[H_CAP + SMALL] = small
    ps[H_CAP + MAIN] = budget - small
    ps[H_CAP + GHOST] = budget * GHOST_RATIO_TENTHS // 10
    ps[H_BUDGET] = budget
    ps[H_PEND_LOAD] = -1
    return ps


_at, _prev_at, _next_at = make_rows(HDR, H_N, R_PREV, R_NEXT)


_push_at, _unlink_at = make_list(_prev_at, _next_at)


@njit(cache=True, inline="always")
def _push(ps, q, e):
    """Append ``e`` at queue ``q``'s newest end."""
    _push_at(ps, H_HEAD + q, H_TAIL + q, e)


@njit(cache=True, inline="always")
def _unlink(ps, q, e):
    _unlink_at(ps, H_HEAD + q, H_TAIL + q, e)


@njit(cache=True, inline="always")
def _join(ps, ent, e):
    """A held admission (a later load has begun) joins the queue chosen at its admission; its bytes
    move from that queue's pending bytes to its occupancy."""
    wi = _at(ps, R_WHERE, e)
    q = SMALL if ps[wi] == PEND_SMALL else MAIN
    _push(ps, q, e)
    ps[wi] = IN_SMALL if q == SMALL else IN_MAIN
    ps[H_BYTES + q] += ent[BYTES, e]
    ps[H_PEND_SMALL if q == SMALL else H_PEND_MAIN] -= ent[BYTES, e]


_hold, _flush = make_pending(_at, R_PEND, H_PEND_N, H_PEND_LOAD, _join)


@njit(cache=True, inline="always")
def on_admit(ps, ent, grp, g, e):
    load = np.int64(ent[PIN, e])
    _flush(ps, ent, load)
    b = np.int64(ent[BYTES, e])
    total = ps[H_BYTES + SMALL] + ps[H_BYTES + MAIN] + ps[H_PEND_SMALL] + ps[H_PEND_MAIN]
    if total + b > ps[H_BUDGET]:
        ps[H_HAS_EVICTED] = 1  # the cache is full: libCacheSim would evict before inserting this one
    wi = _at(ps, R_WHERE, e)
    if ps[wi] == IN_GHOST:
        _unlink(ps, GHOST, e)
        ps[H_BYTES + GHOST] -= b
        to_main = True
    else:
        to_main = ps[H_HAS_EVICTED] == 0 and ps[H_BYTES + SMALL] + ps[H_PEND_SMALL] >= ps[H_CAP + SMALL]
    if to_main:
        ps[wi] = PEND_MAIN
        ps[H_PEND_MAIN] += b
    else:
        ps[wi] = PEND_SMALL
        ps[H_PEND_SMALL] += b
    _hold(ps, e)
    ps[_at(ps, R_FREQ, e)] = 0
    ps[_at(ps, R_LASTL, e)] = load


@njit(cache=True, inline="always")
def on_touch(ps, ent, grp, g, e):
    load = np.int64(ent[PIN, e])
    _flush(ps, ent, load)
    li = _at(ps, R_LASTL, e)
    if ps[li] != load:  # once per load (a repeat, or the load that admitted it, does not count)
        ps[li] = load
        fi = _at(ps, R_FREQ, e)
        if ps[fi] < FREQ_MAX:
            ps[fi] += 1


@njit(cache=True, inline="always")
def _from_main(ps, ent, load):
    e = ps[H_HEAD + MAIN]
    while e >= 0:
        nx = ps[_at(ps, R_NEXT, e)]
        fi = _at(ps, R_FREQ, e)
        if ps[fi] >= 1:
            ps[fi] -= 1
            _unlink(ps, MAIN, e)
            _push(ps, MAIN, e)
            if nx < 0:
                nx = e  # it was the newest and is again: look at it once more
        elif evictable(ent, e, load):
            return e
        e = nx
    return -1


@njit(cache=True, inline="always")
def _from_small(ps, ent, load):
    e = ps[H_HEAD + SMALL]
    while e >= 0:
        nx = ps[_at(ps, R_NEXT, e)]
        fi = _at(ps, R_FREQ, e)
        if ps[fi] >= MOVE_TO_MAIN:
            b = np.int64(ent[BYTES, e])
            _unlink(ps, SMALL, e)
            ps[H_BYTES + SMALL] -= b
            _push(ps, MAIN, e)
            ps[H_BYTES + MAIN] += b
            ps[_at(ps, R_WHERE, e)] = IN_MAIN
            ps[fi] = 0
        elif evictable(ent, e, load):
            return e
        e = nx
    return -1


@njit(cache=True, inline="always")
def pick_victim(ps, ent, grp, g, load):
    _flush(ps, ent, load)
    ps[H_HAS_EVICTED] = 1
    if ps[H_BYTES + MAIN] > ps[H_CAP + MAIN] or ps[H_BYTES + SMALL] == 0:
        v = _from_main(ps, ent, load)
        if v < 0:
            v = _from_small(ps, ent, load)
        if v < 0:
            v = _from_main(ps, ent, load)
        return v
    v = _from_small(ps, ent, load)
    if v < 0:
        v = _from_main(ps, ent, load)
    return v


@njit(cache=True, inline="always")
def on_evict(ps, ent, grp, g, e):
    b = np.int64(ent[BYTES, e])
    wi = _at(ps, R_WHERE, e)
    if ps[wi] == IN_MAIN:
        _unlink(ps, MAIN, e)
        ps[H_BYTES + MAIN] -= b
        ps[wi] = ABSENT
        return
    _unlink(ps, SMALL, e)
    ps[H_BYTES + SMALL] -= b
    ps[wi] = ABSENT
    cap = ps[H_CAP + GHOST]
    if b > cap:
        return  # too big for the ghost (libCacheSim's FIFO refuses it too)
    while ps[H_BYTES + GHOST] + b > cap:
        old = ps[H_HEAD + GHOST]
        _unlink(ps, GHOST, old)
        ps[H_BYTES + GHOST] -= np.int64(ent[BYTES, old])
        ps[_at(ps, R_WHERE, old)] = ABSENT
    _push(ps, GHOST, e)
    ps[H_BYTES + GHOST] += b
    ps[wi] = IN_GHOST
