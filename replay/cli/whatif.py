"""``drop`` and ``prefetch``: what-ifs that change what is read. Thin: the numbers come from
:mod:`replay.analyses.drop_cold` and :mod:`replay.analyses.prefetching`; time columns from :mod:`replay.analyses.cost_model`."""

from __future__ import annotations

from pathlib import Path

import typer

from replay.cli.options import (
    BUDGET_UNITS_HELP,
    DeviceProfileOpt,
    ForeignCostModelOpt,
    JsonOpt,
    MixOpt,
    PolicyFileOpt,
    PredictorFileOpt,
    SplitSeedOpt,
    TimeModelOpt,
    TraceArg,
    TrainOpt,
    TrainTraceOpt,
    check_foreign_cost_model,
    example,
    learner_keywords,
    parse_budget,
)
from traces.format.errors import UserError


def parse_floats(text: str, option: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{option} {text!r}: expected comma-separated numbers.") from None
    if not vals:
        raise UserError(f"{option} is empty.")
    return vals


def register(app: typer.Typer) -> None:
    @app.command(epilog=example("moe-replay drop traces/qwen --mode closed --budget-mib 4GiB --fracs 0.25,0.5"))
    def drop(
        trace: Path = TraceArg,
        fracs: str = typer.Option("0.25,0.5,0.75,1.0", "--fracs", help="Drop-cold thresholds F: skip a miss whose weight < F/k."),
        mode: str = typer.Option("static", "--mode", help="static (recorded residency) | closed (replayed cache)."),
        phase: str = typer.Option("decode", "--phase", help="Routings to drop from and judge: decode | prefill | all (both)."),
        budget_mib: str | None = typer.Option(None, "--budget-mib", help=f"closed: cache budget in {BUDGET_UNITS_HELP} "
                                              "(default: the recorded one).", show_default=False),
        policy: str = typer.Option("lru", "--policy", help="closed: cache policy of the replay."),
        cost_model: Path | None = typer.Option(None, "--cost-model", help="Add ms/token from a 'cost fit --json' file (decode only)."),
        foreign_cost_model: bool = ForeignCostModelOpt,
        time_model: str | None = TimeModelOpt,
        device_profile: str | None = DeviceProfileOpt,
        policy_file: list[Path] | None = PolicyFileOpt,
        json_out: bool = JsonOpt,
    ) -> None:
        """Drop-cold trade-off: reads avoided against router weight mass discarded, next to the top-k cut."""
        from replay.plugin_files import register_files

        register_files(policy_file, None)
        from replay.api import drop as api_drop
        from replay.core.frames import rows_of
        from replay.core.phases import check_phase
        from replay.present.format import json_object
        from replay.present.whatif import (
            DROP_TIMELINE,
            _model_scope,
            format_closed,
            format_drop,
            format_drop_time,
            format_drop_timeline,
        )
        from traces import open_trace

        check_phase(phase)
        values = parse_floats(fracs, "--fracs")
        if mode not in ("static", "closed"):
            raise UserError(f"--mode {mode!r} is not static or closed.")
        budget_mib = parse_budget(budget_mib, "--budget-mib")
        check_foreign_cost_model(foreign_cost_model, cost_model)
        model = _cost_model(cost_model, phase)
        tr = open_trace(trace)
        from replay.analyses.timeline_whatif import check_time_model

        check_time_model(time_model, device_profile)
        if time_model == "linear" and model is None:
            from replay.api import fit_cost_model

            model = _cost_model_checked(fit_cost_model(tr), phase)  # the linear model fitted on this run's own metrics
        model = _applied(model, tr, foreign_cost_model)
        timeline = time_model in ("fitted", "profile")
        frame = api_drop(tr, fracs=values, mode=mode, budget_mib=budget_mib, policy=policy, phase=phase, cost_model=model,
                         foreign_cost_model=foreign_cost_model, time_model=time_model if timeline else None,
                         device_profile=device_profile)
        notes = []
        if model is not None:
            notes.append(f"ms_per_token: {model.model} (decode tokens; {_model_scope()})")
        if timeline:
            notes.append(DROP_TIMELINE)
        if json_out:
            typer.echo(json_object("drop", str(trace), rows_of(frame), mode=mode, notes=notes or None))
            return
        timed = model is not None or timeline
        typer.echo(format_drop(frame, tr.top_k, timed) if mode == "static" else format_closed(frame, tr.top_k, timed))
        if timed:
            typer.echo("")
            typer.echo(format_drop_timeline(frame) if timeline else format_drop_time(frame, mode))

    @app.command(epilog=example("moe-replay prefetch traces/qwen --predictor prev-token --budget-mib 4GiB --cap 4"))
    def prefetch(
        trace: Path = TraceArg,
        predictor: str = typer.Option("prev-token", "--predictor", help="A predictor: prev-token, stale-gate\\[d], "
                                       "static-hot, static-hot-prompt, pair-table\\[d], request-match, mix, or one from "
                                       "--predictor-file."),
        budget_mib: str | None = typer.Option(None, "--budget-mib", help=f"Cache budget in {BUDGET_UNITS_HELP} (default: the "
                                              "recorded one).", show_default=False),
        policy: str = typer.Option("lru", "--policy", help="lru | lfru"),
        cap: int | None = typer.Option(None, "--cap", help="At most N predicted misses read per layer."),
        guard: bool = typer.Option(False, "--guard", help="LFRU eviction guard on speculative fills."),
        drop_frac: float | None = typer.Option(None, "--drop", help="Skip guesses with predicted weight < F/k (top kept)."),
        retain: bool = typer.Option(False, "--retain", help="Also protect the guesses for the next layer(s) from eviction."),
        train: str | None = TrainOpt,
        train_trace: Path | None = TrainTraceOpt,
        seed: int = SplitSeedOpt,
        mix: str | None = MixOpt,
        cost_model: Path | None = typer.Option(None, "--cost-model", help="Add ms/token from a 'cost fit --json' file."),
        foreign_cost_model: bool = ForeignCostModelOpt,
        time_model: str | None = TimeModelOpt,
        device_profile: str | None = DeviceProfileOpt,
        policy_file: list[Path] | None = PolicyFileOpt,
        predictor_file: list[Path] | None = PredictorFileOpt,
        json_out: bool = JsonOpt,
    ) -> None:
        """Speculative prefetch: a predictor's guesses read into the same cache, against no prefetch."""
        from replay.plugin_files import register_files

        register_files(policy_file, predictor_file)
        from replay.api import prefetch as api_prefetch
        from replay.core.frames import rows_of
        from replay.present.format import json_object
        from replay.present.whatif import BYTES_NOT_TIME, PREFETCH_NOTES, TIMED, TIMELINE, format_prefetch
        from traces import open_trace

        budget_mib = parse_budget(budget_mib, "--budget-mib")
        check_foreign_cost_model(foreign_cost_model, cost_model)
        model = _cost_model(cost_model, "decode")
        tr = open_trace(trace)
        from replay.analyses.timeline_whatif import check_time_model

        check_time_model(time_model, device_profile)
        if time_model == "linear" and model is None:
            from replay.api import fit_cost_model

            model = fit_cost_model(tr)  # the linear model fitted on this run's own metrics
        model = _applied(model, tr, foreign_cost_model)
        frame = api_prefetch(tr, predictor=predictor, budget_mib=budget_mib, policy=policy, cap=cap, guard=guard,
                             drop_frac=drop_frac, retain=retain, cost_model=model, foreign_cost_model=foreign_cost_model,
                             predictor_file=predictor_file, time_model=None if time_model == "linear" else time_model,
                             device_profile=device_profile, seed=seed,
                             **learner_keywords(train, train_trace, mix))
        if json_out:
            timeline = time_model in ("fitted", "profile")
            notes = [*PREFETCH_NOTES, TIMELINE if timeline else BYTES_NOT_TIME if model is None else TIMED]
            typer.echo(json_object("prefetch", str(trace), rows_of(frame), notes=notes))
            return
        typer.echo(format_prefetch(tr, rows_of(frame)[0], model))



def _cost_model(path: Path | None, phase: str):
    if path is None:
        return None
    from replay.analyses.cost_model import load_cost_model

    if phase != "decode":
        raise UserError(f"--cost-model: time per token is modelled for decoded tokens; use --phase decode, not {phase!r}.")
    return load_cost_model(path)


def _cost_model_checked(model, phase: str):
    if phase != "decode":
        raise UserError(f"--time-model linear: time per token is modelled for decoded tokens; use --phase decode, not {phase!r}.")
    return model


def _applied(model, tr, foreign: bool):
    """The model as it may be applied to ``tr`` (refused, or a copy marked foreign: replay.analyses.cost_origin)."""
    if model is None:
        return None
    from replay.analyses.cost_origin import apply_to

    return apply_to(model, tr, foreign=foreign)
