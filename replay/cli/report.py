"""``report``: one command that writes the whole report of a trace."""

from __future__ import annotations

from pathlib import Path

import typer

from replay.cli.options import (
    BudgetsOpt,
    ComputeMsOpt,
    DeviceProfileOpt,
    FlashMibSOpt,
    ForeignCostModelOpt,
    PolicyFileOpt,
    PredictorFileOpt,
    TimeModelOpt,
    TraceArg,
    check_foreign_cost_model,
    example,
    parse_budgets,
)


def register(app: typer.Typer) -> None:
    @app.command(epilog=example("moe-replay report traces/qwen -o reports/qwen --budget-mib 4GiB --force"))
    def report(
        trace: Path = TraceArg,
        out: Path = typer.Option(..., "-o", "--out", help="Report directory to create (index.md, index.html, PNGs, tables/)."),
        budgets: str | None = BudgetsOpt,
        budget_mib: str | None = typer.Option(None, "--budget-mib", help="The budget(s) the verdict answers for, comma-separated, "
                                              "each in MiB or with a binary unit (default: the recorded one, else 2 x T); "
                                              "drop-cold and prefetch run there too.", show_default=False),
        policies: str | None = typer.Option(None, "--policies", help="Cache policies, comma-separated."),
        cost_model: Path | None = typer.Option(None, "--cost-model", help="A 'cost fit --json' file (default: fit on the metrics)."),
        flash_mib_s: float | None = FlashMibSOpt,
        compute_ms: float | None = ComputeMsOpt,
        foreign_cost_model: bool = ForeignCostModelOpt,
        time_model: str | None = TimeModelOpt,
        device_profile: str | None = DeviceProfileOpt,
        force: bool = typer.Option(False, "--force", help="Replace OUT if it exists."),
        policy_file: list[Path] | None = PolicyFileOpt,
        predictor_file: list[Path] | None = PredictorFileOpt,
        quality: list[Path] = typer.Option([], "--quality", help="A 'moe-replay quality' output directory or its quality.json "
                                           "(repeatable): adds quality lost against reads avoided per setting."),
    ) -> None:
        """Write a report: the verdict first (best policy, predictor, prefetch, drop-cold at the budget), then the evidence."""
        from replay.analyses.cost_model import cost_model_from_options
        from replay.analyses.report import SECTIONS

        # First: OUT may not be, hold or lie inside anything the report reads (--force or not).
        from replay.analyses.timeline_fit import PRESETS
        from replay.analyses.timeline_whatif import check_time_model
        from replay.api import write_report
        from replay.core.progress import progress
        from replay.core.simulate import check_policies
        from replay.plugin_files import register_files
        from traces.io.atomic import check_not_input, check_not_special

        check_time_model(time_model, device_profile)
        profile_file = Path(device_profile) if device_profile is not None and device_profile not in PRESETS else None
        inputs = [cost_model, profile_file, *(policy_file or []), *(predictor_file or []), *quality]
        check_not_input(out, [trace, *inputs])
        check_not_special(out)
        register_files(policy_file, predictor_file)
        # Validated up front, as 'cache' does: a bad value must not silently turn into a section
        # marked unavailable (every section's UserError is caught and shown as "not available").
        b = parse_budgets(budgets, "--budgets") if budgets is not None else None
        vb = parse_budgets(budget_mib, "--budget-mib") if budget_mib is not None else None
        p = check_policies([x for x in policies.split(",") if x.strip()]) if policies is not None else None
        m = cost_model_from_options(cost_model, flash_mib_s, compute_ms)
        check_foreign_cost_model(foreign_cost_model, cost_model)
        with progress(len(SECTIONS), "report", unit="section") as bar:
            write_report(trace, out, budgets_mib=b, budget_mib=vb, policies=p, cost_model=m, force=force,
                         predictor_file=predictor_file, progress=lambda name: (bar.set_postfix_str(name), bar.update()),
                         inputs=inputs, quality=list(quality), foreign_cost_model=foreign_cost_model,
                         time_model=None if time_model == "linear" else time_model, device_profile=device_profile)
        typer.echo(f"wrote {out}/index.md and {out}/index.html")
