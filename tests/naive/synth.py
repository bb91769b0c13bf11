"""Naive twin of the synthetic generator's low-rank model (traces.synth.kernels), written from
its docstrings: plain Python floats and loops, one token, one layer, one expert at a time.

Same random numbers (the model's generator, drawn token by token: topic R, residual L x R, noise
R), same operations in the same order, so the kernels must agree bit for bit."""

from __future__ import annotations

import math

import numpy as np

QUANT = 4096.0
CLIP = 8.0


def naive_lowrank_routes(model, n: int) -> dict[str, np.ndarray]:
    """The next ``n`` tokens of ``model`` (a traces.synth.generator._LowRankModel, its state advanced as
    the kernels would): experts / weights ``[n, L, k]`` and, unless routing-only, logits and gate
    inputs, as the model's ``routes`` returns them (softmax gating)."""
    cfg = model.cfg
    L, E, D, K, R = cfg.layers, cfg.experts, cfg.embd, cfg.top_k, cfg.rank
    W = model.W.astype(np.float64).tolist()
    P = model.P.tolist()
    G = [[sum(P[d][i] * P[d][j] for d in range(D)) for j in range(R)] for i in range(R)]
    M = [[[0.0] * R for _ in range(E)] for _ in range(L)]  # M[l][e][j] = sum over d >= 1 of W P
    for l in range(L):
        for e in range(E):
            for j in range(R):
                acc = 0.0
                for d in range(1, D):
                    acc += W[l][e][d] * P[d][j]
                M[l][e][j] = acc
    rho = float(cfg.reuse)
    keep = float(np.sqrt(1.0 - cfg.reuse * cfg.reuse))
    a = model.topic.tolist()
    u = model.u.tolist()
    ids = np.zeros((n, L, K), np.int32)
    wts = np.zeros((n, L, K), np.float32)
    logits = np.zeros((n, L, E), np.float32)
    gate = np.zeros((n, L, D), np.float32)
    for t in range(n):
        z_topic = model.rng.standard_normal(R).tolist()
        z_u = model.rng.standard_normal((L, R)).tolist()
        z_noise = model.rng.standard_normal(R).tolist()
        a = [rho * a[j] + keep * z_topic[j] for j in range(R)]
        u = [[rho * u[l][j] + keep * z_u[l][j] for j in range(R)] for l in range(L)]
        h = [0.8 * a[j] + 0.6 * z_noise[j] for j in range(R)]
        cum = [0.0] * R
        for l in range(L):
            cum = [cum[j] + u[l][j] for j in range(R)]
            s = [h[j] + cfg.drift * cum[j] for j in range(R)]
            q = 0.0
            for i in range(R):
                for j in range(R):
                    q += G[i][j] * s[i] * s[j]
            rms = math.sqrt(q / D) or 1.0
            sn = [min(CLIP, max(-CLIP, math.floor(s[j] / rms * QUANT + 0.5) / QUANT)) for j in range(R)]
            x = []
            for e in range(E):
                acc = W[l][e][0]
                for j in range(R):
                    acc += M[l][e][j] * sn[j]
                x.append(acc)
            chosen = sorted(range(E), key=lambda e: (-x[e], e))[:K]
            ex = [math.exp(x[e] - x[chosen[0]]) for e in chosen]
            total = 0.0
            for v in ex:
                total += v
            ids[t, l] = chosen
            wts[t, l] = [np.float32(v / total * 1.0) for v in ex]
            logits[t, l] = x
            g = [sum(P[d][j] * sn[j] for j in range(R)) for d in range(D)]
            g[0] = 1.0
            gate[t, l] = g
    model.topic[:] = a
    model.u[:] = u
    out = {"experts": ids, "weights": wts}
    if not cfg.routing_only:
        out["logits"] = logits
        out["gate_input"] = gate
    return out


def naive_first_bad_routing(ids, weights, n_expert: int, by_rank: bool) -> tuple[int, int]:
    """Twin of traces.synth.kernels.first_bad_routing, from its docstring: the first row no
    reader would accept and the first of its problems (1 id range, 2 repeated id, 3 weight
    negative or not finite, 4 weights increasing), ``(0, -1)`` if none."""
    for r, (row_ids, row_w) in enumerate(zip(ids.tolist(), weights.astype(np.float64).tolist())):
        if any(not 0 <= e < n_expert for e in row_ids):
            return 1, r
        if len(set(row_ids)) < len(row_ids):
            return 2, r
        if any(math.isnan(w) or math.isinf(w) or w < 0 for w in row_w):
            return 3, r
        if by_rank and any(b > a for a, b in zip(row_w, row_w[1:])):
            return 4, r
    return 0, -1
