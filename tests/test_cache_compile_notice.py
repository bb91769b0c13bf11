"""First run: the CLI says, in one line on stderr, when it is compiling kernels (not when it loads
them), on a terminal or not: a first run under make, its output piped, compiles for minutes too."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
from pathlib import Path

import numba

from replay.core.progress import COMPILE_NOTICE, compile_notice

ROOT = Path(__file__).resolve().parent.parent


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_notice_only_when_compiling_terminal_or_not():
    tty = _Tty()
    with compile_notice(tty):
        f = numba.njit(lambda x: x + 1)  # a new function: a real compile
        f(1)
        g = numba.njit(lambda x: x + 2)
        g(1)
    assert tty.getvalue() == COMPILE_NOTICE + "\n"  # once, however many functions compile
    again = _Tty()
    with compile_notice(again):
        f(2)  # already compiled: nothing to say
    assert again.getvalue() == ""
    pipe = io.StringIO()  # not a terminal (make, a pipe, a file): the same one line
    with compile_notice(pipe):
        numba.njit(lambda x: x + 3)(1)
    assert pipe.getvalue() == COMPILE_NOTICE + "\n"
    after = _Tty()
    h = numba.njit(lambda x: x + 4)
    with compile_notice(after):
        pass
    h(1)  # outside the block: no listener left behind
    assert after.getvalue() == ""


def _cli_on_pty(args: list[str], env: dict) -> str:
    """Run the CLI with stderr (and stdout) on a pseudo-terminal; return what it printed."""
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "replay.cli", *args], cwd=ROOT, env=env, stdout=slave, stderr=slave)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    p.wait()
    os.close(master)
    assert p.returncode == 0, out
    return out.decode(errors="replace")


def test_cli_notice_with_a_fresh_kernel_cache(synth_trace_dir, tmp_path):
    """A fresh NUMBA_CACHE_DIR forces a compile: the notice shows on a terminal; the next run
    loads the kernels from that cache and prints none; piped, with a fresh cache, the notice is one
    line on stderr (none on stdout), --json too."""
    trace = synth_trace_dir(layers=2, experts=4, top_k=1, embd=8, tokens=6, prompt_tokens=2, routing_only=True,
                            expert_bytes=1 << 20)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), COLUMNS="200")
    args = ["cache", str(trace), "--policies", "lru", "--budgets", "2"]
    assert COMPILE_NOTICE in _cli_on_pty(args, env)
    assert COMPILE_NOTICE not in _cli_on_pty(args, env)
    env2 = dict(env, NUMBA_CACHE_DIR=str(tmp_path / "numba2"))
    p = subprocess.run([sys.executable, "-m", "replay.cli", *args, "--json"], cwd=ROOT, env=env2, capture_output=True,
                       text=True)
    assert p.returncode == 0 and COMPILE_NOTICE not in p.stdout
    assert [ln for ln in p.stderr.splitlines() if ln.strip()] == [COMPILE_NOTICE], p.stderr


def test_progress_is_tqdms_disabled_bar_off_a_terminal(monkeypatch):
    """Piped or redirected, a bar is tqdm's own disabled one: it takes every call the verbs make and prints nothing."""
    from replay.core.progress import progress

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with progress(10, "x", unit="row") as bar:
        bar.set_postfix_str("decode", refresh=False)
        bar.set_description("y")
        bar.update(3)
        bar.reset(total=5)
        assert bar.disable and bar.total == 5
    bar.close()
    assert sys.stderr.getvalue() == ""
    with progress(10, "x", enabled=False) as bar:
        assert bar.disable
