"""``least-stale``: an interpretation of SpecMD's "least-stale" eviction (arXiv 2602.03921). The
paper publishes no code; this is one reading of its description, not a reproduction.

The reading: entries touched in the current token pass (the current *batch*: one decode token, or
one prefill batch) are *fresh*, every other resident entry is *stale*. Eviction takes stale
entries before fresh ones, and within each tier the oldest admission first (FIFO: a hit does not
move an entry). "Touched" = the entry's last demand lookup, or a what-if's speculative fill, was
in a load of the current batch (``ent[LAST_LOAD, e] >= grp[g, BATCH_LOAD]``, the first load of
the current batch, which the driver writes once per batch for a policy with ``NEEDS_BATCH``).

Mapping onto this driver: eviction runs after each load, so a load of layer l sees as fresh the
entries the same token used at layers < l (and l itself); the entries the load touched, and
those a what-if protects, are not evictable and are passed over unchanged. One FIFO list in
admission order; the victim search walks it from the oldest entry and stops at the first
evictable stale one, remembering the first evictable fresh one in case there is none.
"""

from __future__ import annotations

from replay.core.state import BATCH_LOAD, LAST_LOAD, evictable
from replay.policies.lru import _append, _g, _unlink, init  # noqa: F401  (the same linked list, admission order)
from traces.util.jit import njit

PARTITION = "global"
UNBOUNDED = False
NEEDS_NEXT_USE = False
NEEDS_LAST_LOAD = True
NEEDS_TICK = False
NEEDS_FREQ = False
NEEDS_BATCH = True


@njit(cache=True, inline="always")
def on_admit(ps, ent, grp, g, e):
    _append(ps, g, e)


@njit(cache=True, inline="always")
def on_touch(ps, ent, grp, g, e):
    pass  # FIFO: a hit changes nothing but LAST_LOAD, which the driver writes


@njit(cache=True, inline="always")
def pick_victim(ps, ent, grp, g, load):
    first = grp[g, BATCH_LOAD]
    fresh = -1
    e = ps[_g(ps, g)]  # HEAD = 0: the oldest admission
    while e >= 0:
        if evictable(ent, e, load):
            if ent[LAST_LOAD, e] < first:
                return e
            if fresh < 0:
                fresh = e
        e = ps[2 * e + 1]  # NEXT
    return fresh


@njit(cache=True, inline="always")
def on_evict(ps, ent, grp, g, e):
    _unlink(ps, g, e)
