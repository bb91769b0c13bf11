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

What-ifs, all in the same driver and compiled out of nothing (each guarded by a flag tested once
per slot or once per load; a plain replay passes empty arrays):

- drop flags (closed-loop drop-cold, closed top-k cut): ``drop[r, j]`` 1 skips the slot when its
  entry is not resident at that moment, 2 skips it always. A skipped slot is neither looked up,
  nor read, nor admitted, nor promoted; its residency code is 3.
- predictions ``pred`` [R, w] (entries predicted for routing row r) feed two things:
  - retention (``OPT_RETAIN``): before a load's eviction step, the predictions for the next
    ``OPT_AHEAD`` loads of the same batch (layers l+1 .. l+d) are protected (``PROTECT = load``);
  - speculative fills (``OPT_FILL``): after the eviction step, each prediction for the load
    ``OPT_AHEAD`` layers on (same batch) that is not resident is read into the same cache with
    ``SPEC = 1``, ``FREQ = 0``, most recent (``LAST_TICK`` and ``LAST_LOAD`` are the fill's, so the
    same step's later fills cannot evict it and LFRU's recency byte stays monotone); at most ``OPT_CAP`` such predicted misses per step
    (resident predictions do not use the cap); a fill evicts with the policy's own victim choice
    until it fits (never overflowing: no evictable victim refuses it); with ``OPT_GUARD`` a
    victim whose demand ``HEAT >= 2`` refuses the fill unless
    ``score(v) + score(v) // 4 + 4 * 256 <= score(candidate)``, score = heat << 8 | recency byte
    (:func:`_guard_score`). Victims evicted before a refusal stay evicted (one eviction at a time,
    as an engine would). A victim with ``SPEC == 1`` is counted "evicted unused".
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
    HEAT,
    LAST_LOAD,
    LAST_TICK,
    NEXT_USE,
    OUTCOME,
    PRED_MARK,
    PROTECT,
    RES_LIST,
    RES_POS,
    RESIDENT,
    SPEC,
    USED,
)

# acc[phase, lidx, field] and bacc[batch, field]: demand lookups, hits, bytes read by misses; slots
# dropped; demand hits on a speculative entry (useful speculations); speculative fills and bytes
# (attributed to the load they were made for)
ACC_LOOKUPS, ACC_HITS, ACC_READ, ACC_SKIPPED, ACC_SPEC_HITS, ACC_SPEC_FILLS, ACC_SPEC_READ = 0, 1, 2, 3, 4, 5, 6
N_ACC = 7
# stats[]
STAT_EVICTIONS, STAT_OVERFLOW, STAT_SPEC_HITS, STAT_TICKS = 0, 1, 2, 3
STAT_SPEC_EVICTED_UNUSED, STAT_SPEC_REFUSED, STAT_SPEC_NO_ROOM, STAT_SPEC_CAPPED = 4, 5, 6, 7
STAT_SPEC_RESIDENT, STAT_SPEC_FILLS, STAT_SPEC_UNUSED_END = 8, 9, 10
N_STATS = 11
# opts[]: layers ahead the predictions are for; cap on predicted misses per layer (-1 none);
# eviction guard on speculative fills; retention; speculative fills
OPT_AHEAD, OPT_CAP, OPT_GUARD, OPT_RETAIN, OPT_FILL = 0, 1, 2, 3, 4
N_OPTS = 5


def no_options() -> np.ndarray:
    """opts for a plain replay (no drop, no predictor)."""
    o = np.zeros(N_OPTS, np.int64)
    o[OPT_AHEAD] = 1
    o[OPT_CAP] = -1
    return o


@njit(cache=True, inline="always")
def _guard_score(ent, e, load):
    """The guard's score = heat << 8 | recency byte; heat = demand lookups over the whole replay
    (speculative fills never add), recency = LFRU's byte max(0, 255 - (load - LAST_LOAD)), where
    LAST_LOAD is the last load that demanded the entry or after which it was filled; 0 if never."""
    last = ent[e, LAST_LOAD]
    rec = 0
    if last >= 0:
        rec = 255 - (load - last)
        if rec < 0:
            rec = 0
    return (np.int64(ent[e, HEAT]) << 8) | rec


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
WHATIF = True  # compile the what-if paths (drop, predictions); False compiles them out of plain replays

def on_admit(ps, ent, grp, e):  # pragma: no cover
    raise NotImplementedError


def on_touch(ps, ent, grp, e):  # pragma: no cover
    raise NotImplementedError


def pick_victim(ps, ent, grp, g, load):  # pragma: no cover
    raise NotImplementedError


def on_evict(ps, ent, grp, e):  # pragma: no cover
    raise NotImplementedError


def _driver(entries, load_start, load_lidx, load_phase, load_batch, next_load, ent, grp, ps, acc, bacc, stats, slot_out,
            drop, pred, opts):
    """Replay every load; fill acc [2, L, N_ACC], bacc [B, N_ACC], stats, and slot_out [R, k] if it has rows.

    ``drop`` [R, k] uint8 (0 rows = no dropping): 1 = skip the slot if its entry is not resident
    at that moment (drop-cold), 2 = skip it always (top-k cut). ``pred`` [R, w] int32 (0 rows =
    no predictor): the entries predicted for routing row r (-1 = none). ``opts`` int64
    [OPT_AHEAD, OPT_CAP, OPT_GUARD, OPT_RETAIN, OPT_FILL] (see the module docstring).
    """
    k = entries.shape[1]
    want_slots = slot_out.shape[0] > 0
    has_next = next_load.shape[0] > 0
    has_drop = WHATIF and drop.shape[0] > 0
    has_pred = WHATIF and pred.shape[0] > 0
    w = pred.shape[1]
    ahead = opts[OPT_AHEAD]
    cap = opts[OPT_CAP]
    guard = opts[OPT_GUARD] != 0
    retain = has_pred and opts[OPT_RETAIN] != 0
    fill = has_pred and opts[OPT_FILL] != 0
    n_load = load_start.shape[0] - 1
    tick = 0
    for load in range(n_load):
        # Per-load counters live in registers and are added to acc/bacc once per load (a
        # read-modify-write of acc per slot costs a store-forwarding chain per slot).
        n_look = 0
        n_hit = 0
        n_read = 0
        n_skip = 0
        n_spec_hit = 0
        for r in range(load_start[load], load_start[load + 1]):
            for j in range(k):
                e = entries[r, j]
                if has_drop:
                    dm = drop[r, j]
                    # A dropped slot is neither looked up, nor read, nor admitted: it leaves no trace
                    # in the cache (not even recency), so the cache later holds other things.
                    if dm != 0 and (dm == 2 or ent[e, RESIDENT] == 0):
                        n_skip += 1
                        if want_slots:
                            slot_out[r, j] = 3
                        continue
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
                if WHATIF:
                    ent[e, HEAT] += 1  # lifetime demand heat (the eviction guard's); never reset
                ent[e, LAST_LOAD] = load
                ent[e, LAST_TICK] = tick
                if has_next:
                    ent[e, NEXT_USE] = next_load[r, j]
                if ent[e, RESIDENT] == 1:
                    code = 1
                    if ent[e, SPEC] == 1:  # prefetched and now demanded: a useful speculation
                        code = 2
                        ent[e, SPEC] = 0
                        n_spec_hit += 1
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
        if WHATIF:  # a plain replay never drops nor fills: these stay 0 without being written
            acc[ph, lid, ACC_SKIPPED] += n_skip
            acc[ph, lid, ACC_SPEC_HITS] += n_spec_hit
            bacc[b, ACC_SKIPPED] += n_skip
            bacc[b, ACC_SPEC_HITS] += n_spec_hit
            stats[STAT_SPEC_HITS] += n_spec_hit
        if load_start[load + 1] == load_start[load]:
            continue
        if retain:
            # Retention: what the predictor names for the next `ahead` layers of this batch is not
            # evictable after this load (nor by this step's speculative fills).
            for m in range(1, ahead + 1):
                t = load + m
                if t >= n_load or load_batch[t] != b or load_lidx[t] != lid + m:
                    break
                for r in range(load_start[t], load_start[t + 1]):
                    for j in range(w):
                        e = pred[r, j]
                        if e >= 0:
                            ent[e, PROTECT] = load
        # Eviction: once, after the load, in the load's group, until the group fits.
        g = ent[entries[load_start[load], 0], GROUP]
        while grp[g, USED] > grp[g, BUDGET]:
            v = pick_victim(ps, ent, grp, g, load)
            if v < 0:
                stats[STAT_OVERFLOW] += 1  # everything left was touched by this load
                break
            if WHATIF and ent[v, SPEC] == 1:
                stats[STAT_SPEC_EVICTED_UNUSED] += 1
            on_evict(ps, ent, grp, v)
            _remove(ent, grp, v, KEEP_RES_LIST)
            stats[STAT_EVICTIONS] += 1
        if not fill:
            continue
        # Speculative fills: the predictions for the load `ahead` layers on, in this batch, read now
        # into the same cache (token-major, rank order, each entry once).
        t = load + ahead
        if t >= n_load or load_batch[t] != b or load_lidx[t] != lid + ahead:
            continue
        attempts = 0
        n_fill = 0
        n_fill_bytes = 0
        for r in range(load_start[t], load_start[t + 1]):
            for j in range(w):
                e = pred[r, j]
                if e < 0 or ent[e, PRED_MARK] == load:
                    continue
                ent[e, PRED_MARK] = load
                if ent[e, RESIDENT] == 1:
                    stats[STAT_SPEC_RESIDENT] += 1  # already resident: no read, does not use the cap
                    continue
                if cap >= 0 and attempts >= cap:
                    stats[STAT_SPEC_CAPPED] += 1
                    continue
                attempts += 1
                ge = ent[e, GROUP]
                need = ent[e, BYTES]
                ok = True
                while grp[ge, USED] + need > grp[ge, BUDGET]:
                    v = pick_victim(ps, ent, grp, ge, load)
                    if v < 0:
                        stats[STAT_SPEC_NO_ROOM] += 1  # a speculation never overflows the budget
                        ok = False
                        break
                    if guard and ent[v, HEAT] >= 2:
                        sv = _guard_score(ent, v, load)
                        if not (sv + sv // 4 + 4 * 256 <= _guard_score(ent, e, load)):
                            stats[STAT_SPEC_REFUSED] += 1
                            ok = False
                            break
                    if ent[v, SPEC] == 1:
                        stats[STAT_SPEC_EVICTED_UNUSED] += 1
                    on_evict(ps, ent, grp, v)
                    _remove(ent, grp, v, KEEP_RES_LIST)
                    stats[STAT_EVICTIONS] += 1
                if not ok:
                    continue
                tick += 1
                ent[e, LAST_TICK] = tick
                ent[e, LAST_LOAD] = load  # most recent (LFRU's recency byte too); not a demand lookup
                _admit(ent, grp, e, KEEP_RES_LIST)
                ent[e, FREQ] = 0  # no demand access yet: a speculative fill never raises frequency or heat
                ent[e, SPEC] = 1
                on_admit(ps, ent, grp, e)
                n_fill += 1
                n_fill_bytes += need
        tl = load_lidx[t]
        acc[ph, tl, ACC_SPEC_FILLS] += n_fill
        acc[ph, tl, ACC_SPEC_READ] += n_fill_bytes
        bacc[b, ACC_SPEC_FILLS] += n_fill
        bacc[b, ACC_SPEC_READ] += n_fill_bytes
        stats[STAT_SPEC_FILLS] += n_fill
    stats[STAT_TICKS] = tick
    if fill:
        for e in range(ent.shape[0]):
            if ent[e, RESIDENT] == 1 and ent[e, SPEC] == 1:
                stats[STAT_SPEC_UNUSED_END] += 1


def make_kernel(name: str, pm: ModuleType, whatif: bool = True):
    """Compile the driver for one policy module, its hooks inlined.

    The driver's code object is rebound to globals holding this policy's hooks (no closure: a
    closure over dispatchers would never hit Numba's on-disk cache, whose key pickles closure
    cells and a dispatcher pickles with a per-process id). The function's name carries a hash of
    the sources it inlines, so editing a policy module invalidates its cached machine code (Numba
    itself only watches the file that defines the function). ``whatif=False`` compiles the
    drop/prediction paths out (a plain replay pays nothing for them); such a kernel ignores
    ``drop`` and ``pred``.
    """
    g = dict(_driver.__globals__)
    g.update(on_admit=pm.on_admit, on_touch=pm.on_touch, pick_victim=pm.pick_victim, on_evict=pm.on_evict,
             KEEP_RES_LIST=bool(getattr(pm, "NEEDS_RESIDENT_LIST", False)), WHATIF=bool(whatif))
    qual = f"replay_kernel_{name}{'_whatif' if whatif else ''}_{_source_hash(pm)}"
    f = FunctionType(_driver.__code__, g, qual, _driver.__defaults__, None)
    f.__qualname__ = qual
    f.__doc__ = _driver.__doc__
    return njit(cache=True, nogil=True, _nrt=False)(f)


def _source_hash(pm: ModuleType) -> str:
    # Every policy source file, whether imported yet or not: hashing only the policy modules
    # already in sys.modules gave a different name (a recompile) depending on import order.
    h = hashlib.sha256()
    files = {Path(pm.__file__), Path(sys.modules[__name__].__file__), Path(sys.modules["replay.cache_state"].__file__)}
    files |= set((Path(__file__).parent / "policies").glob("*.py"))
    for f in sorted(files):
        h.update(f.name.encode())
        h.update(f.read_bytes())
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
