"""Writes that never lie: interrupts, stale staging, inputs under --force, two writers, OS errors.

Each test pins one line of README "Guarantees". Signals go to a real subprocess, sent once its
staging directory exists (a bounded poll, never a fixed sleep).
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import assert_one_sentence_error, run_cli
from traces.format.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
SMALL = dict(layers=4, experts=16, top_k=4, embd=32, tokens=40, prompt_tokens=12)
#: A synth run long enough (tens of seconds) to be interrupted mid-write.
LONG_SYNTH = ["--layers", "16", "--experts", "64", "--tokens", "200000", "--prompt-tokens", "8"]


def tree_digest(path: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``path`` (or of ``path`` itself)."""
    if path.is_file():
        return {".": hashlib.sha256(path.read_bytes()).hexdigest()}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()}


def leftovers(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}."))


def spawn(*args: object) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "replay.cli", *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_staging(proc: subprocess.Popen, dest: Path, timeout: float = 120) -> Path:
    """Poll until ``.DEST.partial-PID`` of ``proc`` exists; fail if the process ends first."""
    stage = dest.parent / f".{dest.name}.partial-{proc.pid}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stage.is_dir():
            return stage
        if proc.poll() is not None:
            pytest.fail(f"the command ended (exit {proc.returncode}) before staging: {proc.communicate()}")
        time.sleep(0.01)
    proc.kill()
    pytest.fail(f"no staging directory {stage} within {timeout} s")


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, err


def last_line(err: str) -> str:
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    """A synthetic trace big enough that a report takes seconds (so a signal lands mid-write)."""
    from traces.synth.generator import SynthConfig, write_synthetic

    out = tmp_path_factory.mktemp("t") / "trace"
    write_synthetic(out, SynthConfig(layers=16, experts=64, top_k=8, embd=64, tokens=3000, prompt_tokens=32))
    return out


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    from traces.synth.generator import SynthConfig, write_synthetic

    out = tmp_path_factory.mktemp("s") / "small"
    write_synthetic(out, SynthConfig(**SMALL))
    return out


# -- 1, 2: interrupts exit 128+N, say nothing was written, and leave nothing behind ---------------

@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("verb", ["synth", "report", "synth --debug"])
def test_interrupt_exits_128_plus_signal_and_leaves_nothing(trace, tmp_path, verb, sig):
    out = tmp_path / "out"
    args = [*LONG_SYNTH, out] if verb.startswith("synth") else [trace, "-o", out]
    proc = spawn(verb.split()[0], *args, *verb.split()[1:])
    wait_for_staging(proc, out)
    proc.send_signal(sig)
    code, stdout, err = finish(proc)
    assert code == 128 + int(sig), err
    assert "wrote" not in stdout
    assert last_line(err) == f"moe-replay: interrupted by {sig.name}; nothing was written to {out}", err
    assert not out.exists()
    assert leftovers(out) == [], "the staging directory was left behind"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_force_keeps_the_old_report_and_does_not_claim_success(trace, tmp_path, sig):
    out = tmp_path / "r"
    out.mkdir()
    (out / "index.md").write_text("the old report\n")
    before = tree_digest(out)
    proc = spawn("report", trace, "-o", out, "--force")
    wait_for_staging(proc, out)
    proc.send_signal(sig)
    code, stdout, err = finish(proc)
    assert code == 128 + int(sig), err
    assert "nothing was written" in last_line(err)
    assert tree_digest(out) == before
    assert leftovers(out) == []


def test_a_keyboard_interrupt_typer_turns_into_a_returned_exit_code_is_honoured(monkeypatch, tmp_path):
    """Under standalone_mode=False typer *returns* Exit(130) for a KeyboardInterrupt; main must exit 130."""
    import traces.synth.generator

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(traces.synth.generator, "write_synthetic", boom)
    res = run_cli("synth", tmp_path / "x", "--tokens", "4")
    assert res.code == 130, res
    assert "interrupted" in last_line(res.err) and "nothing was written" in last_line(res.err)


def test_stale_staging_of_a_dead_process_is_swept_and_a_live_ones_kept(small, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # that process has exited (a reused PID would only keep its dir)
    out = tmp_path / "out"
    for kind in ("partial", "old"):
        stale = tmp_path / f".out.{kind}-{dead_pid}"
        stale.mkdir()
        (stale / "big.bin").write_bytes(b"x" * 1000)
    live = tmp_path / f".out.partial-{os.getppid()}"  # the process that started pytest: alive
    live.mkdir()
    other = tmp_path / f".other.partial-{dead_pid}"  # another destination's: not ours to judge
    other.mkdir()
    res = run_cli("report", small, "-o", out)
    assert res.code == 0, res.err
    assert leftovers(out) == [live.name]
    assert other.is_dir()


# -- 3: --force never touches an input -------------------------------------------------------

def _route_csv(path: Path) -> Path:
    lines = ["# route_trace v1", "# model=/x/m.gguf arch=qwen3moe n_layer=2 n_expert=4 n_expert_used=2",
             "# layer=0 expert_bytes=1000 dense_bytes=10", "# layer=1 expert_bytes=2000 dense_bytes=10",
             "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes"]
    for phase, step in [(0, 0), (0, 1), (1, 2), (1, 3)]:
        for layer in range(2):
            for slot, (e, w) in enumerate([(step % 4, 0.6), ((step + 1) % 4, 0.4)]):
                lines.append(f"0,{phase},{step},{layer},{slot},{e},{w},0,{1000 * (layer + 1)}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("dest", ["T", "T/routings", "T/new", "parent", "link-to-T", "dotted"])
def test_report_force_refuses_a_destination_that_is_holds_or_lies_in_the_trace(small, tmp_path, dest):
    import shutil

    t = tmp_path / "p" / "T"
    shutil.copytree(small, t)
    before = tree_digest(t.parent)
    d = {"T": t, "T/routings": t / "routings", "T/new": t / "new", "parent": t.parent,
         "link-to-T": tmp_path / "link", "dotted": t / "routings" / ".."}[dest]
    if dest == "link-to-T":
        d.symlink_to(t)
    res = run_cli("report", t, "-o", d, "--force")
    assert_one_sentence_error(res, str(d), str(t), "input")
    assert tree_digest(t.parent) == before


def test_report_refuses_replacing_its_cost_model(small, tmp_path):
    model = tmp_path / "m" / "cost.json"
    model.parent.mkdir()
    model.write_text('{"intercept_ms": 10, "ms_per_mib": 0.5}')
    res = run_cli("report", small, "-o", model.parent, "--force", "--cost-model", model)
    assert_one_sentence_error(res, str(model.parent), str(model), "input")
    assert model.is_file()


def test_import_force_refuses_the_folder_holding_its_source(tmp_path):
    d = tmp_path / "D"
    d.mkdir()
    src = _route_csv(d / "x.route.csv")
    before = tree_digest(d)
    res = run_cli("import", "bigmoe", src, d, "--force")
    assert_one_sentence_error(res, str(d), str(src), "input")
    assert tree_digest(d) == before


def test_cache_csv_refuses_a_file_of_the_trace(small, tmp_path):
    import shutil

    t = tmp_path / "T"
    shutil.copytree(small, t)
    before = tree_digest(t)
    res = run_cli("cache", t, "--budgets", "1", "--policies", "lru", "--csv", t / "trace.json")
    assert_one_sentence_error(res, str(t / "trace.json"), "input")
    assert tree_digest(t) == before


# -- 4: two writers to one destination ---------------------------------------------------------

def test_a_destination_that_appears_during_the_work_is_not_replaced(tmp_path):
    """The existence check is repeated at the rename: the second writer refuses, the first's work stays."""
    from traces.io.atomic import staged_dir

    out = tmp_path / "out"
    with pytest.raises(UserError, match="another writer created it"):
        with staged_dir(out) as stage:
            (stage / "mine").write_text("second")
            out.mkdir()
            (out / "theirs").write_text("first")  # the other writer committed meanwhile
    assert tree_digest(out) == {"theirs": hashlib.sha256(b"first").hexdigest()}
    assert leftovers(out) == []
    with staged_dir(out, force=True) as stage:  # --force: replaced, in one swap
        (stage / "mine").write_text("second")
    assert tree_digest(out) == {"mine": hashlib.sha256(b"second").hexdigest()}
    assert leftovers(out) == []


@pytest.mark.parametrize("force", [False, True])
def test_two_reports_into_one_new_directory(trace, tmp_path, force):
    out = tmp_path / "r"
    extra = ["--force"] if force else []
    first = spawn("report", trace, "-o", out, *extra)
    wait_for_staging(first, out)  # the first passed its check; start the second while it works
    second = spawn("report", trace, "-o", out, *extra)
    wait_for_staging(second, out)
    assert first.poll() is None, "the first report finished before the second started; make the trace bigger"
    # 600 s: a hang guard, not a speed check (on a fresh clone both compile every policy kernel at once)
    results = [finish(first, 600), finish(second, 600)]
    codes = sorted(r[0] for r in results)
    if force:
        assert codes == [0, 0], results
    else:
        assert codes == [0, 2], results
        loser = next(r for r in results if r[0] == 2)
        assert last_line(loser[2]).startswith(f"moe-replay: error: {out}: another writer created it"), loser
        assert "wrote" not in loser[1]
    assert (out / "index.md").is_file() and (out / "index.html").is_file()
    assert leftovers(out) == []


# -- 9: OS errors are one sentence, exit 2; bugs still say so -----------------------------------

def test_csv_into_a_missing_folder_or_onto_a_directory(small, tmp_path):
    missing = tmp_path / "nope" / "x.csv"
    assert_one_sentence_error(run_cli("cache", small, "--budgets", "1", "--csv", missing), str(missing), "does not exist")
    res = run_cli("cache", small, "--budgets", "1", "--csv", tmp_path)
    assert res.code == 2
    assert_one_sentence_error(res, str(tmp_path), "directory")


def test_metrics_that_is_a_directory(tmp_path):
    src = _route_csv(tmp_path / "x.route.csv")
    res = run_cli("import", "bigmoe", src, tmp_path / "out", "--metrics", tmp_path)
    assert res.code == 2, res
    assert_one_sentence_error(res, str(tmp_path))
    assert not (tmp_path / "out").exists()


def test_a_full_disk_is_named_not_called_a_bug(monkeypatch, tmp_path):
    """ENOSPC while writing (simulated at fsync, where a full disk shows with delayed allocation)."""
    import traces.io.atomic

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(traces.io.atomic.os, "fsync", full)
    out = tmp_path / "out"
    res = run_cli("synth", out, "--tokens", "4", "--layers", "2", "--experts", "8", "--top-k", "2", "--embd", "8")
    assert res.code == 2, res
    assert_one_sentence_error(res, str(out), "No space left on device", "nothing was written")
    assert not out.exists() and leftovers(out) == []


def test_a_genuine_bug_still_says_so(monkeypatch, small):
    import replay.analyses.info

    def broken(*a, **k):
        raise OSError(errno.EBADF, "Bad file descriptor")  # no path, not the machine's fault: ours

    monkeypatch.setattr(replay.analyses.info, "info_rows", broken)
    res = run_cli("info", small)
    assert res.code == 3 and "this is a bug" in res.err, res


def _mount_tmpfs(where: Path, opts: str) -> None:
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()})")


@pytest.fixture
def mounts(tmp_path):
    made: list[Path] = []

    def mount(name: str, opts: str) -> Path:
        d = tmp_path / name
        _mount_tmpfs(d, opts)
        made.append(d)
        return d

    yield mount
    for d in reversed(made):
        subprocess.run(["umount", str(d)], capture_output=True)


def test_a_real_full_disk(mounts):
    disk = mounts("full", "size=64k")
    out = disk / "out"
    res = run_cli("synth", out, "--tokens", "2000", "--layers", "4", "--experts", "16", "--top-k", "4", "--embd", "32")
    assert_one_sentence_error(res, str(out), "No space left on device")
    assert res.code == 2
    assert list(disk.iterdir()) == []


def test_a_read_only_mount(small, mounts):
    ro = mounts("ro", "size=64k,ro")
    for args in (["cache", small, "--budgets", "1", "--csv", ro / "x.csv"], ["report", small, "-o", ro / "r"],
                 ["synth", ro / "t", "--tokens", "4"]):
        res = run_cli(*args)
        assert res.code == 2, (args, res)
        assert_one_sentence_error(res, str(args[-1] if args[0] == "cache" else (ro / ("r" if args[0] == "report" else "t"))),
                                  "Read-only file system")


def test_an_interrupt_as_the_staging_directory_is_made_leaves_nothing(tmp_path, monkeypatch):
    # the signal handler runs when os.mkdir returns, before staged_dir's next line: the directory
    # exists, so it must be removed and the output counted as abandoned (the CLI then names it)
    from traces.io import atomic

    made = []
    real_mkdir = Path.mkdir

    def mkdir_then_interrupt(self, *a, **kw):
        real_mkdir(self, *a, **kw)
        made.append(self)
        raise KeyboardInterrupt

    out = tmp_path / "out"
    atomic.abandoned.clear()
    monkeypatch.setattr(Path, "mkdir", mkdir_then_interrupt)
    with pytest.raises(KeyboardInterrupt), atomic.staged_dir(out):
        pass
    monkeypatch.undo()
    assert made and not made[0].exists() and sorted(tmp_path.iterdir()) == []
    assert atomic.abandoned == [out]


def test_an_interrupt_before_the_block_starts_names_the_output_and_leaves_nothing(tmp_path):
    # the handler can also run after staged_dir yielded but before the caller's block starts (in the
    # context manager's __enter__): the block never runs, only the generator's finalisation removes
    # the stage, and the CLI's message (printed first) must already count the output as abandoned
    from traces.io import atomic

    out = tmp_path / "out"
    atomic.abandoned.clear()
    atomic.written.clear()
    cm = atomic.staged_dir(out)
    stage = cm.__enter__()  # what a `with` does before the interrupt lands
    assert stage.is_dir() and atomic.abandoned == [out] and atomic.written == []
    del cm  # the interrupt unwinds the frame: the generator is finalised
    assert sorted(tmp_path.iterdir()) == [] and atomic.abandoned == [out]
