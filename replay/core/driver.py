"""The replay driver: walks loads, asks a policy's hooks what to evict, counts everything.

docs/design.md, "Replay semantics". A *load* is one (batch, layer) group. Inside a load the routed
slots are visited token-major (row order, then slot order). Each unique entry (layer, expert) is
*looked up* once per load: a hit if resident, else a miss that reads ``entry_bytes`` and is
admitted at once; a repeated id in the same load only promotes (recency). After the load,
eviction runs once, in the load's eviction group, until the group's bytes fit its budget; it never
evicts an entry the load touched (so a load larger than the budget overflows instead of thrashing;
``stats[STAT_OVERFLOW]`` counts such loads: a load after whose eviction step its group still held
more than the group's budget).

Resident bytes: the driver keeps a running total of the bytes resident in all groups together
(misses add, evictions and fills move it; one register add per load) and ``stats[STAT_PEAK_BYTES]``
is its maximum, taken after each load's eviction step and after each load's speculative fills
(never inside a load, where the engine too holds the whole load before it evicts). A cell that
never overflowed has a peak within its budget (the partitioned policies: within the sum of the
shares); one that overflowed needed ``peak`` bytes for the hit rate it reports.

Frequency (``ent[FREQ]``, kept for policies with ``NEEDS_FREQ``) counts demand loads that looked
the entry up (a repeat inside one load counts once), over one of two spans, chosen by the policy
constant ``FREQ_SINCE``:

- ``"run"`` (``lfu``, ``layerlfu``): since the start of the run; the count survives eviction, so a
  readmitted entry keeps its history (a miss adds one, as a hit does);
- ``"admission"`` (the default; ``lfu-incache``, ``layerlfu-incache``, ``lfru``): since the entry
  was last admitted; a miss restarts it at 1.

A speculative fill is not a demand access: under ``"run"`` it leaves the count as it is (no
increase, no history erased); under ``"admission"`` it sets it to 0 (admitted, not yet demanded).

Hooks every policy module in :mod:`replay.policies` exposes (all ``@njit(inline="always")``;
``ent``/``grp`` are the shared state matrices of :mod:`replay.core.state`, ``ps`` the policy's
own matrix from ``init(ent, grp, seed)``; ``g`` is the eviction group of ``e``, which the driver
knows per load, so no hook has to look it up):

- ``on_admit(ps, ent, grp, g, e)``  ``e`` was just admitted (a miss, or a speculative fill;
  ``ent`` fields already updated)
- ``on_touch(ps, ent, grp, g, e)``  ``e`` was visited while resident and not just admitted (a hit,
  or a repeat inside a load); exactly one of ``on_admit`` / ``on_touch`` runs per visit
- ``pick_victim(ps, ent, grp, g, load) -> e | -1``  next victim in group ``g``; must only return
  entries for which :func:`replay.core.state.evictable` holds; -1 = nothing evictable
- ``on_evict(ps, ent, grp, g, e)``  ``e`` (the entry ``pick_victim`` just returned) is leaving
  (before ``ent[RESIDENT, e]`` is cleared)

and constants ``PARTITION`` ("global" | "layer"), ``UNBOUNDED``, ``NEEDS_NEXT_USE``, and optionally
``NEEDS_RESIDENT_LIST`` (keep ``ent[RES_LIST]``, the per-group resident list a scan reads; it
costs two random writes per miss and eviction, so policies that do not scan go without),
``NEEDS_BATCH`` (default False: when True the driver writes, once per batch, the index of the
batch's first load into ``grp[g, BATCH_LOAD]`` of every group before that load's lookups, so a
hook knows which loads belong to the current token pass (``least-stale``): "touched in this batch"
is ``ent[LAST_LOAD, e] >= grp[g, BATCH_LOAD]``; compiled out otherwise),
``NEEDS_TICK``, ``NEEDS_FREQ`` and ``NEEDS_LAST_LOAD`` (default True: keep ``ent[LAST_TICK]`` /
``ent[FREQ]`` / ``ent[LAST_LOAD]`` in a plain replay; a policy that does not read one, like LRU
whose list is its recency, sets it False and the driver writes one field less per routed slot;
a what-if replay keeps ``LAST_LOAD`` regardless, for the guard).
Optional plain-Python parts of a policy module, run before the replay (:mod:`replay.core.simulate`), never
inside the kernel:

- ``BOUND = True``: an offline bound (it sees the whole trace), never an online candidate in a
  "best online" verdict (``belady``, ``infinite``, ``layer-opt``);
- ``OPTIONS`` (tuple of names) and ``prepare_options(loads, options) -> dict``: the policy's
  parameters (``policy_options=`` of :func:`replay.core.simulate.replay`), checked and resolved once per
  sweep (a policy without ``OPTIONS`` takes none);
- ``group_budgets(loads, budget_bytes, options) -> int64 [groups]``: each eviction group's byte
  budget, instead of the whole budget (``"global"``) or floor(budget / MoE layers) each (``"layer"``);
- ``setup(ps, ent, grp, loads, budget_bytes, options)``: after ``init``, e.g. preload entries with
  :func:`replay.core.state.preload` (resident from the start; their bytes count in the group's
  ``USED`` and in the peak, and are reported as ``preload_mib``); it may return a new ``ps`` that replaces
  ``init``'s (a state sized by the trace, e.g. ``colibri``'s re-pin schedule);
- ``describe(loads, budgets_bytes, options) -> str``: one line for the cache text.

:func:`make_kernel` compiles the driver once per policy with the hooks inlined (its code rebound to
globals holding the module's hooks; Numba treats them as compile-time constants), so the interface costs nothing.

What-ifs, all in the same driver and compiled out of nothing (each guarded by a flag tested once
per slot or once per load; a plain replay passes empty arrays):

- drop flags (closed-loop drop-cold, closed top-k cut): ``drop[r, j]`` 1 skips the slot when its
  entry is not resident at that moment, 2 skips it always. A skipped slot is neither looked up,
  nor read, nor admitted, nor promoted; its residency code is 3.
- predictions ``pred`` [R, w] (entries predicted for routing row r) feed two things:
  - retention (``OPT_RETAIN``): before a load's eviction step, the predictions for the next
    ``OPT_AHEAD`` loads of the same batch (layers l+1 .. l+d) are protected (``PIN = load``);
  - speculative fills (``OPT_FILL``): after the eviction step, each prediction for the load
    ``OPT_AHEAD`` layers on (same batch) that is not resident is read into the same cache with
    ``SPEC = 1``, ``FREQ`` as above (0 under ``"admission"``, unchanged under ``"run"``), most
    recent (``LAST_TICK`` and ``LAST_LOAD`` are the fill's, so the same step's later fills cannot
    evict it and LFRU's recency byte stays monotone); at most ``OPT_CAP`` such predicted misses per step
    (resident predictions do not use the cap); a fill evicts with the policy's own victim choice
    until it fits (never overflowing: no evictable victim refuses it); with ``OPT_GUARD`` a
    victim whose demand ``HEAT >= 2`` refuses the fill unless
    ``score(v) + score(v) // 4 + 4 * 256 <= score(candidate)``, score = heat << 8 | recency byte
    (:func:`_guard_score`). Victims evicted before a refusal stay evicted (one eviction at a time,
    as an engine would). A victim with ``SPEC == 1`` is counted "evicted unused".
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path
from types import FunctionType, ModuleType

import numpy as np

from replay.core.state import (
    BASE,
    BATCH_LOAD,
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
    PIN,
    PRED_MARK,
    RES_LIST,
    RES_POS,
    RESIDENT,
    SPEC,
    USED,
)
from traces.util.jit import dispatcher_of, njit, resolve

# acc[phase, lidx, field] and bacc[batch, field]: demand lookups, hits, bytes read by misses; slots
# dropped; demand hits on a speculative entry (useful speculations); speculative fills and bytes
# (attributed to the load they were made for)
ACC_LOOKUPS, ACC_HITS, ACC_READ, ACC_SKIPPED, ACC_SPEC_HITS, ACC_SPEC_FILLS, ACC_SPEC_READ = 0, 1, 2, 3, 4, 5, 6
N_ACC = 7
# stats[]
STAT_EVICTIONS, STAT_OVERFLOW, STAT_SPEC_HITS, STAT_TICKS = 0, 1, 2, 3
STAT_SPEC_EVICTED_UNUSED, STAT_SPEC_REFUSED, STAT_SPEC_NO_ROOM, STAT_SPEC_CAPPED = 4, 5, 6, 7
STAT_SPEC_RESIDENT, STAT_SPEC_FILLS, STAT_SPEC_UNUSED_END = 8, 9, 10
STAT_PEAK_BYTES = 11  # most bytes resident in all groups together, after an eviction step or a load's fills
# A hook's answer the driver refused (0 none): the replay stopped at once, and the Python side turns
# the code, the value and the load into one sentence naming the plugin (replay.core.simulate.driver_error).
# Checked where it is cheap: once per victim, never per routed slot. Without it, a victim index past
# the state arrays is an unchecked store into memory (SIGSEGV, or worse, silently wrong figures).
STAT_ERR, STAT_ERR_VALUE, STAT_ERR_LOAD = 12, 13, 14
ERR_VICTIM_RANGE = 1  # pick_victim returned an index that is no entry
ERR_VICTIM_NOT_RESIDENT = 2  # pick_victim returned an entry that is not resident
N_STATS = 15
# opts[]: layers ahead the predictions are for; cap on predicted misses per layer (-1 none);
# eviction guard on speculative fills; retention; speculative fills
OPT_AHEAD, OPT_CAP, OPT_GUARD, OPT_RETAIN, OPT_FILL = 0, 1, 2, 3, 4
# A replay streamed part by part (replay.core.simulate.replay_stream) carries its clocks across calls:
# the tick and the load number the part starts at, and the local index of a batch that continues
# the previous part's last batch (0) or -1.
OPT_TICK0, OPT_LOAD0, OPT_BATCH0 = 5, 6, 7
N_OPTS = 8
# fill_out[r, j]: what the speculative step did with prediction pred[r, j] (0: not considered: no
# prediction, a repeat of one already considered in the step, or no step for its load)
FILL_RESIDENT, FILL_READ, FILL_CAPPED, FILL_REFUSED = 1, 2, 3, 4  # refused: the guard, or no room


def no_options() -> np.ndarray:
    """opts for a plain replay (no drop, no predictor)."""
    o = np.zeros(N_OPTS, np.int64)
    o[OPT_AHEAD] = 1
    o[OPT_CAP] = -1
    o[OPT_BATCH0] = -1
    return o


@njit(cache=True, inline="always")
def _guard_score(ent, e, load):
    """The guard's score = heat << 8 | recency byte; heat = demand lookups over the whole replay
    (speculative fills never add), recency = LFRU's byte max(0, 255 - (load - LAST_LOAD)), where
    LAST_LOAD is the last load that demanded the entry or after which it was filled; 0 if never."""
    last = ent[LAST_LOAD, e]
    rec = 0
    if last >= 0:
        rec = 255 - (load - last)
        if rec < 0:
            rec = 0
    return (np.int64(ent[HEAT, e]) << 8) | rec


@njit(cache=True, inline="always")
def _list_add(ent, grp, g, e):
    pos = grp[g, BASE] + grp[g, COUNT] - 1  # COUNT already counts e
    ent[RES_LIST, pos] = e
    ent[RES_POS, e] = pos


@njit(cache=True, inline="always")
def _forget(ent, grp, g, e, keep_list, whatif):
    """``e`` leaves the cache; the caller takes its bytes off ``grp[g, USED]`` (and, without a
    resident list, its count off ``grp[g, COUNT]``)."""
    ent[RESIDENT, e] = 0
    if whatif:
        ent[SPEC, e] = 0  # only fills set it
    if not keep_list:
        return
    grp[g, COUNT] -= 1
    last = grp[g, BASE] + grp[g, COUNT]
    pos = ent[RES_POS, e]
    moved = ent[RES_LIST, last]
    ent[RES_LIST, pos] = moved
    ent[RES_POS, moved] = pos
    ent[RES_POS, e] = -1


@njit(cache=True, inline="always")
def _victim_error(ent, g, v, n_ent):
    """0 if ``v`` (>= 0, from ``pick_victim`` for group ``g``) is an entry and resident, else the
    ERR_VICTIM_* code: two compares per eviction (the RESIDENT field is the one the eviction writes
    next, so it costs no extra cache line), none per routed slot. A victim of another group is not
    checked: it cannot write outside the arrays, and the check stays at the two compares every
    eviction pays."""
    if v >= n_ent:
        return ERR_VICTIM_RANGE
    if ent[RESIDENT, v] != 1:
        return ERR_VICTIM_NOT_RESIDENT
    return 0


@njit(cache=True, inline="always")
def _acc_read(acc, layer_info):
    """``acc[:, l, ACC_READ]`` = misses x the bytes of one entry of layer ``l`` (the driver adds
    lookups and hits per load; every entry of a layer costs the same, so the bytes read follow from
    the totals, here once per call, whatever earlier calls added: a streamed or stepped replay's
    ``acc`` carries its totals from call to call)."""
    for p in range(acc.shape[0]):
        for l in range(acc.shape[1]):
            acc[p, l, ACC_READ] = (acc[p, l, ACC_LOOKUPS] - acc[p, l, ACC_HITS]) * layer_info[l, 1]


# Hook placeholders: make_kernel rebinds these names to one policy's @njit hooks and constants.
KEEP_RES_LIST = True  # maintain the resident list (only scanning policies read it)
KEEP_TICK = True  # maintain ent[LAST_TICK] (policies whose order or tie-break reads it)
KEEP_FREQ = True  # maintain ent[FREQ] (LFU, LFRU)
FREQ_RUN = False  # ent[FREQ] counts over the whole run (FREQ_SINCE = "run"), not since admission
KEEP_LAST_LOAD = True  # maintain ent[LAST_LOAD] in a plain replay (what-ifs always do: the guard reads it)
WHATIF = True  # compile the what-if paths (drop, predictions); False compiles them out of plain replays
SLOTS = True  # compile the per-slot residency codes (slot_out); False compiles them out
NEXT_USE_COL = True  # the policy reads ent[NEXT_USE] (Belady): next_load is given
KEEP_BATCH = False  # write grp[:, BATCH_LOAD] at each batch's first load (policies with NEEDS_BATCH)

def on_admit(ps, ent, grp, g, e):  # pragma: no cover
    raise NotImplementedError


def on_touch(ps, ent, grp, g, e):  # pragma: no cover
    raise NotImplementedError


def pick_victim(ps, ent, grp, g, load):  # pragma: no cover
    raise NotImplementedError


def on_evict(ps, ent, grp, g, e):  # pragma: no cover
    raise NotImplementedError


def _driver(entries, load_start, load_lidx, batch_start, batch_phase, layer_info, next_load, ent, grp, ps, acc, bacc, stats,
            slot_out, drop, pred, opts, fill_out):
    """Replay every load; fill acc [2, L, N_ACC], bacc [B, N_ACC], stats, and slot_out [R, k] if it has rows.

    The loads of batch ``b`` are ``batch_start[b]:batch_start[b+1]``, all of phase
    ``batch_phase[b]`` (:class:`replay.core.simulate.Loads`): the driver walks batches, then their
    loads, and reads per load only its rows' bounds and its layer.

    ``layer_info`` int64 [L, 2]: per MoE layer index, its eviction group and the bytes of one of
    its entries (the same as ``ent[GROUP]`` / ``ent[BYTES]`` of its entries, read from a table that
    stays in L1 instead of two random rows per load).

    ``drop`` [R, k] uint8 (0 rows = no dropping): 1 = skip the slot if its entry is not resident
    at that moment (drop-cold), 2 = skip it always (top-k cut). ``pred`` [R, w] int32 (0 rows =
    no predictor): the entries predicted for routing row r (-1 = none). ``opts`` int64
    [OPT_AHEAD, OPT_CAP, OPT_GUARD, OPT_RETAIN, OPT_FILL] (see the module docstring).
    ``fill_out`` [R, w] int8 (0 rows = not recorded): what the speculative step did with each
    prediction ``pred[r, j]`` (the FILL_* codes; replay.analyses.timeline times the reads).
    """
    k = entries.shape[1]
    # Flat views of the per-slot arrays [R, k] (C-contiguous: every caller passes them so): slot
    # r * k + j, so one loop walks a load's slots (at top-1 decode, one slot per load: no inner loop
    # to enter and leave per load).
    entries_f = entries.reshape(entries.size)
    drop_f = drop.reshape(drop.size)
    slot_out_f = slot_out.reshape(slot_out.size)
    next_f = next_load.reshape(next_load.size)
    want_slots = SLOTS and slot_out.shape[0] > 0
    has_next = NEXT_USE_COL and next_load.shape[0] > 0
    has_drop = WHATIF and drop.shape[0] > 0
    has_pred = WHATIF and pred.shape[0] > 0
    w = pred.shape[1]
    ahead = opts[OPT_AHEAD]
    cap = opts[OPT_CAP]
    guard = opts[OPT_GUARD] != 0
    retain = has_pred and opts[OPT_RETAIN] != 0
    fill = has_pred and opts[OPT_FILL] != 0
    want_fills = fill and fill_out.shape[0] > 0
    n_ent = ent.shape[1]
    tick = opts[OPT_TICK0]
    load0 = opts[OPT_LOAD0]
    n_evict = 0
    resident = np.int64(0)  # bytes resident in all groups together (entries a policy preloaded included)
    # Groups above their budget (after a load overflowed, or a policy preloaded past a share): while
    # there is none, a load that read nothing skips its eviction step without reading its group.
    n_over = 0
    for g0 in range(grp.shape[0]):
        resident += grp[g0, USED]
        if grp[g0, USED] > grp[g0, BUDGET]:
            n_over += 1
    peak = resident
    batch_now = opts[OPT_BATCH0]  # KEEP_BATCH: the batch whose first load grp[:, BATCH_LOAD] holds
    for b in range(batch_start.shape[0] - 1):
        ph = batch_phase[b]
        b_end = batch_start[b + 1]
        # The batch's totals live in registers and are added to bacc once, after its last load.
        b_look = 0
        b_hit = 0
        b_read = np.int64(0)
        for li in range(batch_start[b], b_end):  # li indexes this call's load arrays; load (the clock) counts from load0
            load = li + load0
            lo = load_start[li]
            hi = load_start[li + 1]
            if hi == lo:
                continue
            # Every entry of a load is of the load's layer: one eviction group, one entry size.
            lid = load_lidx[li]
            g = layer_info[lid, 0]
            nbytes = layer_info[lid, 1]
            if KEEP_BATCH:
                if b != batch_now:  # once per batch, at its first load with rows
                    batch_now = b
                    for gg in range(grp.shape[0]):
                        grp[gg, BATCH_LOAD] = load
            # Per-load counters live in registers and are added to acc/bacc/grp once per load (a
            # read-modify-write of memory per slot costs a store-forwarding chain per slot).
            n_look = 0
            n_hit = 0
            n_skip = 0
            n_spec_hit = 0
            for si in range(lo * k, hi * k):  # the load's slots, token-major (row r, slot j: si = r * k + j)
                s = np.uint64(si)  # unsigned indexes: no wraparound code (s is only an index below)
                e = np.uint32(entries_f[s])  # unsigned: no negative-index wraparound code per access
                if has_drop:
                    dm = drop_f[s]
                    # A dropped slot is neither looked up, nor read, nor admitted: it leaves no trace
                    # in the cache (not even recency), so the cache later holds other things.
                    if dm != 0 and (dm == 2 or ent[RESIDENT, e] == 0):
                        n_skip += 1
                        if want_slots:
                            slot_out_f[s] = 3
                        continue
                tick += 1
                if KEEP_TICK:
                    ent[LAST_TICK, e] = tick
                if ent[PIN, e] == load:
                    # A repeat inside this load: already looked up, only promoted.
                    on_touch(ps, ent, grp, g, e)
                    if want_slots:
                        slot_out_f[s] = ent[OUTCOME, e]
                    continue
                n_look += 1
                if WHATIF:
                    ent[HEAT, e] += 1  # lifetime demand heat (the eviction guard's); never reset
                ent[PIN, e] = load
                if WHATIF or KEEP_LAST_LOAD:
                    ent[LAST_LOAD, e] = load
                if has_next:
                    ent[NEXT_USE, e] = next_f[s]
                if ent[RESIDENT, e] == 1:
                    code = 1
                    if WHATIF and ent[SPEC, e] == 1:  # prefetched and now demanded: a useful speculation
                        code = 2
                        ent[SPEC, e] = 0
                        n_spec_hit += 1
                    n_hit += 1
                    if KEEP_FREQ:
                        ent[FREQ, e] += 1
                    on_touch(ps, ent, grp, g, e)
                else:
                    code = 0
                    ent[RESIDENT, e] = 1
                    if KEEP_FREQ:
                        if FREQ_RUN:
                            ent[FREQ, e] += 1  # the whole run's count: history survives eviction
                        else:
                            ent[FREQ, e] = 1  # the admitting load is its first
                    if KEEP_RES_LIST:
                        grp[g, COUNT] += 1
                        _list_add(ent, grp, g, e)
                    on_admit(ps, ent, grp, g, e)
                if want_slots:
                    ent[OUTCOME, e] = code
                    slot_out_f[s] = code
            n_miss = n_look - n_hit
            n_read = n_miss * nbytes
            # acc's bytes read are not added here: every entry of a layer costs the same, so they are
            # (lookups - hits) x the layer's entry bytes, written from the totals once per call (_acc_read).
            acc[ph, lid, ACC_LOOKUPS] += n_look
            acc[ph, lid, ACC_HITS] += n_hit
            b_look += n_look
            b_hit += n_hit
            b_read += n_read
            if WHATIF:  # a plain replay never drops nor fills: these stay 0 without being written
                acc[ph, lid, ACC_SKIPPED] += n_skip
                acc[ph, lid, ACC_SPEC_HITS] += n_spec_hit
                bacc[b, ACC_SKIPPED] += n_skip
                bacc[b, ACC_SPEC_HITS] += n_spec_hit
                stats[STAT_SPEC_HITS] += n_spec_hit
            if retain:
                # Retention: what the predictor names for the next `ahead` layers of this batch is not
                # evictable after this load (nor by this step's speculative fills).
                for m in range(1, ahead + 1):
                    t = li + m
                    if t >= b_end or load_lidx[t] != lid + m:  # past the batch, or not the next layer
                        break
                    for rp in range(load_start[t], load_start[t + 1]):
                        for jp in range(w):
                            ep = pred[rp, jp]
                            if ep >= 0:
                                ent[PIN, ep] = load
            # Eviction: once, after the load, in the load's group, until the group fits. The group's
            # bytes and count live in registers through the step (no hook reads them).
            if n_read == 0 and n_over == 0 and not fill:
                continue  # nothing read and every group fits: no eviction, nothing to write back (the hit path)
            used0 = grp[g, USED]
            budget = grp[g, BUDGET]
            if n_read == 0 and used0 <= budget and not fill:
                continue  # the same, where some other group is above its budget
            used = used0 + n_read
            n_gone = 0
            while used > budget:
                vi = pick_victim(ps, ent, grp, g, load)
                if vi < 0:
                    stats[STAT_OVERFLOW] += 1  # everything left was touched by this load
                    break
                err = _victim_error(ent, g, vi, n_ent)
                if err != 0:
                    stats[STAT_ERR], stats[STAT_ERR_VALUE], stats[STAT_ERR_LOAD] = err, vi, load
                    return
                v = np.uint32(vi)
                if WHATIF and ent[SPEC, v] == 1:
                    stats[STAT_SPEC_EVICTED_UNUSED] += 1
                on_evict(ps, ent, grp, g, v)
                _forget(ent, grp, g, v, KEEP_RES_LIST, WHATIF)
                used -= ent[BYTES, v]
                n_gone += 1
            grp[g, USED] = used
            if used0 > budget:
                n_over -= 1
            if used > budget:
                n_over += 1  # this load overflowed
            resident += used - used0
            if resident > peak:
                peak = resident
            if not KEEP_RES_LIST:
                grp[g, COUNT] += n_miss - n_gone
            n_evict += n_gone
            if not fill:
                continue
            # Speculative fills: the predictions for the load `ahead` layers on, in this batch, read now
            # into the same cache (token-major, rank order, each entry once).
            t = li + ahead
            if t >= b_end or load_lidx[t] != lid + ahead:
                continue
            attempts = 0
            n_fill = 0
            n_fill_bytes = 0
            for rp in range(load_start[t], load_start[t + 1]):
                for jp in range(w):
                    e = pred[rp, jp]
                    if e < 0 or ent[PRED_MARK, e] == load:
                        continue
                    ent[PRED_MARK, e] = load
                    if ent[RESIDENT, e] == 1:
                        stats[STAT_SPEC_RESIDENT] += 1  # already resident: no read, does not use the cap
                        if want_fills:
                            fill_out[rp, jp] = FILL_RESIDENT
                        continue
                    if cap >= 0 and attempts >= cap:
                        stats[STAT_SPEC_CAPPED] += 1
                        if want_fills:
                            fill_out[rp, jp] = FILL_CAPPED
                        continue
                    attempts += 1
                    ge = ent[GROUP, e]
                    need = ent[BYTES, e]
                    ok = True
                    over0 = grp[ge, USED] > grp[ge, BUDGET]
                    while grp[ge, USED] + need > grp[ge, BUDGET]:
                        v = pick_victim(ps, ent, grp, ge, load)
                        if v < 0:
                            stats[STAT_SPEC_NO_ROOM] += 1  # a speculation never overflows the budget
                            if want_fills:
                                fill_out[rp, jp] = FILL_REFUSED
                            ok = False
                            break
                        err = _victim_error(ent, ge, v, n_ent)
                        if err != 0:
                            stats[STAT_ERR], stats[STAT_ERR_VALUE], stats[STAT_ERR_LOAD] = err, v, load
                            return
                        if guard and ent[HEAT, v] >= 2:
                            sv = _guard_score(ent, v, load)
                            if not (sv + sv // 4 + 4 * 256 <= _guard_score(ent, e, load)):
                                stats[STAT_SPEC_REFUSED] += 1
                                if want_fills:
                                    fill_out[rp, jp] = FILL_REFUSED
                                ok = False
                                break
                        if ent[SPEC, v] == 1:
                            stats[STAT_SPEC_EVICTED_UNUSED] += 1
                        on_evict(ps, ent, grp, ge, v)
                        _forget(ent, grp, ge, v, KEEP_RES_LIST, WHATIF)
                        grp[ge, USED] -= ent[BYTES, v]
                        resident -= ent[BYTES, v]
                        if not KEEP_RES_LIST:
                            grp[ge, COUNT] -= 1
                        n_evict += 1
                    if over0 and grp[ge, USED] <= grp[ge, BUDGET]:
                        n_over -= 1  # its evictions brought the group within its budget (a fill never takes one past it)
                    if not ok:
                        continue
                    tick += 1
                    if KEEP_TICK:
                        ent[LAST_TICK, e] = tick
                    ent[LAST_LOAD, e] = load  # most recent (LFRU's recency byte too); not a demand lookup
                    ent[PIN, e] = load  # this step's later fills cannot evict it
                    ent[RESIDENT, e] = 1
                    if not FREQ_RUN:
                        ent[FREQ, e] = 0  # no demand access yet: a speculative fill never raises frequency or heat
                    ent[SPEC, e] = 1
                    grp[ge, USED] += need
                    resident += need
                    grp[ge, COUNT] += 1
                    if KEEP_RES_LIST:
                        _list_add(ent, grp, ge, e)
                    on_admit(ps, ent, grp, ge, e)
                    n_fill += 1
                    n_fill_bytes += need
                    if want_fills:
                        fill_out[rp, jp] = FILL_READ
            tl = load_lidx[t]
            acc[ph, tl, ACC_SPEC_FILLS] += n_fill
            acc[ph, tl, ACC_SPEC_READ] += n_fill_bytes
            bacc[b, ACC_SPEC_FILLS] += n_fill
            bacc[b, ACC_SPEC_READ] += n_fill_bytes
            stats[STAT_SPEC_FILLS] += n_fill
            if resident > peak:
                peak = resident
        bacc[b, ACC_LOOKUPS] += b_look
        bacc[b, ACC_HITS] += b_hit
        bacc[b, ACC_READ] += b_read
    _acc_read(acc, layer_info)
    stats[STAT_TICKS] = tick
    stats[STAT_PEAK_BYTES] = peak
    stats[STAT_EVICTIONS] += n_evict
    if fill:
        for e in range(ent.shape[1]):
            if ent[RESIDENT, e] == 1 and ent[SPEC, e] == 1:
                stats[STAT_SPEC_UNUSED_END] += 1


def make_kernel(name: str, pm: ModuleType, whatif: bool = True, slots: bool = True, checked: bool = False):
    """Compile the driver for one policy module, its hooks inlined.

    The driver's code object is rebound to globals holding this policy's hooks (no closure: a
    closure over dispatchers would never hit Numba's on-disk cache, whose key pickles closure
    cells and a dispatcher pickles with a per-process id). The function's name carries a hash of
    the sources it inlines, so editing a policy module invalidates its cached machine code (Numba
    itself only watches the file that defines the function). ``whatif=False`` compiles the
    drop/prediction paths out (a plain replay pays nothing for them); such a kernel ignores
    ``drop`` and ``pred``, and with ``slots=False`` also ``slot_out`` (the per-slot codes are
    compiled out; a what-if kernel keeps the run-time choice). Branches and live arrays that a
    variant does not need cost registers in the slot loop: measured 15-20% on the LRU benchmark.
    ``checked`` (a user's plugin policy): every array index in the kernel, the inlined hooks' too,
    is bounds-checked (Numba's ``boundscheck``), so a hook indexing past a state ``init`` made too
    short raises IndexError instead of writing outside the array (a crash, or silently wrong
    figures); the built-ins, tested against their naive twins, run unchecked.
    """
    resolve()  # Numba itself, and every helper the driver and hooks read as a dispatcher (traces.util.jit)
    g = dict(_driver.__globals__)
    g.update(on_admit=dispatcher_of(pm.on_admit), on_touch=dispatcher_of(pm.on_touch),
             pick_victim=dispatcher_of(pm.pick_victim), on_evict=dispatcher_of(pm.on_evict),
             KEEP_RES_LIST=bool(getattr(pm, "NEEDS_RESIDENT_LIST", False)), KEEP_TICK=bool(getattr(pm, "NEEDS_TICK", True)),
             KEEP_FREQ=bool(getattr(pm, "NEEDS_FREQ", True)), FREQ_RUN=freq_since(pm) == "run",
             KEEP_LAST_LOAD=bool(getattr(pm, "NEEDS_LAST_LOAD", True)), WHATIF=bool(whatif),
             SLOTS=bool(slots or whatif), NEXT_USE_COL=bool(pm.NEEDS_NEXT_USE),
             KEEP_BATCH=bool(getattr(pm, "NEEDS_BATCH", False)))
    variant = ("_whatif" if whatif else ("_slots" if slots else "")) + ("_checked" if checked else "")
    qual = f"replay_kernel_{re.sub(r'[^A-Za-z0-9_]', '_', name)}{variant}_{_source_hash(pm)}"
    f = FunctionType(_driver.__code__, g, qual, _driver.__defaults__, None)
    f.__qualname__ = qual
    f.__doc__ = _driver.__doc__
    import numba

    return numba.njit(cache=True, nogil=True, _nrt=False, boundscheck=bool(checked))(f)


def freq_since(pm: ModuleType) -> str:
    """A policy's ``FREQ_SINCE``: "run" (whole-run demand counts) or "admission" (the default)."""
    since = getattr(pm, "FREQ_SINCE", "admission")
    if since not in ("run", "admission"):
        raise ValueError(f"{pm.__name__}.FREQ_SINCE = {since!r}: must be 'run' or 'admission'")
    return since


POLICIES_DIR = Path(__file__).resolve().parents[1] / "policies"  # replay/policies: the hooks and their helper modules


def hashed_sources(pm: ModuleType) -> list[Path]:
    """The files whose text names a policy's kernel: the policy's module, this driver, the state
    layout, and every built-in policy source, helper modules (``_lists.py``, ``_heap.py``, ...)
    included, whether imported yet or not (hashing only the modules already in sys.modules gave a
    different name, a recompile, depending on import order). Editing any of them gives the kernel a
    new name, so Numba's on-disk cache, which only watches the file defining the function, never
    runs a kernel built from old hook code."""
    files = {Path(pm.__file__), Path(sys.modules[__name__].__file__), Path(sys.modules["replay.core.state"].__file__)}
    files |= set(POLICIES_DIR.glob("*.py"))
    return sorted(files)


def _source_hash(pm: ModuleType) -> str:
    h = hashlib.sha256()
    for f in hashed_sources(pm):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:10]


@njit(cache=True, nogil=True)
def next_loads_from(entries, load_start, load0, seen):
    """:func:`next_loads` for one part of a trace whose first load is ``load0``, walking backward;
    ``seen`` [entries] int32 holds, for each entry, the first load after this part that touches it
    (NEVER if none) and is updated to the first load from this part on (replay.core.streaming)."""
    out = np.empty(entries.shape, np.int32)
    k = entries.shape[1]
    for load in range(load_start.shape[0] - 2, -1, -1):
        lo, hi = load_start[load], load_start[load + 1]
        for r in range(lo, hi):
            for j in range(k):
                out[r, j] = seen[entries[r, j]]
        for r in range(lo, hi):
            for j in range(k):
                seen[entries[r, j]] = np.int32(load0 + load)
    return out


@njit(cache=True, nogil=True)
def next_loads(entries, load_start, n_entries):
    """For each routed slot, the next load after its own that touches the same entry (NEVER if none)."""
    never = np.int32(2147483647)  # cache_state.NEVER
    return next_loads_from(entries, load_start, np.int64(0), np.full(n_entries, never, np.int32))
