"""Runs that can be recovered (issue 29 item 8): a sweep stopped by a full disk before its first
result is resumed by the same command; ``sweep --force`` stopped by a full disk leaves a complete
result complete; SIGKILL of ``sweep`` leaves no forkserver, resource tracker or worker behind (so
``sweep ... | tee`` returns); a signal before a command starts (Python importing) or after it ended
(its --csv written) ends with the tool's own message and 128 + N, not the default action.

A full disk is simulated at the write layer: ``fsync`` of the atomic writes raises ENOSPC (where a
full disk shows with delayed allocation), in this process, which is the one that writes a sweep's
results (the workers only compute)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import replay
from tests.helpers import assert_one_sentence_error, run_cli
from tests.hostile.run import session_pids
from tests.test_sweep import start_slow_sweep

ROOT = Path(__file__).resolve().parent.parent
SHAPE = {"layers": 2, "experts": 8, "top_k": 2, "embd": 8, "tokens": 24, "prompt_tokens": 4}
GRID = 'traces = ["t1"]\n[cache]\npolicies = ["lru", "lfu"]\nbudgets_mib = [1, 2]\n'


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("recover")
    replay.synth(root / "t1", seed=1, **SHAPE)
    (root / "grid.toml").write_text(GRID)
    return root


def _disk_full_after(monkeypatch, n_ok: int) -> None:
    """Every atomic write after the first ``n_ok`` fails with ENOSPC at its fsync."""
    import traces.io.atomic

    real, calls = os.fsync, [0]

    def fsync(fd):
        calls[0] += 1
        if calls[0] > n_ok:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(traces.io.atomic.os, "fsync", fsync)


def test_a_sweep_stopped_by_a_full_disk_before_its_first_result_is_resumed(world, tmp_path, monkeypatch):
    out = tmp_path / "R"
    with monkeypatch.context() as m:
        _disk_full_after(m, 0)
        res = run_cli("sweep", world / "grid.toml", "-o", out, "--workers", "1")
        assert res.code == 2, res
        assert_one_sentence_error(res, str(out / "sweep.json"), "no space left on device")
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # all it could write
    # space freed: the same command finishes the sweep (it was "holds no sweep results")
    res = run_cli("sweep", world / "grid.toml", "-o", out, "--workers", "1", "--json")
    assert res.code == 0, res.err
    assert res.json()["computed"] == 4
    assert json.loads((out / "sweep.json").read_text())["complete"] is True


def test_a_directory_holding_other_files_is_still_refused(world, tmp_path):
    out = tmp_path / "R"
    out.mkdir()
    (out / ".lock").touch()
    (out / "notes.txt").write_text("mine")
    assert_one_sentence_error(run_cli("sweep", world / "grid.toml", "-o", out), str(out), "holds no sweep results")


def test_force_stopped_by_a_full_disk_keeps_a_complete_result_complete(world, tmp_path, monkeypatch):
    out = tmp_path / "R"
    assert run_cli("sweep", world / "grid.toml", "-o", out, "--workers", "1").code == 0
    record = (out / "sweep.json").read_bytes()
    table = (out / "cache.parquet").read_bytes()
    assert json.loads(record)["complete"] is True
    with monkeypatch.context() as m:
        _disk_full_after(m, 1)  # the disk fills during the rerun: its first write succeeds, the rest fail
        res = run_cli("sweep", world / "grid.toml", "-o", out, "--workers", "1", "--force")
        assert res.code == 2, res
        assert "no space left on device" in res.err.lower()
    # the complete record and its table are as they were (it was flipped to "complete": false)
    assert (out / "sweep.json").read_bytes() == record
    assert (out / "cache.parquet").read_bytes() == table
    res = run_cli("sweep", world / "grid.toml", "-o", out, "--workers", "1", "--force", "--json")
    assert res.code == 0, res.err
    assert json.loads((out / "sweep.json").read_text())["complete"] is True
    assert (out / "cache.parquet").read_bytes() == table
    # another grid into the same results: the tables there are not this grid's, so it is unfinished
    (world / "grid2.toml").write_text(GRID.replace("[1, 2]", "[1, 3]"))
    with monkeypatch.context() as m:
        _disk_full_after(m, 1)
        assert run_cli("sweep", world / "grid2.toml", "-o", out, "--workers", "1").code == 2
    assert json.loads((out / "sweep.json").read_text())["complete"] is False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc (Linux)")
def test_sigkill_of_sweep_leaves_no_process_holding_its_stdout(world, tmp_path):
    # stdout a pipe, as under `sweep ... | tee`: it reaches end of file only when no process holds it
    _, _, proc = start_slow_sweep(tmp_path, f"{world}/t1", "[1, 2, 3, 4, 5, 6, 7, 8]", "1", 2,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while len(session_pids(proc.pid)) < 4 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # the driver, the resource tracker, the forkserver and a worker
        assert proc.poll() is None and len(session_pids(proc.pid)) >= 4, "the sweep did not start its workers"
        os.kill(proc.pid, signal.SIGKILL)  # the driver only, as `kill -9 PID` does
        proc.wait()
        eof = threading.Event()
        threading.Thread(target=lambda: (proc.stdout.read(), eof.set()), daemon=True).start()
        assert eof.wait(60), f"stdout still held after SIGKILL by {session_pids(proc.pid)}"
        deadline = time.monotonic() + 30
        while session_pids(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert session_pids(proc.pid) == []
    finally:
        for pid in session_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)


def _python(code: str, *, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_while_the_command_is_still_importing_ends_with_its_message(sig):
    """The handler is the first thing ``replay.cli`` installs in the moe-replay process: a signal
    right after it (the rest of the imports, typer's start) ends with the message, not the default
    action (SIGTERM, SIGHUP: killed silently; SIGINT: a KeyboardInterrupt traceback)."""
    r = _python("import os, signal, sys, time\n"
                "sys.argv = ['/usr/bin/moe-replay', 'import', 'vllm', 'x', 'y']\n"
                "import replay.cli\n"
                f"os.kill(os.getpid(), {int(sig)})\n"
                "time.sleep(30)\n")
    assert r.returncode == 128 + sig, r
    assert r.stderr.strip() == f"moe-replay: interrupted by {signal.Signals(sig).name}; nothing was written", r.stderr


def test_the_handler_is_not_installed_in_a_library_user(tmp_path):
    r = _python("import signal\nimport replay.cli\nprint(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)\n")
    assert r.returncode == 0 and r.stdout.strip() == "True", r


@pytest.mark.parametrize("when", ["after main", "at exit"])
def test_sigterm_right_after_the_csv_is_written_leaves_the_commands_status(world, tmp_path, when):
    """Once the command has its status (its --csv written), a signal is ignored and the process
    exits with that status: at exit Python put the default action back, which killed it (-15)."""
    csv = tmp_path / "x.csv"
    kill = "os.kill(os.getpid(), signal.SIGTERM)"
    r = _python("import atexit, os, signal, sys, time\n"
                f"sys.argv = ['/usr/bin/moe-replay', 'cache', {str(world / 't1')!r}, '--budgets', '1', '--csv', {str(csv)!r}]\n"
                "import replay.cli\n"
                + (f"atexit.register(lambda: {kill})\n" if when == "at exit" else "")
                + "replay.cli.main()\n"
                + (f"{kill}\ntime.sleep(0.2)\n" if when == "after main" else ""))
    assert r.returncode == 0, r
    assert "Traceback" not in r.stderr and csv.read_text().startswith("policy"), r


def test_a_sweep_stopped_by_a_full_disk_in_a_process_says_one_line(world, tmp_path):
    """A real process whose writes fail past 1 KiB (RLIMIT_FSIZE: EFBIG, Python ignores SIGXFSZ):
    the first chunk cannot be written. One line, exit 2; it was followed by the resource tracker's
    "leaked semaphore objects" warning (tqdm's lock in the terminated worker)."""
    import resource

    out = tmp_path / "R"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "replay.cli", "sweep", str(world / "grid.toml"), "-o", str(out), "--workers",
                        "1"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024)))
    time.sleep(1)  # the resource tracker writes its warning as it exits, after the sweep
    assert r.returncode == 2, r
    assert r.stderr.strip() == f"moe-replay: error: {out / 'chunks' / '000001.parquet'}: file too large.", r.stderr
