"""Cache rows as plain Python, without Polars: what ``rows_of(cache_frame(rows))`` gives.

The library returns cache rows as a Polars frame (:func:`replay.cache.sweep`), built from the
dicts :func:`replay.cache.result_rows` makes with a few column types fixed
(:data:`CACHE_COLUMN_TYPES`). A ``cache --json`` run prints those rows and nothing else of the
frame, so the command line's fast path (:mod:`replay.fastcli`) skips the frame, and Polars'
import (about 0.1-0.3 s of a whole run), and normalizes the dicts here as the frame would:
a fixed column takes its type, any other column holding a float anywhere turns its ints into
floats (Polars' Float64 supertype), and NaN or an infinity becomes None (:func:`replay.frames.clean`).
``tests/test_fastcli.py`` holds the two forms to each other, byte for byte in the JSON.
"""

from __future__ import annotations

import math
from typing import Any

from traces.units import MIB

# Column -> type for the cache rows' columns Polars could not infer from the first values alone
# (None on the per-layer rows): "int", "float" or "bool".
CACHE_COLUMN_TYPES = {"layer": "int", "evictions": "int", "overflow_loads": "int", "peak_resident_mib": "float",
                      "over_budget": "bool"}
EXTRA_COLUMN_TYPES = {"preload_mib": "float", "share_mib": "float"}
_CAST = {"int": int, "float": float, "bool": bool}


def cache_row(policy: str, budget_mib: float, layer: int | None, lookups: list[int], hits: list[int], read_bytes: list[int],
              evictions: int | None, overflow_loads: int | None, peak_resident_bytes: int | None,
              over_budget: bool | None) -> dict[str, Any]:
    """One cache row (DESIGN.md keys first) from per-phase totals: ``lookups``, ``hits`` and
    ``read_bytes`` are [prefill, decode] Python ints. ``lookups``/``hits``/``misses``/``read_mib``
    are all phases (cumulative); the ``_decode`` columns count decode loads only. The replay's
    rows (:func:`replay.cache.result_rows`) and the native path's (:mod:`replay.native`) are both
    made here."""
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


def column_types(extras: bool) -> dict[str, str]:
    return {**CACHE_COLUMN_TYPES, **(EXTRA_COLUMN_TYPES if extras else {})}


def plain_rows(rows: list[dict[str, Any]], types: dict[str, str]) -> list[dict[str, Any]]:
    """``rows`` as a frame of them with ``types`` fixed would give them back (see the module docstring)."""
    if not rows:
        return []
    columns = list(dict.fromkeys(k for r in rows for k in r))
    cast: dict[str, Any] = {}
    for c in columns:
        if c in types:
            cast[c] = _CAST[types[c]]
        elif any(isinstance(r.get(c), float) for r in rows) and not any(isinstance(r.get(c), bool) for r in rows):
            cast[c] = float
    out = []
    for r in rows:
        row = {}
        for c in columns:
            v = r.get(c)
            if hasattr(v, "item") and not isinstance(v, (list, dict, str)):
                v = v.item()  # a numpy scalar
            if v is not None and c in cast:
                v = cast[c](v)
            if isinstance(v, float) and not math.isfinite(v):
                v = None
            row[c] = v
        out.append(row)
    return out


def cache_frame(rows: list[dict[str, Any]], extras: bool = False) -> Any:
    """The cache rows as the library's Polars frame (the types of :func:`column_types`)."""
    import polars as pl

    pl_types = {"int": pl.Int64, "float": pl.Float64, "bool": pl.Boolean}
    return pl.DataFrame(rows, schema_overrides={c: pl_types[t] for c, t in column_types(extras).items()},
                        infer_schema_length=None)


def cache_summary(trace: Any, rows: list[dict[str, Any]], budgets_mib: list[float], budgets_given: bool,
                  working_set_bytes: int, has_decode: bool) -> dict[str, Any]:
    """What ``cache`` prints around its rows (the command line's typer path and its fast path
    alike): ``token_cycle_mib`` T, ``working_set_mib`` W, ``budgets_below_token_cycle``,
    ``budgets_chosen`` (how the budgets were chosen), ``collapsed`` (LRU's overall rows below T
    with a decode hit under 5%), ``no_decode`` and the ``note`` the JSON object carries."""
    from replay.info import COLLAPSE, NO_DECODE
    from traces.units import MIB, exact

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

