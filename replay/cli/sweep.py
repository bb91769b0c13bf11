"""``sweep`` (a TOML grid of traces x analyses x parameters into Parquet tables, resumable, on a
local process pool or Ray) and ``sweep-report`` (compare the traces of a sweep). Thin: the work is
in :mod:`replay.analyses.sweeps`."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from replay.cli.options import JsonOpt, example
from traces.format.errors import UserError


def register(app: typer.Typer) -> None:
    @app.command(epilog=example("moe-replay sweep grid.toml -o results"))
    def sweep(
        grid: Path | None = typer.Argument(None, help="The grid (TOML): traces and, per analysis kind, the lists to cross.",
                                           show_default=False),
        out: Path | None = typer.Option(None, "-o", "--out", help="Results directory (created; a rerun finishes it)."),
        engine: str = typer.Option("local", "--engine", help="local (a process pool on this machine) | ray (cells as Ray "
                                   "tasks; needs the cluster extra)."),
        workers: int | None = typer.Option(None, "--workers", help="local: worker processes (default: one per core)."),
        address: str | None = typer.Option(None, "--address", help="ray: auto (the cluster this machine belongs to) or "
                                           "HOST:PORT of a running head node (default: start Ray on this machine)."),
        force: bool = typer.Option(False, "--force", help="Recompute every cell of the grid, even those RESULTS holds."),
        example: bool = typer.Option(False, "--example", help="Print a commented example grid and exit."),
        json_out: bool = JsonOpt,
    ) -> None:
        """Run a grid of analyses (cache, predict, drop, prefetch, retention, curve, profile) over traces into Parquet tables.

        Each cell (one trace x one set of keyword arguments of the kind's API function) is computed
        once: a rerun computes only the cells RESULTS lacks, so an interrupted sweep is finished by
        running it again. Tables: RESULTS/<kind>.parquet, rows in grid order, identical whatever the
        engine. Compare the traces with 'moe-replay sweep-report RESULTS'."""
        from replay.analyses.sweeps import EXAMPLE, run_sweep
        from replay.present.format import json_object

        if example:
            typer.echo(EXAMPLE, nl=False)
            return
        if grid is None:
            raise UserError("sweep: give the grid file (see 'moe-replay sweep --example').")
        if out is None:
            raise UserError("-o/--out: give the results directory.")
        summary = run_sweep(grid, out, engine=engine, workers=workers, address=address, force=force, show_progress=True)
        for line in summary.get("corrupt_chunks", []):
            print(f"moe-replay: warning: {line}", file=sys.stderr)
        if json_out:
            extra = {k: v for k, v in summary.items() if k not in ("kinds", "format", "version")}
            typer.echo(json_object("sweep", None, summary["kinds"], results=str(out), **extra))
            return
        # Wall clock of the whole sweep: worker start, trace reading and any first-run Numba compile
        # included (not the kernels' own time; benchmarks/sweep_scale.py separates them).
        rate = f", {summary['cells_per_s']:.2f} cells/s" if summary["cells_per_s"] else ""
        where = (f"{summary['workers']} local worker{'s' if summary['workers'] != 1 else ''}" if engine == "local"
                 else "Ray")
        typer.echo(f"swept {summary['cells']} cells of {grid} over {len(summary['traces'])} traces: "
                   f"{summary['computed']} computed ({where}, {summary['seconds']:.1f} s wall{rate}, worker start and any first-run "
                   "compile included), "
                   f"{summary['reused']} already in {out}"
                   + (f" ({summary['same_content']} share a trace's content with another path of the grid: computed once)"
                      if summary["same_content"] else ""))
        for k in summary["kinds"]:
            typer.echo(f"  {k['table']}: {k['rows']} rows from {k['cells']} cells")
            for n in k["notes"]:
                typer.echo(f"    note: {n}")

    @app.command("sweep-report", epilog=example("moe-replay sweep-report results"))
    def sweep_report(
        results: Path = typer.Argument(..., help="A sweep's results directory (moe-replay sweep -o RESULTS).",
                                       show_default=False),
        json_out: bool = JsonOpt,
    ) -> None:
        """Compare the traces of a sweep: best within-budget online policy per budget and trace, against Belady; the budget answer.

        With a cost model in the [cache] cells, also the fastest online policy by ms per decoded token.
        With a [profile] table, also each profile cell's answer to 'is this routing cacheable?'."""
        from replay.analyses.sweeps import profile_answers, sweep_budget_answer
        from replay.analyses.sweeps import sweep_report as run
        from replay.core.frames import rows_of
        from replay.present.curve import sweep_answer_lines
        from replay.present.format import json_object

        profiles = profile_answers(results)  # None without a [profile] table
        cache_grid = (results / "cache.parquet").exists()
        curves = cache_grid or (results / "curve.parquet").exists()
        frame = run(results) if curves or profiles is None else None
        answers = rows_of(sweep_budget_answer(results)) if curves else []
        if json_out:
            extra = {} if profiles is None else {"profile": rows_of(profiles)}
            typer.echo(json_object("sweep-report", None, [] if frame is None else rows_of(frame), results=str(results),
                                   budget_answer=answers, **extra))
            return
        parts = [report_text(frame, results)] if cache_grid and frame is not None else []
        lines = sweep_answer_lines(answers, cache_grid)
        if lines:
            parts.append("budget answer: where each curve (or the tested budgets' hit rate) bends\n" + "\n".join(lines))
        if profiles is not None:
            parts.append(profile_text(profiles, results))
        typer.echo("\n\n".join(parts))


def profile_text(answers, results: Path) -> str:
    """Per [profile] cell: the trace, its parameters and the answer to 'is this routing cacheable?'
    (the headline ``moe-replay profile`` prints, from the same figures)."""
    from replay.core.frames import rows_of
    from replay.present.format import exact
    from replay.present.profile import answer_lines

    if answers.height == 0:
        return f"{results}: the profile table has no rows."
    lines = [f"sweep {results}: is this routing cacheable? (per [profile] cell; figures in profile.parquet's pooled "
             "rows, answer_*)"]
    for r in rows_of(answers):
        params = [f"{k[len('cell_'):]} {exact(v) if isinstance(v, float) else v}" for k, v in r.items()
                  if k.startswith("cell_") and v is not None]
        head = answer_lines(r)[0].removeprefix("Is this routing cacheable? ")
        lines.append(f"{r['trace']}" + (f" ({', '.join(params)})" if params else "") + f": {head}")
    return "\n".join(lines)


def report_text(frame, results: Path) -> str:
    from replay.core.frames import rows_of
    from replay.present.cache import OVER
    from replay.present.format import exact, fmt_q, header_for, text_table

    if frame.height == 0:
        return f"{results}: the cache table has no rows."
    cols = ["trace", "budget_mib", "best_online", "best_online_hit_pct_decode", "belady_hit_pct_decode", "gap_to_belady_pp"]
    heads = [header_for(c) for c in cols]  # the report's headers for the same quantities (replay.present.format.HEADERS)
    if "cell_cost_model" in frame.columns:
        cols.insert(1, "cell_cost_model")
        heads.insert(1, "Cost model")
    cols += ["vs_lru_call"]
    heads += ["Best vs LRU (points, 95% interval)"]
    if "fastest_online" in frame.columns:
        cols += ["fastest_online", "fastest_ms_per_token", "fastest_tok_s", "fastest_vs_lru_call"]
        heads += ["Fastest online policy", header_for("ms_per_token"), header_for("tok_s"),
                  "Fastest vs LRU (ms/token, 95% interval)"]
    rows = rows_of(frame)
    for r in rows:  # the one call (replay.analyses.paired.decide): better / worse only when the interval excludes zero
        r["vs_lru_call"] = _call_cell(r, "", "delta_vs_lru_pp", "delta_", r.get("tied_with_best"))
        if "fastest_online" in frame.columns:
            r["fastest_vs_lru_call"] = _call_cell(r, "fastest_", "fastest_delta_ms_vs_lru", "fastest_delta_ms_",
                                                  r.get("tied_with_fastest"))
    bel_over = [r for r in rows if r.get("belady_over_budget")]
    for r in rows:
        if r.get("cell_cost_model"):
            r["cell_cost_model"] = Path(r["cell_cost_model"]).name
        if r.get("belady_over_budget"):  # the bound itself needed more memory than the budget: marked, as in `cache`
            r["belady_hit_pct_decode"] = fmt_q(r["belady_hit_pct_decode"], "pct") + OVER
    lines = [f"sweep {results}: per trace and budget, the online policy (not a bound) with the highest decode hit % among "
             "the cells that stayed within budget; gap = Belady (the offline bound at that budget) minus it, in points",
             text_table(rows, cols, heads)]
    lines.append("vs LRU: the best (fastest) minus LRU on the same tokens, with a 95% interval from a seeded paired block "
                 "bootstrap over decoded tokens; better only when the interval excludes zero, else a tie within noise "
                 "(docs/design.md, 'Paired comparisons')")
    for r in rows:
        if r.get("paired_note"):
            lines.append(f"{r['trace']} at {exact(r['budget_mib'])} MiB: {r['paired_note']}.")
    over = [r for r in rows if r.get("over_budget_excluded")]
    if over:
        lines.append("left out as over budget (a load needed more than the budget: that hit rate needs more memory): "
                     + "; ".join(f"{r['trace']} at {exact(r['budget_mib'])} MiB: {r['over_budget_excluded']}" for r in over))
    if bel_over:
        lines.append(f"{OVER.strip()} Belady over budget (a load larger than the budget overflowed: that bound needs more memory "
                     "than the budget it is listed under): "
                     + ", ".join(f"{r['trace']} at {exact(r['budget_mib'])} MiB" for r in bel_over))
    return "\n".join(lines)


def _call_cell(r: dict, prefix: str, delta: str, ci: str, tied: str | None) -> str:
    """"+1.6 [+0.3, +2.9] better" / "tie within noise (±1.3): +0.2 [-1.1, +1.5]" (and the ties), "-" without one."""
    from replay.analyses.paired import signed, tie_text

    call = r.get(f"{prefix}vs_lru")
    if r.get("fastest_online" if prefix else "best_online") == "lru":
        txt = "is LRU"
    elif call is None:
        txt = "-"
    else:
        lo, hi = r[f"{ci}ci_low"], r[f"{ci}ci_high"]
        iv = f"{signed(r[delta])} [{signed(lo)}, {signed(hi)}]"
        txt = f"{tie_text((hi - lo) / 2, '')}: {iv}" if call == "tie" else f"{iv} {call}"
    return txt + (f"; tied: {tied}" if tied else "")
