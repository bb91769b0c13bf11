"""``export``: a trace in other tools' formats (traces/io/exports.py): libCacheSim's oracleGeneral, BigMoeOnEdge's route CSV."""

from __future__ import annotations

from pathlib import Path

import typer

from replay.cli.options import JsonOpt, TraceArg, example

export_app = typer.Typer(no_args_is_help=True, help="Write a trace in another tool's format.")
OutArg = typer.Argument(..., help="The file to write (replaced atomically).", show_default=False)


def _done(kind: str, trace: Path, out: Path, json_out: bool) -> None:
    from replay.present.format import json_object

    size = out.stat().st_size
    if json_out:
        typer.echo(json_object(f"export {kind}", str(trace), [{"out": str(out), "bytes": size}]))
    else:
        typer.echo(f"wrote {out} ({size:,} bytes)")


@export_app.command("libcachesim", epilog=example("moe-replay export libcachesim traces/qwen qwen.oracleGeneral"))
def export_libcachesim(trace: Path = TraceArg, out: Path = OutArg, json_out: bool = JsonOpt) -> None:
    """libCacheSim's oracleGeneral binary trace: one request per unique (layer, expert) per load, obj id =
    layer x n_expert + expert, size = expert bytes, next access filled in; all phases, in replay order."""
    from traces.io.exports import export

    _done("libcachesim", trace, export("libcachesim", trace, out), json_out)


@export_app.command("bigmoe", epilog=example("moe-replay export bigmoe traces/qwen route_trace.csv"))
def export_bigmoe(trace: Path = TraceArg, out: Path = OutArg, json_out: bool = JsonOpt) -> None:
    """BigMoeOnEdge's route_trace v1 CSV, the file 'import bigmoe' reads (needs recorded residency and read bytes)."""
    from traces.io.exports import export

    _done("bigmoe", trace, export("bigmoe", trace, out), json_out)


def register(app: typer.Typer) -> None:
    app.add_typer(export_app, name="export")
