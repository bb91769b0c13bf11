"""Cache rows: one row from a replay's per-phase totals (:func:`cache_row`), the rows as the
library's Polars frame (:func:`cache_frame`: Polars types and normalises them) and what ``cache``
prints around them (:func:`cache_summary`)."""

from __future__ import annotations

import math
from typing import Any

from traces.util.units import MIB

# Column -> type for the cache rows' columns Polars could not infer from the first values alone
# (None on the per-layer rows): "int", "float" or "bool".
CACHE_COLUMN_TYPES = {"layer": "int", "evictions": "int", "overflow_loads": "int", "peak_resident_mib": "float",
                      "over_budget": "bool"}
EXTRA_COLUMN_TYPES = {"preload_mib": "float", "share_mib": "float"}


def cache_row(policy: str, budget_mib: float, layer: int | None, lookups: list[int], hits: list[int], read_bytes: list[int],
              evictions: int | None, overflow_loads: int | None, peak_resident_bytes: int | None,
              over_budget: bool | None) -> dict[str, Any]:
    """One cache row (docs/design.md keys first) from per-phase totals: ``lookups``, ``hits`` and
    ``read_bytes`` are [prefill, decode] Python ints. ``lookups``/``hits``/``misses``/``read_mib``
    are all phases (cumulative); the ``_decode`` columns count decode loads only (the replay's
    rows: :func:`replay.core.simulate.result_rows`)."""
    lk, ht = lookups[0] + lookups[1], hits[0] + hits[1]
    return {
        "policy": policy, "budget_mib": budget_mib, "layer": layer,
        "lookups": lk, "hits": ht,
        "hit_pct_decode": _pct(hits[1], lookups[1]), "hit_pct_cum": _pct(ht, lk),
        "hit_pct_prefill": _pct(hits[0], lookups[0]),
        "read_mib": float(read_bytes[0] + read_bytes[1]) / MIB,
        "misses": lk - ht,
        "lookups_decode": lookups[1], "hits_decode": hits[1],
        "read_mib_decode": float(read_bytes[1]) / MIB,
        "evictions": evictions,
        "overflow_loads": overflow_loads,
        "peak_resident_mib": peak_resident_bytes / MIB if peak_resident_bytes is not None else None,
        "over_budget": over_budget,
    }


def _pct(h: int, n: int) -> float:
    return 100.0 * float(h) / float(n) if n else math.nan


def cache_frame(rows: list[dict[str, Any]], extras: bool = False) -> Any:
    """The cache rows as the library's Polars frame: the columns of :data:`CACHE_COLUMN_TYPES`
    (and with ``extras`` :data:`EXTRA_COLUMN_TYPES`) take their type, the others Polars' supertype
    over every row (an int column holding a float anywhere becomes Float64)."""
    import polars as pl

    pl_types = {"int": pl.Int64, "float": pl.Float64, "bool": pl.Boolean}
    types = {**CACHE_COLUMN_TYPES, **(EXTRA_COLUMN_TYPES if extras else {})}
    return pl.DataFrame(rows, schema_overrides={c: pl_types[t] for c, t in types.items()}, infer_schema_length=None)


def cache_summary(trace: Any, rows: list[dict[str, Any]], budgets_mib: list[float], budgets_given: bool,
                  working_set_bytes: int, has_decode: bool) -> dict[str, Any]:
    """What ``cache`` prints around its rows: ``token_cycle_mib`` T, ``working_set_mib`` W, ``budgets_below_token_cycle``,
    ``budgets_chosen`` (how the budgets were chosen), ``collapsed`` (LRU's overall rows below T
    with a decode hit under 5%), ``no_decode`` and the ``note`` the JSON object carries."""
    from replay.core.notes import COLLAPSE, NO_DECODE
    from traces.util.units import MIB, exact

    rec_budget = trace.recorded.get("budget_mib")
    chosen = "given"
    if not budgets_given:
        chosen = ("default: 9 budgets geometric from T/2 to the working set W, 2 significant figures"
                  + (f", the recorded {exact(rec_budget)} MiB replacing the nearest" if rec_budget in budgets_mib else ""))
    T = trace.token_cycle_bytes / MIB
    lru_below = [r for r in rows if r["layer"] is None and r["policy"] == "lru" and r["budget_mib"] < T]
    # No decode loads (prefill-only trace): decode hit % is null, which is not a collapse.
    collapsed = [r for r in lru_below if r["hit_pct_decode"] is not None and r["hit_pct_decode"] < 5.0]
    no_decode = not has_decode  # any decode row (a load's phase is its batch's: one phase per batch)
    return {"token_cycle_mib": T, "working_set_mib": working_set_bytes / MIB,
            "budgets_below_token_cycle": [b for b in budgets_mib if b < T], "budgets_chosen": chosen,
            "collapsed": collapsed, "no_decode": no_decode,
            "note": NO_DECODE if no_decode else COLLAPSE if collapsed else None}

