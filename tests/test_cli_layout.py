"""Issue 15 item 2 (part): the typer code is its own package, replay/cli/, with one registration
pattern and one module of shared options; the entry points keep working."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_python_dash_m_replay_cli_runs():
    r = subprocess.run([sys.executable, "-m", "replay.cli", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "cache" in r.stdout and "predict" in r.stdout, r.stderr


def test_every_verb_module_registers_and_uses_the_shared_options():
    import replay.cli as cli
    from replay.cli import options

    assert (ROOT / "replay" / "cli" / "__main__.py").is_file()
    assert callable(cli.main)  # the console script replay.cli:main
    for name in cli.VERB_MODULES:
        mod = importlib.import_module(name)
        assert callable(mod.register), name
        assert "from replay.cli.options import" in Path(mod.__file__).read_text(), name
    assert not list((ROOT / "replay").glob("*_cli.py"))
    assert options.TraceArg is cli.TraceArg and options.JsonOpt is cli.JsonOpt


def test_main_registers_each_verb_once_per_process():
    # main() registers the verbs before every run; typer appends a command each time one is added, so
    # without a guard every in-process call (the tests make thousands) grew the app and slowed the next
    import replay.cli as cli
    from tests.helpers import run_cli

    run_cli("info", "/nonexistent")
    sizes = len(cli.app.registered_commands), len(cli.app.registered_groups)
    for _ in range(3):
        assert run_cli("info", "/nonexistent").code == 2
    assert (len(cli.app.registered_commands), len(cli.app.registered_groups)) == sizes
    names = [c.name or c.callback.__name__ for c in cli.app.registered_commands]
    assert len(names) == len(set(names)), names
