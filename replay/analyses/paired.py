"""Paired comparisons with their noise: is one setting better than another on this trace, or a tie?

Two settings replayed on the same trace see the same tokens, so their per-token figures are
paired. The difference of a figure between two settings (decode hit %, MiB read per decoded
token, ms per decoded token under a cost model) gets a confidence interval from a *seeded
circular block bootstrap over decoded tokens* (docs/design.md, "Paired comparisons"):

- the unit is a decode batch (one decoded token for a single request; with several requests in
  one batch, the batch, its tokens counted for per-token figures): the kernel's per-batch
  counters (``ReplayResult.bacc``: lookups, hits, bytes read), kept by the in-memory and the
  streamed replay alike;
- the units are resampled in blocks of ``block_tokens(n) = max(16, ceil(sqrt(n)))`` consecutive
  units (the cache remembers, so neighbouring tokens' hits are correlated; circular: a block
  may wrap from the last unit to the first), the same blocks for both settings (paired); when the
  trace has requests, each decode batch serving one, whole requests (:func:`request_units`);
- a ratio is recomputed on each resample as a ratio of sums (hit % = sum hits / sum lookups,
  MiB per token = sum bytes / sum tokens), never a mean of per-token ratios;
- ms per token under a cost model is linear in MiB and misses per token, so its difference is
  ``ms_per_mib x d(MiB/token) + ms_per_miss x d(misses/token)`` on the same resamples;
- the 95% interval is the difference ± t(0.975, b - 1) x SE, SE the standard deviation of
  ``resamples`` = 2000 resampled differences and b the number of blocks (a short trace has few
  blocks: the t quantile widens the interval for it; docs/design.md gives the coverage measured
  while choosing it), drawn by
  ``numpy.random.default_rng(seed)`` (seed 0): the same inputs give the same interval, byte for byte.

:func:`call` turns an interval into the one answer every surface prints: "better" or "worse"
only when the interval excludes zero, else "tie" (printed "tie within noise (±x)", x the
interval's half-width). :func:`decide` applies it to one budget's rows: the best within-budget
online setting (:func:`replay.core.simulate.pick_best`), the settings tied with it, and how it compares
with LRU. The report's verdict, ``cache``, ``sweep-report`` and the API all go through it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from replay.core.series import DecodeSeries, series_of, whatif_series  # noqa: F401 (re-exported: the series paired comparisons resample)

RESAMPLES = 2000
SEED = 0
MIN_BLOCK = 16
BASELINE = "lru"


def block_tokens(n: int) -> int:
    """Units per bootstrap block: max(16, ceil(sqrt(n))) (at most n)."""
    return max(1, min(n, max(MIN_BLOCK, math.ceil(math.sqrt(n)))))


MIN_REQUESTS = 8


def request_units(trace: Any) -> np.ndarray | None:
    """The request of each decode batch, numbered 0.. (requests resampled whole), when the trace has a
    ``request`` column, every decode batch serves one request and at least :data:`MIN_REQUESTS`
    requests decode; else None (blocks of decode batches: one request, or batches that serve
    several requests at once, whose reads cannot be split between them)."""
    if trace is None or not trace.has("request"):
        return None
    t = trace.table(["batch", "phase", "request"])
    dec = t.column("phase").to_numpy() == 1
    b, rq = t.column("batch").to_numpy()[dec], t.column("request").to_numpy()[dec]
    if b.size == 0:
        return None
    change = np.r_[True, b[1:] != b[:-1]]
    first = rq[np.flatnonzero(change)]
    if (rq != first[np.cumsum(change) - 1]).any():
        return None  # a decode batch serves several requests
    _, units = np.unique(first, return_inverse=True)
    return units.astype(np.int64) if int(units.max()) + 1 >= MIN_REQUESTS else None


def with_requests(series: dict[Any, DecodeSeries], trace: Any) -> dict[Any, DecodeSeries]:
    """``series`` with each decode batch's request (:func:`request_units`) where the trace has them."""
    import dataclasses

    units = request_units(trace)
    if units is None:
        return series
    return {k: dataclasses.replace(s, requests=units) if len(s) == units.shape[0] else s for k, s in series.items()}


@dataclass(frozen=True)
class Diff:
    """A paired difference (a - b) and its interval; ``n`` units, ``block`` units per block."""

    delta: float
    low: float
    high: float
    n: int
    block: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2.0


def _resampled_sums(cols: np.ndarray, rng: np.random.Generator, resamples: int,
                    requests: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """(Sums of each column of ``cols`` [n, c] over ``resamples`` resamples: [resamples, c]; the
    degrees of freedom of the interval). With ``requests``, whole requests are resampled (G
    requests drawn with replacement: G - 1 degrees of freedom); else circular blocks of
    :func:`block_tokens` units (b blocks: b - 1)."""
    n, c = cols.shape
    if requests is not None:
        G = int(requests.max()) + 1
        per = np.zeros((G, c), np.float64)
        np.add.at(per, requests, cols.astype(np.float64))
        out = np.empty((resamples, c), np.float64)
        step = max(1, 4_000_000 // G)
        for a in range(0, resamples, step):
            m = min(step, resamples - a)
            out[a:a + m] = per[rng.integers(0, G, size=(m, G))].sum(axis=1)
        return out, G - 1
    L = block_tokens(n)
    nb = math.ceil(n / L)
    lens = np.full(nb, L, np.int64)
    lens[-1] = n - L * (nb - 1)
    cum = np.zeros((2 * n + 1, c), np.float64)
    cum[1:] = np.cumsum(np.concatenate([cols, cols]).astype(np.float64), axis=0)
    out = np.empty((resamples, c), np.float64)
    step = max(1, 4_000_000 // max(nb, 1))
    for a in range(0, resamples, step):
        m = min(step, resamples - a)
        starts = rng.integers(0, n, size=(m, nb))
        out[a:a + m] = (cum[starts + lens] - cum[starts]).sum(axis=1)
    return out, nb - 1


Z975 = 1.959963984540054
_T975 = {1: 12.706204736174705, 2: 4.302652729749464, 3: 3.182446305284263, 4: 2.7764451051977934}


def t975(df: int) -> float:
    """Student's t 97.5% quantile: exact for 1-4 degrees of freedom, else the Cornish-Fisher
    expansion to 1/df^4 (within 0.001 from 5 on)."""
    if df in _T975:
        return _T975[df]
    z, v = Z975, float(df)
    return (z + (z ** 3 + z) / 4 / v + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96 / v ** 2
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384 / v ** 3
            + (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160 / v ** 4)


def _interval(point: float, draws: np.ndarray, n: int, df: int) -> Diff:
    """point ± t(0.975, df) x the standard deviation of the resampled differences (df = blocks - 1,
    or requests - 1)."""
    draws = draws[np.isfinite(draws)]
    L = block_tokens(n)
    if draws.size < 2 or df < 1:
        return Diff(float(point), math.nan, math.nan, n, L)
    h = t975(df) * float(np.std(draws, ddof=1))
    return Diff(float(point), float(point) - h, float(point) + h, n, L)


def _requests(a: DecodeSeries, b: DecodeSeries) -> np.ndarray | None:
    return a.requests if a.requests is not None else b.requests


def _check(a: DecodeSeries, b: DecodeSeries) -> None:
    if len(a) != len(b) or not np.array_equal(a.tokens, b.tokens):
        raise ValueError("paired series must cover the same decode batches")


def diff_hit_pp(a: DecodeSeries, b: DecodeSeries, *, seed: int = SEED, resamples: int = RESAMPLES) -> Diff:
    """Decode hit % of ``a`` minus that of ``b``, in points, with its interval."""
    _check(a, b)
    n = len(a)
    if n == 0 or a.lookups.sum() == 0 or b.lookups.sum() == 0:
        return Diff(math.nan, math.nan, math.nan, n, block_tokens(n))
    point = 100.0 * (a.hits.sum() / a.lookups.sum() - b.hits.sum() / b.lookups.sum())
    s, df = _resampled_sums(np.stack([a.hits, a.lookups, b.hits, b.lookups], axis=1), np.random.default_rng(seed), resamples,
                            _requests(a, b))
    with np.errstate(divide="ignore", invalid="ignore"):
        d = 100.0 * (s[:, 0] / s[:, 1] - s[:, 2] / s[:, 3])
    return _interval(point, d, n, df)


def diff_per_token(a: DecodeSeries, b: DecodeSeries, *, ms_per_mib: float = 1.0, ms_per_miss: float = 0.0,
                   seed: int = SEED, resamples: int = RESAMPLES) -> Diff:
    """Per decoded token, ``ms_per_mib`` x MiB read + ``ms_per_miss`` x misses, of ``a`` minus ``b``
    (the defaults give MiB read per token; a cost model's slopes give ms per token, its intercept
    cancelling in the difference)."""
    _check(a, b)
    n = len(a)
    if n == 0 or a.tokens.sum() == 0:
        return Diff(math.nan, math.nan, math.nan, n, block_tokens(n))
    mib = float(1 << 20)

    def cost(read: np.ndarray, look: np.ndarray, hit: np.ndarray) -> np.ndarray:
        return ms_per_mib * (read / mib) + ms_per_miss * (look - hit)

    da = cost(a.read_bytes.astype(np.float64), a.lookups.astype(np.float64), a.hits.astype(np.float64))
    db = cost(b.read_bytes.astype(np.float64), b.lookups.astype(np.float64), b.hits.astype(np.float64))
    point = float((da.sum() - db.sum()) / a.tokens.sum())
    s, df = _resampled_sums(np.stack([da - db, a.tokens.astype(np.float64)], axis=1), np.random.default_rng(seed), resamples,
                            _requests(a, b))
    with np.errstate(divide="ignore", invalid="ignore"):
        d = s[:, 0] / s[:, 1]
    return _interval(point, d, n, df)


def diff_ms(a_ms: np.ndarray, b_ms: np.ndarray, tokens: np.ndarray, *, requests: np.ndarray | None = None,
            seed: int = SEED, resamples: int = RESAMPLES) -> Diff:
    """Per decoded token, the time of ``a`` minus that of ``b`` given per decode batch (ms, e.g. a
    timeline's, replay.analyses.timeline), with its interval: the same blocks (or whole requests) as
    every other paired figure, a ratio of sums on each resample. A timeline's tokens are not
    independent (read lanes carry over), which the blocks are there for."""
    a = np.asarray(a_ms, np.float64)
    b = np.asarray(b_ms, np.float64)
    tok = np.asarray(tokens, np.float64)
    n = a.shape[0]
    if n == 0 or b.shape[0] != n or tok.sum() == 0:
        return Diff(math.nan, math.nan, math.nan, n, block_tokens(n))
    point = float((a.sum() - b.sum()) / tok.sum())
    s, df = _resampled_sums(np.stack([a - b, tok], axis=1), np.random.default_rng(seed), resamples, requests)
    with np.errstate(divide="ignore", invalid="ignore"):
        d = s[:, 0] / s[:, 1]
    return _interval(point, d, n, df)


def call(d: Diff | None, higher_is_better: bool = True) -> str | None:
    """"better" / "worse" (the interval excludes zero) or "tie"; None without an interval."""
    if d is None or not (math.isfinite(d.low) and math.isfinite(d.high)):
        return None
    if d.low > 0 or d.high < 0:
        return "better" if (d.low > 0) == higher_is_better else "worse"
    return "tie"


def tie_text(half_width: float, unit: str) -> str:
    """"tie within noise (±x unit)"."""
    return f"tie within noise (±{_num(half_width)}{unit})"


def _digits(v: float) -> int:
    """Decimals that show ``v``: one from 0.05 up, else enough for its first significant digit (two at
    least, six at most), so a small non-zero difference never prints as a signed zero ("-0.00")."""
    if v == 0 or abs(v) >= 0.05:
        return 1
    return max(2, min(6, -math.floor(math.log10(abs(v)))))


def _num(v: float, sign: str = "") -> str:
    if v is None or not math.isfinite(v):
        return "-"
    if v != 0 and abs(v) < 5e-7:  # below six decimals: its order of magnitude, still not a zero
        return f"{v:{sign}.0e}"
    return f"{v:{sign}.{_digits(v)}f}"


def signed(v: float | None) -> str:
    return _num(v, "+")


# -- columns on cache rows, and the one decision --------------------------------------------------

HIT_COLUMNS = ("delta_vs_lru_pp", "delta_ci_low", "delta_ci_high", "vs_lru", "tied_with_best")
TIME_COLUMNS = ("delta_ms_vs_lru", "delta_ms_ci_low", "delta_ms_ci_high", "vs_lru_time", "tied_with_fastest")


def annotate(rows: list[dict[str, Any]], series: dict[tuple[str, float], DecodeSeries], model: Any = None, *,
             seed: int = SEED, resamples: int = RESAMPLES) -> None:
    """Add, in place, to every overall cache row (``layer`` None) of a replayed (policy, budget)
    cell: its decode hit % minus LRU's at the same budget with the interval (``delta_vs_lru_pp``,
    ``delta_ci_low``, ``delta_ci_high``, ``vs_lru`` = better | worse | tie), and whether it is
    the best within-budget online policy or tied with it (``tied_with_best``); with a cost model
    the same for ms per decoded token (``delta_ms_vs_lru``, ``delta_ms_ci_low``,
    ``delta_ms_ci_high``, ``vs_lru_time``, ``tied_with_fastest``). None where it does not apply
    (no LRU replayed, a bound, an over-budget cell, no series)."""
    from replay.core.simulate import is_over_budget, pick_best
    from replay.policies import bound_policies

    bounds = set(bound_policies())
    overall = [r for r in rows if r.get("layer") is None]
    for r in overall:
        for k in HIT_COLUMNS + (TIME_COLUMNS if model is not None else ()):
            r[k] = None
    slopes = (dict(ms_per_mib=model.ms_per_mib, ms_per_miss=model.ms_per_miss) if model is not None else None)
    for b in dict.fromkeys(r["budget_mib"] for r in overall):
        at = [r for r in overall if r["budget_mib"] == b and (r["policy"], b) in series]
        base = next((r for r in at if r["policy"] == BASELINE), None)
        ok = [r for r in at if r["policy"] not in bounds and not is_over_budget(r)]
        best = pick_best(ok, "hit_pct_decode", highest=True)
        fastest = pick_best(ok, "ms_per_token", highest=False) if model is not None else None
        ok_ids = {id(r) for r in ok}
        for r in at:
            s = series[(r["policy"], b)]
            if base is not None and r is not base:
                d = diff_hit_pp(s, series[(BASELINE, b)], seed=seed, resamples=resamples)
                r.update(delta_vs_lru_pp=d.delta, delta_ci_low=d.low, delta_ci_high=d.high, vs_lru=call(d))
                if slopes is not None:
                    d = diff_per_token(s, series[(BASELINE, b)], seed=seed, resamples=resamples, **slopes)
                    r.update(delta_ms_vs_lru=d.delta, delta_ms_ci_low=d.low, delta_ms_ci_high=d.high,
                             vs_lru_time=call(d, higher_is_better=False))
            elif r is base:
                r.update(delta_vs_lru_pp=0.0, delta_ci_low=0.0, delta_ci_high=0.0)
                if slopes is not None:
                    r.update(delta_ms_vs_lru=0.0, delta_ms_ci_low=0.0, delta_ms_ci_high=0.0)
            if id(r) in ok_ids and best is not None:
                r["tied_with_best"] = r is best or call(diff_hit_pp(s, series[(best["policy"], b)], seed=seed,
                                                                    resamples=resamples)) == "tie"
            if id(r) in ok_ids and fastest is not None and slopes is not None:
                r["tied_with_fastest"] = r is fastest or call(diff_per_token(s, series[(fastest["policy"], b)], seed=seed,
                                                                             resamples=resamples, **slopes)) == "tie"


def decide(rows: list[dict[str, Any]], value: str = "hit_pct_decode") -> dict[str, Any] | None:
    """The one rule every surface names a "best" by, on one budget's annotated rows (:func:`annotate`):
    the best within-budget online row by ``value`` (hit_pct_decode, highest; ms_per_token, lowest),
    the online rows tied with it (in the order given), and how it compares with LRU: ``call``
    better | worse | tie (None: no interval), ``delta`` / ``low`` / ``high`` (best minus LRU:
    points of decode hit %, or ms per token), ``text``, a phrase for the line that names it. None
    when no online row stays within budget."""
    from replay.core.simulate import is_over_budget, pick_best
    from replay.policies import bound_policies

    bounds = set(bound_policies())
    timed = value == "ms_per_token"
    ok = [r for r in rows if r.get("layer") is None and r["policy"] not in bounds and not is_over_budget(r)]
    best = pick_best(ok, value, highest=not timed)
    if best is None:
        return None
    tcol = "tied_with_fastest" if timed else "tied_with_best"
    tied = [r["policy"] for r in ok if r is not best and r.get(tcol)]
    pre = "delta_ms" if timed else "delta"
    d, lo, hi = (best.get(f"{pre}_vs_lru" if timed else "delta_vs_lru_pp"), best.get(f"{pre}_ci_low"),
                 best.get(f"{pre}_ci_high"))
    verdict = best.get("vs_lru_time" if timed else "vs_lru")
    unit = " ms/token" if timed else " points"
    if best["policy"] == BASELINE:
        text = "that is LRU"
    elif verdict is None:
        text = ("no paired interval against LRU (" + ("LRU not replayed here)" if d is None else
                                                      f"fewer than {2 * MIN_BLOCK} decoded tokens)"))
    else:
        iv = f"{signed(d)}{unit} vs LRU, 95% interval [{signed(lo)}, {signed(hi)}]"
        if verdict == "tie":
            text = f"{best['policy']} and lru: {tie_text((hi - lo) / 2.0, unit)}; {iv}"
        elif verdict == "better":
            text = f"{best['policy']} beats LRU beyond noise: {iv}"
        else:  # LRU did better but is not a candidate (over budget)
            text = f"{best['policy']} is below LRU beyond noise (LRU is over budget): {iv}"
    return {"best": best, "policy": best["policy"], "tied": tied, "call": verdict if best["policy"] != BASELINE else None,
            "delta": d, "low": lo, "high": hi, "text": text}


def tied_text(dec: dict[str, Any]) -> str:
    """"; tied with it within noise: a, b" or ""."""
    return f"; tied with it within noise: {', '.join(dec['tied'])}" if dec and dec["tied"] else ""


def with_paired(frame: Any, series: dict[tuple[str, float], DecodeSeries], model: Any = None, *, seed: int = SEED,
                resamples: int = RESAMPLES) -> Any:
    """A cache frame (:func:`replay.core.simulate.sweep`'s rows, with ``ms_per_token`` when ``model`` is
    given) plus the columns of :func:`annotate` (null on per-layer rows)."""
    import polars as pl

    rows = frame.to_dicts()
    annotate(rows, series, model, seed=seed, resamples=resamples)
    cols = HIT_COLUMNS + (TIME_COLUMNS if model is not None else ())

    def dtype(k: str) -> Any:
        return pl.Boolean if k.startswith("tied_") else pl.String if k.startswith("vs_") else pl.Float64

    return frame.with_columns([pl.Series(k, [r.get(k) for r in rows], dtype=dtype(k)) for k in cols])


# -- what-ifs against their baseline (prefetch, retention) ----------------------------------------

WHATIF_COLUMNS = ("delta_hit_pp", "delta_hit_ci_low", "delta_hit_ci_high", "vs_baseline", "delta_mib_per_token",
                  "delta_mib_ci_low", "delta_mib_ci_high")
WHATIF_TIME_COLUMNS = ("delta_ms_per_token", "delta_ms_ci_low", "delta_ms_ci_high", "vs_baseline_time")


def whatif_columns(loads: Any, base: Any, res: Any, model: Any = None, *, seed: int = SEED,
                   resamples: int = RESAMPLES, requests: np.ndarray | None = None) -> dict[str, Any]:
    """A what-if replay ``res`` (prefetch, retention) against its baseline ``base`` (same policy and
    budget, no what-if), paired over decoded tokens: decode hit points gained (``delta_hit_pp`` and
    interval, ``vs_baseline`` = better | worse | tie), MiB read per decoded token added, speculative
    reads included (``delta_mib_per_token`` and interval), and with ``model`` ms per decoded token
    (``delta_ms_per_token`` and interval, ``vs_baseline_time``: better = faster)."""
    a, b = whatif_series(loads, res), whatif_series(loads, base)
    if requests is not None and len(a) == requests.shape[0]:  # requests resampled whole (request_units)
        import dataclasses

        a, b = dataclasses.replace(a, requests=requests), dataclasses.replace(b, requests=requests)
    h = diff_hit_pp(a, b, seed=seed, resamples=resamples)
    m = diff_per_token(a, b, seed=seed, resamples=resamples)
    out = dict(zip(WHATIF_COLUMNS, (h.delta, h.low, h.high, call(h), m.delta, m.low, m.high), strict=True))
    if model is not None:
        t = diff_per_token(a, b, ms_per_mib=model.ms_per_mib, ms_per_miss=model.ms_per_miss, seed=seed, resamples=resamples)
        out.update(zip(WHATIF_TIME_COLUMNS, (t.delta, t.low, t.high, call(t, higher_is_better=False)), strict=True))
    return out


def interval_text(delta: float | None, low: float | None, high: float | None, unit: str) -> str:
    """"+1.2 points (95% interval [+0.4, +2.0])"."""
    return f"{signed(delta)}{unit} (95% interval [{signed(low)}, {signed(high)}])"


def diff_saved_pct(base: DecodeSeries, res: DecodeSeries, *, seed: int = SEED, resamples: int = RESAMPLES) -> Diff:
    """Bytes read avoided by a what-if (drop-cold) as % of its baseline's, 100 x (base - res) / base,
    over decoded tokens, with its interval (the ratio of sums recomputed on each paired resample)."""
    _check(base, res)
    n = len(base)
    if n == 0 or base.read_bytes.sum() == 0:
        return Diff(math.nan, math.nan, math.nan, n, block_tokens(n))
    point = 100.0 * float(base.read_bytes.sum() - res.read_bytes.sum()) / float(base.read_bytes.sum())
    s, df = _resampled_sums(np.stack([base.read_bytes, res.read_bytes], axis=1), np.random.default_rng(seed), resamples,
                            _requests(base, res))
    with np.errstate(divide="ignore", invalid="ignore"):
        d = 100.0 * (s[:, 0] - s[:, 1]) / s[:, 0]
    return _interval(point, d, n, df)
