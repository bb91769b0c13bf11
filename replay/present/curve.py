"""``curve``'s text: the budget answer (plateau, knees, the cliff below T, doublings) and the curve
read at a readable set of budgets, from :func:`replay.api.curve_run`'s result."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from replay.present.format import exact, fmt, text_table

OVER = " !"


def in_force(rows: list[dict[str, Any]], b_mib: float) -> dict[str, Any] | None:
    """The row in force at ``b_mib``: the last change point at or below it (the curve is flat between)."""
    best = None
    for r in rows:
        if r["budget_mib"] <= b_mib:
            best = r
    return best


def answer_lines(a: dict[str, Any]) -> list[str]:
    """The budget answer in sentences (decode-only hit % when the trace decodes)."""
    if a.get("metric") is None:
        return ["budget answer: the trace has no lookups."]
    what = "decode-only hit %" if a["metric"] == "hit_pct_decode" else "cumulative hit %"
    out = [f"budget answer ({a['policy']}, {what}):",
           f"  plateau   {a['plateau_pct']:.1f}% at the working set W = {a['w_mib']:.1f} MiB (only first visits miss)"]
    for k in a["knees"]:
        if k["budget_mib"] is None:
            out.append(f"  knee      none within {k['tolerance_pp']:g} pp of the plateau inside the budget")
        else:
            out.append(f"  knee      {k['budget_mib']:.1f} MiB: the smallest budget within {k['tolerance_pp']:g} pp of the "
                       f"plateau ({k['hit_pct']:.1f}%)")
    out.append(f"  cliff     {a['below_t_pct']:.1f}% just below one token's working set T = {a['t_mib']:.1f} MiB, "
               f"{a['at_t_pct']:.1f}% at T (below T a token's own layers evict each other)")
    if a["doublings"]:
        steps = "; ".join(f"{d['from_mib']:.0f} -> {d['to_mib']:.0f} MiB {d['gain_pp']:+.1f} pp"
                          + (" (over budget)" if d["over_budget"] else "") for d in a["doublings"])
        out.append(f"  doubling  {steps}")
    return out


def _count(policy: str, n: int) -> str:
    where = "--budgets" if policy == "layer-opt" else "where it changes, plus --budgets"
    return f"{policy}: {n} budget{'s' if n != 1 else ''} ({where})"


def curve_text(t: Any, res: Any, policies: list[str]) -> str:
    frame = res.frame
    rows = frame.to_dicts() if frame.height else []
    by = {p: sorted((r for r in rows if r["policy"] == p), key=lambda r: r["budget_mib"]) for p in policies}
    T, W = res.token_cycle_bytes / 2**20, res.working_set_bytes / 2**20
    counts = t.token_counts()
    lines = [
        f"trace    {t.path} ({t.model.get('name')}, {len(t.moe_layers)} MoE layers x {t.n_expert} experts, top-{t.top_k}; "
        f"{counts['tokens_prefill']} prefill + {counts['tokens_decode']} decode tokens)",
        f"T        one token cycle = {T:.1f} MiB; working set W = {W:.1f} MiB",
        "curve    " + "; ".join(_count(p, len(by[p])) for p in policies)
        + "; every figure equals a replay at that budget" + (" (lru sampled: estimates)" if res.sample_rate else ""),
        "",
        *answer_lines(res.answer),
        "",
    ]
    # A readable set of budgets: T/4 .. W by doubling, the knees and the requested budgets.
    marks: dict[float, str] = {}
    b = T / 4
    while T > 0 and b < W:
        marks.setdefault(b, "")
        b *= 2
    marks[W] = "W"
    for k in res.answer.get("knees", []):
        if k["budget_mib"] is not None:
            marks[k["budget_mib"]] = (marks.get(k["budget_mib"], "") + f" knee {k['tolerance_pp']:g}pp").strip()
    for bm in sorted({r["budget_mib"] for r in rows if r["requested"]}):
        marks[bm] = (marks.get(bm, "") + " asked").strip()
    for m in list(marks):
        if abs(m - T) < 1e-9:
            marks[m] = ("T " + marks[m]).strip()
    timed = "ms_per_token" in frame.columns
    table = []
    any_over = False
    for bm in sorted(marks):
        row: dict[str, Any] = {"budget": exact(round(bm, 1)) if not math.isclose(bm, round(bm, 1)) else exact(bm),
                               "mark": marks[bm]}
        for p in policies:
            r = in_force(by[p], bm) if p != "layer-opt" else next((x for x in by[p] if x["budget_mib"] == bm), None)
            if r is None:
                row[f"{p}_dec"] = row[f"{p}_cum"] = row[f"{p}_read"] = "-"
                row[f"{p}_ms"] = "-"
                continue
            o = OVER if r["over_budget"] else ""
            any_over |= bool(o)
            row[f"{p}_dec"] = fmt(r["hit_pct_decode"], 1) + o
            row[f"{p}_cum"] = fmt(r["hit_pct_cum"], 1) + o
            row[f"{p}_read"] = fmt(r["read_mib"], 1)
            row[f"{p}_ms"] = fmt(r.get("ms_per_token"), 1) if timed else "-"
        table.append(row)
    cols, heads = ["budget", "mark"], ["budget_mib", ""]
    for p in policies:
        cols += [f"{p}_dec", f"{p}_cum", f"{p}_read"] + ([f"{p}_ms"] if timed else [])
        heads += [f"{p} dec %", f"{p} cum %", f"{p} MiB read"] + ([f"{p} ms/tok"] if timed else [])
    lines.append("\n".join(line.rstrip() for line in text_table(table, cols, heads).splitlines()))
    lines.append("")
    lines.append("dec % = decode-only hit %; cum % = cumulative (prefill included); MiB read = all phases. Each budget reads "
                 "the curve's row in force there (the curve is flat between change points); --json or -o has every row.")
    if any_over:
        lines.append("! over budget: a load held more than the budget (or its layer's share), so that hit rate needs more "
                     "memory than the budget it is listed under.")
    if "layer" in policies:
        lines.append("layer = the budget split equally over the MoE layers (each layer's own curve: --json per_layer); "
                     "layer-opt = the best per-layer split, at --budgets only.")
    lines += [f"note: {n}" for n in res.notes]
    return "\n".join(lines)


def sweep_answer_lines(rows: list[dict[str, Any]], cache_grid: bool) -> list[str]:
    """``sweep-report``'s budget answer (:func:`replay.analyses.sweeps.sweep_budget_answer`'s rows):
    per [curve] cell the plateau, knees, cliff and doublings; per [cache] policy with enough tested
    budgets where the tested budgets' hit rate bends (between the tested budget below and the knee)."""
    out: list[str] = []
    tols = sorted({k[len("knee_"):-len("pp_mib")] for r in rows for k in r if k.startswith("knee_") and k.endswith("pp_mib")},
                  key=lambda x: float(x.replace("_", ".")))
    for r in rows:
        what = "decode-only hit %" if r["metric"] == "hit_pct_decode" else "cumulative hit %"
        extra = "".join(f", {k.removeprefix('cell_')} {Path(str(r[k])).name if k == 'cell_cost_model' else r[k]}"
                        for k in ("cell_cost_model", "cell_sample_rate") if r.get(k) is not None)
        if r["source"] == "curve":
            out.append(f"{r['trace']}: {r['policy']} curve ({r['budgets']} change points{extra}; {what})")
            w = "" if r.get("w_mib") is None else f" (the working set W = {r['w_mib']:.1f} MiB)"
            out.append(f"  plateau   {r['plateau_pct']:.1f}% from {r['plateau_at_mib']:.1f} MiB{w}")
        else:
            out.append(f"{r['trace']}: {r['policy']} at the {r['budgets']} tested budgets{extra} ({what})")
            out.append(f"  best      {r['plateau_pct']:.1f}% tested"
                       + ("" if r.get("plateau_reached") else " (below the plateau: the grid stops short of W)"
                          if r.get("plateau_reached") is False else ""))
        for tol in tols:
            b, h = r.get(f"knee_{tol}pp_mib"), r.get(f"knee_{tol}pp_hit_pct")
            tl = tol.replace("_", ".")
            if b is None:
                out.append(f"  knee      none within {tl} pp inside the budget")
            elif r["source"] == "curve":
                out.append(f"  knee      {b:.1f} MiB: the smallest budget within {tl} pp of the plateau ({h:.1f}%)")
            else:
                after = r.get(f"knee_{tol}pp_after_mib")
                where = (f"between {exact(after)} and {exact(b)} MiB (the grid tested nothing in between)" if after is not None
                         else f"at or below {exact(b)} MiB, the smallest tested budget")
                out.append(f"  bend      {where}: {exact(b)} MiB is within {tl} pp of the best tested ({h:.1f}%)")
        if r["source"] == "curve" and r.get("below_t_pct") is not None:
            out.append(f"  cliff     {r['below_t_pct']:.1f}% just below one token's working set T = {r['t_mib']:.1f} MiB, "
                       f"{r['at_t_pct']:.1f}% at T")
        if r["steps"]:
            fm = (lambda x: f"{x:.0f}") if r["source"] == "curve" else exact
            label = "doubling " if r["source"] == "curve" else "steps    "
            out.append(f"  {label} " + "; ".join(f"{fm(d['from_mib'])} -> {fm(d['to_mib'])} MiB {d['gain_pp']:+.1f} pp"
                                                 + (" (over budget)" if d["over_budget"] else "") for d in r["steps"]))
        if r.get("note"):
            out.append(f"  note      {r['note']}")
    if cache_grid and not any(r["source"] == "cache" for r in rows):
        from replay.analyses.sweeps import BEND_MIN_BUDGETS

        out.append(f"cache grid: fewer than {BEND_MIN_BUDGETS} budgets per policy, too few to say where the hit rate bends "
                   "(moe-replay curve gives every budget).")
    return out
