"""The replay driver: walks loads, asks a policy's hooks what to evict, counts everything.

DESIGN.md, "Replay semantics". A *load* is one (batch, layer) group. Inside a load the routed
slots are visited token-major (row order, then slot order). Each unique entry (layer, expert) is
*looked up* once per load: a hit if resident, else a miss that reads ``entry_bytes`` and is
admitted at once; a repeated id in the same load only promotes (recency). After the load,
eviction runs once, in the load's eviction group, until the group's bytes fit its budget; it never
evicts an entry the load touched (so a load larger than the budget overflows instead of thrashing;
``stats[STAT_OVERFLOW]`` counts such loads).

Hooks every policy module in :mod:`replay.policies` exposes (all ``@njit(inline="always")``;
``ent``/``grp`` are the shared state matrices of :mod:`replay.cache_state`, ``ps`` the policy's
own int64 matrix from ``init(ent, grp, seed)``):

- ``on_admit(ps, ent, grp, e)``  a miss admitted ``e`` (``ent`` fields already updated)
- ``on_touch(ps, ent, grp, e)``  every visit of ``e`` (first lookup, hit or admitted, and repeats)
- ``pick_victim(ps, ent, grp, g, load) -> e | -1``  next victim in group ``g``; must only return
  entries for which :func:`replay.cache_state.evictable` holds; -1 = nothing evictable
- ``on_evict(ps, ent, grp, e)``  ``e`` is leaving (before ``ent[e, RESIDENT]`` is cleared)

and constants ``PARTITION`` ("global" | "layer"), ``UNBOUNDED``, ``NEEDS_NEXT_USE``, and optionally
``NEEDS_RESIDENT_LIST`` (keep ``ent[:, RES_LIST]``, the per-group resident list a scan reads; it
costs two random writes per miss and eviction, so policies that do not scan go without).
:func:`make_kernel` compiles the driver once per policy with the hooks inlined (its code rebound to
globals holding the module's hooks; Numba treats them as compile-time constants), so the interface costs nothing.

Extension points (not implemented yet; each is a local change):

- skip flags (closed-loop drop-cold): add a ``skip`` [R, k] uint8 argument and, at the top of the
  slot loop, ``if skip[r, j]: continue`` before any lookup/read/admission (a dropped slot is
  neither looked up, nor read, nor admitted); count skipped slots in ``acc`` if wanted.
- speculative fills (prefetch): after the load's eviction step, call ``_fill(...)`` for each
  predicted entry of the next load: if not resident, admit with ``ent[e, SPEC] = 1`` (the demand
  lookup path below already turns a hit on a ``spec`` entry into residency code 2 and clears the
  flag; count fills/bytes separately from demand misses), ask a policy hook ``admit_ok`` (the
  eviction guard) first, and evict with the same loop as after a load. In ``_evict`` a victim with
  ``ent[e, SPEC] == 1`` is "evicted unused".
- protected set (retention): set ``ent[e, PROTECT] = load`` for the protected entries before the
  eviction step; :func:`evictable` already refuses them.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from types import FunctionType, ModuleType

import numpy as np
from numba import njit

from replay.cache_state import (
    BASE,
    BUDGET,
    BYTES,
    COUNT,
    FREQ,
    GROUP,
    LAST_LOAD,
    LAST_TICK,
    NEXT_USE,
    OUTCOME,
    RES_LIST,
    RES_POS,
    RESIDENT,
    SPEC,
    USED,
)

# acc[phase, lidx, field]
ACC_LOOKUPS, ACC_HITS, ACC_READ = 0, 1, 2
# stats[]
STAT_EVICTIONS, STAT_OVERFLOW, STAT_SPEC_HITS, STAT_TICKS = 0, 1, 2, 3
N_STATS = 4


@njit(cache=True, inline="always")
def _admit(ent, grp, e, keep_list):
    g = ent[e, GROUP]
    ent[e, RESIDENT] = 1
    ent[e, FREQ] = 1  # the admitting load is its first
    grp[g, USED] += ent[e, BYTES]
    grp[g, COUNT] += 1
    if not keep_list:
        return
    pos = grp[g, BASE] + grp[g, COUNT] - 1
    ent[pos, RES_LIST] = e
    ent[e, RES_POS] = pos


@njit(cache=True, inline="always")
def _remove(ent, grp, e, keep_list):
    g = ent[e, GROUP]
    ent[e, RESIDENT] = 0
    ent[e, SPEC] = 0
    grp[g, USED] -= ent[e, BYTES]
    grp[g, COUNT] -= 1
    if not keep_list:
        return
    last = grp[g, BASE] + grp[g, COUNT]
    pos = ent[e, RES_POS]
    moved = ent[last, RES_LIST]
    ent[pos, RES_LIST] = moved
    ent[moved, RES_POS] = pos
    ent[e, RES_POS] = -1


# Hook placeholders: make_kernel rebinds these names to one policy's @njit hooks and constants.
KEEP_RES_LIST = True  # maintain the resident list (only scanning policies read it)

def on_admit(ps, ent, grp, e):  # pragma: no cover
    raise NotImplementedError


def on_touch(ps, ent, grp, e):  # pragma: no cover
    raise NotImplementedError


def pick_victim(ps, ent, grp, g, load):  # pragma: no cover
    raise NotImplementedError


def on_evict(ps, ent, grp, e):  # pragma: no cover
    raise NotImplementedError


def _driver(entries, load_start, load_lidx, load_phase, load_batch, next_load, ent, grp, ps, acc, bacc, stats, slot_out):
    """Replay every load; fill acc [2, L, 3], bacc [B, 3], stats, and slot_out [R, k] if it has rows."""
    k = entries.shape[1]
    want_slots = slot_out.shape[0] > 0
    has_next = next_load.shape[0] > 0
    tick = 0
    for load in range(load_start.shape[0] - 1):
        # Per-load counters live in registers and are added to acc/bacc once per load (a
        # read-modify-write of acc per slot costs a store-forwarding chain per slot).
        n_look = 0
        n_hit = 0
        n_read = 0
        for r in range(load_start[load], load_start[load + 1]):
            for j in range(k):
                e = entries[r, j]
                tick += 1
                if ent[e, LAST_LOAD] == load:
                    # A repeat inside this load: already looked up, only promoted.
                    ent[e, LAST_TICK] = tick
                    on_touch(ps, ent, grp, e)
                    if want_slots:
                        slot_out[r, j] = ent[e, OUTCOME]
                    continue
                n_look += 1
                ent[e, FREQ] += 1  # reset to 0 by _admit below for a miss, then counted
                ent[e, LAST_LOAD] = load
                ent[e, LAST_TICK] = tick
                if has_next:
                    ent[e, NEXT_USE] = next_load[r, j]
                if ent[e, RESIDENT] == 1:
                    code = 1
                    if ent[e, SPEC] == 1:  # prefetched and now demanded (prefetch extension)
                        code = 2
                        ent[e, SPEC] = 0
                        stats[STAT_SPEC_HITS] += 1
                    n_hit += 1
                else:
                    code = 0
                    n_read += ent[e, BYTES]
                    _admit(ent, grp, e, KEEP_RES_LIST)
                    on_admit(ps, ent, grp, e)
                on_touch(ps, ent, grp, e)
                if want_slots:
                    ent[e, OUTCOME] = code
                    slot_out[r, j] = code
        lid = load_lidx[load]
        ph = load_phase[load]
        b = load_batch[load]
        acc[ph, lid, ACC_LOOKUPS] += n_look
        acc[ph, lid, ACC_HITS] += n_hit
        acc[ph, lid, ACC_READ] += n_read
        bacc[b, ACC_LOOKUPS] += n_look
        bacc[b, ACC_HITS] += n_hit
        bacc[b, ACC_READ] += n_read
        # Eviction: once, after the load, in the load's group, until the group fits.
        if load_start[load + 1] == load_start[load]:
            continue
        g = ent[entries[load_start[load], 0], GROUP]
        while grp[g, USED] > grp[g, BUDGET]:
            v = pick_victim(ps, ent, grp, g, load)
            if v < 0:
                stats[STAT_OVERFLOW] += 1  # everything left was touched by this load
                break
            on_evict(ps, ent, grp, v)
            _remove(ent, grp, v, KEEP_RES_LIST)
            stats[STAT_EVICTIONS] += 1
    stats[STAT_TICKS] = tick


def make_kernel(name: str, pm: ModuleType):
    """Compile the driver for one policy module, its hooks inlined.

    The driver's code object is rebound to globals holding this policy's hooks (no closure: a
    closure over dispatchers would never hit Numba's on-disk cache, whose key pickles closure
    cells and a dispatcher pickles with a per-process id). The function's name carries a hash of
    the sources it inlines, so editing a policy module invalidates its cached machine code (Numba
    itself only watches the file that defines the function).
    """
    g = dict(_driver.__globals__)
    g.update(on_admit=pm.on_admit, on_touch=pm.on_touch, pick_victim=pm.pick_victim, on_evict=pm.on_evict,
             KEEP_RES_LIST=bool(getattr(pm, "NEEDS_RESIDENT_LIST", False)))
    qual = f"replay_kernel_{name}_{_source_hash(pm)}"
    f = FunctionType(_driver.__code__, g, qual, _driver.__defaults__, None)
    f.__qualname__ = qual
    f.__doc__ = _driver.__doc__
    return njit(cache=True, nogil=True, _nrt=False)(f)


def _source_hash(pm: ModuleType) -> str:
    h = hashlib.sha256()
    mods = [pm, sys.modules[__name__], sys.modules["replay.cache_state"]]
    mods += [m for m in sys.modules.values() if getattr(m, "__name__", "").startswith("replay.policies.")]
    for m in sorted(set(mods), key=lambda m: m.__name__):
        src = getattr(m, "__file__", None)
        if src:
            h.update(Path(src).read_bytes())
    return h.hexdigest()[:10]


@njit(cache=True, nogil=True)
def next_loads(entries, load_start, n_entries):
    """For each routed slot, the next load after its own that touches the same entry (NEVER if none)."""
    never = np.int32(2147483647)  # cache_state.NEVER
    seen = np.full(n_entries, never, np.int32)
    out = np.empty(entries.shape, np.int32)
    k = entries.shape[1]
    for load in range(load_start.shape[0] - 2, -1, -1):
        lo, hi = load_start[load], load_start[load + 1]
        for r in range(lo, hi):
            for j in range(k):
                out[r, j] = seen[entries[r, j]]
        for r in range(lo, hi):
            for j in range(k):
                seen[entries[r, j]] = load
    return out
