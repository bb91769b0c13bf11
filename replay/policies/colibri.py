"""``colibri``: the expert cache of the colibri engine (github.com/JustVugg/colibri), as its shared
native scheduler implements it (``c/expert_scheduler.c`` and ``c/tier.h``, used by its Qwen3-Next,
Qwen3.5 and Granite GGUF backends): per MoE layer a *pinned tier* (never evicted) plus an *LRU
tier*; every ``repin`` tokens a re-pin pass may swap, in each layer, its coldest pinned expert for
a clearly hotter unpinned one, ranked by colibri's LFRU score; after a swap that layer's heat is
halved.

Where it differs from ``lfru``: ``lfru`` here is one global cache over all layers that evicts the
lowest score (in-cache frequency << 8 | recency byte), so it ranks exactly like ``lfu-incache``.
colibri never evicts by that score: its eviction is plain LRU inside a layer; the score (with
*demand heat*, counted over the whole session and halved at each swap, not an in-cache count)
only decides which experts hold the pinned slots.

What is colibri's (the source, read at commit 003a0b9):

- *heat* (``coli_expert_record_demand``): per layer and expert, +1 for every demand access (a
  routed expert of a token, pinned or cached, hit or miss); a speculative load (prefetch) never
  adds. ``tier_decay`` halves every heat of the layer (``heat >>= 1``) after a successful swap.
- *access clock*: one counter for the whole model, +1 per demand access (all layers); an expert's
  ``last`` is the clock value of its last demand access (0 = never).
- *score* (``tier_lfru_score``): ``heat << 8 | recent``, ``recent = 255 - (clock - last)`` if that
  age is below 255, else 0 (an expert never accessed has ``last = 0``, so while the clock is below
  255 it too gets a recency byte; kept as is). The window is 255 *demand accesses*, all layers
  together: with top-k 8 over 48 MoE layers that is under one token.
- *re-pin* (``qwen_repin``, after every forward, prompt tokens included: ``REPIN`` tokens apart;
  ``tier_pick_lfru``): in every layer with pins, the coldest pinned slot (lowest score; ties to the
  lower slot index) against the hottest unpinned expert (highest score; ties to the lower expert
  id); the swap happens only if ``hot > cold + cold // 4 + 4 * 256`` (25% + 4 heat units of
  hysteresis). The new expert takes the cold one's slot; the old one leaves the cache.
- *LRU tier* (``coli_expert_choose_lru``): victim = the least recently used cached expert of the
  layer; a demand hit on a cached (not pinned) expert and every admission (demand or speculative)
  make it most recent.
- sizes: the LRU slots are split evenly over the layers (``cache_slots / L`` each, the remainder one
  more to the first layers); the pinned experts come from the persistent usage history
  (``.coli_usage`` of earlier sessions), half the slots by default (``PIN_GB`` unset);
  ``REPIN`` = 0 (off) by default, ``--policy balanced`` sets ``REPIN=64``.

This replay's semantics (the mapping onto loads; docs/design.md "Replay semantics"):

- a demand access = a *lookup*: one per entry per load (a repeat inside a load is not another
  access). On decode a load is one token's routing at one layer, so this is colibri's count
  exactly; a prefill batch is one load per layer here (the engine looks each routed expert up
  once for the batch), where colibri's token-by-token prompt would count each token's access.
  The access clock advances once per lookup in the driver's order (token-major, slot order).
- eviction runs once after each load, never on the current load's entries (the driver's rule),
  not at each miss: the layer may hold the whole load before it evicts.
- budgets are bytes: each layer's group holds its N pinned experts plus its LRU share, the bytes
  left after all pins split in whole entries round-robin from the first layer (with equal expert
  sizes: colibri's even split with the remainder to the first layers), at most n_expert - N
  entries a layer. N (``per_layer``): the same in every layer, default as many as fit in half the
  budget (colibri's default of half the slots, but per layer: colibri ranks its usage history over
  all layers at once, so its layers get unequal counts), or every expert when the budget holds
  them all (colibri then pins all). The hot list: ``pin``'s (this trace's prompt, or
  ``profile``, another trace's whole-run counts, which stands for colibri's usage history); each
  layer's pinned slots in that rank order (colibri's order). Pinned experts are preloaded
  (``preload_mib``).
- re-pin (``repin`` tokens, 0 = off, colibri's default; 64 is its balanced setting): passes run
  only at batch boundaries, before the batch's first lookup: a pass runs before batch b when the
  tokens of the batches since the last pass (each batch's most routing rows in one of its loads:
  one per decode token) add up to ``repin`` or more; the count then restarts at 0. On decode this
  is colibri's schedule; a long prompt batch gives one pass at its end instead of one every
  ``repin`` prompt tokens.
- a swap changes tiers, not residency (the driver alone loads and evicts): the promoted expert
  leaves the LRU tier if it is cached; if it is not cached, it is pinned but absent and is read
  at its next demand lookup (a miss, counted in ``read_mib``; colibri reads it at the swap, off
  the demand path, so that lookup would be a hit there). The demoted expert is not dropped (colibri
  drops it and frees its slot): it joins its layer's LRU tier as the least recent entry, the next
  victim, so a lookup of it before the layer next evicts is a hit here and a miss in colibri.
- what-ifs: a speculative fill neither adds heat nor moves the clock (colibri's
  ``record_demand`` runs for demand only) and enters the LRU tier as most recent; the eviction
  guard of a fill is the driver's (lifetime heat, recency by loads), not colibri's.

State (``ps``, int64, built by :func:`setup`): a header, then per entry the LRU links, its tier
(absent / LRU / pinned), heat, last access (clock), the last load whose lookup counted, then per
layer the list head/tail and the pinned slots, then the loads before which a pass runs.
"""

from __future__ import annotations

import numpy as np

from replay.core.state import BATCH_LOAD, PIN, RESIDENT, SPEC, evictable, preload
from replay.policies import pin as _pin
from replay.policies._lists import make_list
from traces.format.errors import UserError
from traces.util.jit import njit
from traces.util.units import exact

PARTITION = "layer"
UNBOUNDED = False
NEEDS_NEXT_USE = False
NEEDS_LAST_LOAD = False
NEEDS_TICK = False
NEEDS_FREQ = False
NEEDS_BATCH = True
OPTIONS = ("per_layer", "profile", "repin")

DEFAULT_REPIN = 0  # colibri: REPIN unset = off (--policy quality)
BALANCED_REPIN = 64  # colibri: --policy balanced sets REPIN=64
MARGIN_HEAT = 4  # tier_pick_lfru: hot > cold + cold / 4 + (4 << 8)

# ps header (int64 scalars), then regions whose offsets follow from the header
CLOCK, NPIN, NEXP, NCOL, NGRP, NEXT_PASS, N_PASS = 0, 1, 2, 3, 4, 5, 6
HDR = 8
ABSENT, LISTED, PINNED = 0, 1, 2  # an entry's tier


@njit(cache=True, inline="always")
def _state(ps):
    return HDR + 2 * ps[NCOL]


@njit(cache=True, inline="always")
def _heat(ps):
    return HDR + 3 * ps[NCOL]


@njit(cache=True, inline="always")
def _last(ps):
    return HDR + 4 * ps[NCOL]


@njit(cache=True, inline="always")
def _seen(ps):
    return HDR + 5 * ps[NCOL]


@njit(cache=True, inline="always")
def _ht(ps, g):
    return HDR + 6 * ps[NCOL] + 2 * g


@njit(cache=True, inline="always")
def _pins(ps, g):
    return HDR + 6 * ps[NCOL] + 2 * ps[NGRP] + g * ps[NPIN]


@njit(cache=True, inline="always")
def _passes(ps):
    return HDR + 6 * ps[NCOL] + 2 * ps[NGRP] + ps[NGRP] * ps[NPIN]


@njit(cache=True, inline="always")
def _prev_at(ps, e):
    return HDR + 2 * e


@njit(cache=True, inline="always")
def _next_at(ps, e):
    return HDR + 2 * e + 1


_push, _unlink_at = make_list(_prev_at, _next_at)


@njit(cache=True, inline="always")
def _unlink(ps, g, e):
    h = _ht(ps, g)
    _unlink_at(ps, h, h + 1, e)


@njit(cache=True, inline="always")
def _append(ps, g, e):
    """``e`` becomes the most recent of layer ``g``'s LRU tier."""
    h = _ht(ps, g)
    _push(ps, h, h + 1, e)


@njit(cache=True, inline="always")
def _prepend(ps, g, e):
    """``e`` becomes the least recent of layer ``g``'s LRU tier (the next victim)."""
    h = _ht(ps, g)
    f = ps[h]
    ps[HDR + 2 * e] = -1
    ps[HDR + 2 * e + 1] = f
    if f >= 0:
        ps[HDR + 2 * f] = e
    else:
        ps[h + 1] = e
    ps[h] = e


@njit(cache=True, inline="always")
def score(ps, e):
    """colibri's ``tier_lfru_score``: heat << 8 | recency byte over 255 demand accesses."""
    age = ps[CLOCK] - ps[_last(ps) + e]
    rec = 255 - age if age < 255 else 0
    return (ps[_heat(ps) + e] << 8) | rec


@njit(cache=True)
def _repin_pass(ps, ent):
    """One re-pin pass over every layer (colibri's ``qwen_repin`` body)."""
    n_pin = ps[NPIN]
    n_exp = ps[NEXP]
    if n_pin == 0:
        return
    st = _state(ps)
    heat = _heat(ps)
    for g in range(ps[NGRP]):
        pins = _pins(ps, g)
        cold = 0
        cs = score(ps, ps[pins])
        for z in range(1, n_pin):
            s = score(ps, ps[pins + z])
            if s < cs:
                cold = z
                cs = s
        base = g * n_exp
        hot = -1
        hs = np.int64(0)
        for x in range(n_exp):
            e = base + x
            if ps[st + e] == PINNED:
                continue
            s = score(ps, e)
            if hot < 0 or s > hs:
                hot = e
                hs = s
        if hot < 0 or hs <= cs + (cs >> 2) + (MARGIN_HEAT << 8):
            continue
        c = ps[pins + cold]
        ps[pins + cold] = hot
        if ps[st + hot] == LISTED:
            _unlink(ps, g, hot)
        ps[st + hot] = PINNED  # pinned; if not resident, read at its next demand lookup
        if ent[RESIDENT, c] == 1:
            _prepend(ps, g, c)  # demoted: the least recent of the LRU tier
            ps[st + c] = LISTED
        else:
            ps[st + c] = ABSENT
        for x in range(n_exp):
            ps[heat + base + x] >>= 1


@njit(cache=True, inline="always")
def _catch_up(ps, ent, grp, g):
    """Run the passes due at or before the current batch's first load (the driver wrote it into
    ``grp[:, BATCH_LOAD]`` before the batch's first lookup; nothing changed since that boundary
    if no hook ran yet)."""
    p = ps[NEXT_PASS]
    if p < ps[N_PASS] and ps[_passes(ps) + p] <= grp[g, BATCH_LOAD]:
        while p < ps[N_PASS] and ps[_passes(ps) + p] <= grp[g, BATCH_LOAD]:
            _repin_pass(ps, ent)
            p += 1
        ps[NEXT_PASS] = p


@njit(cache=True, inline="always")
def _demand(ps, ent, e):
    """A demand lookup of ``e`` (once per load: ``ent[PIN, e]`` is the load looking it up)."""
    seen = _seen(ps) + e
    if ps[seen] != ent[PIN, e]:
        ps[seen] = ent[PIN, e]
        ps[CLOCK] += 1
        ps[_heat(ps) + e] += 1
        ps[_last(ps) + e] = ps[CLOCK]


def init(ent: np.ndarray, grp: np.ndarray, seed: int) -> np.ndarray:
    return np.zeros(HDR, np.int64)  # a placeholder: setup builds the state, which depends on the trace


@njit(cache=True, inline="always")
def on_admit(ps, ent, grp, g, e):
    _catch_up(ps, ent, grp, g)
    if ent[SPEC, e] == 0:  # a speculative fill is not a demand access
        _demand(ps, ent, e)
    st = _state(ps) + e
    if ps[st] == PINNED:
        return  # a pinned expert read at last: stays pinned
    if ps[st] == LISTED:
        _unlink(ps, g, e)  # demoted by the pass that just ran before this lookup
    _append(ps, g, e)
    ps[st] = LISTED


@njit(cache=True, inline="always")
def on_touch(ps, ent, grp, g, e):
    _catch_up(ps, ent, grp, g)
    _demand(ps, ent, e)
    if ps[_state(ps) + e] == LISTED and ps[_ht(ps, g) + 1] != e:
        _unlink(ps, g, e)
        _append(ps, g, e)


@njit(cache=True, inline="always")
def pick_victim(ps, ent, grp, g, load):
    _catch_up(ps, ent, grp, g)
    e = ps[_ht(ps, g)]
    while e >= 0 and not evictable(ent, e, load):
        e = ps[HDR + 2 * e + 1]
    return e


@njit(cache=True, inline="always")
def on_evict(ps, ent, grp, g, e):
    _unlink(ps, g, e)
    ps[_state(ps) + e] = ABSENT


# -- plain Python, before the replay ---------------------------------------------------------------


def prepare_options(loads, options: dict) -> dict:
    """``per_layer`` and ``profile`` checked and resolved as ``pin`` does; ``repin`` a whole
    number of tokens >= 0 (0 = off)."""
    out = dict(options)
    r = out.get("repin", DEFAULT_REPIN)
    if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 0:
        raise UserError(f"colibri: repin {r!r} is not a whole number of tokens >= 0 (0 = off).")
    out.update(_pin.prepare_options(loads, {k: v for k, v in out.items() if k in ("per_layer", "profile")}))
    out["repin"] = int(r)
    return out


def per_layer_for(loads, budget_bytes: int, options: dict) -> int:
    """N: the option; else every expert if the budget holds them all, else as many per layer as
    fit in half the budget."""
    n = options.get("per_layer")
    if n is not None:
        return int(n)
    if budget_bytes >= loads.n_expert * int(loads.layer_expert_bytes.sum()):
        return loads.n_expert
    return min(loads.n_expert, budget_bytes // 2 // int(loads.layer_expert_bytes.sum()))


def lru_entries(loads, budget_bytes: int, n_pin: int) -> np.ndarray:
    """Entries of each layer's LRU tier: the bytes left after the pins, in whole entries
    round-robin from the first layer, at most n_expert - n_pin a layer."""
    eb = loads.layer_expert_bytes.astype(np.int64)
    L = eb.shape[0]
    rest = budget_bytes - n_pin * int(eb.sum())
    cap = loads.n_expert - n_pin
    out = np.zeros(L, np.int64)
    if rest <= 0 or cap <= 0:
        return out
    full = min(cap, rest // int(eb.sum()))  # whole rounds at once, then one entry at a time
    out[:] = full
    rest -= full * int(eb.sum())
    grew = True
    while grew:
        grew = False
        for li in range(L):
            if out[li] < cap and rest >= eb[li]:
                out[li] += 1
                rest -= int(eb[li])
                grew = True
    return out


def group_budgets(loads, budget_bytes: int, options: dict) -> np.ndarray:
    n = per_layer_for(loads, budget_bytes, options)
    eb = loads.layer_expert_bytes.astype(np.int64)
    need = n * int(eb.sum())
    if need > budget_bytes:
        raise UserError(f"colibri: {n} pinned experts per layer take {exact(need / (1 << 20))} MiB, more than the "
                        f"{exact(budget_bytes / (1 << 20))} MiB budget; pin fewer per layer.")
    return (n + lru_entries(loads, budget_bytes, n)) * eb


def pass_loads(loads, repin: int) -> np.ndarray:
    """The loads before which a re-pin pass runs: the first load of each batch before which the
    batches since the last pass hold ``repin`` tokens or more (a batch's tokens: the most routing
    rows of one of its loads)."""
    if repin <= 0 or loads.load_batch.shape[0] == 0:
        return np.zeros(0, np.int64)
    rows = np.diff(loads.load_start)
    firsts = np.flatnonzero(np.r_[True, loads.load_batch[1:] != loads.load_batch[:-1]])
    tokens = np.maximum.reduceat(rows, firsts)
    out = []
    since = 0
    for i, f in enumerate(firsts):
        if i > 0 and since >= repin:
            out.append(int(f))
            since = 0
        since += int(tokens[i])
    return np.array(out, np.int64)


def setup(ps, ent, grp, loads, budget_bytes: int, options: dict) -> np.ndarray:
    """Build the state: pins preloaded (each layer's hot list, in rank order), the pass schedule."""
    n = per_layer_for(loads, budget_bytes, options)
    hot = _pin.hot_list(loads, budget_bytes, {**options, "per_layer": n})
    passes = pass_loads(loads, int(options.get("repin", DEFAULT_REPIN)))
    ncol = ent.shape[1]
    G = grp.shape[0]
    out = np.zeros(HDR + 6 * ncol + 2 * G + G * n + passes.shape[0], np.int64)
    out[NPIN], out[NEXP], out[NCOL], out[NGRP], out[N_PASS] = n, loads.n_expert, ncol, G, passes.shape[0]
    out[HDR: HDR + 2 * ncol] = -1  # no links
    out[HDR + 5 * ncol: HDR + 6 * ncol] = -1  # no load counted yet
    out[HDR + 6 * ncol: HDR + 6 * ncol + 2 * G] = -1  # empty lists
    st = HDR + 2 * ncol
    for g in range(G):
        for z, e in enumerate(hot[g]):
            preload(ent, grp, int(e))
            out[st + int(e)] = PINNED
            out[HDR + 6 * ncol + 2 * G + g * n + z] = int(e)
    out[HDR + 6 * ncol + 2 * G + G * n:] = passes
    return out


def describe(loads, budgets_bytes: list[int], options: dict) -> str:
    _, src = _pin.hot_counts(loads, options)
    ns = [per_layer_for(loads, b, options) for b in budgets_bytes]
    how = (f"{ns[0]} per layer (given)" if options.get("per_layer") is not None else
           "per layer as many as fit in half the budget (" + ", ".join(str(n) for n in ns) + " at the budgets above)")
    r = int(options.get("repin", DEFAULT_REPIN))
    rp = (f"re-pin every {r} tokens (at batch boundaries): in each layer the coldest pin yields to the hottest unpinned "
          "expert by colibri's LFRU score (demand heat << 8 | recency byte over 255 demand accesses) when it leads by "
          "25% + 4 heat, then that layer's heat is halved" if r else
          f"no re-pin (colibri's default; --colibri-repin {BALANCED_REPIN} is its balanced setting)")
    return (f"colibri = per MoE layer a pinned tier (the most-routed experts in {src}, {how}, preloaded) plus LRU over the "
            f"layer's share of the rest; {rp}.")
