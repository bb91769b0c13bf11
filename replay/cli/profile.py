"""``profile``: the routing's locality profile (is it cacheable?), as text, one JSON object, or a
directory of tables and plots. The command parses options and formats what
:mod:`replay.analyses.locality` returns."""

from __future__ import annotations

from pathlib import Path

import typer

from replay.cli.options import BudgetMibOpt, JsonOpt, TraceArg, example, parse_budget


def register(app: typer.Typer) -> None:
    @app.command(epilog=example("moe-replay profile traces/qwen --budget-mib 4GiB -o qwen-profile"))
    def profile(
        trace: Path = TraceArg,
        phase: str = typer.Option("decode", "--phase", help="Routings to profile: decode | prefill | all (both); the "
                                  "reuse figures count that phase's lookups of a cache that runs through every phase."),
        budget_mib: str | None = BudgetMibOpt,
        segments: str = typer.Option("4,16,64,256", "--segments", help="SRP/SCH segment lengths in tokens (the "
                                     "paper's: 4,16,64,256)."),
        pair_layer: int | None = typer.Option(None, "--pair-layer", help="With -o: the MoE layer L of the transition "
                                              "heatmap (L -> next MoE layer) [default: the most predictable pair]."),
        per_layer: bool = typer.Option(True, "--per-layer/--no-per-layer", help="Print the per-layer table."),
        out: Path | None = typer.Option(None, "-o", "--out", help="Write every table (CSV and Parquet) and the plots "
                                        "(PNG) into this directory (atomically)."),
        force: bool = typer.Option(False, "--force", help="Replace the -o directory if it exists."),
        json_out: bool = JsonOpt,
    ) -> None:
        """Is this routing cacheable? Popularity, reuse, co-activation, SRP and SCH per layer."""
        import json

        from replay.analyses.locality import summary
        from replay.api import profile_run
        from replay.core.phases import check_phase
        from replay.present.format import json_object, rows_of
        from replay.present.profile import profile_text, write_plots
        from traces import open_trace
        from traces.format.errors import UserError
        from traces.io.atomic import staged_dir

        check_phase(phase)
        try:
            segs = [int(s) for s in segments.split(",") if s.strip()]
        except ValueError:
            raise UserError(f"--segments {segments}: expected token counts like 4,16,64,256.") from None
        if not segs or min(segs) < 1:
            raise UserError(f"--segments {segments}: segment lengths are >= 1 token.")
        if force and out is None:
            raise UserError("--force: only meaningful with -o DIR.")
        t = open_trace(trace)
        if pair_layer is not None and (pair_layer not in t.moe_layers or pair_layer == t.moe_layers[-1]):
            raise UserError(f"--pair-layer {pair_layer}: not a MoE layer with a next MoE layer "
                            f"(MoE layers {t.moe_layers[0]}..{t.moe_layers[-1]}).")
        if out is not None:
            from traces.io.atomic import check_output_dir

            check_output_dir(out, force, [trace])  # before the work, not after
        prof = profile_run(t, phase=phase, budget_mib=parse_budget(budget_mib), segment_lengths=segs)
        if out is not None:
            with staged_dir(out, force=force, inputs=[trace]) as stage:
                (stage / "tables").mkdir()
                for name, frame in {"summary": summary(prof), **prof.tables()}.items():
                    frame.write_csv(stage / "tables" / f"{name}.csv")
                    frame.write_parquet(stage / "tables" / f"{name}.parquet")
                (stage / "answer.json").write_text(json.dumps(prof.answer, indent=1, sort_keys=True) + "\n")
                write_plots(prof, stage, pair_layer)
        if json_out:
            typer.echo(json_object("profile", str(trace), rows_of(summary(prof)), answer=prof.answer, phase=prof.phase,
                                   **{name: rows_of(frame) for name, frame in prof.tables().items()}))
        else:
            typer.echo(profile_text(trace, prof, per_layer))
            if out is not None:
                typer.echo(f"\nwrote {out}/ (tables/*.csv and *.parquet, answer.json, PNG plots)")
