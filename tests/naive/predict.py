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


def naive_evaluate(path, names: list[str], width: int | None = None, phase: str = "decode") -> list[dict]:
    t = open_trace(path)
    k, n_expert, moe = t.top_k, t.n_expert, t.moe_layers
    width = k if width is None else width
    rank_w = max(width, k)
    gate_ok = t.has("gate_input") and t.has_router
    cols = ["turn", "batch", "phase", "step", "layer", "experts", "weights"] + (["gate_input"] if gate_ok else [])
    rows = t.routings(cols + (["request"] if t.has("request") else [])).to_dicts()
    for r in rows:  # docs/design.md: no request column = one request; with one, step is the position in its request
        r.setdefault("request", 0)
    scored_idx = [i for i, r in enumerate(rows) if _in_phase(r["phase"], phase)]

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

    out = []
    for name in names:
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
            learn = scored_idx if name == "static-hot" else [i for i, r in enumerate(rows) if r["phase"] == PREFILL]
            lists = hot(learn)
            for i in scored_idx:
                if rows[i]["layer"] in lists:
                    pred[i] = lists[rows[i]["layer"]]
        elif name == "ctrl" or name.startswith("stale-gate["):
            if not gate_ok:
                continue
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

        acc = {l: defaultdict(float) for l in [*moe, None]}
        for i in scored_idx:
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
            })
    return out
