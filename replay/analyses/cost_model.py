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
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from replay.analyses.cost_sense import MAX_FLASH_MIB_S, MAX_MS, check_coefficients, check_times, extrapolated, interval_half_ms
from replay.core.run_identity import check_metrics_of_run, decode_token_index
from replay.policies import bound_policies
from traces.format.errors import UserError
from traces.io.reader import Trace
from traces.util.units import MIB, exact

MAX_COUNT = (1 << 63) - 1  # token counts and degrees of freedom in a model file

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
    # What the coefficients were fitted on (replay.analyses.cost_origin.trace_origin): model, arch, per-layer
    # expert bytes, engine and device, the trace's content hash. None: manual, or a file from
    # before origins were recorded (applied only as foreign).
    origin: dict[str, Any] | None = None
    # For the prediction interval (replay.analyses.cost_sense): (X'X)^-1 of the fit's design, its residual
    # degrees of freedom, and the range of the fitted tokens' regressors (extrapolation beyond it).
    cov_unscaled: list[list[float]] | None = None
    df_resid: int | None = None
    fit_read_mib_min: float | None = None
    fit_read_mib_max: float | None = None
    fit_misses_min: float | None = None
    fit_misses_max: float | None = None
    # Not saved: set on the copy applied to a trace of another model or device (replay.analyses.cost_origin),
    # and the file a loaded model came from (for messages).
    foreign: bool = False
    loaded_from: str | None = None

    @property
    def bandwidth_mib_s(self) -> float | None:
        """Effective read bandwidth the slope implies (MiB/s); None if the slope is not positive."""
        return 1000.0 / self.ms_per_mib if self.ms_per_mib > 0 else None

    def predict_ms(self, read_bytes: np.ndarray | float, misses: np.ndarray | float = 0.0) -> np.ndarray:
        """Predicted ms per decoded token for per-token expert bytes read (and misses)."""
        rb = np.asarray(read_bytes, dtype=np.float64) / MIB
        return self.intercept_ms + self.ms_per_mib * rb + self.ms_per_miss * np.asarray(misses, dtype=np.float64)

    def interval_ms(self, n_tokens: int, read_mib_per_token: float | None = None, misses_per_token: float = 0.0) -> float:
        """Half-width of the 95% prediction interval of the mean ms/token of ``n_tokens`` new
        decoded tokens reading ``read_mib_per_token`` MiB each on average (replay.analyses.cost_sense:
        residual and coefficient terms; the latter grows with the distance from the fitted read
        volumes). It assumes independent per-token errors; it does not cover drift between runs."""
        if n_tokens <= 0:
            return float("nan")
        x = self.fit_read_mib_mean if read_mib_per_token is None else read_mib_per_token
        return float(interval_half_ms(self, np.array([x if x is not None else 0.0]), np.array([misses_per_token]),
                                      np.array([n_tokens]))[0])

    @property
    def fit_read_mib_mean(self) -> float | None:
        """The fitted tokens' mean MiB read per token (where the interval is narrowest)."""
        if self.cov_unscaled is None:
            return None
        C = np.asarray(self.cov_unscaled)
        # (X'X)^-1 of [1, x]: the mean is -C[0,1]/C[1,1] (for the misses model, at the mean misses)
        return float(-C[0, 1] / C[1, 1]) if self.terms == "bytes" else None

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        del d["foreign"], d["loaded_from"]
        d["bandwidth_mib_s"] = self.bandwidth_mib_s
        return d


def manual_model(flash_mib_s: float, compute_ms: float) -> CostModel:
    """First-principles model for users without recorded metrics: reads are serial with compute."""
    if not (flash_mib_s > 0 and math.isfinite(flash_mib_s)):
        raise UserError(f"--flash-mib-s {flash_mib_s} must be a positive bandwidth in MiB/s.")
    if flash_mib_s > MAX_FLASH_MIB_S:
        raise UserError(f"--flash-mib-s {flash_mib_s:g} is above any device's read bandwidth (at most "
                        f"{MAX_FLASH_MIB_S:,.0f} MiB/s).")
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
    a = trace.arrays(recorded=True)
    check_metrics_of_run(trace, m, a)  # token count, order, the run's own totals: the same check as cache --validate
    dec, inv, uniq = decode_token_index(a)
    n_tok = uniq.shape[0]
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
        mib = X[:, 1]
        out.append(CostModel(
            model=FORMULAS[terms], terms=terms, intercept_ms=float(c[0]), ms_per_mib=float(c[1]),
            ms_per_miss=float(c[2]) if terms == "bytes+misses" else 0.0, r2=_r2(y, pred),
            heldout_mape_pct=held, heldout_run_mean_err_pct=held_mean, tokens_fit=h, tokens_heldout=n - h,
            resid_std_ms=float(resid.std(ddof=X.shape[1])), source=source,
            fit_trace_id=fit_data_id(features),
            fit_tokens=f"coefficients: decoded tokens 0..{n - 1}; held-out scores: fit on 0..{h - 1}, tested on {h}..{n - 1}",
            cov_unscaled=np.linalg.inv(X.T @ X).tolist(), df_resid=int(n - X.shape[1]),
            fit_read_mib_min=float(mib.min()), fit_read_mib_max=float(mib.max()),
            fit_misses_min=float(X[:, 2].min()) if terms == "bytes+misses" else None,
            fit_misses_max=float(X[:, 2].max()) if terms == "bytes+misses" else None,
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
    if model.intercept_ms < 0:
        notes.append(f"the fitted intercept is negative ({model.intercept_ms:.1f} ms): a token reading nothing would take "
                     "less than no time, so --cost-model refuses this model; the line holds only near the fitted volumes")
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


def fit_trace(trace: Trace, metrics: pl.DataFrame | None = None,
              origin: bool = True) -> tuple[CostModel, list[CostModel], pl.DataFrame]:
    """(chosen model, all candidates, per-token features) for one trace with recorded metrics.
    ``origin``: record what the model was fitted on (replay.analyses.cost_origin; it hashes every file of
    the trace); a model used only on the trace it was fitted on (the report's own) can skip it."""
    from replay.analyses.cost_origin import trace_origin

    feats = recorded_token_features(trace, metrics)
    cands = fit_candidates(feats, str(trace.path))
    best = choose(cands)
    m = metrics if metrics is not None else trace.metrics()
    where = trace_origin(trace) if origin else None
    for c in cands:
        c.notes = diagnose(c, feats, m)
        c.fit_trace = str(trace.path)
        c.origin = dict(where) if where is not None else None
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


def _model_count(p: Path, row: dict[str, Any], key: str) -> int | None:
    v = row.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT:
        raise UserError(f"{p}: {key} {v!r} is not a non-negative integer (at most 2^63-1).")
    return v


def _model_range(p: Path, row: dict[str, Any], lo: str, hi: str) -> tuple[float | None, float | None]:
    a, b = _model_number(p, row, lo), _model_number(p, row, hi)
    if (a is None) != (b is None) or (a is not None and not 0 <= a <= b <= MAX_MS):  # type: ignore[operator]
        raise UserError(f"{p}: {lo} {row.get(lo)!r} and {hi} {row.get(hi)!r} are not a range of non-negative values.")
    return a, b


def _model_cov(p: Path, row: dict[str, Any], terms: str) -> list[list[float]] | None:
    v = row.get("cov_unscaled")
    if v is None:
        return None
    k = 3 if terms == "bytes+misses" else 2
    ok = (isinstance(v, list) and len(v) == k and all(isinstance(r, list) and len(r) == k for r in v)
          and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for r in v for x in r))
    if ok:
        C = np.asarray(v, dtype=np.float64)
        ok = bool(np.allclose(C, C.T, rtol=1e-6, atol=0.0) and (np.diag(C) > 0).all())
    if not ok:
        raise UserError(f"{p}: cov_unscaled is not the {k} x {k} symmetric matrix (X'X)^-1 of a {terms} fit.")
    return [[float(x) for x in r] for r in v]


def _model_origin(p: Path, row: dict[str, Any]) -> dict[str, Any] | None:
    v = row.get("origin")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise UserError(f"{p}: origin {v!r} is not an object (model, arch, expert_bytes, engine, ...).")
    for key in ("model", "arch", "engine", "engine_version", "device", "trace_content_sha256"):
        if v.get(key) is not None and not isinstance(v[key], str):
            raise UserError(f"{p}: origin.{key} {v[key]!r} is not a string.")
    eb = v.get("expert_bytes")
    if not isinstance(eb, list) or not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b <= MAX_COUNT for b in eb):
        raise UserError(f"{p}: origin.expert_bytes is not a list of byte counts.")
    return dict(v)


def check_model(m: CostModel, where: str) -> CostModel:
    """Refuse a model that would print nonsense times (replay.analyses.cost_sense.check_coefficients): a
    slope that is not a positive ms/MiB within the physical bounds (more bytes read would make a
    token faster, down to negative ms; or a bandwidth no device has), a negative intercept or
    per-miss cost, or any of them beyond a day."""
    check_coefficients(m, where)
    return m


def load_cost_model(path: str | Path) -> CostModel:
    """Read a ``cost fit --json`` output (the row marked ``selected``) or a bare model object.
    The file is read with bounds (traces.util.bounded_json: nesting depth, integer size), and every
    field is checked before the model is built."""
    from traces.io.atomic import note_input
    from traces.util.bounded_json import read_bounded

    p = Path(path)
    note_input(p)  # an input of the command: no output of it may replace it
    if not p.is_file():
        # repr: a blank or odd path is visible in the sentence ("--cost-model ' '", not "--cost-model  ")
        raise UserError(f"--cost-model {str(path)!r}: no such cost-model file.")
    obj = read_bounded(p, what="cost-model", hint=" (expected the output of 'moe-replay cost fit --json')")
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
        counts[key] = _model_count(p, row, key) or 0
    notes = row.get("notes") or []
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise UserError(f"{p}: notes is not a list of strings.")
    for key in ("model", "terms", "kind", "source", "fit_trace", "fit_trace_id", "fit_tokens"):
        if row.get(key) is not None and not isinstance(row[key], str):
            raise UserError(f"{p}: {key} {row[key]!r} is not a string.")
    terms = str(row.get("terms", "bytes"))
    if terms not in FORMULAS:
        raise UserError(f"{p}: terms {terms!r} is not one of {', '.join(FORMULAS)}.")
    kind = str(row.get("kind", "fit"))
    if kind not in ("fit", "manual"):
        raise UserError(f"{p}: kind {kind!r} is not fit or manual.")
    rmin, rmax = _model_range(p, row, "fit_read_mib_min", "fit_read_mib_max")
    mmin, mmax = _model_range(p, row, "fit_misses_min", "fit_misses_max")
    df = _model_count(p, row, "df_resid")
    if df == 0:
        raise UserError(f"{p}: df_resid 0 leaves no residual to estimate an interval from.")
    m = CostModel(
        model=str(row.get("model", FORMULAS["bytes"])), terms=terms, intercept_ms=intercept,  # type: ignore[arg-type]
        ms_per_mib=slope, ms_per_miss=_model_number(p, row, "ms_per_miss") or 0.0, kind=kind,  # type: ignore[arg-type]
        r2=_model_number(p, row, "r2"), heldout_mape_pct=_model_number(p, row, "heldout_mape_pct"),
        heldout_run_mean_err_pct=_model_number(p, row, "heldout_run_mean_err_pct"),
        tokens_fit=counts["tokens_fit"], tokens_heldout=counts["tokens_heldout"],
        resid_std_ms=_model_number(p, row, "resid_std_ms"), source=row.get("source"), fit_trace=row.get("fit_trace"),
        fit_trace_id=row.get("fit_trace_id"), fit_tokens=row.get("fit_tokens"), notes=list(notes),
        origin=_model_origin(p, row), cov_unscaled=_model_cov(p, row, terms), df_resid=df,
        fit_read_mib_min=rmin, fit_read_mib_max=rmax, fit_misses_min=mmin, fit_misses_max=mmax, loaded_from=str(p),
    )
    return check_model(m, str(p))


def add_time_columns(frame: pl.DataFrame, model: CostModel, read_mib_col: str, misses_col: str | None,
                     tokens_col: str) -> pl.DataFrame:
    """Add ``ms_per_token``, ``tok_s``, ``ms_per_token_ci95`` and ``extrapolated`` to rows that
    carry decode-phase MiB read (``read_mib_col``), misses and the number of decoded tokens they
    cover (and ``cost_model_foreign`` when the model is a foreign one, replay.analyses.cost_origin).

    ``ms_per_token_ci95``: half-width of the 95% prediction interval of the rows' mean ms/token
    (replay.analyses.cost_sense), wider the further the row's read volume is from the fitted ones;
    ``extrapolated``: the row's read volume per token lies outside the fitted tokens' (None for a
    model with no fitted range). Every time is checked for sense first: a model that gives a time
    outside the physical bounds at some row is refused with the row's budget named."""
    tok = frame[tokens_col].cast(pl.Float64).to_numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        mib_per_tok = frame[read_mib_col].cast(pl.Float64).to_numpy() / tok
        miss_per_tok = (frame[misses_col].cast(pl.Float64).to_numpy() / tok) if misses_col else np.zeros(frame.height)
    ms = model.intercept_ms + model.ms_per_mib * mib_per_tok + model.ms_per_miss * miss_per_tok
    check_times(model, ms, _cells(frame))
    ci = interval_half_ms(model, mib_per_tok, miss_per_tok, tok)
    out = frame.with_columns(
        ms_per_token=pl.Series(ms, dtype=pl.Float64), tok_s=pl.Series(1000.0 / ms, dtype=pl.Float64),
        ms_per_token_ci95=pl.Series(ci, dtype=pl.Float64),
        extrapolated=pl.Series(extrapolated(model, mib_per_tok, miss_per_tok), dtype=pl.Boolean),
    )
    if model.foreign:
        out = out.with_columns(cost_model_foreign=pl.lit(True))
    return out


def _cells(frame: pl.DataFrame) -> list[str]:
    """How a refusal names each row: its budget (and policy, when the rows have one)."""
    cols = frame.columns
    out = []
    for r in frame.select([c for c in ("policy", "budget_mib", "frac", "mode") if c in cols]).to_dicts() if cols else []:
        bits = [f"at {exact(float(r['budget_mib']))} MiB" if r.get("budget_mib") is not None else "at the recorded residency"]
        if r.get("policy") is not None:
            bits.append(f"({r['policy']}" + (f", drop F={r['frac']:g})" if r.get("frac") is not None else ")"))
        out.append(" ".join(bits))
    return out or ["" for _ in range(frame.height)]


# -- check against the device --------------------------------------------------------------------

def device_check(trace: Trace, model: CostModel | None = None, budget_mib: float | None = None, *,
                 foreign: bool = False) -> dict[str, Any]:
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
    with an intercept), not a sign of accuracy. ``error_scope`` says which case a row is.

    A given model fitted on another model or device is refused unless ``foreign``
    (replay.analyses.cost_origin.apply_to); then the row carries ``cost_model_foreign``. A model whose
    prediction for some token is not a time (replay.analyses.cost_sense) is refused, the budget named."""
    from replay.analyses.cost_origin import apply_to
    from replay.core.simulate import decode_token_series, loads_of, replay

    model = apply_to(model, trace, foreign=foreign)

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
    check_times(model, pred, [f"at {exact(float(budget))} MiB (lru, decode token {i + 1})" for i in range(n)])
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
    if model.foreign:
        row["cost_model_foreign"] = True
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
    """Cache rows + ``ms_per_token``/``tok_s``/``ms_per_token_ci95``/``extrapolated`` for the
    decode phase (:func:`add_time_columns`). Whether ``model`` may be applied to the rows' trace is
    the caller's check (replay.analyses.cost_origin.apply_to): the rows do not say which trace they are."""
    if tokens_decode <= 0:
        raise UserError("the trace has no decoded tokens, so there is no time per decoded token to estimate.")
    f = frame.with_columns(pl.lit(tokens_decode).alias("tokens_decode"),
                           (pl.col("lookups_decode") - pl.col("hits_decode")).alias("misses_decode"))
    return add_time_columns(f, model, "read_mib_decode", "misses_decode", "tokens_decode")


