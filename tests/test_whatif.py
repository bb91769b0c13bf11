"""Closed-loop drop, prefetch, retention and the eviction guard: pinned cases, real traces, CLI."""

from __future__ import annotations

import numpy as np
import pytest

from replay.analyses.prefetching import guesses, prefetch
from replay.core.driver import STAT_SPEC_FILLS, STAT_SPEC_HITS, STAT_SPEC_REFUSED
from replay.core.simulate import prepare_loads, replay
from tests.helpers import assert_one_sentence_error, run_cli
from traces import open_trace
from traces.io.reader import RoutingArrays
from traces.util.units import MIB


def _loads(batches):
    """batches: list of per-batch [experts at layer 0, experts at layer 1] (one token, top-1, decode)."""
    rows = [(b, layer, [ex]) for b, per_layer in enumerate(batches) for layer, ex in enumerate(per_layer)]
    R = len(rows)
    ra = RoutingArrays(
        turn=np.zeros(R, np.int32), batch=np.array([r[0] for r in rows], np.int32), phase=np.ones(R, np.int8),
        step=np.array([r[0] for r in rows], np.int32), layer=np.array([r[1] for r in rows], np.int16),
        experts=np.array([r[2] for r in rows], np.int32), weights=np.ones((R, 1), np.float32),
    )
    return prepare_loads(ra, [0, 1], 4, np.array([MIB, MIB]))


def _guard_case(n_warm, demanded=0):
    """(layer 1, expert 0) demanded in ``n_warm`` batches; then a batch whose layer-1 guess is expert 3
    (never seen) and whose layer 1 then routes ``demanded``. Budget 2 MiB holds two experts: the
    batch's own layer-0 expert (not evictable after its load) and (1, 0), the only possible victim
    of the speculative fill."""
    batches = [[0, 0]] * n_warm + [[0, demanded]]
    loads = _loads(batches)
    pred = np.full((loads.entries.shape[0], 1), -1, np.int32)
    pred[-1, 0] = 1 * 4 + 3  # the last batch's layer-1 row: guess (layer 1, expert 3)
    return loads, pred


@pytest.mark.parametrize("policy", ["lru", "lfru"])
def test_guard_keeps_a_warm_resident_and_counts_the_refusal(policy):
    loads, pred = _guard_case(n_warm=2, demanded=0)
    res = replay(loads, policy, 2.0, slots=True, pred=pred, fill=True, guard=True)
    assert res.stats[STAT_SPEC_REFUSED] == 1 and res.stats[STAT_SPEC_FILLS] == 0
    assert res.evictions == 0 and res.slots[-1, 0] == 1  # the warm expert (two demand accesses) survived and hit
    # without the guard the same (wrong) speculation evicts it, and the demand then misses
    res = replay(loads, policy, 2.0, slots=True, pred=pred, fill=True, guard=False)
    assert res.stats[STAT_SPEC_REFUSED] == 0 and res.stats[STAT_SPEC_FILLS] == 1
    assert res.slots[-1, 0] == 0 and res.stats[STAT_SPEC_HITS] == 0  # the warm expert was evicted for a wrong guess


@pytest.mark.parametrize("policy", ["lru", "lfru"])
def test_guard_evicts_a_resident_seen_once(policy):
    loads, pred = _guard_case(n_warm=1, demanded=3)
    res = replay(loads, policy, 2.0, slots=True, pred=pred, fill=True, guard=True)
    assert res.stats[STAT_SPEC_REFUSED] == 0 and res.stats[STAT_SPEC_FILLS] == 1 and res.evictions == 1
    assert res.slots[-1, 0] == 2 and res.stats[STAT_SPEC_HITS] == 1  # the prefetched expert was demanded: code 2


def _guard_boundary_case(m, k, n):
    """Three MoE layers, top-1, 4 experts, 3 MiB (layers 0 and 2 always route expert 0 and stay
    cached, leaving one place for layer 1). Layer 1 routes the candidate (1, 3) in ``m`` batches,
    a filler (1, 2) in ``k``, the victim (1, 0) in ``n``; then a batch whose layer-1 guess is the
    candidate. At that speculation (load i = 3B, B = m + k + n) the scores are
    victim 256 n + 253 (last demand 2 loads ago) and candidate 256 m + 253 - 3 (n + k)."""
    batches = [[0, 3, 0]] * m + [[0, 2, 0]] * k + [[0, 0, 0]] * n + [[0, 0, 0]]
    rows = [(b, layer, ex) for b, per_layer in enumerate(batches) for layer, ex in enumerate(per_layer)]
    R = len(rows)
    ra = RoutingArrays(
        turn=np.zeros(R, np.int32), batch=np.array([r[0] for r in rows], np.int32), phase=np.ones(R, np.int8),
        step=np.array([r[0] for r in rows], np.int32), layer=np.array([r[1] for r in rows], np.int16),
        experts=np.array([[r[2]] for r in rows], np.int32), weights=np.ones((R, 1), np.float32),
    )
    loads = prepare_loads(ra, [0, 1, 2], 4, np.array([MIB, MIB, MIB]))
    pred = np.full((R, 1), -1, np.int32)
    pred[R - 2, 0] = 1 * 4 + 3  # the last batch's layer-1 row names the candidate
    sv = 256 * n + 253
    threshold = sv + sv // 4 + 4 * 256
    return loads, pred, 256 * m + max(0, 253 - 3 * (n + k)) - threshold, rows


@pytest.mark.parametrize("policy", ["lru", "lfru"])
@pytest.mark.parametrize("m, k, n, admitted", [(11, 38, 5, True), (7, 20, 2, False)])
def test_guard_boundary_is_inclusive(policy, m, k, n, admitted):
    """score(candidate) == score(v) + score(v) // 4 + 1024 exactly: admitted; one less: refused
    (the naive twin, written from the same sentence, agrees on both)."""
    from tests.naive.whatif import naive_whatif

    loads, pred, margin, rows = _guard_boundary_case(m, k, n)
    assert margin == (0 if admitted else -1)
    res = replay(loads, policy, 3.0, slots=True, pred=pred, fill=True, guard=True)
    assert (res.stats[STAT_SPEC_FILLS], res.stats[STAT_SPEC_REFUSED]) == ((1, 0) if admitted else (0, 1))
    want = naive_whatif([(b, 1, layer, [ex]) for b, layer, ex in rows], [0, 1, 2], 4, {0: MIB, 1: MIB, 2: MIB},
                        policy, 3 * MIB, preds=[[3] if i == len(rows) - 2 else [None] for i in range(len(rows))],
                        fill=True, guard=True)
    st = want["stats"]
    assert (st.get("spec_fills", 0), st.get("spec_refused", 0)) == ((1, 0) if admitted else (0, 1))


def test_demand_fill_is_never_refused():
    # a warm resident is evicted by a demand miss, guard or not
    loads = _loads([[0, 0], [0, 0], [0, 3]])
    res = replay(loads, "lru", 2.0, slots=True, pred=np.full((6, 1), -1, np.int32), fill=True, guard=True)
    assert res.slots[-1, 0] == 0 and res.evictions == 1 and res.stats[STAT_SPEC_REFUSED] == 0


def test_retention_keeps_the_guess_resident():
    # 1 MiB holds one expert. After batch 1's layer-0 load, (1, 0) is the only victim... unless it is
    # the guess for batch 1's layer 1 and retained (the load then overflows rather than evict it).
    loads = _loads([[1, 0], [2, 0]])
    pred = np.full((4, 1), -1, np.int32)
    pred[3, 0] = 4 + 0  # batch 1, layer 1: guess (1, 0)
    plain = replay(loads, "lru", 1.0, slots=True)
    kept = replay(loads, "lru", 1.0, slots=True, pred=pred, retain=True)
    assert plain.slots[3, 0] == 0 and kept.slots[3, 0] == 1
    assert kept.acc[:, :, 2].sum() < plain.acc[:, :, 2].sum()  # zero extra bytes: fewer read


def test_plain_replay_unchanged_by_empty_whatif_arrays(synth_trace_dir):
    t = open_trace(synth_trace_dir(layers=3, experts=16, top_k=2, embd=8, tokens=30, prompt_tokens=4, routing_only=True))
    from replay.core.simulate import loads_of
    lo = loads_of(t)
    a = replay(lo, "lru", 1.0, slots=True)
    b = replay(lo, "lru", 1.0, slots=True, drop=np.zeros(lo.entries.shape, np.uint8),
               pred=np.full(lo.entries.shape, -1, np.int32), retain=True, fill=True, guard=True)
    assert (a.acc == b.acc).all() and (a.slots == b.slots).all()


def test_guesses_align_with_rows_and_predicted_weights(synth_trace_dir):
    t = open_trace(synth_trace_dir(layers=4, experts=16, top_k=3, embd=8, tokens=12, prompt_tokens=3))
    a = t.arrays()
    g = guesses(t, "prev-token")
    dec = np.flatnonzero(a.phase == 1)
    # row r's guess = the previous decoded token's routing at the same layer, with its weights
    for r in dec[16:24]:
        prev = dec[(a.layer[dec] == a.layer[r]) & (a.step[dec] == a.step[r] - 1)]
        assert prev.size == 1
        assert (g.entries[r] == list(t.moe_layers).index(int(a.layer[r])) * 16 + a.experts[prev[0]]).all()
        assert np.array_equal(g.weights[r], a.weights[prev[0]])
    sg = guesses(t, "stale-gate[1]")
    assert sg.ahead == 1 and (sg.entries[a.layer == t.moe_layers[0]] == -1).all()  # the first layer has no source
    w = sg.weights[(a.phase == 1) & (a.layer == t.moe_layers[1])]
    assert np.allclose(w.sum(axis=1), 1.0, atol=1e-5)  # softmax, norm_topk: a predicted mixture sums to 1
    cut = guesses(t, "stale-gate[1]", drop_frac=1.0)
    assert cut.dropped_guesses > 0 and ((cut.entries >= 0).sum() + cut.dropped_guesses == (sg.entries >= 0).sum())
    assert ((cut.entries[:, 0] >= 0) == (sg.entries[:, 0] >= 0)).all()  # the top guess is always kept


def test_prefetch_counts_are_consistent(synth_trace_dir):
    t = open_trace(synth_trace_dir(layers=4, experts=32, top_k=4, embd=8, tokens=80, prompt_tokens=4))
    for pred in ("prev-token", "stale-gate[1]", "stale-gate[2]", "static-hot"):
        for guard in (False, True):
            r = prefetch(t, pred, budget_mib=3.0, cap=2, guard=guard).row(0, named=True)
            assert r["spec_fills"] == r["useful"] + r["evicted_unused"] + r["unused_at_end"]
            assert r["ahead"] == (2 if pred == "stale-gate[2]" else 1)
            assert r["hit_pct_decode_baseline"] is not None and r["total_mib_per_token"] >= r["read_mib_decode"] / 80


def test_real_qwen_closed_drop_at_recorded_budget(real_trace_dir):
    res = run_cli("drop", real_trace_dir("qwen"), "--mode", "closed", "--fracs", "0.5,1.0", "--json")
    assert res.code == 0, res.err
    rows = res.json()["rows"]
    for r in rows:
        for key in ("mode", "frac", "keep_k", "phase", "io_saved_pct", "mass_lost_pct", "routings_dropped_pct",
                    "experts_dropped_pct", "hit_pct_decode", "hit_pct_cum", "hit_pct_decode_baseline"):
            assert key in r
        assert "hit_pct" not in r  # docs/design.md names hit rates by phase
        assert r["budget_mib"] == 4000.0 and r["policy"] == "lru" and r["phase"] == "decode"
    cold = [r for r in rows if r["mode"] == "closed"]
    assert [r["frac"] for r in cold] == [0.5, 1.0] and [r["keep_k"] for r in rows if r["mode"] == "closed-k"] == [5, 4, 3, 2, 1]
    assert cold[1]["io_saved_pct"] > cold[0]["io_saved_pct"] > 0
    # dropped slots are not lookups: fewer lookups, and the cache's own hit rate moves on its own
    assert cold[1]["lookups"] < cold[1]["lookups_baseline"]
    text = run_cli("drop", real_trace_dir("qwen"), "--mode", "closed", "--fracs", "1.0").out
    assert "never look the cache up" in text and "weight mass is not quality" in text.lower()


def test_real_qwen_prefetch_more_hits_more_bytes_is_slower(real_trace_dir, tmp_path):
    q = real_trace_dir("qwen")
    fit = run_cli("cost", "fit", q, "--json")
    assert fit.code == 0, fit.err
    model = tmp_path / "cost.json"
    model.write_text(fit.out)
    # in-sample (the list has seen the run: the figures docs/real-traces.md quotes as in-sample)
    res = run_cli("prefetch", q, "--predictor", "static-hot", "--train", "in-sample", "--cost-model", model, "--json")
    assert res.code == 0, res.err
    r = res.json()["rows"][0]
    assert r["train"] == "in-sample"
    assert r["hit_pct_decode"] > r["hit_pct_decode_baseline"] and r["bytes_change_pct"] > 0
    assert r["ms_per_token"] > r["ms_per_token_baseline"]
    assert "slower" in r["verdict"] and "more bytes" in r["verdict"]
    # 1.8 ms/token slower on 128 tokens is inside the paired interval (replay.analyses.paired): a tie, said as one
    assert r["delta_ms_ci_low"] < 0 < r["delta_ms_ci_high"] and r["vs_baseline_time"] == "tie"
    assert "tie within noise (±" in r["verdict"] and "neither wins on time" in r["verdict"]
    text = run_cli("prefetch", q, "--predictor", "static-hot", "--train", "in-sample", "--cost-model", model).out
    assert "decode-only" in text and "cumulative" in text and "slower under the cost model" in text
    assert "IN-SAMPLE" in text
    # held out (the default): learned on the first half of the decoded tokens, no guess for them
    held = run_cli("prefetch", q, "--predictor", "static-hot", "--cost-model", model, "--json").json()["rows"][0]
    assert held["train"] == "50%" and held["scored_routings"] == 48 * 64
    assert held["ms_per_token"] > held["ms_per_token_baseline"] and held["bytes_change_pct"] > 0
    # prev-token under LRU above one token cycle: every guess is resident, prefetch reads nothing (said out loud)
    pt = run_cli("prefetch", q, "--predictor", "prev-token")
    assert pt.code == 0 and "already resident" in pt.out and "read nothing" in pt.out


def test_cache_retain_reports_the_change(synth_trace_dir):
    s = synth_trace_dir(layers=4, experts=32, top_k=4, embd=8, tokens=60, prompt_tokens=4)
    res = run_cli("cache", s, "--budgets", "2,4", "--policies", "lru", "--retain", "--predictor", "stale-gate[1]", "--json")
    assert res.code == 0, res.err
    rows = res.json()["rows"]
    for r in rows:
        assert r["retain_gain_pp_decode"] == pytest.approx(r["hit_pct_decode"] - r["hit_pct_decode_no_retain"])
    assert "retention" in run_cli("cache", s, "--budgets", "2", "--policies", "lru", "--retain").out


def test_bad_options(synth_trace_dir, tmp_path):
    s = synth_trace_dir(layers=2, experts=8, top_k=2, embd=4, tokens=10, prompt_tokens=2, routing_only=True)
    assert_one_sentence_error(run_cli("drop", s, "--mode", "closed"), "--budget-mib")
    assert_one_sentence_error(run_cli("drop", s, "--mode", "open"), "--mode")
    assert_one_sentence_error(run_cli("prefetch", s, "--budget-mib", "1", "--policy", "belady"), "--policy")
    assert_one_sentence_error(run_cli("prefetch", s, "--budget-mib", "1", "--predictor", "ctrl"), "--predictor")
    assert_one_sentence_error(run_cli("prefetch", s, "--budget-mib", "1", "--predictor", "stale-gate[1]"), "gate_input")
    assert_one_sentence_error(run_cli("prefetch", s, "--budget-mib", "1", "--cap", "-1"), "--cap")
    assert_one_sentence_error(run_cli("prefetch", s, "--budget-mib", "1", "--drop", "-0.5"), "--drop")
    assert_one_sentence_error(run_cli("prefetch", s), "--budget-mib")
    assert_one_sentence_error(run_cli("prefetch", s, "--budget-mib", "1", "--cost-model", tmp_path / "none.json"), "cost-model")
    assert_one_sentence_error(run_cli("drop", s, "--mode", "closed", "--budget-mib", "1", "--phase", "all",
                                      "--cost-model", tmp_path / "x.json"), "--phase")


def test_real_qwen_closed_drop_two_dropped_shares(real_trace_dir):
    """Qwen, closed loop, LRU at 4000 MiB, F = 0.75, decode: 2,311 of the 6,144 (token, layer)
    routings lose at least one expert (37.6%), but only 2,991 of the 36,864 routed experts are
    skipped (8.1%): the share an engine's telemetry calls "routings dropped". Measured here."""
    res = run_cli("drop", real_trace_dir("qwen"), "--mode", "closed", "--fracs", "0.75", "--budget-mib", "4000", "--json")
    assert res.code == 0, res.err
    r = res.json()["rows"][0]
    assert r["routings"] == 6144 and r["slots_dropped"] == 2991
    assert r["routings_dropped_pct"] == pytest.approx(2311 / 6144 * 100)
    assert r["experts_dropped_pct"] == pytest.approx(2991 / 36864 * 100)
    assert r["hit_pct_decode_baseline"] == pytest.approx(80.287, abs=0.001)


def test_prefetch_shows_the_best_plain_policy(real_trace_dir, tmp_path):
    """The what-if is shown next to the best plain online policy at the same budget (the max decode
    hit % of a cache sweep over the online policies, ties by name), not only its own policy."""
    from replay.analyses.cost_model import BOUNDS
    from replay.policies import REGISTRY

    q = real_trace_dir("qwen")
    online = [p for p in REGISTRY if p not in BOUNDS]
    sweep = run_cli("cache", q, "--budgets", "4000", "--policies", ",".join(online), "--json").json()["rows"]
    top = max(r["hit_pct_decode"] for r in sweep)
    best = sorted(r["policy"] for r in sweep if r["hit_pct_decode"] == top)[0]
    res = run_cli("prefetch", q, "--predictor", "static-hot", "--policy", "lfru", "--json")
    assert res.code == 0, res.err
    r = res.json()["rows"][0]
    assert r["best_plain_policy"] == best and r["best_plain_hit_pct_decode"] == pytest.approx(top)
    text = run_cli("prefetch", q, "--predictor", "static-hot", "--policy", "lfru").out
    assert f"best plain policy at 4000 MiB (no prefetch, highest decode hit among online policies): {best} " in text
    assert "Bytes are not time (see --cost-model)" in text
    fit = run_cli("cost", "fit", q, "--json")
    (tmp_path / "m.json").write_text(fit.out)
    timed = run_cli("prefetch", q, "--predictor", "static-hot", "--cost-model", tmp_path / "m.json")
    assert timed.code == 0, timed.err
    assert "Bytes are not time" not in timed.out and "ms/token" in timed.out.split("best plain policy")[1]
