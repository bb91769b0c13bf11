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


def test_budgets_with_budget_mib_is_refused(small):
    p = run(str(small), "--budgets", "4,8", "--budget-mib", "16")
    assert p.returncode == 2 and p.stdout == ""
    assert "--budgets and --budget-mib" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_over_budget_cells_are_marked(small, tmp_path):
    """`layer` at 4 MiB gives each of the 4 layers 1 MiB, but a decode load routes 2 experts of
    1 MiB: every such load overflows. Global LRU at 4 MiB overflows only on the prefill batch (6
    prompt tokens route up to 12 experts a layer); at 64 MiB nothing overflows. Text marks the
    cells and lists their peaks; JSON and CSV carry peak_resident_mib / overflow_loads /
    over_budget on every row."""
    p = run(str(small), "--budgets", "4,64", "--policies", "lru,layer", "--flash-mib-s", "1000", "--compute-ms", "10")
    assert p.returncode == 0, p.stderr
    assert " !" in p.stdout and "! Over budget:" in p.stdout
    note = p.stdout.split("! Over budget:")[1].split("\n")[0]
    assert "layer at 4 MiB (peak 22.0 MiB resident, 164 loads overflowed)" in note and "at 64 MiB" not in note
    assert "lru at 4 MiB (peak 8.0 MiB resident, 3 loads overflowed)" in note
    assert "4 MiB: none within budget; 64 MiB: " in p.stdout
    out = tmp_path / "c.csv"
    p = run(str(small), "--budgets", "4,64", "--policies", "lru,layer", "--json", "--csv", str(out))
    rows = json.loads(p.stdout)["rows"]
    assert all("peak_resident_mib" in r and "overflow_loads" in r for r in rows)
    cell = {(r["policy"], r["budget_mib"]): r for r in rows}
    lay = cell[("layer", 4.0)]
    assert lay["over_budget"] and lay["overflow_loads"] > 0 and lay["peak_resident_mib"] > 4.0
    assert not cell[("lru", 64.0)]["over_budget"] and cell[("lru", 64.0)]["peak_resident_mib"] <= 64.0
    assert "peak_resident_mib" in out.read_text().splitlines()[0]


def test_validate_exit_code(real_trace_dir):
    """--validate exits 0 when the replay reproduces the engine, 1 (report printed) when not."""
    q = str(real_trace_dir("qwen"))
    ok = run(q, "--validate")
    assert ok.returncode == 0 and "within 0.1 points" in ok.stdout
    bad = run(q, "--validate", "--budget-mib", "3000")
    assert bad.returncode == 1 and "NOT within 0.1 points" in bad.stdout
    js = run(q, "--validate", "--budget-mib", "3000", "--json")
    assert js.returncode == 1 and json.loads(js.stdout)["reproduced"] is False


def test_help_states_both_lfu_definitions_and_the_exit_code():
    p = run("--help")
    text = " ".join(p.stdout.replace("│", " ").split())  # rich wraps option help inside a box
    assert "since the start of the run" in text and "lfu-incache" in text
    assert "exits 1 when the replay does not reproduce the engine" in text


def test_lfru_note_names_lfu_incache(small):
    p = run(str(small), "--budgets", "3,9", "--policies", "lfru,lfu-incache,lfu")
    assert p.returncode == 0, p.stderr
    assert "lfru = lfu-incache, by construction" in p.stdout
    assert "lfru = lfu," not in p.stdout and "survives eviction" in p.stdout
