"""The trace report: Markdown (and later HTML, plots, CSV tables) written atomically."""

from __future__ import annotations

from pathlib import Path

from replay.info import info_rows, info_text
from traces import open_trace
from traces.atomic import staged_dir


def write_report(trace_dir: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    trace = open_trace(trace_dir)
    row = info_rows(trace)[0]
    lines = [
        f"# moe-replay report: {row['model']}",
        "",
        "## Trace summary",
        "",
        "```",
        info_text(trace, row).replace(str(trace.path), Path(trace_dir).name),
        "```",
        "",
    ]
    with staged_dir(out_dir, force=force) as stage:
        (stage / "index.md").write_text("\n".join(lines), encoding="utf-8")
    return Path(out_dir)
