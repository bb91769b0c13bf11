"""The CLI as one tool (issue 20 item 4): --version, shell completion, one example per verb, TRACE on
the usage line, a --help that does not wait for Numba or Polars, budgets with units everywhere
through one parser, a compact one-line output; and one signal installer (issue 15 item 2)."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import typer

from tests.helpers import assert_one_sentence_error, run_cli
from traces.format.errors import UserError
from traces.format.version import __version__
from traces.util.units import parse_budget_mib, parse_budgets_mib

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _py(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, check=True, cwd=ROOT).stdout


# -- a --help that answers at once --------------------------------------------------------------

def test_help_imports_no_numba_or_polars():
    # not a timed test: what makes --help slow is importing the kernels' and frames' libraries before
    # parsing; every verb registered (built-ins and plugins, as main() does), none of them imported
    got = _py("import sys, replay.cli as c\nc._register_modules()\nc._register_plugins()\n"
              "print(sorted(m for m in ('numba', 'polars', 'pyarrow', 'numpy', 'matplotlib', 'tqdm', 'replay.api') "
              "if m in sys.modules))")
    assert got.strip() == "[]"


def test_import_replay_is_lazy_but_complete():
    got = _py("import sys, replay\nprint('polars' in sys.modules)\nprint(callable(replay.cache), 'replay.api' in sys.modules)\n"
              "import replay.core.simulate\nprint(callable(replay.cache), sorted(set(replay.__all__) - set(dir(replay))))")
    assert got.split("\n")[:3] == ["False", "True True", "True []"]


# -- --version, completion, examples, usage line ------------------------------------------------

def test_version():
    res = run_cli("--version")
    assert res.code == 0 and res.out.strip() == f"moe-replay {__version__}"


def test_shell_completion():
    env = {**ENV, "_MOE_REPLAY_COMPLETE": "complete_bash", "COMP_WORDS": "moe-replay ca", "COMP_CWORD": "1"}
    out = subprocess.run([sys.executable, "-m", "replay.cli"], capture_output=True, text=True, env=env, cwd=ROOT).stdout
    assert out.split() == ["cache", "capture", "capture-hf"]
    env.update(COMP_WORDS="moe-replay cache t --budg", COMP_CWORD="3")
    out = subprocess.run([sys.executable, "-m", "replay.cli"], capture_output=True, text=True, env=env, cwd=ROOT).stdout
    assert out.split() == ["--budgets", "--budget-mib"]
    assert "--install-completion" in run_cli("--help").out


def _verbs() -> list[tuple[str, ...]]:
    """Every leaf command of the registered CLI, as its path of names (``('cost', 'fit')``)."""
    from replay import cli

    cli._register_modules()
    cli._register_plugins()
    out = []

    def walk(cmd, path):
        if hasattr(cmd, "list_commands"):  # a group, walked through click's lookup: it may make its commands when first listed
            ctx = type(cmd).context_class(cmd)
            for name in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, name), (*path, name))
        else:
            out.append(path)

    walk(typer.main.get_command(cli.app), ())
    return out


def test_every_verb_has_one_example_and_a_plain_usage_line():
    verbs = _verbs()
    assert {("cache",), ("predict",), ("drop",), ("prefetch",), ("cost", "fit"), ("import", "bigmoe")} <= set(verbs)
    for v in verbs:
        res = run_cli(*v, "--help")
        assert res.code == 0, (v, res.err)
        text = " ".join(res.out.replace("│", " ").split())
        assert text.count("Example: moe-replay " + " ".join(v)) == 1, f"{' '.join(v)} --help has no example: {text[-300:]}"
        usage = next(line for line in res.out.splitlines() if "Usage:" in line).strip()
        args = usage.split("[OPTIONS]", 1)[1].split()
        assert args and all(a == a.upper() and "{" not in a for a in args), usage  # TRACE, OUT_DIR: not {trace}
    assert "Usage: moe-replay cache [OPTIONS] TRACE " in " ".join(run_cli("cache", "--help").out.split()) + " "


def test_validate_tolerance_in_help_is_the_library_one():
    from replay.core.simulate import VALIDATE_TOLERANCE_PP

    assert f"{VALIDATE_TOLERANCE_PP:g} points off" in " ".join(run_cli("cache", "--help").out.replace("│", " ").split())


# -- budgets: one parser, units, one sentence ---------------------------------------------------

@pytest.mark.parametrize("text, mib", [("4000", 4000.0), ("4000MiB", 4000.0), ("4000 mib", 4000.0), ("4GiB", 4096.0),
                                       ("1.5GiB", 1536.0), ("512KiB", 0.5), ("1TiB", 1048576.0), (" 0.25 ", 0.25),
                                       ("1e3", 1000.0)])
def test_budget_units_exact(text, mib):
    assert parse_budget_mib(text, "--budget-mib") == mib


@pytest.mark.parametrize("text, needle", [("4GB", "decimal units are ambiguous"), ("4 MB", "decimal"), ("abc", "is not a number of MiB"),
                                          ("-1", "not a positive number"), ("0", "not a positive number"), ("0GiB", "positive"),
                                          ("nan", "is not a number of MiB"), ("inf", "is not a number of MiB"), ("1e300", "at most 2^40"),
                                          ("4GiBs", "is not a number of MiB"), ("", "is not a number of MiB")])
def test_bad_budget_is_one_sentence(text, needle):
    with pytest.raises(UserError) as e:
        parse_budget_mib(text, "--budget-mib")
    msg = str(e.value)
    assert msg.startswith("--budget-mib: ") and needle in msg and msg.endswith(".") and "\n" not in msg


def test_budget_list_dedupes_across_units():
    assert parse_budgets_mib("1GiB, 1024,512MiB") == [1024.0, 512.0]
    with pytest.raises(UserError, match="--budgets: no budget given"):
        parse_budgets_mib(" , ")


def test_one_budget_parser():
    # the three old ways (cli/cache inline, parse_budgets(repr(x)) in whatif/cost, budget_bytes in the
    # library) are one: no module but traces/util/units.py parses or bounds a budget itself
    offenders = []
    for f in [*(ROOT / "replay").rglob("*.py"), *(ROOT / "engine_bridge").rglob("*.py")]:
        src = f.read_text(encoding="utf-8")
        if "MAX_BUDGET_MIB" in src or "parse_budgets(repr(" in src:
            offenders.append(str(f.relative_to(ROOT)))
    assert offenders == []


@pytest.fixture(scope="module")
def tiny(synth_trace_dir):
    return synth_trace_dir(layers=3, experts=8, top_k=2, embd=8, tokens=24, prompt_tokens=4)


@pytest.mark.parametrize("verb", [["cache", "--policies", "lru"], ["drop", "--mode", "closed"], ["prefetch"],
                                  ["cache", "--validate"]])
def test_budget_mib_takes_units_everywhere(tiny, verb):
    a = run_cli(verb[0], tiny, *verb[1:], "--budget-mib", "0.5GiB", "--json")
    b = run_cli(verb[0], tiny, *verb[1:], "--budget-mib", "512", "--json")
    assert a.code == b.code == 0, a.err
    assert a.json() == b.json() and a.json()["rows"]
    bad = run_cli(verb[0], tiny, *verb[1:], "--budget-mib", "4GB")
    assert bad.code == 2
    assert_one_sentence_error(bad, "--budget-mib", "4GB")


def test_budgets_take_units(tiny):
    a = run_cli("cache", tiny, "--policies", "lru", "--budgets", "0.25GiB,1GiB", "--json").json()
    b = run_cli("cache", tiny, "--policies", "lru", "--budgets", "256,1024", "--json").json()
    assert a["rows"] == b["rows"] and [r["budget_mib"] for r in a["rows"]] == [256.0, 1024.0]


def test_api_budgets_take_units(tiny):
    import replay

    a = replay.cache(str(tiny), policies=["lru"], budgets_mib=["0.5GiB", "1GiB"])
    b = replay.cache(str(tiny), policies=["lru"], budgets_mib=[512, 1024])
    assert a.equals(b)
    assert replay.drop(str(tiny), mode="closed", fracs=[0.5], budget_mib="512MiB").equals(
        replay.drop(str(tiny), mode="closed", fracs=[0.5], budget_mib=512))
    with pytest.raises(replay.ReplayError, match="^budget_mib: '4GB': decimal units are ambiguous"):
        replay.prefetch(str(tiny), budget_mib="4GB")


# -- compact output -------------------------------------------------------------------------------

def test_compact_is_one_line_per_cell(tiny):
    res = run_cli("cache", tiny, "--policies", "lru", "--budget-mib", "0.5", "--format", "compact")
    assert res.code == 0, res.err
    lines = res.out.strip().splitlines()
    row = run_cli("cache", tiny, "--policies", "lru", "--budget-mib", "0.5", "--json").json()["rows"][0]
    assert len(lines) == 1
    assert lines[0].startswith(f"{tiny.name} lru cache size 0.5 MiB, {row['lookups']} lookups, ")
    assert f"decode miss ratio {1 - row['hit_pct_decode'] / 100:.4f}" in lines[0]
    two = run_cli("cache", tiny, "--policies", "lru,belady", "--budgets", "0.5,1", "--format", "compact").out.strip()
    assert len(two.splitlines()) == 4
    js = run_cli("cache", tiny, "--policies", "lru", "--budget-mib", "0.5", "--format", "json")
    assert js.json()["rows"] == run_cli("cache", tiny, "--policies", "lru", "--budget-mib", "0.5", "--json").json()["rows"]
    assert_one_sentence_error(run_cli("cache", tiny, "--format", "wide"), "--format", "compact")


# -- one signal installer -------------------------------------------------------------------------

def test_one_signal_installer():
    # the command line (replay/runner.py's guarded(), which replay/cli and the fast path both run
    # through) and engine_bridge/capture both go through traces.util.signals.on_signals; nothing else
    # in the distribution installs a SIGINT/SIGTERM handler itself
    callers = []
    for pkg in ("replay", "engine_bridge", "traces"):
        for f in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "signal"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "signal"):
                    callers.append(str(f.relative_to(ROOT)))
    assert sorted(set(callers)) == ["traces/util/signals.py"]
    for f in ("replay/runner.py", "engine_bridge/capture.py"):
        assert "on_signals(" in (ROOT / f).read_text(encoding="utf-8"), f


def test_on_signals_installs_and_restores():
    from traces.util.signals import on_signals

    seen = []
    before = signal.getsignal(signal.SIGTERM)
    with on_signals(lambda s, f: seen.append(s)):
        os.kill(os.getpid(), signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) is not before
    assert seen == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is before
    errors = []

    def off_main():
        try:
            with on_signals(lambda s, f: None):
                pass
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=off_main)
    t.start()
    t.join()
    assert errors == []


def test_bracketed_names_survive_the_help_renderer():
    # rich markup read "stale-gate[d]" as a style tag and printed "stale-gate": every name[param] a
    # help text writes (escaped as name\[param] for rich) must reach the rendered --help whole.
    import re

    import typer.main

    from replay import cli

    def texts(cmd):
        yield cmd.help or ""
        for p in cmd.params:
            yield getattr(p, "help", None) or ""

    checked = 0
    for v in _verbs():
        cmd = typer.main.get_command(cli.app)
        for name in v:  # click's lookup: a group may make its commands when first asked
            cmd = cmd.get_command(type(cmd).context_class(cmd), name)
        want = {m.replace("\\", "") for t in texts(cmd) for m in re.findall(r"[a-z-]+\\?\[[a-z]\]", t)}
        if not want:
            continue
        text = "".join(run_cli(*v, "--help").out.replace("│", " ").split())
        for w in want:
            assert w in text, f"{' '.join(v)} --help lost {w!r}"
            checked += 1
    assert checked >= 4  # predict, prefetch, cache at least
