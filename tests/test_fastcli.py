"""The console script's fast path (replay/fastcli.py): a plain ``cache --json`` runs without typer,
Polars or Numba and prints what the typer path prints, byte for byte, refusals included; every
other command line goes to typer unchanged."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from replay import aot, fastcli
from tests.helpers import CliResult, modules_after, run_cli

ROOT = Path(__file__).resolve().parent.parent


def run_fast(*args: str) -> CliResult:
    """``moe-replay ARGS`` through the console script's main() in this process."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            fastcli.main([str(a) for a in args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return CliResult(code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def tiny(synth_trace_dir):
    return synth_trace_dir(layers=4, experts=16, top_k=2, tokens=40, prompt_tokens=8, seed=5, routing_only=True)


@pytest.fixture(scope="module")
def prefill_only(synth_trace_dir):
    return synth_trace_dir(layers=3, experts=8, top_k=2, tokens=0, prompt_tokens=6, seed=2, routing_only=True)


def test_parse_takes_only_what_it_understands(tiny):
    t = str(tiny)
    assert fastcli.parse(["cache", t, "--json"]) is not None
    assert fastcli.parse(["cache", t, "--format", "json", "--budgets", "1,2", "--policies", "lru"]) is not None
    assert fastcli.parse(["cache", t, "--json", "--per-layer", "--stream", "on", "--seed", "3", "--phase", "all"])["seed"] == 3
    for args in (["cache", t],  # text tables: typer
                 ["cache", t, "--format", "compact"], ["cache", t, "--format", "table", "--json"],
                 ["cache", t, "--json", "--json"],  # repeated
                 ["cache", t, "--json", "--budgets=1"],  # --opt=value
                 ["cache", t, "--json", "--help"], ["cache", "--json"], ["cache", t, t, "--json"],
                 ["cache", t, "--json", "--csv", "x.csv"], ["cache", t, "--json", "--validate"],
                 ["cache", t, "--json", "--flash-mib-s", "100", "--compute-ms", "5"],
                 ["cache", t, "--json", "--seed", "x"], ["cache", t, "--json", "--seed", "-1"],
                 ["cache", t, "--json", "--budgets"], ["info", t, "--json"], []):
        assert fastcli.parse(args) is None, args


def test_default_policies_are_typers():
    import typer

    from replay.cli import _register_modules, app

    _register_modules()
    cmd = typer.main.get_command(app).commands["cache"]
    assert next(p for p in cmd.params if p.name == "policies").default == fastcli.DEFAULT_POLICIES


ARGS = [
    ("--json",),
    ("--json", "--budgets", "1,2.5,0.3", "--policies", "lru,layer,lfu,belady,infinite"),
    ("--json", "--budget-mib", "2", "--policies", "lru", "--stream", "on"),
    ("--json", "--budget-mib", "2", "--policies", "lru", "--stream", "off"),
    ("--format", "json", "--budgets", "0.2,4", "--policies", "lru,layer", "--per-layer", "--phase", "all"),
    ("--json", "--budgets", "1", "--policies", "random", "--seed", "7"),
    ("--json", "--policies", "lru,pin"),  # pin replays in memory only: auto picks off
]


@pytest.mark.parametrize("args", ARGS, ids=[" ".join(a) for a in ARGS])
def test_fast_path_prints_what_typer_prints(tiny, args):
    assert fastcli.parse(["cache", str(tiny), *args]) is not None
    fast, slow = run_fast("cache", tiny, *args), run_cli("cache", tiny, *args)
    assert (fast.code, fast.err) == (slow.code, slow.err) == (0, "")
    assert fast.out == slow.out
    assert json.loads(fast.out)["rows"]


def test_prefill_only_note(prefill_only):
    args = ("cache", prefill_only, "--json", "--budgets", "0.5")
    fast, slow = run_fast(*args), run_cli(*args)
    assert fast.out == slow.out and json.loads(fast.out)["note"].startswith("the trace has no decoded tokens")


BAD = [
    ("--json", "--phase", "later"),
    ("--json", "--policies", "lru,nope"),
    ("--json", "--budgets", "1,x"),
    ("--json", "--budgets", "0"),
    ("--json", "--budget-mib", "lots"),
    ("--json", "--budgets", "1", "--budget-mib", "2"),
    ("--json", "--stream", "sometimes"),
    ("--json", "--policies", "pin", "--stream", "on"),
    ("--json", "--seed", str(1 << 63)),
]


@pytest.mark.parametrize("args", BAD, ids=[" ".join(a) for a in BAD])
def test_refusals_read_the_same(tiny, args):
    fast, slow = run_fast("cache", tiny, *args), run_cli("cache", tiny, *args)
    assert fast.code == slow.code == 2
    assert fast.err == slow.err and fast.err.startswith("moe-replay: error: ") and fast.err.count("\n") == 1
    assert fast.out == slow.out == ""


def test_missing_and_broken_traces(tmp_path):
    fast, slow = run_fast("cache", tmp_path / "nope", "--json"), run_cli("cache", tmp_path / "nope", "--json")
    assert (fast.code, fast.err) == (slow.code, slow.err) and fast.code == 2 and "nope" in fast.err
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "trace.json").write_text("{not json")
    fast, slow = run_fast("cache", tmp_path / "t", "--json"), run_cli("cache", tmp_path / "t", "--json")
    assert (fast.code, fast.err) == (slow.code, slow.err) and fast.code == 2 and "trace.json" in fast.err


def test_other_commands_go_to_typer(tiny):
    fast, slow = run_fast("info", tiny, "--json"), run_cli("info", tiny, "--json")
    assert fast == slow and fast.code == 0
    fast = run_fast("cache", tiny, "--json", "--budgets=1", "--policies", "lru")
    assert fast.code == 0 and json.loads(fast.out)["rows"][0]["budget_mib"] == 1.0
    assert run_fast("cache", "--help").out == run_cli("cache", "--help").out


@pytest.mark.parametrize("stream", ["off", "on"])
def test_fast_path_imports_neither_typer_nor_polars(tiny, stream):
    args = ["cache", str(tiny), "--budgets", "1", "--policies", "lru", "--json", "--stream", stream]
    out, mods = modules_after("replay.fastcli", *args)
    assert "typer" not in mods and "click" not in mods
    assert "polars" not in mods
    assert out == run_cli(*args).out
    if aot.load() is not None:
        assert "numba" not in mods and "llvmlite" not in mods  # the compiled extension ran every kernel
    else:
        assert "numba" in mods  # without the extension the kernels are Numba's (nothing else changes)


def test_fast_path_can_be_turned_off(tiny, monkeypatch):
    monkeypatch.setenv("MOE_REPLAY_FAST", "0")
    assert fastcli.run(["cache", str(tiny), "--json"], False) is None
