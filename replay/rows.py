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

# Column -> type for the cache rows' columns Polars could not infer from the first values alone
# (None on the per-layer rows): "int", "float" or "bool".
CACHE_COLUMN_TYPES = {"layer": "int", "evictions": "int", "overflow_loads": "int", "peak_resident_mib": "float",
                      "over_budget": "bool"}
EXTRA_COLUMN_TYPES = {"preload_mib": "float", "share_mib": "float"}
_CAST = {"int": int, "float": float, "bool": bool}


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
