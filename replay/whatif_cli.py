"""``drop`` (and later ``prefetch``): what-ifs that change what is read."""

from __future__ import annotations

from pathlib import Path

import typer

from traces.errors import UserError


def parse_floats(text: str, option: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{option} {text!r}: expected comma-separated numbers.") from None
    if not vals:
        raise UserError(f"{option} is empty.")
    return vals


def register(app: typer.Typer) -> None:
    @app.command()
    def drop(
        trace: Path = typer.Argument(..., help="Trace directory."),
        fracs: str = typer.Option("0.25,0.5,0.75,1.0", "--fracs", help="Drop-cold thresholds F: skip a miss whose weight < F/k."),
        mode: str = typer.Option("static", "--mode", help="static (recorded residency) | closed (replayed cache)."),
        phase: str = typer.Option("decode", "--phase", help="decode | prefill | all"),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    ) -> None:
        """Drop-cold trade-off: reads avoided against router weight mass discarded, next to the static top-k cut."""
        from replay.drop import static_drop
        from replay.output import json_object, rows_of
        from traces import open_trace

        values = parse_floats(fracs, "--fracs")
        for f in values:
            if f < 0:
                raise UserError(f"--fracs: {f} is not a non-negative fraction (F in 'weight < F / k').")
        if mode != "static":
            raise UserError(f"--mode {mode!r}: only 'static' is available in this version.")
        tr = open_trace(trace)
        frame = static_drop(tr, values, phase=phase)
        if json_out:
            typer.echo(json_object("drop", str(trace), rows_of(frame)))
            return
        typer.echo(format_drop(frame, tr.top_k))


def format_drop(frame, k: int) -> str:
    from replay.output import rows_of, text_table

    rows = rows_of(frame)
    phase = rows[0]["phase"] if rows else "decode"
    cold = [r for r in rows if r["mode"] == "static"]
    cut = [r for r in rows if r["mode"] == "static-k"]
    out = [f"drop-cold, static: on the recorded run ({phase} routings), skip a miss whose weight < F/{k}; "
           "the top-weighted expert is never skipped"]
    out.append(text_table(cold, ["frac", "io_saved_pct", "io_saved_mib", "mass_lost_pct", "routings_dropped_pct",
                                 "survivors_mean", "static_k_mass_lost_at_equal_io_pct"],
                          ["F", f"io_saved_%_{phase}", "saved_MiB", "mass_lost_%", "routings_dropped_%", "experts_left",
                           "top-k cut mass_lost_% at equal io"], digits={"frac": 2, "survivors_mean": 2}))
    out.append("")
    out.append("static top-k cut on the same rows (every slot at rank >= keep_k dropped, hit or miss; only misses save bytes):")
    out.append(text_table(cut, ["keep_k", "io_saved_pct", "io_saved_mib", "mass_lost_pct"],
                          ["keep_k", f"io_saved_%_{phase}", "saved_MiB", "mass_lost_%"]))
    out.append("")
    out.append("io_saved = share of the recorded miss bytes not read; weight mass is not quality (no perplexity or task "
               "accuracy is measured); bytes are not time (see 'cost fit').")
    return "\n".join(out)
