"""The locality profile of a trace's routing (``moe-replay profile``): the statistics an engine
author reads before building a cache, a pin list or a predictor. docs/profile.md says what each
figure measures and what it does not; tests/naive/profile.py holds the slow twins.

- **Popularity** per MoE layer (and over every (layer, expert) entry): the share of routed slots
  the hottest N experts take (N = k, 2k, 4k, ...), the hot-set size for 50/80/95% of the slots,
  the Gini coefficient, experts never routed, the hottest expert's share against uniform (k / E);
  and drift: how much of the top-2k set of one window of tokens is still in the next window's.
- **Reuse**, load-aware, over the whole run (every phase warms the one cache; figures are given per
  phase of the lookup): a *lookup* is one distinct (layer, expert) of one load (a batch's routings
  of one layer, read together), as in the replay. Its reuse distance in bytes is the bytes of the
  distinct entries touched since that entry's previous lookup, itself included (the LRU recency
  stack before its load); in steps, the batches since then (one token per step for one request).
  An LRU cache of B bytes hits a lookup exactly when its distance is <= B, or when the entry was in
  the load just before (a load larger than the cache overflows and keeps all its entries; the
  driver never evicts the current load's entries): tests/test_profile.py holds this against the
  ``lru`` replay and "ever reused" against ``infinite``.
- **Co-activation**: within a layer, pairs of experts chosen by one routing against independence
  (lift = count x routings / (count_a x count_b)); across consecutive MoE layers, the counts of
  (e at L, e' at L+1) over the tokens routed at both, P(e' at L+1 | e at L) = count(e, e') / count(e)
  (sums to k over e'), and the conditional entropy of the next layer's slots given this layer's.
- **SRP and SCH** (Liang et al., "Not All Models Suit Expert Offloading", arXiv 2505.16056, code
  github.com/ljcleo/moe-lrc, read and re-implemented here, not copied), per layer over each request's
  tokens of the phase in step order, at the paper's segment lengths 4, 16, 64, 256:

  * SRP(m): every window of m consecutive tokens (sliding, stride 1) predicts, for each of its m
    tokens, the experts the window routes to at least theta times; F1 of those predictions against
    the routings, counts pooled over windows, experts and requests (and layers, for the pooled
    row), maximised over theta = 0..m.
  * SCH(m, C): the hit rate of a C-expert cache of one layer that evicts the expert used least in
    the next m tokens (the current one included), the least recently used among ties, computed for
    every C at once by Mattson's stack algorithm as the paper's code does: a token's experts are
    found at their depths in the stack before that token (so they do not evict each other), and a
    first use counts at the depth after every expert seen before it (so SCH at C = n_expert is
    100%: no compulsory miss is counted). Pooled: hits over routed slots of every request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from traces.util.jit import njit
from traces.util.units import MIB

SEGMENT_LENGTHS = (4, 16, 64, 256)  # the paper's seg_lengths (moe-lrc config.json)
HOT_SET_PCTS = (50, 80, 95)
DRIFT_WINDOW = 16  # tokens per drift window


# ---------------------------------------------------------------------------------------------
# kernels (one implementation each; tests/naive/profile.py has the twins)


@njit(cache=True)
def _bit_add(tree, i, v):
    i += 1
    while i < tree.shape[0]:
        tree[i] += v
        i += i & -i


@njit(cache=True)
def _bit_prefix(tree, i):
    """Sum of positions 0..i."""
    s = np.int64(0)
    i += 1
    while i > 0:
        s += tree[i]
        i -= i & -i
    return s


@njit(cache=True)
def _compact_times(tree, last_time, entry_bytes):
    """Renumbers the live visit times 0..n-1 in their order and rebuilds the Fenwick tree over them
    (the prefix sums keep their order, so every distance is unchanged); returns the new clock."""
    tree[:] = 0
    n = 0
    for e in np.argsort(last_time):  # -1 (never visited) first; live times are distinct
        if last_time[e] >= 0:
            last_time[e] = n
            _bit_add(tree, n, entry_bytes[e])
            n += 1
    return n - 1


@njit(cache=True)
def reuse_walk(entries, load_start, batch_start, g0, g1, entry_bytes, state, tree, last_time, last_load,
               last_batch, mark):
    """The lookups of loads g0..g1-1 (each distinct entry of a load, in the load's token-major visit
    order): their load, entry, reuse distance in bytes (-1: first lookup) and in batches (-1), and
    the loads since the entry's previous lookup (-1). Recency follows every visit, repeats included,
    as ``lru`` does; a load's lookups all see the stack as it was before the load (a Fenwick tree over
    visit times holds each entry's bytes at its latest visit).

    Resumable: loads are walked in chunks (g0 = the last call's g1), the walk's state carried in
    ``state`` (int64 [3]: clock, bytes of every entry seen, the current batch; start [-1, 0, 0]) and
    the arrays made by :func:`reuse_state`. The tree has room for ``tree.shape[0] - 2`` visit times:
    when they run out, the live ones (one per entry at most) are renumbered in order
    (:func:`_compact_times`), so memory is O(entries), not O(routings)."""
    k = entries.shape[1]
    cap = tree.shape[0] - 2
    n_look = 0
    for g in range(g0, g1):
        for r in range(load_start[g], load_start[g + 1]):
            for j in range(k):
                e = entries[r, j]
                if mark[e] != g:
                    mark[e] = g
                    n_look += 1
    look_load = np.empty(n_look, np.int64)
    look_entry = np.empty(n_look, np.int64)
    dist_bytes = np.empty(n_look, np.int64)
    dist_steps = np.empty(n_look, np.int64)
    gap_loads = np.empty(n_look, np.int64)
    mark[:] = -2  # the counting pass marked these loads' entries (a load number is never -2)
    clock = state[0]
    total = state[1]  # bytes of every entry seen so far (each at its latest visit)
    b = state[2]
    n = 0
    for g in range(g0, g1):
        while batch_start[b + 1] <= g:
            b += 1
        for r in range(load_start[g], load_start[g + 1]):
            for j in range(k):
                e = entries[r, j]
                if mark[e] == g:
                    continue
                mark[e] = g
                look_load[n] = g
                look_entry[n] = e
                if last_time[e] < 0:
                    dist_bytes[n] = -1
                    dist_steps[n] = -1
                    gap_loads[n] = -1
                else:
                    dist_bytes[n] = total - _bit_prefix(tree, last_time[e]) + entry_bytes[e]
                    dist_steps[n] = b - last_batch[e]
                    gap_loads[n] = g - last_load[e]
                n += 1
        for r in range(load_start[g], load_start[g + 1]):
            for j in range(k):
                e = entries[r, j]
                if clock + 1 >= cap:  # before e leaves its place: the rebuilt tree holds every live entry
                    clock = _compact_times(tree, last_time, entry_bytes)
                if last_time[e] >= 0:
                    _bit_add(tree, last_time[e], -entry_bytes[e])
                else:
                    total += entry_bytes[e]
                clock += 1
                last_time[e] = clock
                last_load[e] = g
                last_batch[e] = b
                _bit_add(tree, clock, entry_bytes[e])
    state[0] = clock
    state[1] = total
    state[2] = b
    return look_load, look_entry, dist_bytes, dist_steps, gap_loads


def reuse_state(n_entries: int, n_visits: int, capacity: int = 0) -> tuple[np.ndarray, ...]:
    """The state :func:`reuse_walk` carries between chunks: (state, tree, last_time, last_load,
    last_batch, mark). ``capacity``: visit times the tree holds before renumbering (default
    max(4 x entries, 65,536), never more than the visits; at least entries + 1)."""
    cap = capacity or max(4 * n_entries, 1 << 16)
    cap = max(min(cap, n_visits), n_entries + 1)
    return (np.array([-1, 0, 0], np.int64), np.zeros(cap + 2, np.int64), np.full(n_entries, -1, np.int64),
            np.full(n_entries, -1, np.int64), np.full(n_entries, -1, np.int64), np.full(n_entries, -2, np.int64))


def reuse_distances(entries, load_start, batch_start, entry_bytes, n_entries, *, chunk_loads: int = 0,
                    capacity: int = 0) -> tuple[np.ndarray, ...]:
    """Every lookup's (load, entry, distance in bytes, in batches, loads since): :func:`reuse_walk`
    over all loads, ``chunk_loads`` at a time (0: at once), concatenated (the twin tests' view; the
    profile itself folds each chunk into counts and never holds all of them)."""
    G = load_start.shape[0] - 1
    st = reuse_state(n_entries, entries.size, capacity)
    step = chunk_loads or max(G, 1)
    parts = [reuse_walk(entries, load_start, batch_start, g0, min(G, g0 + step), entry_bytes, *st)
             for g0 in range(0, max(G, 1), step)] if G else []
    if not parts:
        return tuple(np.empty(0, np.int64) for _ in range(5))
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(5))


@njit(cache=True)
def pair_counts(experts, rows, n_expert):
    """[E, E] int64: for a < b, the routings among ``rows`` that chose both a and b (upper triangle)."""
    out = np.zeros((n_expert, n_expert), np.int64)
    k = experts.shape[1]
    for r in rows:
        for i in range(k):
            for j in range(i + 1, k):
                a, b = experts[r, i], experts[r, j]
                if a == b:
                    continue
                if a < b:
                    out[a, b] += 1
                else:
                    out[b, a] += 1
    return out


@njit(cache=True)
def transition_counts(experts, row_here, row_next, n_expert):
    """[E, E] int64: over the tokens routed at both layers (row_here[t] and row_next[t] >= 0), the
    count of (e at this layer, e' at the next) over every pair of their slots."""
    out = np.zeros((n_expert, n_expert), np.int64)
    k = experts.shape[1]
    for t in range(row_here.shape[0]):
        a, b = row_here[t], row_next[t]
        if a < 0 or b < 0:
            continue
        for i in range(k):
            for j in range(k):
                out[experts[a, i], experts[b, j]] += 1
    return out


@njit(cache=True)
def window_counts(experts, rows, seq_start, window, n_expert):
    """Per whole window of ``window`` consecutive tokens inside each sequence (``rows`` of a layer,
    sequences cut at ``seq_start``): the expert counts [windows, E] and each window's sequence."""
    n_win = 0
    for s in range(seq_start.shape[0] - 1):
        n_win += (seq_start[s + 1] - seq_start[s]) // window
    out = np.zeros((n_win, n_expert), np.int64)
    seq = np.empty(n_win, np.int64)
    w = 0
    k = experts.shape[1]
    for s in range(seq_start.shape[0] - 1):
        n = (seq_start[s + 1] - seq_start[s]) // window
        for i in range(n):
            for t in range(seq_start[s] + i * window, seq_start[s] + (i + 1) * window):
                for j in range(k):
                    out[w, experts[rows[t], j]] += 1
            seq[w] = s
            w += 1
    return out, seq


@njit(cache=True)
def srp_hist(experts, rows, seq_start, m, n_expert):
    """[m + 1] int64: over every window of m consecutive tokens of each sequence and every expert,
    how many (window, expert) pairs route the expert c times in the window (c = 0..m).

    O(k) per token, not O(n_expert) per window: ``level[c]`` is how many experts the current window
    routes c times, and ``hist[c]`` is credited with ``level[c]`` for each window that level held,
    when it changes (``since[c]``: the first window not yet credited) and at the sequence's end."""
    hist = np.zeros(m + 1, np.int64)
    k = experts.shape[1]
    cnt = np.zeros(n_expert, np.int64)
    level = np.zeros(m + 1, np.int64)
    since = np.zeros(m + 1, np.int64)
    for s in range(seq_start.shape[0] - 1):
        a, b = seq_start[s], seq_start[s + 1]
        if b - a < m:
            continue
        cnt[:] = 0
        level[:] = 0
        level[0] = n_expert
        since[:] = a  # windows are numbered by their first token: a .. b - m
        for t in range(a, a + m):
            for j in range(k):
                x = experts[rows[t], j]
                level[cnt[x]] -= 1
                cnt[x] += 1
                level[cnt[x]] += 1
        for w in range(a + 1, b - m + 1):
            for j in range(k):
                for d in range(2):  # the token leaving the window, then the one entering it
                    x = experts[rows[w - 1], j] if d == 0 else experts[rows[w + m - 1], j]
                    step = -1 if d == 0 else 1
                    c = cnt[x]
                    hist[c] += level[c] * (w - since[c])
                    since[c] = w
                    level[c] -= 1
                    c += step
                    hist[c] += level[c] * (w - since[c])
                    since[c] = w
                    level[c] += 1
                    cnt[x] = c
        for c in range(m + 1):
            hist[c] += level[c] * (b - m + 1 - since[c])
    return hist


@njit(cache=True)
def sch_depths(experts, rows, seq_start, m, n_expert):
    """[E] int64: per depth d, the routed slots found at depth d of the segment-cache stack (the
    paper's SCH, module docstring); SCH(C) = sum(depths[:C]) / slots. Each sequence starts empty."""
    depth = np.zeros(n_expert, np.int64)
    k = experts.shape[1]
    stack = np.empty(n_expert, np.int64)
    pos = np.full(n_expert, -1, np.int64)
    cnt = np.zeros(n_expert, np.int64)
    last = np.zeros(n_expert, np.int64)
    for s in range(seq_start.shape[0] - 1):
        a, b = seq_start[s], seq_start[s + 1]
        T = b - a
        pos[:] = -1
        cnt[:] = 0
        last[:] = 0
        size = 0
        ts = 0
        for t in range(a, a + min(m, T)):
            for j in range(k):
                cnt[experts[rows[t], j]] += 1
        for i in range(T):
            r = rows[a + i]
            uni = size
            for j in range(k):
                d = pos[experts[r, j]]
                if d < 0:
                    depth[uni] += 1
                    uni += 1
                else:
                    depth[d] += 1
            for j in range(k):
                x = experts[r, j]
                d = pos[x] if pos[x] >= 0 else size
                if size == 0:
                    stack[0] = x
                    pos[x] = 0
                    size = 1
                else:
                    carry = stack[0]
                    stack[0] = x
                    pos[x] = 0
                    for p in range(1, d):
                        y = stack[p]
                        if cnt[y] < cnt[carry] or (cnt[y] == cnt[carry] and last[y] < last[carry]):
                            stack[p] = carry
                            pos[carry] = p
                            carry = y
                    if d < size:
                        if d > 0:
                            stack[d] = carry
                            pos[carry] = d
                    else:
                        stack[size] = carry
                        pos[carry] = size
                        size += 1
                ts += 1
                cnt[x] -= 1
                last[x] = ts
            if i + m < T:
                for j in range(k):
                    cnt[experts[rows[a + i + m], j]] += 1
    return depth


# ---------------------------------------------------------------------------------------------
# statistics from counts (integers in, one division out: the twins agree exactly)


def coverage_ns(k: int, n_expert: int) -> list[int]:
    """N = k, 2k, 4k, ... below n_expert, then n_expert."""
    out, n = [], max(1, k)
    while n < n_expert:
        out.append(n)
        n *= 2
    return out + [n_expert]


def gini(counts: np.ndarray) -> float | None:
    """Gini coefficient of the counts: sum_i sum_j |x_i - x_j| / (2 n sum x); None without counts.
    The numerator is an exact integer (sorted: 2 sum_i (2i - n + 1) x_(i), i from 0)."""
    x = np.sort(np.asarray(counts, dtype=np.int64))
    n, s = x.shape[0], int(x.sum())
    if n == 0 or s == 0:
        return None
    num = 2 * int(((2 * np.arange(n, dtype=np.int64) - n + 1) * x).sum())
    return num / (2 * n * s)


def popularity_row(counts: np.ndarray, k: int, slots_per_routing: int | None = None) -> dict[str, Any]:
    """Coverage, hot-set sizes, Gini, never-used and hottest-vs-uniform of one population's counts
    (a layer's experts, or every (layer, expert) entry). Shares are of routed slots."""
    counts = np.asarray(counts, dtype=np.int64)
    E = counts.shape[0]
    total = int(counts.sum())
    srt = -np.sort(-counts)
    cum = np.cumsum(srt)
    row: dict[str, Any] = {"slots": total}
    for n in coverage_ns(k, E):
        row[f"top{n}_pct"] = 100.0 * int(cum[n - 1]) / total if total else None
    for p in HOT_SET_PCTS:
        row[f"hot_set_{p}"] = int(np.argmax(cum * 100 >= p * total)) + 1 if total else None
    row["gini"] = gini(counts)
    row["experts_never_routed"] = int((counts == 0).sum())
    # uniform routing gives each expert total / E slots
    row["hottest_vs_uniform"] = int(srt[0]) * E / total if total else None
    return row


def srp_from_hist(hist: np.ndarray) -> tuple[float | None, int | None, float | None]:
    """(best F1, its threshold theta, predicted / routed slots at it) from :func:`srp_hist`'s counts
    (summed over layers or requests for a pooled figure); None without a window."""
    hist = np.asarray(hist, dtype=np.int64)
    m = hist.shape[0] - 1
    c = np.arange(m + 1, dtype=np.int64)
    matches = np.cumsum((c * hist)[::-1])[::-1]  # sum_{c >= theta} c hist[c]
    preds = m * np.cumsum(hist[::-1])[::-1]  # m sum_{c >= theta} hist[c]
    acts = int(matches[0])
    if int(hist.sum()) == 0 or acts == 0:
        return None, None, None
    best, theta = -1.0, 0
    for th in range(m + 1):
        f1 = 2 * int(matches[th]) / max(int(preds[th]) + acts, 1)
        if f1 > best:
            best, theta = f1, th
    return best, theta, int(preds[theta]) / acts


def cond_entropy_bits(trans: np.ndarray) -> tuple[float | None, float | None]:
    """(H(next | this), H(next)) in bits, of the slot distribution: q(e' | e) = n(e, e') / sum_e' n(e, e'),
    weighted by each e's share of the pairs. None without pairs."""
    trans = np.asarray(trans, dtype=np.int64)
    tot = int(trans.sum())
    if tot == 0:
        return None, None
    h = 0.0
    for e in range(trans.shape[0]):
        row = trans[e]
        ne = int(row.sum())
        for v in row:
            if v:
                h -= (int(v) / tot) * math.log2(int(v) / ne)
    marg = trans.sum(axis=0)
    hm = 0.0
    for v in marg:
        if v:
            hm -= (int(v) / tot) * math.log2(int(v) / tot)
    return h, hm


# ---------------------------------------------------------------------------------------------
# the tokens: one row index per (token, MoE layer)


@dataclass(frozen=True)
class Tokens:
    """Every token (request, turn, step) in (request, turn, step) order: its request and phase, and
    the row routing it at each MoE layer (-1: none)."""

    request: np.ndarray  # int64 [T]
    phase: np.ndarray  # int8 [T]
    row_of: np.ndarray  # int32 [T, L] (int64 from 2^31 rows)


TOKEN_CHUNK_ROWS = 1 << 20  # rows per step of tokens_of's passes (their temporaries bounded by it)


def _in_token_order(request: np.ndarray | None, turn: np.ndarray, step: np.ndarray) -> bool:
    """The rows already in (request, turn, step) order (a single request's decode, for one): then
    the stable sort of :func:`tokens_of` is the identity and is skipped."""
    R = turn.shape[0]
    for a in range(0, max(R - 1, 0), TOKEN_CHUNK_ROWS):
        b = min(R, a + TOKEN_CHUNK_ROWS + 1)  # rows a..b-1: the pairs (a, a+1) .. (b-2, b-1)
        tu, st = turn[a:b], step[a:b]
        ok = (tu[1:] > tu[:-1]) | ((tu[1:] == tu[:-1]) & (st[1:] >= st[:-1]))
        if request is not None:
            rq = request[a:b]
            ok = (rq[1:] > rq[:-1]) | ((rq[1:] == rq[:-1]) & ok)
        if not ok.all():
            return False
    return True


def tokens_of(request: np.ndarray | None, turn: np.ndarray, step: np.ndarray, phase: np.ndarray, lidx: np.ndarray,
              n_layers: int) -> Tokens:
    """The tokens of routing rows (``request`` None: one request). Memory: the row map (4 bytes per
    (token, MoE layer)), a flag per row, and the sort's order (8 bytes per row, only when the rows
    are not in token order); the columns are read in their own widths, one at a time."""
    R = turn.shape[0]
    order = None if _in_token_order(request, turn, step) else np.lexsort(
        (step, turn) if request is None else (step, turn, request))
    new = np.ones(R, dtype=bool)  # the row (in token order) starts a token
    if R:
        new[1:] = False
    for key in (turn, step) if request is None else (turn, step, request):
        x = key if order is None else key[order]
        new[1:] |= x[1:] != x[:-1]
        del x
    row_type = np.int32 if R < 2**31 else np.int64
    T = int(np.count_nonzero(new))
    row_of = np.full((T, n_layers), -1, row_type)
    tok_before = -1
    for a in range(0, R, TOKEN_CHUNK_ROWS):  # the token numbers a chunk at a time, not a column of them
        b = min(R, a + TOKEN_CHUNK_ROWS)
        tok = np.cumsum(new[a:b], dtype=np.int64) + tok_before
        tok_before = int(tok[-1])
        rows = np.arange(a, b, dtype=np.int64) if order is None else order[a:b]
        row_of[tok, lidx[rows]] = rows
    first = np.flatnonzero(new) if order is None else order[new]
    req = np.zeros(T, np.int64) if request is None else request[first].astype(np.int64)
    return Tokens(request=req, phase=phase[first].astype(np.int8), row_of=row_of)


def sequences(tokens: Tokens, sel: np.ndarray, li: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Layer ``li``'s rows of the selected tokens in token order, cut per request: (rows, seq_start,
    the request of each sequence). A token missing that layer is left out of its sequence."""
    rows = tokens.row_of[sel, li]
    req = tokens.request[sel]
    keep = rows >= 0
    rows, req = rows[keep], req[keep]
    if rows.shape[0] == 0:
        return rows, np.zeros(1, np.int64), np.zeros(0, np.int64)
    cut = np.flatnonzero(req[1:] != req[:-1]) + 1
    starts = np.concatenate([[0], cut, [rows.shape[0]]]).astype(np.int64)
    return rows.astype(np.int64), starts, req[starts[:-1]]


# ---------------------------------------------------------------------------------------------
# the profile


@dataclass
class Profile:
    """Everything ``profile`` prints. Frames (keys in docs/profile.md): ``popularity``, ``drift``,
    ``reuse``, ``reuse_cdf``, ``pairs``, ``transitions``, ``top_transitions``, ``srp``, ``sch``; the
    histograms behind the reuse plots; ``answer`` (the cacheability answer's figures)."""

    phase: str
    moe_layers: tuple[int, ...]
    n_expert: int
    top_k: int
    layer_expert_bytes: np.ndarray
    token_cycle_bytes: int
    budget_mib: float | None
    has_request: bool
    popularity: pl.DataFrame
    drift: pl.DataFrame
    reuse: pl.DataFrame
    reuse_cdf: pl.DataFrame
    pairs: pl.DataFrame
    transitions: pl.DataFrame
    top_transitions: pl.DataFrame
    srp: pl.DataFrame
    sch: pl.DataFrame
    answer: dict[str, Any]
    # the phase's reused lookups, all layers: the distinct reuse distances in bytes (ascending) and how
    # many lookups have each; and how many have each distance in steps (index = steps). The reuse CDF
    # plots step through them; the per-layer figures are in ``reuse`` / ``reuse_cdf``.
    reuse_bytes_hist: tuple[np.ndarray, np.ndarray]
    reuse_steps_hist: np.ndarray
    drift_window: int = DRIFT_WINDOW
    transition_matrices: dict[int, np.ndarray] = field(default_factory=dict)  # MoE index L -> [E, E] counts (L, L+1)
    coverage_curves: dict[int, np.ndarray] = field(default_factory=dict)  # MoE index -> cumulative share % by rank

    def tables(self) -> dict[str, pl.DataFrame]:
        return {"popularity": self.popularity, "drift": self.drift, "reuse": self.reuse, "reuse_cdf": self.reuse_cdf,
                "pairs": self.pairs,
                "transitions": self.transitions, "top_transitions": self.top_transitions, "srp": self.srp,
                "sch": self.sch}


def _phase_mask(phase_arr: np.ndarray, phase: str) -> np.ndarray:
    if phase == "decode":
        return phase_arr == 1
    if phase == "prefill":
        return phase_arr == 0
    return np.ones(phase_arr.shape[0], dtype=bool)


def _pow2_upto(n: int) -> list[int]:
    out, v = [], 1
    while v <= max(n, 1):
        out.append(v)
        v *= 2
    return out


def lru_hits(dist_bytes: np.ndarray, gap_loads: np.ndarray, budget_bytes: int) -> np.ndarray:
    """Which lookups an LRU cache of ``budget_bytes`` hits: distance within the budget, or the entry
    was in the load just before (kept by that load's overflow). Exact against the ``lru`` replay."""
    seen = dist_bytes >= 0
    return seen & ((dist_bytes <= budget_bytes) | (gap_loads == 1))


POPULARITY_CHUNK_ROWS = 1 << 20  # routing rows per popularity bincount
REUSE_CHUNK_LOADS = 1 << 16  # loads per reuse_walk call: its per-lookup arrays are at most this many x k
HIST_MERGE_MIN = 1 << 16  # chunks' distance histograms pending before a merge (at least the merged one's size)


@dataclass
class ReuseCounts:
    """The reuse figures' counts over the phase's lookups, per MoE layer index (folded chunk by chunk
    from :func:`reuse_walk`; nothing per lookup is kept). ``bytes_keys`` / ``bytes_counts``: the
    distinct (distance in bytes, layer) of the reused lookups as ``distance x L + layer``, ascending,
    and how many lookups have each; ``steps_counts[s]``: the reused lookups at s batches (all layers)."""

    lookups: np.ndarray  # int64 [L]
    reused: np.ndarray  # int64 [L]
    step_buckets: np.ndarray  # int64 [L, 64]: bucket i = distances in steps s with 2^(i-1) < s <= 2^i (0, 1 -> 0)
    lru_hits: np.ndarray  # int64 [len(budgets), L]: lru_hits at each budget
    within: np.ndarray  # int64 [len(marks), L]: reused lookups with distance <= each mark
    max_steps: int  # the largest distance in steps over every lookup of every phase (-1: none reused; 1: no lookup)
    bytes_keys: np.ndarray
    bytes_counts: np.ndarray
    steps_counts: np.ndarray


def _merge_hist(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(distinct keys, counts) histograms as one, keys ascending, exactly (integer sums)."""
    k = np.concatenate([p[0] for p in parts])
    c = np.concatenate([p[1] for p in parts])
    order = np.argsort(k, kind="stable")
    k, c = k[order], c[order]
    if k.shape[0] == 0:
        return k, c
    starts = np.flatnonzero(np.concatenate([[True], k[1:] != k[:-1]]))
    return k[starts], np.add.reduceat(c, starts)


def reuse_counts(loads: Any, phase: str, marks: list[int], budgets: list[int], *,
                 chunk_loads: int = REUSE_CHUNK_LOADS, capacity: int = 0) -> ReuseCounts:
    """:class:`ReuseCounts` of ``loads`` (every phase warms the cache; the phase's lookups counted).
    Memory: O(entries + distinct reuse distances + batches) beside one chunk's lookups."""
    L = len(loads.moe_layers)
    G = loads.load_start.shape[0] - 1
    eb = loads.entry_bytes
    # distance x L + layer must fit in int64: a distance is at most every entry's bytes
    if int(eb.sum()) >= (1 << 62) // max(L, 1):
        msg = f"the experts' bytes ({int(eb.sum())} in all) are too large to profile reuse distances in bytes"
        raise ValueError(msg)
    st = reuse_state(loads.n_entries, loads.entries.size, capacity)
    lookups = np.zeros(L, np.int64)
    reused = np.zeros(L, np.int64)
    buckets = np.zeros((L, 64), np.int64)
    hits = np.zeros((len(budgets), L), np.int64)
    within = np.zeros((len(marks), L), np.int64)
    keys, kcounts = np.zeros(0, np.int64), np.zeros(0, np.int64)
    pending: list[tuple[np.ndarray, np.ndarray]] = []  # chunks' histograms not merged yet
    n_pending = 0
    steps_counts = np.zeros(0, np.int64)
    max_steps = None
    lidx_of_load = loads.load_lidx
    for g0 in range(0, G, chunk_loads):
        look_load, _, d, s, gap = reuse_walk(loads.entries, loads.load_start, loads.batch_start, g0,
                                             min(G, g0 + chunk_loads), eb, *st)
        if d.shape[0]:
            m = int(s.max())
            max_steps = m if max_steps is None else max(max_steps, m)
        ph = loads.batch_phase[np.searchsorted(loads.batch_start, look_load, side="right") - 1]
        sel = _phase_mask(ph, phase)
        li = lidx_of_load[look_load[sel]].astype(np.int64)
        d, s, gap = d[sel], s[sel], gap[sel]
        del look_load, ph, sel
        lookups += np.bincount(li, minlength=L)
        rs = d >= 0
        reused += np.bincount(li[rs], minlength=L)
        for i, b in enumerate(budgets):
            hits[i] += np.bincount(li[lru_hits(d, gap, b)], minlength=L)
        for i, b in enumerate(marks):
            within[i] += np.bincount(li[rs & (d <= b)], minlength=L)
        # a reused lookup's distance in steps is >= 0 exactly when its distance in bytes is
        sr, lr = s[rs], li[rs]
        _, ex = np.frexp(np.maximum(sr - 1, 0).astype(np.float64))  # bit length of s - 1 (s < 2^53)
        buckets += np.bincount(lr * 64 + ex, minlength=L * 64).reshape(L, 64)
        sc = np.bincount(sr)
        if sc.shape[0] > steps_counts.shape[0]:
            sc[:steps_counts.shape[0]] += steps_counts
            steps_counts = sc
        else:
            steps_counts[:sc.shape[0]] += sc
        u, c = np.unique(d[rs] * L + lr, return_counts=True)
        pending.append((u, c.astype(np.int64)))
        n_pending += u.shape[0]
        if n_pending > max(keys.shape[0], HIST_MERGE_MIN):  # merged when the pending outgrow it: O(n log n) in all
            keys, kcounts = _merge_hist([(keys, kcounts), *pending])
            pending, n_pending = [], 0
    keys, kcounts = _merge_hist([(keys, kcounts), *pending])
    return ReuseCounts(lookups=lookups, reused=reused, step_buckets=buckets, lru_hits=hits, within=within,
                       max_steps=1 if max_steps is None else max_steps, bytes_keys=keys, bytes_counts=kcounts,
                       steps_counts=steps_counts)


def _hist_median(values: np.ndarray, counts: np.ndarray) -> float | None:
    """np.median of the multiset (sorted distinct ``values``, ``counts``), exactly: the mean of its
    middle one or two elements, as np.median takes it."""
    n = int(counts.sum())
    if n == 0:
        return None
    cum = np.cumsum(counts)
    mid = [(n - 1) // 2, n // 2] if n % 2 == 0 else [n // 2]
    return float(np.mean(values[np.searchsorted(cum, mid, side="right")]))


def profile_arrays(arrays: Any, loads: Any, *, moe_layers: tuple[int, ...], n_expert: int, top_k: int,
                   phase: str = "decode", budget_mib: float | None = None, segment_lengths=SEGMENT_LENGTHS,
                   drift_window: int = DRIFT_WINDOW, top_pairs: int = 5, min_pair_routings: int = 5,
                   reuse_chunk_loads: int = REUSE_CHUNK_LOADS) -> Profile:
    """The profile of routing rows (``arrays``: a :class:`traces.io.reader.RoutingArrays` or
    :class:`RoutingColumns`; the profile reads turn, phase, step, layer, experts, request) and their
    :class:`replay.core.simulate.Loads`. ``phase``: the routings the popularity, co-activation, drift,
    SRP and SCH figures count and the lookups the reuse figures count (the cache runs over every phase)."""
    L, E, k = len(moe_layers), int(n_expert), int(top_k)
    # the routing columns in their own widths (no int64 copies): MoE index int16, experts int32
    lidx_of = np.full(max(moe_layers) + 1, -1, np.int16)
    lidx_of[list(moe_layers)] = np.arange(L)
    lidx = lidx_of[arrays.layer]
    request = arrays.request  # int64 [R], or None: one request
    has_request = request is not None
    experts = np.ascontiguousarray(arrays.experts, dtype=np.int32)
    in_phase = _phase_mask(arrays.phase, phase)
    eb = np.asarray(loads.layer_expert_bytes, dtype=np.int64)
    R = in_phase.shape[0]

    # popularity: counts per (request, layer, expert) of the phase's routings, one bincount over
    # (request, layer, expert) per chunk of rows (not np.add.at; temporaries bounded by the chunk)
    chunks = [(a, min(R, a + POPULARITY_CHUNK_ROWS)) for a in range(0, R, POPULARITY_CHUNK_ROWS)]
    req_ids = (np.unique(np.concatenate([np.zeros(0, np.int64)] + [np.unique(request[a:b][in_phase[a:b]]) for a, b in chunks]))
               if has_request else np.zeros(1, np.int64))
    counts = np.zeros((len(req_ids), L, E), np.int64)
    for a, b in chunks:
        rows_c = np.flatnonzero(in_phase[a:b]) + a
        cell = lidx[rows_c].astype(np.int64)
        if has_request:
            cell += np.searchsorted(req_ids, request[rows_c]) * L
        cell *= E
        for j in range(k):
            counts += np.bincount(cell + experts[rows_c, j], minlength=counts.size).reshape(counts.shape)
        del rows_c, cell
    pop_rows, curves = [], {}
    groups = [(None, counts.sum(axis=0))] + ([(int(r), counts[i]) for i, r in enumerate(req_ids)]
                                             if has_request and len(req_ids) > 1 else [])
    for req, c in groups:
        for li in range(L):
            pop_rows.append({"request": req, "layer": moe_layers[li], "routings": int(c[li].sum()) // k,
                             **popularity_row(c[li], k)})
            if req is None:
                tot = int(c[li].sum())
                curves[li] = (100.0 * np.cumsum(-np.sort(-c[li])) / tot) if tot else np.zeros(E)
        pooled = popularity_row(c.reshape(-1), k * L)
        hot_bytes = {}
        order = np.argsort(-c.reshape(-1), kind="stable")
        for p in HOT_SET_PCTS:
            n = pooled[f"hot_set_{p}"]
            hot_bytes[f"hot_set_{p}_mib"] = (int(np.repeat(eb, E)[order[:n]].sum()) / MIB) if n else None
        pop_rows.append({"request": req, "layer": None, "routings": int(c.sum()) // k, **pooled, **hot_bytes})
    popularity = pl.DataFrame(pop_rows, infer_schema_length=None)

    # tokens and sequences
    tokens = tokens_of(request, arrays.turn, arrays.step, arrays.phase, lidx, L)
    tsel = _phase_mask(tokens.phase, phase)

    # drift: per layer, whole windows of drift_window tokens of each request; top-2k sets, ties to the lower id
    top_n = min(2 * k, E)
    drift_cols: dict[str, list[np.ndarray]] = {"request": [], "layer": [], "window": [], "kept_pct": []}
    for li in range(L):
        rows, starts, seq_req = sequences(tokens, tsel, li)
        wc, wseq = window_counts(experts, rows, starts, drift_window, E)
        if wc.shape[0] < 2:
            continue
        # each window's top-n set as a mask (a stable sort of -count: ties to the lower id), all windows at once
        top = np.zeros(wc.shape, bool)
        np.put_along_axis(top, np.argsort(-wc, axis=1, kind="stable")[:, :top_n], True, axis=1)
        kept = (top[1:] & top[:-1]).sum(axis=1)
        del wc, top
        first = np.searchsorted(wseq, wseq)  # each window's index inside its request = w - its sequence's first
        ws = np.flatnonzero(wseq[1:] == wseq[:-1]) + 1  # the windows after another of their request
        # columns, not a dict per window (300,000 windows on the benchmark trace)
        drift_cols["request"].append(seq_req[wseq[ws]].astype(np.int64))
        drift_cols["layer"].append(np.full(ws.shape[0], moe_layers[li], np.int64))
        drift_cols["window"].append((ws - first[ws]).astype(np.int64))
        drift_cols["kept_pct"].append(100.0 * kept[ws - 1].astype(np.int64) / top_n)
    n_drift = sum(a.shape[0] for a in drift_cols["layer"])
    drift = pl.DataFrame({
        "request": (pl.Series("request", np.concatenate(drift_cols["request"]), pl.Int64) if has_request and n_drift
                    else pl.Series("request", [None] * n_drift, pl.Int64)),
        "layer": pl.Series("layer", np.concatenate(drift_cols["layer"]) if n_drift else [], pl.Int64),
        "window": pl.Series("window", np.concatenate(drift_cols["window"]) if n_drift else [], pl.Int64),
        "top_n": pl.Series("top_n", np.full(n_drift, top_n, np.int64), pl.Int64),
        "kept_pct": pl.Series("kept_pct", np.concatenate(drift_cols["kept_pct"]) if n_drift else [], pl.Float64),
    })
    del drift_cols

    # reuse (load-aware, whole run): reuse_walk's lookups folded into counts chunk by chunk
    T_bytes = loads.token_cycle_bytes
    budget_b = None if budget_mib is None else int(math.floor(budget_mib * MIB))
    # the byte-distance histogram as a CDF at T/4 .. 16 T (and the budget): the share of the phase's
    # lookups an LRU cache of that size hits (overflow aside: lru_hits is the exact rule)
    marks = sorted({T_bytes * f // 4 for f in (1, 2, 4, 8, 16, 32, 64)} | ({budget_b} if budget_b is not None else set()))
    rc = reuse_counts(loads, phase, marks, [T_bytes] + ([budget_b] if budget_b is not None else []),
                      chunk_loads=reuse_chunk_loads)
    steps = _pow2_upto(rc.max_steps)
    cum_buckets = np.cumsum(rc.step_buckets, axis=1)
    key_layer, key_dist = rc.bytes_keys % max(L, 1), rc.bytes_keys // max(L, 1)
    # every layer's distances pooled: the keys are distance-major, so equal distances are adjacent
    pstart = np.flatnonzero(np.concatenate([[True], key_dist[1:] != key_dist[:-1]])) if key_dist.size else key_dist
    pooled_dist = key_dist[pstart]
    pooled_counts = np.add.reduceat(rc.bytes_counts, pstart) if key_dist.size else rc.bytes_counts

    def layer_sum(a: np.ndarray, li: int | None) -> int:
        return int(a.sum()) if li is None else int(a[li])

    reuse_rows = []
    for li in [None, *range(L)]:
        n = layer_sum(rc.lookups, li)
        row: dict[str, Any] = {"layer": None if li is None else moe_layers[li], "lookups": n,
                               "reused_pct": 100.0 * layer_sum(rc.reused, li) / n if n else None}
        for st in steps:
            row[f"within_{st}_steps_pct"] = (100.0 * layer_sum(cum_buckets[:, st.bit_length() - 1], li) / n
                                             if n else None)
        row["lru_hit_pct_at_token_cycle"] = 100.0 * layer_sum(rc.lru_hits[0], li) / n if n else None
        if budget_b is not None:
            row["lru_hit_pct_at_budget"] = 100.0 * layer_sum(rc.lru_hits[1], li) / n if n else None
        med = (_hist_median(pooled_dist, pooled_counts) if li is None
               else _hist_median(key_dist[key_layer == li], rc.bytes_counts[key_layer == li]))
        row["median_distance_mib"] = None if med is None else med / MIB
        reuse_rows.append(row)
    reuse = pl.DataFrame(reuse_rows, infer_schema_length=None)
    cdf_rows = []
    for li in [None, *range(L)]:
        n = layer_sum(rc.lookups, li)
        for i, b in enumerate(marks):
            cdf_rows.append({"layer": None if li is None else moe_layers[li], "distance_mib": b / MIB,
                             "distance_x_t": b / T_bytes if T_bytes else None,
                             "within_pct": 100.0 * layer_sum(rc.within[i], li) / n if n else None})
    reuse_cdf = pl.DataFrame(cdf_rows, schema={"layer": pl.Int64, "distance_mib": pl.Float64, "distance_x_t": pl.Float64,
                                               "within_pct": pl.Float64})

    # co-activation within a layer
    pair_rows = []
    for li in range(L if k > 1 else 0):
        rows_l = np.flatnonzero(in_phase & (lidx == li))
        if rows_l.shape[0] == 0:
            continue
        pc = pair_counts(experts, rows_l, E)
        ce = counts.sum(axis=0)[li]
        R = rows_l.shape[0]
        a_idx, b_idx = np.nonzero(pc)
        cand = []
        for a, b in zip(a_idx.tolist(), b_idx.tolist()):
            cnt = int(pc[a, b])
            if cnt < min_pair_routings:  # a pair seen once has a lift of R / (c_a c_b): noise, not affinity
                continue
            cand.append((-cnt * R / (int(ce[a]) * int(ce[b])), -cnt, a, b, cnt))
        for neg_lift, _, a, b, cnt in sorted(cand)[:top_pairs]:
            pair_rows.append({"layer": moe_layers[li], "expert_a": a, "expert_b": b, "routings_both": cnt,
                              "lift": -neg_lift})
    pairs = pl.DataFrame(pair_rows, schema={"layer": pl.Int64, "expert_a": pl.Int64, "expert_b": pl.Int64,
                                            "routings_both": pl.Int64, "lift": pl.Float64})

    # across consecutive MoE layers
    trans_rows, top_rows, mats = [], [], {}
    for li in range(L - 1):
        rh = tokens.row_of[tsel, li]
        rn = tokens.row_of[tsel, li + 1]
        tc = transition_counts(experts, rh.astype(np.int64), rn.astype(np.int64), E)
        mats[li] = tc
        h, hm = cond_entropy_bits(tc)
        n_here = tc.sum(axis=1) // k  # routings at L (with a row at L+1) that chose e
        trans_rows.append({"layer": moe_layers[li], "next_layer": moe_layers[li + 1], "tokens": int(((rh >= 0) & (rn >= 0)).sum()),
                           "cond_entropy_bits": h, "next_entropy_bits": hm,
                           "info_bits": None if h is None else hm - h})
        flat = [(-int(tc[a, b]), a, b) for a, b in zip(*np.nonzero(tc))]
        for negc, a, b in sorted(flat)[:top_pairs]:
            top_rows.append({"layer": moe_layers[li], "expert": int(a), "next_expert": int(b), "count": -negc,
                             "p_next_pct": 100.0 * (-negc) / int(n_here[a])})
    transitions = pl.DataFrame(trans_rows, schema={"layer": pl.Int64, "next_layer": pl.Int64, "tokens": pl.Int64,
                                                   "cond_entropy_bits": pl.Float64, "next_entropy_bits": pl.Float64,
                                                   "info_bits": pl.Float64})
    top_transitions = pl.DataFrame(top_rows, schema={"layer": pl.Int64, "expert": pl.Int64, "next_expert": pl.Int64,
                                                     "count": pl.Int64, "p_next_pct": pl.Float64})

    # SRP and SCH
    srp_rows, sch_rows = [], []
    cache_sizes = sorted({c for c in (k, 2 * k, 4 * k) if c <= E})
    for m in segment_lengths:
        hist_req: dict[Any, np.ndarray] = {}
        dep_req: dict[Any, np.ndarray] = {}
        per_layer_h, per_layer_d = [], []
        for li in range(L):
            rows, starts, seq_req = sequences(tokens, tsel, li)
            hl = np.zeros(m + 1, np.int64)
            dl = np.zeros(E, np.int64)
            for si in range(starts.shape[0] - 1):
                one = np.array([starts[si], starts[si + 1]], np.int64)
                h = srp_hist(experts, rows, one, m, E)
                d = sch_depths(experts, rows, one, m, E)
                hl += h
                dl += d
                if has_request:
                    key = int(seq_req[si])
                    hist_req[key] = hist_req.get(key, np.zeros(m + 1, np.int64)) + h
                    dep_req[key] = dep_req.get(key, np.zeros(E, np.int64)) + d
            per_layer_h.append(hl)
            per_layer_d.append(dl)
            srp_rows.append(_srp_row(None, moe_layers[li], m, hl, E))
            sch_rows.extend(_sch_rows(None, moe_layers[li], m, dl, cache_sizes, k))
        srp_rows.append(_srp_row(None, None, m, np.sum(per_layer_h, axis=0), E))
        sch_rows.extend(_sch_rows(None, None, m, np.sum(per_layer_d, axis=0), cache_sizes, k))
        if has_request and len(hist_req) > 1:
            for key in sorted(hist_req):
                srp_rows.append(_srp_row(key, None, m, hist_req[key], E))
                sch_rows.extend(_sch_rows(key, None, m, dep_req[key], cache_sizes, k))
    srp = pl.DataFrame(srp_rows, schema={"request": pl.Int64, "layer": pl.Int64, "segment_tokens": pl.Int64,
                                         "windows": pl.Int64, "srp_pct": pl.Float64, "threshold": pl.Int64,
                                         "predicted_per_routed": pl.Float64})
    sch = pl.DataFrame(sch_rows, schema={"request": pl.Int64, "layer": pl.Int64, "segment_tokens": pl.Int64,
                                         "cache_experts": pl.Int64, "cache_x_k": pl.Float64, "slots": pl.Int64,
                                         "sch_pct": pl.Float64})

    prof = Profile(phase=phase, moe_layers=tuple(moe_layers), n_expert=E, top_k=k, layer_expert_bytes=eb,
                   token_cycle_bytes=T_bytes, budget_mib=budget_mib, has_request=has_request, popularity=popularity,
                   drift=drift, reuse=reuse, reuse_cdf=reuse_cdf, pairs=pairs, transitions=transitions, top_transitions=top_transitions,
                   srp=srp, sch=sch, answer={}, reuse_bytes_hist=(pooled_dist, pooled_counts),
                   reuse_steps_hist=rc.steps_counts, drift_window=drift_window, transition_matrices=mats, coverage_curves=curves)
    prof.answer = cacheability(prof)
    return prof


def _srp_row(req, layer, m, hist, n_expert) -> dict[str, Any]:
    f1, theta, ratio = srp_from_hist(hist)
    # every window counts each expert once: windows = (window, expert) pairs / n_expert
    return {"request": req, "layer": layer, "segment_tokens": m, "windows": int(hist.sum()) // n_expert,
            "srp_pct": None if f1 is None else 100.0 * f1, "threshold": theta, "predicted_per_routed": ratio}


def _sch_rows(req, layer, m, depths, sizes, k) -> list[dict[str, Any]]:
    n = int(depths.sum())
    return [{"request": req, "layer": layer, "segment_tokens": m, "cache_experts": c, "cache_x_k": c / k, "slots": n,
             "sch_pct": 100.0 * int(depths[:c].sum()) / n if n else None} for c in sizes]


def sch_at(prof: Profile, m: int, cache_experts: int) -> float | None:
    """Pooled SCH (every layer, every request) at segment length m and a C-expert cache per layer;
    computed from the stored figures only for the sizes in ``prof.sch``."""
    f = prof.sch.filter(pl.col("layer").is_null() & pl.col("request").is_null() & (pl.col("segment_tokens") == m)
                        & (pl.col("cache_experts") == cache_experts))
    return f["sch_pct"][0] if f.height else None


def cacheability(prof: Profile) -> dict[str, Any]:
    """The figures of the answer to "is this routing cacheable?": the hot set covering 80% of the
    phase's routed slots (MiB) against the budget, lookups reused within one step (the previous
    token at that layer, for one request), LRU's hit % at one token's routing (T) and at the budget,
    and SCH at 2k experts per layer (the paper's sweet spot) for 16-token segments."""
    pooled = prof.popularity.filter(pl.col("layer").is_null() & pl.col("request").is_null()).row(0, named=True)
    overall = prof.reuse.filter(pl.col("layer").is_null()).row(0, named=True)
    out = {
        "phase": prof.phase,
        "budget_mib": prof.budget_mib,
        "token_cycle_mib": prof.token_cycle_bytes / MIB,
        "working_set_mib": None,
        "hot_set_80_mib": pooled.get("hot_set_80_mib"),
        "hot_set_80_experts": pooled.get("hot_set_80"),
        "entries": prof.n_expert * len(prof.moe_layers),
        "reused_pct": overall["reused_pct"],
        "within_1_steps_pct": overall.get("within_1_steps_pct"),
        "lru_hit_pct_at_token_cycle": overall["lru_hit_pct_at_token_cycle"],
        "lru_hit_pct_at_budget": overall.get("lru_hit_pct_at_budget"),
        "sch_2k_16_pct": sch_at(prof, 16, 2 * prof.top_k),
    }
    return out


@dataclass(frozen=True)
class RoutingColumns:
    """The routing columns the profile reads (a :class:`traces.io.reader.RoutingArrays` without
    ``batch``, ``weights`` and the recorded columns), in the format's widths."""

    turn: np.ndarray  # int32 [R]
    phase: np.ndarray  # int8 [R]
    step: np.ndarray  # int32 [R]
    layer: np.ndarray  # int16 [R]
    experts: np.ndarray  # int32 [R, k]
    request: np.ndarray | None  # int64 [R], None: one request


def routing_columns(trace: Any) -> RoutingColumns:
    """:class:`RoutingColumns` of a trace, read part by part into arrays allocated once (peak: the
    result plus one part's columns, not the whole table beside its copy)."""
    from traces.io.reader import fixed_list_to_numpy

    trace.check_rows()  # as Trace.table does; n_rows is the parts' footers' sum, the rows read below
    names = ["turn", "phase", "step", "layer"] + (["request"] if trace.has("request") else [])
    R = int(trace.n_rows)
    out: dict[str, np.ndarray] = {}
    at = 0
    for t in trace.iter_tables([*names, "experts"]):
        n = t.num_rows
        cols = {c: t.column(c).to_numpy() for c in names}
        cols["experts"] = fixed_list_to_numpy(t.column("experts"))
        del t
        for c, a in cols.items():
            if c not in out:
                out[c] = np.empty((R, *a.shape[1:]), a.dtype)
            out[c][at:at + n] = a
        del cols
        at += n
    if not out:  # no part
        out = {"turn": np.zeros(0, np.int32), "phase": np.zeros(0, np.int8), "step": np.zeros(0, np.int32),
               "layer": np.zeros(0, np.int16), "experts": np.zeros((0, int(trace.top_k)), np.int32)}
    return RoutingColumns(turn=out["turn"], phase=out["phase"], step=out["step"], layer=out["layer"],
                          experts=out["experts"], request=out.get("request"))


def profile(trace: Any, *, phase: str = "decode", budget_mib: float | None = None,
            segment_lengths=SEGMENT_LENGTHS, drift_window: int = DRIFT_WINDOW) -> Profile:
    """:func:`profile_arrays` of a trace (its rows read once, its loads cut as the replay cuts them).
    ``budget_mib`` default: the recorded budget, if any."""
    import pyarrow as pa

    from replay.core.simulate import loads_of

    arrays = routing_columns(trace)
    loads = loads_of(trace)
    # the parts' decoded pages went back to Arrow's allocator: hand them back to the system before
    # the analysis allocates its own (about 30 bytes per routing on the benchmark trace otherwise)
    pa.default_memory_pool().release_unused()
    if budget_mib is None:
        budget_mib = trace.recorded.get("budget_mib")
    prof = profile_arrays(arrays, loads, moe_layers=tuple(int(x) for x in trace.moe_layers), n_expert=trace.n_expert,
                          top_k=trace.top_k, phase=phase, budget_mib=budget_mib, segment_lengths=segment_lengths,
                          drift_window=drift_window)
    prof.answer["working_set_mib"] = loads.working_set_bytes / MIB
    return prof


def summary(prof: Profile, segment_tokens: int = 16) -> pl.DataFrame:
    """One row per MoE layer and the pooled row (``layer`` null): the headline figures of every
    part of the profile (the rows of ``profile --json`` and :func:`replay.profile`). SRP and SCH at
    ``segment_tokens`` (SCH with 2k experts per layer)."""
    k = prof.top_k
    pop = prof.popularity.filter(pl.col("request").is_null())
    srp = prof.srp.filter(pl.col("request").is_null() & (pl.col("segment_tokens") == segment_tokens))
    sch = prof.sch.filter(pl.col("request").is_null() & (pl.col("segment_tokens") == segment_tokens)
                          & (pl.col("cache_experts") == min(2 * k, prof.n_expert)))
    per = pop.filter(pl.col("layer").is_not_null())
    slots = int(per["slots"].sum()) if per.height else 0
    # pooled: the share of all routed slots taken by each layer's own k hottest experts
    pooled_top = (sum(int(round(p * s / 100.0)) for p, s in zip(per[f"top{k}_pct"].fill_null(0), per["slots"])) * 100.0
                  / slots) if slots and f"top{k}_pct" in per.columns else None
    rows = []
    for layer in [*prof.moe_layers, None]:
        def pick(frame: pl.DataFrame, col: str, layer=layer) -> Any:
            f = frame.filter(pl.col("layer").is_null() if layer is None else pl.col("layer") == layer)
            return f[col][0] if f.height and col in f.columns else None

        rows.append({
            "layer": layer, "routings": pick(pop, "routings"),
            "topk_pct": pooled_top if layer is None else pick(pop, f"top{k}_pct"),
            "hot_set_80": pick(pop, "hot_set_80"), "gini": pick(pop, "gini"),
            "experts_never_routed": pick(pop, "experts_never_routed"), "hottest_vs_uniform": pick(pop, "hottest_vs_uniform"),
            "drift_kept_pct": (prof.drift["kept_pct"].mean() if layer is None else
                               prof.drift.filter(pl.col("layer") == layer)["kept_pct"].mean()) if prof.drift.height else None,
            "reused_pct": pick(prof.reuse, "reused_pct"), "within_1_steps_pct": pick(prof.reuse, "within_1_steps_pct"),
            "lru_hit_pct_at_token_cycle": pick(prof.reuse, "lru_hit_pct_at_token_cycle"),
            "lru_hit_pct_at_budget": pick(prof.reuse, "lru_hit_pct_at_budget"),
            f"srp{segment_tokens}_pct": pick(srp, "srp_pct"), f"sch{segment_tokens}_2k_pct": pick(sch, "sch_pct"),
            "cond_entropy_bits": (None if layer is None else pick(prof.transitions, "cond_entropy_bits")),
        })
    return pl.DataFrame(rows, infer_schema_length=None)
