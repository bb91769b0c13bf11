"""``cost fit``: fit a time-per-token model on recorded engine metrics (see replay/cost.py)."""

from __future__ import annotations

from pathlib import Path

import typer

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
                                               "mean_err_pct"]))


@cost_app.command("check")
def check(
    traces: list[Path] = typer.Argument(..., help="Traces with recorded metrics and a recorded cache budget."),
    cost_model: Path | None = typer.Option(None, "--cost-model", help="Use this model (default: fit on each trace's first half)."),
    budget_mib: float | None = typer.Option(None, "--budget-mib", help="Replay budget (default: the recorded one)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Replay LRU at the recorded budget, turn the replay's bytes into time, compare with the device."""
    from replay.cost import device_check, load_cost_model
    from replay.output import json_object, text_table
    from traces import open_trace

    if budget_mib is not None:
        from replay.cache_cli import parse_budgets

        parse_budgets(repr(budget_mib), "--budget-mib")
    model = load_cost_model(cost_model) if cost_model else None
    rows = [device_check(open_trace(p), model, budget_mib) for p in traces]
    if json_out:
        typer.echo(json_object("cost check", str(traces[0]) if len(traces) == 1 else None, rows))
        return
    cols = ["model", "budget_mib", "recorded_tok_s", "predicted_tok_s", "tok_s_err_pct", "token_mape_pct"]
    heads = ["model", "budget_mib", "recorded tok/s", "predicted tok/s", "error %", "per-token MAPE %"]
    if all("heldout_tok_s_err_pct" in r for r in rows):
        cols += ["heldout_tok_s_err_pct"]
        heads += ["held-out error %"]
    typer.echo(text_table(rows, cols, heads, digits={"budget_mib": 0, "recorded_tok_s": 3, "predicted_tok_s": 3,
                                                     "tok_s_err_pct": 1, "token_mape_pct": 1, "heldout_tok_s_err_pct": 1}))
    typer.echo("predicted = LRU replay at the recorded budget -> the replay's own expert bytes per decoded token -> "
               "cost model; recorded = the engine's wall time per decoded token (decode only).")
    if model is None:
        typer.echo("model fitted on each trace's first half of decoded tokens; 'held-out error' is on the second half.")


def _describe(path: str, best, cands) -> str:
    bw = best.bandwidth_mib_s
    lines = [
        f"{path}: {best.model}",
        f"  intercept {best.intercept_ms:.1f} ms/token, slope {best.ms_per_mib:.4f} ms/MiB"
        + (f", {best.ms_per_miss:.3f} ms/miss" if best.terms == "bytes+misses" else "")
        + (f" (effective bandwidth {bw:.0f} MiB/s)" if bw else " (no positive bandwidth implied)"),
        f"  r2 {best.r2:.3f} on all {best.tokens_fit + best.tokens_heldout} decoded tokens; held-out error "
        f"(fit on the first {best.tokens_fit}, tested on the last {best.tokens_heldout}) {best.heldout_mape_pct:.1f}% MAPE",
    ]
    others = [c for c in cands if c is not best]
    for c in others:
        lines.append(f"  not chosen: {c.terms} (held-out {c.heldout_mape_pct:.1f}% MAPE; a richer model must cut it by >5%)")
    lines += [f"  note: {n}" for n in best.notes]
    lines.append("  measures: decode-phase ms per token from expert bytes read; prefill is not modelled")
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    app.add_typer(cost_app, name="cost")
