"""``lru``: global least-recently-used over (layer, expert) entries (what the engine ran).

Recency is the order of visits, token-major inside a load, repeats included. A doubly linked list
per eviction group keeps entries in recency order (head = least recent), so every hook is O(1):
the current load's entries all sit at the tail, so the victim search from the head stops at the
first evictable entry (it walks only past protected entries, or through the whole group when the
load touched all of it, which is an overflow). The list is the recency, so the driver need not
keep ticks or frequencies for it.
"""

from __future__ import annotations

import numpy as np

from replay.core.state import evictable
from replay.policies._lists import make_list
from traces.util.jit import njit

PARTITION = "global"  # one eviction group over all layers
UNBOUNDED = False
NEEDS_NEXT_USE = False
NEEDS_LAST_LOAD = False
NEEDS_TICK = False
NEEDS_FREQ = False

# ps int32, flat and entry-major unlike ent: entry e's links at 2e + PREV / 2e + NEXT share one
# cache line (every hook reads or writes both), and a flat index has a compile-time stride (a 2-D
# index multiplies by a run-time stride that the slot loop keeps spilled). Group g's HEAD / TAIL
# sit in the pair counted backwards from the end. -1 = none.
PREV, NEXT = 0, 1
HEAD, TAIL = 0, 1


def init(ent: np.ndarray, grp: np.ndarray, seed: int) -> np.ndarray:
    return np.full(2 * (ent.shape[1] + grp.shape[0]), -1, np.int32)


@njit(cache=True, inline="always")
def _g(ps, g):
    return ps.shape[0] - 2 - 2 * g  # group pairs at the end, counted backwards (needs no n)


# Indexes cast to unsigned once known >= 0: Numba then emits no negative-index wraparound.
@njit(cache=True, inline="always")
def _prev_at(ps, e):
    return 2 * np.uint32(e) + PREV


@njit(cache=True, inline="always")
def _next_at(ps, e):
    return 2 * np.uint32(e) + NEXT


_push, _unlink_at = make_list(_prev_at, _next_at)


@njit(cache=True, inline="always")
def _unlink(ps, g, e):
    gr = _g(ps, g)
    _unlink_at(ps, gr + HEAD, gr + TAIL, e)


@njit(cache=True, inline="always")
def _append(ps, g, e):
    gr = _g(ps, g)
    _push(ps, gr + HEAD, gr + TAIL, e)


@njit(cache=True, inline="always")
def on_admit(ps, ent, grp, g, e):
    _append(ps, g, e)


@njit(cache=True, inline="always")
def on_touch(ps, ent, grp, g, e):
    if ps[_g(ps, g) + TAIL] != e:  # already the most recent: nothing to move
        _unlink(ps, g, e)
        _append(ps, g, e)


@njit(cache=True, inline="always")
def pick_victim(ps, ent, grp, g, load):
    e = ps[_g(ps, g) + HEAD]
    while e >= 0 and not evictable(ent, np.uint32(e), load):
        e = ps[2 * np.uint32(e) + NEXT]
    return e


@njit(cache=True, inline="always")
def on_evict(ps, ent, grp, g, e):
    _unlink(ps, g, e)
