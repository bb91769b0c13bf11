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


def test_verbs_that_run_a_predictor_take_the_same_learner_options_from_one_declaration():
    # predict, prefetch and cache --retain run a predictor that may learn or be a mix: each takes
    # --train, --train-trace, --mix, --seed and --predictor-file, declared once (replay.cli.options)
    import typer

    import replay.cli as cli
    from replay.cli import options

    cli._register_modules()
    group = typer.main.get_command(cli.app)
    ctx = type(group).context_class(group)
    shared = {"--train": options.TrainOpt, "--train-trace": options.TrainTraceOpt, "--mix": options.MixOpt,
              "--predictor-file": options.PredictorFileOpt}
    helps = {}
    for verb in ("predict", "prefetch", "cache"):
        params = {p.opts[0]: p for p in group.get_command(ctx, verb).params if p.opts}
        assert set(shared) | {"--seed"} <= set(params), verb
        for flag, decl in shared.items():
            helps.setdefault(flag, set()).add(params[flag].help)
            assert params[flag].help == decl.help, (verb, flag)
    assert all(len(h) == 1 for h in helps.values())
    # the manual cost model's two options, too, are one declaration wherever a verb takes them
    for verb in ("cache", "curve", "report"):
        params = {p.opts[0]: p for p in group.get_command(ctx, verb).params if p.opts}
        assert params["--flash-mib-s"].help == options.FlashMibSOpt.help
        assert params["--compute-ms"].help == options.ComputeMsOpt.help
