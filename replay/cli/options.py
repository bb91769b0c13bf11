"""Options shared by the verbs: one definition each, so every verb spells and explains them alike.

Each verb module of this package defines ``register(app)`` and takes its shared parameters from
here (``trace: Path = TraceArg``, ``json_out: bool = JsonOpt``, ...)."""

from __future__ import annotations

import typer

TraceArg = typer.Argument(..., help="Trace directory (trace.json + routings/).", show_default=False)
JsonOpt = typer.Option(False, "--json", help="Print one JSON object instead of tables.")
CostModelOpt = typer.Option(None, "--cost-model", help="A 'cost fit --json' file: adds ms/token and tok/s.")
BudgetsOpt = typer.Option(None, "--budgets", help="Cache budgets in MiB (2^20 bytes), comma-separated.")
PolicyFileOpt = typer.Option(None, "--policy-file", help="A policy module (.py) anywhere on disk; its NAME can then be "
                             "named as a policy (repeatable).")
PredictorFileOpt = typer.Option(None, "--predictor-file", help="A predictor module (.py) anywhere on disk; its NAME can "
                                "then be named as a predictor (repeatable).")
