"""Sweeps: one TOML grid of traces x analyses x parameters, computed as independent cells on a
local process pool or a Ray cluster, kept in RESULTS as Parquet tables (docs/design.md, "sweep").

A *cell* is one call of a public API function (:mod:`replay.api`) on one trace with one set of
keyword arguments; its rows are exactly that function's rows (what the verb's ``--json`` prints).
Nothing here analyses anything: a worker opens the trace from its path and calls the API.

Layout of RESULTS::

    sweep.json            what the last sweep did (grid, engine, cells, tables); "complete": false while one runs
    grid.toml             a copy of the grid the tables were made from
    <kind>.parquet        one table per analysis kind of the grid (cache, predict, drop, prefetch, retention, curve,
                          profile)
    chunks/NNNNNN.parquet the cell store: one atomically written file per finished batch of cells
                          (compacted into one file when a sweep ends)
    .lock                 held (flock) while a sweep writes: a second sweep on the same RESULTS refuses

Each cell is keyed by sha256 of (trace content id, kind, parameters with the content of any file
they name, tool version): a rerun computes only the cells the store lacks (``force`` recomputes
them; the newest chunk wins). A chunk is written atomically as soon as its batch finishes, so an
interrupted sweep keeps every finished batch. The tables are rebuilt from the store in grid order
(traces as listed, globs sorted; then each kind's keys in the order the grid lists them, crossed),
so the local pool and Ray write byte-identical tables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import glob
import hashlib
import io
import itertools
import json
import math
import os
import re
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from replay.api import _api
from traces.format.errors import UserError
from traces.io.digest import sha256_file, trace_content_id
from traces.util.units import parse_budget_mib

FORMAT = "moe-replay-sweep"
KIND_ORDER = ("cache", "predict", "drop", "prefetch", "retention", "curve", "profile")

EXAMPLE = '''\
# moe-replay sweep grid (TOML). Run: moe-replay sweep THIS.toml -o RESULTS
# Relative paths are relative to this file's folder.
traces = ["runs/qwen", "runs/*-batch8"]   # trace directories or globs (each glob must match)

# One table per analysis kind; each key is a keyword argument of that replay.<function>
# (cache, predict, drop, prefetch, curve, profile; retention = replay.retain). A list is crossed: one cell per
# combination. The plural spellings below (policies, budgets_mib, predictors, modes, caps, ...)
# are the lists of the singular keyword.

[cache]                                   # replay.cache: one cell per (policy, budget)
policies = ["lru", "lfu", "belady"]
budgets_mib = [1000, 2000, 4000]
# per_layer = true                        # also one row per MoE layer
# cost_model = "qwen-cost.json"           # a 'cost fit --json' file: adds ms_per_token and tok_s

[predict]                                 # replay.predict: one cell per predictor
predictors = ["prev-token", "stale-gate"] # a bare stale-gate is one cell per horizon
horizons = [1, 2]

[drop]                                    # replay.drop: one cell per (mode, policy, budget); the
modes = ["closed"]                        # fracs are the drop table's own rows (one cell holds all,
fracs = [0.5, 0.75, 1.0]                  # with the top-k cut beside them, as 'moe-replay drop')
policies = ["lru"]
budgets_mib = [4000]

[prefetch]                                # replay.prefetch: one row per cell
predictors = ["prev-token"]
budgets_mib = [2000, 4000]
caps = [2]

[retention]                               # replay.retain: guesses protected from eviction
predictors = ["prev-token"]
policies = ["lru"]
budgets_mib = [2000]

[curve]                                   # replay.curve: one cell per policy, its whole curve in one pass
policies = ["lru", "layer"]               # (every budget where it changes, each equal to a replay there)

[profile]                                 # replay.profile: one cell per trace (x budget, x phase), its rows
budgets_mib = [4000]                      # the per-layer and pooled locality summary; the pooled row also
                                          # holds the cacheability answer at the budget (answer_*)
'''


# --- the analysis kinds ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Kind:
    """How a grid table becomes cells of one API function."""

    name: str
    function: str  # the replay.api function a cell calls
    split: dict[str, str]  # the API's list keywords crossed one element per cell: list keyword -> cell parameter
    plural: dict[str, str]  # grid spellings of a singular keyword's list: plural -> keyword
    refused: dict[str, str]  # API keywords a grid may not set -> why


# The timeline's axes (replay.analyses.timeline_whatif): device profiles (files or preset names) and time models.
_TIME_AXES = {"device_profiles": "device_profile", "time_models": "time_model"}
_COMMON_REFUSED = {"trace": "the traces are the grid's top-level 'traces' list", "loads": "internal",
                   "show_progress": "the sweep has its own progress bar", "progress": "the sweep has its own progress bar"}
KINDS: dict[str, Kind] = {
    "cache": Kind("cache", "cache", {"policies": "policy", "budgets_mib": "budget_mib"}, _TIME_AXES,
                  {**_COMMON_REFUSED, "retain_predictor": "use a [retention] table"}),
    "predict": Kind("predict", "predict_run", {"predictors": "predictor"}, {},
                    {**_COMMON_REFUSED, "max_horizon": "list the horizons instead (predictors = ['stale-gate'], "
                     "horizons = [1, 2, ...])"}),
    "drop": Kind("drop", "drop", {}, {"modes": "mode", "policies": "policy", "budgets_mib": "budget_mib",
                                      "phases": "phase", "cost_models": "cost_model"}, dict(_COMMON_REFUSED)),
    "prefetch": Kind("prefetch", "prefetch", {}, {"predictors": "predictor", "policies": "policy", "budgets_mib": "budget_mib",
                                                  "caps": "cap", "drop_fracs": "drop_frac", "cost_models": "cost_model",
                                                  **_TIME_AXES},
                     dict(_COMMON_REFUSED)),
    "retention": Kind("retention", "retain", {"policies": "policy", "budgets_mib": "budget_mib"},
                      {"predictors": "predictor"}, dict(_COMMON_REFUSED)),
    "curve": Kind("curve", "curve", {"policies": "policy"}, {"budgets_mib": "budget_mib", "sample_rates": "sample_rate",
                                                             "cost_models": "cost_model"},
                  {**_COMMON_REFUSED, "tolerances_pp": "the budget answer is the verb's and the API's, not a table's"}),
    "profile": Kind("profile", "profile", {}, {"budgets_mib": "budget_mib", "phases": "phase",
                                               "drift_windows": "drift_window"},
                    {**_COMMON_REFUSED, "segment_lengths": "a [profile] row holds SRP and SCH at 16-token segments; the "
                     "other lengths are the verb's (moe-replay profile --segments)"}),
}
_FILE_KEYS = ("cost_model", "policy_file", "predictor_file")
#: ``--workers`` is refused beyond this many local workers per core (a typo, not a pool).
MAX_WORKERS_PER_CORE = 4  # values are paths: their bytes enter the cell key


def _api_keywords(kind: Kind) -> dict[str, Any]:
    """The API function's keyword arguments and their defaults (what a grid key may name)."""
    import inspect

    from replay import api

    fn = inspect.unwrap(getattr(api, kind.function))
    return {n: p.default for n, p in inspect.signature(fn).parameters.items() if p.kind == p.KEYWORD_ONLY}


@dataclasses.dataclass
class Cell:
    kind: str
    trace: str  # the trace's path as the grid names it (glob matches: as the glob wrote them)
    path: str  # absolute path the workers open
    trace_id: str
    params: dict[str, Any]  # the cell's keyword arguments (one value each), in grid order
    key: str = ""
    index: int = 0  # position in grid order


@dataclasses.dataclass
class Grid:
    file: Path
    traces: list[tuple[str, str]]  # (as named, absolute path)
    kinds: dict[str, list[dict[str, Any]]]  # kind -> parameter sets in grid order
    text: str


# --- reading and checking a grid -------------------------------------------------------------


def _where(grid: Path, kind: str | None, key: str | None) -> str:
    return f"{grid}: " + (f"[{kind}] " if kind else "") + (f"{key}" if key else "")


def _check_value(kind: str, key: str, v: Any, default: Any, where: str, base: Path) -> Any:
    """One value of keyword ``key``, checked as far as can be without a trace; paths made absolute."""
    from replay.core.phases import PHASES
    from replay.core.simulate import check_policies

    if key in ("budget_mib",):
        return None if v is None else parse_budget_mib(v, where)  # a number of MiB, or a string with a binary unit ("4GiB")
    if key == "policy":
        if not isinstance(v, str):
            raise UserError(f"{where}: {v!r} is not a policy name.")
        return check_policies([v], option=where)[0]
    if key == "phase":
        if v not in PHASES:
            raise UserError(f"{where}: {v!r} is not one of {', '.join(PHASES)}.")
        return v
    if key == "mode":
        if v not in ("static", "closed"):
            raise UserError(f"{where}: {v!r} is not static or closed.")
        return v
    if key == "time_model":
        from replay.analyses.timeline_whatif import TIME_MODELS

        if v not in TIME_MODELS:
            raise UserError(f"{where}: {v!r} is not one of {', '.join(TIME_MODELS)}.")
        return v
    if key == "device_profile":  # a preset's name, else a profile file (its bytes enter the cell key)
        from replay.analyses.timeline_fit import PRESETS

        return v if isinstance(v, str) and v in PRESETS else _check_value(kind, "cost_model", v, None, where, base)
    if key in ("policy_file", "predictor_file"):  # a list registers every file: one value, not crossed
        files = v if isinstance(v, list) else [v]
        return [_check_value(kind, "cost_model", f, None, where, base) for f in files]
    if key in _FILE_KEYS:
        if not isinstance(v, str) or not v.strip():
            raise UserError(f"{where}: {v!r} is not a file path.")
        p = (base / v).resolve() if not Path(v).is_absolute() else Path(v)
        if not p.is_file():
            raise UserError(f"{where}: {v!r} is not a file (relative paths are relative to the grid's folder).")
        return str(p)
    if key == "predictor":
        from replay.analyses.accuracy import expand

        if not isinstance(v, str):
            raise UserError(f"{where}: {v!r} is not a predictor name.")
        return expand([v], [1], option=where)[0]
    if key == "policy_options":
        if not isinstance(v, dict):
            raise UserError(f"{where}: expected a table like {{pin = {{per_layer = 4}}}}.")
        return v
    if isinstance(default, bool):
        if not isinstance(v, bool):
            raise UserError(f"{where}: {v!r} is not true or false.")
        return v
    if key in ("seed", "cap", "width", "drift_window"):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if key == "seed" else 1) or v >= 1 << 63:
            raise UserError(f"{where}: {v!r} is not a{' non-negative' if key == 'seed' else ' positive'} integer.")
        return v
    if key == "drop_frac":
        from replay.analyses.drop_cold import check_drop_frac

        return check_drop_frac(v, where)  # the one check of F (prefetch --drop, drop --fracs, the API)
    return v


def _resolve_traces(grid: Path, raw: Any) -> list[tuple[str, str]]:
    from traces import open_trace

    where = _where(grid, None, "traces")
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not raw or not all(isinstance(t, str) and t.strip() for t in raw):
        raise UserError(f"{where}: expected a non-empty list of trace directories or globs.")
    base = grid.parent
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for pattern in raw:
        absolute = Path(pattern).is_absolute()
        full = pattern if absolute else str(base / pattern)
        matches = sorted(glob.glob(full)) if glob.has_magic(pattern) else ([full] if Path(full).exists() else [])
        matches = [m for m in matches if Path(m).is_dir()]
        if not matches:
            raise UserError(f"{where}: {pattern!r} matches no trace directory (relative paths are relative to the grid's "
                            "folder).")
        for m in matches:
            shown = m if absolute else os.path.relpath(m, base)
            ab = str(Path(m).resolve())
            if ab in seen:
                continue
            seen.add(ab)
            try:
                open_trace(ab, check_rows=False)
            except UserError as e:
                raise UserError(f"{where}: {shown!r} is not a readable trace ({e})") from None
            out.append((shown, ab))
    return out


def _expand_kind(grid: Path, kind: Kind, table: Any) -> list[dict[str, Any]]:
    """The parameter sets (one per cell, before traces) of one kind's table, in grid order."""
    if not isinstance(table, dict):
        raise UserError(f"{_where(grid, None, kind.name)}: expected a table [{kind.name}].")
    keywords = _api_keywords(kind)
    axes: list[tuple[str, list[Any]]] = []
    horizons: list[int] | None = None
    for key, raw in table.items():
        where = _where(grid, kind.name, key)
        if key in kind.refused:
            raise UserError(f"{where}: not a sweep key ({kind.refused[key]}).")
        if kind.name == "predict" and key == "horizons":
            if not isinstance(raw, list) or not raw or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 1
                                                               for h in raw):
                raise UserError(f"{where}: expected a list of stale-gate horizons >= 1.")
            horizons = list(dict.fromkeys(raw))
            continue
        if key in kind.split:
            param = kind.split[key]
            if not isinstance(raw, list) or not raw:
                raise UserError(f"{where}: expected a non-empty list.")
        elif key in kind.plural:
            param = kind.plural[key]
            if not isinstance(raw, list) or not raw:
                raise UserError(f"{where}: expected a non-empty list.")
        elif key in keywords and key not in kind.split.values():
            param = key
            if key == "fracs":  # the drop table's own rows: one list per cell, a list of lists crosses
                raw = raw if isinstance(raw, list) and raw and all(isinstance(x, list) for x in raw) else [raw]
            raw = [raw] if not isinstance(raw, list) or key in ("policy_file", "predictor_file") else raw
        else:
            known = sorted({*kind.split, *kind.plural, *(k for k in keywords if k not in kind.refused
                                                         and k not in kind.split.values())}
                           | ({"horizons"} if kind.name == "predict" else set()))
            raise UserError(f"{where}: unknown key for replay.{kind.function} (known: {', '.join(known)}).")
        if any(a[0] == param for a in axes):
            raise UserError(f"{where}: {param} is already given by another key of [{kind.name}].")
        if key == "fracs":
            vals = [_check_fracs(v, where) for v in raw]
        elif param == "predictor" and kind.name == "predict":
            vals = [v for v in raw]  # expanded with the horizons below
        else:
            vals = [_check_value(kind.name, param, v, keywords.get(param), where, grid.parent) for v in raw]
        if not vals:
            raise UserError(f"{where}: expected a non-empty list.")
        axes.append((param, list(_dedupe(vals))))
    if kind.name == "predict":
        axes = _predict_axes(grid, kind, axes, horizons)
    if kind.name in ("cache", "retention"):
        if not any(a[0] == "budget_mib" for a in axes):
            raise UserError(f"{_where(grid, kind.name, 'budgets_mib')}: missing (a sweep names its budgets; the "
                            "default budgets depend on each trace).")
        if not any(a[0] == "policy" for a in axes):  # the API's default list
            axes.insert(0, ("policy", list(keywords["policies"])))
    names = [a[0] for a in axes]
    return [dict(zip(names, combo)) for combo in itertools.product(*(a[1] for a in axes))]


def _check_fracs(v: Any, where: str) -> list[float]:
    from replay.analyses.drop_cold import check_drop_frac

    if not isinstance(v, list) or not v:
        raise UserError(f"{where}: {v!r} is not a non-empty list of drop-cold F values.")
    return [check_drop_frac(f, where) for f in v]  # the one check of F, as drop's --fracs


def _dedupe(vals: list[Any]) -> list[Any]:
    out: list[Any] = []
    for v in vals:
        if v not in out:
            out.append(v)
    return out


def _predict_axes(grid: Path, kind: Kind, axes: list[tuple[str, list[Any]]], horizons: list[int] | None):
    from replay.analyses.accuracy import expand
    from replay.predictors import default_names

    where = _where(grid, "predict", "predictors")
    names = next((a[1] for a in axes if a[0] == "predictor"), None)
    if names is None:
        names = list(default_names())
        axes = [("predictor", []), *axes]
    if not all(isinstance(n, str) for n in names):
        raise UserError(f"{where}: expected predictor names.")
    full = expand(names, horizons or [1], option=where)
    return [(p, full if p == "predictor" else v) for p, v in axes]


def read_grid(path: str | Path) -> Grid:
    """Read and check a grid file; every problem is one sentence naming the file and the key."""
    grid = Path(path)
    if not grid.is_file():
        raise UserError(f"{grid}: no such grid file.")
    try:
        text = grid.read_text(encoding="utf-8")
        data = tomllib.loads(text)
    except UnicodeDecodeError:
        raise UserError(f"{grid}: is not UTF-8 text (expected a TOML grid; see 'moe-replay sweep --example').") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{grid}: is not valid TOML ({e}).") from None
    grid = grid.resolve()
    if "traces" not in data:
        raise UserError(f"{grid}: traces: missing (the trace directories or globs to sweep).")
    kinds: dict[str, list[dict[str, Any]]] = {}
    for key, value in data.items():
        if key == "traces":
            continue
        if key not in KINDS:
            raise UserError(f"{grid}: [{key}]: unknown analysis kind (known: {', '.join(KIND_ORDER)}).")
        # policy/predictor files are registered first: the names they define are then known
        if isinstance(value, dict):
            from replay.plugin_files import register_files

            for fk in ("policy_file", "predictor_file"):
                if fk in value:
                    checked = _check_value(key, fk, value[fk], None, _where(grid, key, fk), grid.parent)
                    register_files(*((checked, None) if fk == "policy_file" else (None, checked)))
        kinds[key] = _expand_kind(grid, KINDS[key], value)
    if not kinds:
        raise UserError(f"{grid}: names no analysis kind (add a table: {', '.join(f'[{k}]' for k in KIND_ORDER)}).")
    return Grid(grid, _resolve_traces(grid, data["traces"]), kinds, text)


# --- cell keys -------------------------------------------------------------------------------


def cell_key(trace_id: str, kind: str, params: dict[str, Any], version: str) -> str:
    """sha256 of (trace content id, kind, parameters, tool version); a file a parameter names
    enters by its content (a cost model refitted into the same path is a new cell)."""
    def content(k: str, v: Any) -> Any:
        if k == "device_profile" and v is not None and _is_profile_file(v):
            return sha256_file(v)
        if k not in _FILE_KEYS or v is None:
            return v
        return [sha256_file(f) for f in v] if isinstance(v, list) else sha256_file(v)

    canon = {k: content(k, v) for k, v in params.items()}
    blob = json.dumps({"trace": trace_id, "kind": kind, "params": canon, "version": version}, sort_keys=True,
                      separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _is_profile_file(v: Any) -> bool:
    """A ``device_profile`` value that names a file, not a preset."""
    from replay.analyses.timeline_fit import PRESETS

    return not (isinstance(v, str) and v in PRESETS)


def cells_of(grid: Grid) -> list[Cell]:
    """Every cell of the grid in grid order (trace, then kind as the grid lists them, then parameters)."""
    from traces.format.version import __version__

    out: list[Cell] = []
    for shown, ab in grid.traces:
        tid = trace_content_id(ab)
        for kind, psets in grid.kinds.items():
            for params in psets:
                c = Cell(kind, shown, ab, tid, dict(params), index=len(out))
                c.key = cell_key(tid, kind, c.params, __version__)
                out.append(c)
    return out


# --- computing cells (runs in a worker) ------------------------------------------------------

_OPEN: dict[str, tuple[Any, Any]] = {}  # this process's open traces: path -> (trace, loads or None)


def _trace_and_loads(path: str, need_loads: bool):
    from replay.core.simulate import loads_of
    from traces import open_trace

    if path not in _OPEN:
        if len(_OPEN) >= 2:  # a worker keeps at most two traces (batches come grouped by trace)
            _OPEN.pop(next(iter(_OPEN)))
        _OPEN[path] = (open_trace(path), None)
    t, loads = _OPEN[path]
    if need_loads and loads is None:
        loads = loads_of(t)
        _OPEN[path] = (t, loads)
    return t, loads


def compute_cell(kind: str, path: str, params: dict[str, Any]) -> tuple[pl.DataFrame, list[str]]:
    """The rows of one cell: the API function on the trace at ``path`` with the cell's keyword
    arguments (what ``moe-replay <verb> --json`` prints for that cell), and notes (predictors the
    trace cannot run)."""
    from replay import api

    kw = dict(params)
    if kw.get("cost_model") is not None:
        kw["cost_model"] = api.load_cost_model(kw["cost_model"])
    if kind in ("cache", "retention"):
        t, loads = _trace_and_loads(path, True)
        pol, bud = kw.pop("policy"), kw.pop("budget_mib")
        if kind == "retention":
            kw["retain_predictor"] = kw.pop("predictor", "prev-token")
        return api.cache(t, policies=[pol], budgets_mib=[bud], loads=loads, **kw), []
    t, _ = _trace_and_loads(path, False)
    if kind == "predict":
        res = api.predict_run(t, predictors=[kw.pop("predictor")], **kw)
        return res.frame, [f"{u['predictor']}: {u['reason']}" for u in res.unavailable]
    if kind == "drop":
        return api.drop(t, **kw), []
    if kind == "prefetch":
        return api.prefetch(t, **kw), []
    if kind == "curve":  # one policy's whole curve per cell; a requested budget joins its rows
        kw["policies"] = [kw.pop("policy")]
        if "budget_mib" in kw:
            b = kw.pop("budget_mib")
            kw["budgets_mib"] = None if b is None else [b]
        return api.curve(t, **kw), []
    if kind == "profile":
        return profile_cell(api.profile_run(t, **kw)), []
    raise AssertionError(kind)


#: The cacheability answer's figures (``Profile.answer``) as a [profile] table's ``answer_*`` columns.
ANSWER_SCHEMA = {"phase": pl.String, "budget_mib": pl.Float64, "token_cycle_mib": pl.Float64,
                 "working_set_mib": pl.Float64, "hot_set_80_mib": pl.Float64, "hot_set_80_experts": pl.Int64,
                 "entries": pl.Int64, "reused_pct": pl.Float64, "within_1_steps_pct": pl.Float64,
                 "lru_hit_pct_at_token_cycle": pl.Float64, "lru_hit_pct_at_budget": pl.Float64,
                 "sch_2k_16_pct": pl.Float64}


def profile_cell(prof: Any) -> pl.DataFrame:
    """A [profile] cell's rows: :func:`replay.profile`'s rows (one per MoE layer and the pooled row),
    the pooled row also carrying the cacheability answer (what ``profile --json`` prints as
    ``answer``) as ``answer_<key>`` columns, null on the per-layer rows."""
    from replay.analyses.locality import summary

    rows = summary(prof)
    assert set(prof.answer) == set(ANSWER_SCHEMA), sorted(prof.answer)
    pooled = pl.col("layer").is_null()
    return rows.with_columns([pl.when(pooled).then(pl.lit(prof.answer[k], dtype=dt)).otherwise(pl.lit(None, dtype=dt))
                              .alias(f"answer_{k}") for k, dt in ANSWER_SCHEMA.items()])


def run_batch(batch: list[tuple[str, str, str, dict[str, Any]]]) -> list[tuple[str, bytes, list[str]]]:
    """Compute a batch of cells (key, kind, trace path, params); each result is (key, rows as Arrow
    IPC bytes, notes). A cell's :class:`UserError` comes back as one sentence naming the cell."""
    out = []
    for key, kind, path, params in batch:
        try:
            frame, notes = compute_cell(kind, path, params)
        except UserError as e:
            shown = ", ".join(f"{k}={_show(v)}" for k, v in params.items())
            raise UserError(f"sweep cell [{kind}] {path} ({shown}): {e}") from None
        buf = io.BytesIO()
        frame.write_ipc(buf)
        out.append((key, buf.getvalue(), notes))
    return out


def _show(v: Any) -> str:
    from traces.util.units import exact

    return exact(v) if isinstance(v, float) else str(v)


def _worker_init(parent: Any = None) -> None:
    from traces.util.signals import exit_with_parent, ignore_interrupts

    ignore_interrupts()  # Ctrl-C is the driver's to handle: it stops the pool
    # tqdm's first bar (even a disabled one) creates a multiprocessing lock, a named semaphore the
    # resource tracker counts; a worker the driver terminates never unregisters it, and the tracker
    # then printed "leaked semaphore objects" after the command's one-line error. A thread lock
    # does for a worker that draws no bar.
    with contextlib.suppress(ImportError):
        import threading

        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())
    if parent is not None:  # the sweep killed (SIGKILL too): this worker ends with it
        exit_with_parent(parent)


# --- the cell store --------------------------------------------------------------------------


class Store:
    """RESULTS/chunks: append-only chunk files, each one Parquet table written atomically (a rename)
    when its batch finishes: one row per cell (``key``, ``kind``, ``notes`` and ``rows``, the cell's
    frame as Arrow IPC bytes, so a cell reads back exactly as computed, whatever it was batched with)."""

    def __init__(self, out: Path) -> None:
        self.dir = out / "chunks"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.next = 1 + max((int(p.stem) for p in self.dir.glob("*.parquet") if p.stem.isdigit()), default=0)
        self.corrupt: list[str] = []  # chunks set aside because they did not read back (see _verified)
        self._ok: set[Path] = set()

    def _chunks(self) -> list[Path]:
        """The chunks that read back whole; one that does not (a disk error, an edit, garbage
        written in its place) is renamed ``NNNNNN.parquet.corrupt``, named in ``corrupt`` and its
        cells count as not done, so the sweep computes them again instead of failing."""
        return [p for p in sorted(p for p in self.dir.glob("*.parquet") if p.stem.isdigit()) if self._verified(p)]

    def _verified(self, p: Path) -> bool:
        if p in self._ok:
            return True
        problem = chunk_problem(p)
        if problem is None:
            self._ok.add(p)
            return True
        aside = p.with_name(p.name + ".corrupt")
        p.replace(aside)
        self.corrupt.append(f"{p}: {problem}; set aside as {aside.name}, its cells computed again")
        return False

    def done(self) -> dict[str, tuple[Path, list[str]]]:
        """cell key -> (its chunk, notes); a later chunk (a ``force`` rerun) wins over an earlier one."""
        out: dict[str, tuple[Path, list[str]]] = {}
        for p in self._chunks():
            for key, notes in pl.read_parquet(p, columns=["key", "notes"]).iter_rows():
                out[key] = (p, list(notes))
        return out

    def write(self, results: list[tuple[Cell, bytes, list[str]]]) -> None:
        from traces.io.atomic import atomic_write_bytes

        frame = pl.DataFrame({"key": [c.key for c, _, _ in results], "kind": [c.kind for c, _, _ in results],
                              "notes": [n for _, _, n in results], "rows": [b for _, b, _ in results]},
                             schema={"key": pl.String, "kind": pl.String, "notes": pl.List(pl.String), "rows": pl.Binary})
        path = self.dir / f"{self.next:06d}.parquet"
        self.next += 1
        atomic_write_bytes(path, _parquet_bytes(frame))

    def compact(self) -> None:
        """Rewrite the store as one chunk holding the newest result of every cell (a ``force``
        rerun leaves older copies behind). Killed midway it loses nothing: the new chunk is written
        before the old ones go, and the newest chunk wins."""
        chunks = self._chunks()
        if len(chunks) <= 1:
            return
        latest: dict[str, tuple] = {}
        for p in chunks:
            for row in pl.read_parquet(p).iter_rows(named=True):
                latest[row["key"]] = (row["kind"], row["notes"], row["rows"])
        keys = sorted(latest)
        frame = pl.DataFrame({"key": keys, "kind": [latest[k][0] for k in keys], "notes": [latest[k][1] for k in keys],
                              "rows": [latest[k][2] for k in keys]},
                             schema={"key": pl.String, "kind": pl.String, "notes": pl.List(pl.String), "rows": pl.Binary})
        from traces.io.atomic import atomic_write_bytes

        atomic_write_bytes(self.dir / f"{self.next:06d}.parquet", _parquet_bytes(frame))
        self.next += 1
        for p in chunks:
            p.unlink()

    def frames(self, wanted: dict[str, tuple[Path, list[str]]]) -> dict[str, pl.DataFrame]:
        """The rows of the ``wanted`` cells (key -> frame as the cell computed it)."""
        out: dict[str, pl.DataFrame] = {}
        for chunk in sorted({v[0] for v in wanted.values()}):
            for key, blob in pl.read_parquet(chunk, columns=["key", "rows"]).iter_rows():
                if key in wanted and wanted[key][0] == chunk:
                    out[key] = pl.read_ipc(io.BytesIO(blob))
        return out


_CHUNK_SCHEMA = {"key": pl.String, "kind": pl.String, "notes": pl.List(pl.String), "rows": pl.Binary}


def chunk_problem(p: Path) -> str | None:
    """Why the chunk ``p`` cannot be used (not Parquet, other columns, a cell's rows that do not
    decode), or None: every byte of it is read back before any of it is trusted."""
    try:
        t = pl.read_parquet(p)
    except Exception as e:  # noqa: BLE001 - polars raises several kinds for a damaged file; each means "corrupt"
        return f"is not a readable Parquet file ({type(e).__name__})"
    if dict(t.schema) != _CHUNK_SCHEMA:
        return f"has columns {', '.join(f'{k} {v}' for k, v in t.schema.items())}, not a sweep chunk's"
    for key, blob in zip(t["key"], t["rows"], strict=True):
        if key is None or blob is None:
            return "holds a cell with no key or no rows"
        try:
            pl.read_ipc(io.BytesIO(blob))
        except Exception as e:  # noqa: BLE001 - as above
            return f"holds cell {key[:12]} whose rows do not decode ({type(e).__name__})"
    return None


@contextlib.contextmanager
def results_lock(out: Path) -> Iterator[None]:
    """An exclusive flock on RESULTS/.lock for the whole sweep: a second sweep refuses."""
    fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UserError(f"{out}: another sweep is writing these results now; wait for it to finish or choose "
                                "another -o.") from None
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
        yield
    finally:
        os.close(fd)


def grid_inputs(grid: Grid) -> list[str]:
    """Every path a sweep of ``grid`` reads: the grid, its traces, and the files its cells name
    (cost models, policy and predictor files); RESULTS may be none of them nor hold one."""
    files: list[str] = [str(grid.file), *(ab for _, ab in grid.traces)]
    for sets in grid.kinds.values():
        for params in sets:
            v = params.get("device_profile")
            if v is not None and _is_profile_file(v) and str(v) not in files:
                files.append(str(v))
            for k in _FILE_KEYS:
                v = params.get(k)
                for f in (v if isinstance(v, list) else [v]):
                    if f is not None and str(f) not in files:
                        files.append(str(f))
    return files


_LEFTOVER = re.compile(r"\.lock|\..+\.tmp-\d+")


def _own_leftover(name: str) -> bool:
    """What a sweep that stopped before its first result leaves (a full disk as it wrote sweep.json,
    a kill): the lock file and a temporary file of an atomic write. A directory holding only these is
    a sweep's own, resumable by the same command, not someone else's folder."""
    return _LEFTOVER.fullmatch(name) is not None


def _holds_complete(out: Path, grid: Grid, cells: list[Cell]) -> bool:
    """RESULTS already holds the complete tables of this very grid (sweep.json says complete,
    grid.toml is this grid's text and each table holds exactly the cells of this grid, trace
    contents included): a rerun (``force`` too) leaves that record as it is until it has rebuilt
    every table, so a rerun that fails (a full disk, a kill) never downgrades it."""
    try:
        record = json.loads((out / "sweep.json").read_text(encoding="utf-8"))
        if record.get("complete") is not True or (out / "grid.toml").read_text(encoding="utf-8") != grid.text:
            return False
        for kind in grid.kinds:
            keys = set(pl.read_parquet(out / f"{kind}.parquet", columns=["cell_key"])["cell_key"].to_list())
            if keys != {c.key for c in cells if c.kind == kind}:
                return False
        return True
    except Exception:  # noqa: BLE001 - anything unreadable (a damaged table, an odd record) is not a complete result
        return False


def _check_results_dir(out: Path, inputs: Sequence[str]) -> None:
    from traces.io.atomic import check_not_input, check_not_special

    check_not_input(out, inputs)
    check_not_special(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a directory.")
    if out.is_dir() and any(not _own_leftover(e.name) for e in out.iterdir()) and not (out / "sweep.json").exists() \
            and not (out / "chunks").is_dir():
        raise UserError(f"{out}: exists, is not empty and holds no sweep results; choose another -o.")
    parent = Path(os.path.abspath(out)).parent
    if not parent.is_dir():
        raise UserError(f"{out}: the parent directory {parent} does not exist.")


# --- the tables ------------------------------------------------------------------------------


def _param_value(v: Any) -> Any:
    return json.dumps(v, sort_keys=True) if isinstance(v, dict) else v


def build_tables(grid: Grid, cells: list[Cell], store: Store) -> dict[str, pl.DataFrame]:
    """One table per kind: the stored rows of the grid's cells in grid order, each row with
    trace_id, trace, cell_key and every cell parameter (``cell_<keyword>``)."""
    done = store.done()
    tables: dict[str, pl.DataFrame] = {}
    for kind in grid.kinds:
        kcells = [c for c in cells if c.kind == kind]
        rows = store.frames({c.key: done[c.key] for c in kcells})
        frames, idx = [], []
        for i, c in enumerate(kcells):
            f = rows.get(c.key)
            if f is not None and f.height:
                frames.append(f)
                idx += [i] * f.height
        params = pl.DataFrame([{"trace_id": c.trace_id, "trace": c.trace, "cell_key": c.key,
                                **{f"cell_{k}": _param_value(v) for k, v in c.params.items()}} for c in kcells],
                              infer_schema_length=None)
        if not frames:
            tables[kind] = params.clear()
            continue
        body = pl.concat(frames, how="diagonal_relaxed")
        head = params[idx] if params.width else params
        tables[kind] = pl.concat([head, body], how="horizontal")
    return tables


def _parquet_bytes(frame: pl.DataFrame) -> bytes:
    buf = io.BytesIO()
    frame.write_parquet(buf, compression="zstd", statistics=True)
    return buf.getvalue()


# --- the engines -----------------------------------------------------------------------------


def _batches(todo: list[Cell], workers: int, max_batch: int = 16) -> list[list[Cell]]:
    """Cells grouped by trace (a worker reuses the trace it opened), cut into batches small enough
    that every worker has several (a balanced finish) and large enough to pay a task's overhead."""
    if not todo:
        return []
    size = max(1, min(max_batch, math.ceil(len(todo) / (4 * max(1, workers)))))
    out: list[list[Cell]] = []
    for _, group in itertools.groupby(sorted(todo, key=lambda c: (c.path, c.index)), key=lambda c: c.path):
        g = list(group)
        out += [g[i:i + size] for i in range(0, len(g), size)]
    return out


def _payload(batch: list[Cell]) -> list[tuple[str, str, str, dict[str, Any]]]:
    return [(c.key, c.kind, c.path, c.params) for c in batch]


def _decode(results: list[tuple[str, bytes, list[str]]], by_key: dict[str, Cell]):
    return [(by_key[k], b, notes) for k, b, notes in results]


def _run_local(batches: list[list[Cell]], workers: int, on_done: Callable[[list], None]) -> None:
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    ctx = multiprocessing.get_context("forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn")
    by_key = {c.key: c for b in batches for c in b}
    # A pipe only this process writes to: each worker exits when it closes, i.e. when this process
    # dies, even by SIGKILL (traces.util.signals.exit_with_parent). Without it the workers lived on,
    # and with them the forkserver and the resource tracker, holding this process's stdout, so
    # `sweep ... | tee` never returned.
    watch_r, watch_w = ctx.Pipe(duplex=False)
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init, initargs=(watch_r,))
    ok = False
    try:
        pending = {pool.submit(run_batch, _payload(b)) for b in batches}
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                on_done(_decode(fut.result(), by_key))
        ok = True
    finally:
        if not ok:  # an interrupt or a failed cell: stop the workers now, keep what was written
            for p in list(getattr(pool, "_processes", {}).values()):
                with contextlib.suppress(Exception):
                    p.terminate()
        pool.shutdown(wait=ok, cancel_futures=True)
        watch_w.close()
        watch_r.close()


RAY_MISSING = "--engine ray needs Ray: install the cluster extra (pip install 'moe-replay[cluster]')."


def _import_ray():
    try:
        import ray
    except ImportError:
        raise UserError(RAY_MISSING) from None
    return ray


def ray_connect(address: str | None) -> None:
    """Join the cluster at ``address`` (``auto``, ``HOST:PORT``; None starts Ray on this machine),
    unless this process is already connected. A HOST:PORT nobody answers at is refused at once:
    Ray itself would keep retrying for minutes."""
    import logging
    import socket

    ray = _import_ray()
    if ray.is_initialized():
        return
    if address not in (None, "auto", "local") and not address.startswith("ray://"):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise UserError(f"--address {address!r}: expected auto or HOST:PORT of a Ray head node (e.g. 10.0.0.5:6379).")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as e:
            raise UserError(f"--address {address}: no Ray head node answers there ({e.strerror or e}).") from None
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise UserError(f"--address {address}: cannot connect to a Ray cluster ({str(e).splitlines()[0]}).") from None


def _run_ray(batches: list[list[Cell]], on_done: Callable[[list], None], max_retries: int = 3) -> None:
    ray = _import_ray()
    by_key = {c.key: c for b in batches for c in b}
    # A task whose worker dies (killed, out of memory, node lost) is run again by Ray, up to
    # max_retries times; its result is delivered once, so each cell is stored once.
    task = ray.remote(max_retries=max_retries, retry_exceptions=False)(run_batch)
    refs = [task.remote(_payload(b)) for b in batches]
    try:
        while refs:
            ready, refs = ray.wait(refs, num_returns=1)
            for r in ready:
                try:
                    res = ray.get(r)
                except ray.exceptions.RayTaskError as e:
                    cause = e.cause if hasattr(e, "cause") else None
                    if isinstance(cause, UserError):
                        raise UserError(str(cause)) from None
                    raise
                on_done(_decode(res, by_key))
    finally:
        for r in refs:
            with contextlib.suppress(Exception):
                ray.cancel(r, force=True)


# --- the sweep -------------------------------------------------------------------------------


def run_sweep(grid_file: str | Path, out: str | Path, *, engine: str = "local", workers: int | None = None,
              address: str | None = None, force: bool = False, show_progress: bool = False) -> dict[str, Any]:
    """Run (or finish) the sweep of ``grid_file`` into ``out``; returns the summary :func:`summary` rows
    come from. Bad input is refused before anything is written."""
    from replay.core.progress import progress
    from traces.format.version import __version__
    from traces.io import atomic
    from traces.io.atomic import atomic_write_bytes, atomic_write_text

    if engine not in ("local", "ray"):
        raise UserError(f"--engine {engine!r} is not local or ray.")
    if workers is not None and (isinstance(workers, bool) or workers < 1):
        raise UserError(f"--workers {workers}: give at least 1 worker.")
    cores = os.cpu_count() or 1
    if workers is not None and workers > MAX_WORKERS_PER_CORE * cores:
        # Each worker is a process holding its traces; beyond the cores they only queue for CPU
        # (docs/sweeps.md: two workers on 2 CPUs were already slower than one).
        raise UserError(f"--workers {workers}: this machine has {cores} core{'s' if cores != 1 else ''}; more than "
                        f"{MAX_WORKERS_PER_CORE} workers per core only add processes and memory "
                        f"(give 1..{MAX_WORKERS_PER_CORE * cores}).")
    if address is not None and engine != "ray":
        raise UserError("--address: only meaningful with --engine ray.")
    if workers is not None and engine != "local":
        raise UserError("--workers: only meaningful with --engine local (Ray runs as many tasks as the cluster has CPUs).")
    if engine == "ray":
        _import_ray()
    out = Path(out)
    grid = read_grid(grid_file)
    _check_results_dir(out, grid_inputs(grid))
    cells = cells_of(grid)
    if engine == "ray":
        ray_connect(address)  # before anything is written: a cluster that cannot be reached writes nothing
    t0 = time.perf_counter()
    out.mkdir(exist_ok=True)
    with results_lock(out):
        # until the sweep ends, sweep.json says it is unfinished (a killed sweep leaves it so; the
        # tables, if any, are those of an earlier run): rerun the same grid to finish it. Not when
        # RESULTS already holds this grid's complete tables (a --force rerun): those stay the
        # record, and stay true, until this run has rebuilt them (new chunks only add to the store,
        # the newest wins), so a rerun stopped by a full disk or a kill downgrades nothing.
        if not _holds_complete(out, grid, cells):
            atomic_write_text(out / "sweep.json", json.dumps({"format": FORMAT, "version": 1, "tool_version": __version__,
                                                              "grid": str(grid.file), "complete": False}, indent=1) + "\n")
        store = Store(out)
        done = store.done()
        todo, seen = [], set()
        for c in cells:  # one computation per key (two paths to one trace's content share their cells)
            if (force or c.key not in done) and c.key not in seen:
                seen.add(c.key)
                todo.append(c)
        n_workers = workers or os.cpu_count() or 1
        batches = _batches(todo, n_workers)
        computed = 0
        with progress(len(todo), "sweep", unit="cell", enabled=show_progress) as bar:
            def on_done(results: list) -> None:
                nonlocal computed
                store.write(results)
                if not computed:  # an interrupted sweep says truthfully that it wrote finished cells
                    atomic.written.append(store.dir)
                computed += len(results)
                bar.update(len(results))

            if batches:
                if engine == "local":
                    _run_local(batches, n_workers, on_done)
                else:
                    _run_ray(batches, on_done)
        seconds = time.perf_counter() - t0
        store.compact()
        tables = build_tables(grid, cells, store)
        for kind, frame in tables.items():
            atomic_write_bytes(out / f"{kind}.parquet", _parquet_bytes(frame))
        atomic_write_text(out / "grid.toml", grid.text)
        done = store.done()
        kinds = []
        for kind, frame in tables.items():
            kc = [c for c in cells if c.kind == kind]
            notes = sorted({n for c in kc for n in done[c.key][1]})
            kinds.append({"kind": kind, "cells": len(kc), "computed": len({c.key for c in kc if c.key in seen}),
                          "rows": frame.height, "table": str(out / f"{kind}.parquet"), "notes": notes})
        summary = {"format": FORMAT, "version": 1, "tool_version": __version__, "grid": str(grid.file), "complete": True,
                   "traces": [s for s, _ in grid.traces], "engine": engine,
                   "workers": n_workers if engine == "local" else None, "cells": len(cells), "computed": computed,
                   "reused": sum(1 for c in cells if c.key not in seen),
                   # cells whose trace has the same content as an earlier path of the grid: computed once
                   "same_content": len(cells) - len({c.key for c in cells}), "seconds": seconds,
                   "cells_per_s": computed / seconds if computed and seconds > 0 else None, "kinds": kinds,
                   # chunks that did not read back, named (set aside, their cells computed again)
                   **({"corrupt_chunks": list(store.corrupt)} if store.corrupt else {})}
        # sweep.json is this run's record (times vary): the tables are the deterministic output
        atomic_write_text(out / "sweep.json", json.dumps(summary, indent=1) + "\n")
    return summary


# --- the report over RESULTS -----------------------------------------------------------------


def _paired_columns(rows: list[dict[str, Any]], timed: bool) -> dict[str, Any]:
    """The best (and fastest) of one (trace, cost model, budget) group against LRU with the paired
    interval, and the policies tied with it (:func:`replay.analyses.paired.decide`): the group's plain cells
    replayed again from their trace (the stored rows hold totals, not per-token figures), each
    replayed figure checked against the stored one. ``paired_note`` says why there is none."""
    from replay.analyses.paired import annotate, decide, with_requests

    keys = ["vs_lru", "delta_vs_lru_pp", "delta_ci_low", "delta_ci_high", "tied_with_best"]
    if timed:
        keys += ["fastest_vs_lru", "fastest_delta_ms_vs_lru", "fastest_delta_ms_ci_low", "fastest_delta_ms_ci_high",
                 "tied_with_fastest"]
    out: dict[str, Any] = dict.fromkeys(keys)
    out["paired_note"] = None
    if not any(r["policy"] == "lru" for r in rows):
        out["paired_note"] = "no LRU cell at this budget to compare with"
        return out
    plain = [r for r in rows if not any(r.get(c) is not None for c in ("cell_policy_options", "cell_retain_predictor",
                                                                      "cell_predictor"))]
    try:
        from replay.analyses.cost_model import load_cost_model
        from replay.core.simulate import loads_of, sweep
        from traces import open_trace

        t = open_trace(rows[0]["trace"])
        series: dict = {}
        pols = list(dict.fromkeys(r["policy"] for r in plain))
        b = float(rows[0]["budget_mib"])
        again = sweep(loads_of(t), pols, [b], seed=int(plain[0].get("cell_seed") or 0), show_progress=False,
                      series=series).filter(pl.col("layer").is_null()).to_dicts()
        model = None
        if timed and rows[0].get("cell_cost_model"):
            from replay.analyses.cost_model import with_time

            model = load_cost_model(rows[0]["cell_cost_model"])
            again = with_time(pl.DataFrame(again), model, t.token_counts()["tokens_decode"]).to_dicts()
    except (UserError, OSError) as e:
        out["paired_note"] = f"not replayed again for the paired interval: {str(e).rstrip('.')}"
        return out
    stored = {r["policy"]: r for r in plain}
    if any(stored[r["policy"]].get("hits") != r.get("hits") for r in again):
        out["paired_note"] = "the trace no longer gives the stored figures: no paired interval"
        return out
    annotate(again, with_requests(series, t), model)
    for prefix, value in (("", "hit_pct_decode"), ("fastest_", "ms_per_token")):
        if prefix and not timed:
            continue
        d = decide(again, value)
        if d is None:
            continue
        out[f"{prefix}vs_lru"] = d["call"]
        unit = "delta_ms_vs_lru" if prefix else "delta_vs_lru_pp"
        out[f"{prefix}{unit}"] = d["delta"]
        out[f"{prefix}{'delta_ms_' if prefix else 'delta_'}ci_low"] = d["low"]
        out[f"{prefix}{'delta_ms_' if prefix else 'delta_'}ci_high"] = d["high"]
        out["tied_with_fastest" if prefix else "tied_with_best"] = ", ".join(d["tied"]) or None
    return out


@_api
def sweep_report(results: str | Path) -> pl.DataFrame:
    """Per trace, cost model and budget: the best within-budget online policy of RESULTS/cache.parquet
    by decode hit % (and, where a cost model was given, the fastest by ms per token), against the
    Belady bound. Over-budget cells are left out and named (``over_budget_excluded``)."""
    from replay.core.frames import rows_of
    from replay.core.simulate import is_over_budget, pick_best, within_budget
    from replay.policies import bound_policies

    res = Path(results)
    table = res / "cache.parquet"
    _check_results(res)
    if not table.exists():
        if (res / "curve.parquet").exists():  # a curve-only grid: its budget answer is sweep_budget_answer's
            return pl.DataFrame()
        raise UserError(f"{res}: holds no cache or curve table (the grid had no [cache] or [curve] table).")
    frame = _read_table(table)
    if frame.height == 0:
        return pl.DataFrame()
    overall = frame.filter(pl.col("layer").is_null())
    bounds = set(bound_policies())
    group_cols = ["trace", "trace_id"] + (["cell_cost_model"] if "cell_cost_model" in overall.columns else [])
    out = []
    for key, g in overall.group_by([*group_cols, "budget_mib"], maintain_order=True):
        rows = rows_of(g)
        online = [r for r in rows if r["policy"] not in bounds]
        ok, excluded = within_budget(online)
        best = pick_best(ok, "hit_pct_decode", highest=True)
        bel = next((r for r in rows if r["policy"] == "belady"), None)
        row = dict(zip([*group_cols, "budget_mib"], key))
        row.update({
            "policies": len(online), "best_online": best["policy"] if best else None,
            "best_online_hit_pct_decode": best["hit_pct_decode"] if best else None,
            "belady_hit_pct_decode": bel["hit_pct_decode"] if bel else None,
            "belady_over_budget": is_over_budget(bel) if bel else None,
        })
        row["gap_to_belady_pp"] = (None if best is None or bel is None or bel["hit_pct_decode"] is None
                                   or best["hit_pct_decode"] is None else bel["hit_pct_decode"] - best["hit_pct_decode"])
        if "ms_per_token" in overall.columns:
            fastest = pick_best([r for r in ok if r.get("ms_per_token") is not None], "ms_per_token", highest=False)
            row.update({"fastest_online": fastest["policy"] if fastest else None,
                        "fastest_ms_per_token": fastest["ms_per_token"] if fastest else None,
                        "fastest_tok_s": fastest.get("tok_s") if fastest else None})
        row["over_budget_excluded"] = ", ".join(
            f"{r['policy']} (peak {r['peak_resident_mib']:.1f} MiB)" if r.get("peak_resident_mib") is not None else r["policy"]
            for r in excluded) or None
        row.update(_paired_columns(rows, "ms_per_token" in overall.columns))
        out.append(row)
    order = {t: i for i, t in enumerate(dict.fromkeys(r["trace"] for r in out))}  # traces in grid order
    out.sort(key=lambda r: (order[r["trace"]], str(r.get("cell_cost_model")), r["budget_mib"]))
    return pl.DataFrame(out, infer_schema_length=None)


def _check_results(res: Path) -> None:
    if not (res / "sweep.json").exists():
        raise UserError(f"{res}: is not a sweep results directory (no sweep.json; see 'moe-replay sweep').")


def _read_table(table: Path) -> pl.DataFrame:
    try:
        return pl.read_parquet(table)
    except Exception as e:  # noqa: BLE001 - polars raises several kinds for a damaged file
        raise UserError(f"{table}: is not a readable Parquet table ({type(e).__name__}); rerun the same sweep to rebuild "
                        "it from its cell store.") from None


#: A [cache] grid says where its tested budgets' hit rate bends only with at least this many budgets
#: within budget for a policy: with fewer, "the smallest within a tolerance of the best" is a guess
#: between two or three points.
BEND_MIN_BUDGETS = 4


def _trace_sizes(path: str) -> tuple[int | None, int | None, str | None]:
    """(T, W) in bytes of the trace at ``path``, or (None, None, why) when it no longer opens."""
    from replay.core.streaming import working_set_stream
    from traces import open_trace

    try:
        t = open_trace(path)
        return int(t.token_cycle_bytes), int(working_set_stream(t)), None
    except (UserError, OSError) as e:
        return None, None, f"T and W not known (the trace does not open: {str(e).rstrip('.')})"


def _bend(rows: list[dict[str, Any]], tolerances_pp: Sequence[float]) -> dict[str, Any]:
    """Where a [cache] grid's tested budgets' hit rate bends (decode-only hit % when the trace decodes):
    the best tested hit % (the plateau of what was tested), for each tolerance the smallest within-budget
    tested budget within that many points of it and the tested budget below it (the bend lies between:
    the grid did not test in between), and what each step between tested budgets buys."""
    rows = sorted(rows, key=lambda r: r["budget_mib"])
    metric = "hit_pct_decode" if any((r.get("lookups_decode") or 0) > 0 for r in rows) else "hit_pct_cum"
    h = [float(r[metric]) if r[metric] is not None else math.nan for r in rows]
    best = max((x for x in h if not math.isnan(x)), default=math.nan)
    knees = []
    for tol in tolerances_pp:
        i = next((i for i, r in enumerate(rows) if not r["over_budget"] and h[i] >= best - tol), None)
        knees.append({"tolerance_pp": float(tol), "budget_mib": None if i is None else float(rows[i]["budget_mib"]),
                      "hit_pct": None if i is None else h[i],
                      "after_mib": None if not i else float(rows[i - 1]["budget_mib"])})
    steps = [{"from_mib": float(a["budget_mib"]), "to_mib": float(b["budget_mib"]), "hit_pct": h[i + 1],
              "gain_pp": h[i + 1] - h[i], "over_budget": bool(b["over_budget"])} for i, (a, b) in enumerate(zip(rows, rows[1:]))]
    return {"metric": metric, "plateau_pct": best, "knees": knees, "steps": steps, "budgets": len(rows),
            "largest_mib": float(rows[-1]["budget_mib"]),
            "best_mib": next((float(r["budget_mib"]) for x, r in zip(h, rows) if x >= best), None)}


@_api
def sweep_budget_answer(results: str | Path, *, tolerances_pp: Sequence[float] = (1.0, 5.0)) -> pl.DataFrame:
    """The budget answer per trace and cell of a sweep's results (``sweep-report``'s second table).

    ``source = "curve"`` (a [curve] cell: one policy's exact curve): :func:`replay.analyses.curve.budget_answer`
    on its rows: the plateau (hit % at the working set W), the knee at each tolerance (the smallest
    within-budget budget within that many points of the plateau: ``knee_<tol>pp_mib``), the cliff
    (``below_t_pct`` just below one token's working set T, ``at_t_pct`` at T) and what each doubling
    from T to W buys (``steps``).

    ``source = "cache"`` (a [cache] grid's policy with at least :data:`BEND_MIN_BUDGETS` budgets): where
    the tested budgets' hit rate bends: ``plateau_pct`` is the best tested hit % (``plateau_reached``:
    whether the largest tested budget reaches W, so that it is the true plateau), ``knee_<tol>pp_mib``
    the smallest within-budget tested budget within the tolerance of it and ``knee_<tol>pp_after_mib``
    the tested budget below it (the bend lies between them; the grid did not look in between),
    ``steps`` what each step between tested budgets buys. No cliff (the grid need not straddle T).
    Hit % is decode-only when the trace decodes (``metric``)."""
    res = Path(results)
    _check_results(res)
    tols = [float(x) for x in tolerances_pp]
    if not tols or any(not 0 <= x < 100 for x in tols):
        raise UserError(f"tolerances_pp {tols}: each must be in [0, 100) percentage points.")
    have = [k for k in ("curve", "cache") if (res / f"{k}.parquet").exists()]
    if not have:
        raise UserError(f"{res}: holds no cache or curve table (the grid had no [cache] or [curve] table).")
    import numpy as np

    from replay.analyses.curve import budget_answer
    from replay.core.frames import rows_of
    from traces.util.units import MIB

    sizes: dict[str, tuple[int | None, int | None, str | None]] = {}
    out: list[dict[str, Any]] = []
    for kind in have:
        frame = _read_table(res / f"{kind}.parquet")
        if frame.height == 0:
            continue
        frame = frame.filter(pl.col("layer").is_null())
        params = [c for c in frame.columns if c.startswith("cell_") and c not in ("cell_key", "cell_budget_mib", "cell_policy",
                                                                                 "cell_budgets_mib")]
        for key, g in frame.group_by(["trace", "trace_id", "policy", *params], maintain_order=True):
            head = dict(zip(["trace", "trace_id", "policy", *params], key))
            if head["trace"] not in sizes:
                sizes[head["trace"]] = _trace_sizes(head["trace"])
            T, W, why = sizes[head["trace"]]
            row: dict[str, Any] = {"source": kind, **{k: head[k] for k in ("trace", "trace_id", "policy")},
                                   "cell_cost_model": head.get("cell_cost_model"),
                                   "cell_sample_rate": head.get("cell_sample_rate"),
                                   "t_mib": None if T is None else T / MIB, "w_mib": None if W is None else W / MIB}
            rows = rows_of(g.sort("budget_mib"))
            if kind == "curve":
                if W is None:  # the curve's rows run up to W: the last change point is the plateau's budget
                    a = budget_answer(g, 0, int(round(max(r["budget_mib"] for r in rows) * MIB)), tolerances_pp=tuple(tols),
                                      policy=head["policy"])
                    a["below_t_pct"] = a["at_t_pct"] = None
                else:
                    a = budget_answer(g, T, W, tolerances_pp=tuple(tols), policy=head["policy"])
                h = g.sort("budget_mib")[a["metric"]].to_numpy()
                at = g.sort("budget_mib")["budget_mib"].to_numpy()[np.flatnonzero(h >= a["plateau_pct"])]
                row.update({"metric": a["metric"], "budgets": g.height, "plateau_pct": a["plateau_pct"],
                            # where the curve first reaches it (over budget or not; at most W for lru)
                            "plateau_at_mib": float(at[0]) if at.shape[0] else None, "plateau_reached": True,
                            "below_t_pct": a["below_t_pct"], "at_t_pct": a["at_t_pct"]})
                knees, steps = a["knees"], a["doublings"]
                row["note"] = why
            else:
                b = _bend(rows, tols)
                if b["budgets"] < BEND_MIN_BUDGETS:
                    continue
                knees, steps = b["knees"], b["steps"]
                row.update({"metric": b["metric"], "budgets": b["budgets"], "plateau_pct": b["plateau_pct"],
                            "plateau_at_mib": b["best_mib"], "plateau_reached": None if W is None else b["largest_mib"] * MIB >= W,
                            "below_t_pct": None, "at_t_pct": None})
                row["note"] = why or ("the best tested hit % is below the plateau: the largest tested budget "
                                      f"({exact_mib(b['largest_mib'])} MiB) is below the working set W "
                                      f"({exact_mib(W / MIB)} MiB)" if not row["plateau_reached"] else None)
            for k in knees:
                tag = f"knee_{k['tolerance_pp']:g}pp".replace(".", "_")
                row[f"{tag}_mib"] = k["budget_mib"]
                row[f"{tag}_hit_pct"] = k["hit_pct"]
                if kind == "cache":
                    row[f"{tag}_after_mib"] = k["after_mib"]
            row["steps"] = steps
            out.append(row)
    if not out:
        return pl.DataFrame()
    order = {t: i for i, t in enumerate(dict.fromkeys(r["trace"] for r in out))}
    out.sort(key=lambda r: (r["source"] != "curve", order[r["trace"]], str(r.get("cell_cost_model")),
                            str(r.get("cell_sample_rate"))))  # stable: the policies in their table's (the grid's) order
    return pl.DataFrame(out, infer_schema_length=None)


def exact_mib(x: float) -> str:
    """A budget in MiB to 0.1, without trailing zeros (1024, 12.3)."""
    return f"{round(x, 1):g}"


def profile_answers(results: str | Path) -> pl.DataFrame | None:
    """One row per [profile] cell of RESULTS (grid order): ``trace``, ``trace_id``, the cell's
    parameters (``cell_*``) and the cacheability answer's figures (the ``Profile.answer`` keys, from
    the pooled row's ``answer_*`` columns). None when RESULTS holds no profile table."""
    res = Path(results)
    table = res / "profile.parquet"
    _check_results(res)
    if not table.exists():
        return None
    frame = _read_table(table)
    if frame.height == 0:
        return pl.DataFrame()
    pooled = frame.filter(pl.col("layer").is_null())
    keep = ["trace", "trace_id", *(c for c in pooled.columns if c.startswith("cell_") and c != "cell_key")]
    return pooled.select(*keep, *(pl.col(f"answer_{k}").alias(k) for k in ANSWER_SCHEMA))


# The public functions (replay.sweep, replay.sweep_report): here, above the API whose verbs
# each cell runs, so that replay.api never imports this module.
@_api
def sweep(grid: str | Path, out: str | Path, *, engine: str = "local", workers: int | None = None,
          address: str | None = None, force: bool = False, show_progress: bool = False) -> pl.DataFrame:
    """Run the sweep of the TOML ``grid`` into the results directory ``out`` (one Parquet table per
    analysis kind, ``out/<kind>.parquet``: each row the kind's API rows plus ``trace_id``, ``trace``,
    ``cell_key`` and every cell parameter as ``cell_<keyword>``). A rerun computes only the cells
    ``out`` lacks (``force`` recomputes them). ``engine``: ``local`` (a process pool of ``workers``,
    default one per core) or ``ray`` (``address``: ``auto``, ``HOST:PORT``, or None to start Ray
    here). Returns one row per kind (cells, computed, rows, table); the whole run's record is
    ``out/sweep.json``. The grid format: ``moe-replay sweep --example``."""
    import polars as pl

    summary = run_sweep(grid, out, engine=engine, workers=workers, address=address, force=force,
                        show_progress=show_progress)
    return pl.DataFrame(summary["kinds"], schema={"kind": pl.String, "cells": pl.Int64, "computed": pl.Int64,
                                                  "rows": pl.Int64, "table": pl.String, "notes": pl.List(pl.String)})
