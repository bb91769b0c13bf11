"""Issue 29 items 1, 2 and 9: the one output guard (traces/io/atomic.py).

1. No output replaces, deletes or writes into anything the command reads: plugins, profile
   traces, sizes files, not only the trace (checksums of every input before and after).
2. No output replaces a special file (a FIFO, a symbolic link to a character device), and two
   writers to one single-file output do not both succeed.
9. Options that were silently accepted or ignored are refused in one sentence, exit 2.

Every fixture is built here, in tmp; the real /dev/null is only ever the target of a link, never
a destination (the refusal comes before any write)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from tests.helpers import assert_one_sentence_error, run_cli
from traces.format.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
SMALL = dict(layers=4, experts=16, top_k=4, embd=32, tokens=40, prompt_tokens=12)


def digest(*paths: Path) -> dict[str, str]:
    """sha256 of every file under each path (a file: of itself), and the kind of each entry, so a
    FIFO turned into a regular file or a deleted folder shows as a change."""
    out: dict[str, str] = {}
    for root in paths:
        entries = [root] + (sorted(root.rglob("*")) if root.is_dir() and not root.is_symlink() else [])
        for p in entries:
            st = os.lstat(p)
            kind = stat.S_IFMT(st.st_mode)
            key = str(p)
            if stat.S_ISREG(st.st_mode):
                out[key] = f"{kind}:{hashlib.sha256(p.read_bytes()).hexdigest()}"
            elif stat.S_ISLNK(st.st_mode):
                out[key] = f"{kind}:{os.readlink(p)}"
            else:
                out[key] = f"{kind}"
    return out


@pytest.fixture(autouse=True)
def fresh_registries():
    """Each test loads the example plugins from its own tmp copy: forget the previous test's."""
    from replay.policies import REG as POLICIES
    from replay.predictors import REG as PREDICTORS

    POLICIES.reset()
    PREDICTORS.reset()
    yield
    POLICIES.reset()
    PREDICTORS.reset()


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    from traces.synth.generator import SynthConfig, write_synthetic

    out = tmp_path_factory.mktemp("s") / "small"
    write_synthetic(out, SynthConfig(**SMALL))
    return out


@pytest.fixture
def trace(small, tmp_path) -> Path:
    t = tmp_path / "T"
    shutil.copytree(small, t)
    return t


# -- 1: inputs other than the trace ------------------------------------------------------------

@pytest.mark.parametrize("option,example", [("--policy-file", "fifo_policy.py"),
                                            ("--predictor-file", "two_tokens_ago_predictor.py")])
def test_report_force_never_deletes_a_plugin_in_its_destination(trace, tmp_path, option, example):
    d = tmp_path / "D"
    d.mkdir()
    plugin = shutil.copy(ROOT / "examples" / example, d / example)
    before = digest(d, trace)
    res = run_cli("report", trace, "-o", d, "--force", option, plugin)
    assert_one_sentence_error(res, str(d), str(plugin), "input")
    assert digest(d, trace) == before


@pytest.mark.parametrize("option,example", [("--policy-file", "fifo_policy.py"),
                                            ("--predictor-file", "two_tokens_ago_predictor.py")])
def test_cache_csv_never_overwrites_a_plugin(trace, tmp_path, option, example):
    plugin = Path(shutil.copy(ROOT / "examples" / example, tmp_path / example))
    extra = ["--retain"] if option == "--predictor-file" else []
    before = digest(plugin, trace)
    res = run_cli("cache", trace, "--budgets", "1", "--policies", "lru", option, plugin, *extra, "--csv", plugin)
    assert_one_sentence_error(res, str(plugin), "input")
    assert digest(plugin, trace) == before


def test_cache_csv_never_writes_into_the_pin_profile(small, trace, tmp_path):
    profile = tmp_path / "T2"
    shutil.copytree(small, profile)
    before = digest(profile, trace)
    res = run_cli("cache", trace, "--budgets", "1", "--policies", "pin", "--pin-profile", profile,
                  "--csv", profile / "trace.json")
    assert_one_sentence_error(res, str(profile / "trace.json"), str(profile), "input")
    assert digest(profile, trace) == before


def _moetrace_plain(path: Path, layers=2, experts=4, k=2, tokens=6) -> Path:
    """A plain llama.cpp moe-trace CSV ('layer,expert' per routed expert, one pass per token)."""
    lines = [f"{il},{(t + j + il) % experts}" for t in range(tokens) for il in range(layers) for j in range(k)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _hf_config(path: Path) -> Path:
    path.write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2,
                                "num_experts": 4, "moe_intermediate_size": 32, "num_experts_per_tok": 2}))
    return path


def test_import_force_never_deletes_the_sizes_it_reads(tmp_path):
    src = _moetrace_plain(tmp_path / "routes.csv")
    args = ("--top-k", "2", "--prompt-tokens", "2", "--dtype", "f16")
    ok = run_cli("import", "llamacpp-moetrace", src, tmp_path / "ok", "--sizes-from", _hf_config(tmp_path / "c.json"), *args)
    assert ok.code == 0, ok.err  # the import itself is good: only the destination is at fault below
    d = tmp_path / "D"
    d.mkdir()
    config = _hf_config(d / "config.json")
    before = digest(d, src)
    res = run_cli("import", "llamacpp-moetrace", src, d, "--sizes-from", config, "--force", *args)
    assert_one_sentence_error(res, str(d), str(config), "input")
    assert digest(d, src) == before
    # a directory --sizes-from names (its config.json is read) is protected too
    res = run_cli("import", "llamacpp-moetrace", src, d, "--sizes-from", d, "--force", *args)
    assert_one_sentence_error(res, str(d), "input")
    assert digest(d, src) == before


def test_sweep_results_never_hold_a_file_a_cell_reads(small, tmp_path):
    t = tmp_path / "T"
    shutil.copytree(small, t)
    out = tmp_path / "R"
    out.mkdir()
    (out / "sweep.json").write_text('{"format": "moe-replay-sweep", "version": 1, "complete": false}\n')
    plugin = shutil.copy(ROOT / "examples" / "fifo_policy.py", out / "fifo_policy.py")
    grid = tmp_path / "g.toml"
    grid.write_text(f'traces = ["{t}"]\n[cache]\npolicies = ["fifo"]\nbudgets_mib = [1]\npolicy_file = "{plugin}"\n')
    before = digest(out, t, grid)
    res = run_cli("sweep", grid, "-o", out, "--workers", "1")
    assert_one_sentence_error(res, str(out), str(plugin), "input")
    assert digest(out, t, grid) == before


def test_an_input_read_during_the_work_is_checked_again_at_the_rename(tmp_path):
    """An input noted by a reader after the first check (a profile opened mid-replay) still stops
    the rename: the guard runs again under the lock, with every input noted so far."""
    from traces.io import atomic

    d = tmp_path / "D"
    d.mkdir()
    (d / "kept").write_text("input")
    with atomic.command_scope():
        with pytest.raises(UserError, match="contains the input"):
            with atomic.staged_dir(d, force=True) as stage:
                (stage / "x").write_text("new")
                atomic.note_input(d / "kept")
        out = tmp_path / "f.csv"
        with pytest.raises(UserError, match="is the input"):
            with atomic.staged_file(out) as tmp:
                tmp.write_text("new")
                atomic.note_input(out)
    assert (d / "kept").read_text() == "input" and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["D"]  # no staging left


def test_library_calls_note_nothing(small, tmp_path):
    """Outside a command no reader notes anything: a notebook may rewrite a trace it opened."""
    from traces import open_trace
    from traces.io import atomic

    open_trace(small)
    assert atomic._noted is None


# -- 2: special files and concurrent single-file writers ----------------------------------------

@pytest.fixture
def specials(tmp_path) -> dict[str, Path]:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link_fifo = tmp_path / "link-to-fifo"
    link_fifo.symlink_to(fifo)
    link_null = tmp_path / "link-to-null"
    link_null.symlink_to("/dev/null")  # only the link is ever a destination; /dev/null is never opened
    return {"fifo": fifo, "link-to-fifo": link_fifo, "link-to-null": link_null}


WRITERS = {
    "csv": lambda t, out: ("cache", t, "--budgets", "1", "--policies", "lru", "--csv", out),
    "libcachesim": lambda t, out: ("export", "libcachesim", t, out),
    "bigmoe": lambda t, out: ("export", "bigmoe", t, out),
    "report": lambda t, out: ("report", t, "-o", out, "--force"),
    "synth": lambda t, out: ("synth", out, "--layers", "2", "--experts", "4", "--top-k", "2", "--tokens", "4", "--force"),
    "import": lambda t, out: ("import", "llamacpp-moetrace", _moetrace_plain(out.parent / "routes.csv"), out, "--top-k",
                              "2", "--prompt-tokens", "2", "--expert-bytes", "1000", "--force"),
}


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("which", ["fifo", "link-to-fifo", "link-to-null"])
def test_no_special_file_is_replaced(small, tmp_path, specials, writer, which):
    dest = specials[which]
    before = digest(*specials.values(), small)
    res = run_cli(*WRITERS[writer](small, dest))
    assert res.code == 2, (res.out, res.err)
    assert_one_sentence_error(res, str(dest))
    assert digest(*specials.values(), small) == before
    assert stat.S_ISFIFO(os.lstat(specials["fifo"]).st_mode)
    assert os.readlink(specials["link-to-null"]) == "/dev/null"


def test_make_model_force_never_replaces_a_fifo(specials):
    pytest.importorskip("gguf")
    for dest in specials.values():
        before = digest(*specials.values())
        assert_one_sentence_error(run_cli("make-model", dest, "--force"), str(dest), "not a regular file")
        assert digest(*specials.values()) == before


def test_a_csv_another_writer_wrote_meanwhile_is_not_replaced(small, tmp_path, monkeypatch):
    """Two --csv writers to one file: the second to finish refuses instead of silently winning."""
    from replay import api

    out = tmp_path / "rows.csv"
    real = api.cache_run

    def other_writer_commits_first(*a, **k):
        out.write_text("first\n")
        return real(*a, **k)

    monkeypatch.setattr(api, "cache_run", other_writer_commits_first)
    res = run_cli("cache", small, "--budgets", "1", "--policies", "lru", "--csv", out)
    assert_one_sentence_error(res, str(out), "another writer")
    assert out.read_text() == "first\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.csv"]


def test_an_export_another_writer_changed_meanwhile_is_not_replaced(small, tmp_path, monkeypatch):
    from traces.io import exports

    out = tmp_path / "t.oracleGeneral"
    out.write_bytes(b"old")
    real = exports.oracle_general_records

    def other_writer_commits_first(trace):
        tmp = tmp_path / "other"
        tmp.write_bytes(b"theirs")
        os.replace(tmp, out)
        return real(trace)

    monkeypatch.setattr(exports, "oracle_general_records", other_writer_commits_first)
    res = run_cli("export", "libcachesim", small, out)
    assert_one_sentence_error(res, str(out), "another writer")
    assert out.read_bytes() == b"theirs"
    monkeypatch.undo()
    assert run_cli("export", "libcachesim", small, out).code == 0  # alone, it replaces the old file
    assert out.stat().st_size > 0 and out.stat().st_size % 24 == 0


# -- 9: options accepted or ignored in silence ----------------------------------------------------

def test_a_budget_below_one_byte_is_refused_like_zero(small):
    assert_one_sentence_error(run_cli("cache", small, "--budgets", "0", "--policies", "lru"), "--budgets", "positive")
    for b in ("1e-300", "5e-7", "0.0001KiB"):
        assert_one_sentence_error(run_cli("cache", small, "--budgets", b, "--policies", "lru"), "--budgets",
                                  "less than one byte")
    assert run_cli("cache", small, "--budgets", "1e-6", "--policies", "lru").code == 0  # 1 byte is a budget


def test_json_with_another_format_is_refused(small):
    assert_one_sentence_error(run_cli("cache", small, "--budgets", "1", "--json", "--format", "compact"),
                              "--json", "--format compact")
    assert run_cli("cache", small, "--budgets", "1", "--json", "--format", "json").code == 0


def test_predictor_without_retain_is_refused(small):
    assert_one_sentence_error(run_cli("cache", small, "--budgets", "1", "--predictor", "static-hot"),
                              "--predictor", "--retain")
    assert run_cli("cache", small, "--budgets", "1", "--retain", "--predictor", "static-hot").code == 0


def test_absurd_worker_count_is_refused(small, tmp_path):
    grid = tmp_path / "g.toml"
    grid.write_text(f'traces = ["{small}"]\n[cache]\npolicies = ["lru"]\nbudgets_mib = [1]\n')
    res = run_cli("sweep", grid, "-o", tmp_path / "R", "--workers", "100000")
    assert_one_sentence_error(res, "--workers 100000", "core")
    assert not (tmp_path / "R").exists()


def test_drop_thresholds_are_checked_alike_by_drop_and_prefetch(small):
    """One rule for F (weight < F/k) in both verbs: any finite F >= 0 (the report itself runs 1.5)."""
    for f in ("-1", "nan", "inf"):
        assert_one_sentence_error(run_cli("drop", small, "--mode", "closed", "--budget-mib", "1", "--fracs", f), "--fracs")
        assert_one_sentence_error(run_cli("prefetch", small, "--budget-mib", "1", "--drop", f), "--drop")
    assert run_cli("drop", small, "--mode", "closed", "--budget-mib", "1", "--fracs", "2").code == 0
    assert run_cli("prefetch", small, "--budget-mib", "1", "--drop", "2").code == 0


def test_export_of_a_trace_without_routings_is_refused(small, tmp_path):
    """An interrupted capture that wrote trace.json but no routing part: no 0-byte export."""
    empty = tmp_path / "empty"
    shutil.copytree(small, empty)
    for f in (empty / "routings").iterdir():
        f.unlink()
    meta = json.loads((empty / "trace.json").read_text())
    meta["complete"], meta["rows"] = False, 0
    (empty / "trace.json").write_text(json.dumps(meta))
    for kind in ("libcachesim", "bigmoe"):
        out = tmp_path / f"out.{kind}"
        res = run_cli("export", kind, empty, out)
        assert_one_sentence_error(res, str(empty), "no routings")
        assert not out.exists()


def test_an_interrupt_swallowed_by_a_ctypes_callback_still_ends_the_command(capsys):
    # Numba compiles through llvmlite, whose object-cache hook is a ctypes callback: a SIGINT whose
    # handler ran inside it had its Interrupted printed as a traceback and ignored by ctypes, and the
    # command went on (exit 0) or failed on a half-built kernel (exit 3). Found by the hostile run.
    import ctypes
    import signal

    from replay.runner import guarded

    ran_on = []

    def command() -> int:
        cb = ctypes.CFUNCTYPE(None)(lambda: signal.raise_signal(signal.SIGINT))
        cb()  # the handler runs inside the callback; ctypes swallows what it raises
        ran_on.append(True)  # the command goes on, as it did under Numba
        return 0

    assert guarded(command, debug=False) == 130
    assert ran_on  # the exception really was swallowed (else this would not have run)
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err
    assert err.strip() == "moe-replay: interrupted by SIGINT; nothing was written"


def test_a_failure_after_a_swallowed_interrupt_is_the_interrupt_not_a_bug(capsys):
    import ctypes
    import signal

    from replay.runner import guarded

    def command() -> int:
        ctypes.CFUNCTYPE(None)(lambda: signal.raise_signal(signal.SIGTERM))()
        raise RuntimeError("no compiled object yet")  # what llvmlite raised next, half built

    assert guarded(command, debug=False) == 143
    err = capsys.readouterr().err
    assert "internal error" not in err and "Traceback" not in err and "SIGTERM" in err


def test_a_refusal_after_a_swallowed_interrupt_is_the_interrupt_too(capsys):
    import ctypes
    import signal

    from replay.runner import guarded

    def command() -> int:
        ctypes.CFUNCTYPE(None)(lambda: signal.raise_signal(signal.SIGINT))()
        raise UserError("a sentence the half-run command would not have said")

    assert guarded(command, debug=False) == 130
    err = capsys.readouterr().err
    assert "error:" not in err and "interrupted by SIGINT" in err
