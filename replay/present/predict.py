"""``predict``'s text: the headline table, the per-layer table and the horizon curve, from a
:class:`replay.analyses.accuracy.PredictResult`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl

from replay.analyses.accuracy import PredictResult, describe
from replay.present.format import rows_of, text_table


def _headline(res: PredictResult) -> str:

    rows = []
    for r in rows_of(res.overall()):
        # a learner scored on the tokens it learned from says so wherever its figures print
        name = f"{r['predictor']} (in-sample)" if r.get("in_sample") else r["predictor"]
        lo, hi = r.get("slot_acc_ci_low"), r.get("slot_acc_ci_high")
        mlo, mhi = r.get("mass_ci_low"), r.get("mass_ci_high")
        rows.append({**r, "predictor": name, "measures": describe(r["predictor"]),
                     "slot_ci": f"{lo:.1f}-{hi:.1f}" if lo is not None and hi is not None else "-",
                     "mass_ci": f"{mlo:.1f}-{mhi:.1f}" if mlo is not None and mhi is not None else "-",
                     "vs_prev": (f"{r['vs_prev_token_pp']:+.1f} ({r['vs_prev_token']})"
                                 if r.get("vs_prev_token_pp") is not None and r.get("vs_prev_token") else "-")})
    cols = ["predictor", "slot_acc_pct", "slot_ci", "whole_acc_pct"]
    heads = ["predictor", "slot acc %", "95% interval", "whole acc %"]
    if res.width != res.k:
        cols += ["recall_pct", "precision_pct"]
        heads += [f"recall@{res.width} %", f"precision@{res.width} %"]
    cols += ["mass_pct", "mass_ci"]
    heads += [f"mass@{res.width} %", "95% interval"]
    if any(r["vs_prev"] != "-" for r in rows):
        cols += ["vs_prev"]
        heads += ["vs prev-token (pts)"]
    cols += ["lead_layers", "unused_mib_per_token"]
    heads += ["lead", "unused MiB/token"]
    if any(r.get("bytes_recall_pct") is not None for r in rows):
        cols += ["bytes_recall_pct"]
        heads += [f"recall@{_num(rows[0].get('byte_budget_mib'))} MiB %"]
    cols += ["scored", "unscored"]
    heads += ["scored", "unscored"]
    lines = text_table(rows, cols, heads, digits=1).splitlines()
    # the description column is left-aligned text, appended after the right-aligned numbers
    notes = ["what it measures", "-" * 16] + [r["measures"] for r in rows]
    return "\n".join(f"{line}  {note}" for line, note in zip(lines, notes))


def _num(v: Any) -> str:
    return "-" if v is None else f"{v:g}"


def _per_layer(res: PredictResult, names: list[str], key: str = "predictor", labels: list[str] | None = None) -> str:

    per = res.per_layer()
    layers = list(res.routings)
    table: dict[int, dict[str, Any]] = {l: {"layer": l, "routings": res.routings[l]} for l in layers}
    for r in per.iter_rows(named=True):
        table[r["layer"]][str(r[key])] = r["slot_acc_pct"]
    labels = labels or names
    return text_table([table[l] for l in layers], ["layer", *names, "routings"], ["layer", *labels, "routings"], digits=1)


def _footer(res: PredictResult) -> list[str]:
    lines = [
        f"slot acc = |top-{res.k} named ∩ routed| / {res.k}; whole acc = the routed set named exactly; "
        f"both over scored {res.phase} routings only.",
        "unscored = routings a predictor could not rank (first token of a turn or request, first d MoE layers, missing "
        "source row, no prompt): counted apart, never as wrong; '-' = nothing scored.",
        f"mass@{res.width} = share of the routed experts' router weight that the top-{res.width} named "
        "(weight mass is not output quality; '-' where the engine exposed no weights).",
    ]
    if res.train_text:
        lines.append(f"training: {res.train_text} ({res.evaluated:,} {res.phase} routings scored); the learners "
                     "(static-hot, pair-table, request-match, mix) never saw a scored token"
                     if not res.in_sample else f"training: {res.train_text}; figures marked (in-sample) have seen "
                     "the answers")
    lines.append("95% interval: seeded block bootstrap over the scored tokens (whole requests when there are at least 8); "
                 "vs prev-token = slot accuracy minus prev-token's on the same resamples (better / worse beyond noise, "
                 "or tie); lead = MoE layers ahead the guess exists; unused MiB/token = expert bytes the top-"
                 f"{res.width} guesses name that were not routed (residency not modelled), per scored token.")
    by_reason: dict[str, list[str]] = {}
    for u in res.unavailable:
        by_reason.setdefault(u["reason"], []).append(u["predictor"])
    lines += [f"unavailable: {', '.join(ps)}: {reason}" for reason, ps in by_reason.items()]
    lines += [f"note: {n}" for n in res.notes]
    return lines


def predict_text(trace_path: Path, trace: Any, res: PredictResult, per_layer: bool) -> str:
    n = sum(res.routings.values())
    wtxt = f"width {res.width} (= top-k)" if res.width == res.k else f"width {res.width} (top-k {res.k})"
    out = [
        f"predict {trace_path}: {trace.model['name']}, {len(trace.moe_layers)} MoE layers x {trace.n_expert} experts, "
        f"top-{res.k}; scored phase {res.phase} ({n:,} routings); {wtxt}",
    ]
    out += res.warnings
    out += ["", _headline(res)] if res.predictors else ["", "no predictor could run on this trace."]
    if per_layer and res.predictors:
        out += ["", f"slot accuracy % per layer ({res.phase} routings; '-' = nothing scored)", _per_layer(res, res.predictors)]
    out += [""] + _footer(res)
    out += res.warnings  # said again at the end: a failing ctrl must not scroll away
    return "\n".join(out)


def curve_text(trace_path: Path, trace: Any, res: PredictResult, per_layer: bool) -> str:

    ov = res.overall().sort("horizon")
    rows = ov.to_dicts()
    prev = None
    for r in rows:
        r["delta"] = None if prev is None or r["slot_acc_pct"] is None or prev is None else r["slot_acc_pct"] - prev
        prev = r["slot_acc_pct"]
    out = [
        f"predict {trace_path}: stale-gate horizon curve d=1..{len(rows)}, {res.phase} routings, "
        f"width {res.width}: how much anticipation costs (d = MoE layers of lead time)",
    ]
    out += res.warnings
    if rows:
        out += ["", text_table(rows, ["horizon", "slot_acc_pct", "whole_acc_pct", "delta", "scored", "unscored"],
                               ["d", "slot acc %", "whole acc %", "slot vs d-1", "scored", "unscored"], digits=1)]
        if per_layer:
            names = [str(d) for d in ov["horizon"].to_list()]
            res2 = PredictResult(res.frame.with_columns(pl.col("horizon").cast(pl.String)), res.predictors,
                                 routings=res.routings)
            out += ["", "slot accuracy % per layer and horizon d ('-' = out of reach: the first d MoE layers)",
                    _per_layer(res2, names, key="horizon", labels=[f"d={d}" for d in names])]
    out += [""] + _footer(res)
    return "\n".join(out)
