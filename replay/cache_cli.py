"""``moe-replay cache``: the expert-cache table (policies x budgets), per layer on request, and
``--validate`` (LRU at the engine's budget against what the engine recorded). Thin: the numbers
come from :mod:`replay.cache`."""

from __future__ import annotations

import math
from pathlib import Path

import typer

from traces.errors import UserError

MIB = 1 << 20


def parse_budgets(text: str, option: str = "--budgets") -> list[float]:
    out = []
    for tok in text.split(","):
        tok = tok.strip()
        if not tok:
            continue
        try:
            v = float(tok)
        except ValueError:
            raise UserError(f"{option}: {tok!r} is not a number of MiB.") from None
        if not math.isfinite(v) or v <= 0:
            raise UserError(f"{option}: {tok!r} is not a positive number of MiB.")
        if v > 2.0**40:
            raise UserError(f"{option}: {tok!r} MiB is above 2^40 MiB (1 EiB), which no cache holds.")
        if v not in out:
            out.append(v)
    if not out:
        raise UserError(f"{option}: no budget given.")
    return out


COLLAPSE = ("global LRU collapses toward 0% hit below one token cycle T: each token sweeps all MoE layers, so "
            "by the time a layer comes round again the cycle has evicted exactly the experts it needs next")


def register(app: typer.Typer) -> None:
    @app.command()
    def cache(
        trace: Path = typer.Argument(..., help="Trace directory (trace.json + routings/).", show_default=False),
        budgets: str | None = typer.Option(None, "--budgets", help="Cache budgets in MiB (2^20 bytes), comma-separated. "
                                           "Default: 9 budgets from T/2 to the working set (see output)."),
        policies: str = typer.Option("lru,lfu,layer,lfru,belady,infinite", "--policies",
                                     help="Comma-separated: lru, lfu, random, layer, layerlfu, lfru, belady, infinite."),
        per_layer: bool = typer.Option(False, "--per-layer", help="Also one row per MoE layer."),
        phase: str = typer.Option("decode", "--phase", help="Hit % the table leads with: decode (phase 1 only) or all."),
        seed: int = typer.Option(0, "--seed", help="Seed of the random policy."),
        csv: Path | None = typer.Option(None, "--csv", help="Also write every row to this CSV file (atomically)."),
        validate: bool = typer.Option(False, "--validate", help="Replay LRU at the recorded budget and compare with the engine."),
        budget_mib: float | None = typer.Option(None, "--budget-mib", help="Budget for --validate (default: the recorded one); "
                                                "without --validate, a single budget to replay."),
        cost_model: Path | None = typer.Option(None, "--cost-model", help="A 'cost fit --json' file: adds ms/token and tok/s."),
        flash_mib_s: float | None = typer.Option(None, "--flash-mib-s", help="Manual cost model: read bandwidth in MiB/s."),
        compute_ms: float | None = typer.Option(None, "--compute-ms", help="Manual cost model: compute ms per token."),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
        retain: bool = typer.Option(False, "--retain", help="Protect the --predictor's guesses for the next layer(s) from eviction."),
        predictor: str = typer.Option("prev-token", "--predictor", help="With --retain: prev-token | stale-gate[d] | static-hot."),
    ) -> None:
        """Expert-cache hit rates per policy and budget (decode-only and cumulative), MiB read, T, bound."""
        from replay.cache import check_policies, default_budgets_mib, loads_of, sweep
        from replay.cache import validate as run_validate
        from replay.cost import cost_model_from_options
        from replay.info import NO_DECODE, require_routings
        from replay.output import json_object, rows_of
        from traces import open_trace
        from traces.atomic import atomic_write_text

        if phase not in ("decode", "all"):
            raise UserError(f"--phase: {phase!r} is not decode or all.")
        cmodel = cost_model_from_options(cost_model, flash_mib_s, compute_ms)
        if budget_mib is not None:
            parse_budgets(repr(budget_mib), "--budget-mib")
        pols = check_policies([p for p in policies.split(",") if p.strip()])
        if seed < 0:
            raise UserError(f"--seed: {seed} is negative.")
        if seed >= 1 << 63:
            raise UserError(f"--seed: {seed} does not fit in 64 bits.")
        blist = parse_budgets(budgets) if budgets is not None else None
        t = open_trace(trace)
        require_routings(t, "replay")
        if validate:
            row = run_validate(t, budget_mib)
            if csv is not None:
                import polars as pl
                atomic_write_text(csv, pl.DataFrame([row]).write_csv())
            if json_out:
                typer.echo(json_object("cache", str(trace), [row], validate=True))
            else:
                typer.echo(validate_text(t, row))
            return
        loads = loads_of(t)
        rec_budget = t.recorded.get("budget_mib")
        chosen = "given"
        if blist is None and budget_mib is not None:
            blist = [budget_mib]
        if blist is None:
            blist = default_budgets_mib(loads, rec_budget)
            chosen = ("default: 9 budgets geometric from T/2 to the working set W, 2 significant figures"
                      + (f", the recorded {rec_budget:g} MiB replacing the nearest" if rec_budget in blist else ""))
        if retain:
            from replay.prefetch import retain_sweep
            frame = retain_sweep(t, loads, pols, blist, predictor, per_layer=per_layer, seed=seed)
        else:
            frame = sweep(loads, pols, blist, per_layer=per_layer, seed=seed)
        if cmodel is not None:
            from replay.cost import with_time

            frame = with_time(frame, cmodel, t.token_counts()["tokens_decode"])
        T = loads.token_cycle_bytes / MIB
        W = loads.working_set_bytes / MIB
        below = [b for b in blist if b < T]
        overall = frame.filter(frame["layer"].is_null())
        lru_below = [r for r in rows_of(overall) if r["policy"] == "lru" and r["budget_mib"] < T]
        # No decode loads (prefill-only trace): decode hit % is null, which is not a collapse.
        collapsed = [r for r in lru_below if r["hit_pct_decode"] is not None and r["hit_pct_decode"] < 5.0]
        no_decode = not (loads.load_phase == 1).any()
        if csv is not None:
            atomic_write_text(csv, frame.write_csv())
        if json_out:
            typer.echo(json_object(
                "cache", str(trace), rows_of(frame), phase=phase, token_cycle_mib=T, working_set_mib=W,
                budgets_below_token_cycle=below, budgets_chosen=chosen,
                note=(NO_DECODE if no_decode else COLLAPSE if collapsed else None),
                cost_model=(cmodel.row() if cmodel is not None else None),
            ))
            return
        typer.echo(sweep_text(t, frame, pols, blist, T, W, chosen, phase, per_layer, collapsed))
        if no_decode:
            typer.echo(f"note: {NO_DECODE}.")
        if retain:
            from replay.prefetch import retain_text
            typer.echo(retain_text(frame, pols, blist))
        if cmodel is not None:
            typer.echo("")
            typer.echo(time_text(frame, pols, blist, cmodel))


def sweep_text(t, frame, pols, blist, T, W, chosen, phase, per_layer, collapsed) -> str:
    from replay.output import rows_of, text_table

    overall = rows_of(frame.filter(frame["layer"].is_null()))
    cell = {(r["policy"], r["budget_mib"]): r for r in overall}
    lead = "hit_pct_decode" if phase == "decode" else "hit_pct_cum"

    def grid(field: str) -> str:
        rows = []
        for b in blist:
            row = {"budget": f"{b:g}" + (" *" if b < T else "")}
            for p in pols:
                row[p] = cell[(p, b)][field]
            rows.append(row)
        return text_table(rows, ["budget", *pols], ["budget_mib", *pols], digits=1)

    counts = t.token_counts()
    lines = [
        f"trace    {t.path} ({t.model.get('name')}, {len(t.moe_layers)} MoE layers x {t.n_expert} experts, top-{t.top_k}; "
        f"{counts['tokens_prefill']} prefill + {counts['tokens_decode']} decode tokens)",
        f"T        one token cycle = {T:.1f} MiB (sum over MoE layers of top_k x expert_bytes); "
        f"working set W = {W:.1f} MiB (every (layer, expert) the trace touches)",
        f"budgets  {chosen}",
        "lookup   one unique (layer, expert) per load ((batch, layer) group); hit % = hits / lookups",
        "",
    ]
    decode = "decode-only hit % (decode loads only; prefill excluded)"
    cum = "cumulative hit % (prefill included, as the engine's cache_hit_pct)"
    order = [("hit_pct_decode", decode), ("hit_pct_cum", cum)]
    if lead == "hit_pct_cum":
        order.reverse()
    for field, title in order:
        lines += [title, grid(field), ""]
    lines += ["MiB read by misses, all phases (bytes, not time)", grid("read_mib"), ""]
    if any(b < T for b in blist):
        lines.append(f"* budget below one token cycle T = {T:.1f} MiB.")
    if collapsed:
        vals = ", ".join(f"{r['hit_pct_decode']:.1f}% at {r['budget_mib']:g} MiB" for r in collapsed)
        lines.append(f"  Here {COLLAPSE} (LRU decode-only hit: {vals}).")
    if "infinite" in pols:
        lines.append("infinite = no eviction: only compulsory misses, the bound for any policy at any budget.")
    if "belady" in pols:
        lines.append("belady = evict the entry whose next load is furthest: the offline bound at that budget.")
    if "lfru" in pols and "lfu" in pols:
        same = all(cell[("lfru", b)]["hits"] == cell[("lfu", b)]["hits"] for b in blist)
        if same:
            lines.append("lfru = lfu, by construction: frequency fills the high bits, and the recency byte only orders "
                         "entries of equal frequency by last load, which is the least-recent tie-break lfu already uses.")
    if per_layer:
        from replay.output import rows_of as _rows

        rows = _rows(frame.filter(frame["layer"].is_not_null()))
        lines += ["", "per layer", text_table(
            rows, ["policy", "budget_mib", "layer", "lookups", "hits", "hit_pct_decode", "hit_pct_cum", "read_mib"],
            digits={"budget_mib": 0, "hit_pct_decode": 1, "hit_pct_cum": 1, "read_mib": 1})]
    return "\n".join(lines)


def time_text(frame, pols, blist, cmodel) -> str:
    """The ms/token grid and which configuration wins on time (not just on hits)."""
    from replay.cost import verdict
    from replay.output import rows_of, text_table

    overall = rows_of(frame.filter(frame["layer"].is_null()))
    cell = {(r["policy"], r["budget_mib"]): r for r in overall}
    rows = []
    for b in blist:
        row = {"budget": f"{b:g}"}
        for p in pols:
            row[p] = cell[(p, b)]["ms_per_token"]
        rows.append(row)
    bw = cmodel.bandwidth_mib_s
    lines = [f"estimated ms per decoded token ({cmodel.kind} model: {cmodel.model}; intercept {cmodel.intercept_ms:.1f} ms, "
             f"{cmodel.ms_per_mib:.4f} ms/MiB" + (f" = {bw:.0f} MiB/s" if bw else "") + ")",
             text_table(rows, ["budget", *pols], ["budget_mib", *pols], digits=1)]
    lines += verdict(overall)
    return "\n".join(lines)


def validate_text(t, row) -> str:
    rec = row["recorded_hit_pct_cum"]
    lines = [
        f"validate  LRU replay of {t.path} at {row['budget_mib']:g} MiB "
        f"(engine's recorded budget: {row['recorded_budget_mib'] if row['recorded_budget_mib'] is not None else 'none'})",
    ]
    if rec is not None:
        ok = abs(row["diff_pp"]) <= 0.1
        lines.append(f"cumulative hit % (prefill included): replay {row['hit_pct_cum']:.3f}, engine {rec} "
                     f"(its summary line), difference {row['diff_pp']:+.3f} points -> "
                     + ("within 0.1 points" if ok else "NOT within 0.1 points"))
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
