"""The ``moe-replay`` console script: a plain ``cache --json`` runs here without typer, Polars or
Numba; everything else goes to the typer application (:mod:`replay.cli`).

Why: a one-budget ``cache`` on a few million routings takes less time than importing typer
(~0.08 s), Polars (~0.1-0.3 s) and Numba with its cached kernels (~0.4 s) (issue 18: the whole
process against libCacheSim's ``process_trace``). The fast path takes only command lines it
understands completely: ``cache TRACE`` with any of ``--json`` (or ``--format json``),
``--per-layer``, ``--budgets``, ``--budget-mib``, ``--policies``, ``--phase``, ``--seed`` and
``--stream``, each at most once, as ``--opt value``; any other option or form (``--help``,
``--opt=value``, text output, a cost model, ``--validate``, ``--csv``, plugins, a value typer
would refuse) goes to typer, which answers exactly as before. It then runs the same library calls
as :mod:`replay.cli.cache` (the rows as :mod:`replay.rows` normalizes them, the same JSON object),
through the same error handling (:func:`replay.runner.guarded`); the kernels are the compiled
extension's when it was built (:mod:`replay.aot`), else Numba's. A simple trace with plain LRU
policies and given budgets goes further, to :mod:`replay.native` (no NumPy and no Arrow either),
which gives back what it does not take. ``tests/test_fastcli.py`` holds the output to the typer
path's, byte for byte, refusals included. ``MOE_REPLAY_FAST=0`` turns it off.
"""

from __future__ import annotations

import os
import sys
from typing import Any

FLAGS = ("--json", "--per-layer")
VALUED = ("--budgets", "--budget-mib", "--policies", "--phase", "--seed", "--stream", "--format")
DEFAULT_POLICIES = "lru,lfu,layer,lfru,belady,infinite"  # replay.cli.cache's --policies default (a test checks)


def parse(args: list[str]) -> dict[str, Any] | None:
    """The options of a ``cache`` command line the fast path runs, or None (typer runs it)."""
    if not args or args[0] != "cache":
        return None
    opts: dict[str, Any] = {}
    pos: list[str] = []
    i = 1
    while i < len(args):
        a = args[i]
        if a in FLAGS:
            if a in opts:
                return None
            opts[a] = True
        elif a in VALUED:
            if a in opts or i + 1 >= len(args) or args[i + 1].startswith("-"):
                return None
            opts[a] = args[i + 1]
            i += 1
        elif a.startswith("-"):
            return None
        else:
            pos.append(a)
        i += 1
    if len(pos) != 1 or opts.get("--format", "json") != "json" or not ("--json" in opts or "--format" in opts):
        return None
    seed = opts.get("--seed", "0")
    if not seed.strip().lstrip("+-").isdigit():
        return None  # typer's own "not a valid integer"
    return {"trace": pos[0], "budgets": opts.get("--budgets"), "budget_mib": opts.get("--budget-mib"),
            "policies": opts.get("--policies", DEFAULT_POLICIES), "phase": opts.get("--phase", "decode"),
            "seed": int(seed), "stream": opts.get("--stream", "auto"), "per_layer": "--per-layer" in opts}


def cache_json(trace: str, budgets: str | None, budget_mib: str | None, policies: str, phase: str, seed: int, stream: str,
               per_layer: bool) -> str:
    """``cache --json``'s output: the calls and checks of :mod:`replay.cli.cache` in the same order,
    for the options the fast path takes."""
    from pathlib import Path

    from replay.cache import check_policies, default_budgets_mib
    from replay.cache_stream import check_stream_mode, choose_stream
    from replay.info import require_routings
    from replay.phases import check_phase
    from replay.rows import cache_summary, column_types, plain_rows
    from traces import open_trace
    from traces.units import parse_budget_mib, parse_budgets_mib

    check_phase(phase)
    bmib = None if budget_mib is None else parse_budget_mib(budget_mib, "--budget-mib")
    pols = check_policies([p for p in policies.split(",") if p.strip()])
    if not 0 <= seed < 1 << 63:
        from traces.errors import UserError

        raise UserError(f"--seed: {seed} is not in 0..2^63-1.")
    blist = parse_budgets_mib(budgets, "--budgets") if budgets is not None else None
    if blist is not None and bmib is not None:
        from traces.errors import UserError

        raise UserError("--budgets and --budget-mib both name the budgets to replay; give one of them.")
    check_stream_mode(stream)
    t = open_trace(Path(trace), defer_rows=True)
    require_routings(t, "replay")
    streamed = choose_stream(t, pols, stream, in_memory_only=None)
    rec_budget = t.recorded.get("budget_mib")
    if blist is None and bmib is not None:
        blist = [bmib]
    if streamed:
        from replay.cache_stream import Sizes, stream_sweep_rows, working_set_stream

        if blist is None:
            blist = default_budgets_mib(Sizes(t.token_cycle_bytes, working_set_stream(t)), rec_budget)
        raw, loads, W_bytes = stream_sweep_rows(t, pols, blist, per_layer=per_layer, seed=seed, show_progress=True)
        extras = False
    else:
        from replay.cache import loads_of, sweep_rows

        loads = loads_of(t)
        W_bytes = loads.working_set_bytes
        if blist is None:
            blist = default_budgets_mib(loads, rec_budget)
        raw, extras = sweep_rows(loads, pols, [float(b) for b in blist], per_layer=per_layer, seed=seed, show_progress=True)
    rows = plain_rows(raw, column_types(extras))
    sm = cache_summary(t, rows, blist, budgets is not None or budget_mib is not None, W_bytes,
                       bool((loads.batch_phase == 1).any()))
    return cache_json_text(trace, phase, rows, sm)


def cache_json_text(trace: str, phase: str, rows: list[dict[str, Any]], sm: dict[str, Any]) -> str:
    """The JSON object ``cache --json`` prints: the rows and :func:`replay.rows.cache_summary`'s ``sm``."""
    from pathlib import Path

    from replay.present.format import json_object

    return json_object("cache", str(Path(trace)), rows, phase=phase, token_cycle_mib=sm["token_cycle_mib"],
                       working_set_mib=sm["working_set_mib"], budgets_below_token_cycle=sm["budgets_below_token_cycle"],
                       budgets_chosen=sm["budgets_chosen"], note=sm["note"], cost_model=None)


def run(args: list[str], debug: bool) -> int | None:
    """Run ``args`` on the fast path and return its exit code, or None when typer should run it."""
    if os.environ.get("MOE_REPLAY_FAST", "1") == "0":
        return None
    opts = parse(args)
    if opts is None:
        return None
    from replay.runner import guarded

    def call() -> int:
        # The library's own functions, not replay.api's: their messages name the flags as typed
        # (what replay.api.cli_flags asks of the API's functions on typer's path).
        from replay import native

        got = native.cache_rows(**opts)  # None: not one the native path takes (the same JSON, or refusal, below)
        out = cache_json(**opts) if got is None else cache_json_text(opts["trace"], opts["phase"], *got)
        sys.stdout.write(out + "\n")
        sys.stdout.flush()
        return 0

    return guarded(call, debug, quiet=True)


def main(argv: list[str] | None = None) -> None:
    """The console script: the fast path when it takes the command line, else :func:`replay.cli.main`."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    atomic = sys.modules.get("traces.atomic")  # what an interrupted run names (the fast path writes nothing)
    if atomic is not None:
        atomic.written.clear()
        atomic.abandoned.clear()
    code = run([a for a in args if a != "--debug"], debug)
    if code is None:
        from replay.cli import main as full

        full(args)
        return
    if code:
        sys.exit(code)
