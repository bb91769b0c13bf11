"""Slow, obviously-correct twin of replay.predict, written from docs/design.md ("Predictors and
accuracy") with dicts, sets and loops. It recomputes the router selection rule on its own (plain
Python floats, math.exp) and never imports traces.format.gating or replay.

Returns the same rows as ``replay.analyses.accuracy.evaluate(...).frame.to_dicts()``: per predictor, one
row per MoE layer in ``moe_layers`` order, then the overall row (layer None).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

from traces import open_trace

PREFILL, DECODE = 0, 1


def _in_phase(p: int, phase: str) -> bool:
    return phase == "all" or (phase == "decode" and p == DECODE) or (phase == "prefill" and p == PREFILL)


def selection_values(logits: list[float], gating: dict, bias: list[float]) -> list[float]:
    """The values the router ranks: activation, + selection bias, group limiting (masked = -inf)."""
    act = gating.get("activation") or "softmax"
    if act == "softmax_weight":  # gpt-oss: raw logits rank
        vals = list(logits)
    elif act == "sigmoid":
        vals = [1.0 / (1.0 + math.exp(-x)) for x in logits]
    else:
        m = max(logits)
        z = [math.exp(x - m) for x in logits]
        s = sum(z)
        vals = [v / s for v in z]
    if gating.get("selection_bias"):
        vals = [v + b for v, b in zip(vals, bias)]
    n_group = int(gating.get("n_group") or 1)
    if n_group > 1:
        size = len(vals) // n_group
        score = {}
        for g in range(n_group):
            top2 = sorted(vals[g * size:(g + 1) * size], reverse=True)[:2]
            score[g] = top2[0] + top2[1] if len(top2) == 2 else top2[0]
        keep = sorted(range(n_group), key=lambda g: (-score[g], g))[: int(gating.get("topk_group") or 1)]
        vals = [v if e // size in keep else -math.inf for e, v in enumerate(vals)]
    return vals


def ranking(vals: list[float]) -> list[int]:
    """All experts, best first; equal values: lower id first."""
    return sorted(range(len(vals)), key=lambda e: (-vals[e], e))


LEARNERS = ("static-hot", "pair-table", "request-match", "mix", "learned-gate")


def _solve(A: list[list[float]], B: list[list[float]]) -> list[list[float]]:
    """A X = B by Gauss-Jordan elimination with partial pivoting (plain floats)."""
    n = len(A)
    M = [list(A[i]) + list(B[i]) for i in range(n)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(M[r][c]))
        M[c], M[p] = M[p], M[c]
        piv = M[c][c]
        M[c] = [v / piv for v in M[c]]
        for r in range(n):
            if r != c and M[r][c] != 0.0:
                f = M[r][c]
                M[r] = [a - f * b for a, b in zip(M[r], M[c])]
    return [row[n:] for row in M]


def _learns(name: str) -> bool:
    return name.split("[")[0] in LEARNERS


def naive_evaluate(path, names: list[str], width: int | None = None, phase: str = "decode", train: str | None = None,
                   mix: tuple[str, str, float] = ("prev-token", "pair-table[1]", 0.5)) -> list[dict]:
    """``train``: None = the default (the first 50% of each request's tokens of the phase train the
    learners when one is named, else nothing is split), ``"P%"`` the first P%, ``"in-sample"``."""
    t = open_trace(path)
    k, n_expert, moe = t.top_k, t.n_expert, t.moe_layers
    expert_bytes = {l: int(b or 0) for l, b in enumerate(t.meta["expert_bytes"])}
    width = k if width is None else width
    rank_w = max(width, k)
    gate_ok = t.has("gate_input") and t.has_router
    cols = ["turn", "batch", "phase", "step", "layer", "experts", "weights"] + (["gate_input"] if gate_ok else [])
    rows = t.routings(cols + (["request"] if t.has("request") else [])).to_dicts()
    for r in rows:  # docs/design.md: no request column = one request; with one, step is the position in its request
        r.setdefault("request", 0)
    scored_idx = [i for i, r in enumerate(rows) if _in_phase(r["phase"], phase)]
    # The held-out split: per request, its tokens of the phase in (turn, step) order; the first P% train.
    if train is None:
        train = "50%" if any(_learns(n) for n in names) else "none"
    if train in ("none", "in-sample"):
        train_idx, eval_idx = list(scored_idx), list(scored_idx)
    else:
        pct = float(train.rstrip("%"))
        toks: dict[int, set] = defaultdict(set)
        for i in scored_idx:
            toks[rows[i]["request"]].add((rows[i]["turn"], rows[i]["step"]))
        train_tok = set()
        for req, ts in toks.items():
            ordered = sorted(ts)
            for tk in ordered[: int(len(ordered) * pct / 100.0)]:
                train_tok.add((req, *tk))
        train_idx = [i for i in scored_idx if (rows[i]["request"], rows[i]["turn"], rows[i]["step"]) in train_tok]
        eval_idx = [i for i in scored_idx if (rows[i]["request"], rows[i]["turn"], rows[i]["step"]) not in train_tok]

    def token(i: int) -> tuple:
        return (rows[i]["request"], rows[i]["turn"], rows[i]["step"])

    row_of = {(token(i), rows[i]["layer"]): i for i in range(len(rows))}

    router: dict[int, dict[int, tuple[list[float], float, float]]] = defaultdict(dict)
    if gate_ok:
        for r in t.router().to_dicts():  # logit_bias: optional, added to the logits (gpt-oss)
            router[r["layer"]][r["expert"]] = (r["weight"], r["bias"], r.get("logit_bias", 0.0))

    def router_rank(layer: int, g: list[float]) -> list[int]:
        logits = [sum(gv * wv for gv, wv in zip(g, router[layer][e][0])) + router[layer][e][2] for e in range(n_expert)]
        bias = [router[layer][e][1] for e in range(n_expert)]
        return ranking(selection_values(logits, t.gating, bias))[:rank_w]

    def hot(learn: list[int]) -> dict[int, list[int]]:
        counts: dict[int, Counter] = defaultdict(Counter)
        for i in learn:
            counts[rows[i]["layer"]].update(rows[i]["experts"])
        return {l: sorted(range(n_expert), key=lambda e: (-c[e], e))[:rank_w] for l, c in counts.items()}

    def predictions(name: str) -> dict[int, list[int]]:
        pred: dict[int, list[int]] = {}  # row index -> ranked experts; absent = unscored
        if name == "prev-token":
            # "previous" is per request: the previous token of the same request and turn at this layer
            by_turn_layer = defaultdict(list)
            for i in scored_idx:
                by_turn_layer[(rows[i]["request"], rows[i]["turn"], rows[i]["layer"])].append(i)
            for seq in by_turn_layer.values():
                seq.sort(key=lambda i: (rows[i]["step"], i))
                for a, b in zip(seq, seq[1:]):
                    pred[b] = list(rows[a]["experts"])[:rank_w]
        elif name in ("static-hot", "static-hot-prompt"):
            learn = train_idx if name == "static-hot" else [i for i, r in enumerate(rows) if r["phase"] == PREFILL]
            lists = hot(learn)
            for i in scored_idx:
                if rows[i]["layer"] in lists:
                    pred[i] = lists[rows[i]["layer"]]
        elif name.startswith("pair-table["):
            d = int(name[len("pair-table["):-1])
            C: Counter = Counter()
            N: Counter = Counter()
            M: Counter = Counter()
            train_set = set(train_idx)
            for i in train_idx:
                j = moe.index(rows[i]["layer"])
                for e in rows[i]["experts"]:
                    M[(j, e)] += 1
                if j < d:
                    continue
                src = row_of.get((token(i), moe[j - d]))
                if src is None or src not in train_set:
                    continue
                for s_ in rows[src]["experts"]:
                    N[(j, s_)] += 1
                    for t_ in rows[i]["experts"]:
                        C[(j, s_, t_)] += 1
            for i in scored_idx:
                j = moe.index(rows[i]["layer"])
                if j < d or not any(N[(j, e)] for e in range(n_expert)):
                    continue
                src = row_of.get((token(i), moe[j - d]))
                if src is None:
                    continue
                score = {}
                for t_ in range(n_expert):
                    acc = 0.0
                    for s_ in rows[src]["experts"]:
                        acc += (C[(j, s_, t_)] + 1.0) / (N[(j, s_)] + 1.0 * n_expert)
                    score[t_] = acc
                pred[i] = sorted(range(n_expert), key=lambda e: (-score[e], -M[(j, e)], e))[:rank_w]
        elif name == "request-match":
            mats: dict[int, Counter] = defaultdict(Counter)
            for i in train_idx:
                for e in rows[i]["experts"]:
                    mats[rows[i]["request"]][(rows[i]["layer"], e)] += 1
            for i in scored_idx:
                cur: Counter = Counter()
                for r in rows:  # every routing of this request before this token, any phase
                    if r["request"] == rows[i]["request"] and (r["turn"], r["step"]) < (rows[i]["turn"], rows[i]["step"]):
                        for e in r["experts"]:
                            cur[(r["layer"], e)] += 1
                ncur = sum(v * v for v in cur.values())
                if ncur == 0:
                    continue
                best, best_sim = None, None
                for g in sorted(mats):
                    if g == rows[i]["request"]:
                        continue  # never matched to itself
                    ng = sum(v * v for v in mats[g].values())
                    if ng == 0:
                        continue
                    dot = sum(v * mats[g][key] for key, v in cur.items())
                    sim = dot / math.sqrt(float(ncur) * float(ng))
                    if best_sim is None or sim > best_sim:
                        best, best_sim = g, sim
                if best is None:
                    continue
                counts = {e: mats[best][(rows[i]["layer"], e)] for e in range(n_expert)}
                if sum(counts.values()) == 0:
                    continue
                pred[i] = sorted(range(n_expert), key=lambda e: (-counts[e], e))[:rank_w]
        elif name == "mix":
            a_name, b_name, w = mix
            pa, pb = predictions(a_name), predictions(b_name)
            for i in scored_idx:
                if i not in pa and i not in pb:
                    continue
                score = defaultdict(float)
                ba: dict[int, int] = {}
                bb: dict[int, int] = {}
                for j, e in enumerate(pa.get(i, [])[:k]):
                    if e != -1:
                        score[e] += w / (1 + j)
                        ba.setdefault(e, j)
                for j, e in enumerate(pb.get(i, [])[:k]):
                    if e != -1:
                        score[e] += (1.0 - w) / (1 + j)
                        bb.setdefault(e, j)
                named = [e for e in range(n_expert) if score[e] > 0]
                if not named:
                    continue
                named.sort(key=lambda e: (-score[e], ba.get(e, rank_w), bb.get(e, rank_w), e))
                pred[i] = named[:rank_w]
        elif name.startswith("learned-gate["):
            # ridge regression of layer l's own logits on [gate input at l-d, 1] over the training
            # tokens; lambda = 1e-6 x the mean of the normal matrix's diagonal
            if not gate_ok:
                return pred
            d = int(name[len("learned-gate["):-1])
            train_set = set(train_idx)

            def logits_of(layer: int, g: list[float]) -> list[float]:
                return [sum(gv * wv for gv, wv in zip(g, router[layer][e][0])) + router[layer][e][2] for e in range(n_expert)]

            coef = {}
            for j in range(d, len(moe)):
                X, Y = [], []
                for i in train_idx:
                    if rows[i]["layer"] != moe[j]:
                        continue
                    src = row_of.get((token(i), moe[j - d]))
                    if src is None or src not in train_set:
                        continue
                    X.append([float(v) for v in rows[src]["gate_input"]] + [1.0])
                    Y.append(logits_of(moe[j], [float(v) for v in rows[i]["gate_input"]]))
                if not X:
                    continue
                m = len(X[0])
                G = [[sum(x[a] * x[b] for x in X) for b in range(m)] for a in range(m)]
                lam = 1e-6 * sum(G[a][a] for a in range(m)) / m
                for a in range(m):
                    G[a][a] += lam
                XY = [[sum(x[a] * y[e] for x, y in zip(X, Y)) for e in range(n_expert)] for a in range(m)]
                coef[j] = _solve(G, XY)
            for i in scored_idx:
                j = moe.index(rows[i]["layer"])
                if j < d or j not in coef:
                    continue
                src = row_of.get((token(i), moe[j - d]))
                if src is None:
                    continue
                x = [float(v) for v in rows[src]["gate_input"]] + [1.0]
                lg = [sum(x[a] * coef[j][a][e] for a in range(len(x))) for e in range(n_expert)]
                bias = [router[rows[i]["layer"]][e][1] for e in range(n_expert)]
                pred[i] = ranking(selection_values(lg, t.gating, bias))[:rank_w]
        elif name == "ctrl" or name.startswith("stale-gate["):
            if not gate_ok:
                return pred
            d = 0 if name == "ctrl" else int(name[len("stale-gate["):-1])
            by_key = {(r["batch"], r["request"], r["step"], r["layer"]): i for i, r in enumerate(rows)}
            for i in scored_idx:
                r = rows[i]
                pos = moe.index(r["layer"])
                if pos - d < 0:
                    continue  # out of reach: the first d MoE layers
                src = by_key.get((r["batch"], r["request"], r["step"], moe[pos - d]))
                if src is None:
                    continue  # the trace lacks the source row
                pred[i] = router_rank(r["layer"], rows[src]["gate_input"])
        else:
            raise ValueError(name)
        return pred

    out = []
    for name in names:
        if name in ("ctrl",) or name.startswith(("stale-gate[", "learned-gate[")):
            if not gate_ok:
                continue
        pred = predictions(name)
        acc = {l: defaultdict(float) for l in [*moe, None]}
        for i in eval_idx:
            r = rows[i]
            for key in (r["layer"], None):
                a = acc[key]
                if i not in pred:
                    a["unscored"] += 1
                    continue
                routed = list(r["experts"])
                top_k = [e for e in pred[i][:k] if e != -1]
                top_w = [e for e in pred[i][:width] if e != -1]
                a["scored"] += 1
                a["hits_k"] += len(set(top_k) & set(routed))
                a["exact"] += 1 if set(top_k) == set(routed) else 0
                a["hits_w"] += len(set(top_w) & set(routed))
                a["named_w"] += len(top_w)
                a["unused_bytes"] += (len(top_w) - len(set(top_w) & set(routed))) * expert_bytes[r["layer"]]
                a.setdefault("tokens", set()).add(token(i))
                ws = list(r["weights"])
                if not any(math.isnan(w) for w in ws):
                    mn = mt = 0.0
                    for e, w in zip(routed, ws):
                        mt += w
                        if e in top_w:
                            mn += w
                    a["mass_named"] += mn
                    a["mass_total"] += mt
                    a["mass_scored"] += 1

        def pct(num, den):
            return None if den == 0 else 100.0 * num / den

        for l in [*moe, None]:
            a = acc[l]
            n = int(a["scored"])
            out.append({
                "predictor": name, "layer": l, "phase": phase, "width": width,
                "slot_acc_pct": pct(int(a["hits_k"]), k * n),
                "whole_acc_pct": pct(int(a["exact"]), n),
                "recall_pct": pct(int(a["hits_w"]), k * n),
                "precision_pct": pct(int(a["hits_w"]), int(a["named_w"])),
                "mass_pct": pct(a["mass_named"], a["mass_total"]) if a["mass_scored"] else None,
                "scored": n, "unscored": int(a["unscored"]), "mass_scored": int(a["mass_scored"]),
                # the prefetch scores (overall rows only): lead, bytes named in vain, the protocol
                "lead_layers": None if l is not None else lead(name),
                "unused_mib_per_token": (None if l is not None or not a.get("tokens") else
                                         a["unused_bytes"] / (1 << 20) / len(a["tokens"])),
                "train": None if l is not None else train,
                "in_sample": (None if l is not None else train == "in-sample" if _learns(name)
                              # the prompt list scored on prompt routings has seen them
                              else True if name == "static-hot-prompt" and phase != "decode" else None),
            })
    return out


def lead(name: str) -> int | None:
    """MoE layers ahead the guess exists: d for the depth-d predictors, none for the ctrl check, else 1."""
    if name == "ctrl":
        return None
    if name.startswith(("stale-gate[", "pair-table[", "learned-gate[")):
        return int(name.split("[")[1][:-1])
    return 1
