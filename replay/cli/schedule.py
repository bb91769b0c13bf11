"""``schedule``: re-batch a trace with a request column by a stated schedule (traces/synth/schedule.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from replay.cli.options import JsonOpt, example


def schedule(
    trace: Path = typer.Argument(..., help="A trace with a request column."),
    out_dir: Path = typer.Argument(..., help="Trace directory to create."),
    mode: str = typer.Option(..., "--schedule", help="sequential | continuous (the rule: README, 'Many requests in one batch')."),
    max_batch: int = typer.Option(1, "--max-batch", help="continuous: requests decoding together."),
    prefill_chunk: int | None = typer.Option(None, "--prefill-chunk", help="continuous: prompt tokens per prefill batch "
                                             "(default: unbounded)."),
    force: bool = typer.Option(False, "--force", help="Replace OUT_DIR if it exists."),
    json_out: bool = JsonOpt,
) -> None:
    """Re-batch the requests of TRACE by a schedule into OUT_DIR: the same routings, new batches
    (how does the expert cache behave at batch 1, 8, 64? -- one command per batch size)."""
    from replay.analyses.info import info_rows
    from replay.cli import _echo
    from replay.present.format import json_object
    from traces import open_trace
    from traces.format.errors import UserError
    from traces.synth.schedule import MODES, rebatch_trace

    if mode not in MODES:
        raise UserError(f"--schedule {mode!r} is not one of {', '.join(MODES)}.")
    try:
        res = rebatch_trace(trace, out_dir, mode=mode, max_batch=max_batch, prefill_chunk=prefill_chunk,  # type: ignore[arg-type]
                            force=force)
    except UserError as e:  # the library names its keywords; here they are flags
        raise UserError(str(e).replace("max_batch", "--max-batch").replace("prefill_chunk", "--prefill-chunk")) from None
    row = info_rows(open_trace(out_dir, check_rows=False))[0]
    if json_out:
        _echo(json_object("schedule", str(out_dir), [{**row, "dropped_columns": res["dropped_columns"]}]))
        return
    b = f"--max-batch {max_batch}" if mode == "continuous" else "one request at a time"
    _echo(f"wrote {out_dir}: {res['requests']} requests re-batched ({mode}, {b}) into {res['batches']} batches; "
          f"decode batches of {row['decode_batch_tokens_min']}..{row['decode_batch_tokens_max']} tokens"
          + (f"; left out (they describe the original run): {', '.join(res['dropped_columns'])}" if res["dropped_columns"] else ""))


def register(app: typer.Typer) -> None:
    app.command("schedule", epilog=example("moe-replay schedule traces/reqs traces/reqs-cb --schedule continuous --max-batch 4"))(schedule)
