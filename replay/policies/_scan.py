"""Victim search by scanning a group's resident entries for the smallest key.

A policy whose key is not kept in order by the other hooks (today ``random``, whose key is drawn
afresh at each eviction) gives ``key(ps, ent, e, load) -> int64``; the victim is the evictable
entry with the smallest key, ties to the least recently used (ticks are unique, so the choice
never depends on the resident list's order and the naive twin can take ``min`` over a set and
agree exactly). O(resident entries of the group) per eviction. A policy using it must set
``NEEDS_RESIDENT_LIST = True``. (LFU and LFRU use :mod:`._heap`, Belady :mod:`._blocks`.)

Also here: :func:`no_op` (a hook that does nothing), :func:`no_state` (an ``init`` for a
policy without state of its own), shared by ``infinite``, ``opt-bound`` and ``random``, and
:func:`never_evict` (the ``pick_victim`` of a policy that never evicts: ``infinite``, and
``opt-bound``, whose hooks are never run).
"""

from __future__ import annotations

import numpy as np

from replay.core.state import BASE, COUNT, LAST_TICK, RES_LIST, evictable
from traces.util.jit import njit


def make_pick_victim(key):
    @njit(cache=True, inline="always")
    def pick_victim(ps, ent, grp, g, load):
        best = -1
        best_key = 0
        base = grp[g, BASE]
        for i in range(base, base + grp[g, COUNT]):
            e = ent[RES_LIST, i]
            if not evictable(ent, e, load):
                continue
            k = key(ps, ent, e, load)
            if best < 0 or k < best_key or (k == best_key and ent[LAST_TICK, e] < ent[LAST_TICK, best]):
                best = e
                best_key = k
        return best

    return pick_victim


@njit(cache=True, inline="always")
def no_op(ps, ent, grp, g, e):
    pass


@njit(cache=True, inline="always")
def never_evict(ps, ent, grp, g, load):
    return -1


def no_state(ent: np.ndarray, grp: np.ndarray, seed: int) -> np.ndarray:
    return np.zeros((1, 1), np.int64)
