"""``cost fit``: fit a time-per-token model on recorded engine metrics (see replay/cost.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from replay.cli.options import JsonOpt

cost_app = typer.Typer(no_args_is_help=True, help="Cost model: from bytes read per token to time per token.")


@cost_app.command("fit")
def fit(
    traces: list[Path] = typer.Argument(..., help="One or more traces with recorded per-token metrics."),
    metrics: Path | None = typer.Option(None, "--metrics", help="A .metrics file for a single trace imported without one."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (save it: --cost-model FILE reads it)."),
) -> None:
    """Fit wall_ms per decoded token against expert bytes read (and misses, if it pays)."""
    from replay.cost import cross_trace, fit_trace
    from replay.output import json_object, rows_of, text_table
    from traces import open_trace
    from traces.errors import UserError
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


@cost_app.command("check")
def check(
    traces: list[Path] = typer.Argument(..., help="Traces with recorded metrics and a recorded cache budget."),
    cost_model: Path | None = typer.Option(None, "--cost-model", help="Use this model (default: fit on each trace's first half)."),
    budget_mib: float | None = typer.Option(None, "--budget-mib", help="Replay budget (default: the recorded one)."),
    json_out: bool = JsonOpt,
) -> None:
    """Replay LRU at the recorded budget, turn the replay's bytes into time, compare with the device
    (at another --budget-mib: the prediction only, since the device ran at the recorded one)."""
    from replay.cost import device_check, load_cost_model
    from replay.output import json_object
    from traces import open_trace

    if budget_mib is not None:
        from replay.cli.cache import parse_budgets

        parse_budgets(repr(budget_mib), "--budget-mib")
    model = load_cost_model(cost_model) if cost_model else None
    rows = [device_check(open_trace(p), model, budget_mib) for p in traces]
    if json_out:
        typer.echo(json_object("cost check", str(traces[0]) if len(traces) == 1 else None, rows))
        return
    typer.echo(check_text(rows, model))


def check_text(rows: list[dict], model) -> str:
    """The check table: like with like only (the error columns are blank where the replayed budget is
    not the one the device ran at), with each error named by what it is."""
    from replay.output import exact, fmt_q, text_table

    cols = ["model", "budget_mib", "recorded_tok_s", "predicted_tok_s", "tok_s_err_pct", "token_mape_pct"]
    heads = ["model", "budget_mib", "recorded tok/s", "predicted tok/s", "run-mean error %", "per-token MAPE %"]
    if any("heldout_run_mean_err_pct" in r for r in rows):
        cols += ["heldout_run_mean_err_pct", "heldout_mape_pct"]
        heads += ["held-out run-mean error %", "held-out per-token MAPE %"]
    lines = [text_table(rows, cols, heads)]
    compared = [r for r in rows if r["compared"]]
    if compared:
        lines.append("predicted = LRU replay at the recorded budget -> the replay's own expert bytes per decoded token -> "
                     "cost model; recorded = the engine's wall time per decoded token (decode only). run-mean error = "
                     "predicted against recorded tok/s over the run; per-token MAPE = mean |error| of single tokens.")
    for r in rows:
        if not r["compared"]:
            lines.append(f"{r['model']} at {exact(r['budget_mib'])} MiB: prediction only, no error: {r['not_compared_why']} "
                         + (f"(recorded {fmt_q(r['recorded_tok_s_at_recorded_budget'], 'tok_s')} tok/s there)."
                            if r["recorded_budget_mib"] is not None else "."))
    if model is None:
        if compared:
            lines.append("model fitted on each trace's first half of decoded tokens: the run-mean error and MAPE over all "
                         "tokens are half in-sample; the held-out columns are the second half only.")
    else:
        scopes = sorted({r["error_scope"] for r in compared})
        for sc in scopes:
            if sc.startswith("in-sample"):
                lines.append("IN-SAMPLE: the given model was fitted on this same run, so its run-mean error is 0 by "
                             "construction (least squares with an intercept), not a measure of accuracy; its own held-out "
                             f"figures from 'cost fit': run-mean error {_pct_or_dash(compared[0]['model_heldout_run_mean_err_pct'])}, "
                             f"per-token MAPE {_mape_or_dash(compared[0]['model_heldout_mape_pct'])}.")
            else:
                lines.append(f"errors are {sc}.")
    return "\n".join(lines)


def _mape_or_dash(v) -> str:
    from replay.output import fmt_q

    return "-" if v is None else f"{fmt_q(v, 'pct')}%"


def _pct_or_dash(v) -> str:
    from replay.output import fmt_q

    return "-" if v is None else f"{'+' if v >= 0 else ''}{fmt_q(v, 'pct')}%"


def _describe(path: str, best, cands) -> str:
    from replay.output import fmt_q

    bw = best.bandwidth_mib_s
    lines = [
        f"{path}: {best.model}",
        f"  intercept {fmt_q(best.intercept_ms, 'ms')} ms/token, slope {fmt_q(best.ms_per_mib, 'ms_per_mib')} ms/MiB"
        + (f", {fmt_q(best.ms_per_miss, 'ms_per_miss')} ms/miss" if best.terms == "bytes+misses" else "")
        + (f" (effective bandwidth {fmt_q(bw, 'mib_s')} MiB/s)" if bw else " (no positive bandwidth implied)"),
        f"  r2 {fmt_q(best.r2, 'r2')} on all {best.tokens_fit + best.tokens_heldout} decoded tokens (the coefficients are "
        "fitted on all of them)",
        f"  held out (fit on the first {best.tokens_fit}, tested on the last {best.tokens_heldout}): per-token MAPE "
        f"{fmt_q(best.heldout_mape_pct, 'pct')}%, run-mean error {_pct_or_dash(best.heldout_run_mean_err_pct)} "
        "(predicted against recorded tok/s)",
    ]
    others = [c for c in cands if c is not best]
    for c in others:
        lines.append(f"  not chosen: {c.terms} (held-out per-token MAPE {fmt_q(c.heldout_mape_pct, 'pct')}%; a richer model "
                     "must cut it by >5%)")
    lines += [f"  note: {n}" for n in best.notes]
    lines.append("  measures: decode-phase ms per token from expert bytes read; prefill is not modelled")
    lines.append(f"  fit provenance: {best.fit_trace_id} ({best.fit_tokens}); 'cost check' on this same run is in-sample")
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    app.add_typer(cost_app, name="cost")
