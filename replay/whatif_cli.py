"""``drop`` and ``prefetch``: what-ifs that change what is read. Thin: the numbers come from
:mod:`replay.drop` and :mod:`replay.prefetch`; time columns from :mod:`replay.cost`."""

from __future__ import annotations

from pathlib import Path

import typer

from replay.cache_cli import parse_budgets
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
        trace: Path = typer.Argument(..., help="Trace directory."),
        fracs: str = typer.Option("0.25,0.5,0.75,1.0", "--fracs", help="Drop-cold thresholds F: skip a miss whose weight < F/k."),
        mode: str = typer.Option("static", "--mode", help="static (recorded residency) | closed (replayed cache)."),
        phase: str = typer.Option("decode", "--phase", help="decode | prefill | all"),
        budget_mib: float | None = typer.Option(None, "--budget-mib", help="closed: cache budget in MiB (default: the recorded one)."),
        policy: str = typer.Option("lru", "--policy", help="closed: cache policy of the replay."),
        cost_model: Path | None = typer.Option(None, "--cost-model", help="Add ms/token from a 'cost fit --json' file (decode only)."),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    ) -> None:
        """Drop-cold trade-off: reads avoided against router weight mass discarded, next to the top-k cut."""
        from replay.drop import closed_drop, static_drop
        from replay.output import json_object, rows_of
        from traces import open_trace

        values = parse_floats(fracs, "--fracs")
        if mode not in ("static", "closed"):
            raise UserError(f"--mode {mode!r} is not static or closed.")
        if budget_mib is not None:
            parse_budgets(repr(budget_mib), "--budget-mib")
        model = _cost_model(cost_model, phase)
        tr = open_trace(trace)
        if mode == "static":
            frame = static_drop(tr, values, phase=phase)
        else:
            frame = closed_drop(tr, values, budget_mib=budget_mib, policy=policy, phase=phase)
        notes = []
        if model is not None:
            frame = drop_time_columns(frame, model, mode)
            notes.append(f"ms_per_token: {model.model} (decode tokens; {_model_scope()})")
        if json_out:
            typer.echo(json_object("drop", str(trace), rows_of(frame), mode=mode, notes=notes or None))
            return
        typer.echo(format_drop(frame, tr.top_k) if mode == "static" else format_closed(frame, tr.top_k))
        if model is not None:
            typer.echo("")
            typer.echo(format_drop_time(frame, mode))

    @app.command()
    def prefetch(
        trace: Path = typer.Argument(..., help="Trace directory."),
        predictor: str = typer.Option("prev-token", "--predictor", help="prev-token | stale-gate[d] | static-hot | static-hot-prompt"),
        budget_mib: float | None = typer.Option(None, "--budget-mib", help="Cache budget in MiB (default: the recorded one)."),
        policy: str = typer.Option("lru", "--policy", help="lru | lfru"),
        cap: int | None = typer.Option(None, "--cap", help="At most N predicted misses read per layer."),
        guard: bool = typer.Option(False, "--guard", help="LFRU eviction guard on speculative fills."),
        drop_frac: float | None = typer.Option(None, "--drop", help="Skip guesses with predicted weight < F/k (top kept)."),
        retain: bool = typer.Option(False, "--retain", help="Also protect the guesses for the next layer(s) from eviction."),
        cost_model: Path | None = typer.Option(None, "--cost-model", help="Add ms/token from a 'cost fit --json' file."),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    ) -> None:
        """Speculative prefetch: a predictor's guesses read into the same cache, against no prefetch."""
        from replay.output import json_object, rows_of
        from replay.prefetch import prefetch as run_prefetch
        from replay.prefetch import with_prefetch_time
        from traces import open_trace

        if budget_mib is not None:
            parse_budgets(repr(budget_mib), "--budget-mib")
        model = _cost_model(cost_model, "decode")
        tr = open_trace(trace)
        frame = run_prefetch(tr, predictor, budget_mib=budget_mib, policy=policy, cap=cap, guard=guard,
                             drop_frac=drop_frac, retain=retain)
        if model is not None:
            frame = with_prefetch_time(frame, model)
        if json_out:
            typer.echo(json_object("prefetch", str(trace), rows_of(frame), notes=PREFETCH_NOTES))
            return
        typer.echo(format_prefetch(tr, rows_of(frame)[0], model))


PREFETCH_NOTES = [
    "hit % = demand hits / demand lookups (a speculative fill is not a lookup; a demand hit on a prefetched entry is a "
    "hit); _decode = decode loads only, _cum = prefill included",
    "bytes = expert bytes read (demand misses + speculative fills), all speculative reads happen in decode; bytes are "
    "not time (see --cost-model); no quality is measured (prefetch does not change the routing)",
]


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


def drop_time_columns(frame, model, mode: str):
    """ms/token of each drop row and of the no-drop baseline (decode tokens)."""
    import polars as pl

    from replay.cost import add_time_columns

    if mode == "static":
        f = add_time_columns(frame, model, "read_mib", "misses", "tokens")
        base = add_time_columns(frame, model, "read_mib_baseline", "misses_baseline", "tokens")
    else:
        f = add_time_columns(frame, model, "read_mib_decode", "misses_decode", "tokens_decode")
        base = add_time_columns(frame, model, "read_mib_decode_baseline", "misses_decode_baseline", "tokens_decode")
    return f.with_columns(ms_per_token_baseline=base["ms_per_token"], tok_s_baseline=base["tok_s"],
                          ms_saved_per_token=base["ms_per_token"] - f["ms_per_token"]).with_columns(
        pl.col("ms_saved_per_token").cast(pl.Float64))


def format_drop_time(frame, mode: str) -> str:
    from replay.output import rows_of, text_table

    rows = rows_of(frame)
    base = rows[0]["ms_per_token_baseline"] if rows else None
    out = [f"time per decoded token under the cost model (no drop: {base:.1f} ms/token); drop changes only the bytes "
           "it reads here, not compute; weight mass is not quality" if base is not None else "time per decoded token"]
    out.append(text_table(rows, ["mode", "frac", "keep_k", "ms_per_token", "ms_per_token_ci95", "tok_s", "ms_saved_per_token"],
                          ["mode", "F", "keep_k", "ms/token", "+-95%", "tok/s", "ms_saved/token"], digits={"frac": 2}))
    return "\n".join(out)


def format_drop(frame, k: int) -> str:
    from replay.output import rows_of, text_table

    rows = rows_of(frame)
    phase = rows[0]["phase"] if rows else "decode"
    cold = [r for r in rows if r["mode"] == "static"]
    cut = [r for r in rows if r["mode"] == "static-k"]
    out = [f"drop-cold, static: on the recorded run ({phase} routings), skip a miss whose weight < F/{k}; "
           "the top-weighted expert is never skipped"]
    out.append(text_table(cold, ["frac", "io_saved_pct", "io_saved_mib", "mass_lost_pct", "routings_dropped_pct",
                                 "survivors_mean", "static_k_mass_lost_at_equal_io_pct"],
                          ["F", f"io_saved_%_{phase}", "saved_MiB", "mass_lost_%", "routings_dropped_%", "experts_left",
                           "top-k cut mass_lost_% at equal io"], digits={"frac": 2, "survivors_mean": 2}))
    out.append("")
    out.append("static top-k cut on the same rows (every slot at rank >= keep_k dropped, hit or miss; only misses save bytes):")
    out.append(text_table(cut, ["keep_k", "io_saved_pct", "io_saved_mib", "mass_lost_pct"],
                          ["keep_k", f"io_saved_%_{phase}", "saved_MiB", "mass_lost_%"]))
    out.append("")
    out.append("io_saved = share of the recorded miss bytes not read; weight mass is not quality (no perplexity or task "
               "accuracy is measured); bytes are not time (see 'cost fit').")
    return "\n".join(out)


def format_closed(frame, k: int) -> str:
    from replay.output import rows_of, text_table

    rows = rows_of(frame)
    r0 = rows[0]
    phase = r0["phase"]
    cold = [r for r in rows if r["mode"] == "closed"]
    cut = [r for r in rows if r["mode"] == "closed-k"]
    out = [f"drop-cold, closed loop: {r0['policy']} cache at {r0['budget_mib']:g} MiB replayed with dropping in the loop "
           f"({phase} routings): a slot is skipped iff not resident at that moment and weight < F/{k}; the top-weighted "
           "expert is never skipped; a skipped slot is not read and not admitted",
           f"io_saved = bytes the misses read ({phase}) against the no-drop replay at the same budget and policy "
           f"({r0['read_mib_baseline']:.1f} MiB); cache hit % = hits / lookups ({phase}), no drop: "
           f"{r0['hit_pct_baseline']:.2f}%"]
    out.append(text_table(cold, ["frac", "io_saved_pct", "io_saved_mib", "mass_lost_pct", "routings_dropped_pct",
                                 "survivors_mean", "hit_pct", "closed_k_mass_lost_at_equal_io_pct"],
                          ["F", f"io_saved_%_{phase}", "saved_MiB", "mass_lost_%", "routings_dropped_%", "experts_left",
                           f"cache_hit_%_{phase}", "top-k cut mass_lost_% at equal io"],
                          digits={"frac": 2, "survivors_mean": 2, "hit_pct": 2}))
    out.append("")
    out.append("closed top-k cut (every slot at rank >= keep_k skipped, resident or not; the cache replayed the same way):")
    out.append(text_table(cut, ["keep_k", "io_saved_pct", "io_saved_mib", "mass_lost_pct", "hit_pct"],
                          ["keep_k", f"io_saved_%_{phase}", "saved_MiB", "mass_lost_%", f"cache_hit_%_{phase}"],
                          digits={"hit_pct": 2}))
    out.append("")
    out.append("Dropped slots never look the cache up, so the cache hit % rises without the cache serving more: judge "
               "drop-cold by io_saved and mass_lost, not by hit %. Weight mass is not quality (no perplexity or task "
               "accuracy is measured); bytes are not time (see --cost-model).")
    return "\n".join(out)


def format_prefetch(tr, r: dict, model) -> str:
    from replay.output import fmt

    opts = [f"policy {r['policy']}", f"budget {r['budget_mib']:g} MiB", f"cap {r['cap'] if r['cap'] is not None else 'none'}",
            f"guard {'on' if r['guard'] else 'off'}", f"drop {r['drop'] if r['drop'] is not None else 'off'}",
            f"retain {'on' if r['retain'] else 'off'}"]
    lines = [
        f"prefetch  {r['predictor']}: guesses for the MoE layer {r['ahead']} ahead, read after each decode layer's load "
        f"into the same cache ({', '.join(opts)})",
        f"          {r['scored_routings']:,} decode routings had guesses; prefill runs as without prefetch",
        "",
        "demand hit % (hits / lookups; speculative fills are not lookups)   with prefetch   without",
        f"  decode-only                                                      {fmt(r['hit_pct_decode'], 2):>13}   "
        f"{fmt(r['hit_pct_decode_baseline'], 2):>7}",
        f"  cumulative (prefill included)                                    {fmt(r['hit_pct_cum'], 2):>13}   "
        f"{fmt(r['hit_pct_cum_baseline'], 2):>7}",
        "",
        f"speculative fills  {r['spec_fills']:,} ({r['spec_mib']:.1f} MiB, all in decode; {fmt(r['spec_share_pct'], 1)}% of "
        "the bytes read in decode)",
        f"  useful (demanded before eviction) {r['useful']:,} ({fmt(r['useful_pct'], 1)}% of fills); evicted unused "
        f"{r['evicted_unused']:,}; still unused at the end {r['unused_at_end']:,}",
        f"  not read: already resident {r['predicted_resident']:,}; over the cap {r['capped']:,}; refused by the guard "
        f"{r['refused_guard']:,}; no evictable room {r['refused_no_room']:,}"
        + (f"; under the drop threshold {r['guesses_dropped']:,}" if r["drop"] is not None else ""),
        "",
        f"bytes per decoded token (demand + speculative)  {fmt(r['total_mib_per_token'], 2)} MiB, without prefetch "
        f"{fmt(r['total_mib_per_token_baseline'], 2)} MiB ({r['bytes_change_pct']:+.1f}%)",
    ]
    if r["predicted_resident"] and not r["spec_fills"]:
        lines.append("  note: every guess was already resident, so prefetch read nothing and changed nothing"
                     + (" (prev-token under LRU with a budget above one token cycle: the previous token's experts are all "
                        "still cached)" if r["predictor"] == "prev-token" and r["policy"] == "lru" else ""))
    if model is not None:
        lines += ["", f"time per decoded token (cost model: {model.model}; {_model_scope()}):",
                  f"  with prefetch {r['ms_per_token']:.1f} ms ({fmt(r['tok_s'], 2)} tok/s), without "
                  f"{r['ms_per_token_baseline']:.1f} ms ({fmt(r['tok_s_baseline'], 2)} tok/s), +-{fmt(r['ms_per_token_ci95'], 1)} ms "
                  "(95%, per-token residuals only)",
                  f"  {r['verdict']}"]
        ci = r["ms_per_token_ci95"]
        if ci is not None and abs(r["ms_per_token"] - r["ms_per_token_baseline"]) < ci:
            lines.append(f"  (the difference is inside the +-{ci:.1f} ms interval of a run's mean: a measured A/B of "
                         f"{r['tokens_decode']} tokens could not tell them apart)")
    lines += ["", "Bytes are not time (see --cost-model); prefetch does not change the routing, so no quality is at stake; "
              "a speculative read competes with demand reads for the same flash bandwidth."]
    return "\n".join(lines)
