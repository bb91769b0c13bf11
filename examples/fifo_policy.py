"""``fifo``: first in, first out — an example policy plugin for moe-replay.

Evicts the entry admitted longest ago; a hit changes nothing (unlike LRU, which moves the entry
to the most-recent end). Use it with::

    moe-replay cache TRACE --policy-file examples/fifo_policy.py --policies lru,fifo

or ``replay.cache(trace, policies=["lru", "fifo"], policy_file="examples/fifo_policy.py")``.

A policy module defines ``NAME``, the constants ``PARTITION`` ("global": one cache over all
layers, or "layer": one per MoE layer), ``UNBOUNDED`` and ``NEEDS_NEXT_USE``, ``init`` (plain
Python: the policy's own state array ``ps``) and four hooks compiled with
``@njit(inline="always")`` into the replay driver (see replay/core/driver.py for what each is
told): ``on_admit``, ``on_touch``, ``pick_victim`` (must only return entries for which
``replay.core.state.evictable`` holds, or -1) and ``on_evict``. ``NEEDS_TICK``, ``NEEDS_FREQ``
and ``NEEDS_LAST_LOAD`` = False tell the driver this policy reads none of those fields.

State: a doubly linked list per eviction group in admission order (head = oldest), in ``ps``:
entry e's links at ``2e`` (previous) and ``2e + 1`` (next), the group's head and tail in the
last two slots. Every hook is O(1) but the victim walk, which skips only entries the current load
touched (they cannot be evicted after it).
"""

import numpy as np
from numba import njit

from replay.core.state import evictable

NAME = "fifo"
PARTITION = "global"
UNBOUNDED = False
NEEDS_NEXT_USE = False
NEEDS_TICK = False
NEEDS_FREQ = False
NEEDS_LAST_LOAD = False


def state_shape(ent: np.ndarray, grp: np.ndarray) -> tuple[int, ...]:
    # what init returns; the driver refuses another shape before the replay (a short state would
    # let the hooks write past its end)
    return (2 * ent.shape[1] + 2,)


def init(ent: np.ndarray, grp: np.ndarray, seed: int) -> np.ndarray:
    # one global group: 2 links per entry, then head, tail; -1 = none
    return np.full(state_shape(ent, grp), -1, np.int32)


@njit(inline="always")
def on_admit(ps, ent, grp, g, e):
    head = ps.shape[0] - 2
    t = ps[head + 1]
    ps[2 * e] = t
    ps[2 * e + 1] = -1
    if t >= 0:
        ps[2 * t + 1] = e
    else:
        ps[head] = e
    ps[head + 1] = e


@njit(inline="always")
def on_touch(ps, ent, grp, g, e):
    pass  # a hit does not move the entry: that is what makes it FIFO


@njit(inline="always")
def pick_victim(ps, ent, grp, g, load):
    e = ps[ps.shape[0] - 2]
    while e >= 0 and not evictable(ent, e, load):
        e = ps[2 * e + 1]
    return e


@njit(inline="always")
def on_evict(ps, ent, grp, g, e):
    head = ps.shape[0] - 2
    p, q = ps[2 * e], ps[2 * e + 1]
    if p >= 0:
        ps[2 * p + 1] = q
    else:
        ps[head] = q
    if q >= 0:
        ps[2 * q] = p
    else:
        ps[head + 1] = p
