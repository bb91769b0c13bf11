"""The whole hit-rate curve in one pass: global LRU (``lru``) and per-layer LRU partitions
(``layer``, each layer's own curve, and ``layer-opt``'s allocation) at every budget where the
curve changes, exactly equal to replaying the driver at each budget (docs/design.md, "curve").

Why one pass is exact with the engine's load semantics (:mod:`replay.core.driver`): recency is the
visit order (token-major inside a load, repeats included); a load's entries are looked up against
what was resident at the load's start, admitted at once, and eviction runs once after the load,
removing the least recent entries the load did not touch until the group fits. By induction the
cache after every load holds the longest most-recent prefix of the recency stack whose bytes fit
the budget, or, when the load itself is larger than the budget (an overflow), exactly the load's
own entries: the prefix of length max(u, J), u = the load's unique entries (they are the u most
recent), J = the longest prefix that fits. (If the prefix of length J + 1 fitted after load t, its
older part was a fitting prefix after load t - 1 too, longer than what was resident then.) So a
lookup of entry e at load t hits iff

- e was looked up in load t - 1 (it is among the u most recent: resident at every budget), or
- D(e) <= budget, D = the bytes of the distinct entries visited since e's last visit, e included,
  measured at the start of load t (the other lookups of load t do not count: they are not yet
  visited when the load is looked up against the cache).

D is measured over visit positions (each entry at the position of its last visit, weighing its
layer's ``expert_bytes``; positions are compacted when they run out, so the arrays hold about 2 x
entries and stay in cache): with one expert size, the size times the occupied positions from the
entry's on (popcounts of an occupancy bitmask, then counts of whole blocks); with sizes that differ
by layer, the bytes of whole runs of 64 positions after its own, then those of its own run's later
positions (fixed-length sums the compiler vectorises). A histogram of D is the whole curve; a load
overflows at budget B iff its unique entries' bytes exceed B.

``layer`` (the budget split equally, floor(budget_bytes / MoE layers) per layer): each layer's
share holds C = floor(share / expert_bytes) entries, and per layer the same argument gives the
stack distances :func:`replay.policies.layer_opt.miss_curves_by_phase` already counts (a hit iff
the rank at the load's start <= max(C, u of the layer's previous load)); a load of layer l
overflows iff its unique entries exceed C_l. ``layer-opt``'s shares come from
:func:`replay.policies.layer_opt.partition` (the same code the policy runs), fed the same curves.

Furthest-next-use (``belady``) only where it is a stack algorithm: one lookup per load (top-1,
one token per batch) and one expert size; there the C-entry cache after each load is the top C of
Mattson's OPT stack (:func:`_opt_pass`), so one pass gives every budget. With loads that read
several entries together, or sizes that differ by layer, a larger cache's contents need not include
a smaller one's, so no one-pass curve is exact: the curve refuses ``belady`` there and says why
(``cache --policies belady`` replays it per budget).

Sampling (``sample_rate`` / ``sample_size``, SHARDS: Waldspurger et al., FAST 2015): a seeded
hash of each (layer, expert) entry picks the entries whose lookups are measured (all or none of an
entry's lookups); distances are taken among sampled entries only and scaled by 1 / rate, so a
sampled row at budget B estimates the exact row at B from the sampled lookups' hit ratio. The
membership of the previous load (the always-hit case) and overflow are exact (they are cheap).
With a fixed sample size the entries with the smallest hashes are taken (the universe of entries
is known: layers x experts), so the rate is exactly size / entries. Sampled rows are estimates:
``sampled`` is True on them, and benchmarks/RESULTS.md states the error measured against the
exact curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from traces.format.errors import UserError
from traces.util.bits import popcount64
from traces.util.jit import njit
from traces.util.units import MIB

# A dense histogram of byte distances in units of the layers' gcd when it has at most this many
# bins; beyond, the distances are listed and sorted (np.unique): both exact.
DENSE_BINS = 1 << 21
SAMPLE_MOD = 1 << 24  # the spatial hash's range: an entry is sampled when hash mod this < rate x this


WORDS = 8  # 64-bit words of visit positions per block: a distance counts whole blocks, then one block's words


@njit(cache=True, nogil=True)
def _lru_pass(entries, load_start, load_lidx, load_phase, layer_bytes, layer_units, n_expert, keep, dense):
    """One pass over the loads for global LRU. Returns (cnt int64 [2, nbins], rd int64 [2, nbins],
    dist int64 [n], phase int8 [n], lidx int32 [n], always int64 [2], cold_bytes int64 [2], lookups
    int64 [2], uhist int64 [2, L, n_expert + 1]).

    Measured lookups: every lookup, or with ``keep`` [entries] bool non-empty only those of kept
    entries. Per phase: ``lookups`` measured, ``always`` of them looked up in the previous non-empty
    load (resident at every budget), ``cold_bytes`` the bytes of first visits (missed at every
    budget). Every other measured lookup has a stack distance D (at the load's start, among measured
    entries) in ``layer_units`` (each layer's expert bytes over a common unit; bytes when unit = 1):
    with ``dense`` counted in cnt/rd[phase, D] (lookups, bytes of the entry; nbins = the units of
    every entry + 1), else listed in dist/phase/lidx. uhist[phase, layer, u] = the non-empty loads
    of that phase and layer with u unique entries (all entries, sampled or not): what overflow and
    the per-layer curves need, without a per-load array. ``layer_units``' dtype is the stack's (int32
    when the units of every entry fit: twice the lanes per vector in the block sums).

    Recency as visit positions: each measured entry sits at the position of its last visit, one bit
    per position marks the occupied ones (``occ``), and a visit moves its entry to the next free
    position. When every layer's entries weigh the same (one expert size), D is that weight times
    the occupied positions at p and above: the set bits of p's word from p, of the later words of
    its block of :data:`WORDS` words (popcounts), and the counts of the later blocks (``bcnt``);
    then ``rd`` is ``cnt`` times the one size, derived after the pass. With sizes that differ by
    layer, D sums units: ``wpos`` (units at each position) over the rest of p's 64 positions, and
    ``bsum`` (units per 64 positions) over the later ones. Every sum runs a fixed length with the
    terms it skips masked to 0 by arithmetic (and-not, never a select: a select compiles to a branch
    that mispredicts where the mask flips), so the compiler emits straight vector code.
    ``benchmarks/RESULTS.md``, "The whole LRU curve in one pass", measures each choice."""
    R, k = entries.shape
    G = load_start.shape[0] - 1
    L = layer_bytes.shape[0]
    E = L * n_expert
    sampled = keep.shape[0] > 0
    zero = layer_units[0] - layer_units[0]  # the stack's integer type
    same = True  # one weight for every entry: distances by counting bits
    for li in range(L):
        if layer_units[li] != layer_units[0]:
            same = False
    nbins = 1
    if dense:
        for li in range(L):
            nbins += layer_units[li] * n_expert
    NB = ((2 * E + 64) // 64 + WORDS) // WORDS  # blocks of WORDS words
    NW = NB * WORDS
    S = NW * 64  # positions: at least 2 x entries, so a compaction frees at least E of them
    occ = np.zeros(NW, np.uint64)  # bit q of word w: position 64 w + q holds an entry's last visit
    bcnt = np.zeros(NB, np.int32)  # occupied positions per block
    wpos = np.zeros(0 if same else S, layer_units.dtype)  # units at each position (0 if none); sizes differ only
    bsum = np.zeros(0 if same else NW, layer_units.dtype)  # units per 64 positions
    before = np.zeros(NW, np.int64)  # a compaction's occupied positions before each word
    pos = np.full(E, -1, np.int32)
    mark = np.full(E, -1, np.int64)
    top = 0
    cnt = np.zeros((2, nbins if dense else 0), np.int64)
    rd = np.zeros((2, nbins if dense else 0), np.int64)
    m_out = 0 if dense else R * k
    dist = np.empty(m_out, np.int64)
    lph = np.empty(m_out, np.int8)
    lli = np.empty(m_out, np.int32)
    always = np.zeros(2, np.int64)
    cold = np.zeros(2, np.int64)
    looks = np.zeros(2, np.int64)
    uhist = np.zeros((2, L, n_expert + 1), np.int64)
    ones = ~np.uint64(0)
    none = np.uint64(0)
    one = np.uint64(1)
    u_same = layer_units[0]
    n = 0
    prev = -1
    for load in range(G):
        lo, hi = load_start[load], load_start[load + 1]
        if hi == lo:
            continue  # the driver skips an empty load too (no eviction step)
        lid = load_lidx[load]
        w = layer_bytes[lid]
        wu = layer_units[lid]
        ph = load_phase[load]
        u = 0
        n_look = 0  # the load's counters in registers, added once after it (not a memory
        n_always = 0  # read-modify-write per lookup)
        n_cold = 0
        for r in range(lo, hi):  # distances at the load's start: positions not yet updated
            for j in range(k):
                e = entries[r, j]
                m = mark[e]
                if m == load:
                    continue
                mark[e] = load
                u += 1
                if sampled and not keep[e]:
                    continue
                n_look += 1
                if m == prev and m >= 0:
                    n_always += 1
                    continue
                p = pos[e]
                if p < 0:
                    n_cold += 1
                    continue
                if same:  # D = the weight x the occupied positions >= p
                    wp = p >> 6
                    g = wp // WORDS
                    c = popcount64(occ[wp] & (ones << np.uint64(p & 63)))
                    base = g * WORDS
                    for i in range(WORDS):
                        c += popcount64(occ[base + i] & (none - np.uint64(base + i > wp)))
                    cb = np.int32(0)
                    for b in range(NB):
                        cb += bcnt[b] & (np.int32(0) - np.int32(b > g))
                    d = (c + cb) * u_same
                else:  # D = units at positions >= p: the rest of p's 64, then every later 64
                    d = zero
                    b0 = p >> 6
                    base = b0 * 64
                    off = p - base
                    for i in range(64):
                        d += wpos[base + i] & (zero - (zero + (i >= off)))
                    for b in range(NW):
                        d += bsum[b] & (zero - (zero + (b > b0)))
                if dense:
                    cnt[ph, d] += 1
                    if not same:
                        rd[ph, d] += w
                else:
                    dist[n] = d
                    lph[n] = ph
                    lli[n] = lid
                    n += 1
        looks[ph] += n_look
        always[ph] += n_always
        cold[ph] += n_cold * w
        uhist[ph, lid, u] += 1
        for r in range(lo, hi):  # then every visit moves its entry to the top, in visit order
            for j in range(k):
                e = entries[r, j]
                if sampled and not keep[e]:
                    continue
                if top == S:  # out of positions: each live one to its rank among them, order kept
                    c = 0
                    for q in range(NW):
                        before[q] = c
                        c += popcount64(occ[q])
                    if not same:
                        wpos[:] = 0
                        bsum[:] = 0
                    for x in range(E):
                        q = pos[x]
                        if q >= 0:
                            nq = before[q >> 6] + popcount64(occ[q >> 6] & ((one << np.uint64(q & 63)) - one))
                            pos[x] = nq
                            if not same:
                                wq = layer_units[x // n_expert]
                                wpos[nq] = wq
                                bsum[nq >> 6] += wq
                    occ[:] = 0
                    bcnt[:] = 0
                    for q in range(c):
                        occ[q >> 6] |= one << np.uint64(q & 63)
                        bcnt[(q >> 6) // WORDS] += 1
                    top = c
                p = pos[e]
                if p >= 0:
                    occ[p >> 6] &= ~(one << np.uint64(p & 63))
                    if same:
                        bcnt[(p >> 6) // WORDS] -= 1
                    else:
                        wpos[p] = 0
                        bsum[p >> 6] -= wu
                pos[e] = top
                occ[top >> 6] |= one << np.uint64(top & 63)
                if same:
                    bcnt[(top >> 6) // WORDS] += 1
                else:
                    wpos[top] = wu
                    bsum[top >> 6] += wu
                top += 1
        prev = load
    if dense and same:  # one size: a bin's bytes are its lookups x that size
        w0 = layer_bytes[0]
        for q in range(2):
            for b in range(cnt.shape[1]):
                rd[q, b] = cnt[q, b] * w0
    return cnt, rd, dist[:n].copy(), lph[:n].copy(), lli[:n].copy(), always, cold, looks, uhist


def _units(w: np.ndarray, n_expert: int) -> tuple[np.ndarray, int, bool]:
    """(each layer's expert bytes in units, the unit in bytes, dense): over the layers' gcd, int32,
    when the units of every entry fit a dense histogram of at most :data:`DENSE_BINS` bins (then
    every stack sum fits int32 too); else bytes, int64, the distances listed (both exact)."""
    unit = int(np.gcd.reduce(w[w > 0])) if (w > 0).any() else 1
    if int((w // unit).sum()) * n_expert + 1 <= DENSE_BINS:
        return (w // unit).astype(np.int32), unit, True
    return w.astype(np.int64), 1, False


@njit(cache=True, nogil=True)
def _opt_pass(entries, load_start, next_load, n_entries):
    """Furthest-next-use stack distances (Mattson's OPT stack) for loads of one entry each: d int64
    [G], the smallest number of entries whose ``belady`` cache holds the load's entry at its start
    (0: first visit, never held). The stack is kept so that its top C entries are the C-entry
    cache: the visited entry goes to the top, and down to its old place each position keeps the
    entry whose next use is sooner, the other carried on down."""
    G = load_start.shape[0] - 1
    stack = np.empty(n_entries, np.int64)
    nxt = np.zeros(n_entries, np.int64)
    dist = np.zeros(G, np.int64)
    depth = 0
    for g in range(G):
        lo = load_start[g]
        if load_start[g + 1] == lo:
            continue
        x = entries[lo, 0]
        nxt[x] = next_load[lo, 0]
        if depth > 0 and stack[0] == x:
            dist[g] = 1
            continue
        if depth == 0:
            stack[0] = x
            depth = 1
            continue
        y = stack[0]
        stack[0] = x
        i = 1
        while i < depth and stack[i] != x:
            z = stack[i]
            if nxt[z] > nxt[y]:
                stack[i] = y
                y = z
            i += 1
        if i < depth:
            dist[g] = i + 1
            stack[i] = y
        else:
            stack[depth] = y
            depth += 1
    return dist


class _OptCurve:
    """``belady``'s curve where it is a stack algorithm: one entry per load, one expert size."""

    def __init__(self, loads) -> None:
        w = loads.layer_expert_bytes.astype(np.int64)
        nonempty = np.diff(loads.load_start) > 0
        wu, _, dense = _units(w, loads.n_expert)
        uh = _lru_pass(loads.entries, loads.load_start, loads.load_lidx, loads.load_phase, w, wu, loads.n_expert,
                       np.zeros(loads.n_entries, bool), dense)[-1].sum(axis=(0, 1))  # loads by unique entries
        if (uh[2:] > 0).any() or np.unique(w).shape[0] != 1 or int(w[0]) <= 0:
            why = (f"loads of up to {int(np.flatnonzero(uh)[-1])} entries" if (uh[2:] > 0).any()
                   else "expert sizes that differ by layer")
            raise UserError(f"curve: belady has no exact one-pass curve for this trace ({why}): furthest-next-use is a "
                            "stack algorithm only with one lookup per load and one expert size (otherwise a larger cache "
                            "need not hold what a smaller one holds); replay it per budget with cache.")
        self.w = int(w[0])
        d = _opt_pass(loads.entries, loads.load_start, loads.next_load, loads.n_entries)[nonempty]
        ph = loads.load_phase.astype(np.int64)[nonempty]
        self.lookups = np.bincount(ph, minlength=2).astype(np.int64)
        self.always = np.bincount(ph[d == 1], minlength=2).astype(np.int64)  # the previous load's entry: held at any budget
        self.cold = np.bincount(ph[d == 0], minlength=2).astype(np.int64)
        n = loads.n_entries
        self.cnt = np.stack([np.bincount(d[(ph == p) & (d >= 2)], minlength=n + 1) for p in (0, 1)]).astype(np.int64)
        self.cum = np.cumsum(self.cnt, axis=1)
        self.n_loads = int(nonempty.sum())
        self.n = n

    def changes(self) -> np.ndarray:
        used = np.flatnonzero((self.cnt[0] + self.cnt[1]) > 0)
        return np.unique(np.concatenate([[1], used])).astype(np.int64) * self.w  # 1 entry: overflow ends

    def at(self, budgets: np.ndarray) -> dict[str, np.ndarray]:
        c = np.minimum(budgets // self.w, self.n)
        hits = self.always[:, None] + self.cum[:, c]
        miss = self.lookups[:, None] - hits
        return {"lookups": np.repeat(self.lookups[:, None], len(budgets), axis=1), "hits": hits, "read": miss * self.w,
                "overflow": np.where(budgets < self.w, self.n_loads, 0).astype(np.int64)}


@njit(cache=True, nogil=True)
def _hash_entries(n_entries, seed):
    """A seeded 64-bit mix (splitmix64) of each entry id, reduced mod :data:`SAMPLE_MOD`."""
    out = np.empty(n_entries, np.int64)
    for e in range(n_entries):
        z = np.uint64(e) + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
        out[e] = np.int64(z % np.uint64(SAMPLE_MOD))
    return out


def sample_entries(n_entries: int, *, rate: float | None = None, size: int | None = None, seed: int = 0) -> tuple[np.ndarray, float]:
    """(keep bool [entries], rate): SHARDS' spatial sample of the (layer, expert) entries. ``rate``
    in (0, 1]: an entry is kept when its seeded hash < rate x range; ``size``: the ``size`` entries
    with the smallest hashes (ties by id), rate = size / entries exactly."""
    h = _hash_entries(n_entries, int(seed))
    if size is not None:
        size = min(int(size), n_entries)
        keep = np.zeros(n_entries, bool)
        keep[np.lexsort((np.arange(n_entries), h))[:size]] = True
        return keep, size / n_entries
    assert rate is not None
    keep = h < int(round(rate * SAMPLE_MOD))
    return keep, float(rate)


@dataclass
class Curve:
    """Everything :func:`curve` computed: ``frame`` (cache rows of ``lru``, ``layer`` and
    ``layer-opt`` at the budgets, plus ``requested``, ``sampled``), ``per_layer`` (each layer's own
    LRU curve at 0..n_expert entries), ``answer`` (:func:`budget_answer` of the headline policy),
    the trace's T and W in bytes, and notes."""

    frame: Any
    per_layer: Any
    answer: dict[str, Any]
    token_cycle_bytes: int
    working_set_bytes: int
    sample_rate: float | None
    notes: list[str] = field(default_factory=list)


class _LruCurve:
    """Global LRU's curve from one pass: evaluate at any budgets (bytes)."""

    def __init__(self, loads, keep: np.ndarray, rate: float) -> None:
        L = len(loads.moe_layers)
        w = loads.layer_expert_bytes.astype(np.int64)
        # A dense histogram of D in units of the layers' gcd when the bins are few (D <= the bytes
        # of every entry), else the distances listed and sorted: both exact.
        wu, unit, dense = _units(w, loads.n_expert)
        cnt, rd, dist, lph, lli, always, cold, looks, uhist = _lru_pass(
            loads.entries, loads.load_start, loads.load_lidx, loads.load_phase, w, wu, loads.n_expert, keep, dense)
        self.rate = rate
        self.lookups, self.always, self.cold_bytes = looks, always, cold
        if dense:
            used = (cnt[0] + cnt[1]) > 0
            keys, cnt, rd = np.flatnonzero(used).astype(np.int64) * unit, cnt[:, used], rd[:, used]
        else:
            keys, cnt, rd = _histogram(dist, lph.astype(np.int64), w[lli])
        if rate < 1.0:  # SHARDS: a distance among sampled entries estimates distance / rate
            keys = np.ceil(keys / rate).astype(np.int64)
        self.keys, self.cnt, self.rd = keys, cnt, rd
        self.cum_cnt = np.concatenate([np.zeros((2, 1), np.int64), np.cumsum(self.cnt, axis=1)], axis=1)
        self.cum_rd = np.concatenate([np.zeros((2, 1), np.int64), np.cumsum(self.rd, axis=1)], axis=1)
        # loads per (layer, unique entries): a load's bytes are u x its layer's expert_bytes
        n1 = loads.n_expert + 1
        per = uhist.sum(axis=0).ravel()  # loads per (layer, unique entries), both phases: [L x n1]
        lb = (np.arange(n1, dtype=np.int64)[None, :] * w[:, None]).ravel()
        order = np.argsort(lb, kind="stable")
        self.load_bytes_sorted, cum = lb[order], np.cumsum(per[order])
        self.loads_up_to = cum  # loads whose bytes are <= load_bytes_sorted[i]
        self.n_loads = int(per.sum())
        self.load_keys = np.unique(lb[per > 0])
        self.uhist, self.L = uhist, L
        self.all_lookups = (uhist * np.arange(n1, dtype=np.int64)).sum(axis=(1, 2))  # exact, sampled or not

    def changes(self) -> np.ndarray:
        """Every budget (bytes) where hits, bytes read or overflow can change."""
        return np.unique(np.concatenate([self.keys, self.load_keys]))

    def at(self, budgets: np.ndarray) -> dict[str, np.ndarray]:
        """Per-phase lookups/hits/read bytes and overflowed loads at each budget (estimates when sampled:
        the sampled lookups' counts, which :func:`_rows` scales)."""
        i = np.searchsorted(self.keys, budgets, side="right")
        hits = self.always[:, None] + self.cum_cnt[:, i]
        read = self.cold_bytes[:, None] + (self.cum_rd[:, -1:] - self.cum_rd[:, i])
        j = np.searchsorted(self.load_bytes_sorted, budgets, side="right")  # loads with bytes <= budget: the first j bins
        over = self.n_loads - np.where(j > 0, self.loads_up_to[np.maximum(j - 1, 0)], 0)
        return {"lookups": np.repeat(self.lookups[:, None], len(budgets), axis=1), "hits": hits, "read": read,
                "overflow": over.astype(np.int64)}


def _histogram(d: np.ndarray, ph: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(distinct distances ascending, lookups [2, K], bytes [2, K]) of listed lookups."""
    keys, inv = np.unique(d, return_inverse=True)
    K = keys.shape[0]
    cnt = np.stack([np.bincount(inv[ph == p], minlength=K) for p in (0, 1)])
    rd = np.stack([np.bincount(inv[ph == p], weights=b[ph == p], minlength=K) for p in (0, 1)])
    return keys.astype(np.int64), cnt.astype(np.int64), np.rint(rd).astype(np.int64)


class _LayerCurves:
    """Per-layer LRU curves (stack distances per layer, layer_opt's pass), evaluated at shares."""

    def __init__(self, loads, uhist: np.ndarray) -> None:
        from replay.policies.layer_opt import miss_curves_by_phase

        L, n = len(loads.moe_layers), loads.n_expert
        self.L, self.n = L, n
        self.w = loads.layer_expert_bytes.astype(np.int64)
        self.misses, self.umax = miss_curves_by_phase(loads)  # [2, L, n + 1]
        # lookups per (phase, layer): the unique entries of each load (uhist[phase, layer, u]: loads with u)
        self.lookups = (uhist * np.arange(n + 1, dtype=np.int64)).sum(axis=2)
        # loads of layer l with more than C unique entries, C = 0..n: overflow of a C-entry share
        ge = np.cumsum(uhist.sum(axis=0)[:, ::-1], axis=1)[:, ::-1]  # ge[l, C] = loads with u >= C
        self.over = np.concatenate([ge[:, 1:], np.zeros((L, 1), np.int64)], axis=1)  # over[l, C] = loads with u > C

    def at_shares(self, c: np.ndarray) -> dict[str, np.ndarray]:
        """c int64 [L, m] entries per layer at m budgets -> per-phase totals [2, m] and per-layer [2, L, m]."""
        li = np.arange(self.L)[:, None]
        miss = self.misses[:, li, c]  # [2, L, m]
        look = np.repeat(self.lookups[:, :, None], c.shape[1], axis=2)
        read = miss * self.w[None, :, None]
        over = self.over[li, c]  # [L, m]
        return {"lookups_l": look, "hits_l": look - miss, "read_l": read, "overflow_l": over,
                "lookups": look.sum(axis=1), "hits": (look - miss).sum(axis=1), "read": read.sum(axis=1),
                "overflow": over.sum(axis=0)}

    def uniform(self, budgets: np.ndarray) -> np.ndarray:
        """``layer``'s entries per layer [L, m]: floor(floor(budget / L) / expert_bytes), at most n."""
        share = budgets // self.L
        return np.minimum(self.n, share[None, :] // np.maximum(self.w[:, None], 1)).astype(np.int64)

    def changes(self) -> np.ndarray:
        """Budgets (bytes) where some layer's uniform share gains an entry: L x c x expert_bytes."""
        c = np.arange(1, self.n + 1, dtype=np.int64)
        return np.unique((self.L * c[None, :] * self.w[:, None]).ravel())


def _rows(policy: str, budgets: np.ndarray, t: dict[str, np.ndarray], requested: set[int], sampled: bool,
          scale: list[float] | None = None):
    """The curve's rows as a frame with the cache rows' columns (:func:`replay.core.rows.cache_row`,
    built column-wise: a curve has thousands of rows)."""
    import polars as pl

    lk, ht, rd = (t[f].astype(np.int64) for f in ("lookups", "hits", "read"))
    if scale is not None:  # sampled: the exact lookup counts; hits and bytes scaled from the sample
        sc = np.asarray(scale, np.float64)[:, None]
        lk, ht, rd = (np.rint(x * sc).astype(np.int64) for x in (lk, ht, rd))
    ov = t["overflow"].astype(np.int64)
    m = budgets.shape[0]

    def pct(h: np.ndarray, n: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(n > 0, 100.0 * h.astype(np.float64) / np.maximum(n, 1), np.nan)

    none_i = pl.Series([None] * m, dtype=pl.Int64)
    return pl.DataFrame({
        "policy": [policy] * m, "budget_mib": budgets.astype(np.float64) / MIB, "layer": none_i,
        "lookups": lk.sum(axis=0), "hits": ht.sum(axis=0),
        "hit_pct_decode": pct(ht[1], lk[1]), "hit_pct_cum": pct(ht.sum(axis=0), lk.sum(axis=0)),
        "hit_pct_prefill": pct(ht[0], lk[0]),
        "read_mib": rd.sum(axis=0).astype(np.float64) / MIB, "misses": lk.sum(axis=0) - ht.sum(axis=0),
        "lookups_decode": lk[1], "hits_decode": ht[1], "read_mib_decode": rd[1].astype(np.float64) / MIB,
        "evictions": none_i, "overflow_loads": ov, "peak_resident_mib": pl.Series([None] * m, dtype=pl.Float64),
        "over_budget": ov > 0, "requested": np.isin(budgets, np.fromiter(requested, np.int64, len(requested))),
        "sampled": np.full(m, sampled),
    })


def _changed(t: dict[str, np.ndarray], budgets: np.ndarray, requested: set[int]) -> np.ndarray:
    """Keep the budgets where the figures differ from the previous budget's, and every requested one."""
    sig = np.concatenate([t["hits"], t["read"], t["overflow"][None, :]], axis=0)
    keep = np.ones(budgets.shape[0], bool)
    keep[1:] = (sig[:, 1:] != sig[:, :-1]).any(axis=0)
    keep |= np.isin(budgets, np.fromiter(requested, np.int64, len(requested)))
    return keep


def compute_curve(loads, *, policies: tuple[str, ...] = ("lru", "layer"), budgets_bytes: list[int] = (),
                  sample_rate: float | None = None, sample_size: int | None = None, seed: int = 0,
                  tolerances_pp: tuple[float, ...] = (1.0, 5.0)) -> Curve:
    """The curve of each policy in ``policies`` (``lru``, ``layer``, ``layer-opt``) at every budget
    where it changes (``lru``, ``layer``; from the smallest distance to the working set) and at
    ``budgets_bytes`` (``layer-opt``: those only, its allocation solved per budget). Sampling
    (``sample_rate`` or ``sample_size``, ``lru`` only) makes ``lru``'s rows estimates."""
    import polars as pl

    bad = [p for p in policies if p not in ("lru", "layer", "layer-opt", "belady")]
    if bad:
        raise UserError(f"curve: no one-pass curve for policy {bad[0]!r} (curves: lru, layer, layer-opt, belady).")
    if "layer-opt" in policies and not budgets_bytes:
        raise UserError("curve: layer-opt's allocation is solved per budget: give --budgets.")
    if sample_rate is not None and sample_size is not None:
        raise UserError("curve: give --sample-rate or --sample-size, not both.")
    if sample_rate is not None and not 0 < sample_rate <= 1:
        raise UserError(f"curve: --sample-rate {sample_rate} is not in (0, 1].")
    if sample_size is not None and sample_size < 1:
        raise UserError(f"curve: --sample-size {sample_size} is not a positive number of entries.")
    E = loads.n_entries
    rate = 1.0
    keep = np.zeros(0, bool)
    sampled = (sample_rate is not None or sample_size is not None) and "lru" in policies
    if sampled:
        keep, rate = sample_entries(E, rate=sample_rate, size=sample_size, seed=seed)
        if not keep.any():
            raise UserError(f"curve: the sample holds no entry of the trace's {E:,} (raise the sample rate or size).")
    req = sorted({int(b) for b in budgets_bytes})
    requested = set(req)
    req_arr = np.array(req, np.int64)
    if "lru" not in policies:  # the pass only for each load's unique entries: no entry measured
        keep, rate = np.zeros(E, bool), 1.0
    lru = _LruCurve(loads, keep, rate)
    W = int(loads.working_set_bytes)
    rows: list[Any] = []
    notes: list[str] = []
    uhist = lru.uhist  # exact whatever the sample: every entry counts in a load's unique entries
    if "lru" in policies:
        bud = np.unique(np.concatenate([lru.changes(), req_arr]))
        bud = bud[(bud > 0) & ((bud <= W) | np.isin(bud, req_arr))]
        t = lru.at(bud)
        scale = None
        if sampled:
            total = lru.all_lookups
            scale = [float(total[p] / t["lookups"][p, 0]) if t["lookups"][p, 0] else 0.0 for p in (0, 1)]
            notes.append(f"lru: SHARDS sample of {int(keep.sum()):,} of {E:,} (layer, expert) entries (rate {rate:.4g}, "
                         f"seed {seed}): hit rates and MiB read are estimates (benchmarks/RESULTS.md states the error "
                         "measured against the exact curve); overflow marks are exact.")
        k = _changed(t, bud, requested)
        t = {key: v[..., k] for key, v in t.items()}
        rows.append(_rows("lru", bud[k], t, requested, sampled, scale))
    if "layer" in policies or "layer-opt" in policies:
        lc = _LayerCurves(loads, uhist)
    per_layer = None
    if "layer" in policies:
        bud = np.unique(np.concatenate([lc.changes(), req_arr]))
        bud = bud[bud > 0]
        t = lc.at_shares(lc.uniform(bud))
        k = _changed(t, bud, requested)
        t = {key: v[..., k] for key, v in t.items()}
        rows.append(_rows("layer", bud[k], t, requested, False))
        per_layer = _per_layer_frame(loads, lc)
    if "belady" in policies:
        oc = _OptCurve(loads)
        bud = np.unique(np.concatenate([oc.changes(), req_arr]))
        bud = bud[bud > 0]
        t = oc.at(bud)
        k = _changed(t, bud, requested)
        t = {key: v[..., k] for key, v in t.items()}
        rows.append(_rows("belady", bud[k], t, requested, False))
    if "layer-opt" in policies:
        from replay.policies.layer_opt import partition

        opts = {"_curves": (lc.misses.sum(axis=0), lc.umax)}
        c = np.stack([partition(loads, int(b), opts) for b in req], axis=1)
        t = lc.at_shares(c)
        rows.append(_rows("layer-opt", req_arr, t, requested, False))
    frame = pl.concat(rows) if rows else pl.DataFrame()
    head = next((p for p in ("lru", "layer", "layer-opt", "belady") if p in policies), "lru")
    answer = budget_answer(frame.filter(pl.col("policy") == head) if frame.height else frame, loads.token_cycle_bytes, W,
                           tolerances_pp=tolerances_pp, policy=head)
    return Curve(frame, per_layer, answer, int(loads.token_cycle_bytes), W, rate if sampled else None, notes)


def _per_layer_frame(loads, lc: _LayerCurves):
    """Each MoE layer's own LRU curve: one row per (layer, entries 0..n_expert), built column-wise
    (48 x 129 rows on a 48-layer, 128-expert model: a Python dict per row cost 0.014 s, a third
    of one replay of the 4.8 M-routing trace of benchmarks/RESULTS.md)."""
    import polars as pl

    L, n = lc.L, lc.n
    c = np.arange(n + 1, dtype=np.int64)
    t = lc.at_shares(np.repeat(c[None, :], L, axis=0))
    lk, ht = t["lookups_l"], t["hits_l"]  # [2, L, n + 1]

    def pct(h: np.ndarray, m: np.ndarray) -> np.ndarray:  # as _pct: NaN where nothing was looked up
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(m > 0, 100.0 * h.astype(np.float64) / m.astype(np.float64), math.nan).ravel()

    return pl.DataFrame({
        "layer": np.repeat(np.asarray(loads.moe_layers, np.int64), n + 1), "entries": np.tile(c, L),
        "share_mib": (c[None, :] * lc.w[:, None]).astype(np.float64).ravel() / MIB,
        "hit_pct_decode": pct(ht[1], lk[1]), "hit_pct_cum": pct(ht[0] + ht[1], lk[0] + lk[1]),
        "read_mib": (t["read_l"][0] + t["read_l"][1]).astype(np.float64).ravel() / MIB,
        "overflow_loads": t["overflow_l"].astype(np.int64).ravel(),
    })


def _pct(h: int, n: int) -> float:
    return 100.0 * h / n if n else math.nan


def budget_answer(frame, token_cycle_bytes: int, working_set_bytes: int, *, tolerances_pp: tuple[float, ...] = (1.0, 5.0),
                  policy: str = "lru") -> dict[str, Any]:
    """The budget answer from one policy's curve rows: the plateau (the hit % at the working set W,
    where only first visits miss), the knee at each tolerance (the smallest within-budget budget whose
    hit % is within that many points of the plateau), the hit % just below one token's working set T
    (the cliff: below T a token's own layers evict each other) and at T, and what each doubling of
    the budget buys from T up to W. Hit % is decode-only when the trace decodes, else cumulative
    (``metric`` says which). A budget reads the row in force there (the last change point at or below it)."""
    out: dict[str, Any] = {"policy": policy, "t_mib": token_cycle_bytes / MIB, "w_mib": working_set_bytes / MIB}
    if frame.height == 0:
        return {**out, "metric": None, "plateau_pct": None, "knees": [], "below_t_pct": None, "at_t_pct": None,
                "doublings": []}
    f = frame.sort("budget_mib")
    metric = "hit_pct_decode" if int(f["lookups_decode"].max()) > 0 else "hit_pct_cum"
    b = f["budget_mib"].to_numpy()
    h = f[metric].to_numpy()
    over = f["over_budget"].to_numpy()

    def at(b_mib: float) -> tuple[float, bool]:
        i = int(np.searchsorted(b, b_mib, side="right")) - 1
        return (0.0, False) if i < 0 else (float(h[i]), bool(over[i]))

    plateau = float(np.nanmax(h))
    out["metric"] = metric
    out["plateau_pct"] = plateau
    knees = []
    for tol in tolerances_pp:
        ok = np.flatnonzero(~over & (h >= plateau - tol))
        i = int(ok[0]) if ok.shape[0] else None
        knees.append({"tolerance_pp": tol, "budget_mib": None if i is None else float(b[i]),
                      "hit_pct": None if i is None else float(h[i])})
    out["knees"] = knees
    t_mib, w_mib = token_cycle_bytes / MIB, working_set_bytes / MIB
    out["below_t_pct"] = at(math.nextafter(t_mib, 0))[0]
    out["at_t_pct"] = at(t_mib)[0]
    doublings = []
    lo, prev = t_mib, out["at_t_pct"]
    while t_mib > 0 and lo < w_mib:
        hi = min(2 * lo, w_mib)
        now, ob = at(hi)
        doublings.append({"from_mib": lo, "to_mib": hi, "hit_pct": now, "gain_pp": now - prev, "over_budget": ob})
        prev, lo = now, hi
    out["doublings"] = doublings
    return out
