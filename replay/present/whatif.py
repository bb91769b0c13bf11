"""``drop`` and ``prefetch``'s text (and the sentence a prefetch row's ``verdict`` column holds),
from :func:`replay.api.drop` / :func:`replay.api.prefetch`'s rows."""

from __future__ import annotations

import polars as pl

from replay.core.phases import PHASE_HIT_KEY
from replay.present.cost import EXTRAPOLATED, EXTRAPOLATED_LEGEND, FOREIGN, foreign_legend
from replay.present.format import exact, fmt_q, header_for, rows_of, text_table


def _marks(r: dict, suffix: str = "") -> str:
    """Marks of a row's time figures (``suffix`` "_baseline": of its no-drop/no-prefetch baseline)."""
    return (EXTRAPOLATED if r.get("extrapolated" + suffix) else "") + (FOREIGN if r.get("cost_model_foreign") else "")


def _legends(rows: list[dict]) -> list[str]:
    out = []
    if any(r.get("extrapolated") or r.get("extrapolated_baseline") for r in rows):
        out.append(EXTRAPOLATED_LEGEND)
    if any(r.get("cost_model_foreign") for r in rows):
        out.append(foreign_legend())
    return out

PREFETCH_NOTES = [
    "hit % = demand hits / demand lookups (a speculative fill is not a lookup; a demand hit on a prefetched entry is a "
    "hit); _decode = decode loads only, _cum = prefill included",
    "bytes = expert bytes read (demand misses + speculative fills), all speculative reads happen in decode; no quality "
    "is measured (prefetch does not change the routing)",
    "best_plain_* = the online policy (no prefetch, not the belady/infinite bounds) with the highest decode hit % at "
    "the same budget, ties by policy name: the baseline a prefetch what-if must beat, not only its own policy",
]


BYTES_NOT_TIME = "bytes are not time (see --cost-model)"


TIMED = "ms_per_token/tok_s: decode tokens under the given cost model"
TIMELINE = ("ms_per_token/tok_s: decode tokens on the timeline of reads on lanes against compute (replay.analyses.timeline); "
            "useful/late/wasted_mib: speculative bytes demanded in time, demanded after the router asked, never demanded")


# What the drop tables call the two dropped shares (labelled apart, never to be compared).
ROUTINGS_WITH_A_DROP = header_for("routings_dropped_pct")


EXPERTS_DROPPED = header_for("experts_dropped_pct")


DROPPED_SHARES = (f"{ROUTINGS_WITH_A_DROP} = (token, layer) routings with at least one expert skipped; {EXPERTS_DROPPED} = "
                  "routed experts skipped, what an engine's telemetry calls 'routings dropped': different figures")


def _heads(cols: list[str]) -> list[str]:
    """The human headers (replay.present.format.HEADERS), the same for a quantity in every table."""
    return [header_for(c) for c in cols]


def _model_scope() -> str:
    return ("the model sees expert bytes (and misses) per decoded token only, not thermal state, page faults or "
            "compute changes")


def format_drop_time(frame, mode: str) -> str:

    rows = rows_of(frame)
    base = rows[0]["ms_per_token_baseline"] if rows else None
    bm = _marks(rows[0], "_baseline") if rows else ""
    out = [f"time per decoded token under the cost model (no drop: {fmt_q(base, 'ms')} ms/token{bm}); drop changes only the "
           "bytes it reads here, not compute; weight mass is not quality" if base is not None else "time per decoded token"]
    cols = ["mode", "frac", "keep_k", "ms_per_token", "ms_per_token_ci95", "tok_s", "ms_saved_per_token"]
    heads = _heads(cols)
    if any(_marks(r) or _marks(r, "_baseline") for r in rows):  # every time figure of the row carries them
        rows = [{**r, "marks": _marks(r) + ("" if _marks(r, "_baseline") == _marks(r) else f" (baseline {_marks(r, '_baseline') or '-'})")}
                for r in rows]
        cols, heads = cols + ["marks"], heads + ["Marks"]
    out.append(text_table(rows, cols, heads))
    out += _legends(rows)
    return "\n".join(out)


DROP_TIMELINE = ("ms_per_token/tok_s/stall_ms_per_token: decode tokens on the timeline of reads on lanes against compute "
                 "(replay.analyses.timeline), the misses with the dropped slots against those without; ms_saved_per_token: "
                 "without minus with, its 95% interval (ms_saved_ci_low/high) from the paired block bootstrap over decoded "
                 "tokens; vs_baseline_time: better (faster) or worse only when the interval excludes 0")


def format_drop_timeline(frame) -> str:
    """The timeline's time of each drop row (``drop --time-model fitted|profile``)."""
    rows = rows_of(frame)
    r0 = rows[0] if rows else {}
    out = [f"time per decoded token on the timeline ({r0.get('time_model')}, profile {r0.get('time_profile')}; no drop: "
           f"{fmt_q(r0.get('ms_per_token_baseline'), 'ms')} ms/token, stall {fmt_q(r0.get('stall_ms_per_token_baseline'), 'ms')} "
           "ms/token); drop changes only what is read, not compute; weight mass is not quality"]
    rows = [{**r, "ms_saved_ci95": f"[{fmt_q(r['ms_saved_ci_low'], 'ms')}, {fmt_q(r['ms_saved_ci_high'], 'ms')}]"} for r in rows]
    cols = ["mode", "frac", "keep_k", "ms_per_token", "stall_ms_per_token", "ms_saved_per_token", "ms_saved_ci95",
            "vs_baseline_time"]
    out.append(text_table(rows, cols, _heads(cols)))
    return "\n".join(out)


def format_drop(frame, k: int, timed: bool = False) -> str:

    rows = rows_of(frame)
    phase = rows[0]["phase"] if rows else "decode"
    cold = [r for r in rows if r["mode"] == "static"]
    cut = [r for r in rows if r["mode"] == "static-k"]
    out = [f"drop-cold, static: on the recorded run ({phase} routings), skip a miss whose weight < F/{k}; "
           "the top-weighted expert is never skipped"]
    cols = ["frac", "io_saved_pct", "io_saved_mib", "mass_lost_pct", "routings_dropped_pct", "experts_dropped_pct",
            "survivors_mean", "static_k_mass_lost_at_equal_io_pct"]
    out.append(text_table(cold, cols, _heads(cols)))
    out.append("")
    out.append("static top-k cut on the same rows (every slot at rank >= keep_k dropped, hit or miss; only misses save bytes):")
    cols = ["keep_k", "io_saved_pct", "io_saved_mib", "mass_lost_pct", "experts_dropped_pct"]
    out.append(text_table(cut, cols, _heads(cols)))
    out.append("")
    out.append("reads avoided = share of the recorded miss bytes not read; weight mass is not quality (no perplexity or task "
               "accuracy is measured)" + ("." if timed else "; bytes are not time (see --cost-model)."))
    out.append(DROPPED_SHARES + ".")
    return "\n".join(out)


def format_closed(frame, k: int, timed: bool = False) -> str:

    rows = rows_of(frame)
    r0 = rows[0]
    phase = r0["phase"]
    hit = PHASE_HIT_KEY[phase]
    cold = [r for r in rows if r["mode"] == "closed"]
    cut = [r for r in rows if r["mode"] == "closed-k"]
    out = [f"drop-cold, closed loop: {r0['policy']} cache at {exact(r0['budget_mib'])} MiB replayed with dropping in the loop "
           f"({phase} routings): a slot is skipped iff not resident at that moment and weight < F/{k}; the top-weighted "
           "expert is never skipped; a skipped slot is not read and not admitted",
           f"reads avoided = bytes the misses read ({phase}) against the no-drop replay at the same budget and policy "
           f"({fmt_q(r0['read_mib_baseline'], 'mib')} MiB); cache hit % = hits / lookups ({phase}), no drop: "
           f"{fmt_q(r0[hit + '_baseline'], 'pct')}%"]
    cols = ["frac", "io_saved_pct", "io_saved_mib", "mass_lost_pct", "routings_dropped_pct", "experts_dropped_pct",
            "survivors_mean", hit, "closed_k_mass_lost_at_equal_io_pct"]
    out.append(text_table(cold, cols, _heads(cols)))
    out.append("")
    out.append("closed top-k cut (every slot at rank >= keep_k skipped, resident or not; the cache replayed the same way):")
    cols = ["keep_k", "io_saved_pct", "io_saved_mib", "mass_lost_pct", "experts_dropped_pct", hit]
    out.append(text_table(cut, cols, _heads(cols)))
    out.append("")
    out.append("Dropped slots never look the cache up, so the cache hit % rises without the cache serving more: judge "
               "drop-cold by reads avoided and weight mass discarded, not by hit %. Weight mass is not quality (no perplexity or task "
               "accuracy is measured)" + ("." if timed else "; bytes are not time (see --cost-model)."))
    out.append(DROPPED_SHARES + ".")
    return "\n".join(out)


def format_prefetch(tr, r: dict, model) -> str:

    def pct(v):
        return fmt_q(v, "pct")

    opts = [f"policy {r['policy']}", f"budget {exact(r['budget_mib'])} MiB",
            f"cap {exact(r['cap']) if r['cap'] is not None else 'none'}", f"guard {'on' if r['guard'] else 'off'}",
            f"drop {exact(r['drop']) if r['drop'] is not None else 'off'}", f"retain {'on' if r['retain'] else 'off'}"]
    lines = [
        f"prefetch  {r['predictor']}: guesses for the MoE layer {r['ahead']} ahead, read after each decode layer's load "
        f"into the same cache ({', '.join(opts)})",
        f"          {r['scored_routings']:,} decode routings had guesses; prefill runs as without prefetch",
        *([f"          {r['train_text']} (tokens it learned from get no guesses)" if r.get("train") != "in-sample"
           else f"          IN-SAMPLE: {r['train_text']}"] if r.get("train_text") else []),
        "",
        "demand hit % (hits / lookups; speculative fills are not lookups)   with prefetch   without",
        f"  decode-only                                                      {pct(r['hit_pct_decode']):>13}   "
        f"{pct(r['hit_pct_decode_baseline']):>7}",
        f"  cumulative (prefill included)                                    {pct(r['hit_pct_cum']):>13}   "
        f"{pct(r['hit_pct_cum_baseline']):>7}",
        "",
        f"speculative fills  {r['spec_fills']:,} ({fmt_q(r['spec_mib'], 'mib')} MiB, all in decode; {pct(r['spec_share_pct'])}% "
        "of the bytes read in decode)",
        f"  useful (demanded before eviction) {r['useful']:,} ({pct(r['useful_pct'])}% of fills); evicted unused "
        f"{r['evicted_unused']:,}; still unused at the end {r['unused_at_end']:,}",
        f"  not read: already resident {r['predicted_resident']:,}; over the cap {r['capped']:,}; refused by the guard "
        f"{r['refused_guard']:,}; no evictable room {r['refused_no_room']:,}"
        + (f"; under the drop threshold {r['guesses_dropped']:,}" if r["drop"] is not None else ""),
        "",
        f"bytes per decoded token (demand + speculative)  {fmt_q(r['total_mib_per_token'], 'mib_per_token')} MiB, without "
        f"prefetch {fmt_q(r['total_mib_per_token_baseline'], 'mib_per_token')} MiB "
        f"({'+' if (r['bytes_change_pct'] or 0) >= 0 else ''}{pct(r['bytes_change_pct'])}%)",
    ]
    if r["predicted_resident"] and not r["spec_fills"]:
        lines.append("  note: every guess was already resident, so prefetch read nothing and changed nothing"
                     + (" (prev-token under LRU with a budget above one token cycle: the previous token's experts are all "
                        "still cached)" if r["predictor"] == "prev-token" and r["policy"] == "lru" else ""))
    if model is not None:
        lines += ["", f"time per decoded token (cost model: {model.model}; {_model_scope()}):",
                  f"  with prefetch {fmt_q(r['ms_per_token'], 'ms')} ms{_marks(r)} ({fmt_q(r['tok_s'], 'tok_s')} tok/s{_marks(r)}), "
                  f"without {fmt_q(r['ms_per_token_baseline'], 'ms')} ms{_marks(r, '_baseline')} "
                  f"({fmt_q(r['tok_s_baseline'], 'tok_s')} tok/s{_marks(r, '_baseline')}), "
                  f"+-{fmt_q(r['ms_per_token_ci95'], 'ms')} ms (95% prediction interval of the fit)",
                  *(f"  {x}" for x in _legends([r])),
                  f"  {r['verdict']}"]
        ci = r["ms_per_token_ci95"]
        if ci is not None and abs(r["ms_per_token"] - r["ms_per_token_baseline"]) < ci:
            lines.append(f"  (the difference is inside the +-{fmt_q(ci, 'ms')} ms interval of a run's mean: a measured A/B of "
                         f"{r['tokens_decode']} tokens could not tell them apart)")
    if r.get("time_model") in ("fitted", "profile"):
        lines += timeline_lines(r)
    lines += ["", *plain_lines(r, model)]
    timed = model is not None or r.get("time_model") in ("fitted", "profile")
    lines += ["", ("Prefetch" if timed else "Bytes are not time (see --cost-model); prefetch")
              + " does not change the routing, so no quality is at stake; a speculative read competes with demand reads "
              "for the same flash bandwidth."]
    return "\n".join(lines)


def plain_lines(r: dict, model) -> list[str]:
    """The best plain policy at the same budget (no prefetch), and whether this what-if beats it."""

    name = r.get("best_plain_policy")
    if name is None:
        return [f"best plain policy at {exact(r['budget_mib'])} MiB: none fits the budget (every online policy overflowed)"]
    on_timeline = r.get("time_model") in ("fitted", "profile")
    timed = (model is not None or on_timeline) and r.get("best_plain_ms_per_token") is not None
    how = "on the timeline" if on_timeline else "under the cost model"
    mk = FOREIGN if getattr(model, "foreign", False) else ""
    line = (f"best plain policy at {exact(r['budget_mib'])} MiB (no prefetch, highest decode hit among online policies): "
            f"{name} {fmt_q(r['best_plain_hit_pct_decode'], 'pct')}% decode hit, "
            f"{fmt_q(r['best_plain_mib_per_token'], 'mib_per_token')} MiB/token"
            + (f", {fmt_q(r['best_plain_ms_per_token'], 'ms')} ms/token{mk} ({fmt_q(r['best_plain_tok_s'], 'tok_s')} tok/s{mk})"
               if timed else ""))
    out = [line]
    beaten_hit = r["best_plain_hit_pct_decode"] >= (r["hit_pct_decode"] if r["hit_pct_decode"] is not None else -1)
    if timed:
        if r["best_plain_ms_per_token"] <= r["ms_per_token"]:
            out.append(f"  plain {name} without prefetch is at least as fast as this prefetch {how}: "
                       "the what-if is no win at this budget")
        else:
            out.append(f"  this prefetch is faster than plain {name} {how} by "
                       f"{fmt_q(r['best_plain_ms_per_token'] - r['ms_per_token'], 'ms')} ms/token")
    elif beaten_hit:
        out.append(f"  plain {name} without prefetch hits at least as often as this prefetch: its hit gain over "
                   f"{r['policy']} is no win at this budget")
    return out


def with_verdict(frame: pl.DataFrame) -> pl.DataFrame:
    """Prefetch rows timed by :func:`replay.analyses.prefetching.with_prefetch_time` + ``verdict``: which wins
    on time, and why, in one sentence per row."""
    return frame.with_columns(pl.Series("verdict", [verdict(r) for r in frame.to_dicts()], dtype=pl.String))


def verdict(r: dict) -> str:
    """Which wins on time under the model, and why, in one sentence."""

    dh = (r["hit_pct_decode"] or 0.0) - (r["hit_pct_decode_baseline"] or 0.0)
    db = r["bytes_change_pct"] or 0.0
    dms = r["ms_per_token"] - r["ms_per_token_baseline"]
    if not r.get("spec_fills"):
        return ("prefetch read nothing here (every guess was already resident or refused), so it cannot change the "
                "time per token")
    hit = (f"raises the decode hit rate by {fmt_q(dh, 'pp')} points" if dh >= 0
           else f"lowers the decode hit rate by {fmt_q(-dh, 'pp')} points")
    byt = (f"reads {fmt_q(db, 'pct')}% more bytes per decoded token" if db >= 0
           else f"reads {fmt_q(-db, 'pct')}% fewer bytes per decoded token")
    if r.get("vs_baseline_time") == "tie":  # the paired interval over decoded tokens includes zero (replay.analyses.paired)
        from replay.analyses.paired import tie_text

        return (f"prefetch {hit} and {byt} (speculative reads included): {fmt_q(abs(dms), 'ms')} ms/token "
                f"{'slower' if dms > 0 else 'faster'} under the cost model, a "
                f"{tie_text((r['delta_ms_ci_high'] - r['delta_ms_ci_low']) / 2, ' ms/token')}: neither wins on time")
    if dms > 0:
        return (f"prefetch {hit} but {byt} (speculative reads included): {fmt_q(dms, 'ms')} ms/token slower under the "
                "cost model, so no prefetch wins on time")
    return f"prefetch {hit} and {byt}: {fmt_q(-dms, 'ms')} ms/token faster under the cost model, so prefetch wins on time"


# -- the timeline (replay.analyses.timeline) ---------------------------------------------------------

SATURATED_PCT = 80.0  # read lanes busy at least this share of the time: "saturated" in a verdict's why


def with_timeline_verdict(frame: pl.DataFrame) -> pl.DataFrame:
    """Prefetch rows timed on the timeline + ``verdict``: which wins on time and why."""
    return frame.with_columns(pl.Series("verdict", [timeline_verdict(r) for r in frame.to_dicts()], dtype=pl.String))


def timeline_why(r: dict) -> str:
    """Why prefetch won or lost on the timeline, from the row's figures: lanes idle or saturated,
    guesses late or wrong."""
    spec = r.get("spec_mib_timed") or 0.0
    useful, late, wasted = r.get("useful_mib") or 0.0, r.get("late_mib") or 0.0, r.get("wasted_mib") or 0.0
    busy_b, busy = r.get("lane_busy_pct_baseline"), r.get("lane_busy_pct")
    lanes = (f"the read lanes were busy {fmt_q(busy_b, 'pct')}% of the time without prefetch and "
             f"{fmt_q(busy, 'pct')}% with it" + (" (saturated)" if busy is not None and busy >= SATURATED_PCT else
                                                  " (idle during compute)" if busy is not None and busy < 50.0 else ""))
    guesses = (f"{fmt_q(100.0 * useful / spec, 'pct')}% of the {fmt_q(spec, 'mib')} MiB read speculatively were used "
               f"({fmt_q(100.0 * late / useful, 'pct') if useful > 0 else '0.0'}% of those late), "
               f"{fmt_q(100.0 * wasted / spec, 'pct')}% wasted") if spec > 0 else "nothing was read speculatively"
    stall = (f"stall {fmt_q(r.get('stall_ms_per_token'), 'ms')} ms/token with prefetch, "
             f"{fmt_q(r.get('stall_ms_per_token_baseline'), 'ms')} without")
    return f"{lanes}; {guesses}; {stall}"


def timeline_verdict(r: dict) -> str:
    """One sentence: prefetch faster, slower or tied on the timeline (tie unless the paired interval
    excludes 0), with why."""
    from replay.analyses.paired import interval_text, tie_text

    if not r.get("spec_fills"):
        return ("prefetch read nothing here (every guess was already resident or refused), so it cannot change the "
                "time per token")
    dms = r["delta_ms_per_token"]
    iv = interval_text(dms, r["delta_ms_ci_low"], r["delta_ms_ci_high"], " ms/token")
    why = timeline_why(r)
    call = r.get("vs_baseline_time")
    if call == "better":
        return f"prefetch wins on time on the timeline: {iv}; {why}"
    if call == "worse":
        return f"prefetch loses on time on the timeline: {iv}; {why}"
    half = (r["delta_ms_ci_high"] - r["delta_ms_ci_low"]) / 2 if r.get("delta_ms_ci_low") is not None else float("nan")
    return f"neither wins on time on the timeline: {signed_ms(dms)} ms/token, a {tie_text(half, ' ms/token')}; {why}"


def signed_ms(v: float) -> str:
    from replay.analyses.paired import signed

    return signed(v)


def timeline_lines(r: dict) -> list[str]:
    """The timeline's block of the prefetch text."""
    name = "" if r["time_model"] == "fitted" else f"{r['time_profile']}: "
    prof = (f"{name}{r['time_lanes']} lanes x {fmt_q(r['time_lane_mib_s'], 'mib')} MiB/s, "
            f"{fmt_q(r['time_read_latency_ms'], 'ms_per_miss')} ms per read, compute "
            f"{fmt_q(r['time_compute_ms_per_layer'], 'ms_per_miss')} "
            f"ms per layer (expert share {fmt_q(r['time_expert_share'], 'pp')}), overlap {'on' if r['time_overlap'] else 'off'}, "
            f"token overhead {fmt_q(r['time_token_overhead_ms'], 'ms')} ms + {fmt_q(r['time_serial_ms_per_mib'], 'ms_per_mib')} ms/MiB")
    which = "profile fitted on this run's metrics:" if r["time_model"] == "fitted" else "profile"
    lines = ["", f"time per decoded token on the timeline ({which} {prof}; speculative reads issued "
                 f"{r['spec_issue']}):",
             f"  with prefetch {fmt_q(r['ms_per_token'], 'ms')} ms ({fmt_q(r['tok_s'], 'tok_s')} tok/s), without "
             f"{fmt_q(r['ms_per_token_baseline'], 'ms')} ms ({fmt_q(r['tok_s_baseline'], 'tok_s')} tok/s); stall "
             f"{fmt_q(r['stall_ms_per_token'], 'ms')} vs {fmt_q(r['stall_ms_per_token_baseline'], 'ms')} ms/token; read lanes busy "
             f"{fmt_q(r['lane_busy_pct'], 'pct')}% vs {fmt_q(r['lane_busy_pct_baseline'], 'pct')}%",
             f"  speculative bytes: useful {fmt_q(r['useful_mib'], 'mib')} MiB (late {fmt_q(r['late_mib'], 'mib')} MiB), wasted "
             f"{fmt_q(r['wasted_mib'], 'mib')} MiB; useful guesses arrived {fmt_q(r['useful_lead_ms_mean'], 'ms')} ms before "
             "the router asked for them, on average",
             f"  {r['verdict']}"]
    if r.get("time_model_heldout_mape_pct") is not None:
        lines.append("  (the fitted timeline's held-out per-token error on this run: mean "
                     f"{signed_ms(r['time_model_heldout_mean_err_ms'])} "
                     f"ms, MAPE {fmt_q(r['time_model_heldout_mape_pct'], 'pct')}%)")
    if r["time_profile_source"] == "preset":
        lines.append(f"  ({r['time_profile']} is a preset: an assumption about a class of device, not a measurement)")
    return lines
