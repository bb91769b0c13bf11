"""One naming rule for text outputs (issue 28, item 8): snake_case keys in every verb's --json and CSV;
human headers with units in text tables, one header per quantity; signed differences printed with
their sign; counts printed one way; the below-T mark in every grid that shows budgets."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers import run_cli

SNAKE = re.compile(r"[a-z][a-z0-9_]*")


def _keys(obj, out: set[str]) -> set[str]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.add(k)
            _keys(v, out)
    elif isinstance(obj, list):
        for v in obj:
            _keys(v, out)
    return out


@pytest.fixture(scope="module")
def trace(synth_trace_dir):
    return synth_trace_dir(layers=4, experts=16, top_k=2, embd=16, tokens=48, prompt_tokens=8, expert_bytes=1 << 16)


@pytest.mark.parametrize("args", [
    ["info"], ["cache", "--policies", "lru,lfu", "--budgets", "0.5,1"], ["predict", "--horizon", "1..2"],
    ["drop", "--mode", "closed", "--budget-mib", "1", "--fracs", "0.5"], ["prefetch", "--budget-mib", "1"],
    ["compare", "{T}"],
], ids=lambda a: "-".join(a[:2]))
def test_every_verbs_json_keys_are_snake_case(trace, args):
    args = [str(trace) if a == "{T}" else a for a in args]
    res = run_cli(args[0], trace, *args[1:], "--json")
    assert res.code == 0, res.err
    bad = sorted(k for k in _keys(json.loads(res.out), set()) if not SNAKE.fullmatch(k))
    assert not bad, f"{args[0]} --json: keys not in snake_case: {bad}"


def test_csv_headers_are_snake_case(trace, tmp_path):
    res = run_cli("cache", trace, "--policies", "lru", "--budgets", "1", "--csv", tmp_path / "c.csv")
    assert res.code == 0, res.err
    head = (tmp_path / "c.csv").read_text().splitlines()[0].split(",")
    assert head and all(SNAKE.fullmatch(h) for h in head), head


def test_text_tables_use_the_one_human_header_per_quantity(trace):
    """drop and sweep-report's text tables print the report's headers (replay.present.format.HEADERS), not
    key-like ones (io_saved_%_decode, saved_MiB, budget_MiB, gap_pp)."""
    from replay.present.format import HEADERS

    res = run_cli("drop", trace, "--mode", "closed", "--budget-mib", "1")  # (static: the same headers, an engine's trace)
    assert res.code == 0, res.err
    out = res.out
    for bad in ("io_saved_%", "saved_MiB", "mass_lost_%", "experts_left", "cache_hit_%"):
        assert bad not in out, bad
    for k in ("io_saved_pct", "io_saved_mib", "mass_lost_pct", "routings_dropped_pct", "experts_dropped_pct", "hit_pct_decode"):
        assert HEADERS[k] in out, k
    import polars as pl

    from replay.cli.sweep import report_text

    frame = pl.DataFrame([{"trace": "t", "budget_mib": 100.0, "best_online": "lru", "best_online_hit_pct_decode": 50.0,
                           "belady_hit_pct_decode": 60.0, "gap_to_belady_pp": 10.0, "delta_vs_lru_pp": None}])
    text = report_text(frame, "r")
    for bad in ("budget_MiB", "gap_pp", "hit_%_decode", "belady_%_decode"):
        assert bad not in text, bad
    for k in ("budget_mib", "best_online", "best_online_hit_pct_decode", "belady_hit_pct_decode", "gap_to_belady_pp"):
        assert HEADERS[k] in text, k


def test_counts_print_one_way():
    from replay.present.format import cell, fmt, text_table

    assert fmt(6096, 1) == "6,096" and cell("scored", 6096) == "6,096" and cell("scored", 12) == "12"
    assert fmt(True, 1) == "True" and cell("budget_mib", 4000.0) == "4000" and cell("keep_k", 2) == "2"
    assert "6,096" in text_table([{"scored": 6096}], ["scored"])


def test_cost_check_prints_signed_errors_with_their_unit():
    from replay.present.cost import check_text

    row = {"model": "m", "budget_mib": 4000.0, "recorded_tok_s": 5.66, "predicted_tok_s": 5.77, "tok_s_err_pct": 2.0,
           "token_mape_pct": 18.6, "compared": True, "error_scope": "held out"}
    text = check_text([row, {**row, "tok_s_err_pct": -3.25}], None)
    assert " +2.0% " in text + " " and " -3.2% " in text + " " and "18.6%" in text
    assert "budget (MiB)" in text and "budget_mib" not in text.splitlines()[0]


def test_the_ms_per_token_grid_keeps_the_below_t_marks(trace):
    res = run_cli("cache", trace, "--policies", "lru", "--budgets", "0.01,1", "--flash-mib-s", "2400", "--compute-ms", "100")
    assert res.code == 0, res.err
    grids = res.out.split("estimated ms per decoded token")
    assert len(grids) == 2
    assert "0.01 *" in grids[0] and "0.01 *" in grids[1], res.out  # the mark, in the hit grids and the time grid
    assert "* budget below one token cycle T" in grids[1]
