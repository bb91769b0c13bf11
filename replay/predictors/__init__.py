"""Expert predictors: each names, per (token, MoE layer) routing, a ranked list of experts — or
says it cannot ("unscored"). One small module per predictor behind the same hooks, found through
:data:`REGISTRY` (built-ins), ``predictor_file=`` / ``--predictor-file`` (a module anywhere on
disk) and the entry-point group ``moe_replay.predictors``; :mod:`replay.analyses.accuracy` scores them,
:mod:`replay.analyses.prefetching` reads their guesses into the cache, and the report lists them.

A predictor module defines (docs/design.md, "Plugins"):

- ``NAME`` (str): the name users type (``stale-gate``); ``DESCRIPTION`` (str): what its figure
  measures, one line (``{d}`` is replaced by the parameter of a parametrised predictor);
- ``predict(trace, arr, in_phase, width)`` -> int32 ``[routings, width]``: expert ids best first
  for every row of ``arr`` (:class:`traces.io.reader.RoutingArrays`); ``-1`` = no guess; a row
  whose first guess is -1 (or outside ``in_phase``) is unscored, never "wrong". It may return
  ``(ranked, weights)`` with float32 predicted routing weights per rank (NaN unknown), which
  ``prefetch --drop`` uses;

and optionally ``PARAM = "d"`` (the name takes ``[int]``: ``stale-gate[2]``; ``predict`` gets
``param=``), ``unavailable(trace) -> str | None`` (why it cannot run on this trace),
``param_problem(value) -> str | None``, ``check(trace, value) -> str | None``,
``ahead(value) -> int`` (MoE layers ahead its guess exists, default 1), ``PREFETCH = False``
(not a prefetch predictor), ``REPORT = False`` (left out of the report), ``ORACLE = True`` (it has
seen the answers: never the report's "best predictor"), ``WEIGHTS = True``
(``predict`` accepts ``with_weights=``), ``note(trace, arr, in_phase) -> str | None``, and
``predict_many(...)`` (several names computed in one pass; see :mod:`.gate`).

Built-ins:

- :mod:`.prev_token` — what this layer routed for the previous token of the turn;
- :mod:`.stale_gate` — layer l's router on the gate input of the MoE layer d places earlier, and
  :mod:`.ctrl` — layer l's router on its own gate input (must reproduce the routing);
- :mod:`.static_hot`, :mod:`.static_hot_prompt` — the layer's most-routed experts (learned on the
  training split, or from the prompt only);
- learners fitted on a training split and scored on tokens they never saw (:mod:`.training`):
  :mod:`.pair_table` (``pair-table[d]``), :mod:`.request_match`, :mod:`.learned_gate`
  (``learned-gate[d]``), and :mod:`.mix`, a weighted union of two predictors.
"""

from __future__ import annotations

import contextvars
import re
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from replay.plugins import Registry, where
from replay.predictors.base import NONE, Prediction
from traces.format.errors import UserError

if TYPE_CHECKING:  # imported where used: ``moe-replay --help`` lists the names without NumPy
    import numpy as np

REGISTRY: dict[str, str] = {
    "prev-token": "replay.predictors.prev_token",
    "stale-gate": "replay.predictors.stale_gate",
    "ctrl": "replay.predictors.ctrl",
    "static-hot": "replay.predictors.static_hot",
    "static-hot-prompt": "replay.predictors.static_hot_prompt",
    "pair-table": "replay.predictors.pair_table",
    "request-match": "replay.predictors.request_match",
    "learned-gate": "replay.predictors.learned_gate",
    "mix": "replay.predictors.mix",
}
ENTRY_POINT_GROUP = "moe_replay.predictors"

# The file predictors the running call named (predictor_file=): they join the default lists for that call only, so
# a file registered by an earlier call does not change a later call's defaults.
active_files: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("moe_replay_predictor_files", default=())
_PARAM = re.compile(r"^(.+)\[(\d+)\]$")


def _validate(mod: ModuleType, name: str | None) -> str:
    """The module's name, or one sentence naming the file and what is missing."""
    src = where(mod)
    got = getattr(mod, "NAME", None)
    if not isinstance(got, str) or not got:
        raise UserError(f"{src}: a predictor module must define NAME, the predictor's name (a non-empty string).")
    if name is not None and got != name:
        raise UserError(f"{src}: NAME is {got!r} but the module is registered as {name!r}.")
    if not callable(getattr(mod, "predict", None)) and not callable(getattr(mod, "predict_many", None)):
        raise UserError(f"{src}: a predictor module must define predict(trace, arr, in_phase, width) returning "
                        "int32 guesses [routings, width].")
    if not isinstance(getattr(mod, "DESCRIPTION", None), str):
        raise UserError(f"{src}: a predictor module must define DESCRIPTION, one line saying what it predicts.")
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", got):
        raise UserError(f"{src}: NAME {got!r} may hold only letters, digits and _ . + -.")
    return got


# Every loaded predictor, by name, in registration order; REG.from_files: names registered from a file
# (predictor_file=): in default lists only while asked for.
REG = Registry("predictor", REGISTRY, ENTRY_POINT_GROUP, _validate)


def add_predictor_file(path: str | Path) -> str:
    """Register the predictor module in file ``path``; returns its name."""
    return REG.add_file(path)


def names() -> tuple[str, ...]:
    """Every registered predictor family, built-ins first (the default list and the help text)."""
    return REG.names()


def module(family: str) -> ModuleType:
    return REG.module(family)


def known_text() -> str:
    fams = names()
    return ", ".join(fams) + "".join(f", {f}[{module(f).PARAM}]" for f in fams if getattr(module(f), "PARAM", None))


def prefetch_names() -> tuple[str, ...]:
    """Names usable by prefetch and retention, parametrised ones as ``name[d]``."""
    return tuple(f"{f}[{module(f).PARAM}]" if getattr(module(f), "PARAM", None) else f
                 for f in names() if getattr(module(f), "PREFETCH", True))


def default_names() -> tuple[str, ...]:
    """The default predictor list: built-ins and entry points, plus the files the running call
    named (:data:`active_files`)."""
    active = set(active_files.get())
    return tuple(n for n in names() if n not in REG.from_files or n in active)


def report_predictors() -> list[str]:
    """The predictors the report's accuracy section evaluates: the default list without
    ``REPORT = False``."""
    return [f for f in default_names() if getattr(module(f), "REPORT", True)]


def report_prefetch_predictors() -> list[tuple[str, str]]:
    """(family, name) of the report's prefetch rows: modules with ``REPORT_PREFETCH`` set (True, or
    the parameter to show for a parametrised one): the plain ones first, then the parametrised
    (router) ones, each in registry order."""
    out = []
    for f in sorted(default_names(), key=lambda f: bool(getattr(module(f), "PARAM", None))):
        v = getattr(module(f), "REPORT_PREFETCH", False)
        if v is not False and v is not None:
            out.append((f, full_name(f, v) if getattr(module(f), "PARAM", None) else f))
    return out


def parse_predictor(name: str, option: str = "--predictors") -> tuple[str, int | None]:
    """``'stale-gate[2]'`` -> ``('stale-gate', 2)``; ``'ctrl'`` -> ``('ctrl', None)``; bad -> UserError
    naming ``option``, the flag or parameter the name came from."""
    name = name.strip()
    fams = names()
    m = _PARAM.match(name)
    if m and m.group(1) in fams and getattr(module(m.group(1)), "PARAM", None):
        fam, d = m.group(1), int(m.group(2))
        check = getattr(module(fam), "param_problem", None)
        problem = check(d) if check is not None else None
        if problem:
            raise UserError(f"{option} {name}: {problem}.")
        return fam, d
    if name in fams:
        return name, None
    raise UserError(f"{option}: unknown predictor {name!r} (known: {known_text()}).")


def full_name(family: str, param: int | None) -> str:
    return f"{family}[{param}]" if param is not None else family


def unavailable(family: str, trace) -> str | None:
    f = getattr(module(family), "unavailable", None)
    return f(trace) if f is not None else None


def check(family: str, trace, param: int | None) -> str | None:
    f = getattr(module(family), "check", None)
    return f(trace, param) if f is not None and param is not None else None


def ahead(family: str, param: int | None) -> int:
    f = getattr(module(family), "ahead", None)
    return int(f(param)) if f is not None else 1


def describe(name: str) -> str:
    fam, d = parse_predictor(name)
    mod = module(fam)
    return mod.DESCRIPTION.format(**({mod.PARAM: d} if getattr(mod, "PARAM", None) else {}))


def as_prediction(mod: ModuleType, name: str, out, n_rows: int, width: int, n_expert: int,
                  in_phase: np.ndarray) -> Prediction:
    """A hook's return value checked (shape, dtype, range) and made a :class:`Prediction`; a
    wrong one is one sentence naming the module's file."""
    import numpy as np

    src = where(mod)
    weights = None
    if isinstance(out, Prediction):
        out, weights = out.ranked, out.weights
    elif isinstance(out, tuple) and len(out) == 2:
        out, weights = out
    if not isinstance(out, np.ndarray):
        raise UserError(f"{src}: predict() for {name} returned {type(out).__name__}, not an int32 numpy array "
                        f"[{n_rows}, {width}].")
    if out.shape != (n_rows, width):
        raise UserError(f"{src}: predict() for {name} returned shape {list(out.shape)}, expected [{n_rows}, {width}] "
                        "(routings x width).")
    if out.dtype != np.int32:
        raise UserError(f"{src}: predict() for {name} returned dtype {out.dtype}, expected int32.")
    if out.size and (int(out.min()) < NONE or int(out.max()) >= n_expert):
        raise UserError(f"{src}: predict() for {name} returned expert ids outside -1..{n_expert - 1} "
                        f"(-1 = no guess; the trace has {n_expert} experts).")
    if weights is not None:
        if not isinstance(weights, np.ndarray) or weights.shape != (n_rows, width):
            raise UserError(f"{src}: predict() for {name} returned weights that are not a float array [{n_rows}, {width}].")
        weights = weights.astype(np.float32, copy=False)
    scored = in_phase & (out[:, 0] != NONE) if width else np.zeros(n_rows, dtype=bool)
    return Prediction(name, np.ascontiguousarray(out), scored, weights)


def run(trace, arr, in_phase: np.ndarray, width: int, requested: list[tuple[str, int | None]], progress=None,
        with_weights: bool = False, split=None) -> dict[str, Prediction]:
    """{full name: Prediction} for ``requested`` (family, param) pairs. Modules sharing one
    ``predict_many`` hook are computed in one call (the router predictors' single pass over the
    gate inputs).

    ``split`` (:class:`replay.predictors.training.Split`): the held-out protocol. A learner
    (``LEARNS``) is fitted once per fold on the fold's training rows and its guesses kept for the
    fold's evaluated rows only; every prediction is scored on ``split.evaluated`` only, so no
    training token is ever scored. None: no learner may run (one is refused)."""
    import numpy as np

    out: dict[str, Prediction] = {}
    shared: dict[int, tuple[object, list[tuple[str, int | None]]]] = {}
    for fam, d in requested:
        many = getattr(module(fam), "predict_many", None)
        if many is not None:
            shared.setdefault(id(many), (many, []))[1].append((fam, d))
    evaluated = split.evaluated if split is not None else None

    def keep_evaluated(p: Prediction) -> Prediction:
        return p if evaluated is None else Prediction(p.name, p.ranked, p.scored & evaluated, p.weights)

    done = set()
    for fam, d in requested:
        mod = module(fam)
        many = getattr(mod, "predict_many", None)
        if many is not None:
            if id(many) in done:
                continue
            done.add(id(many))
            got = many(trace, arr, in_phase, width, shared[id(many)][1], progress=progress, with_weights=with_weights)
            for f2, d2 in shared[id(many)][1]:
                n = full_name(f2, d2)
                out[n] = keep_evaluated(as_prediction(module(f2), n, got[n], arr.n_rows, width, trace.n_expert, in_phase))
            continue
        kw = {"param": d} if getattr(mod, "PARAM", None) else {}
        if with_weights and getattr(mod, "WEIGHTS", False):
            kw["with_weights"] = True
        n = full_name(fam, d)

        def call(phase_rows, mod=mod, kw=kw, n=n, **extra):
            try:
                return mod.predict(trace, arr, phase_rows, width, **kw, **extra)
            except UserError:
                raise
            except Exception as e:
                if mod.__name__.startswith("replay."):
                    raise
                raise plugin_error(mod, n, e) from e

        if getattr(mod, "SPLIT", False):  # a composite (mix): runs its parts under the same protocol
            out[n] = keep_evaluated(as_prediction(mod, n, call(in_phase, split=split), arr.n_rows, width,
                                                  trace.n_expert, in_phase))
        elif getattr(mod, "LEARNS", False):
            if split is None:
                raise UserError(f"{n} learns from the trace: it needs a training split (a held-out protocol).")
            ranked = np.full((arr.n_rows, width), NONE, np.int32)
            scored = np.zeros(arr.n_rows, bool)
            weights = None
            for training, ev in split.folds:
                p = as_prediction(mod, n, call(ev, training=training), arr.n_rows, width, trace.n_expert, ev)
                ranked[ev] = p.ranked[ev]
                scored[ev] = p.scored[ev]
                if p.weights is not None:
                    weights = np.full((arr.n_rows, width), np.nan, np.float32) if weights is None else weights
                    weights[ev] = p.weights[ev]
            out[n] = keep_evaluated(Prediction(n, ranked, scored, weights))
        else:
            out[n] = keep_evaluated(as_prediction(mod, n, call(in_phase), arr.n_rows, width, trace.n_expert, in_phase))
    return out


def plugin_error(mod: ModuleType, name: str, e: Exception) -> UserError:
    """A user predictor whose ``predict`` raised: one sentence naming its file (the traceback only
    under --debug, as the cause). A Numba function of the plugin that does not compile is said as a
    policy plugin's is (:func:`replay.plugins.numba_error`): the underlying error at its line, not
    Numba's pipeline header and its "During:" lines."""
    import sys

    errors = sys.modules.get("numba.core.errors")  # loaded whenever Numba raised
    if errors is not None and isinstance(e, errors.NumbaError):
        from replay.plugins import numba_error

        line, what = numba_error(e, where(mod))
        at = where(mod) + (f", line {line}" if line is not None else "")
        return UserError(f"{at}: predictor {name!r} does not compile with Numba: {what}.")
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.startswith("\x1b")), "")
    said = f"{type(e).__name__}: {first[:200]}" if first else type(e).__name__
    return UserError(f"{where(mod)}: predict() for {name} failed: {said.rstrip('.')}.")


def learns(family: str) -> bool:
    """True when the predictor is fitted on a training split (``LEARNS``, or a composite that may hold one)."""
    m = module(family)
    return bool(getattr(m, "LEARNS", False) or getattr(m, "SPLIT", False))


__all__ = ["ENTRY_POINT_GROUP", "NONE", "REGISTRY", "Prediction", "add_predictor_file", "describe", "module", "names",
           "parse_predictor", "prefetch_names", "run"]
