"""What a time figure from a cost model may be, and how uncertain it is (docs/design.md, "Cost model").

Physical bounds: a decoded token takes between ``MIN_MS_PER_TOKEN`` (0.01 ms, i.e. at most
100,000 tok/s) and ``MAX_MS`` (one day); a read costs at least ``MIN_MS_PER_MIB`` (0.0001 ms/MiB,
i.e. at most 10,000,000 MiB/s, about twice the fastest HBM of 2026); a token that reads nothing
takes no less than 0 ms (``intercept_ms`` >= 0). A model that gives a time outside them at some
cell is refused with the cell named, never printed as a number.

Uncertainty: the OLS prediction interval of the mean ms/token of ``n`` new decoded tokens whose
mean regressors are ``x0`` (1, MiB read per token[, misses per token])::

    half = t(0.975, df) * resid_std * sqrt(1/n + x0' (X'X)^-1 x0)

The second term (the leverage) is the coefficients' own uncertainty at ``x0``: smallest at the
fitted tokens' mean read volume, growing with the square of the distance from it. A cell whose
read volume per token lies outside [min, max] of the fitted tokens' volumes (or, with a misses
term, whose misses do) is ``extrapolated``: the line is carried where no token was measured.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from traces.format.errors import UserError

MAX_MS = 86_400_000.0  # one day: no per-token time, coefficient or intercept beyond it is a measurement
MIN_MS_PER_TOKEN = 0.01  # 100,000 tok/s: no MoE decode streams experts faster than this
MIN_MS_PER_MIB = 1e-4  # 10,000,000 MiB/s (about 9.5 TiB/s)
MAX_FLASH_MIB_S = 1000.0 / MIN_MS_PER_MIB


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (two-sided 95%).

    Exact for df <= 400 (bisection on the closed-form CDF of integer df, Abramowitz & Stegun
    26.7.3-4); above, the Cornish-Fisher expansion around the normal quantile (error < 1e-9)."""
    if df < 1:
        return float("nan")
    z = 1.959963984540054
    if df > 400:
        return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2) \
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3)

    def central(t: float) -> float:  # P(|T| <= t)
        th = math.atan(t / math.sqrt(df))
        c2, s = math.cos(th) ** 2, math.sin(th)
        if df % 2 == 1:
            if df == 1:
                return 2 * th / math.pi
            term, acc = math.cos(th), math.cos(th)
            for k in range(3, df - 1, 2):
                term *= c2 * (k - 1) / k
                acc += term
            return 2 / math.pi * (th + s * acc)
        term, acc = 1.0, 1.0
        for k in range(2, df - 1, 2):
            term *= c2 * (k - 1) / k
            acc += term
        return s * acc

    lo, hi = 0.0, 1000.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if central(mid) < 0.95:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def regressors(mib_per_token: np.ndarray, misses_per_token: np.ndarray, terms: str) -> np.ndarray:
    """x0 rows: (1, MiB read per token[, misses per token])."""
    cols = [np.ones_like(mib_per_token), mib_per_token]
    if terms == "bytes+misses":
        cols.append(misses_per_token)
    return np.column_stack(cols)


def interval_half_ms(model: Any, mib_per_token: np.ndarray, misses_per_token: np.ndarray, n_tokens: np.ndarray) -> np.ndarray:
    """Half-width of the 95% prediction interval of each row's mean ms/token (NaN where the model
    has no residuals: a manual model). A model without the fit's (X'X)^-1 (a file from before it
    was recorded) gets the residual term alone, 1.96 * resid_std / sqrt(n), as it used to."""
    n = np.asarray(n_tokens, dtype=np.float64)
    if not model.resid_std_ms:
        return np.full(n.shape, np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv_n = np.where(n > 0, 1.0 / n, np.nan)
    if model.cov_unscaled is None or model.df_resid is None:
        return 1.96 * model.resid_std_ms * np.sqrt(inv_n)
    C = np.asarray(model.cov_unscaled, dtype=np.float64)
    X0 = regressors(np.asarray(mib_per_token, dtype=np.float64), np.asarray(misses_per_token, dtype=np.float64), model.terms)
    lev = np.einsum("ij,jk,ik->i", X0, C, X0)
    return t_quantile_975(int(model.df_resid)) * model.resid_std_ms * np.sqrt(inv_n + np.maximum(lev, 0.0))


def extrapolated(model: Any, mib_per_token: np.ndarray, misses_per_token: np.ndarray) -> list[bool | None]:
    """Per row: outside the fitted tokens' read volumes (or misses, with that term)? None when
    the model records no fitted range (a manual model, an older file)."""
    lo, hi = model.fit_read_mib_min, model.fit_read_mib_max
    if lo is None or hi is None:
        return [None] * len(mib_per_token)
    x = np.asarray(mib_per_token, dtype=np.float64)
    out = (x < lo) | (x > hi)
    if model.terms == "bytes+misses" and model.fit_misses_min is not None and model.fit_misses_max is not None:
        m = np.asarray(misses_per_token, dtype=np.float64)
        out |= (m < model.fit_misses_min) | (m > model.fit_misses_max)
    return [bool(v) for v in out]


def check_times(model: Any, ms: np.ndarray, cells: list[str]) -> None:
    """Refuse, naming the cell, a time that is not one: not finite, under MIN_MS_PER_TOKEN (which
    would print a rate of thousands of tok/s or a negative one) or over a day."""
    ms = np.asarray(ms, dtype=np.float64)
    bad = ~np.isfinite(ms) | (ms < MIN_MS_PER_TOKEN) | (ms > MAX_MS)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise UserError(f"{model_name(model)}: gives {ms[i]:.6g} ms per decoded token {cells[i]}, not a time in "
                        f"[{MIN_MS_PER_TOKEN:g} ms, 1 day] (at most {1000.0 / MIN_MS_PER_TOKEN:,.0f} tok/s); "
                        "refusing to print its figures.")


def model_name(model: Any) -> str:
    """How a sentence names a model: its file, else what it is."""
    where = getattr(model, "loaded_from", None)
    if where:
        return str(where)
    return "the manual cost model" if model.kind == "manual" else "the cost model"


def check_coefficients(model: Any, where: str) -> None:
    """A model's own numbers, before any cell: a slope that is a positive time per MiB within the
    bounds, a non-negative intercept and per-miss cost, each under a day."""
    if not (math.isfinite(model.ms_per_mib) and model.ms_per_mib > 0):
        raise UserError(f"{where}: ms_per_mib {model.ms_per_mib:g} is not a positive time per MiB read; reading more "
                        "bytes must not make a token faster (refit on a run where bytes explain the time).")
    if model.ms_per_mib < MIN_MS_PER_MIB:
        raise UserError(f"{where}: ms_per_mib {model.ms_per_mib:g} is below {MIN_MS_PER_MIB:g} ms per MiB, a read bandwidth "
                        f"above {MAX_FLASH_MIB_S:,.0f} MiB/s that no device has.")
    if model.ms_per_mib > MAX_MS:
        raise UserError(f"{where}: ms_per_mib {model.ms_per_mib:g} is more than a day per MiB read.")
    if not (math.isfinite(model.intercept_ms) and model.intercept_ms >= 0):
        raise UserError(f"{where}: intercept_ms {model.intercept_ms:g} is not a non-negative time: a token that reads "
                        "nothing cannot take less than no time.")
    if model.intercept_ms > MAX_MS:
        raise UserError(f"{where}: intercept_ms {model.intercept_ms:g} is more than a day per token.")
    if not (math.isfinite(model.ms_per_miss) and 0 <= model.ms_per_miss <= MAX_MS):
        raise UserError(f"{where}: ms_per_miss {model.ms_per_miss:g} is not a non-negative time per miss under a day.")
    if model.resid_std_ms is not None and not (math.isfinite(model.resid_std_ms) and 0 <= model.resid_std_ms <= MAX_MS):
        raise UserError(f"{where}: resid_std_ms {model.resid_std_ms:g} is not a non-negative time under a day.")
