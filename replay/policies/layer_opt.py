"""``layer-opt``: the offline bound over per-layer LRU partitions. Each MoE layer gets its own LRU
share of whole entries, the shares chosen from each layer's own LRU miss curve to minimise the
total misses (lookups of all phases, prefill and decode) under the budget: the best any
per-layer-partitioned LRU (``layer`` with any split) can do. It reads the whole trace before
choosing, so it is a bound beside ``belady``, not an online policy (``BOUND``: never a "best
online" candidate).

Miss curve of layer l, misses_l(C) for C = 0..n_expert entries, all phases, in one pass by stack
distances adapted to loads, and exactly equal to replaying that layer's LRU with a share of C
entries through the driver (checked at every C in tests/test_policies_partition.py). Why: the
load's entries are the layer's most recent, and eviction after a load removes the least recent
others until C fit, so after every load the layer holds exactly its max(C, u) most recent entries,
u = the load's unique entries (u > C: the load overflowed its share and holds just itself). So a
lookup is a hit iff its entry's rank in the layer's recency order at the start of its load (its
stack distance d; recency is the token-major visit order, repeats included; never seen: d =
infinity) is <= max(C, u of the layer's previous load): a miss for every C < d when d > u_prev,
never otherwise. One histogram of d per layer, summed from the top, is the whole curve.

Allocation, exact (no greedy step: LRU curves need not be convex): dynamic programming over the
layers on Pareto frontiers of (bytes, misses), each layer's share a whole number of its own
entries (layers may differ in expert_bytes); the objective is (total misses, then total share
bytes, then the lexicographically smallest vector of entries per layer), so the choice is unique.
Overflow: a share smaller than a load of its layer (its unique entries) lets that load overflow,
holding more than the share, and the cell is marked over budget. To compare like with like, the
shares have a floor, the first of these that fits in the budget: (1) every layer's largest load
(no load overflows: the bound over partitions that never exceed the budget); (2) every layer's
largest decode load (only prefill loads may overflow, as they do under ``layer`` whenever a
prompt's batch routes more experts to a layer than its share holds); (3) none (every partition
overflows somewhere; the optimum then also uses overflow as memory). ``layer-opt`` is the best
partition above that floor (:func:`share_floor`); a partition below it overflows more loads, so it
is not like with like.

The shares are replayed with the ``lru`` hooks, one group per layer, through the same driver, so
its figures are comparable cell by cell; ``share_mib`` in the per-layer rows lists them. The
shares are chosen from the plain trace (a what-if's drops or predictions do not change them).
Option ``entries_per_layer`` (API only): replay that partition instead of the optimum.
"""

from __future__ import annotations

import numpy as np

from replay.policies.lru import init, on_admit, on_evict, on_touch, pick_victim  # noqa: F401
from traces.format.errors import UserError
from traces.util.bits import popcount64
from traces.util.jit import njit

PARTITION = "layer"
UNBOUNDED = False
BOUND = True
NEEDS_NEXT_USE = False
NEEDS_LAST_LOAD = False
NEEDS_TICK = False
NEEDS_FREQ = False
OPTIONS = ("entries_per_layer",)


@njit(cache=True, nogil=True)
def _stack_pass(entries, load_start, load_lidx, load_phase, n_layers, n_expert):
    """(hist [2, L, n + 2], umax [2, L]): hist[phase, l, d] = lookups of layer l in loads of that
    phase (0 prefill, 1 decode) with stack distance d (n + 1 = never seen) greater than the previous
    load's unique count; umax[phase, l] = most unique entries in one load of that phase. The phase
    split is for :mod:`replay.analyses.curve` (decode-only hit rates); the allocation sums it.

    Recency per layer as visit positions: each entry of layer l sits at the position of its last
    visit (``pos``), a layer's W words of bits mark its occupied positions, and a visit moves its
    entry to the layer's next free position. An entry's rank d (1 = most recent) is then the set
    bits at its position and above: one masked popcount per word, W = ceil(2 n / 64) words (4 at
    128 experts), not a scan of the layer's n entries (4x faster on the 4.8 M-routing trace of
    benchmarks/RESULTS.md, "session 11"). When a layer runs out of positions its live ones are
    compacted to 0..m-1, each to its rank among them (popcounts again), keeping their order."""
    hist = np.zeros((2, n_layers, n_expert + 2), np.int64)
    umax = np.zeros((2, n_layers), np.int64)
    uprev = np.zeros(n_layers, np.int64)
    W = (2 * n_expert + 63) // 64  # at least 2 x n positions: a compaction frees at least n
    P = W * 64
    occ = np.zeros(n_layers * W, np.uint64)
    top = np.zeros(n_layers, np.int64)  # each layer's next free position
    pos = np.full(n_layers * n_expert, -1, np.int64)  # -1: never visited
    mark = np.full(n_layers * n_expert, -1, np.int64)
    before = np.zeros(W, np.int64)
    ones = ~np.uint64(0)
    zero = np.uint64(0)
    one = np.uint64(1)
    k = entries.shape[1]
    for load in range(load_start.shape[0] - 1):
        lo, hi = load_start[load], load_start[load + 1]
        lid = load_lidx[load]
        ob = lid * W
        ph = load_phase[load]
        up = uprev[lid]
        u = 0
        for r in range(lo, hi):  # ranks at the load's start: positions not yet updated
            for j in range(k):
                e = entries[r, j]
                if mark[e] == load:
                    continue
                mark[e] = load
                u += 1
                p = pos[e]
                d = n_expert + 1
                if p >= 0:
                    wp = p >> 6
                    m = ones << np.uint64(p & 63)
                    d = 0
                    for w in range(W):  # a fixed-length loop, the other words masked by arithmetic (a
                        # select compiles to a branch, mispredicted where the mask flips)
                        d += popcount64(occ[ob + w] & ((m & (zero - np.uint64(w == wp))) | (zero - np.uint64(w > wp))))
                # d <= uprev: resident at every share, not counted; bin 0 (no rank is 0) takes those
                # lookups without a branch (mispredicted often: a layer's previous load's entry comes
                # back often) and is cleared at the end
                hist[ph, lid, d if d > up else 0] += 1
        t = top[lid]
        for r in range(lo, hi):  # then every visit moves its entry to the top, in visit order
            for j in range(k):
                e = entries[r, j]
                if t == P:  # out of positions: each live one to its rank among them, order kept
                    c = 0
                    for w in range(W):
                        before[w] = c
                        c += popcount64(occ[ob + w])
                    for x in range(lid * n_expert, (lid + 1) * n_expert):
                        q = pos[x]
                        if q >= 0:
                            pos[x] = before[q >> 6] + popcount64(occ[ob + (q >> 6)] & ((one << np.uint64(q & 63)) - one))
                    for w in range(W):  # positions 0..c-1 occupied
                        lo_w = w * 64
                        occ[ob + w] = ones if lo_w + 64 <= c else (((one << np.uint64(c - lo_w)) - one) if lo_w < c else zero)
                    t = c
                p = pos[e]
                if p >= 0:
                    occ[ob + (p >> 6)] &= ~(one << np.uint64(p & 63))
                pos[e] = t
                occ[ob + (t >> 6)] |= one << np.uint64(t & 63)
                t += 1
        top[lid] = t
        uprev[lid] = u
        if u > umax[ph, lid]:
            umax[ph, lid] = u
    hist[:, :, 0] = 0
    return hist, umax


def miss_curves(loads) -> tuple[np.ndarray, np.ndarray]:
    """(misses int64 [L, n_expert + 1], largest load int64 [2, L]): misses[l, C] = lookups of layer
    l (all phases) that miss under LRU with a share of C entries of that layer; largest[phase, l] =
    most unique entries in one load of layer l in that phase (0 prefill, 1 decode)."""
    misses, umax = miss_curves_by_phase(loads)
    return misses.sum(axis=0), umax


def miss_curves_by_phase(loads) -> tuple[np.ndarray, np.ndarray]:
    """:func:`miss_curves` split by phase: (misses int64 [2, L, n_expert + 1], largest [2, L]),
    misses[phase, l, C] counting the lookups of that phase's loads (0 prefill, 1 decode)."""
    L, n = len(loads.moe_layers), loads.n_expert
    hist, umax = _stack_pass(loads.entries, loads.load_start, loads.load_lidx, loads.load_phase, L, n)
    # misses(C) = lookups with d > C = sum of hist[d] for d = C + 1 .. n + 1
    suffix = np.cumsum(hist[:, :, ::-1], axis=2)[:, :, ::-1]
    return suffix[:, :, 1:].copy(), umax


def allocate(misses: np.ndarray, entry_bytes: np.ndarray, budget_bytes: int, lo: np.ndarray) -> np.ndarray:
    """Entries per layer c (lo[l] <= c[l] <= n) with sum c[l] * entry_bytes[l] <= budget minimising
    (total misses, total bytes, c lexicographically); exact. Needs sum lo * entry_bytes <= budget."""
    L, n1 = misses.shape
    w = entry_bytes.astype(np.int64)
    # Suffix frontiers: front[l] = (bytes ascending, misses strictly descending) for layers l..L-1.
    front: list[tuple[np.ndarray, np.ndarray]] = [None] * (L + 1)  # type: ignore[list-item]
    front[L] = (np.zeros(1, np.int64), np.zeros(1, np.int64))
    for l in range(L - 1, -1, -1):
        cs = np.arange(lo[l], n1, dtype=np.int64)
        # A share that misses no less than one entry fewer only costs bytes: never part of an optimum.
        cs = cs[np.r_[True, misses[l, cs[1:]] < misses[l, cs[:-1]]]]
        fb, fm = front[l + 1]
        b = (fb[:, None] + cs[None, :] * w[l]).ravel()
        m = (fm[:, None] + misses[l, cs][None, :]).ravel()
        ok = b <= budget_bytes
        b, m = b[ok], m[ok]
        order = np.lexsort((m, b))
        b, m = b[order], m[order]
        keep = np.ones(b.shape[0], bool)
        keep[1:] = m[1:] < np.minimum.accumulate(m)[:-1]
        front[l] = (b[keep], m[keep])

    def best(l: int, room: int) -> tuple[int, int] | None:
        fb, fm = front[l]
        i = int(np.searchsorted(fb, room, side="right")) - 1
        return None if i < 0 else (int(fm[i]), int(fb[i]))

    out = np.zeros(L, np.int64)
    room = int(budget_bytes)
    for l in range(L):
        target = best(l, room)
        assert target is not None
        for c in range(int(lo[l]), n1):
            cost = c * int(w[l])
            if cost > room:
                break
            rest = best(l + 1, room - cost)
            if rest is not None and (int(misses[l, c]) + rest[0], cost + rest[1]) == target:
                out[l] = c
                break
        else:  # pragma: no cover - the frontier guarantees a completion
            raise AssertionError("layer-opt: no completion of the optimal partition")
        room -= int(out[l]) * int(w[l])
    return out


def prepare_options(loads, options: dict) -> dict:
    """Compute the miss curves once (a sweep shares them over its budgets); check a given partition."""
    out = dict(options)
    L = len(loads.moe_layers)
    given = out.get("entries_per_layer")
    if given is not None:
        c = np.asarray(given)
        if c.shape != (L,) or not np.issubdtype(c.dtype, np.integer) or (c < 0).any() or (c > loads.n_expert).any():
            raise UserError(f"layer-opt: entries_per_layer must be {L} whole numbers in 0..{loads.n_expert} (one per MoE layer).")
        out["entries_per_layer"] = c.astype(np.int64)
    out["_curves"] = miss_curves(loads)
    return out


def partition(loads, budget_bytes: int, options: dict) -> np.ndarray:
    """Entries per MoE layer int64 [L]: the given ``entries_per_layer`` or the optimum."""
    if options.get("entries_per_layer") is not None:
        c = np.asarray(options["entries_per_layer"], np.int64)
        need = int((c * loads.layer_expert_bytes).sum())
        if need > budget_bytes:
            raise UserError(f"layer-opt: entries_per_layer takes {need:,} bytes, more than the {budget_bytes:,}-byte budget.")
        return c
    misses, umax = options["_curves"] if "_curves" in options else miss_curves(loads)
    w = loads.layer_expert_bytes.astype(np.int64)
    return allocate(misses, w, budget_bytes, share_floor(umax, w, budget_bytes))


def share_floor(largest: np.ndarray, entry_bytes: np.ndarray, budget_bytes: int) -> np.ndarray:
    """Entries per layer every share must hold: the largest load of any phase, else the largest
    decode load, else nothing, whichever fits the budget first (``largest`` from :func:`miss_curves`)."""
    for lo in (largest.max(axis=0), largest[1], np.zeros(largest.shape[1], np.int64)):
        if int((lo * entry_bytes).sum()) <= budget_bytes:
            return lo.astype(np.int64)
    raise AssertionError("unreachable: a zero floor always fits")


def group_budgets(loads, budget_bytes: int, options: dict) -> np.ndarray:
    """Each layer's share in bytes: its entries x its expert_bytes."""
    return partition(loads, budget_bytes, options) * loads.layer_expert_bytes.astype(np.int64)


def describe(loads, budgets_bytes: list[int], options: dict) -> str:
    return ("layer-opt = offline bound over per-layer LRU partitions: each MoE layer's LRU share (whole entries) chosen from "
            "the layers' own LRU miss curves (stack distances, whole trace) to minimise total misses, all phases, under the "
            "budget (exact allocation), each share at least its layer's largest load, else its largest decode load, else 0, "
            "whichever fits first. "
            "A bound, not an online policy; its shares are share_mib in --per-layer.")
