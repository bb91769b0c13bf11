"""``cost fit``: fit a time-per-token model on recorded engine metrics (see replay/analyses/cost_model.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from replay.cli.options import BUDGET_UNITS_HELP, ForeignCostModelOpt, JsonOpt, check_foreign_cost_model, example, parse_budget

cost_app = typer.Typer(no_args_is_help=True, help="Cost model: from bytes read per token to time per token.")


@cost_app.command("fit", epilog=example("moe-replay cost fit traces/qwen --json > qwen-cost.json"))
def fit(
    traces: list[Path] = typer.Argument(..., help="One or more traces with recorded per-token metrics."),
    metrics: Path | None = typer.Option(None, "--metrics", help="A .metrics file for a single trace imported without one."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (save it: --cost-model FILE reads it)."),
) -> None:
    """Fit wall_ms per decoded token against expert bytes read (and misses, if it pays)."""
    from replay.analyses.cost_model import cross_trace, fit_trace
    from replay.core.frames import rows_of
    from replay.present.cost import _describe
    from replay.present.format import json_object, text_table
    from traces import open_trace
    from traces.format.errors import UserError
    from traces.importers.bigmoe import parse_metrics

    if metrics is not None and len(traces) != 1:
        raise UserError("--metrics FILE applies to a single trace; import each trace with its metrics instead.")
    rows, fitted, feats, texts = [], [], [], []
    for path in traces:
        tr = open_trace(path)
        m = None
        if metrics is not None:
            import polars as pl

            m = pl.from_arrow(parse_metrics(metrics)[0])
        best, cands, f = fit_trace(tr, m)
        fitted.append((str(path), best))
        feats.append((str(path), f))
        for c in cands:
            r = c.row()
            r["selected"] = c is best
            r["trace"] = str(path)
            rows.append(r)
        texts.append(_describe(str(path), best, cands))
    cross = cross_trace(fitted, feats) if len(traces) > 1 else None
    if json_out:
        extra = {"cross_trace": rows_of(cross)} if cross is not None and cross.height else {}
        typer.echo(json_object("cost fit", str(traces[0]) if len(traces) == 1 else None, rows, **extra))
        return
    typer.echo("\n\n".join(texts))
    if cross is not None and cross.height:
        typer.echo("\nacross traces (a model fitted on one run, tested on another run's decoded tokens):")
        typer.echo(text_table(rows_of(cross), ["fit_on", "tested_on", "mape_pct", "mean_ms_recorded", "mean_ms_predicted",
                                               "mean_err_pct"],
                              ["fit_on", "tested_on", "per-token MAPE %", "mean ms recorded", "mean ms predicted",
                               "run-mean ms error %"]))


@cost_app.command("check", epilog=example("moe-replay cost check traces/qwen --cost-model qwen-cost.json"))
def check(
    traces: list[Path] = typer.Argument(..., help="Traces with recorded metrics and a recorded cache budget."),
    cost_model: Path | None = typer.Option(None, "--cost-model", help="Use this model (default: fit on each trace's first half)."),
    budget_mib: str | None = typer.Option(None, "--budget-mib", help=f"Replay budget in {BUDGET_UNITS_HELP} (default: the "
                                          "recorded one).", show_default=False),
    foreign_cost_model: bool = ForeignCostModelOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Replay LRU at the recorded budget, turn the replay's bytes into time, compare with the device
    (at another --budget-mib: the prediction only, since the device ran at the recorded one)."""
    from replay.analyses.cost_model import device_check, load_cost_model
    from replay.present.cost import check_text
    from replay.present.format import json_object
    from traces import open_trace

    budget_mib = parse_budget(budget_mib, "--budget-mib")
    check_foreign_cost_model(foreign_cost_model, cost_model)
    model = load_cost_model(cost_model) if cost_model else None
    rows = [device_check(open_trace(p), model, budget_mib, foreign=foreign_cost_model) for p in traces]
    if json_out:
        typer.echo(json_object("cost check", str(traces[0]) if len(traces) == 1 else None, rows))
        return
    typer.echo(check_text(rows, model))



@cost_app.command("timeline", epilog=example("moe-replay cost timeline traces/qwen"))
def timeline(
    traces: list[Path] = typer.Argument(..., help="One or more traces with recorded per-token metrics and cache budget."),
    metrics: Path | None = typer.Option(None, "--metrics", help="A .metrics file for a single trace imported without one."),
    json_out: bool = JsonOpt,
) -> None:
    """Fit the timeline (reads on lanes against compute) on recorded metrics, held out by alternating
    token blocks, beside the linear model fitted on the same tokens."""
    from replay.api import timeline_fit
    from replay.present.cost import timeline_fit_text
    from replay.present.format import json_object
    from traces import open_trace
    from traces.format.errors import UserError

    if metrics is not None and len(traces) != 1:
        raise UserError("--metrics FILE applies to a single trace; import each trace with its metrics instead.")
    m = None
    if metrics is not None:
        import polars as pl

        from traces.importers.bigmoe import parse_metrics

        m = pl.from_arrow(parse_metrics(metrics)[0])
    rows = []
    for path in traces:
        r = timeline_fit(open_trace(path), metrics=m)
        rows.append({"trace": str(path), **r})
    if json_out:
        typer.echo(json_object("cost timeline", str(traces[0]) if len(traces) == 1 else None, rows))
        return
    typer.echo("\n\n".join(timeline_fit_text(r) for r in rows))


def register(app: typer.Typer) -> None:
    app.add_typer(cost_app, name="cost")
