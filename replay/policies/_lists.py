"""Doubly linked lists over a policy's entries, kept in its state array ``ps``: the one list code of
``lru`` (and so ``pin``, ``layer``, ``layer-opt``, ``least-stale``), ``colibri``'s LRU tier,
``sieve``'s queue and ``s3fifo``'s three queues; and the entries a load holds back until a later
load begins (:func:`make_pending`: ``sieve``'s and ``s3fifo``'s admissions, the Belady key
blocks' visited entries).

Each policy lays its links out its own way (``lru``: int32, entry-major ``2e + PREV``; ``sieve`` and
``s3fifo``: int64 rows after a header, :func:`make_rows`; ``colibri``: pairs after its header), so
:func:`make_list` takes the two index functions of that layout, ``prev_at(ps, e)`` and
``next_at(ps, e)`` (``@njit(inline="always")``), and returns the list operations compiled for it.
A list is named by the two slots of ``ps`` holding its head (oldest) and tail (newest) entry; -1
is "none". Every operation is O(1).
"""

from __future__ import annotations

import numpy as np

from traces.util.jit import njit


def make_list(prev_at, next_at):
    """``(push, unlink)`` for links at ``prev_at(ps, e)`` / ``next_at(ps, e)``:
    ``push(ps, head, tail, e)`` appends ``e`` at the newest end; ``unlink(ps, head, tail, e)``
    takes ``e`` out (it must be in that list)."""

    @njit(cache=True, inline="always")
    def push(ps, head, tail, e):
        t = ps[tail]
        ps[prev_at(ps, e)] = t
        ps[next_at(ps, e)] = -1
        if t >= 0:
            ps[next_at(ps, t)] = e
        else:
            ps[head] = e
        ps[tail] = e

    @njit(cache=True, inline="always")
    def unlink(ps, head, tail, e):
        p, q = ps[prev_at(ps, e)], ps[next_at(ps, e)]
        if p >= 0:
            ps[next_at(ps, p)] = q
        else:
            ps[head] = q
        if q >= 0:
            ps[prev_at(ps, q)] = p
        else:
            ps[tail] = p

    return push, unlink


def make_pending(at, r_pend: int, n_at: int, load_at: int, join):
    """``(hold, flush)``: entries a load holds back, in order, until a later load begins (``sieve``,
    ``s3fifo``: its admissions, since libCacheSim inserts the requested object after it evicts, so
    the queues a load's eviction step walks never hold that load's admissions; :mod:`._blocks`: the
    entries it visited, keyed only once the load is over). The held entries are at
    ``at(ps, r_pend, i)`` (row ``r_pend`` of :func:`make_rows`' layout, or a region of ``ps``),
    their count ``ps[n_at]``, the load that last flushed ``ps[load_at]`` (-1 at start).
    ``hold(ps, e)`` holds ``e`` back; ``flush(ps, ent, load)``, called first by every hook with the
    current ``load``, hands the held entries in order to ``join(ps, ent, e)`` once ``load`` is a
    later load."""

    @njit(cache=True, inline="always")
    def hold(ps, e):
        ps[at(ps, r_pend, ps[n_at])] = e
        ps[n_at] += 1

    @njit(cache=True, inline="always")
    def flush(ps, ent, load):
        if ps[load_at] == load:
            return
        ps[load_at] = load
        for i in range(ps[n_at]):
            join(ps, ent, ps[at(ps, r_pend, i)])
        ps[n_at] = 0

    return hold, flush


def make_rows(hdr: int, n_slot: int, r_prev: int, r_next: int):
    """``(at, prev_at, next_at)`` for per-entry rows after a header of ``hdr`` slots (``sieve``,
    ``s3fifo``): row ``r`` of entry ``e`` is ``ps[hdr + r * ps[n_slot] + e]`` (``ps[n_slot]`` = the
    number of entries), the links in rows ``r_prev`` and ``r_next``."""

    @njit(cache=True, inline="always")
    def at(ps, row, e):
        return np.uint64(hdr + row * ps[n_slot] + e)

    @njit(cache=True, inline="always")
    def prev_at(ps, e):
        return at(ps, r_prev, e)

    @njit(cache=True, inline="always")
    def next_at(ps, e):
        return at(ps, r_next, e)

    return at, prev_at, next_at
