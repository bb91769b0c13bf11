"""Numbers and rows as people read them: one precision per quantity, table cells, plain-text
tables, the one JSON object every ``--json`` verb prints. Pure functions: values in, text out."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

from replay.core.frames import clean, rows_of  # noqa: F401 (rows_of: re-exported, the tables' row form)
from traces.util.units import exact  # noqa: F401 (re-exported: a parameter printed as given)


def json_object(command: str, trace: str | None, rows: Iterable[dict[str, Any]], **extra: Any) -> str:
    """The one JSON object every ``--json`` verb prints (docs/design.md, "Machine-readable output")."""
    obj = {"command": command, "trace": trace, "rows": [clean(r) for r in rows]}
    obj.update({k: clean(v) for k, v in extra.items()})
    return json.dumps(obj, indent=1, allow_nan=False)


# One precision per quantity, for every verb and the report (decimals after the point). A column's
# quantity is read from its name (see ``digits_for``). Parameters a user chose (F, keep_k, budgets,
# caps) are never rounded: 0.25 printed as "0.2" is a different F, not a shorter one.
PRECISION: dict[str, int] = {
    "pct": 1,  # any share in percent: hit %, io_saved %, mass_lost %, routings/experts dropped %, errors, MAPE
    "pp": 2,  # a difference of two percentages, in points
    "tok_s": 2,  # decoded tokens per second
    "ms": 1,  # ms per decoded token (and its 95% interval, and ms saved)
    "mib": 1,  # MiB read or saved
    "mib_per_token": 2,  # MiB per decoded token
    "ms_per_mib": 4, "ms_per_miss": 3, "r2": 3, "mib_s": 0, "experts": 2,
}
PARAMETERS = frozenset({"frac", "keep_k", "budget_mib", "recorded_budget_mib", "cap", "drop", "horizon", "seed", "ahead"})


def digits_for(column: str) -> int | None:
    """Decimals for a column by its quantity; None for a parameter (printed exactly)."""
    c = column.lower()
    if c in PARAMETERS:
        return None
    if c in ("ms_per_mib", "ms_per_miss", "r2"):
        return PRECISION[c]
    if c.endswith("_mib_s"):
        return PRECISION["mib_s"]
    if c == "survivors_mean":
        return PRECISION["experts"]
    if c.endswith("_pp") or "_pp_" in c:
        return PRECISION["pp"]
    if "pct" in c:  # before tok_s: tok_s_err_pct is a percentage
        return PRECISION["pct"]
    if "tok_s" in c:
        return PRECISION["tok_s"]
    if "mib_per_token" in c:
        return PRECISION["mib_per_token"]
    if c.startswith(("ms_", "mean_ms", "intercept_ms")) or c.endswith("_ms"):
        return PRECISION["ms"]
    if "mib" in c:
        return PRECISION["mib"]
    return 1


def fmt(v: Any, digits: int | None = 1) -> str:
    """A table cell: None/NaN print as '-', never 0.0 (a layer with nothing scored is not 0%).
    ``digits=None`` prints the value exactly (a parameter)."""
    if v is None:
        return "-"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "-"
        return exact(v) if digits is None else f"{v:.{digits}f}"
    return str(v)


def fmt_q(v: Any, quantity: str) -> str:
    """A figure in running text, at its quantity's precision (``PRECISION``)."""
    return fmt(v, PRECISION[quantity])


def cell(column: str, v: Any, digits: int | dict[str, int] | None = None) -> str:
    """One table cell: parameters exactly; otherwise ``digits`` (an int for every column, or a dict
    by column) when given, else the column's quantity precision."""
    if digits_for(column) is None:
        return fmt(v, None)
    if isinstance(digits, dict):
        return fmt(v, digits.get(column, digits_for(column)))
    return fmt(v, digits if digits is not None else digits_for(column))


def text_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], headers: Sequence[str] | None = None,
               digits: int | dict[str, int] | None = None) -> str:
    """A plain, right-aligned table an engine author can paste into an issue. Cells are formatted
    by ``cell`` (parameters exactly, figures at their quantity's precision unless ``digits`` says)."""
    headers = list(headers or columns)
    cells = [[cell(c, r.get(c), digits) for c in columns] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(out)
