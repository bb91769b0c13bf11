"""Which budget? The verdict's first question, answered from the cache sweep's own cells.

For each tested budget, the best within-budget online policy (the one rule,
:func:`replay.analyses.paired.decide`: highest decode hit %, or lowest ms per decoded token when a
cost model is present) is compared with the best at the *largest* tested budget by the paired block
bootstrap over decoded tokens (:mod:`replay.analyses.paired`; the same tokens replayed at two
budgets are paired like two policies at one). The answer is the smallest tested budget that is
within noise of the largest (its interval includes zero, or it is better) *and* every larger
tested budget is too: a lone small budget that ties by chance below a worse one is not the answer.

"What each doubling buys": the tested budgets chained down from the largest by halving (each step
to the largest tested budget at most about half the one above), and per step the best's gain with
its interval. The sweep's budgets are geometric but not powers of two: each step says its ratio.
"""

from __future__ import annotations

import math
from typing import Any

from replay.analyses.paired import DecodeSeries, call, decide, diff_hit_pp, diff_per_token

HALF = 0.5 * 1.05  # a step counts as a doubling up to 5% short of one (the budgets are rounded to 2 figures)


def _f(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else float(v)


def _doubling_chain(budgets: list[float]) -> list[tuple[float, float]]:
    """(smaller, larger) steps, ascending, from the largest budget down by halving."""
    steps = []
    cur = budgets[-1]
    while True:
        below = [b for b in budgets if b <= cur * HALF]
        if not below:
            break
        steps.append((below[-1], cur))
        cur = below[-1]
    return steps[::-1]


def which_budget(cells: list[dict[str, Any]], series: dict[tuple[str, float], DecodeSeries],
                 model: Any = None) -> dict[str, Any] | None:
    """The budget answer from annotated overall cache cells (:func:`replay.analyses.paired.annotate`)
    and their decode series: ``budget_mib`` (the chosen budget), ``largest_mib``, ``measure``
    (``hit_pct_decode`` or ``ms_per_token``), ``policy`` (the best at the chosen budget, its
    ``policy_text`` and ``tied_with`` by the one rule), ``largest_policy``, ``delta`` / ``ci_low`` /
    ``ci_high`` (chosen minus largest: decode hit points, or ms per decoded token) and
    ``vs_largest`` (better | worse | tie), and ``doublings`` (one dict per step: ``from_mib``,
    ``to_mib``, ``delta`` / ``ci_low`` / ``ci_high``, the larger budget's best minus the smaller's,
    and ``call``), and ``by_budget`` (every tested budget's best against the largest's: ``budget_mib``,
    ``policy``, ``value``, ``delta``, ``ci_low``, ``ci_high``, ``call``: the section's evidence). None
    with fewer than two budgets where some online policy stays within budget."""
    timed = model is not None
    value = "ms_per_token" if timed else "hit_pct_decode"
    overall = [r for r in cells if r.get("layer") is None]
    best: dict[float, dict[str, Any]] = {}
    for b in sorted({r["budget_mib"] for r in overall}):
        d = decide([r for r in overall if r["budget_mib"] == b], value)
        if d is not None and (d["policy"], b) in series and d["best"].get(value) is not None:
            best[b] = d
    budgets = sorted(best)
    if len(budgets) < 2:
        return None
    slopes = dict(ms_per_mib=model.ms_per_mib, ms_per_miss=model.ms_per_miss) if timed else {}

    def diff(a: float, b: float) -> Any:  # the best at a minus the best at b
        sa, sb = series[(best[a]["policy"], a)], series[(best[b]["policy"], b)]
        return diff_per_token(sa, sb, **slopes) if timed else diff_hit_pp(sa, sb)

    top = budgets[-1]
    vs_top = {b: diff(b, top) for b in budgets[:-1]}
    calls = {b: call(d, higher_is_better=not timed) for b, d in vs_top.items()}
    chosen = top
    for b in reversed(budgets[:-1]):  # down from the largest while every budget stays within noise of it
        if calls[b] not in ("tie", "better"):
            break
        chosen = b
    d = vs_top.get(chosen)
    steps = []
    for lo, hi in _doubling_chain(budgets):
        s = diff(hi, lo)
        steps.append({"from_mib": lo, "to_mib": hi, "delta": _f(s.delta), "ci_low": _f(s.low), "ci_high": _f(s.high),
                      "call": call(s, higher_is_better=not timed)})
    dec = best[chosen]
    by_budget = [{"budget_mib": b, "policy": best[b]["policy"], "value": best[b]["best"][value],
                  "delta": _f(vs_top[b].delta) if b in vs_top else 0.0, "ci_low": _f(vs_top[b].low) if b in vs_top else None,
                  "ci_high": _f(vs_top[b].high) if b in vs_top else None, "call": calls.get(b)} for b in budgets]
    return {"kind": "budget", "budget_mib": chosen, "largest_mib": top, "budgets_tested": len(budgets), "measure": value,
            "policy": dec["policy"], "policy_text": dec["text"], "tied_with": dec["tied"],
            "largest_policy": best[top]["policy"], "value": dec["best"][value], "largest_value": best[top]["best"][value],
            "delta": None if d is None else _f(d.delta), "ci_low": None if d is None else _f(d.low),
            "ci_high": None if d is None else _f(d.high), "vs_largest": calls.get(chosen), "doublings": steps,
            "by_budget": by_budget}
