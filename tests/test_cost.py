"""Cost model: fit on recorded engine metrics, apply to replayed bytes, honest about its limits."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.analyses.cost_model import MIB, CostModel, add_time_columns, choose, fit_candidates, load_cost_model, manual_model
from tests.helpers import assert_one_sentence_error, run_cli
from traces.format.errors import UserError


def feats(wall, rb, misses=None):
    n = len(wall)
    return pl.DataFrame({"token": np.arange(n), "wall_ms": np.asarray(wall, float), "read_bytes": np.asarray(rb, float),
                         "misses": np.asarray(misses if misses is not None else np.zeros(n), float)})


def naive_ols_line(x, y):
    """Closed-form simple regression, written out."""
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx = sum((a - mx) ** 2 for a in x)
    slope = sxy / sxx
    return my - slope * mx, slope


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.floats(1, 2000), st.floats(1, 5000)), min_size=8, max_size=60, unique_by=lambda t: t[0]))
def test_bytes_fit_matches_closed_form(points):
    mib = [p[0] for p in points]
    wall = [p[1] for p in points]
    cands = fit_candidates(feats(wall, np.array(mib) * MIB), "t")
    a, b = naive_ols_line(mib, wall)
    m = cands[0]
    assert m.terms == "bytes"
    assert m.intercept_ms == pytest.approx(a, rel=1e-6, abs=1e-6)
    assert m.ms_per_mib == pytest.approx(b, rel=1e-6, abs=1e-9)


def test_exact_linear_data_recovers_coefficients_and_bandwidth():
    rng = np.random.default_rng(0)
    mib = rng.uniform(50, 800, 100)
    wall = 90.0 + 0.5 * mib
    m = choose(fit_candidates(feats(wall, mib * MIB), "t"))
    assert m.intercept_ms == pytest.approx(90.0) and m.ms_per_mib == pytest.approx(0.5)
    assert m.bandwidth_mib_s == pytest.approx(2000.0)
    assert m.r2 == pytest.approx(1.0) and m.heldout_mape_pct == pytest.approx(0.0, abs=1e-9)


def test_misses_term_is_added_only_when_it_pays():
    rng = np.random.default_rng(1)
    mib = rng.uniform(50, 800, 200)
    misses = rng.integers(0, 300, 200).astype(float)
    # misses carry real cost independent of bytes -> the richer model wins on held-out error
    m = choose(fit_candidates(feats(100 + 0.4 * mib + 2.0 * misses, mib * MIB, misses), "t"))
    assert m.terms == "bytes+misses" and m.ms_per_miss == pytest.approx(2.0)
    # misses carry nothing -> the simple model stays
    m = choose(fit_candidates(feats(100 + 0.4 * mib + rng.normal(0, 5, 200), mib * MIB, misses), "t"))
    assert m.terms == "bytes"


def test_manual_model_and_bad_values():
    m = manual_model(flash_mib_s=2000.0, compute_ms=80.0)
    assert m.predict_ms(1000 * MIB) == pytest.approx(80.0 + 500.0)
    with pytest.raises(UserError, match="--flash-mib-s"):
        manual_model(0.0, 10.0)
    with pytest.raises(UserError, match="--compute-ms"):
        manual_model(100.0, -1.0)


def test_add_time_columns_more_bytes_is_slower():
    m = CostModel(model="x", terms="bytes", intercept_ms=100.0, ms_per_mib=0.5, resid_std_ms=40.0)
    f = pl.DataFrame({"read_mib_decode": [1000.0, 2000.0], "misses_decode": [10, 20], "tokens_decode": [10, 10]})
    out = add_time_columns(f, m, "read_mib_decode", "misses_decode", "tokens_decode")
    assert out["ms_per_token"].to_list() == [150.0, 200.0]
    assert out["tok_s"][0] > out["tok_s"][1]
    assert out["ms_per_token_ci95"][0] == pytest.approx(1.96 * 40 / np.sqrt(10))


@pytest.mark.parametrize("name", ["qwen", "gemma", "gptoss"])
def test_fit_on_real_traces(real_trace_dir, tmp_path, name):
    res = run_cli("cost", "fit", real_trace_dir(name), "--json")
    assert res.code == 0, res.err
    obj = res.json()
    sel = [r for r in obj["rows"] if r["selected"]]
    assert len(sel) == 1
    r = sel[0]
    for key in ("model", "intercept_ms", "ms_per_mib", "r2", "heldout_mape_pct", "tokens_fit", "tokens_heldout"):
        assert key in r
    # sanity, not a magic value: time per token and per MiB are positive, held-out error is reported
    assert r["intercept_ms"] > 0 and r["ms_per_mib"] > 0
    assert r["heldout_mape_pct"] is not None and r["heldout_mape_pct"] >= 0
    assert r["tokens_fit"] + r["tokens_heldout"] == (64 if name == "gptoss" else 128)
    # the saved JSON is what --cost-model reads
    p = tmp_path / "m.json"
    p.write_text(res.out)
    m = load_cost_model(p)
    assert m.ms_per_mib == pytest.approx(r["ms_per_mib"]) and m.intercept_ms == pytest.approx(r["intercept_ms"])


def test_fit_says_what_it_cannot_see(real_trace_dir):
    res = run_cli("cost", "fit", real_trace_dir("gptoss"))
    assert res.code == 0
    assert "page faults" in res.out and "prefill is not modelled" in res.out


def test_cross_trace_table(real_trace_dir):
    res = run_cli("cost", "fit", real_trace_dir("qwen"), real_trace_dir("gemma"), "--json")
    assert res.code == 0, res.err
    cross = res.json()["cross_trace"]
    assert len(cross) == 2 and all(c["mape_pct"] >= 0 for c in cross)


def test_bad_inputs(tmp_path, synth_trace_dir):
    d = synth_trace_dir(layers=2, experts=8, top_k=2, embd=4, tokens=10, prompt_tokens=2, routing_only=True)
    assert_one_sentence_error(run_cli("cost", "fit", d), "no recorded per-token metrics")
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(UserError, match="not JSON"):
        load_cost_model(tmp_path / "bad.json")
    (tmp_path / "nokeys.json").write_text(json.dumps({"rows": [{"model": "x"}]}))
    with pytest.raises(UserError, match="intercept_ms"):
        load_cost_model(tmp_path / "nokeys.json")
    with pytest.raises(UserError, match="no such cost-model file"):
        load_cost_model(tmp_path / "missing.json")


def test_cache_rows_gain_time_columns(real_trace_dir, tmp_path):
    q = real_trace_dir("qwen")
    fit = run_cli("cost", "fit", q, "--json")
    (tmp_path / "m.json").write_text(fit.out)
    res = run_cli("cache", q, "--policies", "lru,layer", "--budgets", "2000,4000", "--cost-model", tmp_path / "m.json", "--json")
    assert res.code == 0, res.err
    rows = res.json()["rows"]
    m = load_cost_model(tmp_path / "m.json")
    for r in rows:
        mib_per_tok = r["read_mib_decode"] / 128
        assert r["ms_per_token"] == pytest.approx(m.intercept_ms + m.ms_per_mib * mib_per_tok)
        assert r["tok_s"] == pytest.approx(1000 / r["ms_per_token"])
    lru = {r["budget_mib"]: r for r in rows if r["policy"] == "lru"}
    assert lru[4000.0]["ms_per_token"] < lru[2000.0]["ms_per_token"]  # fewer bytes, less time
    text = run_cli("cache", q, "--policies", "lru,layer", "--budgets", "2000", "--flash-mib-s", "2000", "--compute-ms", "100")
    assert text.code == 0 and "fastest online policy per budget" in text.out and "manual model" in text.out


def test_cost_options_refused(real_trace_dir, tmp_path):
    q = real_trace_dir("qwen")
    assert_one_sentence_error(run_cli("cache", q, "--flash-mib-s", "2000"), "both --flash-mib-s and --compute-ms")
    assert_one_sentence_error(run_cli("cache", q, "--flash-mib-s", "-5", "--compute-ms", "1"), "--flash-mib-s")
    (tmp_path / "m.json").write_text("{}")
    assert_one_sentence_error(run_cli("cache", q, "--cost-model", tmp_path / "m.json", "--flash-mib-s", "1", "--compute-ms", "1"),
                              "alternatives")


@pytest.mark.parametrize("name", ["qwen", "gemma", "gptoss"])
def test_device_check_tracks_recorded_speed(real_trace_dir, name):
    """LRU replay bytes -> fitted model -> tok/s, against the device's recorded tok/s. The error is
    reported; the test only demands it is computed from the replay and is not absurd."""
    res = run_cli("cost", "check", real_trace_dir(name), "--json")
    assert res.code == 0, res.err
    r = res.json()["rows"][0]
    rec = {"qwen": 5.657, "gemma": 4.971, "gptoss": 0.503}[name]
    assert r["recorded_tok_s"] == pytest.approx(rec, abs=0.001)  # 1000 / mean wall, as the engine's summary says
    assert r["predicted_tok_s"] > 0 and abs(r["tok_s_err_pct"]) < 50
    assert "heldout_run_mean_err_pct" in r and "heldout_mape_pct" in r and "heldout_tok_s_err_pct" not in r
    # the replay's own bytes, not the recorded ones, went into the model (they agree: validation is exact)
    assert r["replay_read_mib_per_token"] == pytest.approx(r["recorded_read_mib_per_token"], rel=1e-9)


def test_check_with_the_model_fitted_on_the_same_run_says_in_sample(real_trace_dir, tmp_path):
    q, g = real_trace_dir("qwen"), real_trace_dir("gemma")
    fit = run_cli("cost", "fit", q, "--json")
    row = [r for r in fit.json()["rows"] if r["selected"]][0]
    assert row["fit_trace_id"].startswith("sha256:") and row["fit_trace"] == str(q)
    # both held-out errors are reported, under different names
    assert row["heldout_mape_pct"] > 0 and row["heldout_run_mean_err_pct"] is not None
    (tmp_path / "q.json").write_text(fit.out)
    res = run_cli("cost", "check", q, "--cost-model", tmp_path / "q.json", "--json")
    assert res.code == 0, res.err
    r = res.json()["rows"][0]
    assert r["error_scope"].startswith("in-sample") and abs(r["tok_s_err_pct"]) < 1e-6  # 0 by construction
    text = run_cli("cost", "check", q, "--cost-model", tmp_path / "q.json").out
    assert "IN-SAMPLE" in text and "not a measure of accuracy" in text
    # the same model on another model's run is refused (issue 28 item 4); with leave, out-of-sample and marked
    refused = run_cli("cost", "check", g, "--cost-model", tmp_path / "q.json", "--json")
    assert_one_sentence_error(refused, "fitted on Qwen3-30B-A3B-Q4_K_M")
    other = run_cli("cost", "check", g, "--cost-model", tmp_path / "q.json", "--foreign-cost-model", "--json").json()["rows"][0]
    assert other["error_scope"].startswith("out-of-sample") and other["cost_model_foreign"] is True
    # the same run imported again elsewhere is still the same run
    from tests.conftest import real_files
    from traces.importers.bigmoe import import_bigmoe

    csv, metrics = real_files("qwen")
    import_bigmoe(csv, tmp_path / "again", metrics=metrics)
    again = run_cli("cost", "check", tmp_path / "again", "--cost-model", tmp_path / "q.json", "--json").json()["rows"][0]
    assert again["error_scope"].startswith("in-sample")


def test_check_at_another_budget_compares_nothing(real_trace_dir):
    """The device ran at 4000 MiB; at 3000 MiB there is no recorded speed, so no error is printed."""
    q = real_trace_dir("qwen")
    r = run_cli("cost", "check", q, "--budget-mib", "3000", "--json").json()["rows"][0]
    assert r["compared"] is False and r["budget_mib"] == 3000.0 and r["recorded_budget_mib"] == 4000.0
    assert r["tok_s_err_pct"] is None and r["token_mape_pct"] is None and r["recorded_tok_s"] is None
    assert "heldout_run_mean_err_pct" not in r and r["predicted_tok_s"] > 0
    text = run_cli("cost", "check", q, "--budget-mib", "3000").out
    assert "prediction only, no error" in text and "the device ran at 4000 MiB, not 3000 MiB" in text
    assert "at the recorded budget" not in text
    same = run_cli("cost", "check", q, "--budget-mib", "4000", "--json").json()["rows"][0]
    assert same["compared"] is True and same["tok_s_err_pct"] is not None


def test_missing_cost_model_file_is_named_visibly(tmp_path):
    """Found by the CLI fuzz test: a blank --cost-model printed 'error:  : no such cost-model file'
    (the path invisible, the option unnamed)."""
    from tests.helpers import assert_one_sentence_error, run_cli

    res = run_cli("cost", "check", str(tmp_path / "nope"), "--cost-model", " ")
    assert_one_sentence_error(res, "--cost-model ' '")
