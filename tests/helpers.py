"""Helpers for tests: run the CLI in-process and capture what a user would see."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass

from replay.cli import main


@dataclass
class CliResult:
    code: int
    out: str
    err: str

    def json(self) -> dict:
        return json.loads(self.out)


def run_cli(*args: str) -> CliResult:
    """Run ``moe-replay ARGS`` in this process; return exit code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return CliResult(code, out.getvalue(), err.getvalue())


def assert_one_sentence_error(res: CliResult, *needles: str) -> None:
    """Bad input: non-zero exit, one line on stderr naming the problem, no traceback."""
    assert res.code != 0, f"expected failure, got exit 0 with {res.out!r}"
    lines = [ln for ln in res.err.splitlines() if ln.strip()]
    assert "Traceback" not in res.err, res.err
    assert len(lines) == 1, f"expected one line on stderr, got: {res.err!r}"
    assert lines[0].startswith("moe-replay: error: "), lines[0]
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"
