"""The report's verdict, answer first: its rows (built by :func:`replay.analyses.report.build_verdict` from
the same frames the sections show, each figure copied from a verb's row) as Markdown lines, one
line per row (the drop-cold rows share one line), each linking to the section with the evidence.

Every figure is printed by :func:`replay.present.format.fmt_q` at its quantity's precision and
every parameter (budget, F) exactly, so the page says what the ``--json`` rows say."""

from __future__ import annotations

from typing import Any

from replay.analyses.paired import interval_text, signed, tie_text
from replay.present.format import exact, fmt_q

# the row kinds and the section each links to (the section's title: its anchor is made from it)
EVIDENCE = {"budget": "Expert cache", "retention": "Prefetch and retention what-ifs", "cache": "Expert cache",
            "predictor": "Predictor accuracy (decode)", "prefetch": "Prefetch and retention what-ifs",
            "drop": "Drop-cold trade-off", "cost": "Cost model", "quality": "Quality (drop-cold measured in the model)",
            "cacheable": "Expert popularity"}


def _link(kind: str, anchors: dict[str, str]) -> str:
    title = EVIDENCE[kind]
    return f" [→ {title}](#{anchors[title]})" if title in anchors else ""


def _time(r: dict[str, Any], prefix: str = "") -> str:
    ms, tok = r.get(f"{prefix}ms_per_token"), r.get(f"{prefix}tok_s")
    return "" if ms is None else f", {fmt_q(ms, 'ms')} ms/token, {fmt_q(tok, 'tok_s')} tok/s"


def _over(r: dict[str, Any], prefix: str) -> str:
    """The cache section's mark for a hit rate that needed more memory than its budget (its peak is
    in the section, not in the verdict's line)."""
    return "! (over budget)" if r.get(f"{prefix}over_budget") else ""


def _iv(low: float | None, high: float | None) -> str:
    return f"95% interval [{signed(low)}, {signed(high)}]"


def budget_line(r: dict[str, Any]) -> str:
    """Which budget? (:func:`replay.analyses.budget_choice.which_budget`): the smallest tested budget
    within noise of the largest, what each doubling buys, and the policy at that budget."""
    timed = r["measure"] == "ms_per_token"
    unit, q = (" ms/token", "ms") if timed else (" points", "pct")
    what = "time under the cost model (ms/token)" if timed else "decode hit %"

    def val(v: float | None) -> str:
        return f"{fmt_q(v, q)}{' ms/token' if timed else '%'}"

    b, top = exact(r["budget_mib"]), exact(r["largest_mib"])
    if r["budget_mib"] == r["largest_mib"]:
        txt = (f"Budget: **{b} MiB**, the largest of {r['budgets_tested']} tested: no smaller one comes within noise of it "
               f"on {what}")
    else:
        txt = (f"Budget: **{b} MiB**, the smallest of {r['budgets_tested']} tested within noise of the largest ({top} MiB) "
               f"on {what}: best {r['policy']} {val(r['value'])} against {r['largest_policy']} {val(r['largest_value'])} "
               f"there ({signed(r['delta'])}{unit}, {_iv(r['ci_low'], r['ci_high'])})")
    if r["doublings"]:
        steps = [f"{exact(d['from_mib'])} → {exact(d['to_mib'])} MiB {signed(d['delta'])}{unit} [{signed(d['ci_low'])}, "
                 f"{signed(d['ci_high'])}]{'' if d['call'] != 'tie' else ' (tie)'}" for d in r["doublings"]]
        txt += f"; each doubling of the budget {'changes ms/token by' if timed else 'buys'}: " + "; ".join(steps)
    txt += f"; at {b} MiB: {r['policy_text']}"
    tied = r.get("tied_with") or []
    if tied:  # a few names; the section's table has them all
        names = ", ".join(tied[:3]) + (f" and {len(tied) - 3} more" if len(tied) > 3 else "")
        txt += f"; tied with {r['policy']} within noise{' on time' if timed else ''}: {names}"
    return txt + _knee(r)


def retention_line(rows: list[dict[str, Any]]) -> str:
    """Whether retaining the predictor's guesses (zero extra bytes) helps, per policy, with the paired interval."""
    r0 = rows[0]
    parts = []
    for r in rows:
        call = r.get("retain_vs_no_retain")
        head = (f"{r['policy']} at {exact(r['budget_mib'])} MiB {fmt_q(r['hit_pct_decode_no_retain'], 'pct')}% → "
                f"{fmt_q(r['hit_pct_decode'], 'pct')}%")
        if call == "tie" and r["retain_gain_ci_low"] == r["retain_gain_ci_high"] == 0:  # not one token's hits changed
            parts.append(f"{head}: **no change** (+0.0 points, {_iv(0.0, 0.0)}){_retain_time(r)}")
            continue
        word = {"better": "helps beyond noise", "worse": "hurts beyond noise"}.get(call) or (
            tie_text((r["retain_gain_ci_high"] - r["retain_gain_ci_low"]) / 2, " points") if call == "tie" else "no interval")
        parts.append(f"{head}: **{word}**, {signed(r['retain_gain_pp_decode'])} points "
                     f"({_iv(r['retain_gain_ci_low'], r['retain_gain_ci_high'])}){_retain_time(r)}")
    return f"Retention of {r0['retain_predictor']}'s guesses (zero extra bytes), decode hits: " + "; ".join(parts)


def _retain_time(r: dict[str, Any]) -> str:
    """report --time-model fitted|profile: what retention does to time on the timeline, with its interval."""
    v = r.get("retain_ms_saved_per_token")
    if v is None:
        return ""
    call = r.get("retain_vs_no_retain_time")
    word = {"better": "faster beyond noise", "worse": "slower beyond noise"}.get(call) or (
        tie_text((r["retain_ms_ci_high"] - r["retain_ms_ci_low"]) / 2, " ms/token") if call == "tie" else "no interval")
    return (f"; on the timeline {fmt_q(r['ms_per_token_no_retain'], 'ms')} → {fmt_q(r['ms_per_token'], 'ms')} ms/token: "
            f"**{word}**, {'saves' if v >= 0 else 'costs'} {fmt_q(abs(v), 'ms')} ms/token "
            f"({_iv(r['retain_ms_ci_low'], r['retain_ms_ci_high'])})")


def _preload(r: dict[str, Any]) -> str:
    """Bytes a policy read before the first token (``pin``'s pinned experts): not in MiB read, and why it
    can beat the Belady bound, which starts from an empty cache."""
    mib = r.get("preload_mib")
    return f" + {fmt_q(mib, 'mib')} MiB preloaded before the first token (its first lookups of those hit)" if mib else ""


def _knee(r: dict[str, Any]) -> str:
    """LRU's knee from the exact curve (replay.analyses.curve), on the first budget's line."""
    if r.get("curve_knee_mib") is None:
        return ""
    return (f". LRU's exact curve bends at **{fmt_q(r['curve_knee_mib'], 'mib')} MiB** (the knee: within "
            f"{exact(r['curve_knee_tolerance_pp'])} pp of its {fmt_q(r['curve_plateau_pct'], 'pct')}% plateau at the "
            f"working set; {fmt_q(r['curve_knee_hit_pct'], 'pct')}% there)")


def cache_line(r: dict[str, Any]) -> str:
    return _cache_line(r) + _knee(r)


def _cache_line(r: dict[str, Any]) -> str:
    head = f"Policy at **{exact(r['budget_mib'])} MiB** ({r['budget_from']}), decode: "
    if r["policy"] is None:
        return head + "no online policy stays within this budget (every one overflowed)"
    txt = (head + f"best of {len(r['policies_compared'])} online policies **{r['policy']}**: "
           f"{fmt_q(r['hit_pct_decode'], 'pct')}% hits, "
           f"{fmt_q(r['read_mib'], 'mib')} MiB read (all phases){_preload(r)}{_time(r)}")
    if r["policy"] == "lru":
        txt += "; that is LRU"
    elif r.get("lru_hit_pct_decode") is not None:
        txt += (f"; LRU {fmt_q(r['lru_hit_pct_decode'], 'pct')}%{_over(r, 'lru_')} hits, {fmt_q(r['lru_read_mib'], 'mib')} MiB"
                f"{_time(r, 'lru_')}")
    txt += _paired(r, "")
    if r.get("bound_hit_pct_decode") is not None:  # unequal expert sizes: belady is a heuristic, opt-bound the bound
        if r.get("belady_hit_pct_decode") is not None:
            txt += (f"; furthest-next-use (belady, a heuristic with these unequal expert sizes) "
                    f"{fmt_q(r['belady_hit_pct_decode'], 'pct')}%{_over(r, 'belady_')} hits")
        txt += f"; the upper bound (opt-bound) {fmt_q(r['bound_hit_pct_decode'], 'pct')}% hits"
        gap = r.get("gap_to_bound_pp")
        if gap is not None:
            txt += f" ({fmt_q(abs(gap), 'pp')} points {'above' if gap >= 0 else 'below'} the best)"
    elif r.get("bound_not_computed_loads") is not None and r.get("belady_hit_pct_decode") is not None:
        txt += (f"; furthest-next-use (belady, a heuristic with these unequal expert sizes, not a bound) "
                f"{fmt_q(r['belady_hit_pct_decode'], 'pct')}%{_over(r, 'belady_')} hits; the exact upper bound (opt-bound) "
                f"is not computed in the report on {r['bound_not_computed_loads']:,} loads (`cache --policies opt-bound` does)")
    elif r.get("belady_hit_pct_decode") is not None:
        txt += f"; the Belady bound {fmt_q(r['belady_hit_pct_decode'], 'pct')}%{_over(r, 'belady_')} hits"
        gap = r.get("gap_to_belady_pp")
        if gap is not None:
            txt += f" ({fmt_q(abs(gap), 'pp')} points {'above' if gap >= 0 else 'below'} the best)"
    if r.get("fastest_policy") is not None and r["fastest_policy"] != r["policy"]:
        txt += (f"; fastest under the cost model: **{r['fastest_policy']}**, {fmt_q(r['fastest_ms_per_token'], 'ms')} ms/token, "
                f"{fmt_q(r['fastest_tok_s'], 'tok_s')} tok/s at {fmt_q(r['fastest_hit_pct_decode'], 'pct')}% hits")
    if r.get("fastest_policy") is not None:
        txt += _paired(r, "fastest_", "on time under the cost model, ")
    if r.get("over_budget_left_out"):  # their names; their peaks are in the section
        names = [x.split(" (peak")[0] for x in r["over_budget_left_out"].split(", ")]
        txt += f"; left out as over budget (peaks in the section): {', '.join(names)}"
    return txt


def _paired(r: dict[str, Any], prefix: str, what: str = "") -> str:
    """The best (or fastest) against LRU with the paired interval (replay.analyses.paired.decide), and the ties."""
    txt = r.get(f"{prefix}vs_lru_text")
    if not txt or r.get(f"{prefix}policy") == "lru" and not r.get(f"{prefix}tied_with"):
        return ""
    out = "" if r.get(f"{prefix}policy") == "lru" else f"; {what}{txt}"
    tied = r.get(f"{prefix}tied_with") or []
    if tied:
        out += f"; tied with {r[f'{prefix}policy']} within noise{' on time' if prefix else ''}: {', '.join(tied)}"
    return out


def cacheable_line(r: dict[str, Any]) -> str:
    """The profile's headline (replay.present.profile.answer_lines); its figures are in the section."""
    from replay.present.profile import answer_lines

    return answer_lines(r)[0].rstrip(".")


def predictor_line(r: dict[str, Any]) -> str:
    lo, hi = r.get("slot_acc_ci_low"), r.get("slot_acc_ci_high")
    iv = f"95% interval {fmt_q(lo, 'pct')}-{fmt_q(hi, 'pct')}; " if lo is not None and hi is not None else ""
    vs = ""
    if r.get("vs_prev_token") is not None and r.get("vs_prev_token_pp") is not None:
        d = r["vs_prev_token_pp"]
        vs = (f"; against prev-token {d:+.1f} points, "
              + ("a tie within noise" if r["vs_prev_token"] == "tie" else f"{r['vs_prev_token']} beyond noise")
              + f" (interval {r['vs_prev_token_ci_low']:+.1f} to {r['vs_prev_token_ci_high']:+.1f})")
    held = " on held-out tokens" if r.get("train") not in (None, "none") else ""
    return (f"Best predictor (decode; checks, oracles and in-sample scores left out): **{r['predictor']}**, "
            f"{fmt_q(r['slot_acc_pct'], 'pct')}% slot accuracy{held} ({iv}{fmt_q(r['whole_acc_pct'], 'pct')}% of "
            f"routings named whole){vs}")


def prefetch_outcome(r: dict[str, Any]) -> str:
    """What prefetching did, on time when there is a cost model, on hits and bytes otherwise."""
    more_hits = (r["hit_pct_decode"] or 0.0) > (r["hit_pct_decode_baseline"] or 0.0)
    if not r.get("spec_fills"):
        return "it read nothing (every guess was resident or refused): no change"
    if r.get("ms_per_token") is None:
        if r.get("vs_baseline") is not None:  # the paired interval over decoded tokens (replay.analyses.paired)
            iv = interval_text(r["delta_hit_pp"], r["delta_hit_ci_low"], r["delta_hit_ci_high"], " points")
            hits = ({"better": "more hits beyond noise", "worse": "fewer hits beyond noise"}.get(r["vs_baseline"])
                    or tie_text((r["delta_hit_ci_high"] - r["delta_hit_ci_low"]) / 2, " points") + " on hits")
            return f"{hits}, {iv}; and bytes are not time: no cost model to say which is faster"
        return ("more hits" if more_hits else "no more hits") + ", and bytes are not time: no cost model to say which is faster"
    if r.get("vs_baseline_time") is not None:
        iv = interval_text(r["delta_ms_per_token"], r["delta_ms_ci_low"], r["delta_ms_ci_high"], " ms/token")
        if r["vs_baseline_time"] == "tie":
            return (f"prefetching and no prefetch {tie_text((r['delta_ms_ci_high'] - r['delta_ms_ci_low']) / 2, ' ms/token')} "
                    f"on time, {iv}")
        if r["vs_baseline_time"] == "better":
            return f"prefetching wins on time beyond noise, {iv}"
        return ("prefetching loses on wall-clock time beyond noise" + (" even though it raises the hit rate" if more_hits else "")
                + f", {iv}")
    saved = r["ms_per_token_baseline"] - r["ms_per_token"]
    if saved > 0:
        # below the printed precision the two times read the same: say by how little it wins
        return "prefetching wins on time" + (", by less than 0.1 ms/token" if saved < 0.05 else "")
    if more_hits:
        return "prefetching loses on wall-clock time even though it raises the hit rate"
    return "prefetching loses on time and on hits"


def prefetch_line(r: dict[str, Any]) -> str:
    how = f"{r['policy']}{' + guard' if r['guard'] else ''}"
    txt = (f"Prefetch with {r['predictor']} at {exact(r['budget_mib'])} MiB ({how}): decode hits "
           f"{fmt_q(r['hit_pct_decode_baseline'], 'pct')}% → {fmt_q(r['hit_pct_decode'], 'pct')}%, "
           f"{fmt_q(r['total_mib_per_token_baseline'], 'mib_per_token')} → {fmt_q(r['total_mib_per_token'], 'mib_per_token')} "
           "MiB read per decoded token")
    if r.get("ms_per_token") is not None:
        txt += (f", {fmt_q(r['ms_per_token_baseline'], 'ms')} → {fmt_q(r['ms_per_token'], 'ms')} ms/token "
                f"({fmt_q(r['tok_s_baseline'], 'tok_s')} → {fmt_q(r['tok_s'], 'tok_s')} tok/s)")
    txt += f": **{prefetch_outcome(r)}**"
    if r.get("time_model") in ("fitted", "profile") and r.get("spec_fills"):  # the timeline says why (report --time-model)
        from replay.present.whatif import timeline_why

        txt += f" on the timeline, because {timeline_why(r)}"
    return txt


def drop_line(rows: list[dict[str, Any]]) -> str:
    r0 = rows[0]
    how = ("static, on the engine's recorded residency" if r0["mode"] == "static"
           else f"closed loop, LRU at {exact(r0['budget_mib'])} MiB")
    def saved(r: dict[str, Any]) -> str:
        iv = ("" if r.get("io_saved_ci_low") is None else
              f" (95% interval {fmt_q(r['io_saved_ci_low'], 'pct')} to {fmt_q(r['io_saved_ci_high'], 'pct')}%)")
        return f"{fmt_q(r['io_saved_pct'], 'pct')}%{iv}"

    def time(r: dict[str, Any]) -> str:  # with a cost model or the timeline: what the avoided reads are worth in time
        v = r.get("ms_saved_per_token")
        if v is None:
            return ""
        iv = ("" if r.get("ms_saved_ci_low") is None else
              f" ({_iv(r['ms_saved_ci_low'], r['ms_saved_ci_high'])}{'' if r.get('vs_baseline_time') != 'tie' else ', a tie'})")
        return f", {'saves' if v >= 0 else 'costs'} {fmt_q(abs(v), 'ms')} ms/token{iv}"

    timed = any(r.get("ms_saved_per_token") is not None for r in rows)
    where = ("on the timeline of reads on lanes against compute" if r0.get("time_model") in ("fitted", "profile")
             else "under the cost model")
    parts = [f"F = {exact(r['frac'])}: {saved(r)} / {fmt_q(r['mass_lost_pct'], 'pct')}%{time(r)}" for r in rows]
    return (f"Drop-cold ({how}; decode routings), reads avoided (% of miss bytes) / router weight mass discarded (%)"
            + (f", and the time it saves per decoded token {where}" if timed else "") + ": "
            + "; ".join(parts) + ". Weight mass is a proxy for quality, not a measurement of it"
            + ("" if timed else "; no cost model: bytes, not time"))


def cost_line(r: dict[str, Any]) -> str:
    return f"Times (ms/token, tok/s) are decode estimates of the cost model, {r['source']}: {r['model']}"


def verdict_lines(rows: list[dict[str, Any]], anchors: dict[str, str]) -> list[str]:
    """Markdown lines, in the rows' order; ``anchors``: section title -> anchor of the sections shown."""
    out = []
    drops = [r for r in rows if r["kind"] == "drop"]
    kept = [r for r in rows if r["kind"] == "retention"]
    for r in rows:
        k = r["kind"]
        if k == "retention":
            if r is kept[0]:
                out.append(retention_line(kept) + "." + _link(k, anchors))
            continue
        if k == "drop":
            if r is drops[0]:
                out.append(drop_line(drops) + "." + _link(k, anchors))
            continue
        if k == "quality":  # one line per quality result, its settings in order
            same = [q for q in rows if q["kind"] == "quality" and q["quality"] == r["quality"]]
            if r is same[0]:
                out.append(quality_line(same) + "." + _link(k, anchors))
            continue
        line = {"budget": budget_line, "cache": cache_line, "predictor": predictor_line, "prefetch": prefetch_line, "cost": cost_line,
                "cacheable": cacheable_line}[k](r)
        out.append(line + "." + _link(k, anchors))
    return out or ["The trace cannot answer the cache question (see what is missing below)."]


def quality_line(rows: list[dict[str, Any]]) -> str:
    """Drop-cold measured inside the model's forward pass (``moe-replay quality``): per setting the
    reads the run avoided (the offline replay's prediction beside it) against the quality lost."""
    from replay.present.quality import kl_text

    r0 = rows[0]
    parts = []
    for r in rows:
        what = f"F = {exact(r['frac'])}" if r["frac"] is not None else f"keep-k {r['keep_k']}"
        avoided = ("-" if r["io_saved_pct"] is None else f"{fmt_q(r['io_saved_pct'], 'pct')}%")
        replay = ("-" if r["io_saved_pct_replay"] is None else f"{fmt_q(r['io_saved_pct_replay'], 'pct')}%")
        parts.append(f"{what}: {avoided} reads avoided (replay predicted {replay}), perplexity "
                     f"{r['ppl_delta_pct']:+.2f}%, KL mean {kl_text(r['kl_mean'], rows)} nats, top-1 agreement "
                     f"{fmt_q(r['top1_agree_pct'], 'pct')}%")
    txt = (f"Drop-cold measured in the model ({r0['quality']}: {r0['engine']}, teacher-forced, {r0['policy']} at "
           f"{exact(r0['budget_mib'])} MiB): " + "; ".join(parts))
    return txt + (". RANDOM WEIGHTS: these say nothing about a real model's quality" if r0["random_weights"] else
                  ". Quality figures mean something only for a trained model")
