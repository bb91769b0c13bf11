"""``cost``'s text: a fitted model described, the device check table, and which cache
configuration wins on time (``cache --cost-model``, the report)."""

from __future__ import annotations

import math
from typing import Any

from replay.present.format import exact, fmt_q, text_table

# Marks on a time figure (docs/design.md, "Cost model"): the cell's read volume per token lies
# outside the fitted tokens' (extrapolated), or the model was fitted on another model or device.
EXTRAPOLATED = "^"
FOREIGN = "~"
EXTRAPOLATED_LEGEND = (f"{EXTRAPOLATED} = extrapolated: the read volume per token lies outside the volumes the cost model "
                       "was fitted on, where no token was measured")


def foreign_legend(where: str = "") -> str:
    return (f"{FOREIGN} = FOREIGN cost model{(' ' + where) if where else ''}: fitted on another model or device (or it records "
            "no origin), applied with --foreign-cost-model; its times are that device's, not a measurement of this trace")


def time_marks(r: dict[str, Any]) -> str:
    """The marks a row's time figures carry: ^ (extrapolated), ~ (foreign model)."""
    return (EXTRAPOLATED if r.get("extrapolated") else "") + (FOREIGN if r.get("cost_model_foreign") else "")


def check_text(rows: list[dict], model) -> str:
    """The check table: like with like only (the error columns are blank where the replayed budget is
    not the one the device ran at), with each error named by what it is."""

    cols = ["model", "budget_mib", "recorded_tok_s", "predicted_tok_s", "tok_s_err_pct", "token_mape_pct"]
    heads = ["model", "budget_mib", "recorded tok/s", "predicted tok/s", "run-mean error %", "per-token MAPE %"]
    if any("heldout_run_mean_err_pct" in r for r in rows):
        cols += ["heldout_run_mean_err_pct", "heldout_mape_pct"]
        heads += ["held-out run-mean error %", "held-out per-token MAPE %"]
    if any(r.get("cost_model_foreign") for r in rows):
        heads = [h + (f" {FOREIGN}" if c == "predicted_tok_s" else "") for c, h in zip(cols, heads)]
    lines = [text_table(rows, cols, heads)]
    if any(r.get("cost_model_foreign") for r in rows):
        lines.append(foreign_legend())
    compared = [r for r in rows if r["compared"]]
    if compared:
        lines.append("predicted = LRU replay at the recorded budget -> the replay's own expert bytes per decoded token -> "
                     "cost model; recorded = the engine's wall time per decoded token (decode only). run-mean error = "
                     "predicted against recorded tok/s over the run; per-token MAPE = mean |error| of single tokens.")
    for r in rows:
        if not r["compared"]:
            lines.append(f"{r['model']} at {exact(r['budget_mib'])} MiB: prediction only, no error: {r['not_compared_why']} "
                         + (f"(recorded {fmt_q(r['recorded_tok_s_at_recorded_budget'], 'tok_s')} tok/s there)."
                            if r["recorded_budget_mib"] is not None else "."))
    if model is None:
        if compared:
            lines.append("model fitted on each trace's first half of decoded tokens: the run-mean error and MAPE over all "
                         "tokens are half in-sample; the held-out columns are the second half only.")
    else:
        scopes = sorted({r["error_scope"] for r in compared})
        for sc in scopes:
            if sc.startswith("in-sample"):
                lines.append("IN-SAMPLE: the given model was fitted on this same run, so its run-mean error is 0 by "
                             "construction (least squares with an intercept), not a measure of accuracy; its own held-out "
                             f"figures from 'cost fit': run-mean error {_pct_or_dash(compared[0]['model_heldout_run_mean_err_pct'])}, "
                             f"per-token MAPE {_mape_or_dash(compared[0]['model_heldout_mape_pct'])}.")
            else:
                lines.append(f"errors are {sc}.")
    return "\n".join(lines)


def _mape_or_dash(v) -> str:

    return "-" if v is None else f"{fmt_q(v, 'pct')}%"


def _pct_or_dash(v) -> str:

    return "-" if v is None else f"{'+' if v >= 0 else ''}{fmt_q(v, 'pct')}%"


def _describe(path: str, best, cands) -> str:

    bw = best.bandwidth_mib_s
    lines = [
        f"{path}: {best.model}",
        f"  intercept {fmt_q(best.intercept_ms, 'ms')} ms/token, slope {fmt_q(best.ms_per_mib, 'ms_per_mib')} ms/MiB"
        + (f", {fmt_q(best.ms_per_miss, 'ms_per_miss')} ms/miss" if best.terms == "bytes+misses" else "")
        + (f" (effective bandwidth {fmt_q(bw, 'mib_s')} MiB/s)" if bw else " (no positive bandwidth implied)"),
        f"  r2 {fmt_q(best.r2, 'r2')} on all {best.tokens_fit + best.tokens_heldout} decoded tokens (the coefficients are "
        "fitted on all of them)",
        f"  held out (fit on the first {best.tokens_fit}, tested on the last {best.tokens_heldout}): per-token MAPE "
        f"{fmt_q(best.heldout_mape_pct, 'pct')}%, run-mean error {_pct_or_dash(best.heldout_run_mean_err_pct)} "
        "(predicted against recorded tok/s)",
    ]
    others = [c for c in cands if c is not best]
    for c in others:
        lines.append(f"  not chosen: {c.terms} (held-out per-token MAPE {fmt_q(c.heldout_mape_pct, 'pct')}%; a richer model "
                     "must cut it by >5%)")
    lines += [f"  note: {n}" for n in best.notes]
    lines.append("  measures: decode-phase ms per token from expert bytes read; prefill is not modelled")
    lines.append(f"  fit provenance: {best.fit_trace_id} ({best.fit_tokens}); 'cost check' on this same run is in-sample")
    return "\n".join(lines)


def verdict(rows: list[dict[str, Any]]) -> list[str]:
    """Which online configuration wins on time, and whether that is the one that wins on hits.

    Only within-budget cells compete (:func:`replay.core.simulate.within_budget`): an over-budget cell's
    time needs more memory than its budget, so it is named as left out, never picked. Ties go the
    way :func:`replay.core.simulate.pick_best` breaks them (the CLI and the report alike)."""
    from replay.analyses.cost_model import BOUNDS
    from replay.analyses.paired import decide, tied_text
    from replay.core.simulate import pick_best, within_budget

    online = [r for r in rows if r.get("layer") is None and r["policy"] not in BOUNDS and r.get("ms_per_token") is not None]
    if not online:
        return []
    best = []
    left_out = []
    for b in sorted({r["budget_mib"] for r in online}):
        ok, over = within_budget([r for r in online if r["budget_mib"] == b])
        left_out += over
        dec = decide(ok, "ms_per_token")  # the one rule (replay.analyses.paired): pick_best, then the paired interval vs LRU
        if dec is None:
            best.append(f"{exact(b)} MiB: none within budget")
            continue
        r = dec["best"]
        ci = r.get("ms_per_token_ci95")
        ci_txt = f" +/- {ci:.1f}" if ci is not None and math.isfinite(ci) else ""
        mk = time_marks(r)
        parts = ([dec["text"]] if dec["call"] is not None else []) + ([tied_text(dec).removeprefix("; ")] if dec["tied"] else [])
        paired = f" [{'; '.join(parts)}]" if parts else ""
        best.append(f"{exact(b)} MiB: {r['policy']} {r['ms_per_token']:.1f}{ci_txt} ms{mk} ({r['tok_s']:.2f} tok/s{mk}){paired}")
    named = ["belady", "infinite"] + sorted({r["policy"] for r in rows if r["policy"] in BOUNDS} - {"belady", "infinite"})
    out = [f"fastest online policy per budget (decode, estimated; {'/'.join(named)} are bounds, not candidates"
           + ("; over-budget cells left out" if left_out else "") + "): " + "; ".join(best)]
    if left_out:
        out.append("left out as over budget (the cache overflowed: the figure needs more memory than the budget): "
                   + "; ".join(f"{r['policy']} at {exact(r['budget_mib'])} MiB" + (f" (peak {r['peak_resident_mib']:.1f} MiB)"
                                                                          if r.get("peak_resident_mib") is not None else "")
                               for r in left_out))
    for b in sorted({r["budget_mib"] for r in online}):
        at, _ = within_budget([r for r in online if r["budget_mib"] == b])
        by_time = pick_best(at, "ms_per_token", highest=False)
        by_hits = pick_best(at, "hit_pct_decode", highest=True)
        if by_time is None or by_hits is None:
            continue
        if by_time["policy"] != by_hits["policy"] and by_hits.get("tied_with_fastest"):  # within noise (replay.analyses.paired)
            out.append(f"at {exact(b)} MiB, {by_hits['policy']} hits most and {by_time['policy']} is fastest, but they tie on "
                       "time within noise")
        elif by_time["policy"] != by_hits["policy"] and by_time["ms_per_token"] < by_hits["ms_per_token"]:
            out.append(f"at {exact(b)} MiB, {by_hits['policy']} hits most ({by_hits['hit_pct_decode']:.1f}% decode) but "
                       f"{by_time['policy']} is faster ({by_time['ms_per_token']:.1f} vs {by_hits['ms_per_token']:.1f} ms/token): "
                       "it reads fewer bytes per token (expert sizes differ by layer)")
    out.append("time estimates see bytes read (and misses, if the model has that term), not compute, thermal state or page "
               "faults; the +/- is a 95% prediction interval from the fit (residuals and coefficients: wider away from the "
               "fitted read volumes; none for a manual model), not run-to-run drift")
    if any(r.get("extrapolated") for r in online):
        out.append(EXTRAPOLATED_LEGEND)
    if any(r.get("cost_model_foreign") for r in online):
        out.append(foreign_legend())
    if any(r.get("vs_lru_time") is not None for r in online):
        out.append("against LRU: the difference in ms/token on the same tokens, with a 95% interval from a seeded paired "
                   "block bootstrap over decoded tokens (docs/design.md, 'Paired comparisons'); a policy is called faster "
                   "only when the interval excludes zero, else a tie within noise")
    return out


def timeline_fit_text(r: dict) -> str:
    """``cost timeline``: the fitted timeline and its held-out errors beside the linear model's."""
    from replay.analyses.paired import signed

    p = r["profile"]
    lines = [f"{r['trace']}: timeline fitted on {r['tokens_fit']} decoded tokens, held out on {r['tokens_heldout']} "
             f"({r['split']})",
             f"  {p['lanes']} read lanes x {fmt_q(p['lane_mib_s'], 'mib_s')} MiB/s, {fmt_q(p['read_latency_ms'], 'ms_per_miss')} "
             f"ms per read; compute {fmt_q(p['compute_ms_per_layer'], 'ms_per_miss')} ms per MoE layer, expert share "
             f"{fmt_q(p['expert_share'], 'pp')}; overlap {'on' if p['overlap'] else 'off'}; token overhead "
             f"{fmt_q(p['token_overhead_ms'], 'ms')} ms + {fmt_q(p['serial_ms_per_mib'], 'ms_per_mib')} ms/MiB",
             "",
             "held-out tokens          mean error ms   per-token MAPE %   correlation"]
    for label, key in (("timeline wall_ms", "timeline_wall_ms"), ("linear wall_ms", "linear_wall_ms"),
                       ("timeline io_ms", "timeline_io_ms"), ("timeline stall_ms", "timeline_stall_ms")):
        v = r.get(key)
        if v is None:
            continue
        lines.append(f"  {label:<22} {signed(v['mean_err_ms']):>13}   {fmt_q(v['mape_pct'], 'pct'):>16}   "
                     f"{fmt_q(v['corr'], 'r2'):>11}")
    rec = r["recorded_heldout_tok_s"]
    for name in ("timeline", "linear"):
        ok = r[f"{name}_reproduces_tok_s"]
        lines.append(f"  {name}: held-out {fmt_q(r[f'{name}_heldout_tok_s'], 'tok_s')} tok/s against {fmt_q(rec, 'tok_s')} recorded; "
                     f"{'reproduced' if ok else 'not reproduced' if ok is not None else 'no interval'} within the held-out "
                     f"error (mean per-token error inside +-{fmt_q(r[f'{name}_mean_err_ci95_ms'], 'ms')} ms, 95%)")
    better = {"timeline": "the timeline is better", "linear": "the linear model is better", "tie": "they tie"}[r["better"]]
    lines.append(f"  per-token mean absolute error: timeline {fmt_q(r['timeline_wall_mae_ms'], 'ms')} ms, linear "
                 f"{fmt_q(r['linear_wall_mae_ms'], 'ms')} ms: {better} on this run's held-out tokens")
    lines += [f"  note: {n}" for n in r.get("notes") or []]
    return "\n".join(lines)
