"""``lru``: global least-recently-used over (layer, expert) entries (what the engine ran).

Recency is the tick of the last visit, token-major inside a load, repeats included. A doubly
linked list per eviction group keeps entries in recency order (head = least recent), so every
hook is O(1): the current load's entries all sit at the tail, so the victim search from the head
stops at the first evictable entry (it walks only past protected entries, or through the whole
group when the load touched all of it, which is an overflow).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from replay.cache_state import GROUP, evictable

PARTITION = "global"  # one eviction group over all layers
UNBOUNDED = False
NEEDS_NEXT_USE = False

PREV, NEXT, HEAD, TAIL = 0, 1, 2, 3  # ps columns; HEAD/TAIL rows are groups; -1 = none


def init(ent: np.ndarray, grp: np.ndarray, seed: int) -> np.ndarray:
    return np.full((max(ent.shape[0], grp.shape[0]), 4), -1, np.int32)


@njit(cache=True, inline="always")
def _unlink(ps, ent, e):
    g = ent[e, GROUP]
    p, q = ps[e, PREV], ps[e, NEXT]
    if p >= 0:
        ps[p, NEXT] = q
    else:
        ps[g, HEAD] = q
    if q >= 0:
        ps[q, PREV] = p
    else:
        ps[g, TAIL] = p


@njit(cache=True, inline="always")
def _append(ps, ent, e):
    g = ent[e, GROUP]
    t = ps[g, TAIL]
    ps[e, PREV] = t
    ps[e, NEXT] = -1
    if t >= 0:
        ps[t, NEXT] = e
    else:
        ps[g, HEAD] = e
    ps[g, TAIL] = e


@njit(cache=True, inline="always")
def on_admit(ps, ent, grp, e):
    _append(ps, ent, e)


@njit(cache=True, inline="always")
def on_touch(ps, ent, grp, e):
    if ps[ent[e, GROUP], TAIL] != e:  # already the most recent: nothing to move
        _unlink(ps, ent, e)
        _append(ps, ent, e)


@njit(cache=True, inline="always")
def pick_victim(ps, ent, grp, g, load):
    e = ps[g, HEAD]
    while e >= 0 and not evictable(ent, e, load):
        e = ps[e, NEXT]
    return e


@njit(cache=True, inline="always")
def on_evict(ps, ent, grp, e):
    _unlink(ps, ent, e)
