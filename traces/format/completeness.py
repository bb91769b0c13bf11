"""Completeness measured, not assumed (docs/design.md, "Completeness"): per token, the set of MoE
layers it was routed at.

A token is a distinct (request, turn, step). A *missing routing* is a (token, MoE layer) pair with
no row while the token has rows at other MoE layers of the trace. One pattern is not missing: an
engine that computes only the output row of a prompt pass in its last layer (llama.cpp and the
engines built on it skip the other rows there, so those routings never happened) leaves every
prefill token but the pass's output token without the last MoE layer; a prefill token that lacks
exactly the last MoE layer is *not computed*, counted apart (``routings_not_computed``).
Layers the whole log lacks are not per-token gaps: they are absent from the trace's MoE layers
(``model.moe_layers_absent``). Duplicated rows and steps out of order never reach here: importers
and the reader refuse them, naming the row.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from traces.util.rows import unique_rows

# How many incomplete tokens a report names (the count covers them all).
NAMED = 3


def measure(*, turn: np.ndarray, phase: np.ndarray, step: np.ndarray, layer: np.ndarray,
            moe_layers: list[int], request: np.ndarray | None = None) -> dict[str, Any]:
    """``routings_missing`` (pairs), ``tokens_missing_layers`` (tokens with at least one),
    ``routings_not_computed`` (the output-row pattern above) and ``routings_missing_at``: the first
    incomplete tokens in (request, turn, step) order with their missing layers, as text (None when
    nothing is missing)."""
    n = step.shape[0]
    L = len(moe_layers)
    out: dict[str, Any] = {"routings_missing": 0, "tokens_missing_layers": 0, "routings_not_computed": 0,
                           "routings_missing_at": None}
    if n == 0 or L < 2:
        return out
    req = np.zeros(n, np.int64) if request is None else np.asarray(request, np.int64)
    keys = np.stack([req, np.asarray(turn, np.int64), np.asarray(step, np.int64)], axis=1)
    uniq, inv = unique_rows(keys)  # np.unique(keys, axis=0, return_inverse=True), by one lexsort
    T = uniq.shape[0]
    routed = np.bincount(inv, minlength=T)  # a token routes once per layer (the reader holds it)
    last = max(moe_layers)
    at_last = np.zeros(T, bool)
    at_last[inv[np.asarray(layer) == last]] = True
    first_row = np.full(T, n, np.int64)
    np.minimum.at(first_row, inv, np.arange(n))
    tok_phase = np.asarray(phase)[first_row]
    not_computed = (routed == L - 1) & ~at_last & (tok_phase == 0)
    short = (routed < L) & ~not_computed
    out["routings_not_computed"] = int(not_computed.sum())
    out["routings_missing"] = int((L - routed[short]).sum())
    out["tokens_missing_layers"] = int(short.sum())
    if short.any():
        named = []
        lay = np.asarray(layer)
        for t in np.flatnonzero(short)[:NAMED]:
            have = set(lay[inv == t].tolist())
            gone = compact_ranges([x for x in moe_layers if x not in have])
            r, tu, s = (int(x) for x in uniq[t])
            who = (f"request {r}, " if request is not None else "") + (f"turn {tu}, " if tu else "") + f"step {s}"
            named.append(f"{who}: layer{'s' if len(moe_layers) - len(have) > 1 else ''} {gone}")
        more = int(short.sum()) - len(named)
        out["routings_missing_at"] = "; ".join(named) + (f"; and {more} more token(s)" if more > 0 else "")
    return out


def compact_ranges(xs: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"`` (sorted, distinct)."""
    xs = sorted(set(int(x) for x in xs))
    out: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out)


def sentence(c: dict[str, Any], moe_layers: int) -> str | None:
    """One sentence saying what is missing (None when nothing is)."""
    if not c["routings_missing"]:
        return None
    return (f"{c['routings_missing']:,} (token, layer) routing(s) missing: {c['tokens_missing_layers']:,} token(s) "
            f"routed at fewer than the trace's {moe_layers} MoE layers ({c['routings_missing_at']}); the replay "
            "counts no lookup for a missing routing, so every figure covers the routings present")


def of_trace(trace: Any) -> dict[str, Any]:
    """:func:`measure` over a trace's rows (five narrow columns and the request column, read once)."""
    cols = ["turn", "phase", "step", "layer"] + (["request"] if trace.has("request") else [])
    t = trace.table(cols)
    a = {c: t.column(c).to_numpy() for c in cols}
    return measure(turn=a["turn"], phase=a["phase"], step=a["step"], layer=a["layer"],
                   moe_layers=list(trace.moe_layers), request=a.get("request"))
