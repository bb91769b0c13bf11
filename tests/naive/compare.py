"""Slow, obviously-correct twin of replay.compare for comparable traces of softmax routers (the
margin in raw logits), written from the verb's contract with dicts, sets and loops.

Returns the rows of ``replay.analyses.trace_compare.compare(...).per_layer.to_dicts()``: one per MoE layer that
has compared routings, in layer order, then the overall row (layer None).
"""

from __future__ import annotations

from traces import open_trace


def _rows(path) -> dict[tuple[int, int, int, int], dict]:
    t = open_trace(path)
    cols = ["turn", "step", "layer", "experts", "weights"] + (["logits"] if t.has("logits") else [])
    cols += ["request"] if t.has("request") else []
    out = {}
    for r in t.routings(cols).to_dicts():
        key = (r.get("request", 0), r["turn"], r["step"], r["layer"])
        out[key] = {"experts": list(r["experts"]), "weights": list(r["weights"]), "logits": r.get("logits")}
    return out


def compare_naive(path_a, path_b, tol: float) -> list[dict]:
    ra, rb = _rows(path_a), _rows(path_b)
    assert ra.keys() == rb.keys(), "the twin handles comparable traces only"
    per: dict[int | None, dict] = {}
    for key in sorted(ra):
        a, b = ra[key], rb[key]
        for layer in (key[3], None):
            s = per.setdefault(layer, {"n": 0, "set": 0, "top1": 0, "dis": 0, "exp": 0, "w": [], "l": []})
            s["n"] += 1
            same = set(a["experts"]) == set(b["experts"])
            s["set"] += same
            s["top1"] += a["experts"][0] == b["experts"][0]
            if same and not any(w != w for w in a["weights"] + b["weights"]):  # NaN != NaN
                wa = dict(zip(a["experts"], a["weights"]))
                wb = dict(zip(b["experts"], b["weights"]))
                s["w"] += [abs(wa[e] - wb[e]) for e in wa]
            if a["logits"] is not None and b["logits"] is not None:
                s["l"] += [abs(x - y) for x, y in zip(a["logits"], b["logits"])]
            if not same:
                s["dis"] += 1
                swapped = set(a["experts"]) ^ set(b["experts"])
                margins = [max(lg[e] for e in swapped) - min(lg[e] for e in swapped)
                           for lg in (a["logits"], b["logits"]) if lg is not None]
                s["exp"] += bool(margins) and max(margins) < tol
    rows = []
    for layer in [*sorted(k for k in per if k is not None), None]:
        s = per[layer]
        rows.append({
            "layer": layer, "routings": s["n"], "set_agree_pct": 100.0 * s["set"] / s["n"],
            "top1_agree_pct": 100.0 * s["top1"] / s["n"], "disagreements": s["dis"], "explained": s["exp"],
            "unexplained": s["dis"] - s["exp"],
            "weight_max_abs_diff": max(s["w"]) if s["w"] else None,
            "weight_mean_abs_diff": sum(s["w"]) / len(s["w"]) if s["w"] else None,
            "logit_max_abs_diff": max(s["l"]) if s["l"] else None,
            "logit_mean_abs_diff": sum(s["l"]) / len(s["l"]) if s["l"] else None,
        })
    return rows
