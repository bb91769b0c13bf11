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


# Human headers with units for the docs/design.md keys: the report's tables and every verb's text tables
# use these, so one quantity has one header everywhere (a key not here is shown as it is: a name).
HEADERS: dict[str, str] = {
    "model": "Model", "moe_layers": "MoE layers", "n_expert": "Experts per layer", "top_k": "Top-k",
    "tokens_prefill": "Prefill tokens", "tokens_decode": "Decode tokens", "token_cycle_mib": "Token cycle T (MiB)",
    "complete": "Complete", "layer": "MoE layer", "routings": "Routings", "hottest_expert_pct": "Hottest expert (% of routings)",
    "experts_never_routed": "Experts never routed",
    "mode": "Mode", "frac": "F", "keep_k": "Keep k (top-k cut)", "io_saved_pct": "Reads avoided (% of miss bytes)",
    "mass_lost_pct": "Weight mass discarded (%)", "routings_dropped_pct": "Routings with a drop (%)",
    "experts_dropped_pct": "Experts dropped (%, engine's 'routings dropped')", "io_saved_mib": "Saved (MiB)",
    "survivors_mean": "Experts left (mean)", "hit_pct_prefill": "Hit % (prefill)", "trace": "Trace",
    "ms_per_token_ci95": "± 95% (ms/token)", "ms_saved_per_token": "Saved (ms/token, decode)",
    "static_k_mass_lost_at_equal_io_pct": "Top-k cut's mass discarded at equal reads (%)",
    "closed_k_mass_lost_at_equal_io_pct": "Top-k cut's mass discarded at equal reads (%)",
    "hit_pct_decode_baseline": "Hit % (decode, without)", "hit_pct_decode": "Hit % (decode)",
    "hit_pct_cum": "Hit % (all phases)", "hit_pct_decode_no_retain": "Hit % (decode, no retention)",
    "best_vs_lru": "Best vs LRU (call on the paired interval)", "tied_with_best": "Tied with the best (within noise)",
    "retain_gain_pp_decode": "Gain (points, decode)", "retain_gain_ci_low": "Gain, 95% interval low",
    "retain_gain_ci_high": "Gain, 95% interval high", "retain_vs_no_retain": "Call (vs no retention)",
    "terms": "Terms", "intercept_ms": "Intercept (ms/token)", "ms_per_mib": "Slope (ms/MiB)", "ms_per_miss": "ms per miss",
    "r2": "r2", "heldout_mape_pct": "Held-out per-token MAPE (%)", "heldout_run_mean_err_pct": "Held-out run-mean error (%)",
    "bandwidth_mib_s": "Bandwidth (MiB/s)", "selected": "Selected",
    "predictor": "Predictor", "slot_acc_pct": "Slot accuracy (%, decode)", "whole_acc_pct": "Whole-set accuracy (%, decode)",
    "slot_acc_ci_low": "Slot acc. 95% interval low", "slot_acc_ci_high": "Slot acc. 95% interval high",
    "mass_pct": "Weight mass named (%)", "vs_prev_token_pp": "vs prev-token (points)",
    "vs_prev_token": "vs prev-token (call)",
    "scored": "Scored routings", "unscored": "Unscored routings", "measures": "Measures", "horizon": "Horizon d (layers)",
    "budget_mib": "Budget (MiB)", "below_T": "Below T", "best_online": "Best online policy",
    "best_online_hit_pct_decode": "Best online hit % (decode)", "belady_hit_pct_decode": "Belady hit % (decode)",
    "infinite_hit_pct_decode": "Infinite hit % (decode)", "belady_over_budget": "Belady over budget",
    "over_budget_excluded": "Left out (over budget)", "gap_to_belady_pp": "Gap to Belady (points)",
    "bound_hit_pct_decode": "opt-bound hit % (decode)", "gap_to_bound_pp": "Gap to opt-bound (points)",
    "policy": "Policy", "read_mib": "Read (MiB, all phases)", "peak_resident_mib": "Peak resident (MiB)",
    "overflow_loads": "Overflowing loads", "over_budget": "Over budget", "ms_per_token": "ms/token (decode)",
    "tok_s": "tok/s (decode)", "lookups": "Lookups", "hits": "Hits",
    "guard": "Guard", "spec_mib": "Speculative read (MiB)", "useful_pct": "Useful guesses (%)",
    "evicted_unused": "Evicted unused", "refused_guard": "Refused by guard",
    "total_mib_per_token_baseline": "MiB/token (without)", "total_mib_per_token": "MiB/token (with)",
    "bytes_change_pct": "Bytes change (%)", "ms_per_token_baseline": "ms/token (without)",
    "min": "Min (%)", "median": "Median (%)", "max": "Max (%)", "min_layer": "Lowest at layer", "max_layer": "Highest at layer",
    "quantity": "Quantity",
}


def header_for(key: str) -> str:
    """A key's human header (``HEADERS``), or the key itself (a name)."""
    return HEADERS.get(key, key)


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
    if digits is not None and isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"  # a count: one way everywhere, as running text prints it (6,144, never 6144)
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
    by ``cell`` (parameters exactly, figures at their quantity's precision unless ``digits`` says).
    ``headers`` default: each column's human header (``HEADERS``), never the key."""
    headers = list(headers or [header_for(c) for c in columns])
    cells = [[cell(c, r.get(c), digits) for c in columns] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(out)
