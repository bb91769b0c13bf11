"""``moe-replay cache``: the expert-cache table (policies x budgets), per layer on request, and
``--validate`` (LRU at the engine's budget against what the engine recorded). Thin: the numbers
come from :mod:`replay.cache`."""

from __future__ import annotations

import math
from pathlib import Path

import typer

from replay.cli.options import JsonOpt, PolicyFileOpt, PredictorFileOpt, TraceArg
from replay.output import exact
from replay.policies import REGISTRY
from traces.errors import UserError
from traces.schema import MAX_BUDGET_MIB
from traces.units import MIB


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
        if v > MAX_BUDGET_MIB:
            raise UserError(f"{option}: {tok!r} MiB is more than 2^40 MiB (1 EiB), beyond any trace.")
        if v not in out:
            out.append(v)
    if not out:
        raise UserError(f"{option}: no budget given.")
    return out


POLICIES_HELP = (
    "Comma-separated: " + ", ".join(REGISTRY) + ". "
    "lfu evicts the entry touched by the fewest loads since the start of the run (the count survives eviction, as in "
    "the reference replay behind the published curves); lfu-incache counts only since the entry's last admission; "
    "ties go to the least recently used. layer / layerlfu[-incache] split the budget equally over the MoE layers. "
    "lfru = frequency << 8 | recency byte, with lfu-incache's count. belady and infinite are bounds. "
    "s3fifo = S3-FIFO (SOSP 2023) as libCacheSim runs it: small FIFO of 10% of the bytes, main FIFO with a 2-bit "
    "frequency, ghost of keys evicted from the small queue. sieve = SIEVE (NSDI 2024): one FIFO, a visited bit, a hand "
    "that clears bits and evicts the first unvisited entry. least-stale = an interpretation of SpecMD's least-stale "
    "(no official code): entries not touched in the current token pass (batch) go first, oldest admission first. "
    "None of s3fifo, sieve, least-stale, pin, layer-opt, colibri is in the default list. "
    "pin (the N most-routed experts of each layer in the prompt, or in --pin-profile's trace, "
    "resident from the start and never evicted, LRU for the rest; see --pin-per-layer); layer-opt (per-layer LRU shares "
    "chosen from each layer's miss curve over the whole trace: an offline bound over per-layer LRU partitions, "
    "like belady not an online policy); colibri (the colibri engine's cache: per layer the N hottest experts pinned, "
    "LRU over the layer's share of the rest, and every --colibri-repin tokens a re-pin by its LFRU score with demand "
    "heat, halved after each swap; see --colibri-pin).")
VALIDATE_TOLERANCE_PP = 0.1  # the engine prints its cumulative hit % with one decimal
OVER = " !"  # marks an over-budget cell in the text tables

COLLAPSE = ("global LRU collapses toward 0% hit below one token cycle T: each token sweeps all MoE layers, so "
            "by the time a layer comes round again the cycle has evicted exactly the experts it needs next")


def register(app: typer.Typer) -> None:
    @app.command()
    def cache(
        trace: Path = TraceArg,
        budgets: str | None = typer.Option(None, "--budgets", help="Cache budgets in MiB (2^20 bytes), comma-separated. "
                                           "Default: 9 budgets from T/2 to the working set (see output)."),
        policies: str = typer.Option("lru,lfu,layer,lfru,belady,infinite", "--policies", help=POLICIES_HELP),
        per_layer: bool = typer.Option(False, "--per-layer", help="Also one row per MoE layer."),
        phase: str = typer.Option("decode", "--phase", help="Hit % the table leads with: decode (decode loads only), "
                                  "prefill (prompt loads only) or all (both: cumulative)."),
        seed: int = typer.Option(0, "--seed", help="Seed of the random policy."),
        csv: Path | None = typer.Option(None, "--csv", help="Also write every row to this CSV file (atomically)."),
        validate: bool = typer.Option(False, "--validate", help="Replay LRU at the recorded budget and compare with the engine; "
                                      f"exits 1 when the replay does not reproduce the engine (cumulative hit % more than "
                                      f"{VALIDATE_TOLERANCE_PP} points off)."),
        budget_mib: float | None = typer.Option(None, "--budget-mib", help="Budget for --validate (default: the recorded one); "
                                                "without --validate, a single budget to replay (not with --budgets)."),
        cost_model: Path | None = typer.Option(None, "--cost-model", help="A 'cost fit --json' file: adds ms/token and tok/s."),
        flash_mib_s: float | None = typer.Option(None, "--flash-mib-s", help="Manual cost model: read bandwidth in MiB/s."),
        compute_ms: float | None = typer.Option(None, "--compute-ms", help="Manual cost model: compute ms per token."),
        policy_file: list[Path] | None = PolicyFileOpt,
        predictor_file: list[Path] | None = PredictorFileOpt,
        json_out: bool = JsonOpt,
        retain: bool = typer.Option(False, "--retain", help="Protect the --predictor's guesses for the next layer(s) from eviction."),
        predictor: str = typer.Option("prev-token", "--predictor", help="With --retain: prev-token | stale-gate[d] | static-hot."),
        pin_per_layer: int | None = typer.Option(None, "--pin-per-layer", help="pin: experts pinned per MoE layer "
                                                 "(default: as many as fit in half the budget, the same in every layer)."),
        pin_profile: Path | None = typer.Option(None, "--pin-profile", help="pin: take the hot list from this trace's whole-run "
                                                "routing counts (same MoE layers and experts) instead of this trace's prompt."),
        colibri_pin: int | None = typer.Option(None, "--colibri-pin", help="colibri: experts pinned per MoE layer "
                                               "(default: as many as fit in half the budget, the same in every layer)."),
        colibri_repin: int | None = typer.Option(None, "--colibri-repin", help="colibri: re-pin every this many tokens, at "
                                                 "batch boundaries (default 0 = off, colibri's default; its balanced "
                                                 "setting is 64)."),
    ) -> None:
        """Expert-cache hit rates per policy and budget (decode-only and cumulative), MiB read, T, bound.

        A cell marked '!' is over budget: a load needed more than the budget (or its layer's share),
        so the cache overflowed and the hit rate needs more memory (its peak is listed below the
        tables; JSON/CSV rows carry peak_resident_mib, overflow_loads and over_budget).
        --validate exits 1 when the replay does not reproduce the engine."""
        from replay import api
        from replay.cache import check_policies, default_budgets_mib, loads_of
        from replay.cache import validate as run_validate
        from replay.cost import cost_model_from_options
        from replay.info import NO_DECODE, require_routings
        from replay.output import check_phase, json_object, rows_of
        from traces import open_trace
        from traces.atomic import check_output_file, write_output_file

        check_phase(phase)
        cmodel = cost_model_from_options(cost_model, flash_mib_s, compute_ms)
        if budget_mib is not None and not (math.isfinite(budget_mib) and 0 < budget_mib <= MAX_BUDGET_MIB):
            raise UserError(f"--budget-mib: {budget_mib} is not a positive number of MiB (at most 2^40).")
        from replay.plugins import register_files

        register_files(policy_file, predictor_file)
        pols = check_policies([p for p in policies.split(",") if p.strip()])
        pin_opts = {k: v for k, v in (("per_layer", pin_per_layer), ("profile", pin_profile)) if v is not None}
        if pin_opts and "pin" not in pols:
            raise UserError(f"{'--pin-per-layer' if pin_per_layer is not None else '--pin-profile'}: only meaningful with pin "
                            "in --policies.")
        col_opts = {k: v for k, v in (("per_layer", colibri_pin), ("repin", colibri_repin)) if v is not None}
        if col_opts and "colibri" not in pols:
            raise UserError(f"{'--colibri-pin' if colibri_pin is not None else '--colibri-repin'}: only meaningful with "
                            "colibri in --policies.")
        popts = {**({"pin": pin_opts} if pin_opts else {}), **({"colibri": col_opts} if col_opts else {})} or None
        if not 0 <= seed < 1 << 63:
            raise UserError(f"--seed: {seed} is not in 0..2^63-1.")
        blist = parse_budgets(budgets) if budgets is not None else None
        if blist is not None and budget_mib is not None and not validate:
            raise UserError("--budgets and --budget-mib both name the budgets to replay; give one of them.")
        if csv is not None:
            check_output_file(csv, inputs=[trace, cost_model])  # before the replay, not after
        t = open_trace(trace)
        require_routings(t, "replay")
        if validate:
            row = run_validate(t, budget_mib)
            if csv is not None:
                import polars as pl
                write_output_file(csv, pl.DataFrame([row]).write_csv(), inputs=[trace, cost_model])
            ok = validate_ok(row)
            if json_out:
                typer.echo(json_object("cache", str(trace), [row], validate=True, tolerance_pp=VALIDATE_TOLERANCE_PP,
                                       reproduced=ok))
            else:
                typer.echo(validate_text(t, row))
            if ok is False:
                raise SystemExit(1)  # the report is printed; a script sees the replay did not reproduce the engine
            return
        loads = loads_of(t)
        rec_budget = t.recorded.get("budget_mib")
        chosen = "given"
        if blist is None and budget_mib is not None:
            blist = [budget_mib]
        if blist is None:
            blist = default_budgets_mib(loads, rec_budget)
            chosen = ("default: 9 budgets geometric from T/2 to the working set W, 2 significant figures"
                      + (f", the recorded {exact(rec_budget)} MiB replacing the nearest" if rec_budget in blist else ""))
        frame = api.cache(t, policies=pols, budgets_mib=blist, per_layer=per_layer, phase=phase, seed=seed,
                          policy_options=popts, cost_model=cmodel, retain_predictor=predictor if retain else None,
                          show_progress=True, loads=loads, predictor_file=predictor_file)
        T = loads.token_cycle_bytes / MIB
        W = loads.working_set_bytes / MIB
        below = [b for b in blist if b < T]
        overall = frame.filter(frame["layer"].is_null())
        lru_below = [r for r in rows_of(overall) if r["policy"] == "lru" and r["budget_mib"] < T]
        # No decode loads (prefill-only trace): decode hit % is null, which is not a collapse.
        collapsed = [r for r in lru_below if r["hit_pct_decode"] is not None and r["hit_pct_decode"] < 5.0]
        no_decode = not (loads.load_phase == 1).any()
        if csv is not None:
            write_output_file(csv, frame.write_csv(), inputs=[trace, cost_model])
        if json_out:
            typer.echo(json_object(
                "cache", str(trace), rows_of(frame), phase=phase, token_cycle_mib=T, working_set_mib=W,
                budgets_below_token_cycle=below, budgets_chosen=chosen,
                note=(NO_DECODE if no_decode else COLLAPSE if collapsed else None),
                cost_model=(cmodel.row() if cmodel is not None else None),
            ))
            return
        typer.echo(sweep_text(t, frame, pols, blist, T, W, chosen, phase, per_layer, collapsed, loads, popts))
        if no_decode:
            typer.echo(f"note: {NO_DECODE}.")
        if retain:
            from replay.prefetch import retain_text
            typer.echo(retain_text(frame, pols, blist))
        if cmodel is not None:
            typer.echo("")
            typer.echo(time_text(frame, pols, blist, cmodel))


def sweep_text(t, frame, pols, blist, T, W, chosen, phase, per_layer, collapsed, loads=None, popts=None) -> str:
    from replay.cache import is_over_budget, over_budget_note
    from replay.output import PHASE_HIT_KEY, digits_for, fmt, rows_of, text_table

    overall = rows_of(frame.filter(frame["layer"].is_null()))
    cell = {(r["policy"], r["budget_mib"]): r for r in overall}
    lead = PHASE_HIT_KEY[phase]

    any_over = any(is_over_budget(c) for c in cell.values())

    def grid(field: str) -> str:
        rows = []
        for b in blist:
            row = {"budget": exact(b) + (" *" if b < T else "")}
            for p in pols:
                c = cell[(p, b)]
                row[p] = fmt(c[field], digits_for(field)) + (OVER if is_over_budget(c) else " " * len(OVER) if any_over else "")
            rows.append(row)
        return "\n".join(line.rstrip() for line in text_table(rows, ["budget", *pols], ["budget_mib", *pols]).splitlines())

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
    if lead == "hit_pct_prefill":
        order.insert(0, ("hit_pct_prefill", "prefill-only hit % (prompt loads only; decode excluded)"))
    order.sort(key=lambda o: o[0] != lead)
    for field, title in order:
        lines += [title, grid(field), ""]
    lines += ["MiB read by misses, all phases (bytes, not time)", grid("read_mib"), ""]
    if any(b < T for b in blist):
        lines.append(f"* budget below one token cycle T = {T:.1f} MiB.")
    if collapsed:
        vals = ", ".join(f"{r['hit_pct_decode']:.1f}% at {exact(r['budget_mib'])} MiB" for r in collapsed)
        lines.append(f"  Here {COLLAPSE} (LRU decode-only hit: {vals}).")
    note = over_budget_note([cell[(p, b)] for p in pols for b in blist])
    if note:
        lines.append(f"{OVER.strip()} {note[0].upper()}{note[1:]}")
    if "infinite" in pols:
        lines.append("infinite = no eviction: only compulsory misses, the bound for any policy at any budget.")
    if "belady" in pols:
        lines.append("belady = evict the entry whose next load is furthest: the offline bound at that budget.")
    if loads is not None:
        from replay.cache import budget_bytes, check_policy_options
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
        from replay.output import rows_of as _rows

        rows = _rows(frame.filter(frame["layer"].is_not_null()))
        extra = [c for c in ("share_mib", "preload_mib") if c in frame.columns]
        lines += ["", "per layer" + (" (share_mib: the layer's budget under a per-layer partition; preload_mib: bytes "
                                     "resident from the start)" if extra else ""), text_table(
            rows, ["policy", "budget_mib", "layer", "lookups", "hits", "hit_pct_decode", "hit_pct_cum", "read_mib", *extra],
            digits={"budget_mib": 0, "hit_pct_decode": 1, "hit_pct_cum": 1, "read_mib": 1, "share_mib": 1, "preload_mib": 1})]
    return "\n".join(lines)


def time_text(frame, pols, blist, cmodel) -> str:
    """The ms/token grid and which configuration wins on time (not just on hits)."""
    from replay.cache import is_over_budget
    from replay.cost import verdict
    from replay.output import digits_for, fmt, rows_of, text_table

    overall = rows_of(frame.filter(frame["layer"].is_null()))
    cell = {(r["policy"], r["budget_mib"]): r for r in overall}
    any_over = any(is_over_budget(c) for c in cell.values())
    rows = []
    for b in blist:
        row = {"budget": exact(b)}
        for p in pols:
            c = cell[(p, b)]
            mark = OVER if is_over_budget(c) else " " * len(OVER) if any_over else ""
            row[p] = fmt(c["ms_per_token"], digits_for("ms_per_token")) + mark
        rows.append(row)
    bw = cmodel.bandwidth_mib_s
    lines = [f"estimated ms per decoded token ({cmodel.kind} model: {cmodel.model}; intercept {cmodel.intercept_ms:.1f} ms, "
             f"{cmodel.ms_per_mib:.4f} ms/MiB" + (f" = {bw:.0f} MiB/s" if bw else "") + ")",
             "\n".join(line.rstrip() for line in text_table(rows, ["budget", *pols], ["budget_mib", *pols]).splitlines())]
    lines += verdict(overall)
    return "\n".join(lines)


def validate_ok(row) -> bool | None:
    """Did the replay reproduce the engine (cumulative hit % within the tolerance)? None when the
    trace records no engine hit rate to compare with."""
    if row.get("diff_pp") is None:
        return None
    return abs(row["diff_pp"]) <= VALIDATE_TOLERANCE_PP


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
