"""``upgrade``: rewrite a format version 1 trace as version 2 (traces/io/upgrade.py, docs/format.md)."""

from __future__ import annotations

from pathlib import Path

import typer

from replay.cli.options import JsonOpt, example


def upgrade(
    trace: Path = typer.Argument(..., help="A format version 1 trace (read, never modified).", metavar="OLD_TRACE"),
    out_dir: Path = typer.Argument(..., help="Trace directory to create (format version 2).", metavar="NEW_TRACE"),
    force: bool = typer.Option(False, "--force", help="Replace NEW_TRACE if it exists (never an input)."),
    json_out: bool = JsonOpt,
) -> None:
    """Rewrite a version 1 trace as format version 2 (the same routings, figures and trace.json;
    the layout pyarrow reads at memory speed). Every verb still reads version 1 as it is."""
    from replay.cli import _echo
    from replay.present.format import json_object
    from traces.io.upgrade import upgrade_trace

    res = upgrade_trace(trace, out_dir, force=force)
    if json_out:
        _echo(json_object("upgrade", str(out_dir), [{"from": str(trace), **res}]))
        return
    _echo(f"wrote {out_dir}: format version {res['version']} (from version {res['from_version']}), "
          f"{res['rows']:,} routings in {res['parts']} part file(s); {trace} is unchanged")


def register(app: typer.Typer) -> None:
    app.command("upgrade", epilog=example("moe-replay upgrade traces/old traces/old-v2"))(upgrade)
