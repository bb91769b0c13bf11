"""moe-replay: offline replay of Mixture-of-Experts expert caches, predictors, drop and prefetch
over v1 traces. The public Python API (every function keyword-only past the trace; every analysis
returns one Polars DataFrame with the docs/design.md keys; bad input raises :class:`ReplayError`)::

    import replay
    t = replay.open_trace("trace_dir")
    rows = replay.cache(t, policies=["lru", "belady"], budgets_mib=[512, 1024])
    acc = replay.predict(t, predictors=["prev-token", "stale-gate[1]"])
    pre = replay.prefetch(t, predictor="prev-token", budget_mib=512)
    replay.write_report("trace_dir", "report_dir", force=True)

Functions: open_trace, synth, cache, cache_run, retain, predict, predict_run, drop, prefetch, fit_cost_model,
cost_fit, timeline_fit, load_cost_model, manual_cost_model, with_time, write_report, default_budgets_mib,
policy_names, predictor_names, sweep, sweep_report, sweep_budget_answer, compare, compare_run, curve, curve_run, profile, profile_run.

Each function is imported from the module that holds it on first use: :mod:`replay.api` (and
:mod:`replay.analyses.sweeps` for ``sweep``, ``sweep_report`` and ``sweep_budget_answer``). No submodule of ``replay`` is named
like one of them, so ``replay.cache`` is always the function.

Your own policy or predictor module: ``policy_file=`` / ``predictor_file=`` (see examples/ and
the README, "Write your own policy or predictor").
"""

from traces.format.version import __version__

__all__ = [
    "ReplayError",
    "__version__",
    "cache",
    "cache_run",
    "compare",
    "compare_run",
    "cost_fit",
    "curve",
    "curve_run",
    "default_budgets_mib",
    "drop",
    "fit_cost_model",
    "load_cost_model",
    "manual_cost_model",
    "open_trace",
    "policy_names",
    "predict",
    "predict_run",
    "predictor_names",
    "prefetch",
    "profile",
    "profile_run",
    "retain",
    "sweep",
    "sweep_budget_answer",
    "sweep_report",
    "synth",
    "timeline_fit",
    "with_time",
    "write_report",
]

# Where a public function lives when not in replay.api (the sweep engine sits above the API).
_HOME = {"sweep": "replay.analyses.sweeps", "sweep_report": "replay.analyses.sweeps",
         "sweep_budget_answer": "replay.analyses.sweeps"}


def __getattr__(name: str) -> object:
    """The API functions are imported on first use (PEP 562): ``import replay.cli`` (and so
    ``moe-replay --help``) must not wait for Polars and Numba."""
    if name in __all__:
        import importlib

        value = getattr(importlib.import_module(_HOME.get(name, "replay.api")), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'replay' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

