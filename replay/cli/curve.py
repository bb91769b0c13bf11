"""``moe-replay curve``: the hit-rate curve at every budget in one pass, and the budget answer.
Thin: the numbers come from :func:`replay.api.curve_run`."""

from __future__ import annotations

from pathlib import Path

import typer

from replay.cli.options import (
    BUDGET_UNITS_HELP,
    ComputeMsOpt,
    CostModelOpt,
    FlashMibSOpt,
    ForeignCostModelOpt,
    JsonOpt,
    TraceArg,
    check_foreign_cost_model,
    example,
)
from traces.format.errors import UserError


def curve_cmd(
    trace: Path = TraceArg,
    policies: str = typer.Option("lru,layer", "--policies", help="Comma-separated: lru (global LRU), layer (the budget split "
                                 "equally over the MoE layers), layer-opt (the best per-layer split; at --budgets only), "
                                 "belady (furthest next use; only on traces with one lookup per load and one expert size, "
                                 "where it is a stack algorithm)."),
    budgets: str | None = typer.Option(None, "--budgets", help=f"Budgets to add to the curve, comma-separated, each in "
                                       f"{BUDGET_UNITS_HELP}.", show_default=False),
    out: Path | None = typer.Option(None, "-o", "--out", "--csv", help="Write every row to this file, atomically: "
                                    "Parquet if it ends in .parquet, else CSV.", show_default=False),
    sample_rate: float | None = typer.Option(None, "--sample-rate", help="SHARDS: measure lru on a seeded spatial sample "
                                             "of the (layer, expert) entries at this rate (0-1]; rows are estimates.",
                                             show_default=False),
    sample_size: int | None = typer.Option(None, "--sample-size", help="SHARDS with a fixed number of sampled entries.",
                                           show_default=False),
    seed: int = typer.Option(0, "--seed", help="Seed of the sample's hash."),
    tolerance: str = typer.Option("1,5", "--tolerance", help="Knee tolerances in percentage points below the plateau."),
    cost_model: Path | None = CostModelOpt,
    flash_mib_s: float | None = FlashMibSOpt,
    compute_ms: float | None = ComputeMsOpt,
    foreign_cost_model: bool = ForeignCostModelOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Hit rate (decode-only and cumulative) and MiB read at every budget where the curve changes, in one
    pass, each figure equal to a replay at that budget; the knee, the cliff below T and what each doubling buys."""
    from replay import api
    from replay.analyses.cost_model import cost_model_from_options
    from replay.cli.options import parse_budgets
    from replay.core.frames import rows_of
    from replay.present.curve import curve_text
    from replay.present.format import json_object
    from traces import open_trace
    from traces.io.atomic import check_output_file, write_output_bytes

    pols = [p.strip() for p in policies.split(",") if p.strip()]
    if not pols:
        raise UserError("--policies: name at least one of lru, layer, layer-opt.")
    try:
        tols = [float(x) for x in tolerance.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--tolerance {tolerance!r}: give percentage points, comma-separated (e.g. 1,5).") from None
    cmodel = cost_model_from_options(cost_model, flash_mib_s, compute_ms)
    check_foreign_cost_model(foreign_cost_model, cost_model)
    blist = parse_budgets(budgets) if budgets is not None else None
    inputs = [trace, cost_model]
    if out is not None:
        check_output_file(out, inputs=inputs)
    # Rows are checked as the curve's pass reads them (one read of the trace, not two), as cache does.
    t = open_trace(trace, defer_rows=True)
    res = api.curve_run(t, policies=pols, budgets_mib=blist, sample_rate=sample_rate, sample_size=sample_size, seed=seed,
                        tolerances_pp=tols, cost_model=cmodel, foreign_cost_model=foreign_cost_model)
    if out is not None:
        if out.suffix == ".parquet":
            import io

            buf = io.BytesIO()
            res.frame.write_parquet(buf, compression="zstd", statistics=True)
            write_output_bytes(out, buf.getvalue(), inputs=inputs)
        else:
            write_output_bytes(out, res.frame.write_csv().encode("utf-8"), inputs=inputs)
    if json_out:
        typer.echo(json_object("curve", str(trace), rows_of(res.frame), token_cycle_mib=res.token_cycle_bytes / 2**20,
                               working_set_mib=res.working_set_bytes / 2**20, budget_answer=res.answer,
                               sample_rate=res.sample_rate, notes=res.notes,
                               per_layer=rows_of(res.per_layer) if res.per_layer is not None else None,
                               cost_model=(cmodel.row() if cmodel is not None else None)))
        return
    typer.echo(curve_text(t, res, pols))


def register(app: typer.Typer) -> None:
    app.command("curve", epilog=example("moe-replay curve traces/qwen --budgets 2GiB -o curve.parquet"))(curve_cmd)
