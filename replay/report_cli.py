"""``report``: a Markdown report of a trace (grown section by section as analyses land)."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def report(
        trace: Path = typer.Argument(..., help="Trace directory."),
        out: Path = typer.Option(..., "-o", "--out", help="Report directory to create."),
        force: bool = typer.Option(False, "--force", help="Replace OUT if it exists."),
    ) -> None:
        """Write a report (index.md) for a trace into OUT."""
        from replay.report import write_report

        write_report(trace, out, force=force)
        typer.echo(f"wrote {out}/index.md")
