"""``moe-replay report``: Markdown + self-contained HTML, PNG plots and every table as CSV.

Each section is built when the trace has what it needs; otherwise it is present and says why
not. Everything is written into a staging directory and renamed into place at the end, and the
output is byte-identical for the same trace and options (no timestamps, sorted everything).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from replay.analyses.info import info_rows
from replay.present.format import digits_for, exact, fmt_q, json_object
from replay.present.info import info_text
from replay.present.report import Section, Table, render_html, render_markdown
from replay.present.verdict import verdict_lines
from traces import open_trace
from traces.format.errors import UserError
from traces.io.atomic import atomic_write_text, staged_dir
from traces.io.reader import Trace


@dataclass
class ReportContext:
    trace: Trace
    name: str
    out: Path  # staging directory
    budgets_mib: list[float] | None = None
    policies: list[str] | None = None
    verdict_budgets: list[float] = field(default_factory=list)  # the budgets the verdict answers for (and drop/prefetch run at)
    verdict_where: str = ""  # where they come from: "given", "the recorded budget", "2 x T (no recorded budget)"
    cost_model: Any = None
    progress: Callable[[str], None] | None = None
    shared: dict[str, Any] = field(default_factory=dict)
    # report --time-model fitted|profile: the timeline's profile (replay.analyses.timeline), else None (linear)
    profile: Any = None


# -- sections ----------------------------------------------------------------------------------

def section_summary(ctx: ReportContext) -> Section:
    row = info_rows(ctx.trace)[0]
    text = info_text(ctx.trace, row).replace(str(ctx.trace.path), ctx.name)
    s = Section("Trace summary", code=text)
    s.tables.append(Table("summary", pl.DataFrame([row]), "the trace in one row (same keys as `info --json`)",
                          columns=["model", "moe_layers", "n_expert", "top_k", "tokens_prefill", "tokens_decode",
                                   "token_cycle_mib", "complete"]))
    return s


def section_popularity(ctx: ReportContext) -> Section:
    from replay.analyses.popularity import popularity
    from replay.present import plots

    tr = ctx.trace
    k, E = tr.top_k, tr.n_expert
    layers = tr.moe_layers
    s = Section("Expert popularity")
    pop = popularity(tr)
    phase, sorted_share, frame = pop.phase, pop.sorted_share_pct, pop.frame
    hot_k = frame[f"hot{k}_share_pct"].to_numpy()
    uniform = k / E * 100.0
    s.text.append(
        f"Share of {phase} routings that selected each expert, experts sorted by popularity within each layer "
        f"(rank 0 = hottest). A flat row is uniform routing; a bright left edge is a few experts taking most tokens. "
        f"Concentration = share of routed slots taken by the layer's {k} hottest experts "
        f"(uniform routing would give {uniform:.1f}%).")
    s.images += [
        plots.heatmap(sorted_share, ctx.out / "popularity.png", f"Expert popularity per layer ({phase})",
                      "expert popularity rank within the layer (rank, 0 = hottest)", "MoE layer (index)",
                      f"{phase} routings selecting the expert (%)", ylabels=layers,
                      caption="Bright columns at the left mean a few experts take most routings: a small cache of them "
                              "serves many lookups; an even row means every expert is needed."),
        plots.bars([str(l) for l in layers], hot_k.tolist(), ctx.out / "concentration.png",
                   f"Concentration: share of routed slots taken by the hottest {k} experts ({phase})", "MoE layer (index)",
                   "routed slots taken (%)",
                   caption=f"Layers with tall bars are the ones where pinning the {k} hottest experts pays; "
                           f"uniform routing would give {uniform:.1f}%.")]
    conc = {f"hot{k}_share_pct": f"Hottest {k} experts' share (% of {phase} slots)",
            "hottest_expert_pct": f"Hottest expert (% of {phase} routings)"}
    s.tables.append(Table("concentration_summary", layer_summary(frame, conc, label="quantity"),
                          f"concentration over the {len(layers)} MoE layers ({phase} routings)"))
    s.tables.append(Table("concentration", frame, f"per-layer concentration ({phase} routings)",
                          columns=["layer", "routings", f"hot{k}_share_pct", "hottest_expert_pct", "experts_never_routed"],
                          headers=conc, collapsed=True))
    _locality(ctx, s)
    return s


def _locality(ctx: ReportContext, s: Section) -> None:
    """``profile``'s answer and figures (replay.analyses.locality) at the verdict's first budget, added
    to the popularity section as collapsed notes and two CSV tables (the page's length is budgeted,
    tests/test_report_browser.py);
    the verdict opens with the answer (``ctx.shared["locality"]``)."""
    from replay.analyses.locality import profile, summary
    from replay.present.profile import answer_lines

    tr = ctx.trace
    budget = ctx.verdict_budgets[0] if ctx.verdict_budgets else None
    phase = "decode" if tr.token_counts()["tokens_decode"] else "prefill"
    prof = profile(tr, phase=phase, budget_mib=budget)
    ctx.shared["locality"] = prof.answer
    s.notes += [line.strip() for line in answer_lines(prof.answer)]
    s.notes.append("Locality: the figures of `moe-replay profile` (docs/profile.md): popularity and drift per layer, "
                   "load-aware reuse distances (the share within a budget is LRU's hit % there), co-activation, and SRP/SCH "
                   "as Liang et al. define them: tables/locality.csv per layer, tables/srp_sch.csv by segment length; "
                   "`moe-replay profile TRACE -o DIR` draws them.")
    # tables/locality.csv (the per-layer table) and tables/srp_sch.csv: written, not shown (the page's length)
    atomic_write_text(ctx.out / "tables" / "locality.csv", summary(prof).write_csv(float_precision=6))
    seg = prof.srp.filter(pl.col("request").is_null() & pl.col("layer").is_null()).select(
        "segment_tokens", "windows", "srp_pct", "threshold")
    sch = prof.sch.filter(pl.col("request").is_null() & pl.col("layer").is_null())
    for c in sorted(set(sch["cache_experts"].to_list())):
        seg = seg.join(sch.filter(pl.col("cache_experts") == c).select("segment_tokens", pl.col("sch_pct").alias(f"sch_{c}_pct")),
                       on="segment_tokens", how="left")
    atomic_write_text(ctx.out / "tables" / "srp_sch.csv", seg.write_csv(float_precision=6))


def layer_summary(frame: pl.DataFrame, values: dict[str, str], label: str | None = None, by: str | None = None) -> pl.DataFrame:
    """A per-layer table in a few rows: min, median and max of each value column over the MoE layers
    (with the layer holding the min and the max; ties to the lowest layer), per ``by`` group. ``label``
    names the column that says which value a row summarises (``values`` maps each column to its name).
    The rendered headers say "(%)": every value summarised this way is a percentage."""
    rows = []
    keys = [None] if by is None else sorted(frame[by].unique().to_list())
    for key in keys:
        f = frame if by is None else frame.filter(pl.col(by) == key)
        for col, name in values.items():
            g = f.select("layer", pl.col(col).cast(pl.Float64)).filter(pl.col(col).is_not_null() & pl.col(col).is_not_nan())
            row: dict[str, Any] = {} if by is None else {by: key}
            if label is not None:
                row[label] = name
            if g.height == 0:
                row.update({"min": None, "min_layer": None, "median": None, "max": None, "max_layer": None})
            else:
                lo = g.sort([col, "layer"]).row(0)
                hi = g.sort([col, "layer"], descending=[True, False]).row(0)
                row.update({"min": lo[1], "min_layer": lo[0], "median": float(g[col].median()), "max": hi[1], "max_layer": hi[0]})
            rows.append(row)
    return pl.DataFrame(rows, schema_overrides={"min_layer": pl.Int64, "max_layer": pl.Int64})


DROP_HEADERS = {"routings_dropped_pct": "Routings with a drop (%)",
                "experts_dropped_pct": "Experts dropped (%, engine's 'routings dropped')"}


def section_drop(ctx: ReportContext) -> Section:
    """Static drop-cold on the recorded residency when the engine recorded it; otherwise (and in
    addition) closed-loop drop-cold, where the replayed cache reacts to what was not read."""
    from replay.analyses.drop_cold import closed_drop, static_drop
    from replay.present import plots

    s = Section("Drop-cold trade-off")
    tr = ctx.trace
    if tr.token_counts()["tokens_decode"] == 0:
        s.unavailable = "the trace has no decoded tokens (drop-cold is judged on decode routings)"
        return s
    fracs = [0.25, 0.5, 0.75, 1.0, 1.5]
    series = {}
    s.text.append("Drop-cold F skips a routed expert that is a cache miss with weight below F/k (never the routing's "
                  "top-weighted expert); the top-k cut drops every slot at rank >= keep_k. Lower and further right is "
                  "better. Weight mass is a proxy, not quality; bytes are not time.")
    s.notes.append(f"Two different dropped shares: *{DROP_HEADERS['routings_dropped_pct']}* counts (token, layer) routings "
                  f"with at least one expert skipped; *{DROP_HEADERS['experts_dropped_pct']}* counts routed experts "
                  "skipped, which is what an engine's telemetry calls \"routings dropped\". Compare an engine's figure "
                  "with the second, never the first.")
    if tr.has("residency") and tr.has("read_bytes"):
        frame = static_drop(tr, fracs, profile=ctx.profile)
        cold, cut = frame.filter(pl.col("mode") == "static"), frame.filter(pl.col("mode") == "static-k")
        series["drop-cold, static (recorded residency)"] = (cold["io_saved_pct"].to_numpy(), cold["mass_lost_pct"].to_numpy())
        series["top-k cut, static"] = (cut["io_saved_pct"].to_numpy(), cut["mass_lost_pct"].to_numpy())
        s.tables.append(Table("drop_static", frame, "static: on the run as recorded (the engine's own hits and misses)",
                              columns=["mode", "frac", "keep_k", "io_saved_pct", "mass_lost_pct", "routings_dropped_pct",
                                       "experts_dropped_pct", "static_k_mass_lost_at_equal_io_pct"], headers=DROP_HEADERS))
        ctx.shared["drop"] = ("static", None, _drop_timed(ctx, cold, "static"))
    else:
        s.text.append("Static mode needs the engine's recorded residency, which this trace does not have; the closed-loop "
                      "replay below stands in for it.")
    budgets, where = ctx.verdict_budgets, ctx.verdict_where
    closed = pl.concat([closed_drop(tr, fracs, budget_mib=b, policy="lru", profile=ctx.profile) for b in budgets], how="diagonal_relaxed")
    for b in budgets:
        at = closed.filter(pl.col("budget_mib") == b)
        cold, cut = at.filter(pl.col("mode") == "closed"), at.filter(pl.col("mode") == "closed-k")
        series[f"drop-cold, closed loop (LRU {exact(b)} MiB)"] = (cold["io_saved_pct"].to_numpy(), cold["mass_lost_pct"].to_numpy())
        series[f"top-k cut, closed loop (LRU {exact(b)} MiB)"] = (cut["io_saved_pct"].to_numpy(), cut["mass_lost_pct"].to_numpy())
        if "drop" not in ctx.shared:
            ctx.shared["drop"] = ("closed", b, _drop_timed(ctx, cold, "closed"))
    at_txt = ", ".join(exact(b) for b in budgets)
    s.text.append(f"Closed loop: LRU at {at_txt} MiB ({where}) replayed with dropping in the loop (a skipped expert is "
                  "neither read nor admitted, so the cache holds other things later); reads avoided are against the "
                  "no-drop replay at the same budget. Its cache hit % rises partly because dropped routings never look "
                  "the cache up, not because the cache serves more.")
    s.tables.append(Table("drop_closed", closed, f"closed loop, LRU at {at_txt} MiB, decode routings",
                          columns=(["budget_mib"] if len(budgets) > 1 else []) + [
                              "mode", "frac", "keep_k", "io_saved_pct", "mass_lost_pct", "routings_dropped_pct",
                              "experts_dropped_pct", "hit_pct_decode_baseline", "hit_pct_decode",
                              "closed_k_mass_lost_at_equal_io_pct"],
                          headers={**DROP_HEADERS, "hit_pct_decode_baseline": "Hit % (decode, no drop)",
                                   "hit_pct_decode": "Hit % (decode, with drop)"},
                          collapsed=ctx.shared.get("drop", ("",))[0] == "static"))  # the static table is the evidence
    styles = {n: {"color": (plots.VERMILLION, plots.ORANGE, plots.BLUE, plots.SKY)[2 * (not n.startswith("drop-cold"))
                                                                             + ("closed" in n)],
                  "marker": "o" if n.startswith("drop-cold") else "s", "linestyle": "--" if "closed" in n else "-"}
              for n in series}
    for i, b in enumerate(budgets[1:], 1):  # several verdict budgets: each budget's closed-loop pair its own markers
        for n in (f"drop-cold, closed loop (LRU {exact(b)} MiB)", f"top-k cut, closed loop (LRU {exact(b)} MiB)"):
            styles[n] = {**styles[n], "marker": ("o", "D", "^", "v", "P", "X")[i % 6] if n.startswith("drop-cold")
                         else ("s", "d", "<", ">", "p", "h")[i % 6], "linestyle": (":", "-.")[i % 2]}
    s.images.append(plots.lines(
        series, ctx.out / "drop_tradeoff.png", "Drop-cold vs top-k cut (decode routings)",
        "reads avoided (% of decode miss bytes without dropping)", "router weight mass discarded (%)", styles=styles,
        point_labels={n: [f"F={exact(f)}" for f in fracs] for n in series if n.startswith("drop-cold")},
        caption="Each point is one drop threshold F (labelled): the lower a curve at a given x, the less router weight "
                "it discards for the same reads avoided."))
    return s


def _drop_timed(ctx: ReportContext, cold: pl.DataFrame, mode: str) -> list[dict[str, Any]]:
    """The verdict's drop-cold rows; with a cost model, with the time each saves per decoded token
    (``drop --cost-model``'s columns: ms_per_token, ms_per_token_baseline, ms_saved_per_token); under
    report --time-model fitted|profile, timed on the timeline instead (section_drop passed the
    profile: ``drop --time-model``'s columns, with the paired interval of the time saved)."""
    model = ctx.shared.get("cost_model")
    if model is None or ctx.profile is not None:
        return cold.to_dicts()
    from replay.analyses.drop_cold import drop_time_columns

    return drop_time_columns(cold, model, mode).to_dicts()


def section_cost(ctx: ReportContext) -> Section:
    from replay.analyses.cost_model import fit_trace

    s = Section("Cost model")
    if ctx.cost_model is not None:
        m = ctx.cost_model
        s.text.append(f"Using the given cost model ({m.kind}): {m.model}; intercept {fmt_q(m.intercept_ms, 'ms')} ms/token, "
                      f"{fmt_q(m.ms_per_mib, 'ms_per_mib')} ms/MiB"
                      + (f" ({fmt_q(m.bandwidth_mib_s, 'mib_s')} MiB/s)" if m.bandwidth_mib_s else "") + ".")
        if m.kind != "manual" and m.fit_trace_id is not None:
            s.text.append(f"Fitted on {m.fit_trace or m.source} ({m.fit_trace_id}); held out there: per-token MAPE "
                          f"{fmt_q(m.heldout_mape_pct, 'pct')}%, run-mean error {_signed_pct(m.heldout_run_mean_err_pct)}.")
        if m.kind == "manual":
            s.text.append("A manual model is an assumption given on the command line, not a measurement of any device: "
                          "its times rank configurations by bytes read; they do not predict a real engine's speed.")
        if m.foreign:
            from replay.present.cost import FOREIGN

            o = m.origin or {}
            s.text.append(f"**FOREIGN cost model**: fitted on {o.get('model') or 'a run it does not record'}"
                          + (f" ({o.get('arch')})" if o.get("arch") else "") + f", not on {ctx.trace.model['name']}; applied "
                          "with --foreign-cost-model. Every time figure in this report comes from it and is marked "
                          + f"{FOREIGN} (its figures are that device's, not a measurement of this trace).")
        s.notes += [f"Note: {n}." for n in m.notes]
        if m.kind != "manual":
            s.notes.append(_INTERVAL_NOTE)
        ctx.shared["cost_model"] = m
        if ctx.profile is not None:
            _timeline_cost(ctx, s)
        return s
    if not ctx.trace.has_metrics:
        if ctx.profile is not None:  # no linear model to fit, but the timeline was given a profile
            s.text.append("The trace has no recorded per-token metrics: no linear cost model is fitted, and the cache "
                          "tables show bytes, not time.")
            _timeline_cost(ctx, s)
            return s
        s.unavailable = ("the trace has no recorded per-token engine metrics to fit a cost model on; pass "
                         "--cost-model FILE (from 'cost fit' or a manual model) to get time estimates")
        return s
    best, cands, _ = fit_trace(ctx.trace, origin=False)  # applied here only: no origin to record
    ctx.shared["cost_model"] = best
    rows = []
    for c in cands:
        r = c.row()
        r["selected"] = c is best
        rows.append(r)
    # The trace's name, not its path as typed: `report qwen` and `report /abs/qwen` write the same bytes.
    frame = pl.DataFrame(rows).drop("notes", "origin", "cov_unscaled")
    frame = frame.with_columns(pl.lit(ctx.name).alias("source"), pl.lit(ctx.name).alias("fit_trace"))
    bw = best.bandwidth_mib_s
    s.text.append(f"Fitted on this run's recorded decode tokens: {best.model}; intercept {fmt_q(best.intercept_ms, 'ms')} "
                  f"ms/token, slope {fmt_q(best.ms_per_mib, 'ms_per_mib')} ms/MiB"
                  + (f" (effective {fmt_q(bw, 'mib_s')} MiB/s)" if bw else "")
                  + f"; r2 {fmt_q(best.r2, 'r2')}; held out (fit on the first half, tested on the second): per-token "
                  f"MAPE {fmt_q(best.heldout_mape_pct, 'pct')}%, run-mean error {_signed_pct(best.heldout_run_mean_err_pct)} "
                  "(predicted against recorded tok/s). The time estimates below use coefficients refitted on every token "
                  "of this run, so comparing them with this run's own recorded speed is in-sample.")
    s.notes += [f"Note: {n}." for n in best.notes]
    s.notes.append(_INTERVAL_NOTE)
    if ctx.profile is not None:
        _timeline_cost(ctx, s)
    s.tables.append(Table("cost_fit", frame, "candidate models (the selected one is used for time estimates)",
                          columns=["terms", "intercept_ms", "ms_per_mib", "ms_per_miss", "r2", "heldout_mape_pct",
                                   "heldout_run_mean_err_pct", "bandwidth_mib_s", "selected"],
                          headers={"heldout_mape_pct": "held-out per-token MAPE %",
                                   "heldout_run_mean_err_pct": "held-out run-mean error %"}))
    return s


def _timeline_cost(ctx: ReportContext, s: Section) -> None:
    """report --time-model fitted|profile: the timeline's parameters (with its held-out errors beside
    the linear model's when fitted) and a per-token plot of a few tokens (LRU at the verdict's budget)."""
    from replay.analyses.timeline import T_COMPUTE, T_IO, T_STALL, T_WALL, time_replay
    from replay.core.simulate import loads_of, replay
    from replay.present import plots

    p, scores = ctx.profile, ctx.shared.get("timeline_scores")
    s.text.append(f"Prefetch times come from the timeline ({'fitted on this run' if p.source == 'fitted' else p.name}): "
                  f"{p.lanes} read lanes x {fmt_q(p.lane_mib_s, 'mib_s')} MiB/s, {fmt_q(p.read_latency_ms, 'ms_per_miss')} ms "
                  f"per read, compute {fmt_q(p.compute_ms_per_layer, 'ms_per_miss')} ms per MoE layer (expert share "
                  f"{fmt_q(p.expert_share, 'pp')}), overlap {'on' if p.overlap else 'off'}: reads overlap compute, so a "
                  "speculative read can win or lose time (docs/design.md, Timeline).")
    if p.source == "preset":
        s.text.append(f"{p.name} is a preset: an assumption about a class of device, not a measurement.")
    if scores is not None:
        t, lin = scores["timeline_wall_ms"], scores["linear_wall_ms"]
        s.text.append(f"Held out on alternating 8-token blocks: timeline wall_ms mean error {fmt_q(t['mean_err_ms'], 'ms')} ms, "
                      f"MAPE {fmt_q(t['mape_pct'], 'pct')}%, correlation {fmt_q(t['corr'], 'r2')}; the linear model on the same "
                      f"tokens {fmt_q(lin['mean_err_ms'], 'ms')} ms, {fmt_q(lin['mape_pct'], 'pct')}%, "
                      f"{fmt_q(lin['corr'], 'r2')} ({scores['better']} better per token).")
    budget = ctx.verdict_budgets[0]
    loads = loads_of(ctx.trace)
    tl = time_replay(loads, replay(loads, "lru", float(budget), slots=True), p)
    n = min(12, tl.tok.shape[0])
    if n == 0:
        return
    tok = tl.tok[:n]
    other = tok[:, T_WALL] - tok[:, T_COMPUTE] - tok[:, T_STALL]
    s.images.append(plots.token_timeline(
        np.arange(1, n + 1), tok[:, T_COMPUTE], tok[:, T_STALL], other, tok[:, T_IO] / p.lanes,
        ctx.out / "timeline.png", f"The first {n} decoded tokens on the timeline (LRU at {plots.budget_label(float(budget))})",
        caption="Per decoded token: compute, stall (waiting for reads) and the rest (overhead, serial costs) stacked; the line "
                "is the token's read time divided by the lanes: where it stands above the stall, reads overlapped compute."))


_INTERVAL_NOTE = ("Time figures carry a 95% prediction interval from the fit (its residuals and its coefficients' own "
                  "uncertainty, so it widens with the distance from the read volumes the model was fitted on); a figure "
                  "marked ^ is extrapolated: its read volume per token lies outside the fitted tokens' volumes, where no "
                  "token was measured.")


def _model_kind_text(model: Any, ctx: ReportContext) -> str:
    """What the cost model's times are, said of the model this report uses and no other kind: a
    manual model ranks by bytes; a fitted one estimates (in-sample on its own run, foreign elsewhere)."""
    if model.kind == "manual":
        return "bytes read turned into time by a manual model, an assumption: it ranks, it does not measure"
    if getattr(model, "foreign", False):
        return "bytes read turned into time by a model fitted on another model or device: that device's times, marked ~"
    if ctx.cost_model is None:
        return "bytes read turned into time by the model fitted on this run's recorded tokens: estimates, in-sample here"
    return "bytes read turned into time by the given fitted model: estimates, with the prediction interval in the tables"


def _signed_pct(v: float | None) -> str:
    return "-" if v is None else f"{'+' if v >= 0 else ''}{fmt_q(v, 'pct')}%"


def section_predictors(ctx: ReportContext) -> Section:
    from replay.analyses.accuracy import describe, evaluate, horizon_curve
    from replay.predictors import report_predictors
    from replay.present import plots

    tr = ctx.trace
    s = Section("Predictor accuracy (decode)")
    horizons = [1, 2]
    res = evaluate(tr, report_predictors(), horizons=horizons)
    overall = res.overall()
    # name only the predictors this report evaluates (a caveat about one that is not here misleads)
    unscored = ["first decoded token of a turn" + (" of each request" if tr.has("request") else "")]
    if any(p.startswith("stale-gate") for p in res.predictors):
        unscored.append("the first d MoE layers for stale-gate[d]")
    if "static-hot-prompt" in res.predictors:
        unscored.append("no prompt for static-hot-prompt")
    s.text.append(f"Slot accuracy = |top-{tr.top_k} named ∩ routed| / {tr.top_k}; whole = the routed set named exactly; "
                  f"over scored decode routings only. Unscored routings ({', '.join(unscored)}) are counted apart, "
                  "never as wrong; a layer with nothing scored shows '-'.")
    if res.train_text:
        s.text.append(f"Training: {res.train_text} ({res.evaluated:,} decode routings scored, every predictor on the same "
                      "ones): the learners (static-hot, pair-table, request-match, mix) never saw a scored token. "
                      "Intervals: 95%, seeded block bootstrap over the scored tokens (whole requests when there are "
                      "at least 8); vs prev-token: slot accuracy minus prev-token's on the same resamples.")
    s.text += res.warnings + res.notes
    s.missing += [(f"{u['predictor']} predictor", u["reason"]) for u in res.unavailable]
    head = overall.with_columns(pl.col("predictor").map_elements(describe, return_dtype=pl.String).alias("measures"))
    s.tables.append(Table("predict_overall", head, "headline per predictor (decode)",
                          columns=["predictor", "slot_acc_pct", "slot_acc_ci_low", "slot_acc_ci_high", "whole_acc_pct",
                                   "mass_pct", "vs_prev_token_pp", "vs_prev_token", "scored", "unscored", "measures"]))
    ctx.shared["predictor"] = best_predictor(head.to_dicts())
    per = res.per_layer()
    if per.height:
        wide = per.pivot(on="predictor", index="layer", values="slot_acc_pct").sort("layer")
        wide = wide.join(pl.DataFrame({"layer": list(res.routings), "routings": list(res.routings.values())},
                                      schema_overrides={"layer": per["layer"].dtype}), on="layer", how="left")
        cols = ["layer"] + [p for p in res.predictors if p in wide.columns] + ["routings"]
        s.tables.append(Table("predict_per_layer_summary",
                              layer_summary(wide, {p: p for p in cols[1:-1]}, label="predictor"),
                              f"slot accuracy % (decode) over the {len(tr.moe_layers)} MoE layers, per predictor",
                              collapsed=True))  # one row per predictor: the headline table above has their overall figures
        s.tables.append(Table("predict_per_layer", wide.select(cols), "slot accuracy % per MoE layer (decode)",
                              headers={p: f"{p} (%)" for p in cols[1:-1]}, collapsed=True))
        series = {}
        for p in _plotted(res):
            f = per.filter(pl.col("predictor") == p).sort("layer")
            series[p] = (f["layer"].to_numpy(), f["slot_acc_pct"].fill_null(float("nan")).to_numpy())
        s.images.append(plots.lines(series, ctx.out / "predict_per_layer.png", "Predictor slot accuracy per layer (decode)",
                                    "MoE layer (index)", f"slot accuracy (% of top-{tr.top_k} named)", ylim=(0, 102),
                                    caption="The highest curve names the most of each layer's routed experts; dips "
                                            "mark layers where prefetching on its guesses would waste reads."))
    by_horizon = {}
    if not [u for u in res.unavailable if u["predictor"].startswith("stale-gate")]:
        D = min(8, len(tr.moe_layers) - 1)
        if D >= 1:
            curve = horizon_curve(tr, D).overall().sort("horizon")
            by_horizon = _by_horizon(tr, D, curve)
            s.tables.append(Table("horizon_curve", curve.select(["horizon", "slot_acc_pct", "whole_acc_pct", "scored",
                                                                   "unscored"]), "stale-gate[d], all layers (decode)"))
    if res.predictors:
        s.images.append(_accuracy_plot(ctx, res, by_horizon))
    return s


def _plotted(res) -> list[str]:
    """The predictors with a scored routing (request-match on a one-request trace has none: a curve
    with no point is left out of the figures; the tables still list it, unscored)."""
    ov = {r["predictor"]: r["scored"] for r in res.overall().iter_rows(named=True)}
    return [p for p in res.predictors if ov.get(p)]


def _widths(tr: Trace) -> list[int]:
    return sorted({w for w in (tr.top_k, 2 * tr.top_k, 4 * tr.top_k) if w <= tr.n_expert})


def _by_horizon(tr: Trace, D: int, curve: pl.DataFrame) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """stale-gate recall (% of routed experts among the w named) against horizon d, per width w."""
    from replay.analyses.accuracy import horizon_curve

    out = {}
    for w in _widths(tr):
        try:
            c = curve if w == tr.top_k else horizon_curve(tr, D, width=w).overall().sort("horizon")
        except UserError:  # a wider ranking that does not fit in memory: that width is left out, not the section
            continue
        out[f"stale-gate, {w} named"] = (c["horizon"].to_numpy(), c["recall_pct"].to_numpy())
    return out


def _accuracy_plot(ctx: ReportContext, res: Any, by_horizon: dict) -> tuple[str, str, str]:
    """Predictor recall against width (experts named; stale-gate at d = 1) and, with gate inputs,
    stale-gate's against horizon d per width: what anticipating further or reading more buys."""
    from replay.analyses.accuracy import evaluate
    from replay.present import plots

    tr = ctx.trace
    names = [p for p in _plotted(res) if not p.startswith("stale-gate[") or p == "stale-gate[1]"]
    acc = {}
    for w in _widths(tr):
        try:
            acc[w] = res.overall() if w == res.width else evaluate(tr, names, horizons=[1], width=w).overall()
        except UserError:  # as in _by_horizon
            continue
    widths = list(acc)
    by_width = {}
    for p in names:
        ys = [acc[w].filter(pl.col("predictor") == p)["recall_pct"].to_list() for w in widths]
        by_width[p] = (np.array(widths, dtype=float), np.array([y[0] if y and y[0] is not None else np.nan for y in ys]))
    right_styles = {n: {"linestyle": ("-", "--", ":")[i % 3], "marker": ("^", "v", "D")[i % 3]} for i, n in enumerate(by_horizon)}
    stale = any(p.startswith("stale-gate") for p in names)
    # the caption speaks of stale-gate, and of its horizon panel, only when they are drawn
    why = next((u["reason"].rstrip(".") for u in res.unavailable if u["predictor"].startswith("stale-gate")), None)
    caption = (f"Read how many experts a predictor must name (w = {tr.top_k} is the top-k) to cover a share of the routing"
               + (", and how fast stale-gate's coverage falls as it guesses more layers ahead." if by_horizon else
                  "." + ("" if stale or why is None else f" No stale-gate here: {why}.")))
    return plots.panels(
        by_width, by_horizon, ctx.out / "predict_accuracy.png", "Predictor accuracy against width and horizon (decode)",
        "experts named per layer (width w, count)", "horizon d (MoE layers ahead)",
        "routed experts among those named (recall, %)",
        left_title="against width" + (" (stale-gate at d = 1)" if stale else ""),
        right_title="stale-gate against horizon, per width", right_styles=right_styles, ylim=(0, 102), caption=caption)


def best_predictor(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The predictor an engine could use (not a check such as ``ctrl``, not an oracle, not a learner
    scored in-sample) with the highest decode slot accuracy; ties to one that learns nothing, then to
    the name first alphabetically."""
    from replay.predictors import learns, module, parse_predictor

    def usable(name: str) -> bool:
        m = module(parse_predictor(name)[0])
        return getattr(m, "PREFETCH", True) and not getattr(m, "ORACLE", False)

    ok = [r for r in rows if r.get("slot_acc_pct") is not None and usable(r["predictor"]) and not r.get("in_sample")]
    # equal accuracy: a predictor that learns nothing first (it needs no training split, so its
    # prefetch guesses for every token, not only the held-out ones), then by name
    return min(ok, key=lambda r: (-r["slot_acc_pct"], learns(parse_predictor(r["predictor"])[0]), r["predictor"])) if ok else None


def section_cache(ctx: ReportContext) -> Section:
    from replay.analyses.cost_model import BOUNDS
    from replay.core.simulate import default_budgets_mib, is_over_budget, loads_of, sweep, within_budget
    from replay.present import plots
    from replay.present.cache import over_budget_note

    tr = ctx.trace
    loads = loads_of(tr)
    if tr.token_counts()["tokens_decode"] == 0:
        return Section("Expert cache", unavailable="the trace has no decoded tokens, and hit rates here are decode-only")
    rec = tr.recorded.get("budget_mib")
    budgets = sorted(set(ctx.budgets_mib or default_budgets_mib(loads, rec)) | set(ctx.verdict_budgets))
    from replay.analyses.policy_set import left_out_text, report_policies

    policies, left = report_policies(ctx.policies)
    token_series: dict = {}  # each cell's decode batches, for the paired comparisons (replay.analyses.paired)
    frame = sweep(loads, policies, budgets, per_layer=True, show_progress=False, series=token_series)
    model = ctx.shared.get("cost_model")
    if model is not None:
        from replay.analyses.cost_model import with_time

        frame = with_time(frame, model, tr.token_counts()["tokens_decode"])
    overall = frame.filter(pl.col("layer").is_null())
    T = loads.token_cycle_bytes / (1 << 20)
    s = Section("Expert cache")
    from replay.policies.opt_bound import sizes_differ

    unequal = sizes_differ(loads.layer_expert_bytes)
    ceiling = ("Belady (offline optimum at that budget) and infinite (compulsory misses only) are the ceiling. "
               if not unequal else
               "Infinite (compulsory misses only) is the ceiling at any budget; Belady (furthest next use) is, with these "
               "unequal expert sizes, a heuristic, not a bound: the verdict measures the gap against opt-bound, the upper "
               "bound on hits. ")
    s.text.append(f"Decode-only hit % per policy and byte budget (a lookup = one unique (layer, expert) per load). "
                  f"{ceiling}"
                  f"T = {T:.1f} MiB is one token cycle (sum over MoE layers of top_k x expert_bytes): below it global "
                  "LRU collapses, because each token's sweep over the layers evicts exactly what the next token needs.")
    ranked = [p for p in policies if p not in BOUNDS]
    s.text.append(f"Policies ranked in this section's tables and plots and in the verdict: {len(ranked)} online "
                  f"({', '.join(ranked)}; {'given with --policies' if ctx.policies else 'every registered online policy'}), "
                  "beside the bounds belady and infinite. " + left_out_text(left))
    vlines = {f"T = one token cycle ({T:.1f} MiB)": T}
    if rec is not None:
        vlines[f"recorded budget ({plots.budget_label(float(rec))})"] = float(rec)
    _curve_figure(ctx, s, loads, rec, vlines)
    for col, png, title, ylabel, ylim, caption in (
            ("hit_pct_decode", "cache_curves.png", "Expert-cache hit rate vs budget (decode loads)", "decode-only hit rate (%)",
             (0, 102), "Pick the highest curve at the memory you can give the cache; the distance to the Belady curve is "
                       + ("about " if unequal else "") + "what a better online policy could still win there"
                       + (" (Belady is a heuristic with these unequal expert sizes; the verdict gives the upper bound)."
                          if unequal else ".")),
            *((("tok_s", "cache_tok_s.png", "Decode speed vs budget under the cost model", "decode speed (tok/s, cost model)",
                None, "Pick the highest curve at your budget: the tokens per second each policy buys under the cost model "
                      f"({_model_kind_text(model, ctx)})."),) if model is not None else ())):
        series = {p: (f["budget_mib"].to_numpy(), f[col].to_numpy())
                  for p in policies for f in [overall.filter(pl.col("policy") == p).sort("budget_mib")]}
        ob = overall.filter(pl.col("over_budget")).sort("budget_mib")
        if ob.height:
            series["over budget (needs more memory)"] = (ob["budget_mib"].to_numpy(), ob[col].to_numpy())
        s.images.append(plots.lines(series, ctx.out / png, title, "cache budget (MiB/GiB, log scale)", ylabel, vlines=vlines,
                                    styles={"over budget (needs more memory)": {"linestyle": "none", "marker": "x",
                                                                                "markersize": 8, "color": "black"}},
                                    budget_x=True, ylim=ylim, caption=caption))
    online = [p for p in policies if p not in BOUNDS]
    cells = overall.to_dicts()
    from replay.analyses.paired import annotate, decide, with_requests

    paired_series = with_requests(token_series, tr)
    annotate(cells, paired_series, model)  # every cell against LRU and the best, with the paired interval
    from replay.analyses.budget_choice import which_budget

    ctx.shared["budget_answer"] = which_budget(cells, paired_series, model)  # the verdict's first question
    over = [r for r in cells if is_over_budget(r)]
    gap_rows = []
    for b in budgets:
        at = {r["policy"]: r for r in cells if r["budget_mib"] == b}
        ok, excluded = within_budget([at[p] for p in online if p in at])
        dec = decide([at[p] for p in online if p in at])  # the one rule: pick_best, then the interval against LRU
        best = dec["best"] if dec else None
        bel = at.get("belady")
        row = {"budget_mib": b, "below_T": b < T, "best_online": best["policy"] if best else None,
               "best_online_hit_pct_decode": best["hit_pct_decode"] if best else None,
               "belady_hit_pct_decode": bel["hit_pct_decode"] if bel else None,
               "infinite_hit_pct_decode": at["infinite"]["hit_pct_decode"] if "infinite" in at else None,
               "belady_over_budget": is_over_budget(bel) if bel else None,
               "over_budget_excluded": ", ".join(f"{r['policy']} (peak {r['peak_resident_mib']:.1f} MiB)" for r in excluded)
               or None}
        row["gap_to_belady_pp"] = (None if best is None or bel is None or bel["hit_pct_decode"] is None
                                   or best["hit_pct_decode"] is None else bel["hit_pct_decode"] - best["hit_pct_decode"])
        row["best_vs_lru"] = dec["call"] if dec else None
        row["tied_with_best"] = ", ".join(dec["tied"]) or None if dec else None
        gap_rows.append(row)
    note = over_budget_note(cells) if over else None
    if note:
        s.text.append("Some cells are over budget: the cache overflowed, so their hit rate needs more memory than the budget "
                      "they are listed under; they are marked ! in the tables, drawn as red crosses in the plot and left out "
                      "of every best-online pick (which, and their peaks: the notes and over_budget_excluded).")
        s.notes.append(note[0].upper() + note[1:] + " These cells are marked "
                      "over_budget in the table below (with peak_resident_mib), drawn as red crosses in the plot, and "
                      "left out of the best-online column and its gap to Belady (over_budget_excluded names them).")
    if "lfu-incache" in policies and "lfru" in policies:
        a = overall.filter(pl.col("policy") == "lfu-incache").sort("budget_mib")["hits"].to_list()
        b = overall.filter(pl.col("policy") == "lfru").sort("budget_mib")["hits"].to_list()
        if a == b:
            s.notes.append("lfru and lfu-incache coincide at every budget (their curves overlap): lfru's frequency is the "
                          "in-cache count, it fills the high bits, and the recency byte only orders equal frequencies, which "
                          "is lfu-incache's least-recent tie-break.")
    if "lfu" in policies or "layerlfu" in policies:
        s.notes.append("lfu and layerlfu count every load that touched an entry since the start of the run (the count "
                      "survives eviction, as in the reference replay behind the published curves); lfu-incache and "
                      "layerlfu-incache restart it at admission.")
    s.tables.append(Table("cache_gap", pl.DataFrame(gap_rows), f"best within-budget online policy of those swept "
                          f"({', '.join(online)}) against "
                          + ("Belady (a heuristic with these unequal expert sizes: the verdict's gap is against opt-bound)"
                             if unequal else "the bound") + ", per budget (decode); its call against LRU (better only "
                          "when the paired 95% interval excludes zero, else tie) and the policies tied with it within noise; "
                          "! = " + ("Belady" if unequal else "the Belady bound") + " itself "
                          "overflowed the budget (every registered policy at the verdict's budget: the next table)",
                          columns=["budget_mib", "below_T", "best_online", "best_online_hit_pct_decode", "best_vs_lru",
                                   "tied_with_best", "belady_hit_pct_decode", "gap_to_belady_pp", "infinite_hit_pct_decode",
                                   "over_budget_excluded"],
                          marks={"belady_hit_pct_decode": [bool(r["belady_over_budget"]) for r in gap_rows]},
                          collapsed=True))  # the verdict states the best at its budgets; the figures show every budget
    ans = ctx.shared["budget_answer"]
    if ans is not None:  # the evidence of the verdict's budget line: every tested budget's best against the largest's
        timed = ans["measure"] == "ms_per_token"
        unit = "ms/token" if timed else "points"
        s.tables.append(Table(
            "budget_choice", pl.DataFrame(ans["by_budget"]),
            f"which budget: each budget's best against the largest's ({exact(ans['largest_mib'])} MiB), "
            f"{'ms/token' if timed else 'decode hit %'}: difference ({unit}), paired 95% interval, call",
            columns=["budget_mib", "policy", "value", "delta", "ci_low", "ci_high", "call"],
            headers={"value": "ms/token (decode)" if timed else "Hit % (decode)",
                     "delta": f"Difference vs the largest ({unit})", "ci_low": "95% interval low",
                     "ci_high": "95% interval high", "call": "Call (vs the largest)"},
            digits={"value": digits_for("ms_per_token" if timed else "hit_pct_decode"),
                    **{c: digits_for("ms_per_token" if timed else "delta_pp") for c in ("delta", "ci_low", "ci_high")}},
            collapsed=True))
    cols = ["policy", "budget_mib", "hit_pct_decode", "hit_pct_cum", "read_mib", "peak_resident_mib", "overflow_loads",
            "over_budget"]
    if model is not None:
        cols += ["ms_per_token", "tok_s"]
        from replay.present.cost import verdict

        for v in verdict(cells):  # the picks in the text, what was left out and the caveat in the notes
            (s.notes if v.startswith(("left out", "time estimates")) else s.text).append(v[0].upper() + v[1:] + ".")
    ctx.shared["cache_rows"], ctx.shared["cache_compared"] = _at_verdict_budgets(ctx, loads, policies, model)
    s.tables.append(Table("cache_at_budget", pl.DataFrame(ctx.shared["cache_rows"]),
                          f"every {'' if ctx.policies else 'registered '}online policy at the verdict's budget "
                          f"({ctx.verdict_where}), best decode hit first; ! = over budget"
                          # opt-bound's hit % is the bound; its MiB and times follow one optimal fractional
                          # solution of the LP and bound nothing (replay.policies.opt_bound)
                          + ("; opt-bound: only its hit % is a bound (its MiB and times follow one solution of the LP)"
                             if any(r["policy"] == "opt-bound" for r in ctx.shared["cache_rows"]) else ""),
                          columns=["budget_mib", "policy", "hit_pct_decode", "read_mib", "peak_resident_mib"]
                          + (["ms_per_token", "tok_s"] if model is not None else []),
                          marks={"hit_pct_decode": [is_over_budget(r) for r in ctx.shared["cache_rows"]]},
                          collapsed=len(ctx.shared["cache_rows"]) > 8))  # the verdict states its best, LRU and ties
    s.tables.append(_by_budget(overall, policies, budgets, "hit_pct_decode", "cache_hit_pct_decode_by_budget",
                               "decode hit % per policy (rows) and budget (columns); ! = over budget: the cache overflowed, "
                               "that hit rate needs more memory than the budget (peak in the full table)"))
    if model is not None:
        s.tables.append(_by_budget(overall, policies, budgets, "tok_s", "cache_tok_s_by_budget",
                                   "decode tok/s per policy and budget, estimated by the cost model; ! = over budget"))
    s.tables.append(Table("cache", overall.sort("policy", "budget_mib"), "every (policy, budget) cell; read_mib = all phases; "
                          "peak_resident_mib = most bytes resident at once; over_budget = a load overflowed its budget "
                          "(or its layer's share): that hit rate needs more memory", columns=cols, collapsed=True))
    # per-layer heatmap for the chosen policy
    chosen = "lru" if "lru" in policies else online[0] if online else policies[0]
    per = frame.filter(pl.col("layer").is_not_null() & (pl.col("policy") == chosen))
    layers = tr.moe_layers
    mat = np.full((len(layers), len(budgets)), np.nan)
    li = {l: i for i, l in enumerate(layers)}
    bi = {b: j for j, b in enumerate(budgets)}
    for r in per.iter_rows(named=True):
        if r["hit_pct_decode"] is not None:
            mat[li[r["layer"]], bi[r["budget_mib"]]] = r["hit_pct_decode"]
    s.images.append(plots.heatmap(
        mat, ctx.out / "cache_per_layer.png", f"{chosen}: decode hit rate per layer and budget", "cache budget (MiB/GiB)",
        "MoE layer (index)", "decode-only hit rate (%)", ylabels=layers,
        xticklabels=[plots.budget_label(b) for b in budgets], vmin=0, vmax=100,
        caption=f"Dark cells are layers {chosen} serves badly at that budget: those layers need a bigger share or another policy."))
    per_layer = per.select(["layer", "budget_mib", "lookups", "hits", "hit_pct_decode", "hit_pct_cum", "read_mib"]).sort(
        "layer", "budget_mib")
    s.tables.append(Table("cache_per_layer_summary", layer_summary(per_layer, {"hit_pct_decode": "hit_pct_decode"},
                                                                   by="budget_mib"),
                          f"{chosen}: decode hit % over the {len(layers)} MoE layers, per budget (the heatmap, in numbers)",
                          collapsed=True))
    s.tables.append(Table("cache_per_layer", per_layer, f"{chosen} per layer and budget", collapsed=True))
    return s


def _curve_figure(ctx: ReportContext, s: Section, loads: Any, rec: float | None, vlines: dict[str, float]) -> None:
    """The section's main figure: LRU's exact curve at every budget where it changes (one pass,
    :mod:`replay.analyses.curve`), the recorded budget and the knee marked; the budget answer as a
    table; the answer kept for the verdict (``ctx.shared["curve_answer"]``)."""
    from replay.analyses.curve import compute_curve
    from replay.present import plots
    from traces.util.units import budget_bytes

    # lru's curve (the answer's policy: the first) and each layer's own LRU curve (layer's pass)
    cv = compute_curve(loads, policies=("lru", "layer"), budgets_bytes=[budget_bytes(float(rec))] if rec is not None else [])
    a = cv.answer
    ctx.shared["curve_answer"] = a
    if cv.frame.height == 0 or a["metric"] is None:
        return
    f = cv.frame.filter(pl.col("policy") == "lru").sort("budget_mib")
    knee = next((k for k in a["knees"] if k["budget_mib"] is not None), None)  # the tightest tolerance that has one
    lines = dict(vlines)
    if knee is not None:
        lines[f"knee: within {knee['tolerance_pp']:g} pp of the plateau ({knee['budget_mib']:.1f} MiB)"] = knee["budget_mib"]
    series = {"lru": (f["budget_mib"].to_numpy(), f[a["metric"]].to_numpy())}
    ob = f.filter(pl.col("over_budget"))
    if ob.height:
        series["over budget (needs more memory)"] = (ob["budget_mib"].to_numpy(), ob[a["metric"]].to_numpy())
    what = "decode-only" if a["metric"] == "hit_pct_decode" else "cumulative"
    s.images.insert(0, plots.lines(
        series, ctx.out / "cache_lru_curve.png", f"LRU hit rate at every budget ({what}), exact", "cache budget (MiB/GiB, log scale)",
        f"{what} hit rate (%)", vlines=lines, budget_x=True, ylim=(0, 102), markers=False,
        # lru's colour in every figure (the series' name is not a policy name: style_for would pick another)
        styles={"lru (exact, every budget)": {"color": plots.color_for("lru")},
                "over budget (needs more memory)": {"linestyle": "none", "marker": "x", "markersize": 5, "color": "black"}},
        caption=f"How much cache LRU needs: its hit rate at each of the {f.height:,} budgets where it changes, computed in one "
                f"pass and equal to a replay at each. The plateau ({a['plateau_pct']:.1f}% at the working set, "
                f"{a['w_mib']:.1f} MiB) is where only first visits miss; the knee is the smallest budget within "
                f"{knee['tolerance_pp']:g} pp of it." if knee else
                f"How much cache LRU needs: its hit rate at each of the {f.height:,} budgets where it changes, exact; no "
                "within-budget budget comes within the knee's tolerance of the plateau."))
    if cv.per_layer is not None and cv.per_layer.height:
        # each layer's own curve: evidence behind the heatmap and layer-opt, shown collapsed under the figures
        s.images.insert(1, (*_layer_curves_figure(ctx, cv.per_layer, a["metric"], loads.n_expert)[:3], "collapsed"))
    # at_mib: a figure read off the curve (1 decimal), not a budget the user chose
    rows = [{"point": "plateau (working set W)", "at_mib": a["w_mib"], "hit_pct": a["plateau_pct"], "gain_pp": None}]
    rows += [{"point": f"knee: within {k['tolerance_pp']:g} pp of the plateau", "at_mib": k["budget_mib"],
              "hit_pct": k["hit_pct"], "gain_pp": None} for k in a["knees"]]
    rows += [{"point": "just below T (the cliff)", "at_mib": a["t_mib"], "hit_pct": a["below_t_pct"], "gain_pp": None},
             {"point": "at T", "at_mib": a["t_mib"], "hit_pct": a["at_t_pct"], "gain_pp": None}]
    rows += [{"point": f"doubling from {d['from_mib']:.1f} MiB", "at_mib": d["to_mib"], "hit_pct": d["hit_pct"],
              "gain_pp": d["gain_pp"]} for d in a["doublings"]]
    s.tables.append(Table("cache_budget_answer", pl.DataFrame(rows, schema_overrides={"at_mib": pl.Float64,
                                                                                      "hit_pct": pl.Float64,
                                                                                      "gain_pp": pl.Float64}),
                          f"how much cache LRU needs ({what} hit %, from its exact curve; `moe-replay curve` has every "
                          "budget): the plateau, the knees, the cliff below one token cycle T and what each doubling buys",
                          headers={"point": "point of the curve", "at_mib": "budget (MiB)", "hit_pct": f"{what} hit %",
                                   "gain_pp": "gain (points)"},
                          collapsed=True))  # the verdict's budget line names the knee; the figure above shows them all


def _layer_curves_figure(ctx: ReportContext, per_layer: pl.DataFrame, metric: str, n_expert: int) -> tuple[str, str, str]:
    """Each MoE layer's own LRU curve (hit % against the experts its share holds, 0..n_expert) as
    small multiples: one panel per layer, or per run of consecutive layers when there are more than
    :data:`replay.present.plots.SMALL_MAX_PANELS` (then the line is the mean of the run's layers'
    hit %, the band their lowest to highest)."""
    from replay.present import plots

    layers = sorted(int(x) for x in per_layer["layer"].unique())
    groups = plots.layer_groups(layers)
    what = "decode-only" if metric == "hit_pct_decode" else "cumulative"
    panels = []
    for g in groups:
        sub = per_layer.filter(pl.col("layer").is_in(g)).sort("layer", "entries")
        h = sub[metric].to_numpy().reshape(len(g), n_expert + 1)[:, 1:]  # 0 entries: nothing held, left out
        ov = sub["overflow_loads"].to_numpy().reshape(len(g), n_expert + 1)[:, 1:] > 0
        x = np.arange(1, n_expert + 1, dtype=np.float64)
        name = f"layer {g[0]}" if len(g) == 1 else f"layers {g[0]}-{g[-1]}"
        band = None if len(g) == 1 else np.stack([np.nanmin(h, axis=0), np.nanmax(h, axis=0)])
        panels.append((name, x, np.nanmean(h, axis=0), ov.any(axis=0), band))
    grouped = any(len(g) > 1 for g in groups)
    any_over = any(p[3].any() for p in panels)
    size = max(len(g) for g in groups)
    caption = (f"Each MoE layer's own LRU curve: its {what} hit rate when its share of the cache holds 1 to {n_expert} "
               "experts (exact, from one pass; the per-layer policies layer and layer-opt split the budget over these)"
               + (f"; {len(layers)} layers in {len(groups)} panels of up to {size} consecutive layers: the line is the mean "
                  "of the panel's layers' hit %, the band spans their lowest to highest" if grouped else
                  f"; one panel per layer ({len(layers)})")
               + (". Grey: some load of the layer (of a layer of the panel) needs more experts than the share holds "
                  "(over budget: that hit rate needs more memory)" if any_over else "")
               + ". A layer whose curve rises late needs a larger share.")
    return plots.small_multiples(panels, ctx.out / "cache_layer_curves.png", f"LRU hit rate per MoE layer ({what}), exact",
                                 "experts held (count)", f"{what} hit (%)", caption=caption)


OPT_BOUND_MAX_LOADS = 20_000  # Qwen's phone run: 6,192 loads, 7-30 s; a 3,000-token 16-layer trace (48,500): minutes


def _at_verdict_budgets(ctx: ReportContext, loads: Any, policies: list[str], model: Any) -> tuple[list[dict], list[str]]:
    """The cells the verdict picks from: every online policy in the registry (the ones given with
    ``--policies``, when given) and the Belady bound, at the verdict's budgets, sorted by budget, then
    decode hit % (highest first), then name; and the online policies compared."""
    from replay.analyses.cost_model import BOUNDS, with_time
    from replay.analyses.paired import annotate, with_requests
    from replay.analyses.policy_set import online_policies
    from replay.core.simulate import sweep

    online = online_policies(ctx.policies)
    if not ctx.verdict_budgets:
        return [], online
    from replay.policies.opt_bound import sizes_differ

    # opt-bound's exact LP (min-cost flow) grows faster than the loads: past OPT_BOUND_MAX_LOADS the report
    # does not compute it and says so (cache --policies opt-bound still does, at its own cost).
    n_loads = int(loads.load_lidx.shape[0])
    exact = sizes_differ(loads.layer_expert_bytes) and n_loads <= OPT_BOUND_MAX_LOADS
    if sizes_differ(loads.layer_expert_bytes) and not exact:
        ctx.shared["bound_not_computed_loads"] = n_loads
    bounds = ["belady", "opt-bound"] if exact else ["belady"]
    series: dict = {}
    frame = sweep(loads, [*online, *bounds], ctx.verdict_budgets, show_progress=False, series=series)
    if model is not None:
        frame = with_time(frame, model, ctx.trace.token_counts()["tokens_decode"])
    rows = frame.filter(pl.col("layer").is_null()).to_dicts()
    annotate(rows, with_requests(series, ctx.trace), model)  # each cell against LRU and the best, with the paired interval
    rows.sort(key=lambda r: (r["budget_mib"], r["policy"] in BOUNDS, -(r["hit_pct_decode"] or 0.0), r["policy"]))
    return rows, online


def _by_budget(overall: pl.DataFrame, policies: list[str], budgets: list[float], value: str, name: str, caption: str) -> Table:
    """One value of the cache cells as a policy x budget grid (over-budget cells marked)."""
    from replay.present.cost import time_marks

    rows, marks = [], {exact(b): [] for b in budgets}
    tm: dict[str, list[str]] = {exact(b): [] for b in budgets}
    for p in policies:
        row: dict[str, Any] = {"policy": p}
        for b in budgets:
            f = overall.filter((pl.col("policy") == p) & (pl.col("budget_mib") == b))
            r = f.row(0, named=True) if f.height else {}
            row[exact(b)] = r.get(value)
            marks[exact(b)].append(bool(r) and bool(r.get("overflow_loads") or 0))  # replay.core.simulate.is_over_budget
            tm[exact(b)].append(time_marks(r) if value in ("ms_per_token", "tok_s") else "")
        rows.append(row)
    frame = pl.DataFrame(rows, schema={"policy": pl.String, **{exact(b): pl.Float64 for b in budgets}})
    # The curves and tok/s figures show these numbers: with many policies (every registered online one,
    # the report's default) the table is collapsed, its numbers a click (HTML) or a CSV (Markdown) away.
    return Table(name, frame, caption, headers={exact(b): f"{exact(b)} MiB" for b in budgets}, marks=marks,
                 digits={exact(b): digits_for(value) for b in budgets}, time_marks=tm, collapsed=len(policies) > 8)


def section_prefetch(ctx: ReportContext) -> Section:
    from replay.analyses.prefetching import best_plain, prefetch, retain_sweep, with_prefetch_time
    from replay.core.simulate import loads_of
    from replay.predictors import report_prefetch_predictors, unavailable
    from replay.present import plots

    tr = ctx.trace
    s = Section("Prefetch and retention what-ifs")
    if tr.token_counts()["tokens_decode"] == 0:
        s.unavailable = "the trace has no decoded tokens (prefetch guesses are made for decode routings)"
        return s
    budgets, where = ctx.verdict_budgets, ctx.verdict_where
    predictors = []
    for fam, name in report_prefetch_predictors():
        reason = unavailable(fam, tr)
        if reason is None:
            predictors.append(name)
        else:
            s.missing.append((f"{fam} prefetch", reason))
    best = ctx.shared.get("predictor")
    if best is not None and best["predictor"] not in predictors:
        predictors.append(best["predictor"])  # the verdict's best predictor: its prefetch is the verdict's question
    rows = []
    model = ctx.shared.get("cost_model")
    for budget in budgets:
        for pred in predictors:
            for policy, guard in (("lru", False), ("lfru", True)):
                rows.append(prefetch(tr, pred, budget, policy=policy, guard=guard,
                                     model=model if ctx.profile is None else None, profile=ctx.profile))
    frame = pl.concat(rows, how="diagonal_relaxed")
    cols = (["budget_mib"] if len(budgets) > 1 else []) + [
        "predictor", "policy", "guard", "hit_pct_decode_baseline", "hit_pct_decode", "useful_pct",
        "total_mib_per_token_baseline", "total_mib_per_token"]
    budget = budgets[0]
    s.text.append(f"At {', '.join(exact(b) for b in budgets)} MiB ({where}): after each decode layer's load, the predictor's "
                  "guesses for the next "
                  "layer are read speculatively into the same cache (no cap, no drop). Demand hit % is decode-only; "
                  "bytes per decoded token include the speculative reads. A speculative read competes with demand "
                  "reads for the same flash bandwidth: more hits can still mean more time.")
    if ctx.profile is not None:  # report --time-model fitted|profile: the timeline's times and why
        from replay.present.whatif import with_timeline_verdict

        frame = with_timeline_verdict(frame)
        cols += ["ms_per_token_baseline", "ms_per_token", "useful_mib", "late_mib", "wasted_mib", "lane_busy_pct"]
        s.notes.append(" ".join(f"{r['predictor']} ({r['policy']}{' + guard' if r['guard'] else ''}"
                               + (f", {exact(r['budget_mib'])} MiB" if len(budgets) > 1 else "") + f"): {r['verdict']}."
                               for r in frame.to_dicts()))
    elif model is not None:
        from replay.present.whatif import with_verdict

        frame = with_verdict(with_prefetch_time(frame, model))
        cols += ["ms_per_token_baseline", "ms_per_token"]
        s.notes.append(" ".join(f"{r['predictor']} ({r['policy']}{' + guard' if r['guard'] else ''}"
                               + (f", {exact(r['budget_mib'])} MiB" if len(budgets) > 1 else "") + f"): {r['verdict']}."
                               for r in frame.to_dicts()))
    else:
        s.text.append("No cost model (no recorded metrics and none given): bytes are shown, not time.")
    for b in budgets:
        s.text.append(_plain_text(best_plain(tr, b, model), frame.filter(pl.col("budget_mib") == b), b, model))
    ctx.shared["prefetch_rows"] = frame.to_dicts()
    s.tables.append(Table("prefetch", frame, "prefetch against no prefetch (without), same budget and policy (decode); "
                          "speculative MiB, evictions and refusals in the CSV", columns=cols,
                          headers={"hit_pct_decode_baseline": "Hit % (decode, without)", "hit_pct_decode": "Hit % (decode, with)",
                                   "ms_per_token_baseline": "ms/token (without)", "ms_per_token": "ms/token (with)"}))
    s.images.append(plots.prefetch(
        [{"predictor": r["predictor"], "policy": f"{r['policy']}{'+guard' if r['guard'] else ''}",
          "x0": r["total_mib_per_token_baseline"], "y0": r["hit_pct_decode_baseline"],
          "x1": r["total_mib_per_token"], "y1": r["hit_pct_decode"]} for r in frame.to_dicts()
         if r["budget_mib"] == budget],
        ctx.out / "prefetch.png", f"Prefetch at {plots.budget_label(float(budget))}: from no prefetch (black) to prefetch",
        "expert reads per decoded token (MiB/token, demand + speculative)", "decode-only demand hit rate (%)",
        caption="A segment going up and not far right is a prefetch worth having: more demand hits for few extra bytes; "
                "going right alone means speculative reads that bought nothing."))
    loads = loads_of(tr)
    budgets = sorted({float(f"{f * tr.token_cycle_bytes / (1 << 20):.2g}") for f in (0.5, 1.5, 3.0)} | set(budgets))
    # report --time-model fitted|profile: each retention row also timed on the timeline, with and without
    ret = retain_sweep(tr, loads, ["lru", "lfru"], budgets, "prev-token", profile=ctx.profile).filter(pl.col("layer").is_null())
    ctx.shared["retention_rows"] = ret.filter(pl.col("budget_mib").is_in(ctx.verdict_budgets)).to_dicts()
    s.tables.append(Table("retention", ret, "retention of prev-token's guesses (zero extra bytes): decode hit % with and "
                          "without, change in points with its 95% interval (paired block bootstrap over decoded tokens) "
                          "and the call: better or worse only when the interval excludes zero, else tie",
                          columns=["policy", "budget_mib", "hit_pct_decode_no_retain", "hit_pct_decode", "retain_gain_pp_decode",
                                   "retain_gain_ci_low", "retain_gain_ci_high", "retain_vs_no_retain"],
                          headers={"hit_pct_decode": "Hit % (decode, with retention)"}))
    return s


def _plain_text(plain: dict | None, frame: pl.DataFrame, budget: float, model: Any) -> str:
    """The no-prefetch baseline of the best plain online policy at the budget, against the best what-if."""
    if plain is None:
        return f"No plain online policy fits {exact(budget)} MiB without overflowing, so there is no plain baseline."
    rows = frame.to_dicts()
    tok = rows[0]["tokens_decode"] if rows else 0
    txt = (f"Best plain policy at {exact(budget)} MiB (no prefetch; highest decode hit among online policies, ties by "
           f"name): {plain['policy']} {fmt_q(plain['hit_pct_decode'], 'pct')}% decode hit, "
           f"{fmt_q(plain['read_mib_decode'] / tok if tok else None, 'mib_per_token')} MiB per decoded token")
    if model is not None and plain.get("ms_per_token") is not None:
        from replay.present.cost import time_marks

        mk = time_marks({**plain, "cost_model_foreign": getattr(model, "foreign", False)})
        txt += f", {fmt_q(plain['ms_per_token'], 'ms')} ms/token{mk} ({fmt_q(plain['tok_s'], 'tok_s')} tok/s{mk})"
        beaten = [r for r in rows if r["ms_per_token"] is not None and r["ms_per_token"] < plain["ms_per_token"]]
        what = "time under the cost model"
    else:
        beaten = [r for r in rows if r["hit_pct_decode"] is not None and r["hit_pct_decode"] > plain["hit_pct_decode"]]
        what = "decode hit %"
    names = [f"{r['predictor']} ({r['policy']}{' + guard' if r['guard'] else ''})" for r in beaten]
    txt += (". On " + what + ", " + (", ".join(names) + " beat" + ("s" if len(names) == 1 else "") + " it"
                                      if names else "no prefetch what-if above beats it") + ".")
    return txt


def section_quality(ctx: ReportContext) -> Section:
    """Quality results of ``moe-replay quality`` (validated and matched before anything is written)."""
    from replay.analyses.quality_result import quality_frame
    from replay.present.quality import TITLE, quality_section

    results = ctx.shared.get("quality") or []
    if not results:
        return Section(TITLE, unavailable="no quality result given (run 'moe-replay quality', then 'report --quality OUT')")
    model = ctx.shared.get("cost_model") or ctx.cost_model
    return quality_section(results, quality_frame(results, model), model, ctx.out)


SECTIONS: list[Callable[[ReportContext], Section]] = [
    section_summary, section_predictors, section_cost, section_cache, section_popularity, section_drop,
    section_prefetch, section_quality,
]


# -- the verdict -------------------------------------------------------------------------------


def verdict_budgets(trace: Trace, given: Sequence[float] | None) -> tuple[list[float], str]:
    """The budgets the verdict answers for (and drop-cold and prefetch run at), and where they come
    from: the ones given, else the recorded budget, else 2 x T (two token cycles, 2 significant figures)."""
    if given:
        return sorted({float(b) for b in given}), "given"
    rec = trace.recorded.get("budget_mib")
    if rec is not None:
        return [float(rec)], "the recorded budget"
    two_t = 2 * trace.token_cycle_bytes / (1 << 20)
    return [float(f"{two_t:.2g}")], f"2 x T = {two_t:.1f} MiB rounded to 2 significant figures: no recorded budget"


def build_verdict(ctx: ReportContext) -> list[dict[str, Any]]:
    """The answer as rows (``kind``: cache, cost, predictor, prefetch, drop, quality), every figure
    copied from the row of the verb that computes it (``cache``, ``predict``, ``prefetch``, ``drop``;
    ``quality``'s quality.json with ``--quality``): what
    :func:`replay.present.verdict.verdict_lines` prints and ``verdict.json`` holds."""
    from replay.analyses.cost_model import BOUNDS
    from replay.analyses.paired import decide
    from replay.core.simulate import is_over_budget, within_budget

    rows: list[dict[str, Any]] = []
    if ctx.shared.get("locality") is not None:  # the first question: is this routing cacheable at all?
        rows.append({"kind": "cacheable", **ctx.shared["locality"]})
    if ctx.shared.get("budget_answer") is not None:  # which budget? (replay.analyses.budget_choice)
        rows.append(dict(ctx.shared["budget_answer"]))
    cells = ctx.shared.get("cache_rows") or []
    compared = ctx.shared.get("cache_compared") or []
    model = ctx.shared.get("cost_model")
    for b in ctx.verdict_budgets:
        at = {r["policy"]: r for r in cells if r["budget_mib"] == b}
        if not at:
            continue
        ok, over = within_budget([r for p, r in sorted(at.items()) if p not in BOUNDS])
        dec = decide([r for p, r in sorted(at.items())])  # the one rule (replay.analyses.paired): best, ties, against LRU
        dec_t = decide([r for p, r in sorted(at.items())], "ms_per_token") if model is not None else None
        best = dec["best"] if dec else None
        fastest = dec_t["best"] if dec_t else None
        row: dict[str, Any] = {"kind": "cache", "budget_mib": b, "budget_from": ctx.verdict_where, "policies_compared": compared}
        for prefix, r in (("", best), ("lru_", at.get("lru"))):
            row.update({f"{prefix}{k}": (r or {}).get(k) for k in ("hit_pct_decode", "read_mib", "preload_mib", "ms_per_token",
                                                                   "tok_s")})
            row[f"{prefix}over_budget"] = is_over_budget(r) if r else None
            row[f"{prefix}peak_resident_mib"] = (r or {}).get("peak_resident_mib")
        row["policy"] = best["policy"] if best else None
        bel = at.get("belady")
        row["belady_hit_pct_decode"] = bel["hit_pct_decode"] if bel else None
        row["belady_over_budget"] = is_over_budget(bel) if bel else None
        row["belady_peak_resident_mib"] = bel["peak_resident_mib"] if bel else None
        row["gap_to_belady_pp"] = (None if best is None or bel is None or None in (best["hit_pct_decode"], bel["hit_pct_decode"])
                                   else bel["hit_pct_decode"] - best["hit_pct_decode"])
        ub = at.get("opt-bound")  # only with unequal expert sizes, where belady is a heuristic
        if ctx.shared.get("bound_not_computed_loads") is not None:
            row["bound_not_computed_loads"] = ctx.shared["bound_not_computed_loads"]
        if ub is not None:
            row["bound_hit_pct_decode"] = ub["hit_pct_decode"]
            row["gap_to_bound_pp"] = (None if best is None or None in (best["hit_pct_decode"], ub["hit_pct_decode"])
                                      else ub["hit_pct_decode"] - best["hit_pct_decode"])
        row.update({f"fastest_{k}": (fastest or {}).get(k) for k in ("policy", "ms_per_token", "tok_s", "hit_pct_decode")})
        for prefix, d in (("", dec), ("fastest_", dec_t)):  # the paired interval against LRU, and the ties
            row.update({f"{prefix}vs_lru": (d or {}).get("call"),
                        f"{prefix}{'delta_ms_vs_lru' if prefix else 'delta_vs_lru_pp'}": (d or {}).get("delta"),
                        f"{prefix}delta_ci_low": (d or {}).get("low"), f"{prefix}delta_ci_high": (d or {}).get("high"),
                        f"{prefix}tied_with": (d or {}).get("tied"), f"{prefix}vs_lru_text": (d or {}).get("text")})
        row["over_budget_left_out"] = ", ".join(f"{r['policy']} (peak {fmt_q(r['peak_resident_mib'], 'mib')} MiB)"
                                                for r in over) or None
        ans = ctx.shared.get("curve_answer")
        if ans and ans.get("metric") and not any(x["kind"] == "cache" for x in rows):  # the knee, once: on the budget answer
            knee = next((k for k in ans["knees"] if k["budget_mib"] is not None), None)  # (or the first budget's line)
            at = next((x for x in rows if x["kind"] == "budget"), row)
            at.update({"curve_plateau_pct": ans["plateau_pct"], "curve_knee_mib": knee and knee["budget_mib"],
                       "curve_knee_tolerance_pp": knee and knee["tolerance_pp"],
                       "curve_knee_hit_pct": knee and knee["hit_pct"]})
        rows.append(row)
    tail: list[dict[str, Any]] = []  # the predictor and the cost model: after the four answers (budget, policy, prefetch, drop)
    if model is not None and rows:
        given = ctx.cost_model is not None
        source = ("a manual model given on the command line (an assumption, not a measurement)" if model.kind == "manual"
                  else ("given with --cost-model, FOREIGN: fitted on another model or device" if model.foreign
                        else "given with --cost-model") if given else "fitted on this run's recorded metrics (so in-sample here)")
        tail.append({"kind": "cost", "source": source, "model": model.model})
    pred = ctx.shared.get("predictor")
    if pred is not None:
        tail.insert(0, {"kind": "predictor", **{k: pred[k] for k in ("predictor", "slot_acc_pct", "whole_acc_pct", "scored")},
                     # held out: its interval and how it compares with prev-token on the same resamples
                     **{k: pred.get(k) for k in ("slot_acc_ci_low", "slot_acc_ci_high", "vs_prev_token_pp",
                                                 "vs_prev_token_ci_low", "vs_prev_token_ci_high", "vs_prev_token",
                                                 "train")}})
        timed = model is not None
        for b in ctx.verdict_budgets:
            cand = [r for r in ctx.shared.get("prefetch_rows", []) if r["predictor"] == pred["predictor"] and r["budget_mib"] == b]
            if not cand:
                continue
            # the configuration that helps most among those that read something speculatively (a row that read
            # nothing says nothing about prefetching): most ms/token saved (with a cost model), else most decode hit
            # points gained; the first of equals, in the order the section shows
            timed = timed or ctx.profile is not None
            gain = ((lambda r: r["ms_per_token_baseline"] - r["ms_per_token"]) if timed
                    else (lambda r: (r["hit_pct_decode"] or 0.0) - (r["hit_pct_decode_baseline"] or 0.0)))
            r = max([r for r in cand if r.get("spec_fills")] or cand, key=gain)
            rows.append({"kind": "prefetch", **{k: r.get(k) for k in (
                "budget_mib", "predictor", "policy", "guard", "hit_pct_decode_baseline", "hit_pct_decode",
                "total_mib_per_token_baseline", "total_mib_per_token", "ms_per_token_baseline", "ms_per_token", "tok_s_baseline",
                "tok_s", "spec_fills", "delta_hit_pp", "delta_hit_ci_low", "delta_hit_ci_high", "vs_baseline",
                "delta_ms_per_token", "delta_ms_ci_low", "delta_ms_ci_high", "vs_baseline_time")},
                         **({k: r.get(k) for k in (
                             "time_model", "spec_mib_timed", "useful_mib", "late_mib", "wasted_mib", "lane_busy_pct",
                             "lane_busy_pct_baseline", "stall_ms_per_token", "stall_ms_per_token_baseline")}
                            if ctx.profile is not None else {})})
    for r in ctx.shared.get("retention_rows") or []:  # retention of prev-token's guesses: zero extra bytes
        rows.append({"kind": "retention", **{k: r.get(k) for k in (
            "budget_mib", "policy", "retain_predictor", "hit_pct_decode_no_retain", "hit_pct_decode", "retain_gain_pp_decode",
            "retain_gain_ci_low", "retain_gain_ci_high", "retain_vs_no_retain")},
                     **({k: r.get(k) for k in ("time_model", "ms_per_token", "ms_per_token_no_retain",
                                               "retain_ms_saved_per_token", "retain_ms_ci_low", "retain_ms_ci_high",
                                               "retain_vs_no_retain_time")} if ctx.profile is not None else {})})
    if "drop" in ctx.shared:
        mode, budget, drops = ctx.shared["drop"]
        time_cols = (["ms_per_token_baseline", "ms_per_token", "ms_saved_per_token"]
                     + (["time_model", "ms_saved_ci_low", "ms_saved_ci_high", "vs_baseline_time"] if ctx.profile is not None else [])
                     if model is not None or ctx.profile is not None else [])
        rows += [{"kind": "drop", "mode": mode, "budget_mib": budget, "policy": "lru" if mode == "closed" else None,
                  "frac": r["frac"], "io_saved_pct": r["io_saved_pct"], "mass_lost_pct": r["mass_lost_pct"],
                  "io_saved_ci_low": r.get("io_saved_ci_low"), "io_saved_ci_high": r.get("io_saved_ci_high"),
                  **{k: r.get(k) for k in time_cols}} for r in drops]
    rows += tail
    for res in ctx.shared.get("quality") or []:  # drop-cold measured in the model (report --quality): quality.json's rows
        rows += [{"kind": "quality", "quality": res.name, "engine": res.obj["engine"], "policy": res.obj["policy"],
                  "budget_mib": res.obj["budget_mib"], "random_weights": res.random_weights, "setting": r["setting"],
                  **{k: r.get(k) for k in ("frac", "keep_k", "io_saved_pct", "io_saved_pct_replay", "ppl_delta_pct", "kl_mean", "kl_p95",
                                           "top1_agree_pct")}} for r in res.obj["rows"]]
    return rows


def _mark_foreign(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Verdict rows with a time figure (or the cost row) carry ``cost_model_foreign`` under a
    foreign cost model (replay.analyses.cost_origin)."""
    return [{**r, "cost_model_foreign": True}
            if r["kind"] == "cost" or r.get("measure") == "ms_per_token"
            or any(v is not None for k, v in r.items() if "ms_per_token" in k or "tok_s" in k or k.startswith("ms_")) else r
            for r in rows]


_TIME_UNIT = re.compile(r"(?<=\d) (ms/token|tok/s)\b(?![\^~])")  # a figure already marked keeps its marks


def _mark_foreign_lines(lines: list[str]) -> list[str]:
    """Every time figure of the verdict's sentences marked as foreign (its unit followed by ~), and
    the sentence that says why, first."""
    from replay.present.cost import foreign_legend

    return [foreign_legend("(see Cost model)") + ".", *(_mark_time_units(ln) for ln in lines)]


def _mark_time_units(text: str) -> str:
    from replay.present.cost import FOREIGN

    return _TIME_UNIT.sub(lambda m: f" {m.group(1)}{FOREIGN}", text)


# -- rendering ---------------------------------------------------------------------------------


def write_report(trace_dir: str | Path, out_dir: str | Path, budgets_mib: list[float] | None = None,
                 policies: list[str] | None = None, cost_model: Any = None, force: bool = False,
                 progress: Callable[[str], None] | None = None, inputs: Sequence[str | Path | None] = (),
                 budget_mib: Sequence[float] | None = None, quality: Sequence[str | Path] = (),
                 foreign_cost_model: bool = False, time_model: str | None = None, device_profile: Any = None) -> Path:
    """Build every section and write index.md, index.html, verdict.json, PNGs and tables/*.csv into ``out_dir``.

    ``budgets_mib``: the cache sweep's budgets; ``budget_mib``: the budgets the verdict answers for
    (default: the recorded one) and drop-cold and prefetch run at, added to the sweep.
    ``inputs``: files read besides the trace (a cost model); ``out_dir`` may not be, hold or lie in one.
    ``quality``: results of ``moe-replay quality`` (directories or their quality.json) for the Quality section.
    ``cost_model`` fitted on another model or device: refused unless ``foreign_cost_model``, then
    every time figure is marked (replay.analyses.cost_origin). ``time_model`` ``"fitted"`` /
    ``"profile"`` (with ``device_profile``): the prefetch what-ifs and the verdict's prefetch line are
    timed on the timeline (replay.analyses.timeline), the Cost model section shows it and a per-token
    plot; the cache tables keep the linear model."""
    from replay.analyses.quality_result import load_all
    from replay.core.simulate import check_state_fits

    trace = open_trace(trace_dir)
    check_state_fits(trace)  # every section but the summary holds per-(layer, expert) arrays
    if cost_model is not None:  # before anything is written: refused, or a copy marked foreign
        from replay.analyses.cost_origin import apply_to

        cost_model = apply_to(cost_model, trace, foreign=foreign_cost_model)
    from replay.analyses.timeline_whatif import check_time_model, timeline_profile

    check_time_model(time_model, device_profile)
    profile, scores = timeline_profile(trace, time_model if time_model != "linear" else None,
                                       device_profile)  # before anything is written: a bad profile is refused
    name = Path(trace_dir).resolve().name  # `report .` is named after the directory, not ""
    # Read before anything is written: a section's UserError would only mark it unavailable.
    results = load_all(list(quality), trace, name)
    read = [r.path for r in results] + [r.plain.path for r in results if r.plain is not None]  # the files, not their dirs
    with staged_dir(out_dir, force=force, inputs=[trace_dir, *inputs, *read]) as stage:
        (stage / "tables").mkdir()
        vb, where = verdict_budgets(trace, budget_mib)
        ctx = ReportContext(trace, name, stage, budgets_mib, policies, vb, where, cost_model, progress)
        ctx.shared["quality"] = results
        ctx.profile = profile
        ctx.shared["timeline_scores"] = scores
        sections = []
        for build in SECTIONS:
            if progress:
                progress(build.__name__.removeprefix("section_"))
            if trace.n_rows == 0 and build is not section_summary:
                # An interrupted capture that wrote no rows: the summary says so, the rest has nothing to show.
                sections.append(Section(build.__name__.removeprefix("section_").replace("_", " ").capitalize(),
                                        unavailable="the trace holds no routings"))
                continue
            try:
                sections.append(build(ctx))
            except UserError as e:
                sections.append(Section(build.__name__.removeprefix("section_").replace("_", " ").capitalize(),
                                        unavailable=str(e).rstrip(".").replace(str(trace.path), name)))
        for s in sections:
            for t in s.tables:
                atomic_write_text(stage / "tables" / f"{t.name}.csv", t.frame.write_csv(float_precision=6))
        rows = build_verdict(ctx) if trace.n_rows else []
        foreign = cost_model is not None and cost_model.foreign
        if foreign:
            rows = _mark_foreign(rows)
            for s in sections:  # the sections' sentences: their tables mark their own cells
                s.text, s.notes = [_mark_time_units(x) for x in s.text], [_mark_time_units(x) for x in s.notes]
        atomic_write_text(stage / "verdict.json", json_object("report", name, rows, budgets_mib=vb, budget_from=where) + "\n")
        lines = verdict_lines(rows, {s.title: s.anchor for s in sections if not s.unavailable})
        if foreign:
            lines = _mark_foreign_lines(lines)
        title = f"moe-replay report: {trace.model['name']}"
        atomic_write_text(stage / "index.md", render_markdown(title, sections, lines))
        atomic_write_text(stage / "index.html", render_html(title, sections, stage, lines))
    return Path(out_dir)
