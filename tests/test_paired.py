"""Paired comparisons (replay.analyses.paired): the interval's coverage on synthetic draws with a known
difference, and one call (better / tie within noise) made alike by every surface that names a
best: the API, ``cache --cost-model``, ``sweep-report`` and the report's verdict."""

from __future__ import annotations

import json
import math

import numpy as np
import polars as pl
import pytest

import replay
from replay import api
from replay.analyses.paired import DecodeSeries, block_tokens, call, decide, diff_hit_pp, diff_per_token, series_of, t975
from tests.helpers import run_cli
from tests.paired_traces import write_routing_trace

POLICIES = ["lru", "lfu", "s3fifo", "belady"]
BUDGET = 24  # MiB: 24 of the 4 x 64 one-MiB experts; the win trace's hot set is 16 of them
MANUAL = ("--flash-mib-s", "1000", "--compute-ms", "10")


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("paired")
    # null seed 2: the best online policy there is not LRU itself (so the call is against LRU; seeds 3, 4 and 11 pick LRU)
    return {"win": write_routing_trace(root / "win", "win"), "null": write_routing_trace(root / "null", "null", seed=2)}


# -- the method ------------------------------------------------------------------------------

def _ar_series(rng, n, delta, phi=0.5, L=40):
    """Two settings' decode series with correlated per-token hit probabilities (a shared AR(1)
    component, each its own AR(1) part): true difference of decode hit % = 100 x delta exactly."""
    sd = np.array([[0.08], [0.05], [0.05]]) * math.sqrt(1 - phi ** 2) / math.sqrt(1 - 0.64)
    z = rng.normal(0, 1, (3, n)) * sd
    x = np.zeros((3, n))
    for t in range(1, n):
        x[:, t] = phi * x[:, t - 1] + z[:, t]
    pa = np.clip(0.5 + delta + x[0] + x[1], 0, 1)
    pb = np.clip(0.5 + x[0] + x[2], 0, 1)
    look, one, zero = np.full(n, L, np.int64), np.ones(n, np.int64), np.zeros(n, np.int64)
    return (DecodeSeries(look, rng.binomial(L, pa), zero, one), DecodeSeries(look, rng.binomial(L, pb), zero, one))


def test_coverage_of_a_known_difference_is_near_nominal():
    rng = np.random.default_rng(7)
    n_draws, covered = 300, 0
    for i in range(n_draws):
        a, b = _ar_series(rng, 400, 0.02)
        d = diff_hit_pp(a, b, seed=i, resamples=400)
        covered += d.low <= 2.0 <= d.high
    assert abs(covered / n_draws - 0.95) <= 0.035, covered / n_draws


def test_coverage_of_a_null_difference_between_two_replayed_policies():
    """i.i.d. uniform routing: LRU and LFU fill the cache alike and then hold it full, so each
    lookup hits with the same probability (entries held / entries): a true difference of 0."""
    from replay.core.simulate import prepare_loads, replay
    from traces.io.reader import RoutingArrays

    rng = np.random.default_rng(11)
    layers, experts, tokens = 4, 32, 300
    covered, n_draws = 0, 150
    for i in range(n_draws):
        R = layers * (tokens + 1)
        batch = np.repeat(np.arange(tokens + 1, dtype=np.int32), layers)
        ra = RoutingArrays(turn=np.zeros(R, np.int32), batch=batch, phase=(batch > 0).astype(np.int8), step=batch.copy(),
                           layer=np.tile(np.arange(layers, dtype=np.int16), tokens + 1),
                           experts=rng.integers(0, experts, (R, 1)).astype(np.int32), weights=np.ones((R, 1), np.float32))
        loads = prepare_loads(ra, list(range(layers)), experts, np.full(layers, 1 << 20))
        s = {p: series_of(loads, replay(loads, p, 40.0)) for p in ("lru", "lfu")}
        d = diff_hit_pp(s["lfu"], s["lru"], seed=i, resamples=400)
        covered += d.low <= 0.0 <= d.high
    assert abs(covered / n_draws - 0.95) <= 0.04, covered / n_draws


def test_same_seed_same_interval_and_the_rules():
    rng = np.random.default_rng(1)
    a, b = _ar_series(rng, 128, 0.05)
    d1, d2 = diff_hit_pp(a, b), diff_hit_pp(a, b)
    assert (d1.delta, d1.low, d1.high) == (d2.delta, d2.low, d2.high)
    assert diff_hit_pp(a, b, seed=1).low != d1.low
    assert block_tokens(128) == 16 and block_tokens(10_000) == 100 and block_tokens(5) == 5
    assert abs(t975(7) - 2.3646) < 1e-3 and abs(t975(30) - 2.0423) < 1e-3 and t975(2) == pytest.approx(4.3027, abs=1e-4)
    # the ratio of sums, not a mean of per-token ratios
    look, one, zero = np.array([1, 100]), np.ones(2, np.int64), np.zeros(2, np.int64)
    d = diff_hit_pp(DecodeSeries(look, np.array([1, 50]), zero, one), DecodeSeries(look, np.array([0, 50]), zero, one))
    assert d.delta == pytest.approx(100 * (51 / 101 - 50 / 101))
    # ms per token: the intercept cancels; slope x MiB per token
    rb = np.array([1 << 20, 3 << 20])
    d = diff_per_token(DecodeSeries(look, zero, rb, one), DecodeSeries(look, zero, zero, one), ms_per_mib=2.0)
    assert d.delta == pytest.approx(4.0)
    assert call(d, higher_is_better=False) is None  # 2 tokens are one block: no interval, no call
    d = diff_per_token(DecodeSeries(np.ones(64, np.int64), np.zeros(64, np.int64), np.full(64, 1 << 20), np.ones(64, np.int64)),
                       DecodeSeries(np.ones(64, np.int64), np.zeros(64, np.int64), np.zeros(64, np.int64), np.ones(64, np.int64)),
                       ms_per_mib=2.0)
    assert (d.delta, d.low, d.high) == (2.0, 2.0, 2.0) and call(d, higher_is_better=False) == "worse"


# -- every surface makes the same call ---------------------------------------------------------

def _api_call(trace, model=None):
    f = api.cache(trace, policies=POLICIES, budgets_mib=[BUDGET], paired=True, cost_model=model)
    return decide(f.filter(pl.col("layer").is_null()).to_dicts())


def test_api_win_and_tie(traces):
    win, null = _api_call(traces["win"]), _api_call(traces["null"])
    assert win["policy"] != "lru" and win["call"] == "better" and win["low"] > 5, win
    assert null["policy"] != "lru" and null["call"] == "tie" and null["low"] < 0 < null["high"], null
    assert "lru" in null["tied"] or null["tied"], null
    assert "tie within noise (±" in null["text"]
    f = api.cache(traces["win"], policies=POLICIES, budgets_mib=[BUDGET], paired=True).filter(pl.col("layer").is_null())
    row = f.filter(pl.col("policy") == win["policy"]).row(0, named=True)
    assert row["delta_ci_low"] <= row["delta_vs_lru_pp"] <= row["delta_ci_high"] and row["vs_lru"] == "better"
    # without paired=True the frame is what it was
    plain = api.cache(traces["win"], policies=POLICIES, budgets_mib=[BUDGET])
    assert "delta_vs_lru_pp" not in plain.columns


def test_cache_cost_model_win_and_tie(traces):
    for kind, want in (("win", "better"), ("null", "tie")):
        res = run_cli("cache", traces[kind], "--policies", ",".join(POLICIES), "--budgets", str(BUDGET), *MANUAL, "--json")
        assert res.code == 0, res.err
        rows = [r for r in json.loads(res.out)["rows"] if r["layer"] is None]
        assert decide(rows)["call"] == want
        timed = decide(rows, "ms_per_token")
        assert timed["call"] == ("better" if kind == "win" else "tie"), timed
        f = api.cache(traces[kind], policies=POLICIES, budgets_mib=[BUDGET], paired=True,
                      cost_model=api.manual_cost_model(flash_mib_s=1000, compute_ms=10))
        via_api = decide(f.filter(pl.col("layer").is_null()).to_dicts(), "ms_per_token")
        assert (via_api["policy"], via_api["call"], via_api["low"]) == (timed["policy"], timed["call"], timed["low"])
        text = run_cli("cache", traces[kind], "--policies", ",".join(POLICIES), "--budgets", str(BUDGET), *MANUAL).out
        line = next(ln for ln in text.splitlines() if ln.startswith("fastest online policy"))
        if kind == "win":
            assert "beats LRU beyond noise" in line and "95% interval" in line, line
        else:
            assert "tie within noise (±" in line, line


def test_sweep_report_win_and_tie(traces, tmp_path):
    grid = tmp_path / "g.toml"
    grid.write_text(f'traces = ["{traces["win"]}", "{traces["null"]}"]\n[cache]\npolicies = {json.dumps(POLICIES)}\n'
                    f"budgets_mib = [{BUDGET}]\n")
    replay.sweep(grid, tmp_path / "out", workers=1)
    rep = replay.sweep_report(tmp_path / "out")
    calls = dict(zip(rep["trace"].to_list(), rep["vs_lru"].to_list()))
    assert calls == {str(traces["win"]): "better", str(traces["null"]): "tie"}
    for r in rep.to_dicts():
        assert r["delta_ci_low"] <= r["delta_vs_lru_pp"] <= r["delta_ci_high"]
        assert r["best_online"] == _api_call(r["trace"])["policy"]
        assert r["delta_vs_lru_pp"] == pytest.approx(_api_call(r["trace"])["delta"])
    text = run_cli("sweep-report", tmp_path / "out").out
    win_line = next(ln for ln in text.splitlines() if ln.strip().startswith(str(traces["win"])))
    null_line = next(ln for ln in text.splitlines() if ln.strip().startswith(str(traces["null"])))
    assert "better" in win_line and "tie within noise (±" in null_line, text


def test_report_verdict_win_and_tie(traces, tmp_path):
    from replay.analyses.report import write_report

    for kind, want in (("win", "better"), ("null", "tie")):
        out = write_report(traces[kind], tmp_path / kind, budget_mib=[BUDGET], policies=POLICIES)
        v = json.loads((out / "verdict.json").read_text())
        row = next(r for r in v["rows"] if r["kind"] == "cache")
        api_dec = _api_call(traces[kind])
        assert (row["policy"], row["vs_lru"]) == (api_dec["policy"], want)
        assert row["delta_vs_lru_pp"] == pytest.approx(api_dec["delta"])
        assert row["delta_ci_low"] == pytest.approx(api_dec["low"]) and row["delta_ci_high"] == pytest.approx(api_dec["high"])
        md = (out / "index.md").read_text()
        verdict = md[md.index("## Verdict"):md.index("**Contents:**")]
        assert ("beats LRU beyond noise" if kind == "win" else "tie within noise (±") in verdict, verdict
        gap = pl.read_csv(out / "tables" / "cache_gap.csv").filter(pl.col("budget_mib") == BUDGET).row(0, named=True)
        assert (gap["best_online"], gap["best_vs_lru"]) == (row["policy"], want)  # the section makes the verdict's call
        assert (gap["tied_with_best"] or "") == ", ".join(row["tied_with"])


def test_report_ranks_one_policy_set_and_names_what_it_left_out(traces, tmp_path):
    """The cache section's tables and plots rank the verdict's policies (every registered online
    policy by default, s3fifo among them); with --policies the report names the others as left out."""
    from replay.analyses.report import write_report
    from replay.policies import bound_policies, names

    out = write_report(traces["win"], tmp_path / "all", budget_mib=[BUDGET], budgets_mib=[BUDGET])
    v = json.loads((out / "verdict.json").read_text())
    compared = next(r for r in v["rows"] if r["kind"] == "cache")["policies_compared"]
    online = [p for p in names() if p not in bound_policies()]
    assert compared == online and "s3fifo" in compared
    swept = set(pl.read_csv(out / "tables" / "cache.csv")["policy"].to_list())
    assert set(online) <= swept
    grid = pl.read_csv(out / "tables" / "cache_hit_pct_decode_by_budget.csv")["policy"].to_list()
    assert set(online) <= set(grid)
    md = (out / "index.md").read_text()
    assert "Left out of the ranking: layer-opt (an offline bound" in md
    out = write_report(traces["win"], tmp_path / "some", budget_mib=[BUDGET], budgets_mib=[BUDGET], policies=["lru", "lfu"])
    md = (out / "index.md").read_text()
    assert "s3fifo (not in --policies)" in md
    v = json.loads((out / "verdict.json").read_text())
    assert next(r for r in v["rows"] if r["kind"] == "cache")["policies_compared"] == ["lru", "lfu"]


def test_prefetch_best_plain_uses_the_same_rule(traces):
    from replay.analyses.prefetching import best_plain
    from replay.core.simulate import loads_of
    from traces import open_trace

    t = open_trace(traces["win"])
    f = api.cache(t, policies=names_online(), budgets_mib=[BUDGET], paired=True)
    want = decide(f.filter(pl.col("layer").is_null()).to_dicts())
    got = best_plain(t, BUDGET, loads=loads_of(t))
    assert got["policy"] == want["policy"]
    assert got["tied_with"] == want["tied"]


def names_online():
    from replay.analyses.policy_set import online_policies

    return online_policies()


# -- the Qwen trace at its recorded budget -------------------------------------------------------

def test_qwen_s3fifo_against_lru_is_called_alike_everywhere(real_trace_dir, tmp_path):
    from replay.analyses.policy_set import online_policies
    from replay.analyses.report import write_report
    from replay.policies import REGISTRY

    d = real_trace_dir("qwen")
    t = api.open_trace(d)
    budget = t.recorded["budget_mib"]
    # the built-in online policies (a plugin another test registered in this process is not in a sweep's workers)
    builtin = [p for p in online_policies() if p in REGISTRY]
    out = write_report(d, tmp_path / "rep", policies=builtin)
    row = next(r for r in json.loads((out / "verdict.json").read_text())["rows"] if r["kind"] == "cache")
    assert row["budget_mib"] == budget and row["policy"] == "s3fifo"
    assert row["vs_lru"] in ("better", "tie") and row["delta_ci_low"] <= row["delta_vs_lru_pp"] <= row["delta_ci_high"]
    md = (out / "index.md").read_text()
    verdict = md[md.index("## Verdict"):md.index("**Contents:**")]
    assert "95% interval [" in verdict and ("beats LRU beyond noise" in verdict or "tie within noise" in verdict)
    # the API and cache --cost-model (the model the report fitted, saved by cost fit) make the same call
    pols = [*builtin, "belady"]
    model = api.fit_cost_model(t)
    f = api.cache(t, policies=pols, budgets_mib=[budget], paired=True, cost_model=model)
    dec = decide(f.filter(pl.col("layer").is_null()).to_dicts())
    assert (dec["policy"], dec["call"]) == (row["policy"], row["vs_lru"])
    assert (dec["low"], dec["high"]) == pytest.approx((row["delta_ci_low"], row["delta_ci_high"]))
    timed = decide(f.filter(pl.col("layer").is_null()).to_dicts(), "ms_per_token")
    assert (timed["policy"], timed["call"]) == (row["fastest_policy"], row["fastest_vs_lru"])
    cm = tmp_path / "cost.json"
    res = run_cli("cost", "fit", d, "--json")
    assert res.code == 0, res.err
    cm.write_text(res.out)
    res = run_cli("cache", d, "--policies", ",".join(pols), "--budget-mib", str(budget), "--cost-model", cm, "--json")
    assert res.code == 0, res.err
    rows = [r for r in json.loads(res.out)["rows"] if r["layer"] is None]
    assert (decide(rows)["policy"], decide(rows)["call"]) == (row["policy"], row["vs_lru"])
    assert (decide(rows, "ms_per_token")["call"]) == row["fastest_vs_lru"]
    grid = tmp_path / "g.toml"
    grid.write_text(f'traces = ["{d}"]\n[cache]\npolicies = {json.dumps(pols)}\nbudgets_mib = [{budget}]\n')
    replay.sweep(grid, tmp_path / "sw", workers=1)
    rep = replay.sweep_report(tmp_path / "sw").row(0, named=True)
    assert (rep["best_online"], rep["vs_lru"]) == (row["policy"], row["vs_lru"])
    assert (rep["delta_ci_low"], rep["delta_ci_high"]) == pytest.approx((row["delta_ci_low"], row["delta_ci_high"]))


def test_prefetch_and_retention_carry_the_paired_interval(traces):
    model = api.manual_cost_model(flash_mib_s=1000, compute_ms=10)
    r = api.prefetch(traces["win"], budget_mib=BUDGET, cost_model=model).row(0, named=True)
    assert r["delta_hit_pp"] == pytest.approx(r["hit_pct_decode"] - r["hit_pct_decode_baseline"])
    assert r["delta_mib_per_token"] == pytest.approx(r["total_mib_per_token"] - r["total_mib_per_token_baseline"])
    assert r["delta_ms_per_token"] == pytest.approx(r["ms_per_token"] - r["ms_per_token_baseline"])
    for pre, col in (("delta_hit", "vs_baseline"), ("delta_ms", "vs_baseline_time")):
        lo, hi = r[f"{pre}_ci_low"], r[f"{pre}_ci_high"]
        assert lo <= r[f"{pre}_pp" if pre == "delta_hit" else f"{pre}_per_token"] <= hi
        want = "tie" if lo <= 0 <= hi else ("better" if (lo > 0) == (pre == "delta_hit") else "worse")
        assert r[col] == want
    f = api.cache(traces["win"], policies=["lru"], budgets_mib=[BUDGET], retain_predictor="prev-token")
    row = f.filter(pl.col("layer").is_null()).row(0, named=True)
    assert row["retain_gain_ci_low"] <= row["retain_gain_pp_decode"] <= row["retain_gain_ci_high"]
    assert row["retain_vs_no_retain"] in ("better", "worse", "tie")


def test_closed_loop_drop_carries_the_paired_interval(traces):
    f = api.drop(traces["win"], mode="closed", budget_mib=BUDGET, fracs=[0.5, 1.0])
    rows = [r for r in f.to_dicts() if r["mode"] == "closed"]
    assert rows
    for r in rows:
        assert r["io_saved_ci_low"] <= r["io_saved_pct"] <= r["io_saved_ci_high"], r


def test_requests_are_resampled_whole(tmp_path):
    """With a request column (requests one after another), whole requests are the resampling unit:
    10 requests give t(0.975, 9) x the spread of request resamples, not the token blocks'."""
    from replay.analyses.paired import request_units, with_requests
    from replay.core.simulate import loads_of, sweep
    from traces import open_trace

    t = open_trace(write_routing_trace(tmp_path / "req", "win", tokens=400, requests=10))
    units = request_units(t)
    assert units is not None and units.tolist() == [i // 40 for i in range(400)]
    series: dict = {}
    sweep(loads_of(t), ["lru", "lfu"], [BUDGET], show_progress=False, series=series)
    plain = diff_hit_pp(series[("lfu", BUDGET)], series[("lru", BUDGET)])
    whole = with_requests(series, t)
    d = diff_hit_pp(whole[("lfu", BUDGET)], whole[("lru", BUDGET)])
    assert d.delta == plain.delta and (d.low, d.high) != (plain.low, plain.high)
    f = api.cache(t, policies=["lru", "lfu"], budgets_mib=[BUDGET], paired=True).filter(pl.col("policy") == "lfu")
    assert (f["delta_ci_low"][0], f["delta_ci_high"][0]) == pytest.approx((d.low, d.high))
    # a trace without requests, or whose batches serve several at once, resamples blocks of tokens
    assert request_units(open_trace(write_routing_trace(tmp_path / "one", "win", tokens=100))) is None


def test_streamed_replay_gives_the_same_paired_columns(traces):
    model = api.manual_cost_model(flash_mib_s=1000, compute_ms=10)
    a, b = (api.cache(traces["win"], policies=POLICIES, budgets_mib=[8, BUDGET], paired=True, cost_model=model, stream=s)
            for s in ("on", "off"))
    assert a.equals(b)
    assert a["delta_ci_low"].drop_nulls().len() == 8  # every cell (LRU against itself: 0)
