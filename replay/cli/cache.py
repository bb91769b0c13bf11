"""``moe-replay cache``: the expert-cache table (policies x budgets), per layer on request, and
``--validate`` (LRU at the engine's budget against what the engine recorded). Thin: the numbers
come from :mod:`replay.core.simulate`."""

from __future__ import annotations

from pathlib import Path

import typer

from replay.cli.options import (  # noqa: F401
    BudgetsOpt,
    ComputeMsOpt,
    CostModelOpt,
    DeviceProfileOpt,
    FlashMibSOpt,
    ForeignCostModelOpt,
    JsonOpt,
    MixOpt,
    PolicyFileOpt,
    PredictorFileOpt,
    TimeModelOpt,
    TraceArg,
    TrainOpt,
    TrainTraceOpt,
    check_foreign_cost_model,
    example,
    learner_keywords,
    parse_budget,
    parse_budgets,
)
from replay.policies import REGISTRY
from traces.format.errors import UserError

POLICIES_HELP = (
    "Comma-separated: " + ", ".join(REGISTRY) + ". "
    "lfu evicts the entry touched by the fewest loads since the start of the run (the count survives eviction, as in "
    "the reference replay behind the published curves); lfu-incache counts only since the entry's last admission; "
    "ties go to the least recently used. layer / layerlfu[-incache] split the budget equally over the MoE layers. "
    "lfru = frequency << 8 | recency byte, with lfu-incache's count. belady and infinite are bounds (belady only when all "
    "experts have one size: with unequal sizes furthest-next-use is a heuristic). opt-bound = an upper bound on hits with "
    "any sizes (the LP relaxation of the offline optimum, solved as a min-cost flow; seconds to minutes on long traces). "
    "s3fifo = S3-FIFO (SOSP 2023) as libCacheSim runs it: small FIFO of 10% of the bytes, main FIFO with a 2-bit "
    "frequency, ghost of keys evicted from the small queue. sieve = SIEVE (NSDI 2024): one FIFO, a visited bit, a hand "
    "that clears bits and evicts the first unvisited entry. least-stale = an interpretation of SpecMD's least-stale "
    "(no official code): entries not touched in the current token pass (batch) go first, oldest admission first. "
    "None of s3fifo, sieve, least-stale, pin, layer-opt, colibri, opt-bound is in the default list. "
    "pin (the N most-routed experts of each layer in the prompt, or in --pin-profile's trace, "
    "resident from the start and never evicted, LRU for the rest; see --pin-per-layer); layer-opt (per-layer LRU shares "
    "chosen from each layer's miss curve over the whole trace: an offline bound over per-layer LRU partitions, "
    "like belady not an online policy); colibri (the colibri engine's cache: per layer the N hottest experts pinned, "
    "LRU over the layer's share of the rest, and every --colibri-repin tokens a re-pin by its LFRU score with demand "
    "heat, halved after each swap; see --colibri-pin).")

def register(app: typer.Typer) -> None:
    @app.command(epilog=example("moe-replay cache traces/qwen --policies lru,belady --budgets 2GiB,4GiB"))
    def cache(
        trace: Path = TraceArg,
        budgets: str | None = BudgetsOpt,
        policies: str = typer.Option("lru,lfu,layer,lfru,belady,infinite", "--policies", help=POLICIES_HELP),
        per_layer: bool = typer.Option(False, "--per-layer", help="Also one row per MoE layer."),
        phase: str = typer.Option("decode", "--phase", help="Hit % the table leads with: decode (decode loads only), "
                                  "prefill (prompt loads only) or all (both: cumulative)."),
        seed: int = typer.Option(0, "--seed", help="Seed of the random policy (and of the deal of requests with "
                                "--retain --train folds:K)."),
        csv: Path | None = typer.Option(None, "--csv", help="Also write every row to this CSV file (atomically)."),
        validate: bool = typer.Option(False, "--validate", help="Replay LRU at the recorded budget and compare with the engine; "
                                      "exits 1 when the replay does not reproduce the engine (cumulative hit % more than "
                                      "0.1 points off)."),  # replay.core.simulate.VALIDATE_TOLERANCE_PP (tests check they agree)
        budget_mib: str | None = typer.Option(None, "--budget-mib", help="Budget for --validate (default: the recorded one); "
                                              "without --validate, a single budget to replay (not with --budgets). "
                                              "MiB, or with a unit: 4000, 4000MiB, 4GiB, 1.5GiB.", show_default=False),
        cost_model: Path | None = CostModelOpt,
        flash_mib_s: float | None = FlashMibSOpt,
        compute_ms: float | None = ComputeMsOpt,
        foreign_cost_model: bool = ForeignCostModelOpt,
        time_model: str | None = TimeModelOpt,
        device_profile: str | None = DeviceProfileOpt,
        policy_file: list[Path] | None = PolicyFileOpt,
        predictor_file: list[Path] | None = PredictorFileOpt,
        json_out: bool = JsonOpt,
        fmt: str = typer.Option("table", "--format", help="table (the grids) | compact (one line per policy and budget, "
                                "as libCacheSim prints) | json (as --json)."),
        retain: bool = typer.Option(False, "--retain", help="Protect the --predictor's guesses for the next layer(s) from eviction."),
        predictor: str | None = typer.Option(None, "--predictor", help="With --retain: prev-token (the default) | "
                                             "stale-gate\\[d] | static-hot.", show_default=False),
        train: str | None = TrainOpt,
        train_trace: Path | None = TrainTraceOpt,
        mix: str | None = MixOpt,
        pin_per_layer: int | None = typer.Option(None, "--pin-per-layer", help="pin: experts pinned per MoE layer "
                                                 "(default: as many as fit in half the budget, the same in every layer)."),
        pin_profile: Path | None = typer.Option(None, "--pin-profile", help="pin: take the hot list from this trace's whole-run "
                                                "routing counts (same MoE layers and experts) instead of this trace's prompt."),
        colibri_pin: int | None = typer.Option(None, "--colibri-pin", help="colibri: experts pinned per MoE layer "
                                               "(default: as many as fit in half the budget, the same in every layer)."),
        colibri_repin: int | None = typer.Option(None, "--colibri-repin", help="colibri: re-pin every this many tokens, at "
                                                 "batch boundaries (default 0 = off, colibri's default; its balanced "
                                                 "setting is 64)."),
        stream: str = typer.Option("auto", "--stream", help="auto | on | off: replay part by part, the cache state carried "
                                   "from part to part (memory: one part plus the cache states, whatever the trace's "
                                   "length; the figures are the in-memory ones, byte for byte). auto streams when the "
                                   "in-memory replay would hold more than 1,024 MiB (info's cache_memory_mib_in_memory) "
                                   "or a quarter of the memory available now, and every policy streams; pin, colibri, "
                                   "layer-opt, --retain and --validate replay in memory only (on refuses them)."),
    ) -> None:
        """Expert-cache hit rates per policy and budget (decode-only and cumulative), MiB read, T, bound.

        A cell marked '!' is over budget: a load needed more than the budget (or its layer's share),
        so the cache overflowed and the hit rate needs more memory (its peak is listed below the
        tables; JSON/CSV rows carry peak_resident_mib, overflow_loads and over_budget).
        --validate exits 1 when the replay does not reproduce the engine."""
        from replay import api
        from replay.analyses.cost_model import cost_model_from_options
        from replay.analyses.info import require_routings
        from replay.core.frames import rows_of
        from replay.core.notes import NO_DECODE
        from replay.core.phases import check_phase
        from replay.core.simulate import VALIDATE_TOLERANCE_PP, check_policies, validate_ok
        from replay.core.simulate import validate as run_validate
        from replay.present.cache import compact_text, retain_text, sweep_text, time_text, validate_text
        from replay.present.format import json_object
        from traces import open_trace
        from traces.io.atomic import check_output_file, write_output_file

        if json_out and check_format(fmt) not in ("table", "json"):  # table is the default: --json alone
            raise UserError(f"--json and --format {fmt} ask for two outputs; give one of them (--format json is --json).")
        json_out = json_out or check_format(fmt) == "json"
        if predictor is not None and not retain:  # it would be silently ignored
            raise UserError(f"--predictor {predictor}: only meaningful with --retain (cache replays no predictor otherwise).")
        for flag, given in (("--train", train), ("--train-trace", train_trace), ("--mix", mix)):
            if given is not None and not retain:  # it would be silently ignored
                raise UserError(f"{flag} {given}: only meaningful with --retain (cache runs no predictor otherwise).")
        predictor = predictor or "prev-token"
        check_phase(phase)
        cmodel = cost_model_from_options(cost_model, flash_mib_s, compute_ms)
        check_foreign_cost_model(foreign_cost_model, cost_model)
        from replay.analyses.timeline_whatif import check_time_model

        check_time_model(time_model, device_profile)
        timeline = time_model in ("fitted", "profile")
        if timeline and cmodel is not None:
            raise UserError("--time-model fitted|profile and a cost model (--cost-model, --flash-mib-s) are alternatives; "
                            "give one.")
        budget_mib = parse_budget(budget_mib, "--budget-mib")
        from replay.plugin_files import register_files

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
        # Every path this command reads: --csv may be none of them, nor lie inside one.
        inputs = [trace, cost_model, pin_profile, train_trace, *(policy_file or []), *(predictor_file or [])]
        if csv is not None:
            check_output_file(csv, inputs=inputs)  # before the replay, not after
        from replay.core.streaming import check_stream_mode

        check_stream_mode(stream)
        if validate and stream == "on":
            raise UserError("--stream on: --validate compares every routed slot with the engine's record in memory; "
                            "use --stream off or auto.")
        # Rows are checked as the replay reads them (one read of the trace, not two); anything
        # that reads them another way checks them first (traces.io.reader.Trace.rows_pending).
        t = open_trace(trace, defer_rows=True)
        require_routings(t, "replay")
        if time_model == "linear" and cmodel is None:
            cmodel = api.fit_cost_model(t)  # the linear model fitted on this run's own metrics
        if cmodel is not None:  # before the replay: a model of another model or device is refused, or marked
            from replay.analyses.cost_origin import apply_to

            cmodel = apply_to(cmodel, t, foreign=foreign_cost_model)
        if validate:
            row = run_validate(t, budget_mib)
            if csv is not None:
                import polars as pl
                write_output_file(csv, pl.DataFrame([row]).write_csv(), inputs=inputs)
            ok = validate_ok(row)
            if json_out:
                typer.echo(json_object("cache", str(trace), [row], validate=True, tolerance_pp=VALIDATE_TOLERANCE_PP,
                                       reproduced=ok))
            else:
                typer.echo(validate_text(t, row))
            if ok is False:
                raise SystemExit(1)  # the report is printed; a script sees the replay did not reproduce the engine
            return
        if blist is None and budget_mib is not None:
            blist = [budget_mib]
        run = api.cache_run(t, policies=pols, budgets_mib=blist,
                            per_layer=per_layer, phase=phase, seed=seed, policy_options=popts, cost_model=cmodel,
                            retain_predictor=predictor if retain else None, show_progress=True, stream=stream,
                            predictor_file=predictor_file, foreign_cost_model=foreign_cost_model,
                            paired=cmodel is not None and not retain,  # with a cost model: each cell against LRU (replay.analyses.paired)
                            time_model=time_model if timeline else None, device_profile=device_profile,
                            **learner_keywords(train, train_trace, mix))
        frame, blist, loads, sm = run.frame, run.budgets_mib, run.loads, run.summary
        T, W, chosen, collapsed, no_decode = (sm["token_cycle_mib"], sm["working_set_mib"], sm["budgets_chosen"],
                                              sm["collapsed"], sm["no_decode"])
        if csv is not None:
            write_output_file(csv, frame.write_csv(), inputs=inputs)
        if json_out:
            typer.echo(json_object(
                "cache", str(trace), rows_of(frame), phase=phase, token_cycle_mib=T, working_set_mib=W,
                budgets_below_token_cycle=sm["budgets_below_token_cycle"], budgets_chosen=chosen, note=sm["note"],
                cost_model=(cmodel.row() if cmodel is not None else None),
                **({"cost_model_foreign": True} if cmodel is not None and cmodel.foreign else {}),
            ))
            return
        if fmt == "compact":
            typer.echo(compact_text(t, frame, pols, blist))
            return
        typer.echo(sweep_text(t, frame, pols, blist, T, W, chosen, phase, per_layer, collapsed, loads, popts))
        if no_decode:
            typer.echo(f"note: {NO_DECODE}.")
        if retain:
            typer.echo(retain_text(frame, pols, blist))
        if cmodel is not None:
            typer.echo("")
            typer.echo(time_text(frame, pols, blist, cmodel, T))
        if timeline:
            from replay.present.cache import timeline_text

            typer.echo("")
            typer.echo(timeline_text(frame))


FORMATS = ("table", "compact", "json")


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}.")
    return fmt
