"""Naive twins of the locality profile (replay/analyses/locality.py), written from docs/profile.md's
definitions: lists, dictionaries and loops, every count recomputed from scratch.

rows: list of dicts with ``batch``, ``phase``, ``layer``, ``step``, ``experts`` and optionally
``request`` (and ``turn``), in file order (batch, layer, [request,] step).
"""

from __future__ import annotations

import math
from collections import defaultdict


def _token_key(r):
    return (r.get("request", 0), r.get("turn", 0), r["step"])


def naive_loads(rows):
    """[(batch number 0.., phase, layer, [experts of each row])] in order: one per (batch, layer)."""
    loads, batch_no, prev_batch = [], -1, None
    for r in rows:
        if r["batch"] != prev_batch:
            batch_no += 1
            prev_batch = r["batch"]
        if loads and loads[-1][0] == batch_no and loads[-1][2] == r["layer"]:
            loads[-1][3].append(list(r["experts"]))
        else:
            loads.append((batch_no, r["phase"], r["layer"], [list(r["experts"])]))
    return loads


def naive_reuse(rows, expert_bytes):
    """Per lookup (a distinct (layer, expert) of a load, first-visit order): (load number, layer,
    expert, phase, distance in bytes, distance in batches, loads since) with -1 for a first use.
    The distance in bytes is the bytes of the distinct entries visited since the entry's last
    visit, itself included, looked up before the load's own visits move anything."""
    recency: list[tuple[int, int]] = []  # least recent first
    last_batch: dict[tuple[int, int], int] = {}
    last_load: dict[tuple[int, int], int] = {}
    out = []
    for g, (batch, phase, layer, routings) in enumerate(naive_loads(rows)):
        seen = []
        for ex in routings:
            for e in ex:
                if (layer, e) not in seen:
                    seen.append((layer, e))
        for key in seen:
            if key in recency:
                i = recency.index(key)
                dist = sum(expert_bytes[l] for l, _ in recency[i:])
                out.append((g, key[0], key[1], phase, dist, batch - last_batch[key], g - last_load[key]))
            else:
                out.append((g, key[0], key[1], phase, -1, -1, -1))
        for ex in routings:
            for e in ex:
                key = (layer, e)
                if key in recency:
                    recency.remove(key)
                recency.append(key)
                last_batch[key] = batch
                last_load[key] = g
    return out


def naive_counts(rows, phases, n_expert):
    """{layer: [count per expert]} over the rows of ``phases``."""
    out = defaultdict(lambda: [0] * n_expert)
    for r in rows:
        if r["phase"] in phases:
            for e in r["experts"]:
                out[r["layer"]][e] += 1
    return out


def naive_popularity(counts, k):
    """The popularity figures of one population's counts, from their definitions."""
    E, total = len(counts), sum(counts)
    srt = sorted(counts, reverse=True)
    row = {"slots": total}
    n = max(1, k)
    ns = []
    while n < E:
        ns.append(n)
        n *= 2
    ns.append(E)
    for n in ns:
        row[f"top{n}_pct"] = 100.0 * sum(srt[:n]) / total if total else None
    for p in (50, 80, 95):
        hot = None
        if total:
            for n in range(1, E + 1):
                if sum(srt[:n]) * 100 >= p * total:
                    hot = n
                    break
        row[f"hot_set_{p}"] = hot
    pairs = sum(abs(a - b) for a in counts for b in counts)
    row["gini"] = pairs / (2 * E * total) if total else None
    row["experts_never_routed"] = sum(1 for c in counts if c == 0)
    row["hottest_vs_uniform"] = srt[0] * E / total if total else None
    return row


def naive_sequences(rows, phases, layer):
    """{request: [experts of each of its tokens at ``layer``, in (turn, step) order]}."""
    seqs = defaultdict(list)
    for r in sorted((r for r in rows if r["phase"] in phases and r["layer"] == layer), key=_token_key):
        seqs[r.get("request", 0)].append(list(r["experts"]))
    return dict(sorted(seqs.items()))


def naive_srp_hist(seq, m, n_expert):
    """Per count c, the (window, expert) pairs whose expert the window of m tokens routes c times."""
    hist = [0] * (m + 1)
    for w in range(len(seq) - m + 1):
        for e in range(n_expert):
            hist[sum(1 for t in range(w, w + m) if e in seq[t])] += 1
    return hist


def naive_srp(hist):
    """(best F1, theta, predicted / routed) from the histogram: every window predicts the experts it
    routes >= theta times for all of its m tokens."""
    m = len(hist) - 1
    acts = sum(c * h for c, h in enumerate(hist))
    if sum(hist) == 0 or acts == 0:
        return None, None, None
    best, theta = -1.0, 0
    for th in range(m + 1):
        matches = sum(c * hist[c] for c in range(th, m + 1))
        preds = m * sum(hist[c] for c in range(th, m + 1))
        f1 = 2 * matches / max(preds + acts, 1)
        if f1 > best:
            best, theta = f1, th
    preds = m * sum(hist[c] for c in range(theta, m + 1))
    return best, theta, preds / acts


def naive_sch_depths(seq, m, n_expert):
    """Depth of every routed slot in the segment-cache stack (Mattson's algorithm with the priority
    (uses in the next m tokens, last use)), the paper's code's procedure written plainly; checked
    against the authors' calc_fsf (src/41_sch_calc.py) on 5,000 random sequences while writing it."""
    T = len(seq)
    cnt = [0] * n_expert
    last = [0] * n_expert
    depth = [0] * n_expert
    stack: list[int] = []
    ts = 0
    for t in range(min(m, T)):
        for e in seq[t]:
            cnt[e] += 1

    def prio(e):
        return (cnt[e], last[e])

    for i in range(T):
        uni = len(stack)
        for e in seq[i]:
            if e in stack:
                depth[stack.index(e)] += 1
            else:
                depth[uni] += 1
                uni += 1
        for x in seq[i]:
            d = stack.index(x) if x in stack else len(stack)
            if not stack:
                stack.append(x)
            else:
                carry = stack[0]
                stack[0] = x
                for p in range(1, d):
                    if prio(stack[p]) < prio(carry):
                        stack[p], carry = carry, stack[p]
                if d == len(stack):
                    stack.append(carry)
                elif d > 0:
                    stack[d] = carry
            ts += 1
            cnt[x] -= 1
            last[x] = ts
        if i + m < T:
            for e in seq[i + m]:
                cnt[e] += 1
    return depth


def naive_pairs(rows, phases, layer, n_expert):
    """{(a, b): routings that chose both, a < b}."""
    out = defaultdict(int)
    for r in rows:
        if r["phase"] in phases and r["layer"] == layer:
            ex = r["experts"]
            for i in range(len(ex)):
                for j in range(i + 1, len(ex)):
                    if ex[i] != ex[j]:
                        out[(min(ex[i], ex[j]), max(ex[i], ex[j]))] += 1
    return dict(out)


def naive_transitions(rows, phases, layer, next_layer, n_expert):
    """[E][E] counts of (e at layer, e' at next_layer) over the tokens routed at both."""
    at = defaultdict(dict)
    for r in rows:
        if r["phase"] in phases:
            at[_token_key(r)][r["layer"]] = r["experts"]
    out = [[0] * n_expert for _ in range(n_expert)]
    for lay in at.values():
        if layer in lay and next_layer in lay:
            for a in lay[layer]:
                for b in lay[next_layer]:
                    out[a][b] += 1
    return out


def naive_entropy(trans):
    """(H(next | this), H(next)) in bits."""
    tot = sum(map(sum, trans))
    if tot == 0:
        return None, None
    h = 0.0
    for row in trans:
        ne = sum(row)
        for v in row:
            if v:
                h -= (v / tot) * math.log2(v / ne)
    hm = 0.0
    for b in range(len(trans)):
        v = sum(row[b] for row in trans)
        if v:
            hm -= (v / tot) * math.log2(v / tot)
    return h, hm


def naive_drift(seq, window, top_n, n_expert):
    """Share (%) of each whole window's top-n experts (count, then lower id) kept from the window before."""
    tops = []
    for w in range(len(seq) // window):
        c = [0] * n_expert
        for t in range(w * window, (w + 1) * window):
            for e in seq[t]:
                c[e] += 1
        tops.append(set(sorted(range(n_expert), key=lambda e: (-c[e], e))[:top_n]))
    return [100.0 * len(tops[i] & tops[i - 1]) / top_n for i in range(1, len(tops))]
