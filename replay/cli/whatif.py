"""``drop`` and ``prefetch``: what-ifs that change what is read. Thin: the numbers come from
:mod:`replay.drop` and :mod:`replay.prefetch`; time columns from :mod:`replay.cost`."""

from __future__ import annotations

from pathlib import Path

import typer

from replay.cli.cache import parse_budgets
from replay.cli.options import JsonOpt, PolicyFileOpt, PredictorFileOpt, TraceArg
from traces.errors import UserError


def parse_floats(text: str, option: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{option} {text!r}: expected comma-separated numbers.") from None
    if not vals:
        raise UserError(f"{option} is empty.")
    return vals


def register(app: typer.Typer) -> None:
    @app.command()
    def drop(
        trace: Path = TraceArg,
        fracs: str = typer.Option("0.25,0.5,0.75,1.0", "--fracs", help="Drop-cold thresholds F: skip a miss whose weight < F/k."),
        mode: str = typer.Option("static", "--mode", help="static (recorded residency) | closed (replayed cache)."),
        phase: str = typer.Option("decode", "--phase", help="Routings to drop from and judge: decode | prefill | all (both)."),
        budget_mib: float | None = typer.Option(None, "--budget-mib", help="closed: cache budget in MiB (default: the recorded one)."),
        policy: str = typer.Option("lru", "--policy", help="closed: cache policy of the replay."),
        cost_model: Path | None = typer.Option(None, "--cost-model", help="Add ms/token from a 'cost fit --json' file (decode only)."),
        policy_file: list[Path] | None = PolicyFileOpt,
        json_out: bool = JsonOpt,
    ) -> None:
        """Drop-cold trade-off: reads avoided against router weight mass discarded, next to the top-k cut."""
        from replay.plugins import register_files

        register_files(policy_file, None)
        from replay.api import drop as api_drop
        from replay.output import check_phase, json_object, rows_of
        from traces import open_trace

        check_phase(phase)
        values = parse_floats(fracs, "--fracs")
        if mode not in ("static", "closed"):
            raise UserError(f"--mode {mode!r} is not static or closed.")
        if budget_mib is not None:
            parse_budgets(repr(budget_mib), "--budget-mib")
        model = _cost_model(cost_model, phase)
        tr = open_trace(trace)
        frame = api_drop(tr, fracs=values, mode=mode, budget_mib=budget_mib, policy=policy, phase=phase, cost_model=model)
        notes = []
        if model is not None:
            notes.append(f"ms_per_token: {model.model} (decode tokens; {_model_scope()})")
        if json_out:
            typer.echo(json_object("drop", str(trace), rows_of(frame), mode=mode, notes=notes or None))
            return
        timed = model is not None
        typer.echo(format_drop(frame, tr.top_k, timed) if mode == "static" else format_closed(frame, tr.top_k, timed))
        if model is not None:
            typer.echo("")
            typer.echo(format_drop_time(frame, mode))

    @app.command()
    def prefetch(
        trace: Path = TraceArg,
        predictor: str = typer.Option("prev-token", "--predictor", help="A predictor: prev-token, stale-gate[d], "
                                       "static-hot, static-hot-prompt, or one from --predictor-file."),
        budget_mib: float | None = typer.Option(None, "--budget-mib", help="Cache budget in MiB (default: the recorded one)."),
        policy: str = typer.Option("lru", "--policy", help="lru | lfru"),
        cap: int | None = typer.Option(None, "--cap", help="At most N predicted misses read per layer."),
        guard: bool = typer.Option(False, "--guard", help="LFRU eviction guard on speculative fills."),
        drop_frac: float | None = typer.Option(None, "--drop", help="Skip guesses with predicted weight < F/k (top kept)."),
        retain: bool = typer.Option(False, "--retain", help="Also protect the guesses for the next layer(s) from eviction."),
        cost_model: Path | None = typer.Option(None, "--cost-model", help="Add ms/token from a 'cost fit --json' file."),
        policy_file: list[Path] | None = PolicyFileOpt,
        predictor_file: list[Path] | None = PredictorFileOpt,
        json_out: bool = JsonOpt,
    ) -> None:
        """Speculative prefetch: a predictor's guesses read into the same cache, against no prefetch."""
        from replay.plugins import register_files

        register_files(policy_file, predictor_file)
        from replay.api import prefetch as api_prefetch
        from replay.output import json_object, rows_of
        from traces import open_trace

        if budget_mib is not None:
            parse_budgets(repr(budget_mib), "--budget-mib")
        model = _cost_model(cost_model, "decode")
        tr = open_trace(trace)
        frame = api_prefetch(tr, predictor=predictor, budget_mib=budget_mib, policy=policy, cap=cap, guard=guard,
                             drop_frac=drop_frac, retain=retain, cost_model=model,
                                   predictor_file=predictor_file)
        if json_out:
            notes = [*PREFETCH_NOTES, BYTES_NOT_TIME if model is None else TIMED]
            typer.echo(json_object("prefetch", str(trace), rows_of(frame), notes=notes))
            return
        typer.echo(format_prefetch(tr, rows_of(frame)[0], model))


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
# What the drop tables call the two dropped shares (labelled apart, never to be compared).
ROUTINGS_WITH_A_DROP = "routings with a drop %"
EXPERTS_DROPPED = "experts dropped % (engine's 'routings dropped')"
DROPPED_SHARES = ("routings with a drop % = (token, layer) routings with at least one expert skipped; experts dropped % = "
                  "routed experts skipped, what an engine's telemetry calls 'routings dropped': different figures")


def _model_scope() -> str:
    return ("the model sees expert bytes (and misses) per decoded token only, not thermal state, page faults or "
            "compute changes")


def _cost_model(path: Path | None, phase: str):
    if path is None:
        return None
    from replay.cost import load_cost_model

    if phase != "decode":
        raise UserError(f"--cost-model: time per token is modelled for decoded tokens; use --phase decode, not {phase!r}.")
    return load_cost_model(path)


def format_drop_time(frame, mode: str) -> str:
    from replay.output import fmt_q, rows_of, text_table

    rows = rows_of(frame)
    base = rows[0]["ms_per_token_baseline"] if rows else None
    out = [f"time per decoded token under the cost model (no drop: {fmt_q(base, 'ms')} ms/token); drop changes only the "
           "bytes it reads here, not compute; weight mass is not quality" if base is not None else "time per decoded token"]
    out.append(text_table(rows, ["mode", "frac", "keep_k", "ms_per_token", "ms_per_token_ci95", "tok_s", "ms_saved_per_token"],
                          ["mode", "F", "keep_k", "ms/token", "+-95%", "tok/s", "ms_saved/token"]))
    return "\n".join(out)


def format_drop(frame, k: int, timed: bool = False) -> str:
    from replay.output import rows_of, text_table

    rows = rows_of(frame)
    phase = rows[0]["phase"] if rows else "decode"
    cold = [r for r in rows if r["mode"] == "static"]
    cut = [r for r in rows if r["mode"] == "static-k"]
    out = [f"drop-cold, static: on the recorded run ({phase} routings), skip a miss whose weight < F/{k}; "
           "the top-weighted expert is never skipped"]
    out.append(text_table(cold, ["frac", "io_saved_pct", "io_saved_mib", "mass_lost_pct", "routings_dropped_pct",
                                 "experts_dropped_pct", "survivors_mean", "static_k_mass_lost_at_equal_io_pct"],
                          ["F", f"io_saved_%_{phase}", "saved_MiB", "mass_lost_%", ROUTINGS_WITH_A_DROP, EXPERTS_DROPPED,
                           "experts_left", "top-k cut mass_lost_% at equal io"]))
    out.append("")
    out.append("static top-k cut on the same rows (every slot at rank >= keep_k dropped, hit or miss; only misses save bytes):")
    out.append(text_table(cut, ["keep_k", "io_saved_pct", "io_saved_mib", "mass_lost_pct", "experts_dropped_pct"],
                          ["keep_k", f"io_saved_%_{phase}", "saved_MiB", "mass_lost_%", EXPERTS_DROPPED]))
    out.append("")
    out.append("io_saved = share of the recorded miss bytes not read; weight mass is not quality (no perplexity or task "
               "accuracy is measured)" + ("." if timed else "; bytes are not time (see --cost-model)."))
    out.append(DROPPED_SHARES + ".")
    return "\n".join(out)


def format_closed(frame, k: int, timed: bool = False) -> str:
    from replay.output import PHASE_HIT_KEY, exact, fmt_q, rows_of, text_table

    rows = rows_of(frame)
    r0 = rows[0]
    phase = r0["phase"]
    hit = PHASE_HIT_KEY[phase]
    cold = [r for r in rows if r["mode"] == "closed"]
    cut = [r for r in rows if r["mode"] == "closed-k"]
    out = [f"drop-cold, closed loop: {r0['policy']} cache at {exact(r0['budget_mib'])} MiB replayed with dropping in the loop "
           f"({phase} routings): a slot is skipped iff not resident at that moment and weight < F/{k}; the top-weighted "
           "expert is never skipped; a skipped slot is not read and not admitted",
           f"io_saved = bytes the misses read ({phase}) against the no-drop replay at the same budget and policy "
           f"({fmt_q(r0['read_mib_baseline'], 'mib')} MiB); cache hit % = hits / lookups ({phase}), no drop: "
           f"{fmt_q(r0[hit + '_baseline'], 'pct')}%"]
    out.append(text_table(cold, ["frac", "io_saved_pct", "io_saved_mib", "mass_lost_pct", "routings_dropped_pct",
                                 "experts_dropped_pct", "survivors_mean", hit, "closed_k_mass_lost_at_equal_io_pct"],
                          ["F", f"io_saved_%_{phase}", "saved_MiB", "mass_lost_%", ROUTINGS_WITH_A_DROP, EXPERTS_DROPPED,
                           "experts_left", f"cache_hit_%_{phase}", "top-k cut mass_lost_% at equal io"]))
    out.append("")
    out.append("closed top-k cut (every slot at rank >= keep_k skipped, resident or not; the cache replayed the same way):")
    out.append(text_table(cut, ["keep_k", "io_saved_pct", "io_saved_mib", "mass_lost_pct", "experts_dropped_pct", hit],
                          ["keep_k", f"io_saved_%_{phase}", "saved_MiB", "mass_lost_%", EXPERTS_DROPPED,
                           f"cache_hit_%_{phase}"]))
    out.append("")
    out.append("Dropped slots never look the cache up, so the cache hit % rises without the cache serving more: judge "
               "drop-cold by io_saved and mass_lost, not by hit %. Weight mass is not quality (no perplexity or task "
               "accuracy is measured)" + ("." if timed else "; bytes are not time (see --cost-model)."))
    out.append(DROPPED_SHARES + ".")
    return "\n".join(out)


def format_prefetch(tr, r: dict, model) -> str:
    from replay.output import exact, fmt_q

    def pct(v):
        return fmt_q(v, "pct")

    opts = [f"policy {r['policy']}", f"budget {exact(r['budget_mib'])} MiB",
            f"cap {exact(r['cap']) if r['cap'] is not None else 'none'}", f"guard {'on' if r['guard'] else 'off'}",
            f"drop {exact(r['drop']) if r['drop'] is not None else 'off'}", f"retain {'on' if r['retain'] else 'off'}"]
    lines = [
        f"prefetch  {r['predictor']}: guesses for the MoE layer {r['ahead']} ahead, read after each decode layer's load "
        f"into the same cache ({', '.join(opts)})",
        f"          {r['scored_routings']:,} decode routings had guesses; prefill runs as without prefetch",
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
                  f"  with prefetch {fmt_q(r['ms_per_token'], 'ms')} ms ({fmt_q(r['tok_s'], 'tok_s')} tok/s), without "
                  f"{fmt_q(r['ms_per_token_baseline'], 'ms')} ms ({fmt_q(r['tok_s_baseline'], 'tok_s')} tok/s), "
                  f"+-{fmt_q(r['ms_per_token_ci95'], 'ms')} ms (95%, per-token residuals only)",
                  f"  {r['verdict']}"]
        ci = r["ms_per_token_ci95"]
        if ci is not None and abs(r["ms_per_token"] - r["ms_per_token_baseline"]) < ci:
            lines.append(f"  (the difference is inside the +-{fmt_q(ci, 'ms')} ms interval of a run's mean: a measured A/B of "
                         f"{r['tokens_decode']} tokens could not tell them apart)")
    lines += ["", *plain_lines(r, model)]
    lines += ["", ("Prefetch" if model is not None else "Bytes are not time (see --cost-model); prefetch")
              + " does not change the routing, so no quality is at stake; a speculative read competes with demand reads "
              "for the same flash bandwidth."]
    return "\n".join(lines)


def plain_lines(r: dict, model) -> list[str]:
    """The best plain policy at the same budget (no prefetch), and whether this what-if beats it."""
    from replay.output import exact, fmt_q

    name = r.get("best_plain_policy")
    if name is None:
        return [f"best plain policy at {exact(r['budget_mib'])} MiB: none fits the budget (every online policy overflowed)"]
    timed = model is not None and r.get("best_plain_ms_per_token") is not None
    line = (f"best plain policy at {exact(r['budget_mib'])} MiB (no prefetch, highest decode hit among online policies): "
            f"{name} {fmt_q(r['best_plain_hit_pct_decode'], 'pct')}% decode hit, "
            f"{fmt_q(r['best_plain_mib_per_token'], 'mib_per_token')} MiB/token"
            + (f", {fmt_q(r['best_plain_ms_per_token'], 'ms')} ms/token ({fmt_q(r['best_plain_tok_s'], 'tok_s')} tok/s)"
               if timed else ""))
    out = [line]
    beaten_hit = r["best_plain_hit_pct_decode"] >= (r["hit_pct_decode"] if r["hit_pct_decode"] is not None else -1)
    if timed:
        if r["best_plain_ms_per_token"] <= r["ms_per_token"]:
            out.append(f"  plain {name} without prefetch is at least as fast as this prefetch under the cost model: "
                       "the what-if is no win at this budget")
        else:
            out.append(f"  this prefetch is faster than plain {name} under the cost model by "
                       f"{fmt_q(r['best_plain_ms_per_token'] - r['ms_per_token'], 'ms')} ms/token")
    elif beaten_hit:
        out.append(f"  plain {name} without prefetch hits at least as often as this prefetch: its hit gain over "
                   f"{r['policy']} is no win at this budget")
    return out
