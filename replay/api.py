"""The public Python API: keyword arguments in, one Polars DataFrame out (docs/design.md keys).

Every analysis function takes a trace (a :class:`traces.io.reader.Trace` from :func:`open_trace`,
or a path to one), keyword-only options, and returns one ``polars.DataFrame``; where the
command line prints more than the rows (warnings, predictors that could not run), a second
function returns it (:func:`predict_run`). Bad input raises :class:`ReplayError` (the project's
:class:`traces.format.errors.UserError`) with a message that names the parameter, never a CLI flag.
The ``moe-replay`` verbs call exactly these functions.
"""

from __future__ import annotations

import contextvars
import functools
import re
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from traces.format.errors import UserError

if TYPE_CHECKING:  # Polars is imported where a function runs, not by ``import replay.cli`` (``--help`` stays fast)
    import polars as pl

ReplayError = UserError

TraceLike = Any  # a traces.io.reader.Trace or a path to a trace directory

# CLI flags a library message may name, and the keyword that replaces each in the API's messages.
_KEYWORD = {
    "--policies": "policies", "--policy": "policy", "--budgets": "budgets_mib", "--budget-mib": "budget_mib",
    "--predictors": "predictors", "--predictor": "predictor", "--width": "width", "--horizon": "horizons",
    "--horizon-curve": "max_horizon", "--cap": "cap", "--drop": "drop_frac", "--seed": "seed", "--phase": "phase",
    "--fracs": "fracs", "--mode": "mode", "--cost-model": "cost_model", "--flash-mib-s": "flash_mib_s",
    "--compute-ms": "compute_ms", "--pin-per-layer": "policy_options['pin']['per_layer']",
    "--pin-profile": "policy_options['pin']['profile']", "--policy-file": "policy_file",
    "--predictor-file": "predictor_file", "--force": "force", "--out": "out", "--retain": "retain_predictor",
    "--train": "train", "--train-trace": "train_trace", "--quality": "quality", "--foreign-cost-model": "foreign_cost_model=True",
}
# Set by the CLI while a verb runs: its messages keep the flag names the user typed.
cli_flags: contextvars.ContextVar[bool] = contextvars.ContextVar("moe_replay_cli_flags", default=False)
_FLAG = re.compile(r"(?<![\w/.-])(--[a-z][a-z0-9-]*)")


def _keywords(message: str) -> str:
    return _FLAG.sub(lambda m: _KEYWORD.get(m.group(1), m.group(1)[2:].replace("-", "_")), message)


def _api(fn: Callable) -> Callable:
    """Errors name the keyword, not a CLI flag (the library's messages were written for the CLI)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kw: Any) -> Any:
        from replay.predictors import active_files

        token = active_files.set(active_files.get())
        try:
            return fn(*args, **kw)
        except UserError as e:
            if cli_flags.get():
                raise
            msg = _keywords(str(e))
            if msg == str(e):
                raise
            raise type(e)(msg) from e
        finally:
            active_files.reset(token)

    return wrapper


def _trace(trace: TraceLike):
    from traces import open_trace as _open
    from traces.io.reader import Trace

    return trace if isinstance(trace, Trace) else _open(trace)


def _plugins(policy_file: Any, predictor_file: Any) -> None:
    """Register the files; the predictor files join this call's default lists (a contextvar,
    reset by :func:`_api` when the call returns)."""
    from replay.plugin_files import register_files
    from replay.predictors import active_files

    _, preds = register_files(policy_file, predictor_file)
    if preds:
        active_files.set(tuple(dict.fromkeys((*active_files.get(), *preds))))


def _budget(value: Any, what: str = "budget_mib") -> float | None:
    """A budget in MiB: a number, or text with a binary unit ("4GiB"), read by the CLI's own parser."""
    from traces.util.units import parse_budget_mib

    return None if value is None else parse_budget_mib(value, what)


def _budgets(values: Sequence[Any]) -> list[float]:
    if isinstance(values, (str, int, float)):
        values = [values]
    return [_budget(v, "budgets_mib") for v in values]


@_api
def open_trace(path: str | Path):
    """Open a v1 trace directory (validated); the object every other function takes."""
    from traces import open_trace as _open

    return _open(path)


@_api
def synth(out: str | Path, *, force: bool = False, **config: Any):
    """Write a synthetic trace (the project's small residual-stream model, deterministic per
    ``seed``) into ``out`` and open it. ``config``: the fields of :class:`traces.synth.generator.SynthConfig`
    (``layers``, ``experts``, ``top_k``, ``embd``, ``tokens``, ``prompt_tokens``, ``seed``,
    ``gating``, ``routing_only``, ``expert_bytes``, ``drift``, ``reuse``, ``skew``)."""
    import dataclasses

    from traces import open_trace as _open
    from traces.synth.generator import SynthConfig, write_synthetic

    known = {f.name for f in dataclasses.fields(SynthConfig)}
    bad = sorted(set(config) - known)
    if bad:
        raise UserError(f"synth: unknown option {bad[0]!r} (known: {', '.join(sorted(known))}).")
    write_synthetic(Path(out), SynthConfig(**config), force=force)
    return _open(out)


def default_budgets_mib(trace: TraceLike) -> list[float]:
    """The default budgets: 9, geometric from T/2 to the working set W (2 significant figures),
    the recorded budget replacing the nearest."""
    from replay.core.simulate import default_budgets_mib as _default
    from replay.core.simulate import loads_of

    t = _trace(trace)
    return _default(loads_of(t), t.recorded.get("budget_mib"))


class CacheRun:
    """Everything ``cache`` prints: the rows (``frame``), the budgets replayed (``budgets_mib``),
    the loads the replay cut (``loads``: the batch-only ones when streamed), the working set in
    bytes and :attr:`summary` (:func:`replay.core.rows.cache_summary`: T, W, the note)."""

    def __init__(self, trace: Any, frame: pl.DataFrame, budgets_mib: list[float], budgets_given: bool, loads: Any,
                 working_set_bytes: int | None, streamed: bool) -> None:
        self.trace, self.frame, self.budgets_mib, self.budgets_given = trace, frame, budgets_mib, budgets_given
        self.loads, self.streamed = loads, streamed
        self._working_set_bytes = working_set_bytes

    @property
    def working_set_bytes(self) -> int:
        return self.loads.working_set_bytes if self._working_set_bytes is None else self._working_set_bytes

    @functools.cached_property
    def summary(self) -> dict[str, Any]:
        from replay.core.frames import rows_of
        from replay.core.rows import cache_summary

        return cache_summary(self.trace, rows_of(self.frame.filter(self.frame["layer"].is_null())), self.budgets_mib,
                             self.budgets_given, self.working_set_bytes, bool((self.loads.batch_phase == 1).any()))


@_api
def cache_run(trace: TraceLike, *, policies: Sequence[str] = ("lru", "lfu", "layer", "lfru", "belady", "infinite"),
              budgets_mib: Sequence[float] | None = None, per_layer: bool = False, phase: str = "decode", seed: int = 0,
              policy_options: dict[str, dict[str, Any]] | None = None, policy_file: Any = None, cost_model: Any = None,
              retain_predictor: str | None = None, predictor_file: Any = None, show_progress: bool = False,
              loads: Any = None, stream: str = "auto", foreign_cost_model: bool = False, paired: bool = False,
              time_model: str | None = None, device_profile: Any = None, train: str | None = None,
              train_trace: TraceLike | None = None, mix: Any = None) -> CacheRun:
    """:func:`cache` with everything the command prints beside the rows: a :class:`CacheRun`. The
    one flow of a cache replay: the ``cache`` verb, :func:`cache` and sweeps all run it. A
    ``cost_model`` fitted on another model or device is refused before the replay unless
    ``foreign_cost_model`` (replay.analyses.cost_origin). ``time_model`` / ``device_profile`` as in
    :func:`prefetch` (the timeline replays each cell in memory). ``train`` / ``train_trace`` / ``mix``
    (with ``retain_predictor``): what a learning predictor is fitted on and the parts of ``mix``, as
    in :func:`prefetch` (``seed`` deals the folds); it guesses only for the other tokens."""
    from replay.analyses.info import require_routings
    from replay.core.phases import check_phase
    from replay.core.simulate import check_policies, default_budgets_mib, loads_of, sweep
    from replay.core.streaming import check_stream_mode, choose_stream, streamable

    check_phase(phase)
    check_stream_mode(stream)
    _plugins(policy_file, predictor_file)
    pols = check_policies(list(policies))
    if not 0 <= seed < 1 << 63:
        raise UserError(f"--seed: {seed} is not in 0..2^63-1.")
    given = [f for f, v in (("--train", train), ("--train-trace", train_trace), ("--mix", mix)) if v is not None]
    if retain_predictor is None and given:
        raise UserError(f"{given[0]}: only meaningful with --retain (a cache replay without retention runs no predictor).")
    _check_mix(mix, [retain_predictor] if retain_predictor is not None else [])  # before any replay
    t = _trace(trace)
    require_routings(t, "replay")

    profile, _, cost_model = _time_models(t, time_model, device_profile, cost_model, foreign_cost_model)
    if profile is not None:
        if stream == "on":
            raise UserError("--stream on: the timeline times each cell's per-slot codes in memory; use --stream off or auto.")
        stream = "off"
    blist = _budgets(budgets_mib) if budgets_mib is not None else None
    rec_budget = t.recorded.get("budget_mib")
    # Options of a policy that streams replay in memory only (the policies that take options do not stream).
    in_memory_only = ("--retain" if retain_predictor is not None
                      else "policy_options" if policy_options and all(streamable(p) for p in pols) else None)
    if paired and retain_predictor is not None:
        raise UserError("paired: compares plain replays; not with retain_predictor.")
    series: dict | None = {} if paired else None  # each cell's decode batches (replay.analyses.paired)
    if loads is None and choose_stream(t, pols, stream, in_memory_only=in_memory_only):
        from replay.core.streaming import Sizes, stream_sweep, working_set_stream

        if blist is None:  # the working set first (one more pass over the parts), then the replay
            blist = default_budgets_mib(Sizes(t.token_cycle_bytes, working_set_stream(t)), rec_budget)
        frame, loads, working_set = stream_sweep(t, pols, blist, per_layer=per_layer, seed=seed, show_progress=show_progress,
                                                 series=series)
        streamed = True
    else:
        loads = loads if loads is not None else loads_of(t)
        working_set, streamed = None, False
        if blist is None:
            blist = default_budgets_mib(loads, rec_budget)
        if retain_predictor is not None:
            from replay.analyses.prefetching import retain_sweep

            with _mixed(mix, [retain_predictor]):
                frame = retain_sweep(t, loads, pols, blist, retain_predictor, per_layer=per_layer, seed=seed,
                                     policy_options=policy_options, show_progress=show_progress, train=train,
                                     train_trace=_trace(train_trace) if train_trace is not None else None,
                                     profile=profile)
        else:
            frame = sweep(loads, pols, blist, per_layer=per_layer, seed=seed, policy_options=policy_options,
                          show_progress=show_progress, series=series)
    if cost_model is not None:
        frame = with_time(frame, cost_model, trace=t)
    if series is not None:
        from replay.analyses.paired import with_paired, with_requests

        frame = with_paired(frame, with_requests(series, t), cost_model)
    if profile is not None and retain_predictor is None:  # retention is timed by retain_sweep, with and without
        from replay.analyses.paired import request_units
        from replay.analyses.timeline_whatif import cache_columns

        frame = cache_columns(loads, frame, profile, seed=seed, policy_options=policy_options, requests=request_units(t))
    return CacheRun(t, frame, blist, budgets_mib is not None, loads, working_set, streamed)


@_api
def cache(trace: TraceLike, *, policies: Sequence[str] = ("lru", "lfu", "layer", "lfru", "belady", "infinite"),
          budgets_mib: Sequence[float] | None = None, per_layer: bool = False, phase: str = "decode", seed: int = 0,
          policy_options: dict[str, dict[str, Any]] | None = None, policy_file: Any = None, cost_model: Any = None,
          retain_predictor: str | None = None, predictor_file: Any = None, show_progress: bool = False,
          loads: Any = None, stream: str = "auto", foreign_cost_model: bool = False, paired: bool = False,
          time_model: str | None = None, device_profile: Any = None, train: str | None = None,
          train_trace: TraceLike | None = None, mix: Any = None) -> pl.DataFrame:
    """Replay every (policy, budget) cell: one row per cell (``layer`` null) and, with
    ``per_layer``, one per MoE layer. Keys: ``policy``, ``budget_mib``, ``layer``,
    ``hit_pct_decode``, ``hit_pct_cum``, ``read_mib``, ``peak_resident_mib``, ``overflow_loads``,
    ``over_budget``, ... (docs/design.md, "cache"); with ``cost_model`` (a model from
    :func:`fit_cost_model` / :func:`load_cost_model`) also ``ms_per_token``/``tok_s`` (a model
    fitted on another model or device is refused unless ``foreign_cost_model``; then the rows carry
    ``cost_model_foreign``: docs/design.md, "Cost model"); with
    ``retain_predictor`` the replay protects that predictor's guesses for the next layer(s)
    (``retain_gain_pp_*`` columns; a learning predictor fitted held out under ``train`` /
    ``train_trace`` / ``seed``, and ``mix``'s parts, as in :func:`prefetch`, recorded in ``retain_train``). ``budgets_mib``
    default: :func:`default_budgets_mib`; a budget is MiB, or text with a binary unit (``"4GiB"``,
    ``"1.5GiB"``), in every function that takes one.
    ``phase`` is checked (decode | prefill | all): it names the hit % a caller leads with; every
    row carries all of them. ``policy_file``: a policy module (or a list) anywhere on disk.
    ``stream`` (auto | on | off): replay part by part (:func:`replay.core.streaming.stream_sweep`, the
    same rows byte for byte, memory one part plus the cache states); auto streams when the
    in-memory replay would not fit comfortably (:func:`replay.core.streaming.auto_streams`) and
    every policy streams (not pin, colibri, layer-opt; not with ``retain_predictor`` or
    ``policy_options``); on refuses what cannot stream.

    ``paired``: also, on every overall row, its decode hit % minus LRU's at the same budget with
    a 95% interval from a seeded paired block bootstrap over decoded tokens (``delta_vs_lru_pp``,
    ``delta_ci_low``, ``delta_ci_high``, ``vs_lru`` = better | worse | tie: better or worse only
    when the interval excludes zero) and ``tied_with_best`` (the best within-budget online policy,
    or tied with it within noise); with ``cost_model`` the same for ms per decoded token
    (``delta_ms_vs_lru``, ``delta_ms_ci_low``, ``delta_ms_ci_high``, ``vs_lru_time``,
    ``tied_with_fastest``). :mod:`replay.analyses.paired` (docs/design.md, "Paired comparisons").
    ``time_model`` ``"fitted"`` / ``"profile"`` (with ``device_profile``): every overall row timed on
    the timeline (replay.analyses.timeline_whatif.cache_columns: ``ms_per_token``, ``tok_s``,
    ``stall_ms_per_token``, ``lane_busy_pct``, and against LRU ``delta_ms_vs_lru`` with its paired
    interval and ``vs_lru_time``); with ``retain_predictor``, the replay with retention against the
    plain one instead (replay.analyses.prefetching.retain_timeline_columns: ``ms_per_token``,
    ``ms_per_token_no_retain``, ``retain_ms_saved_per_token`` with its paired interval,
    ``retain_vs_no_retain_time``); ``"linear"``: ``cost_model``, else one fitted on the trace."""
    return cache_run(trace, policies=policies, budgets_mib=budgets_mib, per_layer=per_layer, phase=phase, seed=seed,
                     policy_options=policy_options, policy_file=policy_file, cost_model=cost_model,
                     retain_predictor=retain_predictor, predictor_file=predictor_file, show_progress=show_progress,
                     loads=loads, stream=stream, foreign_cost_model=foreign_cost_model, paired=paired,
                     time_model=time_model, device_profile=device_profile, train=train, train_trace=train_trace,
                     mix=mix).frame


@_api
def retain(trace: TraceLike, *, predictor: str = "prev-token", policies: Sequence[str] = ("lru",),
           budgets_mib: Sequence[float] | None = None, per_layer: bool = False, seed: int = 0,
           policy_options: dict | None = None, policy_file: Any = None, predictor_file: Any = None,
           train: str | None = None, train_trace: TraceLike | None = None, mix: Any = None) -> pl.DataFrame:
    """:func:`cache` with retention: ``predictor``'s guesses for the next layer(s) protected from
    eviction; rows gain ``retain_predictor``, ``retain_train``, ``hit_pct_*_no_retain`` and
    ``retain_gain_pp_*``. A learning predictor is fitted held out (``train`` / ``train_trace`` /
    ``seed`` / ``mix`` as in :func:`prefetch`)."""
    return cache(trace, policies=policies, budgets_mib=budgets_mib, per_layer=per_layer, seed=seed,
                 policy_options=policy_options, policy_file=policy_file, predictor_file=predictor_file,
                 retain_predictor=predictor, train=train, train_trace=train_trace, mix=mix)


@_api
def predict_run(trace: TraceLike, *, predictors: Sequence[str] | None = None, horizons: Sequence[int] = (1,),
                width: int | None = None, phase: str = "decode", max_horizon: int | None = None,
                predictor_file: Any = None, progress: Any = None, train: str | None = None,
                train_trace: TraceLike | None = None, seed: int = 0, byte_budget_mib: float | None = None,
                mix: Any = None):
    """:func:`predict` with everything the command prints beside the rows: a
    :class:`replay.analyses.accuracy.PredictResult` (``.frame``, ``.unavailable``, ``.warnings``, ``.notes``,
    ``.ctrl_failing_layers``, ``.train_text``, ``.in_sample``). ``max_horizon``: the stale-gate[1..D]
    curve instead (``horizon`` column)."""
    from replay.analyses.accuracy import evaluate, expand, horizon_curve
    from replay.analyses.info import require_routings

    _plugins(None, predictor_file)
    t = _trace(trace)
    require_routings(t, "score")
    if max_horizon is not None:
        return horizon_curve(t, max_horizon, width=width, phase=phase, progress=progress)
    names = None if predictors is None else expand(list(predictors), list(horizons), option="predictors")
    with _mixed(mix, names, "--predictors"):
        return evaluate(t, names, horizons=horizons, width=width, phase=phase, progress=progress, train=train,
                        train_trace=_trace(train_trace) if train_trace is not None else None, seed=seed,
                        byte_budget_mib=byte_budget_mib)


def _check_mix(mix: Any, predictors: Sequence[str] | None, option: str = "--predictor") -> tuple | None:
    """``mix``'s two parts and weight (``("prev-token", "pair-table[1]", 0.5)`` or ``"A,B,W"``), checked
    for the call's ``predictors`` (None: the default list, which holds mix): given while no predictor
    of the call is mix it would be silently ignored, so it is refused, by every function that takes
    a predictor (predict, prefetch, cache / retain with a retained predictor)."""
    if mix is None:
        return None
    from replay.predictors import parse_predictor
    from replay.predictors.mix import NAME, parse_mix

    parts = parse_mix(mix, "--mix")
    if predictors is not None and all(parse_predictor(p, option)[0] != NAME for p in predictors):
        raise UserError(f"--mix {mix if isinstance(mix, str) else ','.join(map(str, mix))}: only meaningful when the "
                        f"predictor is {NAME} (it names mix's two parts and A's weight).")
    return parts


@contextmanager
def _mixed(mix: Any, predictors: Sequence[str] | None, option: str = "--predictor"):
    """``mix`` (checked by :func:`_check_mix`) set for the call."""
    parts = _check_mix(mix, predictors, option)
    if parts is None:
        yield
        return
    from replay.predictors.mix import spec

    tok = spec.set(parts)
    try:
        yield
    finally:
        spec.reset(tok)


@_api
def predict(trace: TraceLike, *, predictors: Sequence[str] | None = None, horizons: Sequence[int] = (1,),
            width: int | None = None, phase: str = "decode", max_horizon: int | None = None,
            predictor_file: Any = None, train: str | None = None, train_trace: TraceLike | None = None,
            seed: int = 0, byte_budget_mib: float | None = None, mix: Any = None) -> pl.DataFrame:
    """Predictor accuracy: one row per (predictor, MoE layer) and an overall row per predictor
    (``layer`` null). Keys: ``predictor``, ``layer``, ``slot_acc_pct``, ``whole_acc_pct``,
    ``recall_pct``, ``precision_pct``, ``mass_pct``, ``scored``, ``unscored``, ... (docs/design.md,
    "predict"); overall rows also the 95% intervals ``slot_acc_ci_low/high``, ``mass_ci_low/high``,
    ``vs_prev_token_pp``, ``lead_layers``, ``unused_mib_per_token``, ``bytes_recall_pct`` (at
    ``byte_budget_mib`` per routing), ``train`` and ``in_sample``. ``predictors`` default: every
    registered predictor (a bare ``stale-gate`` is one per ``horizons``). Predictors the trace
    cannot run are left out: :func:`predict_run` says why.

    Held out (docs/predictors.md): a predictor that learns (static-hot, pair-table, request-match,
    mix) is fitted on ``train`` (``"50%"``: the first half of each request's tokens, the default;
    ``"trace:50%"``; ``"folds:5"``: k-fold by request, ``seed``; ``"in-sample"``: on the scored
    tokens themselves, marked ``in_sample``) or on ``train_trace``, and every predictor is scored
    on the other tokens only. ``mix``: ``("A", "B", w)``, the two predictors ``mix`` unites."""
    return predict_run(trace, predictors=predictors, horizons=horizons, width=width, phase=phase,
                       max_horizon=max_horizon, predictor_file=predictor_file, train=train, train_trace=train_trace,
                       seed=seed, byte_budget_mib=byte_budget_mib, mix=mix).frame


@_api
def drop(trace: TraceLike, *, fracs: Sequence[float] = (0.25, 0.5, 0.75, 1.0), mode: str = "static",
         budget_mib: float | None = None, policy: str = "lru", phase: str = "decode", cost_model: Any = None,
         policy_file: Any = None, foreign_cost_model: bool = False, time_model: str | None = None,
         device_profile: Any = None) -> pl.DataFrame:
    """Drop-cold (skip a miss whose router weight < F/k) and top-k cut rows: reads avoided against
    weight mass discarded. ``mode``: ``static`` (on the recorded residency) or ``closed`` (the
    cache replayed at ``budget_mib`` under ``policy`` with dropping in the loop). With
    ``cost_model``: ``ms_per_token`` and the no-drop baseline (decode only; ``foreign_cost_model``
    as in :func:`cache`). ``time_model`` / ``device_profile`` as in :func:`prefetch`: on the
    timeline (``"fitted"`` / ``"profile"``) each row's misses with and without the dropped slots
    are timed (``ms_per_token``, ``ms_per_token_baseline``, ``stall_ms_per_token``,
    ``ms_saved_per_token`` with its paired interval ``ms_saved_ci_low`` / ``_high`` and
    ``vs_baseline_time``: replay.analyses.drop_cold.timeline_drop); ``"linear"``: ``cost_model``,
    else one fitted on the trace."""
    from replay.analyses.drop_cold import check_drop_frac, closed_drop, drop_time_columns, static_drop
    from replay.core.phases import check_phase

    check_phase(phase)
    vals = [check_drop_frac(f, "--fracs") for f in fracs]  # before the trace is read
    _plugins(policy_file, None)
    if mode not in ("static", "closed"):
        raise UserError(f"mode {mode!r} is not static or closed.")
    t = _trace(trace)
    if (cost_model is not None or time_model == "linear") and phase != "decode":
        raise UserError(f"cost_model: time per token is modelled for decoded tokens; use phase='decode', not {phase!r}.")
    profile, _, cost_model = _time_models(t, time_model, device_profile, cost_model, foreign_cost_model)
    frame = (static_drop(t, vals, phase=phase, profile=profile) if mode == "static"
             else closed_drop(t, vals, budget_mib=_budget(budget_mib), policy=policy, phase=phase, profile=profile))
    return drop_time_columns(frame, cost_model, mode) if cost_model is not None else frame


@_api
def prefetch(trace: TraceLike, *, predictor: str = "prev-token", budget_mib: float | None = None, policy: str = "lru",
             cap: int | None = None, guard: bool = False, drop_frac: float | None = None, retain: bool = False,
             cost_model: Any = None, policy_file: Any = None, predictor_file: Any = None,
             foreign_cost_model: bool = False, time_model: str | None = None, device_profile: Any = None,
             train: str | None = None, train_trace: TraceLike | None = None, seed: int = 0,
             mix: Any = None) -> pl.DataFrame:
    """One row: speculative prefetch of ``predictor``'s guesses into the same cache at
    ``budget_mib`` (default: the recorded budget) against no prefetch and against the best plain
    online policy at that budget (``best_plain_*``). With ``cost_model``: ``ms_per_token``,
    ``tok_s`` and a ``verdict`` (``foreign_cost_model`` as in :func:`cache`). A learning predictor
    is fitted held out (``train`` / ``train_trace`` / ``seed`` / ``mix`` as in :func:`predict`) and
    guesses only for tokens it never learned from.

    ``time_model``: ``"linear"`` (``cost_model``, else one fitted on the trace's metrics),
    ``"fitted"`` (the timeline, parameters fitted on the trace's metrics) or ``"profile"`` (the
    timeline on ``device_profile``: a JSON file, a preset name, or a
    :class:`replay.analyses.timeline.Profile`). On the timeline the row carries ``useful_mib``,
    ``late_mib``, ``wasted_mib``, ``useful_lead_ms_mean``, ``lane_busy_pct``, ``stall_ms_per_token``,
    ``ms_per_token`` (each with ``_baseline``), ``delta_ms_per_token`` with its paired interval,
    ``vs_baseline_time`` and a ``verdict`` that says why (docs/design.md, "Timeline")."""
    import polars as pl

    from replay.analyses.prefetching import best_plain, with_best_plain, with_prefetch_time
    from replay.analyses.prefetching import prefetch as _prefetch

    _plugins(policy_file, predictor_file)
    t = _trace(trace)
    profile, scores, cost_model = _time_models(t, time_model, device_profile, cost_model, foreign_cost_model)
    with _mixed(mix, [predictor]):
        frame = _prefetch(t, predictor, budget_mib=_budget(budget_mib), policy=policy, cap=cap, guard=guard,
                          drop_frac=drop_frac, retain=retain, model=cost_model, profile=profile, train=train,
                          train_trace=_trace(train_trace) if train_trace is not None else None, seed=seed)
    if cost_model is not None:
        from replay.present.whatif import with_verdict

        frame = with_verdict(with_prefetch_time(frame, cost_model)).with_columns(pl.lit("linear").alias("time_model"))
    if profile is not None:
        from replay.present.whatif import with_timeline_verdict

        frame = with_timeline_verdict(frame)
        if scores is not None:
            frame = frame.with_columns(
                pl.lit(scores["timeline_wall_ms"]["mape_pct"]).alias("time_model_heldout_mape_pct"),
                pl.lit(scores["timeline_wall_ms"]["mean_err_ms"]).alias("time_model_heldout_mean_err_ms"))
    plain = best_plain(t, frame["budget_mib"][0], cost_model)
    if profile is not None and plain is not None:  # the best plain policy timed on the same timeline
        from replay.analyses.timeline import time_replay
        from replay.core.simulate import loads_of, replay

        loads = loads_of(t)
        summ = time_replay(loads, replay(loads, plain["policy"], float(frame["budget_mib"][0]), slots=True), profile).summary()
        plain = {**plain, "ms_per_token": summ["ms_per_token"], "tok_s": summ["tok_s"]}
    return with_best_plain(frame, plain)


@_api
def fit_cost_model(trace: TraceLike):
    """Fit the cost model (ms per token from expert bytes read and misses) on a trace with
    recorded engine metrics; returns the chosen :class:`replay.analyses.cost_model.CostModel` (``.row()`` is its
    docs/design.md row; :func:`cost_fit` has every candidate)."""
    from replay.analyses.cost_model import fit_trace

    return fit_trace(_trace(trace))[0]


@_api
def timeline_fit(trace: TraceLike, *, metrics: Any = None) -> dict[str, Any]:
    """Fit the timeline's device parameters (read lanes, per-lane MiB/s, per-read latency, compute per
    layer and its expert share, overlap, serial costs) on a trace's recorded per-token metrics, held
    out by alternating 8-token blocks (replay.analyses.timeline_fit). Returns a dict: ``profile`` (the
    fitted parameters), held-out ``timeline_wall_ms`` / ``timeline_io_ms`` / ``timeline_stall_ms``
    and ``linear_wall_ms`` (``mean_err_ms``, ``mape_pct``, ``corr``), the held-out run's recorded and
    predicted tok/s and whether each model reproduces it within its held-out error, ``better``.
    ``metrics``: a Polars frame of the engine's metrics for a trace imported without them."""
    from replay.analyses.timeline_fit import fit_profile

    return fit_profile(_trace(trace), metrics=metrics)[1]


@_api
def cost_fit(trace: TraceLike) -> pl.DataFrame:
    """Every candidate cost model fitted on ``trace``, one row each (``selected`` marks the chosen)."""
    from replay.analyses.cost_model import fit_trace

    best, cands, _ = fit_trace(_trace(trace))
    import polars as pl

    return pl.DataFrame([{**c.row(), "selected": c is best} for c in cands])


@_api
def load_cost_model(path: str | Path):
    """Read a cost model saved by ``moe-replay cost fit --json`` (or a bare model object)."""
    from replay.analyses.cost_model import load_cost_model as _load

    return _load(path)


@_api
def manual_cost_model(*, flash_mib_s: float, compute_ms: float):
    """A cost model from a read bandwidth (MiB/s) and a compute time per token (ms)."""
    from replay.analyses.cost_model import cost_model_from_options

    return cost_model_from_options(None, flash_mib_s, compute_ms)


@_api
def with_time(frame: pl.DataFrame, model: Any, *, trace: TraceLike = None, tokens_decode: int | None = None,
              foreign_cost_model: bool = False) -> pl.DataFrame:
    """``frame`` (rows of :func:`cache`) + ``ms_per_token``, ``tok_s``, ``ms_per_token_ci95`` and
    ``extrapolated`` under ``model``, for the decode tokens of ``trace`` (or ``tokens_decode``).
    With ``trace``, a model fitted on another model or device is refused unless
    ``foreign_cost_model`` (as in :func:`cache`); with ``tokens_decode`` alone there is no trace
    to compare with, so the caller answers for it."""
    from replay.analyses.cost_model import with_time as _with_time

    if trace is not None:
        t = _trace(trace)
        model = _applied(model, t, foreign_cost_model)
        if tokens_decode is None:
            tokens_decode = t.token_counts()["tokens_decode"]
    if tokens_decode is None:
        raise UserError("with_time: give trace= or tokens_decode= (the decoded tokens the rows cover).")
    return _with_time(frame, model, tokens_decode)


def _time_models(t: Any, time_model: str | None, device_profile: Any, cost_model: Any, foreign: bool) -> tuple[Any, Any, Any]:
    """The one resolution of a verb's time options: (the timeline profile or None, its fit scores,
    the cost model to apply or None). A timeline and a cost model are alternatives; ``linear``
    without a cost model fits one on ``t``; a given model is checked against ``t``'s origin."""
    from replay.analyses.timeline_whatif import timeline_profile

    profile, scores = timeline_profile(t, time_model, device_profile)
    if profile is not None and cost_model is not None:
        raise UserError("cost_model and a timeline time model are alternatives; give one.")
    if time_model == "linear" and cost_model is None:
        cost_model = fit_cost_model(t)
    return profile, scores, _applied(cost_model, t, foreign)


def _applied(model: Any, t: Any, foreign: bool) -> Any:
    """``model`` as it may be applied to trace ``t`` (replay.analyses.cost_origin.apply_to), or None."""
    if model is None:
        return None
    from replay.analyses.cost_origin import apply_to

    return apply_to(model, t, foreign=bool(foreign))


@_api
def write_report(trace: str | Path, out: str | Path, *, budgets_mib: Sequence[float] | None = None,
                 policies: Sequence[str] | None = None, cost_model: Any = None, force: bool = False,
                 policy_file: Any = None, predictor_file: Any = None, progress: Callable[[str], None] | None = None,
                 inputs: Sequence[Any] = (), budget_mib: float | Sequence[float] | None = None,
                 quality: str | Path | Sequence[str | Path] = (), foreign_cost_model: bool = False,
                 time_model: str | None = None, device_profile: Any = None) -> Path:
    """Write the whole report of ``trace`` (index.md, index.html, verdict.json, PNGs, tables/*.csv) into
    ``out``; returns ``out``. ``budget_mib``: the budget(s) its verdict answers for (default: the recorded one).
    ``quality``: one or more ``moe-replay quality`` results (directories or their quality.json) for the
    Quality section. ``cost_model`` fitted on another model or device: refused unless
    ``foreign_cost_model`` (then every time figure in the report is marked). ``time_model``
    ``"fitted"`` / ``"profile"`` (``device_profile``: a JSON file or preset): prefetch timed on the
    timeline, with why it wins or loses in the verdict (docs/design.md, "Timeline")."""
    from replay.analyses.report import write_report as _write
    from replay.core.simulate import check_policies
    from replay.plugin_files import _paths

    _plugins(policy_file, predictor_file)
    pols = check_policies(list(policies), option="policies") if policies is not None else None
    path = trace.path if hasattr(trace, "path") else trace
    return _write(path, out, budgets_mib=_budgets(budgets_mib) if budgets_mib is not None else None, policies=pols,
                  cost_model=cost_model, force=force, progress=progress,
                  inputs=[*inputs, *_paths(policy_file), *_paths(predictor_file)],  # the plugins too: out may not hold them
                  budget_mib=_budgets(budget_mib) if budget_mib is not None else None,
                  quality=[quality] if isinstance(quality, (str, Path)) else list(quality),
                  foreign_cost_model=foreign_cost_model, time_model=time_model, device_profile=device_profile)


def policy_names() -> list[str]:
    """Every registered cache policy (built-ins, then entry points and files added so far)."""
    from replay.policies import names

    return list(names())


def predictor_names() -> list[str]:
    """Every registered predictor family (a parametrised one, ``stale-gate``, takes ``[d]``)."""
    from replay.predictors import names

    return list(names())


@_api
def compare_run(trace_a: TraceLike, trace_b: TraceLike, *, tol: float = 1e-3, align: str = "none", phase: str = "all"):
    """:func:`compare` with everything the command prints beside the rows: a
    :class:`replay.analyses.trace_compare.CompareResult` (``.per_layer``, ``.disagreements`` with each one's
    margin and whether it is explained, ``.positions``, ``.tokens_checked``, ``.notes``)."""
    from replay.analyses.trace_compare import compare as run

    return run(_trace(trace_a), _trace(trace_b), tol=tol, align=align, phase=phase)


@_api
def compare(trace_a: TraceLike, trace_b: TraceLike, *, tol: float = 1e-3, align: str = "none",
            phase: str = "all") -> pl.DataFrame:
    """Two traces of the same prompt (two engines, two quantisations, CPU vs GPU), routing by
    routing: one row per MoE layer and the overall row (``layer`` null) with ``routings``,
    ``set_agree_pct``, ``top1_agree_pct``, ``weight_max_abs_diff``, ``weight_mean_abs_diff``,
    ``logit_max_abs_diff``, ``logit_mean_abs_diff``, ``disagreements``, ``explained`` (a near-tie:
    router margin below ``tol``) and ``unexplained``. Traces of other shapes, positions or token
    ids are refused unless ``align="step"`` (the overlap, up to the first differing token)."""
    return compare_run(trace_a, trace_b, tol=tol, align=align, phase=phase).per_layer


@_api
def profile_run(trace: TraceLike, *, phase: str = "decode", budget_mib: float | None = None,
                segment_lengths: Sequence[int] = (4, 16, 64, 256), drift_window: int = 16):
    """:func:`profile` with everything the command prints: a :class:`replay.analyses.locality.Profile`
    (``.popularity``, ``.drift``, ``.reuse``, ``.pairs``, ``.transitions``, ``.top_transitions``,
    ``.srp``, ``.sch`` frames, ``.answer`` (is this routing cacheable?), the reuse-distance
    histograms behind the plots (``.reuse_bytes_hist``, ``.reuse_steps_hist``) and the transition
    counts). ``budget_mib`` default: the recorded budget."""
    from replay.analyses.info import require_routings
    from replay.analyses.locality import profile as _profile
    from replay.core.phases import check_phase

    check_phase(phase)
    segs = [int(m) for m in segment_lengths]
    if not segs or min(segs) < 1:
        raise UserError(f"segment_lengths: {list(segment_lengths)!r} needs lengths >= 1 (tokens).")
    if int(drift_window) < 1:
        raise UserError(f"drift_window: {drift_window!r} is not >= 1 (tokens).")
    t = _trace(trace)
    require_routings(t, "profile")
    return _profile(t, phase=phase, budget_mib=_budget(budget_mib), segment_lengths=tuple(segs),
                    drift_window=int(drift_window))


@_api
def profile(trace: TraceLike, *, phase: str = "decode", budget_mib: float | None = None,
            segment_lengths: Sequence[int] = (4, 16, 64, 256), drift_window: int = 16) -> pl.DataFrame:
    """The routing's locality profile, one row per MoE layer and the pooled row (``layer`` null):
    ``routings``, ``topk_pct`` (slots on the k hottest experts), ``hot_set_80``, ``gini``, ``experts_never_routed``,
    ``hottest_vs_uniform``, ``drift_kept_pct``, ``reused_pct``, ``within_1_steps_pct``,
    ``lru_hit_pct_at_token_cycle``, ``lru_hit_pct_at_budget``, ``srp16_pct``, ``sch16_2k_pct``,
    ``cond_entropy_bits`` (docs/profile.md). :func:`profile_run` has every table behind them."""
    from replay.analyses.locality import summary

    return summary(profile_run(trace, phase=phase, budget_mib=budget_mib, segment_lengths=segment_lengths,
                               drift_window=drift_window))


@_api
def curve_run(trace: TraceLike, *, policies: Sequence[str] = ("lru", "layer"), budgets_mib: Sequence[float] | None = None,
              sample_rate: float | None = None, sample_size: int | None = None, seed: int = 0,
              tolerances_pp: Sequence[float] = (1.0, 5.0), cost_model: Any = None, foreign_cost_model: bool = False,
              loads: Any = None):
    """:func:`curve` with everything the command prints beside the rows: a
    :class:`replay.analyses.curve.Curve` (``.frame``, ``.per_layer`` (each MoE layer's own LRU curve
    at 0..n_expert entries), ``.answer`` (the budget answer: plateau, knees, the cliff below T, what
    each doubling buys), ``.token_cycle_bytes``, ``.working_set_bytes``, ``.notes``)."""
    from replay.analyses.curve import compute_curve
    from replay.analyses.info import require_routings
    from replay.core.simulate import loads_of
    from traces import open_trace
    from traces.io.reader import Trace
    from traces.util.units import budget_bytes

    if not 0 <= seed < 1 << 63:
        raise UserError(f"--seed: {seed} is not in 0..2^63-1.")
    tols = [float(x) for x in tolerances_pp]
    if not tols or any(not 0 <= x < 100 for x in tols):
        raise UserError(f"tolerances_pp {tols}: each must be in [0, 100) percentage points.")
    if loads is None and not isinstance(trace, Trace):
        # The rows are checked as loads_of reads them (one read of the trace, not two: the check at
        # open cost 0.18 s CPU on the 4.8 M-routing trace, as much as both curves); a bad row is
        # refused with the same sentence (traces.io.reader.open_trace, defer_rows).
        t = open_trace(trace, defer_rows=True)
    else:
        t = _trace(trace)
    require_routings(t, "replay")
    cost_model = _applied(cost_model, t, foreign_cost_model)
    blist = _budgets(budgets_mib) if budgets_mib is not None else []
    loads = loads if loads is not None else loads_of(t)
    res = compute_curve(loads, policies=tuple(policies), budgets_bytes=[budget_bytes(b) for b in blist],
                        sample_rate=sample_rate, sample_size=sample_size, seed=seed, tolerances_pp=tuple(tols))
    if cost_model is not None and res.frame.height:
        res.frame = with_time(res.frame, cost_model, trace=t, foreign_cost_model=foreign_cost_model)
    return res


@_api
def curve(trace: TraceLike, *, policies: Sequence[str] = ("lru", "layer"), budgets_mib: Sequence[float] | None = None,
          sample_rate: float | None = None, sample_size: int | None = None, seed: int = 0,
          tolerances_pp: Sequence[float] = (1.0, 5.0), cost_model: Any = None,
          foreign_cost_model: bool = False) -> pl.DataFrame:
    """The hit-rate curve in one pass, exactly equal to replaying each budget: ``lru`` (global) and
    ``layer`` (the budget split equally over the MoE layers) at every budget where the curve
    changes, from the smallest to the working set, plus ``budgets_mib``; ``layer-opt`` (the best
    per-layer LRU partition) at ``budgets_mib`` only. One row per (policy, budget) with the cache
    rows' keys (``budget_mib``, ``hit_pct_decode``, ``hit_pct_cum``, ``read_mib``,
    ``overflow_loads``, ``over_budget``, ...; no ``peak_resident_mib`` or ``evictions``: the
    curve does not track them) plus ``requested`` (a budget of ``budgets_mib``) and ``sampled``.
    ``sample_rate`` (0-1] or ``sample_size`` (entries): SHARDS sampling of ``lru``'s entries,
    seeded by ``seed`` (estimates; overflow marks stay exact). With ``cost_model``:
    ``ms_per_token`` and ``tok_s`` as in :func:`cache`. ``belady`` has no one-pass curve (refused,
    with why). :func:`curve_run` also returns each layer's own curve and the budget answer."""
    return curve_run(trace, policies=policies, budgets_mib=budgets_mib, sample_rate=sample_rate, sample_size=sample_size,
                     seed=seed, tolerances_pp=tolerances_pp, cost_model=cost_model,
                     foreign_cost_model=foreign_cost_model).frame
