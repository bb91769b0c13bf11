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
    param = getattr(mod, "PARAM", None)
    try:  # describe() fills it in for every name: a stray {field} would fail there, not here
        mod.DESCRIPTION.format(**({param: 1} if isinstance(param, str) and param else {}))
    except (KeyError, IndexError, ValueError) as e:
        fields = f"{{{param}}}, the parameter" if isinstance(param, str) and param else "none (the predictor takes no parameter)"
        raise UserError(f"{src}: DESCRIPTION {mod.DESCRIPTION!r} is not a format string whose only field is {fields} "
                        f"({type(e).__name__}: {e}; write a literal brace as {{{{ or }}}}).") from None
    issue = getattr(mod, "ISSUE", "token")
    if issue not in ("token", "layer"):
        raise UserError(f"{src}: ISSUE {issue!r} is not \"token\" or \"layer\" (when its guesses can be read on the timeline).")
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
        mod = module(fam)
        problem = None
        if getattr(mod, "param_problem", None) is not None:
            problem = _sentence_or_none(mod, "param_problem", name, call_hook(mod, "param_problem", name, d),
                                        "why the parameter is refused")
        if problem:
            raise UserError(f"{option} {name}: {problem}.")
        return fam, d
    if name in fams:
        return name, None
    raise UserError(f"{option}: unknown predictor {name!r} (known: {known_text()}).")


def full_name(family: str, param: int | None) -> str:
    return f"{family}[{param}]" if param is not None else family


def call_hook(mod: ModuleType, hook: str, name: str, *args, **kwargs):
    """``mod.<hook>(*args, **kwargs)`` for the predictor ``name``. A user plugin's failure there (an
    exception, a Numba function that does not compile or raises) is one sentence naming its file,
    the line when known, the hook and the problem (:func:`plugin_error`); the traceback only under
    --debug, as the cause. A built-in's failure is a bug of this package and passes through."""
    fn = getattr(mod, hook)
    if mod.__name__.startswith("replay."):
        return fn(*args, **kwargs)
    try:
        return fn(*args, **kwargs)
    except UserError:
        raise
    except Exception as e:
        raise plugin_error(mod, name, e, hook) from e


def _sentence_or_none(mod: ModuleType, hook: str, name: str, value, meaning: str) -> str | None:
    """A hook's answer that must be a sentence or None (``unavailable``, ``check``, ``param_problem``,
    ``note``): anything else is refused, not printed as a reason (``unavailable`` returning 3 would
    otherwise mark the predictor unavailable "because 3")."""
    if value is None or isinstance(value, str):
        return value or None
    raise UserError(f"{where(mod)}: {hook}() for {name} returned {type(value).__name__} {_short(value)}, not a "
                    f"str ({meaning}) or None.")


def _short(value) -> str:
    r = repr(value)
    return r if len(r) <= 40 else r[:37] + "..."


def unavailable(family: str, trace) -> str | None:
    """Why predictor ``family`` cannot run on ``trace`` (its ``unavailable`` hook), or None."""
    mod = module(family)
    if getattr(mod, "unavailable", None) is None:
        return None
    return _sentence_or_none(mod, "unavailable", family, call_hook(mod, "unavailable", family, trace),
                             "why it cannot run on this trace")


def check(family: str, trace, param: int | None) -> str | None:
    """Why ``family[param]`` cannot run on ``trace`` (its ``check`` hook), or None."""
    mod = module(family)
    if getattr(mod, "check", None) is None or param is None:
        return None
    n = full_name(family, param)
    return _sentence_or_none(mod, "check", n, call_hook(mod, "check", n, trace, param),
                             "why it cannot run on this trace with this parameter")


def note(family: str, trace, arr, in_phase) -> str | None:
    """The line predictor ``family`` prints beside its figures (its ``note`` hook), or None."""
    mod = module(family)
    if getattr(mod, "note", None) is None:
        return None
    return _sentence_or_none(mod, "note", family, call_hook(mod, "note", family, trace, arr, in_phase),
                             "a note printed beside its figures")


MAX_AHEAD = (1 << 15) - 1  # layers are int16: no guess can be further ahead than that


def ahead(family: str, param: int | None) -> int:
    """MoE layers ahead of its layer the guess of ``family[param]`` exists (its ``ahead`` hook,
    default 1): an integer in 1..32767, checked here before a replay indexes loads with it."""
    import numpy as np

    mod = module(family)
    if getattr(mod, "ahead", None) is None:
        return 1
    n = full_name(family, param)
    got = call_hook(mod, "ahead", n, param)
    if isinstance(got, bool) or not isinstance(got, (int, np.integer)) or not 1 <= int(got) <= MAX_AHEAD:
        raise UserError(f"{where(mod)}: ahead() for {n} returned {type(got).__name__} {_short(got)}, not an integer "
                        f"number of MoE layers in 1..{MAX_AHEAD}.")
    return int(got)


def describe(name: str) -> str:
    fam, d = parse_predictor(name)
    mod = module(fam)
    return mod.DESCRIPTION.format(**({mod.PARAM: d} if getattr(mod, "PARAM", None) else {}))


def as_prediction(mod: ModuleType, name: str, out, n_rows: int, width: int, n_expert: int,
                  in_phase: np.ndarray, hook: str = "predict") -> Prediction:
    """A hook's return value checked (type, shape, dtype, the range of every expert id, the
    weights' dtype and range) and made a :class:`Prediction`, before anything indexes memory with
    it (the replay reads expert ids as entry indices); a wrong one is one sentence naming the
    module's file and the ``hook`` that returned it."""
    import numpy as np

    src = where(mod)
    said = f"{src}: {hook}() for {name} returned"
    weights = None
    if isinstance(out, Prediction):
        out, weights = out.ranked, out.weights
    elif isinstance(out, tuple) and len(out) == 2:
        out, weights = out
    if not isinstance(out, np.ndarray):
        raise UserError(f"{said} {type(out).__name__}, not an int32 numpy array [{n_rows}, {width}].")
    if out.shape != (n_rows, width):
        raise UserError(f"{said} shape {list(out.shape)}, expected [{n_rows}, {width}] (routings x width).")
    if out.dtype != np.int32:
        raise UserError(f"{said} dtype {out.dtype}, expected int32.")
    if out.size and (int(out.min()) < NONE or int(out.max()) >= n_expert):
        raise UserError(f"{said} expert ids outside -1..{n_expert - 1} (-1 = no guess; the trace has {n_expert} experts).")
    if weights is not None:
        if not isinstance(weights, np.ndarray) or weights.shape != (n_rows, width):
            got = f"shape {list(weights.shape)}" if isinstance(weights, np.ndarray) else type(weights).__name__
            raise UserError(f"{said} weights of {got}, not a float array [{n_rows}, {width}].")
        if not np.issubdtype(weights.dtype, np.floating):
            raise UserError(f"{said} weights of dtype {weights.dtype}, not a float array (NaN = unknown).")
        known = weights[~np.isnan(weights)]
        if known.size and not (np.isfinite(known).all() and float(known.min()) >= 0):
            raise UserError(f"{said} weights that are negative or infinite (a predicted routing weight is >= 0; "
                            "NaN = unknown).")
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
            names = [full_name(f2, d2) for f2, d2 in shared[id(many)][1]]
            got = call_hook(mod, "predict_many", ", ".join(names), trace, arr, in_phase, width, shared[id(many)][1],
                            progress=progress, with_weights=with_weights)
            missing = [n for n in names if not isinstance(got, dict) or n not in got]
            if missing:
                what = (f"{type(got).__name__}, not a dict" if not isinstance(got, dict)
                        else f"a dict without {', '.join(repr(n) for n in missing)}")
                raise UserError(f"{where(mod)}: predict_many() for {', '.join(names)} returned {what} (one "
                                "[routings, width] int32 array per requested name).")
            for (f2, _), n in zip(shared[id(many)][1], names):
                out[n] = keep_evaluated(as_prediction(module(f2), n, got[n], arr.n_rows, width, trace.n_expert, in_phase,
                                                      "predict_many"))
            continue
        kw = {"param": d} if getattr(mod, "PARAM", None) else {}
        if with_weights and getattr(mod, "WEIGHTS", False):
            kw["with_weights"] = True
        n = full_name(fam, d)

        def call(phase_rows, mod=mod, kw=kw, n=n, **extra):
            return call_hook(mod, "predict", n, trace, arr, phase_rows, width, **kw, **extra)

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


def plugin_error(mod: ModuleType, name: str, e: Exception, hook: str = "predict") -> UserError:
    """A user predictor whose ``hook`` raised: one sentence naming its file, the line (of the plugin's
    own code, when the error names or passes through one) and the problem (the traceback only under
    --debug, as the cause). A Numba function of the plugin that does not compile is said as a policy
    plugin's is (:func:`replay.plugins.numba_error`): the underlying error at its line, not Numba's
    pipeline header and its "During:" lines."""
    import sys

    src = where(mod)
    errors = sys.modules.get("numba.core.errors")  # loaded whenever Numba raised
    if errors is not None and isinstance(e, errors.NumbaError):
        from replay.plugins import numba_error

        line, what = numba_error(e, src)
        at = src + (f", line {line}" if line is not None else "")
        return UserError(f"{at}: predictor {name!r} does not compile with Numba in {hook}(): {what}.")
    line = _line_in(e, src)
    at = src + (f", line {line}" if line is not None else "")
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.startswith("\x1b")), "")
    said = f"{type(e).__name__}: {first[:200]}" if first else type(e).__name__
    return UserError(f"{at}: {hook}() for {name} failed: {said.rstrip('.')}.")


def _line_in(e: BaseException, path: str) -> int | None:
    """The line of ``path`` nearest the raise in ``e``'s traceback (None when none of its frames is
    in that file: a Numba function's own lines are not frames)."""
    import traceback

    try:
        target = Path(path).resolve()
    except OSError:
        return None
    line = None
    for fr in traceback.extract_tb(e.__traceback__):
        try:
            if Path(fr.filename).resolve() == target:
                line = fr.lineno
        except OSError:
            continue
    return line


def learns(family: str) -> bool:
    """True when the predictor is fitted on a training split (``LEARNS``, or a composite that may hold one)."""
    m = module(family)
    return bool(getattr(m, "LEARNS", False) or getattr(m, "SPLIT", False))


__all__ = ["ENTRY_POINT_GROUP", "NONE", "REGISTRY", "Prediction", "add_predictor_file", "describe", "module", "names",
           "parse_predictor", "prefetch_names", "run"]
