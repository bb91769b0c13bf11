"""``moe-replay cache``: JSON keys, table, bad options (exit 2, one line, no traceback), --csv."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay.cli", "cache", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.fixture(scope="module")
def small(synth_trace_dir):
    return synth_trace_dir(layers=4, experts=16, top_k=2, embd=16, tokens=40, prompt_tokens=6, routing_only=True, expert_bytes=1 << 20)


def test_json_rows_carry_design_keys(small, tmp_path):
    out = tmp_path / "cells.csv"
    p = run(str(small), "--budgets", "4,16,64", "--policies", "lru,belady,infinite", "--json", "--csv", str(out))
    assert p.returncode == 0, p.stderr
    obj = json.loads(p.stdout)
    assert obj["command"] == "cache" and obj["trace"] == str(small)
    rows = obj["rows"]
    assert len(rows) == 9
    for key in ("policy", "budget_mib", "layer", "lookups", "hits", "hit_pct_decode", "hit_pct_cum", "read_mib"):
        assert all(key in r for r in rows), key
    assert all(r["layer"] is None for r in rows)
    # T = 4 layers x top-2 x 1 MiB; the 4 MiB budget is below T... no: equal to T, not flagged.
    assert obj["token_cycle_mib"] == pytest.approx(8.0)
    assert obj["budgets_below_token_cycle"] == [4.0]
    cell = {(r["policy"], r["budget_mib"]): r for r in rows}
    # The bounds hold: belady <= infinite, lru <= belady, at every budget (hits, all phases).
    for b in (4.0, 16.0, 64.0):
        assert cell[("lru", b)]["hits"] <= cell[("belady", b)]["hits"] <= cell[("infinite", b)]["hits"]
    assert out.read_text().splitlines()[0].startswith("policy,budget_mib,layer,lookups,hits")


def test_per_layer_rows_sum_to_overall(small):
    p = run(str(small), "--budgets", "8", "--policies", "layer", "--per-layer", "--json")
    rows = json.loads(p.stdout)["rows"]
    overall = [r for r in rows if r["layer"] is None]
    layers = [r for r in rows if r["layer"] is not None]
    assert len(overall) == 1 and len(layers) == 4
    for key in ("lookups", "hits", "lookups_decode", "hits_decode"):
        assert sum(r[key] for r in layers) == overall[0][key]


def test_text_table_flags_budgets_below_t(small):
    p = run(str(small), "--budgets", "2,64", "--policies", "lru,lfu")
    assert p.returncode == 0, p.stderr
    assert "decode-only hit %" in p.stdout and "cumulative hit %" in p.stdout
    assert "T        one token cycle = 8.0 MiB" in p.stdout
    assert "2 *" in p.stdout and "* budget below one token cycle" in p.stdout


@pytest.mark.parametrize("args, words", [
    (["--policies", "lru,nope"], "unknown policy 'nope'"),
    (["--budgets", "100,abc"], "'abc' is not a number"),
    (["--budgets", "0"], "not a positive number"),
    (["--budgets", "-5"], "not a positive number"),
    (["--phase", "both"], "--phase"),
    (["--validate"], "records no cache budget"),
])
def test_bad_options_exit_2_one_line(small, args, words):
    p = run(str(small), *args)
    assert p.returncode == 2
    assert words in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    assert p.stdout == ""


def test_missing_trace_is_a_user_error(tmp_path):
    p = run(str(tmp_path / "nope"))
    assert p.returncode == 2 and "no such trace directory" in p.stderr


def test_same_input_same_output(small):
    a = run(str(small), "--budgets", "3,9", "--policies", "random,lfru", "--json", "--seed", "7")
    b = run(str(small), "--budgets", "3,9", "--policies", "random,lfru", "--json", "--seed", "7")
    assert a.returncode == 0 and a.stdout == b.stdout
