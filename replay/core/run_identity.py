"""Are these per-token metrics the metrics of this run? One check for every verb that reads them.

``cache --validate`` compares the replay's cumulative hit % with the engine's after each decoded
token; ``cost fit`` and ``cost check`` fit and score a time model on them. Each of them gives a
plausible wrong answer on another run's metrics (a validation that passes or fails by a few points
for no reason, a model of another device), on metrics whose rows are out of order, or on metrics
with fewer rows than the trace has decoded tokens (a per-token line silently dropped). So all
three call :func:`check_metrics_of_run` before using a row, and refuse in one sentence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from traces.format.errors import UserError

if TYPE_CHECKING:
    import polars as pl

    from traces.io.reader import RoutingArrays, Trace

# The run summary prints the cumulative hit % with one decimal, the per-token lines with two: the
# last line may differ from the summary by the summary's rounding (0.05) plus the line's (0.005).
SUMMARY_HIT_TOLERANCE_PP = 0.055


def decode_token_index(arrays: RoutingArrays) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(decode row mask, each decode row's token number in decode order, the tokens' (request,
    turn, step) keys [tokens, 3] in decode order); a token is one distinct (request, turn, step)."""
    dec = arrays.phase == 1
    keys = np.stack([arrays.request_or_zero[dec], arrays.turn[dec], arrays.step[dec]], axis=1).astype(np.int64)
    uniq, inv = np.unique(keys, axis=0, return_inverse=True)
    return dec, inv.reshape(-1), uniq


def check_metrics_of_run(trace: Trace, metrics: pl.DataFrame, arrays: RoutingArrays | None = None) -> None:
    """Refuse, in one sentence naming the trace, metrics that cannot be this run's:

    - the row count differs from the trace's decoded tokens (one row per decoded token);
    - a ``step`` column that does not increase row by row (rows not in decode order);
    - the last row's cumulative ``cache_hit_pct`` differs from the run's own summary
      (``recorded.cache_hit_pct_cum``) by more than the summary's rounding; the summary's
      ``tokens`` differs from the row count;
    - a token's ``read_bytes`` (all bytes the engine read) below the expert bytes the trace's
      ``read_bytes`` column records for it;
    - a slot's recorded ``read_bytes`` above the size of the expert it read (an expert is read
      whole or not at all: more is another model's, or garbage).
    """
    a = arrays if arrays is not None else trace.arrays(recorded=True)
    dec, inv, uniq = decode_token_index(a)
    n_tok = uniq.shape[0]
    where = trace.path
    if metrics.height != n_tok:
        raise UserError(f"{where}: the metrics hold {metrics.height} per-token rows but the trace has {n_tok} decoded "
                        "tokens; not the metrics of this run.")
    if "step" in metrics.columns and metrics.height > 1 and not trace.has("request"):
        step = metrics["step"].to_numpy()
        down = np.flatnonzero(np.diff(step) <= 0)
        if down.size:
            i = int(down[0]) + 1
            raise UserError(f"{where}: metrics row {i + 1} has step {step[i]:g} after step {step[i - 1]:g}: the rows are not "
                            "in decode order; not the metrics of this run.")
    rec = trace.recorded or {}
    summary = rec.get("summary") if isinstance(rec.get("summary"), dict) else {}
    tokens = summary.get("tokens")
    if isinstance(tokens, (int, float)) and not isinstance(tokens, bool) and tokens != metrics.height:
        raise UserError(f"{where}: the run's summary counts {tokens:g} tokens, the metrics {metrics.height} rows; "
                        "not the metrics of this run.")
    cum = rec.get("cache_hit_pct_cum")
    if cum is not None and "cache_hit_pct" in metrics.columns and metrics.height:
        last = float(metrics["cache_hit_pct"][-1])
        if abs(last - float(cum)) > SUMMARY_HIT_TOLERANCE_PP:
            raise UserError(f"{where}: the metrics end at a cumulative hit rate of {last:g}% but the run's summary says "
                            f"{float(cum):g}%; not the metrics of this run.")
    if a.read_bytes is not None:
        eb = np.asarray(trace.expert_bytes, np.int64)  # [n_layer], indexed by the layer number
        limit = eb[np.clip(a.layer.astype(np.int64), 0, max(eb.shape[0] - 1, 0))] if eb.size else np.zeros(a.layer.shape, np.int64)
        over = a.read_bytes.astype(np.int64) > limit[:, None]
        if over.any():
            r, j = (int(x) for x in np.argwhere(over)[0])
            raise UserError(f"{where}: routing row {r} (layer {int(a.layer[r])}) slot {j} records read_bytes "
                            f"{int(a.read_bytes[r, j])}, more than the {int(limit[r])} bytes of one expert of that layer.")
        if "read_bytes" in metrics.columns:
            # All bytes the engine read for a token include the expert bytes the trace says it read:
            # fewer means the metrics are another run's.
            rb = np.bincount(inv, weights=a.read_bytes[dec].sum(axis=1).astype(np.float64), minlength=n_tok)
            total = metrics["read_bytes"].to_numpy().astype(np.float64)
            short = np.flatnonzero(total < rb)
            if short.size:
                i = int(short[0])
                raise UserError(f"{where}: the metrics say decode token {i + 1} read {total[i]:.0f} bytes in all, fewer "
                                f"than the {rb[i]:.0f} bytes of expert reads the trace records; not the metrics of this run.")
