"""Cost model: from simulated bytes (and misses) per decoded token to time per token.

A policy can improve every metric it owns (hit rate, stall) and still lose the wall clock when
flash bandwidth binds: a what-if that reads more bytes per token is slower even with more hits.
This module fits per-token wall time on a run's *recorded* engine metrics against what the
replay can reproduce per token, and applies the fit to replayed configurations.

What a fitted model can see: expert bytes read per decoded token (and, if it pays under
cross-validation, expert misses per token). What it cannot see: thermal state and clock
throttling, page faults and memory pressure, compute changes (another top-k, another
quantization), prefill, I/O parallelism changes. Those land in the intercept or in the residuals;
the held-out error says how much they matter on this run.

Units: ms per decoded token; MiB = 2^20 bytes; bandwidth in MiB/s.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from replay.policies import bound_policies
from traces.errors import UserError
from traces.reader import Trace
from traces.units import MIB, exact

MAX_MS = 86_400_000.0  # one day: no per-token time, coefficient or intercept beyond it is a measurement

FORMULAS = {
    "bytes": "wall_ms = intercept_ms + ms_per_mib * read_mib",
    "bytes+misses": "wall_ms = intercept_ms + ms_per_mib * read_mib + ms_per_miss * misses",
    "manual": "wall_ms = compute_ms + 1000 * read_mib / flash_mib_s",
}


@dataclass
class CostModel:
    """A per-decoded-token time model. ``kind`` is ``fit`` (from recorded metrics) or ``manual``."""

    model: str  # the formula, human-readable
    terms: str  # "bytes" | "bytes+misses" | "manual"
    intercept_ms: float
    ms_per_mib: float
    ms_per_miss: float = 0.0
    kind: str = "fit"
    r2: float | None = None
    # Two held-out errors, both from a fit on the first half scored on the second half, never to be
    # confused: per-token MAPE (how far single tokens are off) and the error of the run's mean speed
    # (predicted tok/s against recorded tok/s over the second half, signed).
    heldout_mape_pct: float | None = None
    heldout_run_mean_err_pct: float | None = None
    tokens_fit: int = 0
    tokens_heldout: int = 0
    resid_std_ms: float | None = None
    source: str | None = None
    # Fit provenance: which recorded tokens the coefficients saw, so that checking the model on the
    # same run is recognised as in-sample (an error of 0.0 there is arithmetic, not accuracy).
    fit_trace: str | None = None
    fit_trace_id: str | None = None  # fit_data_id() of the recorded tokens the coefficients were fitted on
    fit_tokens: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def bandwidth_mib_s(self) -> float | None:
        """Effective read bandwidth the slope implies (MiB/s); None if the slope is not positive."""
        return 1000.0 / self.ms_per_mib if self.ms_per_mib > 0 else None

    def predict_ms(self, read_bytes: np.ndarray | float, misses: np.ndarray | float = 0.0) -> np.ndarray:
        """Predicted ms per decoded token for per-token expert bytes read (and misses)."""
        rb = np.asarray(read_bytes, dtype=np.float64) / MIB
        return self.intercept_ms + self.ms_per_mib * rb + self.ms_per_miss * np.asarray(misses, dtype=np.float64)

    def interval_ms(self, n_tokens: int) -> float:
        """Half-width of an approximate 95% interval on a run's mean ms/token, from the fit's
        residuals (assumes independent per-token errors; it does not cover drift between runs)."""
        if not self.resid_std_ms or n_tokens <= 0:
            return float("nan")
        return 1.96 * self.resid_std_ms / math.sqrt(n_tokens)

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        d["bandwidth_mib_s"] = self.bandwidth_mib_s
        return d


def manual_model(flash_mib_s: float, compute_ms: float) -> CostModel:
    """First-principles model for users without recorded metrics: reads are serial with compute."""
    if not (flash_mib_s > 0 and math.isfinite(flash_mib_s)):
        raise UserError(f"--flash-mib-s {flash_mib_s} must be a positive bandwidth in MiB/s.")
    if not (compute_ms >= 0 and math.isfinite(compute_ms)) or compute_ms > MAX_MS:
        raise UserError(f"--compute-ms {compute_ms} must be a non-negative time in ms per token (at most a day).")
    if 1000.0 / flash_mib_s > MAX_MS:
        raise UserError(f"--flash-mib-s {flash_mib_s} is below any real bandwidth (more than a day per MiB).")
    return CostModel(model=FORMULAS["manual"], terms="manual", intercept_ms=float(compute_ms),
                     ms_per_mib=1000.0 / flash_mib_s, kind="manual",
                     notes=["manual model: assumes reads do not overlap compute and bandwidth is constant"])


# -- per-token features ----------------------------------------------------------------------

def recorded_token_features(trace: Trace, metrics: pl.DataFrame | None = None) -> pl.DataFrame:
    """One row per decoded token (in decode order): recorded ``wall_ms``, expert ``read_bytes``
    and ``misses`` as the engine's cache saw them.

    Bytes come from the trace's per-slot ``read_bytes`` (expert reads only) when present, else the
    metrics' ``read_bytes`` (which may include non-expert reads). Misses are slots whose recorded
    residency is 0 and that read bytes (a repeat inside one load reads nothing).
    """
    m = metrics if metrics is not None else trace.metrics()
    if m is None:
        raise UserError(f"{trace.path}: has no recorded per-token metrics (import with --metrics, or pass --metrics FILE).")
    a = trace.arrays()
    dec = a.phase == 1
    keys = np.stack([a.request_or_zero[dec], a.turn[dec], a.step[dec]], axis=1).astype(np.int64)
    uniq, inv = np.unique(keys, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    n_tok = uniq.shape[0]
    if m.height != n_tok:
        raise UserError(f"{trace.path}: the metrics hold {m.height} per-token rows but the trace has {n_tok} decode tokens.")
    if a.read_bytes is not None:
        rb = np.bincount(inv, weights=a.read_bytes[dec].sum(axis=1).astype(np.float64), minlength=n_tok)
        bytes_source = "trace read_bytes (expert reads)"
    else:
        rb = m["read_bytes"].to_numpy().astype(np.float64)
        bytes_source = "metrics read_bytes (all reads)"
    if a.residency is not None and a.read_bytes is not None:
        miss_slots = ((a.residency[dec] == 0) & (a.read_bytes[dec] > 0)).sum(axis=1)
    elif a.residency is not None:
        miss_slots = (a.residency[dec] == 0).sum(axis=1)
    else:
        miss_slots = np.zeros(int(dec.sum()))
    misses = np.bincount(inv, weights=miss_slots.astype(np.float64), minlength=n_tok)
    wall = m["wall_ms"].to_numpy().astype(np.float64)
    if not np.all(np.isfinite(wall)) or (wall <= 0).any() or (wall > MAX_MS).any():
        i = int(np.argmax(~np.isfinite(wall) | (wall <= 0) | (wall > MAX_MS)))
        raise UserError(f"{trace.path}: recorded wall_ms of decode token {i + 1} is {wall[i]:g}, not a time in (0, 1 day].")
    if a.read_bytes is not None and "read_bytes" in m.columns:
        # All bytes the engine read for a token include the expert bytes the trace says it read:
        # fewer means the metrics are another run's.
        total = m["read_bytes"].to_numpy().astype(np.float64)
        short = np.flatnonzero(total < rb)
        if short.size:
            i = int(short[0])
            raise UserError(f"{trace.path}: the metrics say decode token {i + 1} read {total[i]:.0f} bytes in all, fewer "
                            f"than the {rb[i]:.0f} bytes of expert reads the trace records; not the metrics of this run.")
    return pl.DataFrame({
        "token": np.arange(n_tok), "turn": uniq[:, 1], "step": uniq[:, 2], "wall_ms": wall,
        "read_bytes": rb, "misses": misses,
    }).with_columns(pl.lit(bytes_source).alias("bytes_source"))


# -- fitting -----------------------------------------------------------------------------------

def _design(f: pl.DataFrame, terms: str) -> np.ndarray:
    cols = [np.ones(f.height), f["read_bytes"].to_numpy() / MIB]
    if terms == "bytes+misses":
        cols.append(f["misses"].to_numpy())
    return np.column_stack(cols)


def _ols(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    return coef


def _r2(y: np.ndarray, pred: np.ndarray) -> float:
    ss = float(((y - y.mean()) ** 2).sum())
    return float(1.0 - ((y - pred) ** 2).sum() / ss) if ss > 0 else float("nan")


def _mape(y: np.ndarray, pred: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - y) / y) * 100.0)


def _run_mean_err(y: np.ndarray, pred: np.ndarray) -> float:
    """Signed error of the run's mean speed: predicted tok/s against recorded tok/s, in %."""
    rec, got = 1000.0 / float(y.mean()), 1000.0 / float(pred.mean())
    return (got - rec) / rec * 100.0


def fit_data_id(features: pl.DataFrame) -> str:
    """Content id of the recorded decode tokens a model is fitted on (their wall_ms, expert bytes
    and misses, in order): the same run gives the same id wherever its trace directory lives."""
    h = hashlib.sha256()
    for c in ("wall_ms", "read_bytes", "misses"):
        h.update(np.ascontiguousarray(features[c].to_numpy(), dtype="<f8").tobytes())
    return "sha256:" + h.hexdigest()[:16]


def fit_candidates(features: pl.DataFrame, source: str) -> list[CostModel]:
    """Fit each candidate on the first half of the decoded tokens, score on the second half
    (held out, later in time: drift shows), then refit the coefficients on all tokens.

    The held-out errors (per-token MAPE, and the error of the second half's mean speed) are the
    honest ones; r2 is on all tokens, and the refitted coefficients have seen every token."""
    n = features.height
    if n < 8:
        raise UserError(f"{source}: only {n} decoded tokens with metrics; a cost fit needs at least 8.")
    h = n // 2
    y = features["wall_ms"].to_numpy()
    out = []
    for terms in ("bytes", "bytes+misses"):
        X = _design(features, terms)
        if np.linalg.matrix_rank(X) < X.shape[1]:
            continue
        c_half = _ols(X[:h], y[:h])
        held = _mape(y[h:], X[h:] @ c_half)
        held_mean = _run_mean_err(y[h:], X[h:] @ c_half)
        c = _ols(X, y)
        pred = X @ c
        resid = y - pred
        if not np.isfinite(c).all() or not np.isfinite(c_half).all() or np.abs(c).max() > MAX_MS:
            raise UserError(f"{source}: the {terms} fit gives coefficients {', '.join(f'{x:g}' for x in c)}, not "
                            "plausible times; check the recorded wall_ms and read_bytes.")
        out.append(CostModel(
            model=FORMULAS[terms], terms=terms, intercept_ms=float(c[0]), ms_per_mib=float(c[1]),
            ms_per_miss=float(c[2]) if terms == "bytes+misses" else 0.0, r2=_r2(y, pred),
            heldout_mape_pct=held, heldout_run_mean_err_pct=held_mean, tokens_fit=h, tokens_heldout=n - h,
            resid_std_ms=float(resid.std(ddof=X.shape[1])), source=source, fit_trace_id=fit_data_id(features),
            fit_tokens=f"coefficients: decoded tokens 0..{n - 1}; held-out scores: fit on 0..{h - 1}, tested on {h}..{n - 1}",
        ))
    return out


def choose(cands: list[CostModel], margin: float = 0.95) -> CostModel:
    """The simplest model unless a richer one cuts held-out error by more than 5%."""
    best = cands[0]
    for c in cands[1:]:
        if c.heldout_mape_pct is not None and best.heldout_mape_pct is not None and \
                c.heldout_mape_pct < margin * best.heldout_mape_pct:
            best = c
    return best


def diagnose(model: CostModel, features: pl.DataFrame, metrics: pl.DataFrame | None) -> list[str]:
    """Plain sentences about what the model explains and what it cannot see on this run."""
    notes = []
    if model.ms_per_mib <= 0:
        notes.append("the fitted slope is not positive: on this run, bytes read do not explain wall time "
                     "(compute or page faults dominate); do not use this model to rank what-ifs")
    if model.r2 is not None and model.r2 < 0.3:
        notes.append(f"r2 {model.r2:.2f}: bytes explain little of the token-to-token variation; "
                     "the model gives the mean trend, not individual tokens")
    if metrics is not None and {"compute_ms", "wall_ms"} <= set(metrics.columns):
        comp = float(metrics["compute_ms"].mean())
        wall = float(metrics["wall_ms"].mean())
        notes.append(f"recorded compute is {comp:.0f} of {wall:.0f} ms mean wall per token; the model cannot "
                     "see compute changes, thermal throttling or page faults")
    if metrics is not None and "majflt" in metrics.columns and float(metrics["majflt"].mean()) > 100:
        notes.append(f"{float(metrics['majflt'].mean()):.0f} major page faults per token: memory pressure "
                     "adds time the byte count does not predict")
    return notes


def fit_trace(trace: Trace, metrics: pl.DataFrame | None = None) -> tuple[CostModel, list[CostModel], pl.DataFrame]:
    """(chosen model, all candidates, per-token features) for one trace with recorded metrics."""
    feats = recorded_token_features(trace, metrics)
    cands = fit_candidates(feats, str(trace.path))
    best = choose(cands)
    m = metrics if metrics is not None else trace.metrics()
    for c in cands:
        c.notes = diagnose(c, feats, m)
        c.fit_trace = str(trace.path)
    return best, cands, feats


def cross_trace(models: list[tuple[str, CostModel]], feats: list[tuple[str, pl.DataFrame]]) -> pl.DataFrame:
    """Each trace's model applied to every other trace's recorded tokens: MAPE of per-token wall
    and error of the run's mean ms/token."""
    rows = []
    for src, model in models:
        for tgt, f in feats:
            if src == tgt:
                continue
            y = f["wall_ms"].to_numpy()
            pred = model.predict_ms(f["read_bytes"].to_numpy(), f["misses"].to_numpy())
            rows.append({"fit_on": src, "tested_on": tgt, "mape_pct": _mape(y, pred),
                         "mean_ms_recorded": float(y.mean()), "mean_ms_predicted": float(pred.mean()),
                         "mean_err_pct": float((pred.mean() - y.mean()) / y.mean() * 100.0)})
    return pl.DataFrame(rows) if rows else pl.DataFrame()


# -- files -------------------------------------------------------------------------------------

def _model_number(p: Path, row: dict[str, Any], key: str, default: float | None = None) -> float | None:
    v = row.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise UserError(f"{p}: {key} {v!r} is not a finite number.")
    return float(v)


def check_model(m: CostModel, where: str) -> CostModel:
    """Refuse a model that would print nonsense times: a slope that is not a positive ms/MiB (more
    bytes read would make a token faster, down to negative ms), a negative per-miss cost, or an
    intercept outside -1 day..1 day per token."""
    if not (math.isfinite(m.ms_per_mib) and m.ms_per_mib > 0):
        raise UserError(f"{where}: ms_per_mib {m.ms_per_mib:g} is not a positive time per MiB read; reading more "
                        "bytes must not make a token faster (refit on a run where bytes explain the time).")
    if not (math.isfinite(m.ms_per_miss) and m.ms_per_miss >= 0):
        raise UserError(f"{where}: ms_per_miss {m.ms_per_miss:g} is not a non-negative time per miss.")
    if not (math.isfinite(m.intercept_ms) and abs(m.intercept_ms) <= MAX_MS):
        raise UserError(f"{where}: intercept_ms {m.intercept_ms:g} is not a plausible time per token (|x| <= 1 day).")
    if m.ms_per_mib > MAX_MS:
        raise UserError(f"{where}: ms_per_mib {m.ms_per_mib:g} is more than a day per MiB read.")
    return m


def load_cost_model(path: str | Path) -> CostModel:
    """Read a ``cost fit --json`` output (the row marked ``selected``) or a bare model object."""
    p = Path(path)
    if not p.is_file():
        # repr: a blank or odd path is visible in the sentence ("--cost-model ' '", not "--cost-model  ")
        raise UserError(f"--cost-model {str(path)!r}: no such cost-model file.")
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"{p}: is not JSON (expected the output of 'moe-replay cost fit --json').") from None
    row = obj
    if isinstance(obj, dict) and isinstance(obj.get("rows"), list):
        sel = [r for r in obj["rows"] if isinstance(r, dict) and r.get("selected")]
        row = sel[0] if sel else (obj["rows"][0] if obj["rows"] else None)
    if not isinstance(row, dict):
        raise UserError(f"{p}: holds no cost model row.")
    if row.get("intercept_ms") is None or row.get("ms_per_mib") is None:
        raise UserError(f"{p}: a cost model needs numeric intercept_ms and ms_per_mib.")
    intercept, slope = _model_number(p, row, "intercept_ms"), _model_number(p, row, "ms_per_mib")
    counts = {}
    for key in ("tokens_fit", "tokens_heldout"):
        v = row.get(key) or 0
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise UserError(f"{p}: {key} {v!r} is not a non-negative integer.")
        counts[key] = v
    notes = row.get("notes") or []
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise UserError(f"{p}: notes is not a list of strings.")
    for key in ("model", "terms", "kind", "source", "fit_trace", "fit_trace_id", "fit_tokens"):
        if row.get(key) is not None and not isinstance(row[key], str):
            raise UserError(f"{p}: {key} {row[key]!r} is not a string.")
    m = CostModel(
        model=str(row.get("model", FORMULAS["bytes"])), terms=str(row.get("terms", "bytes")), intercept_ms=intercept,  # type: ignore[arg-type]
        ms_per_mib=slope, ms_per_miss=_model_number(p, row, "ms_per_miss") or 0.0, kind=str(row.get("kind", "fit")),  # type: ignore[arg-type]
        r2=_model_number(p, row, "r2"), heldout_mape_pct=_model_number(p, row, "heldout_mape_pct"),
        heldout_run_mean_err_pct=_model_number(p, row, "heldout_run_mean_err_pct"),
        tokens_fit=counts["tokens_fit"], tokens_heldout=counts["tokens_heldout"],
        resid_std_ms=_model_number(p, row, "resid_std_ms"), source=row.get("source"), fit_trace=row.get("fit_trace"),
        fit_trace_id=row.get("fit_trace_id"), fit_tokens=row.get("fit_tokens"), notes=list(notes),
    )
    return check_model(m, str(p))


def add_time_columns(frame: pl.DataFrame, model: CostModel, read_mib_col: str, misses_col: str | None,
                     tokens_col: str) -> pl.DataFrame:
    """Add ``ms_per_token``, ``tok_s`` and ``ms_per_token_ci95`` to rows that carry decode-phase
    MiB read (``read_mib_col``), misses and the number of decoded tokens they cover."""
    tok = frame[tokens_col].cast(pl.Float64)
    mib_per_tok = frame[read_mib_col].cast(pl.Float64) / tok
    miss_per_tok = (frame[misses_col].cast(pl.Float64) / tok) if misses_col else pl.Series([0.0] * frame.height)
    ms = model.intercept_ms + model.ms_per_mib * mib_per_tok + model.ms_per_miss * miss_per_tok
    ci = pl.Series([model.interval_ms(int(n)) for n in frame[tokens_col].to_list()], dtype=pl.Float64)
    return frame.with_columns(
        ms_per_token=ms, tok_s=pl.when(ms > 0).then(1000.0 / ms).otherwise(None), ms_per_token_ci95=ci,
    )


# -- check against the device --------------------------------------------------------------------

def device_check(trace: Trace, model: CostModel | None = None, budget_mib: float | None = None) -> dict[str, Any]:
    """Does the replay + cost model reproduce the device's recorded speed?

    LRU is replayed at ``budget_mib`` (default: the recorded budget); the replay's own per-token
    expert bytes (not the recorded ones) go through the cost model. The prediction is compared
    with the recorded wall time per decoded token only at the budget the device ran at: at any
    other budget there is no recorded speed to compare with, so the row carries the prediction and
    no error (``compared`` False, ``not_compared_why``).

    Without a given model, one is fitted on the first half of the decoded tokens, so the second
    half is a genuine hold-out: ``heldout_run_mean_err_pct`` (predicted against recorded tok/s over
    the second half) and ``heldout_mape_pct`` (per-token MAPE over it). A given model whose fit
    provenance (``fit_trace_id``, else its source path) is this run is in-sample: its coefficients
    saw every token it is checked on, so its run-mean error is 0 by construction (least squares
    with an intercept), not a sign of accuracy. ``error_scope`` says which case a row is."""
    from replay.cache import decode_token_series, loads_of, replay

    recorded_budget = trace.recorded.get("budget_mib")
    budget = budget_mib if budget_mib is not None else recorded_budget
    if budget is None:
        raise UserError(f"{trace.path}: records no cache budget; pass --budget-mib.")
    feats = recorded_token_features(trace)
    n = feats.height
    h = n // 2
    if model is None:
        cands = fit_candidates(feats.head(h), f"{trace.path} (first {h} decoded tokens)")
        model = choose(cands)
        model.notes = diagnose(model, feats, trace.metrics())
        fitted_here = True
        scope = f"first {h} decoded tokens in-sample, last {n - h} held out"
    else:
        fitted_here = False
        if model.fit_trace_id is not None:
            same = model.fit_trace_id == fit_data_id(feats)
        else:
            same = model.source is not None and str(model.source) == str(trace.path)
        if same:
            scope = "in-sample (the model was fitted on this run's recorded tokens)"
        elif model.kind == "manual":
            scope = "out-of-sample (a manual model, fitted on nothing)"
        elif model.fit_trace_id is None:
            scope = "unknown (the model file records no fit provenance; re-fit it with 'cost fit --json')"
        else:
            scope = f"out-of-sample (the model was fitted on another run: {model.fit_trace or model.source})"
    loads = loads_of(trace)
    try:
        series = decode_token_series(loads, replay(loads, "lru", float(budget)))
    except UserError as e:
        raise UserError(f"{trace.path}: {e}") from None
    if series.height != n:
        raise UserError(f"{trace.path}: the replay has {series.height} decoded tokens, the metrics {n}.")
    pred = model.predict_ms(series["read_bytes"].to_numpy(), series["misses"].to_numpy())
    wall = feats["wall_ms"].to_numpy()
    rec_tok_s = 1000.0 / float(wall.mean())
    pred_tok_s = 1000.0 / float(pred.mean())
    compared = recorded_budget is not None and float(budget) == float(recorded_budget)
    row: dict[str, Any] = {
        "model": trace.model["name"], "budget_mib": float(budget), "recorded_budget_mib": recorded_budget,
        "policy": "lru", "tokens_decode": n, "compared": compared,
        "not_compared_why": None if compared else (
            f"the device ran at {exact(recorded_budget)} MiB, not {exact(float(budget))} MiB: its recorded speed is not a "
            "measurement of this budget" if recorded_budget is not None
            else "the trace records no budget, so its recorded speed cannot be tied to this one"),
        "error_scope": scope if compared else None,
        "recorded_tok_s": rec_tok_s if compared else None, "predicted_tok_s": pred_tok_s,
        "recorded_tok_s_at_recorded_budget": rec_tok_s,
        "tok_s_err_pct": (pred_tok_s - rec_tok_s) / rec_tok_s * 100.0 if compared else None,
        "token_mape_pct": _mape(wall, pred) if compared else None,
        "replay_read_mib_per_token": float(series["read_bytes"].to_numpy().mean()) / MIB,
        "recorded_read_mib_per_token": float(feats["read_bytes"].to_numpy().mean()) / MIB,
        "cost_model": model.model, "intercept_ms": model.intercept_ms, "ms_per_mib": model.ms_per_mib,
        "fitted_on": f"first {h} decoded tokens of this trace" if fitted_here else (model.fit_trace or model.source or "given file"),
        "model_heldout_mape_pct": None if fitted_here else model.heldout_mape_pct,
        "model_heldout_run_mean_err_pct": None if fitted_here else model.heldout_run_mean_err_pct,
    }
    if fitted_here and compared:
        row["heldout_recorded_tok_s"] = 1000.0 / float(wall[h:].mean())
        row["heldout_predicted_tok_s"] = 1000.0 / float(pred[h:].mean())
        row["heldout_run_mean_err_pct"] = _run_mean_err(wall[h:], pred[h:])
        row["heldout_mape_pct"] = _mape(wall[h:], pred[h:])
    return row


# -- applying a model to replay rows -------------------------------------------------------------

def __getattr__(name: str) -> Any:
    """``BOUNDS``: the offline bounds (policy constant BOUND), not something an engine can run.
    Computed on first use, not at import: it loads every policy module (~40 ms), which a
    ``cache --policies lru`` run does not need."""
    if name == "BOUNDS":
        return bound_policies()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cost_model_from_options(path: str | Path | None, flash_mib_s: float | None, compute_ms: float | None) -> CostModel | None:
    """--cost-model FILE, or the manual --flash-mib-s/--compute-ms pair, or None."""
    if path is not None and (flash_mib_s is not None or compute_ms is not None):
        raise UserError("--cost-model and --flash-mib-s/--compute-ms are alternatives; give one.")
    if path is not None:
        return load_cost_model(path)
    if (flash_mib_s is None) != (compute_ms is None):
        raise UserError("a manual cost model needs both --flash-mib-s and --compute-ms.")
    if flash_mib_s is not None:
        return manual_model(flash_mib_s, compute_ms)  # type: ignore[arg-type]
    return None


def with_time(frame: pl.DataFrame, model: CostModel, tokens_decode: int) -> pl.DataFrame:
    """Cache rows + ``ms_per_token``/``tok_s``/``ms_per_token_ci95`` for the decode phase."""
    if tokens_decode <= 0:
        raise UserError("the trace has no decoded tokens, so there is no time per decoded token to estimate.")
    f = frame.with_columns(pl.lit(tokens_decode).alias("tokens_decode"),
                           (pl.col("lookups_decode") - pl.col("hits_decode")).alias("misses_decode"))
    return add_time_columns(f, model, "read_mib_decode", "misses_decode", "tokens_decode")


