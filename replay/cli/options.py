"""Options shared by the verbs: one definition each, so every verb spells and explains them alike.

Each verb module of this package defines ``register(app)`` and takes its shared parameters from
here (``trace: Path = TraceArg``, ``json_out: bool = JsonOpt``, ...). Budgets, wherever a verb
takes them, are read by :func:`parse_budget` / :func:`parse_budgets` (MiB, or with a binary unit:
``4000``, ``4000MiB``, ``4GiB``, ``1.5GiB``), the one parser of :mod:`traces.util.units`.

This module imports only typer: ``moe-replay --help`` must not wait for Numba or Polars.
"""

from __future__ import annotations

import typer

from traces.util.units import parse_budget_mib, parse_budgets_mib

TraceArg = typer.Argument(..., help="Trace directory (trace.json + routings/).", show_default=False, metavar="TRACE")
JsonOpt = typer.Option(False, "--json", help="Print one JSON object instead of tables.")
CostModelOpt = typer.Option(None, "--cost-model", help="A 'cost fit --json' file: adds ms/token and tok/s.")
FlashMibSOpt = typer.Option(None, "--flash-mib-s", help="Manual cost model: read bandwidth in MiB/s.")
ComputeMsOpt = typer.Option(None, "--compute-ms", help="Manual cost model: compute ms per token.")
ForeignCostModelOpt = typer.Option(False, "--foreign-cost-model", help="Apply a --cost-model fitted on another model or "
                                   "device (or written before models recorded their origin) anyway; every time figure "
                                   "is then marked as foreign. Without it such a model is refused.")
TimeModelOpt = typer.Option(None, "--time-model", help="linear (the cost model: --cost-model, else fitted on the "
                            "trace's metrics) | fitted (the timeline of reads on lanes against compute, fitted on the "
                            "trace's metrics) | profile (the timeline on --device-profile).", show_default=False)
DeviceProfileOpt = typer.Option(None, "--device-profile", help="With --time-model profile: a JSON file (lanes, lane_mib_s, "
                                "read_latency_ms, compute_ms_per_layer, ...) or a preset: phone-ufs4, phone-serial, "
                                "gpu-pcie4 (assumptions, not measurements).", show_default=False)
BUDGET_UNITS_HELP = "MiB (2^20 bytes), or with a unit: 4000, 4000MiB, 4GiB, 1.5GiB"
BudgetsOpt = typer.Option(None, "--budgets", help=f"Cache budgets, comma-separated, each in {BUDGET_UNITS_HELP}. "
                          "Default: derived from the trace (see output).", show_default=False)
BudgetMibOpt = typer.Option(None, "--budget-mib", help=f"Cache budget in {BUDGET_UNITS_HELP} (default: the recorded one).",
                            show_default=False)
PolicyFileOpt = typer.Option(None, "--policy-file", help="A policy module (.py) anywhere on disk; its NAME can then be "
                             "named as a policy (repeatable).")
PredictorFileOpt = typer.Option(None, "--predictor-file", help="A predictor module (.py) anywhere on disk; its NAME can "
                                "then be named as a predictor (repeatable).")

# The options of a learning predictor, the same on every verb that runs a predictor (predict, prefetch,
# cache --retain): declared once here, turned into the API's keywords by learner_keywords().
TrainOpt = typer.Option(None, "--train", help="What a learning predictor (static-hot, pair-table\\[d], request-match, "
                        "learned-gate\\[d], mix) is fitted on; it is scored on, and guesses for, the other tokens only: 50% "
                        "(the first half of each request's tokens), trace:50% (of the trace's), folds:5 (5-fold by "
                        "request, dealt with --seed), or in-sample (on the scored tokens themselves; marked) [default: 50% "
                        "when a learner runs].", show_default=False)
TrainTraceOpt = typer.Option(None, "--train-trace", help="Fit a learning predictor on this trace instead (same model and "
                             "shapes); it is then scored on, and guesses for, every token of TRACE.", show_default=False)
SplitSeedOpt = typer.Option(0, "--seed", help="Seed of the k-fold deal of requests (--train folds:K).")
MixOpt = typer.Option(None, "--mix", help="When a predictor is mix: the two predictors it unites and A's weight, A,B[,W] "
                      "[default: prev-token,pair-table[1],0.5].", show_default=False)


def check_foreign_cost_model(foreign: bool, cost_model: object) -> None:
    """--foreign-cost-model gives leave to apply a --cost-model FILE; alone (or with a manual model,
    which fits no particular trace) it would be silently ignored, so it is refused."""
    if foreign and cost_model is None:
        from traces.format.errors import UserError

        raise UserError("--foreign-cost-model: only meaningful with --cost-model FILE (a manual model applies to any trace).")


def learner_keywords(train: str | None, train_trace: object, mix: str | None) -> dict:
    """The API keywords of the learner options (:data:`TrainOpt`, :data:`TrainTraceOpt`, :data:`MixOpt`;
    ``--seed`` is passed as it is): the training trace opened, ``--mix`` checked (a bad one named as
    ``--mix``). Call it after the verb's --predictor-file is registered (mix may name its predictor)."""
    from traces import open_trace

    if mix is not None:
        from replay.predictors.mix import parse_mix

        parse_mix(mix, "--mix")  # checked before any work; the API parses it again, as the user typed it
    return {"train": train, "train_trace": open_trace(train_trace) if train_trace is not None else None, "mix": mix}


def example(command_line: str) -> str:
    """A verb's ``--help`` epilog: one command line to copy (every verb has one; tests/test_cli_feel.py)."""
    return f"Example: {command_line}"


def parse_budget(text: str | float | None, option: str = "--budget-mib") -> float | None:
    """One budget option's value in MiB (None stays None); a bad one is one sentence naming ``option``."""
    return None if text is None else parse_budget_mib(text, option)


def parse_budgets(text: str, option: str = "--budgets") -> list[float]:
    """A comma-separated budget list in MiB, distinct, in the order given."""
    return parse_budgets_mib(text, option)
