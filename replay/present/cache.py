"""``cache``'s text: the hit-rate, MiB and ms/token grids, the over-budget note, retention and
``--validate``, from :func:`replay.api.cache` / :func:`replay.core.simulate.validate`'s rows."""

from __future__ import annotations

from typing import Any

import polars as pl

from replay.core.notes import COLLAPSE  # noqa: F401 (re-exported; kept beside NO_DECODE for cache --json's fast path)
from replay.core.phases import PHASE_HIT_KEY
from replay.core.simulate import VALIDATE_TOLERANCE_PP, is_over_budget, validate_ok
from replay.policies import names, policy_module
from replay.present.cost import time_marks, verdict
from replay.present.format import PRECISION, digits_for, exact, fmt, header_for, rows_of, text_table

OVER = " !"  # marks an over-budget cell in the text tables
BELOW_T = " *"  # marks a budget below one token cycle T, in every grid that shows budgets
BELOW_T_LEGEND = "* budget below one token cycle T = {T:.1f} MiB."


def sweep_text(t, frame, pols, blist, T, W, chosen, phase, per_layer, collapsed, loads=None, popts=None) -> str:

    overall = rows_of(frame.filter(frame["layer"].is_null()))
    cell = {(r["policy"], r["budget_mib"]): r for r in overall}
    lead = PHASE_HIT_KEY[phase]

    any_over = any(is_over_budget(c) for c in cell.values())

    def grid(field: str) -> str:
        rows = []
        for b in blist:
            row = {"budget": exact(b) + (BELOW_T if b < T else "")}
            for p in pols:
                c = cell[(p, b)]
                row[p] = fmt(c[field], digits_for(field)) + (OVER if is_over_budget(c) else " " * len(OVER) if any_over else "")
            rows.append(row)
        return "\n".join(line.rstrip() for line in text_table(rows, ["budget", *pols], [header_for("budget_mib"), *pols]).splitlines())

    counts = t.token_counts()
    lines = [
        f"trace    {t.path} ({t.model.get('name')}, {len(t.moe_layers)} MoE layers x {t.n_expert} experts, top-{t.top_k}; "
        f"{counts['tokens_prefill']:,} prefill + {counts['tokens_decode']:,} decode tokens)",
        f"T        one token cycle = {T:.1f} MiB (sum over MoE layers of top_k x expert_bytes); "
        f"working set W = {W:.1f} MiB (every (layer, expert) the trace touches)",
        f"budgets  {chosen}",
        "lookup   one unique (layer, expert) per load ((batch, layer) group); hit % = hits / lookups",
        "",
    ]
    decode = "decode-only hit % (decode loads only; prefill excluded)"
    cum = "cumulative hit % (prefill included, as the engine's cache_hit_pct)"
    order = [("hit_pct_decode", decode), ("hit_pct_cum", cum)]
    if lead == "hit_pct_prefill":
        order.insert(0, ("hit_pct_prefill", "prefill-only hit % (prompt loads only; decode excluded)"))
    order.sort(key=lambda o: o[0] != lead)
    for field, title in order:
        lines += [title, grid(field), ""]
    lines += ["MiB read by misses, all phases (bytes, not time)", grid("read_mib"), ""]
    if any(b < T for b in blist):
        lines.append(BELOW_T_LEGEND.format(T=T))
    if collapsed:
        vals = ", ".join(f"{r['hit_pct_decode']:.1f}% at {exact(r['budget_mib'])} MiB" for r in collapsed)
        lines.append(f"  Here {COLLAPSE} (LRU decode-only hit: {vals}).")
    note = over_budget_note([cell[(p, b)] for p in pols for b in blist])
    if note:
        lines.append(f"{OVER.strip()} {note[0].upper()}{note[1:]}")
    if "infinite" in pols:
        lines.append("infinite = no eviction: only compulsory misses, the bound for any policy at any budget.")
    if "belady" in pols:
        from replay.policies.opt_bound import sizes_differ

        if sizes_differ([t.expert_bytes[l] for l in t.moe_layers]):
            lines.append("belady = evict the entry whose next load is furthest: with these unequal expert sizes a heuristic, "
                         "not a bound (opt-bound is one).")
        else:
            lines.append("belady = evict the entry whose next load is furthest: the offline bound at that budget.")
    if loads is not None:
        from replay.core.simulate import budget_bytes, check_policy_options
        from replay.policies import policy_module

        for p in pols:
            pm = policy_module(p)
            if hasattr(pm, "describe"):
                opts = check_policy_options(p, (popts or {}).get(p), loads)
                lines.append(pm.describe(loads, [budget_bytes(b) for b in blist], opts))
        if "preload_mib" in frame.columns:
            pre = [r for r in overall if (r.get("preload_mib") or 0) > 0]
            if pre:
                lines.append("preloaded before the replay (resident from the start; not in MiB read): "
                             + ", ".join(f"{r['policy']} {r['preload_mib']:.1f} MiB at {exact(r['budget_mib'])} MiB" for r in pre)
                             + ".")
    if "lfu" in pols or "layerlfu" in pols:
        lines.append("lfu / layerlfu count every load that touched an entry since the start of the run (the count survives "
                     "eviction); lfu-incache / layerlfu-incache restart it at admission.")
    if "lfru" in pols and "lfu-incache" in pols:
        same = all(cell[("lfru", b)]["hits"] == cell[("lfu-incache", b)]["hits"] for b in blist)
        if same:
            lines.append("lfru = lfu-incache, by construction: lfru's frequency is the in-cache count and fills the high bits, "
                         "and the recency byte only orders entries of equal frequency by last load, which is the least-recent "
                         "tie-break lfu-incache already uses.")
    if per_layer:
        _rows = rows_of

        rows = _rows(frame.filter(frame["layer"].is_not_null()))
        extra = [c for c in ("share_mib", "preload_mib") if c in frame.columns]
        lines += ["", "per layer" + (" (share_mib: the layer's budget under a per-layer partition; preload_mib: bytes "
                                     "resident from the start)" if extra else ""), text_table(
            rows, ["policy", "budget_mib", "layer", "lookups", "hits", "hit_pct_decode", "hit_pct_cum", "read_mib", *extra],
            digits={"budget_mib": 0, "hit_pct_decode": 1, "hit_pct_cum": 1, "read_mib": 1, "share_mib": 1, "preload_mib": 1})]
    return "\n".join(lines)


def time_text(frame, pols, blist, cmodel, T: float | None = None) -> str:
    """The ms/token grid and which configuration wins on time (not just on hits); a budget below one
    token cycle ``T`` (MiB) marked * as in the hit-rate grids."""

    overall = rows_of(frame.filter(frame["layer"].is_null()))
    cell = {(r["policy"], r["budget_mib"]): r for r in overall}
    any_over = any(is_over_budget(c) for c in cell.values())
    width = max((len(time_marks(c)) for c in cell.values()), default=0)
    rows = []
    for b in blist:
        row = {"budget": exact(b) + (BELOW_T if T is not None and b < T else "")}
        for p in pols:
            c = cell[(p, b)]
            mark = OVER if is_over_budget(c) else " " * len(OVER) if any_over else ""
            row[p] = fmt(c["ms_per_token"], digits_for("ms_per_token")) + time_marks(c).ljust(width) + mark
        rows.append(row)
    bw = cmodel.bandwidth_mib_s
    kind = f"{'FOREIGN ' if cmodel.foreign else ''}{cmodel.kind}"
    lines = [f"estimated ms per decoded token ({kind} model: {cmodel.model}; intercept {cmodel.intercept_ms:.1f} ms, "
             f"{cmodel.ms_per_mib:.4f} ms/MiB" + (f" = {bw:.0f} MiB/s" if bw else "") + ")",
             "\n".join(line.rstrip() for line in text_table(rows, ["budget", *pols], [header_for("budget_mib"), *pols]).splitlines())]
    if T is not None and any(b < T for b in blist):
        lines.append(BELOW_T_LEGEND.format(T=T))
    lines += verdict(overall)
    return "\n".join(lines)


def validate_text(t, row) -> str:
    rec = row["recorded_hit_pct_cum"]
    lines = [
        f"validate  LRU replay of {t.path} at {exact(row['budget_mib'])} MiB "
        f"(engine's recorded budget: {row['recorded_budget_mib'] if row['recorded_budget_mib'] is not None else 'none'})",
    ]
    if rec is not None:
        ok = validate_ok(row)
        tol = f"{VALIDATE_TOLERANCE_PP:g} points"
        lines.append(f"cumulative hit % (prefill included): replay {row['hit_pct_cum']:.3f}, engine {rec} "
                     f"(its summary line), difference {row['diff_pp']:+.3f} points -> "
                     + (f"within {tol}" if ok else f"NOT within {tol}: the replay does not reproduce the engine (exit 1)"))
    else:
        lines.append(f"cumulative hit % (prefill included): replay {row['hit_pct_cum']:.3f}; the trace records no engine hit rate")
    if row["token_max_abs_diff_pp"] is not None:
        lines.append(f"per decoded token, cumulative hit %: largest gap to the engine's metrics {row['token_max_abs_diff_pp']:.4f} "
                     "points (the engine prints 2 decimals, so up to 0.005 is rounding)")
    if row["slots_compared"] is None:
        lines.append("row by row: the trace has no recorded residency column")
    else:
        lines.append(f"row by row: {row['slots_compared']:,} routed slots, hit/miss agrees on {row['slot_agree_pct']:.3f}%"
                     + (f"; bytes read per slot agree on {row['read_bytes_agree_pct']:.3f}%"
                        if row["read_bytes_agree_pct"] is not None else ""))
        lines.append("  (a lookup is one unique expert per load; a repeat inside a load carries its lookup's outcome and "
                     "reads 0 bytes, on both sides, as the engine records it)")
        if row["first_disagreement"]:
            lines.append(f"  first disagreement: {row['first_disagreement']}")
            if row["recorded_spec_hits"]:
                lines.append(f"  the engine marked {row['recorded_spec_hits']} slots as speculative hits (prefetch), "
                             "which this LRU replay does not model")
    return "\n".join(lines)


def over_budget_note(rows: list[dict[str, Any]]) -> str | None:
    """One sentence naming every over-budget cell with its peak and overflowed loads, or None."""
    over = [r for r in rows if is_over_budget(r)]
    if not over:
        return None
    cells = "; ".join(f"{r['policy']} at {exact(r['budget_mib'])} MiB (peak {r['peak_resident_mib']:.1f} MiB resident, "
                      f"{r['overflow_loads']:,} loads overflowed)" if r.get("peak_resident_mib") is not None else
                      f"{r['policy']} at {exact(r['budget_mib'])} MiB ({r['overflow_loads']:,} loads overflowed)" for r in over)
    parts = ", ".join(p for p in names() if policy_module(p).PARTITION == "layer")
    return (f"over budget: a load needed more than the budget (or its layer's share under a per-layer partition: {parts}), "
            "so the cache overflowed"
            f" and the hit rate needs more memory than listed: {cells}.")


def retain_text(frame: pl.DataFrame, policies: list[str], budgets_mib: list[float]) -> str:
    """The hit-rate change retention buys, per policy and budget (percentage points)."""

    overall = rows_of(frame.filter(pl.col("layer").is_null()))
    cell = {(r["policy"], r["budget_mib"]): r for r in overall}
    name = overall[0]["retain_predictor"] if overall else "?"
    out = ["", f"retention ({name}'s guesses for the next layer(s) protected from eviction; zero extra bytes): the hit % "
           "tables above are WITH retention; change against the same replay without it, in points"]
    train = overall[0].get("retain_train") if overall else None
    if train == "in-sample":
        out.append(f"IN-SAMPLE: {name} was fitted on the very tokens it guesses for (it has seen the answers).")
    elif train not in (None, "none"):
        out.append(f"{name} was fitted held out ({train}): the tokens it learned from get no guesses.")
    for field, title in (("retain_gain_pp_decode", "decode-only"), ("retain_gain_pp_cum", "cumulative (prefill included)")):
        rows = [{"budget": exact(float(b)), **{p: cell[(p, b)][field] for p in policies}} for b in budgets_mib]
        out += [title, text_table(rows, ["budget", *policies], [header_for("budget_mib"), *policies], digits=PRECISION["pp"])]
    if overall and "retain_vs_no_retain" in overall[0]:
        from replay.analyses.paired import signed, tie_text

        def said(r: dict) -> str:
            lo, hi = r["retain_gain_ci_low"], r["retain_gain_ci_high"]
            if r["retain_vs_no_retain"] is None:
                return f"{signed(r['retain_gain_pp_decode'])} (no interval: too few decoded tokens)"
            iv = f"{signed(r['retain_gain_pp_decode'])} [{signed(lo)}, {signed(hi)}]"
            return f"{iv} {tie_text((hi - lo) / 2, '')}" if r["retain_vs_no_retain"] == "tie" else f"{iv} {r['retain_vs_no_retain']}"

        out.append("decode-only change with its 95% interval (paired block bootstrap over decoded tokens; better or worse "
                   "only when the interval excludes zero): "
                   + "; ".join(f"{p} at {exact(float(b))} MiB {said(cell[(p, b)])}" for p in policies for b in budgets_mib))
    out.append("Hit % is not time: retention reads no extra bytes, so fewer misses are fewer bytes here (see the MiB table).")
    return "\n".join(out)


def compact_text(t, frame: pl.DataFrame, pols: list[str], blist: list[float]) -> str:
    """One line per (policy, budget) cell, as libCacheSim's ``cachesim`` prints its results
    (trace, algorithm, cache size, requests, miss ratio, byte miss ratio), with this tool's units:
    lookups are (layer, expert) per load, ratios over decode lookups and, cumulative, all of them."""
    cells = {(r["policy"], r["budget_mib"]): r for r in rows_of(frame.filter(pl.col("layer").is_null()))}
    name = t.path.name
    out = []
    for p in pols:
        for b in blist:
            r = cells[(p, b)]
            miss_dec = None if r["hit_pct_decode"] is None else 1.0 - r["hit_pct_decode"] / 100.0
            miss_cum = None if r["hit_pct_cum"] is None else 1.0 - r["hit_pct_cum"] / 100.0
            line = (f"{name} {p} cache size {exact(b)} MiB, {r['lookups']} lookups, decode miss ratio {fmt(miss_dec, 4)}, "
                    f"cumulative miss ratio {fmt(miss_cum, 4)}, {fmt(r['read_mib'], PRECISION['mib'])} MiB read")
            if "ms_per_token" in r:
                line += f", {fmt(r['ms_per_token'], PRECISION['ms'])} ms/token"
            if is_over_budget(r):
                line += f", OVER BUDGET (peak {fmt(r.get('peak_resident_mib'), PRECISION['mib'])} MiB)"
            out.append(line)
    return "\n".join(out)


def timeline_text(frame) -> str:
    """``cache --time-model fitted|profile``: each cell's time per decoded token on the timeline,
    and against LRU at the same budget (paired interval; tie unless it excludes 0); with --retain,
    against the same cell without retention."""
    from replay.analyses.paired import interval_text, tie_text
    from replay.present.format import exact, fmt_q

    rows = [r for r in frame.to_dicts() if r.get("layer") is None and r.get("ms_per_token") is not None]
    if not rows:
        return "timeline: no cell could be timed"
    r0 = rows[0]
    which = "profile fitted on this run's metrics" if r0["time_model"] == "fitted" else f"profile {r0['time_profile']}"
    out = [f"time per decoded token on the timeline ({which}: {r0['time_lanes']} lanes x {fmt_q(r0['time_lane_mib_s'], 'mib')} "
           f"MiB/s, compute {fmt_q(r0['time_compute_ms_per_layer'], 'ms_per_miss')} ms per layer, expert share "
           f"{fmt_q(r0['time_expert_share'], 'pp')}, overlap {'on' if r0['time_overlap'] else 'off'}):"]
    for r in rows:
        vs = ""
        if "retain_vs_no_retain_time" in r:  # cache --retain: the same cell without retention
            saved, lo, hi = r["retain_ms_saved_per_token"], r["retain_ms_ci_low"], r["retain_ms_ci_high"]
            call = r["retain_vs_no_retain_time"]
            vs = (f"; without retention {fmt_q(r['ms_per_token_no_retain'], 'ms')} ms: retention "
                  + (tie_text((hi - lo) / 2, " ms/token") if call == "tie"
                     else "saves " + interval_text(saved, lo, hi, " ms/token") if call == "better"
                     else "costs " + interval_text(-saved, -hi, -lo, " ms/token")))
        elif r.get("vs_lru_time") == "tie":
            vs = "; vs lru: " + tie_text((r["delta_ms_ci_high"] - r["delta_ms_ci_low"]) / 2, " ms/token")
        elif r.get("vs_lru_time") is not None:
            vs = (f"; vs lru: {'faster' if r['vs_lru_time'] == 'better' else 'slower'} "
                  + interval_text(r["delta_ms_vs_lru"], r["delta_ms_ci_low"], r["delta_ms_ci_high"], " ms/token"))
        out.append(f"  {r['policy']:<12} {exact(r['budget_mib']):>8} MiB  {fmt_q(r['ms_per_token'], 'ms'):>7} ms  "
                   f"{fmt_q(r['tok_s'], 'tok_s'):>6} tok/s  stall {fmt_q(r['stall_ms_per_token'], 'ms')} ms  lanes busy "
                   f"{fmt_q(r['lane_busy_pct'], 'pct')}%{vs}")
    if r0["time_profile_source"] == "preset":
        out.append(f"  ({r0['time_profile']} is a preset: an assumption about a class of device, not a measurement)")
    return "\n".join(out)
