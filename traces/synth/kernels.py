"""Numba kernels of the synthetic generator's low-rank model (``synth --rank R``).

The model (traces.synth.generator) keeps its residual stream in an R-dimensional latent space: the
full-width stream is ``P s`` for a fixed +-1 matrix ``P`` ``[embd, R]``. Its RMS over the embd
coordinates is ``sqrt(s^T G s / embd)`` with ``G = P^T P``, so nothing embd-wide is computed per
token: the latent is normalized by that RMS and rounded to a multiple of 2^-12 (clipped to
+-``CLIP``), which makes the gate input ``P s`` exact in float32 whatever the summation order.
Router logits are ``W[:, 0] + M s`` with ``M = W[:, 1:] P[1:, :]`` (coordinate 0 is the constant
one), the same numbers a reader gets from the stored gate input and router up to float64
rounding. Every operation here is written in the order the naive twin (tests/naive/synth.py)
does it, without fast-math, so both give the same bits.
"""

from __future__ import annotations

import math

import numpy as np

from traces.util.jit import njit

# The latent is rounded to multiples of 1 / QUANT and clipped to +-CLIP: with R <= 256
# (traces.synth.generator.MAX_RANK), every gate input coordinate is a multiple of 2^-12 below 2^11 in
# magnitude (exact in float32).
QUANT = 4096.0
CLIP = 8.0


@njit(cache=True, nogil=True)
def project_routers(W, P):
    """``MT[l, j, e] = sum over d >= 1 of W[l, e, d] * P[d, j]`` (float64, d ascending)."""
    L, E, D = W.shape
    R = P.shape[1]
    MT = np.empty((L, R, E))
    for l in range(L):
        for j in range(R):
            for e in range(E):
                acc = 0.0
                for d in range(1, D):
                    acc += np.float64(W[l, e, d]) * P[d, j]
                MT[l, j, e] = acc
    return MT


@njit(cache=True, nogil=True)
def latents(z, a, u, G, rho, keep, drift, embd, out):
    """Advance the latent state over ``n = z.shape[0]`` tokens and write each token's normalized,
    rounded latent per layer into ``out`` ``[n, L, R]``. ``z`` ``[n, (L + 2) * R]`` holds, per
    token, the topic draw (R), the per-layer residual draws (L x R) and the token noise (R);
    ``a`` ``[R]`` (topic) and ``u`` ``[L, R]`` (per-layer residual updates) are updated in place."""
    n = z.shape[0]
    L, R = u.shape
    h = np.empty(R)
    cum = np.empty(R)
    s = np.empty((L, R))
    q = np.empty(L)
    for t in range(n):
        for j in range(R):
            a[j] = rho * a[j] + keep * z[t, j]
        for l in range(L):
            for j in range(R):
                u[l, j] = rho * u[l, j] + keep * z[t, R + l * R + j]
        for j in range(R):
            h[j] = 0.8 * a[j] + 0.6 * z[t, R + L * R + j]
            cum[j] = 0.0
        for l in range(L):
            for j in range(R):
                cum[j] += u[l, j]
                s[l, j] = h[j] + drift * cum[j]
            q[l] = 0.0
        # Each layer's quadratic form summed in (i, j) order as before, the layers side by side:
        # independent sums (vectorizable), not one long chain of dependent additions.
        for i in range(R):
            for j in range(R):
                g = G[i, j]
                for l in range(L):
                    q[l] += g * s[l, i] * s[l, j]
        for l in range(L):
            rms = math.sqrt(q[l] / embd)
            if rms == 0.0:
                rms = 1.0
            for j in range(R):
                v = math.floor(s[l, j] / rms * QUANT + 0.5) / QUANT
                out[t, l, j] = min(CLIP, max(-CLIP, v))


@njit(cache=True, nogil=True)
def logits_of(sn, MT, W0, out):
    """``out[t, l, e] = W0[l, e] + sum over j of MT[l, j, e] * sn[t, l, j]`` (j ascending)."""
    n, L, R = sn.shape
    E = W0.shape[1]
    for t in range(n):
        for l in range(L):
            for e in range(E):
                out[t, l, e] = W0[l, e]
            for j in range(R):
                v = sn[t, l, j]
                for e in range(E):
                    out[t, l, e] += MT[l, j, e] * v


@njit(cache=True, nogil=True)
def softmax_route(sn, MT, W0, k, scale, ids, weights):
    """Softmax gating with top-k renormalization, straight from the latents: the k largest logits
    (descending, ties to the lower id; softmax is monotone), weights ``exp(x_i - max)`` over their
    sum in rank order, times ``scale``, as float32. ``ids`` / ``weights`` are ``[n, L, k]``.

    No ``parallel=True`` (callers split the tokens over Python threads instead; the kernels
    release the GIL): ``parallel=True`` took a 2-core machine's route time from 122 to 55 ms per 1,000
    tokens under load, but the threading layer Numba picks here (GNU OpenMP) is not fork-safe: a
    child forked after the parent used it (a fork-started pool in a script that called synth
    first) can hang or be terminated when it runs the kernel again (Numba's documentation)."""
    n, L, R = sn.shape
    E = W0.shape[1]
    x = np.empty(E)
    bv = np.empty(k)
    bi = np.empty(k, dtype=np.int64)
    ex = np.empty(k)
    ns = 2 * k if E >= 2 * k else k  # disjoint sets {i * ns + b} of logits
    m = np.empty(ns)
    cand = np.empty(E + 1, dtype=np.int64)  # one spare slot: the last id is written before it is counted
    nb = E // ns  # >= 1: top_k <= n_expert
    for t in range(n):
        for l in range(L):
            for e in range(E):
                x[e] = W0[l, e]
            for j in range(R):
                v = sn[t, l, j]
                for e in range(E):
                    x[e] += MT[l, j, e] * v
            # A threshold no larger than the k-th largest logit: the k-th largest of the maxima of
            # 2k disjoint sets {i * 2k + b} (k of them when there are fewer than 2k experts), which
            # are k distinct logits at or above it. Logits below it are skipped at once; the rest
            # enter the insertion in ascending id order (ties to the lower id): the same k, in the
            # same order. (The smallest of k set maxima, before, let about 20 of 128 through at 48 x
            # 128 top-8, this about 10.)
            for b in range(ns):
                m[b] = x[b]
            for i in range(1, nb):
                for b in range(ns):
                    m[b] = max(m[b], x[i * ns + b])
            thr = -np.inf
            for a in range(ns):  # the largest set maximum with at least k maxima at or above it
                ma = m[a]
                cnt = 0
                for b in range(ns):
                    cnt += not m[b] < ma
                if cnt >= k and ma > thr:
                    thr = ma
            # The ids at or above it gathered without a branch (a branch per logit mispredicted
            # often), then inserted in ascending id order.
            nc = 0
            for e in range(E):
                cand[nc] = e
                nc += not x[e] < thr
            c = 0
            for q in range(nc):
                e = cand[q]
                v = x[e]
                if c == k and not v > bv[k - 1]:
                    continue
                p = c if c < k else k - 1  # the slot it takes, then moved up past smaller values
                while p > 0 and v > bv[p - 1]:
                    bv[p] = bv[p - 1]
                    bi[p] = bi[p - 1]
                    p -= 1
                bv[p] = v
                bi[p] = e
                if c < k:
                    c += 1
            total = 0.0
            for i in range(k):
                ex[i] = math.exp(bv[i] - bv[0])
                total += ex[i]
            for i in range(k):
                ids[t, l, i] = bi[i]
                weights[t, l, i] = np.float32(ex[i] / total * scale)


@njit(cache=True, nogil=True)
def first_bad_routing(ids, weights, n_expert, by_rank):
    """``(code, row)`` of the first row of ``ids`` / ``weights`` ``[rows, k]`` that no reader would
    accept, ``(0, -1)`` if none; of a row's problems, the first in this list: 1 an expert id
    outside 0..n_expert-1, 2 an id listed twice, 3 a weight negative or not finite, 4 (``by_rank``) weights increasing
    from one slot to the next. One pass over the rows (the synthetic generator's check before
    it writes them)."""
    n, k = ids.shape
    for r in range(n):
        for i in range(k):
            e = ids[r, i]
            if e < 0 or e >= n_expert:
                return 1, r
        for i in range(1, k):
            for j in range(i):
                if ids[r, j] == ids[r, i]:
                    return 2, r
        for i in range(k):
            w = weights[r, i]
            if not (w >= 0.0 and w < np.inf):
                return 3, r
        if by_rank:
            for i in range(1, k):
                if weights[r, i] > weights[r, i - 1]:
                    return 4, r
    return 0, -1
