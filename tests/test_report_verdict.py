"""The report's verdict: every figure it shows is the figure the verb prints with ``--json`` for the
same trace and options (``cache``, ``predict``, ``prefetch``, ``drop``), its picks are the ones the
rules make from those rows, and the page prints each figure at its quantity's precision (parameters
exactly: F = 0.25 is never "0.2")."""

from __future__ import annotations

import json
import re

import pytest

from replay.analyses.cost_model import BOUNDS, cost_model_from_options
from replay.analyses.paired import signed
from replay.present.format import exact, fmt_q
from replay.present.verdict import budget_line, cache_line, drop_line, prefetch_outcome, verdict_lines
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


ORDER = ["cacheable", "budget", "cache", "prefetch", "retention", "drop", "predictor", "cost", "quality"]  # the questions, in order


def _check_against_verbs(trace, report, cost):
    obj = _rows(report)
    rows = obj["rows"]
    kinds = [r["kind"] for r in rows]
    assert kinds.count("cache") == len(obj["budgets_mib"]) and "predictor" in kinds and "prefetch" in kinds and "drop" in kinds
    # the verdict answers in order: which budget, which policy there, prefetch / retention, drop-cold; then the rest
    assert kinds[:2] == ["cacheable", "budget"] and [ORDER.index(k) for k in kinds] == sorted(ORDER.index(k) for k in kinds), kinds
    _check_budget_row(trace, rows[1], cost)
    for r in (r for r in rows if r["kind"] == "retention"):  # retention: the cache verb's --retain row
        got = _ok(run_cli("cache", trace, "--retain", "--predictor", r["retain_predictor"], "--policies", r["policy"],
                          "--budgets", exact(r["budget_mib"]), "--json")).json()["rows"]
        cell = next(c for c in got if c["layer"] is None)
        for k in ("hit_pct_decode_no_retain", "hit_pct_decode", "retain_gain_pp_decode", "retain_gain_ci_low",
                  "retain_gain_ci_high", "retain_vs_no_retain"):
            assert r[k] == cell[k], k
    assert {r["policy"] for r in rows if r["kind"] == "retention"} == {"lru", "lfru"}
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
    got = [d for d in _ok(run_cli("drop", trace, "--fracs", FRACS, *extra, "--cost-model", cost, "--json")).json()["rows"]
           if d["mode"] == mode]
    # what drop-cold is worth in time under the cost model: drop --cost-model's own figures
    assert [(d["frac"], d["io_saved_pct"], d["mass_lost_pct"], d["ms_saved_per_token"]) for d in drops] == [
        (g["frac"], g["io_saved_pct"], g["mass_lost_pct"], g["ms_saved_per_token"]) for g in got]
    assert all(d["ms_saved_per_token"] is not None for d in drops)
    return rows


def _check_budget_row(trace, b, cost):
    """The budget answer's figures are the cache verb's at the chosen and the largest tested budget, each
    the best within-budget online policy there on the measure (ms/token under the cost model)."""
    assert b["measure"] == "ms_per_token"  # a cost model is present: the budget is judged on time
    assert [x["budget_mib"] for x in b["by_budget"]][-1] == b["largest_mib"]
    assert b["budget_mib"] <= b["largest_mib"] and b["budgets_tested"] >= 2
    cells = _ok(run_cli("cache", trace, "--policies", ",".join(_compared(trace)), "--budgets",
                        f"{exact(b['budget_mib'])},{exact(b['largest_mib'])}", "--cost-model", cost, "--json")).json()["rows"]
    for budget, pol, val in ((b["budget_mib"], b["policy"], b["value"]), (b["largest_mib"], b["largest_policy"], b["largest_value"])):
        ok = [c for c in cells if c["layer"] is None and c["budget_mib"] == budget and not c["overflow_loads"]]
        fastest = min(ok, key=lambda c: (c["ms_per_token"], c["policy"]))
        assert (pol, val) == (fastest["policy"], fastest["ms_per_token"])
    if b["budget_mib"] < b["largest_mib"]:  # within noise of the largest: the interval includes zero (or it is faster)
        assert b["vs_largest"] in ("tie", "better") and b["ci_low"] <= b["delta"] <= b["ci_high"]
    for d in b["doublings"]:
        assert 1.9 <= d["to_mib"] / d["from_mib"] and d["call"] in ("better", "worse", "tie")


def _compared(trace):
    from replay.analyses.policy_set import online_policies

    return online_policies(None)


def _check_printed(report, rows):
    """Each row's line on the page prints its figures at their precision, and links to its evidence."""
    md = (report / "index.md").read_text()
    html = (report / "index.html").read_text()
    verdict = md.split("## Verdict\n\n")[1].split("\n\n")[0].splitlines()
    assert verdict == [f"- {ln}" for ln in verdict_lines(rows, _anchors(md))]
    lines = iter(verdict)
    for r in rows:
        if r["kind"] in ("drop", "retention") and r is not next(x for x in rows if x["kind"] == r["kind"]):
            continue
        line = next(lines)
        if r["kind"] == "budget":
            want = [f"Budget: **{exact(r['budget_mib'])} MiB**", "(#expert-cache)", f"at {exact(r['budget_mib'])} MiB: "]
            want += [f"{exact(d['from_mib'])} → {exact(d['to_mib'])} MiB {signed(d['delta'])} ms/token" for d in r["doublings"]]
            if r["budget_mib"] < r["largest_mib"]:
                want.append(f"within noise of the largest ({exact(r['largest_mib'])} MiB) on time under the cost model")
        elif r["kind"] == "retention":
            kept = [x for x in rows if x["kind"] == "retention"]
            want = [f"{x['policy']} at {exact(x['budget_mib'])} MiB {fmt_q(x['hit_pct_decode_no_retain'], 'pct')}% → "
                    f"{fmt_q(x['hit_pct_decode'], 'pct')}%" for x in kept] + ["(#prefetch-and-retention-what-ifs)"]
        elif r["kind"] == "cache":
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
                # the verdict signs intervals as replay.analyses.paired.signed does (one decimal from 0.05,
                # below it its first significant digit)
                want.append(f"(95% interval [{signed(r['delta_ms_ci_low'])}, {signed(r['delta_ms_ci_high'])}])")
        elif r["kind"] == "drop":
            drops = [x for x in rows if x["kind"] == "drop"]
            want = [f"F = {exact(d['frac'])}: {fmt_q(d['io_saved_pct'], 'pct')}%"
                    + ("" if d.get("io_saved_ci_low") is None else  # closed loop: the paired interval (replay.analyses.paired)
                       f" (95% interval {fmt_q(d['io_saved_ci_low'], 'pct')} to {fmt_q(d['io_saved_ci_high'], 'pct')}%)")
                    + f" / {fmt_q(d['mass_lost_pct'], 'pct')}%"
                    # with a cost model, what it is worth in time
                    + f", {'saves' if d['ms_saved_per_token'] >= 0 else 'costs'} {fmt_q(abs(d['ms_saved_per_token']), 'ms')} ms/token"
                    for d in drops] + ["proxy", "(#drop-cold-trade-off)"]
        elif r["kind"] == "cacheable":  # replay.analyses.locality's answer, checked against the verbs in tests/test_profile.py
            want = ["Is this routing cacheable?", "(#expert-popularity)"]
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
    # marked, named, and their peaks left to the section (the verdict's line is not padded with them)
    assert "LRU 0.2%! (over budget)" in line and "peak " not in line and "7275" not in line
    assert "Belady bound 38.8%! (over budget)" in line and "left out as over budget (peaks in the section): layer" in line
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


def _budget_cells(ps: dict[float, float], n: int = 400, look: int = 10):
    """Overall LRU cells and their decode series at budgets with hit probabilities ``ps`` (one uniform draw
    per lookup shared by every budget: the budgets are paired, as replays of the same tokens are)."""
    import numpy as np

    from replay.analyses.paired import DecodeSeries, annotate

    u = np.random.default_rng(7).random((n, look))
    cells, series = [], {}
    for b, p in ps.items():
        hits = (u < p).sum(axis=1).astype(np.int64)
        lookups = np.full(n, look, np.int64)
        series[("lru", b)] = DecodeSeries(lookups, hits, (lookups - hits) * (1 << 20), np.ones(n, np.int64))
        cells.append({"policy": "lru", "budget_mib": b, "layer": None, "overflow_loads": 0,
                      "hit_pct_decode": 100.0 * hits.sum() / lookups.sum()})
    annotate(cells, series)
    return cells, series


def test_which_budget_is_the_smallest_within_noise_of_the_largest_and_each_doubling_is_priced():
    from replay.analyses.budget_choice import which_budget

    # 400 MiB serves exactly what 800 does (a tie); 200 is 30 points short (beyond noise)
    cells, series = _budget_cells({100.0: 0.3, 200.0: 0.6, 400.0: 0.9, 800.0: 0.9})
    r = which_budget(cells, series)
    assert (r["budget_mib"], r["largest_mib"], r["budgets_tested"], r["measure"]) == (400.0, 800.0, 4, "hit_pct_decode")
    assert r["vs_largest"] == "tie" and r["delta"] == 0.0 and r["policy"] == "lru"
    assert [(d["from_mib"], d["to_mib"], d["call"]) for d in r["doublings"]] == [
        (100.0, 200.0, "better"), (200.0, 400.0, "better"), (400.0, 800.0, "tie")]
    assert abs(r["doublings"][0]["delta"] - 30.0) < 1.5 and r["doublings"][0]["ci_low"] > 0
    # the section's evidence: every tested budget against the largest
    assert [(x["budget_mib"], x["call"]) for x in r["by_budget"]] == [(100.0, "worse"), (200.0, "worse"), (400.0, "tie"),
                                                                        (800.0, None)]
    line = budget_line(r)
    assert line.startswith("Budget: **400 MiB**, the smallest of 4 tested within noise of the largest (800 MiB) on decode hit %")
    assert "100 → 200 MiB +" in line and "400 → 800 MiB +0.0 points [+0.0, +0.0] (tie)" in line
    assert "at 400 MiB: that is LRU" in line
    # a small budget that ties by chance below one that is worse is not the answer: every larger one must tie too
    cells, series = _budget_cells({100.0: 0.9, 200.0: 0.6, 400.0: 0.9, 800.0: 0.9})
    assert which_budget(cells, series)["budget_mib"] == 400.0
    # nothing smaller within noise: the largest, said so
    cells, series = _budget_cells({200.0: 0.5, 400.0: 0.7, 800.0: 0.9})
    r = which_budget(cells, series)
    assert r["budget_mib"] == 800.0 and r["vs_largest"] is None
    assert budget_line(r).startswith("Budget: **800 MiB**, the largest of 3 tested: no smaller one comes within noise of it")
    assert which_budget(*_budget_cells({800.0: 0.9})) is None  # one budget: no question to answer


def test_drop_cold_is_priced_in_time_under_a_cost_model():
    rows = [{"mode": "static", "budget_mib": None, "frac": 0.5, "io_saved_pct": 5.8, "mass_lost_pct": 0.5,
             "ms_saved_per_token": 3.44}, {"mode": "static", "budget_mib": None, "frac": 1.0, "io_saved_pct": 66.1,
                                            "mass_lost_pct": 9.5, "ms_saved_per_token": 40.0}]
    line = drop_line(rows)
    assert "F = 0.5: 5.8% / 0.5%, saves 3.4 ms/token" in line and "F = 1: 66.1% / 9.5%, saves 40.0 ms/token" in line
    assert "the time it saves per decoded token under the cost model" in line
    bare = drop_line([{k: v for k, v in r.items() if k != "ms_saved_per_token"} for r in rows])
    assert "ms/token" not in bare and "no cost model: bytes, not time" in bare


def _captions(md: str) -> list[str]:
    return [ln for ln in md.splitlines() if ln.startswith("*") and ln.endswith("*") and not ln.startswith("**")]


def test_captions_speak_only_of_what_the_report_holds(qwen, synth):
    """Qwen: a cost model fitted on the run, no gate inputs (no stale-gate evaluated); the synthetic
    report: a manual model given, stale-gate evaluated. Each caption and sentence names only those."""
    q = (qwen[1] / "index.md").read_text()
    caps = "\n".join(_captions(q))
    assert "manual model" not in q.split("## Cost model")[1].split("\n## ")[0] and "manual model" not in caps
    assert "fitted on this run's recorded tokens" in caps  # the tok/s figure says which model it is
    pred = q.split("## Predictor accuracy (decode)")[1].split("\n## ")[0]
    assert "No stale-gate here: " in pred  # said once, with the reason, instead of a caption about it
    said = re.sub(r"No stale-gate here: [^.]*\.", "", "\n".join(ln for ln in pred.splitlines() if not ln.startswith("|")))
    assert "stale-gate" not in said, said
    s = (synth[1] / "index.md").read_text()
    caps = "\n".join(_captions(s))
    assert "by a manual model, an assumption: it ranks, it does not measure" in caps
    assert "how fast stale-gate's coverage falls" in caps and "the first d MoE layers for stale-gate[d]" in s
