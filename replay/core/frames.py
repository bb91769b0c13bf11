"""Frames to plain Python rows: what ``--json``, the text tables and the library's own row-wise
choices read (NaN and infinities become None: JSON has no NaN, and a missing figure is not 0)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import polars as pl


def clean(v: Any) -> Any:
    """JSON-safe scalar: NaN/inf become None, numpy scalars become Python (lists and dicts recursively)."""
    if hasattr(v, "item") and not isinstance(v, (list, dict, str)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [clean(x) for x in v]
    return v


def rows_of(frame: pl.DataFrame) -> list[dict[str, Any]]:
    return [clean(r) for r in frame.to_dicts()]
