"""Static drop-cold and the static top-k cut against the recorded run."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.analyses.drop_cold import static_drop
from tests.helpers import assert_one_sentence_error, run_cli
from tests.naive.drop import naive_static_drop
from tests.trace_strategies import recorded_traces, write_trace
from traces import open_trace


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=recorded_traces(), frac=st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 4.0]), phase=st.sampled_from(["decode", "all", "prefill"]))
def test_static_drop_matches_naive_twin(tmp_path_factory, spec, frac, phase):
    phases = {"decode": (1,), "prefill": (0,), "all": (0, 1)}[phase]
    rows = [r for r in spec["rows"] if r["phase"] in phases]
    if not rows:
        return
    tr = open_trace(write_trace(spec, tmp_path_factory.mktemp("drop")))
    k = spec["k"]
    got = static_drop(tr, [frac], phase=phase, keep_ks=[]).row(0, named=True)
    saved, total, lost, mass, rdrop, surv, edrop = naive_static_drop(rows, k, frac)
    assert got["io_saved_pct"] == (saved / total * 100 if total else None)
    assert got["mass_lost_pct"] == pytest.approx(lost / mass * 100 if mass else None, abs=1e-9) if mass else got["mass_lost_pct"] is None
    assert got["routings_dropped_pct"] == rdrop / len(rows) * 100
    assert got["experts_dropped_pct"] == edrop / (len(rows) * k) * 100  # skipped / routed experts
    for s in range(1, k + 1):
        assert got[f"survivors_{s}_pct"] == sum(1 for x in surv if x == s) / len(rows) * 100
    assert all(x >= 1 for x in surv)  # the top-weighted expert always survives


def test_real_qwen_tradeoff_tables(real_trace_dir):
    res = run_cli("drop", real_trace_dir("qwen"), "--fracs", "0.25,0.5,0.75,1.0", "--json")
    assert res.code == 0, res.err
    rows = res.json()["rows"]
    cold = [r for r in rows if r["mode"] == "static"]
    cut = [r for r in rows if r["mode"] == "static-k"]
    assert [r["frac"] for r in cold] == [0.25, 0.5, 0.75, 1.0]
    assert [r["keep_k"] for r in cut] == [5, 4, 3, 2, 1]
    # more aggressive thresholds never save less or lose less
    for a, b in zip(cold, cold[1:]):
        assert b["io_saved_pct"] >= a["io_saved_pct"] and b["mass_lost_pct"] >= a["mass_lost_pct"]
    for r in rows:
        assert r["phase"] == "decode" and 0 <= r["io_saved_pct"] <= 100 and 0 <= r["mass_lost_pct"] <= 100
    # the reason drop-cold exists: at equal reads avoided it discards less weight than cutting top-k
    compared = [r for r in cold if r["static_k_mass_lost_at_equal_io_pct"] is not None and r["io_saved_pct"] > 0]
    assert compared and all(r["mass_lost_pct"] < r["static_k_mass_lost_at_equal_io_pct"] for r in compared)
    text = run_cli("drop", real_trace_dir("qwen"), "--fracs", "0.5")
    assert "decode" in text.out and "weight mass is not quality" in text.out


def test_a_dropped_repeat_inside_one_load_saves_nothing(tmp_path):
    """Prefill load, two tokens route expert 3: the first read it (1000 bytes), the second was a
    repeat (recorded 0 bytes). Dropping only the first saves nothing: the second still needs it."""
    def spec(w_second):
        rows = [
            {"turn": 0, "batch": 0, "phase": 0, "step": 0, "layer": 0, "experts": [1, 3], "weights": [0.9, 0.1],
             "residency": [0, 0], "read_bytes": [1000, 1000]},
            {"turn": 0, "batch": 0, "phase": 0, "step": 1, "layer": 0, "experts": [2, 3], "weights": [1.0 - w_second, w_second],
             "residency": [0, 0], "read_bytes": [1000, 0]},
        ]
        return {"n_layer": 1, "n_expert": 4, "k": 2, "sizes": [1000], "rows": rows}

    kept = static_drop(open_trace(write_trace(spec(0.45), tmp_path)), [0.5], phase="prefill", keep_ks=[]).row(0, named=True)
    assert kept["slots_dropped"] == 1 and kept["io_saved_mib"] == 0.0  # expert 3 still read for token 1
    both = static_drop(open_trace(write_trace(spec(0.1), tmp_path)), [0.5], phase="prefill", keep_ks=[]).row(0, named=True)
    assert both["slots_dropped"] == 2 and both["io_saved_mib"] * (1 << 20) == 1000.0
    assert both["io_saved_pct"] == pytest.approx(1000 / 3000 * 100)


def test_bad_options(real_trace_dir, synth_trace_dir):
    q = real_trace_dir("qwen")
    assert_one_sentence_error(run_cli("drop", q, "--fracs", "x"), "--fracs")
    assert_one_sentence_error(run_cli("drop", q, "--fracs", "-1"), "--fracs")
    assert_one_sentence_error(run_cli("drop", q, "--phase", "both"), "--phase")
    s = synth_trace_dir(layers=2, experts=8, top_k=2, embd=4, tokens=10, prompt_tokens=2, routing_only=True)
    assert_one_sentence_error(run_cli("drop", s, "--mode", "static"), "residency")


def test_text_prints_parameters_exactly_and_labels_both_dropped_shares(real_trace_dir):
    """F = 0.125 and 0.75 appear as given (not rounded to a fixed precision); the two dropped shares
    carry labels that say which is which, and experts dropped is never above routings with a drop."""
    res = run_cli("drop", real_trace_dir("qwen"), "--fracs", "0.125,0.75")
    assert res.code == 0, res.err
    lines = res.out.splitlines()
    assert any(ln.split()[:1] == ["0.125"] for ln in lines) and any(ln.split()[:1] == ["0.75"] for ln in lines)
    assert "Routings with a drop (%)" in res.out and "Experts dropped (%, engine's 'routings dropped')" in res.out
    rows = run_cli("drop", real_trace_dir("qwen"), "--fracs", "0.125,0.75", "--json").json()["rows"]
    for r in rows:
        assert 0 <= r["experts_dropped_pct"] <= r["routings_dropped_pct"] <= 100
    cut = [r for r in rows if r["mode"] == "static-k"]
    # the top-k cut at keep_k drops every routing's last k - keep_k slots: an exact share of routed experts
    assert [r["experts_dropped_pct"] for r in cut] == [pytest.approx((6 - r["keep_k"]) / 6 * 100) for r in cut]


def test_bytes_are_not_time_only_without_a_cost_model(real_trace_dir, tmp_path):
    q = real_trace_dir("qwen")
    assert "bytes are not time" in run_cli("drop", q, "--fracs", "0.5").out.lower()
    fit = run_cli("cost", "fit", q, "--json")
    (tmp_path / "m.json").write_text(fit.out)
    for mode in ("static", "closed"):
        res = run_cli("drop", q, "--mode", mode, "--fracs", "0.5", "--cost-model", tmp_path / "m.json")
        assert res.code == 0, res.err
        assert "ms/token" in res.out and "bytes are not time" not in res.out.lower()


def test_phase_accepts_the_same_values_in_every_verb(real_trace_dir):
    """decode, prefill and all are accepted by drop, predict and cache alike; anything else gets the
    same one sentence from each."""
    q = real_trace_dir("qwen")
    verbs = {"drop": ["drop", q, "--fracs", "0.5"], "predict": ["predict", q, "--predictors", "prev-token"],
             "cache": ["cache", q, "--policies", "lru", "--budgets", "4000"]}
    for args in verbs.values():
        for phase in ("decode", "prefill", "all"):
            res = run_cli(*args, "--phase", phase)
            assert res.code == 0, (args[0], phase, res.err)
    errors = set()
    for args in verbs.values():
        res = run_cli(*args, "--phase", "both")
        assert_one_sentence_error(res, "--phase", "'both'", "decode", "prefill", "all")
        errors.add(res.err)
    assert len(errors) == 1
