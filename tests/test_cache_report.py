"""The report's cache section never picks or compares an over-budget cell without saying so."""

from __future__ import annotations

import polars as pl

from replay.analyses.cost_model import cost_model_from_options
from replay.analyses.report import ReportContext, section_cache
from traces import open_trace


def test_report_cache_section_leaves_over_budget_cells_out(real_trace_dir, tmp_path):
    tr = open_trace(real_trace_dir("qwen"))
    ctx = ReportContext(tr, "qwen", tmp_path, budgets_mib=[390.0, 590.0, 4000.0])
    ctx.shared["cost_model"] = cost_model_from_options(None, 2400.0, 110.0)
    s = section_cache(ctx)
    tables = {t.name: t for t in s.tables}
    gap = tables["cache_gap"].frame
    cells = tables["cache"].frame
    assert {"peak_resident_mib", "overflow_loads", "over_budget"} <= set(tables["cache"].columns)
    over = {(r["policy"], r["budget_mib"]) for r in cells.filter(pl.col("over_budget")).to_dicts()}
    assert ("layer", 390.0) in over and ("layer", 590.0) in over  # every load overflowed there
    for r in gap.to_dicts():
        assert (r["best_online"], r["budget_mib"]) not in over
        assert "layer (peak 7275.0 MiB)" in r["over_budget_excluded"]
        if not r["belady_over_budget"]:
            assert r["gap_to_belady_pp"] >= 0.0  # a within-budget online policy never beats the bound
    text = " ".join(s.text + s.notes)
    assert "Over budget:" in text and "layer at 390 MiB (peak 7275.0 MiB resident, 6,192 loads overflowed)" in text
    assert "left out as over budget" in text.lower()
    fastest = next(t for t in s.text if t.startswith("Fastest online policy per budget"))
    assert "MiB: layer" not in fastest
