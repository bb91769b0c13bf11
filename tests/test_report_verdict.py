"""The report's verdict: every figure it shows is the figure the verb prints with ``--json`` for the
same trace and options (``cache``, ``predict``, ``prefetch``, ``drop``), its picks are the ones the
rules make from those rows, and the page prints each figure at its quantity's precision (parameters
exactly: F = 0.25 is never "0.2")."""

from __future__ import annotations

import json

import pytest

from replay.analyses.cost_model import BOUNDS, cost_model_from_options
from replay.analyses.paired import signed
from replay.present.format import exact, fmt_q
from replay.present.verdict import cache_line, prefetch_outcome, verdict_lines
from tests.helpers import run_cli

FRACS = "0.25,0.5,0.75,1.0,1.5"  # the report's drop-cold thresholds


def _ok(res):
    assert res.code == 0, res.err
    return res


@pytest.fixture(scope="module")
def qwen(real_trace_dir, tmp_path_factory):
    """The Qwen report with the cost model it fits, and that model as a file for the verbs."""
    trace = real_trace_dir("qwen")
    d = tmp_path_factory.mktemp("qwen-verdict")
    (d / "cost.json").write_text(_ok(run_cli("cost", "fit", trace, "--json")).out)
    _ok(run_cli("report", trace, "-o", d / "r"))
    return trace, d / "r", d / "cost.json"


@pytest.fixture(scope="module")
def synth(synth_trace_dir, tmp_path_factory):
    """A synthetic trace (gate inputs: stale-gate predicts; no recorded budget or residency: the
    closed-loop drop) with two verdict budgets and a manual cost model given as a file."""
    trace = synth_trace_dir(layers=6, experts=16, top_k=2, embd=8, tokens=40, prompt_tokens=8)
    d = tmp_path_factory.mktemp("synth-verdict")
    (d / "cost.json").write_text(json.dumps(cost_model_from_options(None, 2400.0, 110.0).row()))
    _ok(run_cli("report", trace, "-o", d / "r", "--budget-mib", "40,64", "--cost-model", d / "cost.json"))
    return trace, d / "r", d / "cost.json"


def _rows(report):
    obj = json.loads((report / "verdict.json").read_text())
    assert obj["command"] == "report" and obj["rows"]
    return obj


def _check_against_verbs(trace, report, cost):
    obj = _rows(report)
    rows = obj["rows"]
    kinds = [r["kind"] for r in rows]
    assert kinds.count("cache") == len(obj["budgets_mib"]) and "predictor" in kinds and "prefetch" in kinds and "drop" in kinds
    for r in (r for r in rows if r["kind"] == "cache"):
        pols = r["policies_compared"]
        got = _ok(run_cli("cache", trace, "--policies", ",".join([*pols, "belady"]), "--budgets", exact(r["budget_mib"]),
                          "--cost-model", cost, "--json")).json()["rows"]
        cells = {c["policy"]: c for c in got if c["layer"] is None}
        online = [cells[p] for p in pols]
        ok = [c for c in online if not c["overflow_loads"]]
        best = min(ok, key=lambda c: (-c["hit_pct_decode"], c["policy"]))
        fastest = min(ok, key=lambda c: (c["ms_per_token"], c["policy"]))
        assert r["policy"] == best["policy"]
        for k in ("hit_pct_decode", "read_mib", "preload_mib", "ms_per_token", "tok_s", "peak_resident_mib"):
            assert r[k] == best.get(k), k
            assert r[f"lru_{k}"] == cells["lru"].get(k), k
        assert r["over_budget"] is False and r["lru_over_budget"] == bool(cells["lru"]["overflow_loads"])
        assert r["belady_hit_pct_decode"] == cells["belady"]["hit_pct_decode"]
        assert r["belady_over_budget"] == bool(cells["belady"]["overflow_loads"])
        assert r["gap_to_belady_pp"] == cells["belady"]["hit_pct_decode"] - best["hit_pct_decode"]
        if r.get("bound_hit_pct_decode") is not None:  # unequal expert sizes: the gap against the true bound
            ub = _ok(run_cli("cache", trace, "--policies", "opt-bound", "--budgets", exact(r["budget_mib"]), "--json")).json()["rows"][0]
            assert r["bound_hit_pct_decode"] == ub["hit_pct_decode"] >= best["hit_pct_decode"]
            assert r["gap_to_bound_pp"] == ub["hit_pct_decode"] - best["hit_pct_decode"]
        assert (r["fastest_policy"], r["fastest_ms_per_token"], r["fastest_tok_s"]) == (
            fastest["policy"], fastest["ms_per_token"], fastest["tok_s"])
        left = sorted(c["policy"] for c in online if c["overflow_loads"])  # named in alphabetical order
        assert [x.split(" (peak")[0] for x in (r["over_budget_left_out"] or "").split(", ") if x] == left
    pred = next(r for r in rows if r["kind"] == "predictor")
    got = _ok(run_cli("predict", trace, "--horizon", "1..2", "--json")).json()["rows"]
    overall = {p["predictor"]: p for p in got if p["layer"] is None}
    usable = [p for n, p in overall.items() if n != "ctrl" and not p.get("in_sample") and p["slot_acc_pct"] is not None]
    # ties: a predictor that learns nothing (in_sample is None for it) before a learner, then by name
    assert pred["predictor"] == min(usable, key=lambda p: (-p["slot_acc_pct"], p.get("in_sample") is not None,
                                                           p["predictor"]))["predictor"]
    for k in ("slot_acc_pct", "whole_acc_pct", "scored"):
        assert pred[k] == overall[pred["predictor"]][k], k
    for r in (r for r in rows if r["kind"] == "prefetch"):
        assert r["predictor"] == pred["predictor"]
        args = ["--predictor", r["predictor"], "--budget-mib", exact(r["budget_mib"]), "--policy", r["policy"]]
        got = _ok(run_cli("prefetch", trace, *args, *(["--guard"] if r["guard"] else []), "--cost-model", cost, "--json"))
        row = got.json()["rows"][0]
        for k, v in r.items():
            if k != "kind":
                assert v == row[k], k
        # the configuration shown is the one that saves most time among those that read something
        other = "lfru" if r["policy"] == "lru" else "lru"
        alt = _ok(run_cli("prefetch", trace, "--predictor", r["predictor"], "--budget-mib", exact(r["budget_mib"]), "--policy",
                          other, *(["--guard"] if other == "lfru" else []), "--cost-model", cost, "--json")).json()["rows"][0]
        if alt["spec_fills"] and r["spec_fills"]:
            assert r["ms_per_token_baseline"] - r["ms_per_token"] >= alt["ms_per_token_baseline"] - alt["ms_per_token"]
        if alt["spec_fills"]:
            assert r["spec_fills"]
    drops = [r for r in rows if r["kind"] == "drop"]
    mode = drops[0]["mode"]
    extra = [] if mode == "static" else ["--mode", "closed", "--budget-mib", exact(drops[0]["budget_mib"]), "--policy", "lru"]
    got = [d for d in _ok(run_cli("drop", trace, "--fracs", FRACS, *extra, "--json")).json()["rows"] if d["mode"] == mode]
    assert [(d["frac"], d["io_saved_pct"], d["mass_lost_pct"]) for d in drops] == [
        (g["frac"], g["io_saved_pct"], g["mass_lost_pct"]) for g in got]
    return rows


def _check_printed(report, rows):
    """Each row's line on the page prints its figures at their precision, and links to its evidence."""
    md = (report / "index.md").read_text()
    html = (report / "index.html").read_text()
    verdict = md.split("## Verdict\n\n")[1].split("\n\n")[0].splitlines()
    assert verdict == [f"- {ln}" for ln in verdict_lines(rows, _anchors(md))]
    lines = iter(verdict)
    for r in rows:
        if r["kind"] == "drop" and r is not next(x for x in rows if x["kind"] == "drop"):
            continue
        line = next(lines)
        if r["kind"] == "cache":
            want = [f"**{exact(r['budget_mib'])} MiB**", f"**{r['policy']}**: {fmt_q(r['hit_pct_decode'], 'pct')}% hits",
                    f"{fmt_q(r['read_mib'], 'mib')} MiB read (all phases)", f"{fmt_q(r['ms_per_token'], 'ms')} ms/token",
                    f"{fmt_q(r['tok_s'], 'tok_s')} tok/s", "(#expert-cache)"]
            if r.get("bound_hit_pct_decode") is None:
                want.append(f"Belady bound {fmt_q(r['belady_hit_pct_decode'], 'pct')}%")
            else:  # unequal expert sizes (Qwen): furthest-next-use is a heuristic, opt-bound the bound
                want += [f"furthest-next-use (belady, a heuristic with these unequal expert sizes) "
                         f"{fmt_q(r['belady_hit_pct_decode'], 'pct')}%",
                         f"the upper bound (opt-bound) {fmt_q(r['bound_hit_pct_decode'], 'pct')}% hits "
                         f"({fmt_q(r['gap_to_bound_pp'], 'pp')} points above the best)"]
            if r["policy"] != "lru":
                want += [f"LRU {fmt_q(r['lru_hit_pct_decode'], 'pct')}%", f"{fmt_q(r['lru_ms_per_token'], 'ms')} ms/token"]
        elif r["kind"] == "predictor":
            want = [f"**{r['predictor']}**, {fmt_q(r['slot_acc_pct'], 'pct')}% slot accuracy", "(#predictor-accuracy-decode)"]
        elif r["kind"] == "prefetch":
            want = [f"{fmt_q(r['hit_pct_decode_baseline'], 'pct')}% → {fmt_q(r['hit_pct_decode'], 'pct')}%",
                    f"{fmt_q(r['ms_per_token_baseline'], 'ms')} → {fmt_q(r['ms_per_token'], 'ms')} ms/token",
                    f"{fmt_q(r['tok_s_baseline'], 'tok_s')} → {fmt_q(r['tok_s'], 'tok_s')} tok/s",
                    f"at {exact(r['budget_mib'])} MiB", "(#prefetch-and-retention-what-ifs)"]
            if r["spec_fills"] and r["vs_baseline_time"] == "worse" and r["hit_pct_decode"] > r["hit_pct_decode_baseline"]:
                want.append("loses on wall-clock time beyond noise even though it raises the hit rate")
            if r["spec_fills"] and r["vs_baseline_time"] == "tie":  # the paired interval includes zero
                want.append("tie within noise (±")
            if r["spec_fills"]:
                # the verdict signs intervals as replay.analyses.paired.signed does (two decimals below 0.05)
                want.append(f"(95% interval [{signed(r['delta_ms_ci_low'])}, {signed(r['delta_ms_ci_high'])}])")
        elif r["kind"] == "drop":
            drops = [x for x in rows if x["kind"] == "drop"]
            want = [f"F = {exact(d['frac'])}: {fmt_q(d['io_saved_pct'], 'pct')}%"
                    + ("" if d.get("io_saved_ci_low") is None else  # closed loop: the paired interval (replay.analyses.paired)
                       f" (95% interval {fmt_q(d['io_saved_ci_low'], 'pct')} to {fmt_q(d['io_saved_ci_high'], 'pct')}%)")
                    + f" / {fmt_q(d['mass_lost_pct'], 'pct')}%"
                    for d in drops] + ["proxy", "(#drop-cold-trade-off)"]
        else:
            want = [r["model"], "(#cost-model)"]
        for w in want:
            assert w in line, (w, line)
    for r in rows:  # the HTML says the same (its own markup for bold and links)
        if r["kind"] == "cache":
            assert f"<b>{exact(r['budget_mib'])} MiB</b>" in html and f"{fmt_q(r['tok_s'], 'tok_s')} tok/s" in html
    assert "<a href='#expert-cache'>→ Expert cache</a>" in html


def _anchors(md):
    from replay.present.report import anchor

    return {t: anchor(t) for t in (ln[3:] for ln in md.splitlines() if ln.startswith("## ")) if t != "Verdict"}


def test_qwen_verdict_equals_the_verbs(qwen):
    trace, report, cost = qwen
    rows = _check_against_verbs(trace, report, cost)
    _check_printed(report, rows)
    cache = next(r for r in rows if r["kind"] == "cache")
    assert cache["budget_mib"] == 4000.0 and cache["budget_from"] == "the recorded budget"
    assert "layer" in cache["over_budget_left_out"]  # over budget at every size: never the pick, named as left out
    assert next(r for r in rows if r["kind"] == "drop")["mode"] == "static"  # the engine recorded its residency


def test_synthetic_verdict_equals_the_verbs_at_each_given_budget(synth):
    trace, report, cost = synth
    obj = _rows(report)
    assert obj["budgets_mib"] == [40.0, 64.0] and obj["budget_from"] == "given"
    rows = _check_against_verbs(trace, report, cost)
    _check_printed(report, rows)
    assert [r["budget_mib"] for r in rows if r["kind"] == "prefetch"] == [40.0, 64.0]
    assert next(r for r in rows if r["kind"] == "predictor")["predictor"].startswith("stale-gate")
    md = (report / "index.md").read_text()
    assert "F = 0.25: " in md and "F = 0.2:" not in md and "F = 0.8:" not in md


def test_over_budget_figures_stay_marked_and_ties_are_said():
    row = {"budget_mib": 390.0, "budget_from": "given", "policy": "lfu", "policies_compared": ["lru", "lfu"],
           "hit_pct_decode": 23.0, "read_mib": 100.0, "ms_per_token": None, "tok_s": None,
           "lru_hit_pct_decode": 0.25, "lru_read_mib": 120.0, "lru_over_budget": True, "lru_peak_resident_mib": 7275.0,
           "belady_hit_pct_decode": 38.75, "belady_over_budget": True, "belady_peak_resident_mib": 400.0,
           "gap_to_belady_pp": 15.75, "over_budget_left_out": "layer (peak 7275.0 MiB)"}
    line = cache_line(row)
    assert "LRU 0.2%! (over budget: the cache overflowed, peak 7275.0 MiB)" in line
    assert "Belady bound 38.8%! (over budget" in line and "left out as over budget: layer (peak 7275.0 MiB)" in line
    assert "ms/token" not in line  # no cost model: no time
    # pin preloads its hot experts: said, and why it can beat the bound (which starts empty) is not a negative "above"
    pinned = cache_line({**row, "policy": "pin", "preload_mib": 10.5, "gap_to_belady_pp": -1.5625})
    assert "+ 10.5 MiB preloaded before the first token" in pinned and "(1.56 points below the best)" in pinned
    p = {"hit_pct_decode": 75.0, "hit_pct_decode_baseline": 74.0, "spec_fills": 3, "ms_per_token": 10.02,
         "ms_per_token_baseline": 10.0}
    assert prefetch_outcome(p) == "prefetching loses on wall-clock time even though it raises the hit rate"
    assert prefetch_outcome({**p, "ms_per_token": 9.99}) == "prefetching wins on time, by less than 0.1 ms/token"
    assert "no change" in prefetch_outcome({**p, "spec_fills": 0})
    # with the paired interval (replay.analyses.paired): a call only beyond noise, else a tie
    q = {**p, "delta_ms_per_token": 0.02, "delta_ms_ci_low": -0.5, "delta_ms_ci_high": 0.54, "vs_baseline_time": "tie"}
    assert prefetch_outcome(q) == ("prefetching and no prefetch tie within noise (±0.5 ms/token) on time, +0.02 ms/token "
                                   "(95% interval [-0.5, +0.5])")
    q = {**q, "delta_ms_ci_low": 0.01, "delta_ms_ci_high": 0.03, "vs_baseline_time": "worse"}
    assert prefetch_outcome(q).startswith("prefetching loses on wall-clock time beyond noise even though it raises the hit rate")
    assert "bytes are not time" in prefetch_outcome({**p, "ms_per_token": None})


def test_bounds_are_never_the_best_online_policy(qwen):
    rows = _rows(qwen[1])["rows"]
    for r in (r for r in rows if r["kind"] == "cache"):
        assert r["policy"] not in BOUNDS and not set(r["policies_compared"]) & set(BOUNDS)


def test_a_table_of_cache_rows_marks_over_budget_hit_rates():
    import polars as pl

    from replay.present.report import Table, _md_table

    f = pl.DataFrame({"policy": ["lru", "layer"], "hit_pct_decode": [40.0, 38.25], "overflow_loads": [0, 47]})
    rows = _md_table(Table("t", f, "c")).splitlines()[2:]
    assert rows == ["| lru | 40.0 | 0 |", "| layer | 38.2! | 47 |"]


def test_bad_verdict_budget_is_one_sentence(synth, tmp_path):
    from tests.helpers import assert_one_sentence_error

    res = run_cli("report", synth[0], "-o", tmp_path / "r", "--budget-mib", "4GB")
    assert_one_sentence_error(res, "--budget-mib")
    assert not (tmp_path / "r").exists()
