"""Naive twins of ``opt-bound`` (replay/policies/opt_bound.py), in exact rational arithmetic.

- :func:`naive_lp`: the LP relaxation written out from the replay semantics (one variable per
  lookup that has an earlier lookup of its entry, one capacity row per load), solved by a dense
  simplex over ``fractions.Fraction`` with Bland's rule (no float, no flow).
- :func:`naive_opt`: the best replay of the class P the bound covers, by exhaustive search over
  the resident sets a replay may keep after each load (no intervals, no LP): the integer optimum.

Rows are (batch, phase, layer, experts) in trace order, as tests/naive/cache.py takes them; a load
is a run of rows with equal (batch, layer).
"""

from __future__ import annotations

from fractions import Fraction
from functools import cache


def _loads(rows):
    """[(phase, layer, [unique entries in visit order])] per load."""
    out = []
    key = None
    for batch, phase, layer, experts in rows:
        if (batch, layer) != key:
            key = (batch, layer)
            out.append((phase, layer, []))
        for e in experts:
            if (layer, e) not in out[-1][2]:
                out[-1][2].append((layer, e))
    return out


def simplex_max(c, A, b):
    """max c.x s.t. A x <= b, x >= 0, with b >= 0 (the origin is feasible), exactly (Fractions,
    Bland's rule: no cycling). Returns the optimum (bounded: every caller's x is boxed)."""
    m, n = len(A), len(c)
    T = [[Fraction(v) for v in A[i]] + [Fraction(int(i == j)) for j in range(m)] + [Fraction(b[i])] for i in range(m)]
    z = [Fraction(-v) for v in c] + [Fraction(0)] * m + [Fraction(0)]
    basis = [n + i for i in range(m)]
    while True:
        col = next((j for j in range(n + m) if z[j] < 0), None)
        if col is None:
            return z[-1]
        best = None
        for i in range(m):
            if T[i][col] > 0:
                ratio = T[i][-1] / T[i][col]
                if best is None or ratio < best[0] or (ratio == best[0] and basis[i] < basis[best[1]]):
                    best = (ratio, i)
        assert best is not None, "unbounded LP"
        r = best[1]
        pv = T[r][col]
        T[r] = [v / pv for v in T[r]]
        for i in range(m):
            if i != r and T[i][col] != 0:
                f = T[i][col]
                T[i] = [a - f * bb for a, bb in zip(T[i], T[r])]
        if z[col] != 0:
            f = z[col]
            z = [a - f * bb for a, bb in zip(z, T[r])]
        basis[r] = col


def _fills(sizes, room):
    """Every byte count whole entries of ``sizes`` can fill within ``room``."""
    if not sizes:
        return [0]
    return [n * sizes[0] + rest for n in range(room // sizes[0] + 1) for rest in _fills(sizes[1:], room - n * sizes[0])]


def naive_lp(rows, expert_bytes: dict[int, int], budget: int, phase: int) -> Fraction:
    """The LP optimum of hits in ``phase`` (0 prefill, 1 decode) over replays that start empty:
    a lookup of an entry last looked up at load a, at load b, hits iff the entry stays resident
    after loads a+1 .. b-1 (after load a it is resident anyway); after load t the kept entries
    share the most bytes whole entries can fill in max(0, budget - bytes of load t's entries)
    (with one or two sizes among the layers; else that room itself)."""
    loads = _loads(rows)
    last: dict = {}
    var = []  # (first state, last state, size) of each lookup's interval, for lookups of the phase
    always = 0
    for b, (ph, layer, ents) in enumerate(loads):
        for e in ents:
            a = last.get(e)
            if a is not None and ph == phase:
                if a + 1 == b:
                    always += 1
                else:
                    var.append((a + 1, b - 1, expert_bytes[layer]))
            last[e] = b
    if not var:
        return Fraction(always)
    sizes = sorted(set(expert_bytes.values()))
    A, rhs = [], []
    for t, (_, layer, ents) in enumerate(loads):
        A.append([s if lo <= t <= hi else 0 for lo, hi, s in var])
        room = max(0, budget - expert_bytes[layer] * len(ents))
        rhs.append(max(_fills(sizes, room)) if len(sizes) <= 2 else room)
    for i in range(len(var)):  # x_i <= 1
        A.append([int(j == i) for j in range(len(var))])
        rhs.append(1)
    return simplex_max([1] * len(var), A, rhs) + always


def naive_opt(rows, expert_bytes: dict[int, int], budget: int, phase: int) -> int:
    """The most hits in ``phase`` of any replay in the class P: the cache starts empty; after load
    t it holds the load's entries and any of those it held before, either within ``budget`` bytes
    or (the load alone over budget) nothing else. Exhaustive over the kept subsets."""
    loads = _loads(rows)

    def size(e):
        return expert_bytes[e[0]]

    @cache
    def best(t: int, held: frozenset) -> int:
        if t == len(loads):
            return 0
        ph, _, ents = loads[t]
        hits = sum(1 for e in ents if e in held) if ph == phase else 0
        here = frozenset(ents)
        room = budget - sum(size(e) for e in here)
        others = sorted(held - here)
        out = -1
        for mask in range(1 << len(others)):
            keep = [others[i] for i in range(len(others)) if mask >> i & 1]
            if sum(size(e) for e in keep) <= max(0, room):
                out = max(out, best(t + 1, here | frozenset(keep)))
        return hits + out

    return best(0, frozenset())
