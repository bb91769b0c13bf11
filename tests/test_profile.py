"""The locality profile (replay/analyses/locality.py): every statistic equals its naive twin
(tests/naive/profile.py) exactly on random small traces; SRP and SCH equal the paper's definitions
on hand-checked fixtures; the reuse distances reproduce the ``lru`` and ``infinite`` replays."""

from __future__ import annotations

import statistics

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.analyses.locality import (
    lru_hits,
    popularity_row,
    profile,
    profile_arrays,
    reuse_distances,
    sch_depths,
    srp_from_hist,
    srp_hist,
)
from replay.core.simulate import prepare_loads, replay
from tests.helpers import assert_one_sentence_error
from tests.naive.profile import (
    naive_counts,
    naive_drift,
    naive_entropy,
    naive_pairs,
    naive_popularity,
    naive_reuse,
    naive_sch_depths,
    naive_sequences,
    naive_srp,
    naive_srp_hist,
    naive_transitions,
)
from tests.trace_strategies import recorded_traces
from traces.io.reader import RoutingArrays

PHASES = {"decode": (1,), "prefill": (0,), "all": (0, 1)}


def _arrays(spec):
    rows, k = spec["rows"], spec["k"]
    R = len(rows)
    return RoutingArrays(
        turn=np.array([r["turn"] for r in rows], np.int32).reshape(R),
        batch=np.array([r["batch"] for r in rows], np.int32).reshape(R),
        phase=np.array([r["phase"] for r in rows], np.int8).reshape(R),
        step=np.array([r["step"] for r in rows], np.int32).reshape(R),
        layer=np.array([r["layer"] for r in rows], np.int16).reshape(R),
        experts=np.array([r["experts"] for r in rows], np.int32).reshape(R, k),
        weights=np.zeros((R, k), np.float32),
        request=np.array([r["request"] for r in rows], np.int64) if spec["request"] else None,
    )


def _loads(spec):
    return prepare_loads(_arrays(spec), list(range(spec["n_layer"])), spec["n_expert"],
                         np.array(spec["sizes"], np.int64))


def _profile(spec, phase, **kw):
    return profile_arrays(_arrays(spec), _loads(spec), moe_layers=tuple(range(spec["n_layer"])),
                          n_expert=spec["n_expert"], top_k=spec["k"], phase=phase, **kw)


specs = recorded_traces(max_layers=3, max_experts=6, max_k=3, max_tokens=9, max_requests=3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs, chunk=st.integers(0, 3), room=st.integers(0, 3))
def test_reuse_distances_match_naive(spec, chunk, room):
    """In chunks of any size (0: all at once), and with a Fenwick tree of any room from entries + 1
    visit times (renumbered whenever they run out), the same lookups as the naive twin's."""
    loads = _loads(spec)
    got = reuse_distances(loads.entries, loads.load_start, loads.batch_start, loads.entry_bytes, loads.n_entries,
                          chunk_loads=chunk, capacity=loads.n_entries + 1 + room if room else 0)
    want = naive_reuse(spec["rows"], spec["sizes"])
    E = spec["n_expert"]
    assert got[0].tolist() == [w[0] for w in want]
    assert got[1].tolist() == [w[1] * E + w[2] for w in want]
    assert got[2].tolist() == [w[4] for w in want]
    assert got[3].tolist() == [w[5] for w in want]
    assert got[4].tolist() == [w[6] for w in want]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs, phase=st.sampled_from(sorted(PHASES)), m=st.integers(1, 5), window=st.integers(1, 3),
       chunk=st.integers(1, 4), budget=st.integers(1, 40000))
def test_profile_statistics_match_naive(spec, phase, m, window, chunk, budget):
    prof = _profile(spec, phase, segment_lengths=(m,), drift_window=window, min_pair_routings=1, top_pairs=1000,
                    reuse_chunk_loads=chunk, budget_mib=budget / 2**20)
    rows, E, k, L = spec["rows"], spec["n_expert"], spec["k"], spec["n_layer"]
    counts = naive_counts(rows, PHASES[phase], E)
    # popularity per layer and pooled over every (layer, expert) entry
    pop = prof.popularity.filter(pl.col("request").is_null())
    for layer in range(L):
        got = pop.filter(pl.col("layer") == layer).row(0, named=True)
        want = naive_popularity(counts.get(layer, [0] * E), k)
        assert {c: got[c] for c in want} == want
    pooled = [c for layer in range(L) for c in counts.get(layer, [0] * E)]
    got = pop.filter(pl.col("layer").is_null()).row(0, named=True)
    want = naive_popularity(pooled, k * L)
    assert {c: got[c] for c in want} == want
    # reuse shares of the phase's lookups
    lk = naive_reuse(rows, spec["sizes"])
    mine = [x for x in lk if x[3] in PHASES[phase]]
    overall = prof.reuse.filter(pl.col("layer").is_null()).row(0, named=True)
    assert overall["lookups"] == len(mine)
    if mine:
        assert overall["reused_pct"] == 100.0 * sum(1 for x in mine if x[4] >= 0) / len(mine)
        assert overall["within_1_steps_pct"] == 100.0 * sum(1 for x in mine if 0 <= x[5] <= 1) / len(mine)
        for r in prof.reuse_cdf.filter(pl.col("layer").is_null()).iter_rows(named=True):
            b = round(r["distance_mib"] * 2**20)
            assert r["within_pct"] == 100.0 * sum(1 for x in mine if 0 <= x[4] <= b) / len(mine)
    # every reuse figure per layer and pooled (counts folded chunk by chunk, nothing kept per lookup)
    T = k * sum(spec["sizes"])
    steps = [2**i for i in range(64) if 2**i <= max(1, max((x[5] for x in lk), default=1))]
    for layer in [None, *range(L)]:
        sub = [x for x in mine if layer is None or x[1] == layer]
        got = prof.reuse.filter(pl.col("layer").is_null() if layer is None else pl.col("layer") == layer).row(0, named=True)
        n = len(sub)
        assert got["lookups"] == n
        for s in steps:
            assert got[f"within_{s}_steps_pct"] == (100.0 * sum(1 for x in sub if 0 <= x[5] <= s) / n if n else None)
        assert f"within_{2 * steps[-1]}_steps_pct" not in got
        for col, b in (("lru_hit_pct_at_token_cycle", T), ("lru_hit_pct_at_budget", budget)):
            hits = sum(1 for x in sub if x[4] >= 0 and (x[4] <= b or x[6] == 1))
            assert got[col] == (100.0 * hits / n if n else None)
        dists = [x[4] for x in sub if x[4] >= 0]
        assert got["median_distance_mib"] == (statistics.median(dists) / 2**20 if dists else None)
        for r in prof.reuse_cdf.filter(pl.col("layer").is_null() if layer is None else pl.col("layer") == layer).iter_rows(named=True):
            b = round(r["distance_mib"] * 2**20)
            assert r["within_pct"] == (100.0 * sum(1 for x in sub if 0 <= x[4] <= b) / n if n else None)
    # the reuse plots' histograms: the phase's reused lookups by distance in bytes and in steps
    want_b = sorted(x[4] for x in mine if x[4] >= 0)
    vals, cnts = prof.reuse_bytes_hist
    assert [v for v, c in zip(vals.tolist(), cnts.tolist()) for _ in range(c)] == want_b
    want_s = sorted(x[5] for x in mine if x[5] >= 0)
    assert [s for s, c in enumerate(prof.reuse_steps_hist.tolist()) for _ in range(c)] == want_s
    # co-activation within a layer
    for layer in range(L):
        want = naive_pairs(rows, PHASES[phase], layer, E) if k > 1 else {}
        got = {(r["expert_a"], r["expert_b"]): r["routings_both"]
               for r in prof.pairs.filter(pl.col("layer") == layer).iter_rows(named=True)}
        assert got == want
        routings = sum(1 for r in rows if r["phase"] in PHASES[phase] and r["layer"] == layer)
        c = counts.get(layer, [0] * E)
        for r in prof.pairs.filter(pl.col("layer") == layer).iter_rows(named=True):
            assert r["lift"] == r["routings_both"] * routings / (c[r["expert_a"]] * c[r["expert_b"]])
    # across consecutive layers: the counts, the entropies
    for layer in range(L - 1):
        want = naive_transitions(rows, PHASES[phase], layer, layer + 1, E)
        assert prof.transition_matrices[layer].tolist() == want
        got = prof.transitions.filter(pl.col("layer") == layer).row(0, named=True)
        h, hm = naive_entropy(want)
        assert (got["cond_entropy_bits"], got["next_entropy_bits"]) == (h, hm)
    # drift, SRP and SCH per request sequence, pooled per layer
    for layer in range(L):
        seqs = naive_sequences(rows, PHASES[phase], layer)
        want_drift = [d for s in seqs.values() for d in naive_drift(s, window, min(2 * k, E), E)]
        assert prof.drift.filter(pl.col("layer") == layer)["kept_pct"].to_list() == want_drift
        hist = [0] * (m + 1)
        depth = [0] * E
        for s in seqs.values():
            hist = [a + b for a, b in zip(hist, naive_srp_hist(s, m, E))]
            depth = [a + b for a, b in zip(depth, naive_sch_depths(s, m, E))]
        got = prof.srp.filter(pl.col("layer") == layer).row(0, named=True)
        f1, theta, ratio = naive_srp(hist)
        assert (got["srp_pct"], got["threshold"], got["predicted_per_routed"]) == (
            None if f1 is None else 100.0 * f1, theta, ratio)
        for r in prof.sch.filter(pl.col("layer") == layer).iter_rows(named=True):
            n = sum(depth)
            assert r["sch_pct"] == (100.0 * sum(depth[:r["cache_experts"]]) / n if n else None)


def _one_seq(seq, k):
    ex = np.array(seq, np.int64).reshape(len(seq), k)
    return ex, np.arange(len(seq), dtype=np.int64), np.array([0, len(seq)], np.int64)


def test_srp_hand_checked():
    # One layer, 3 experts, top-1, tokens route 0, 0, 1, 0; segments of m = 2 tokens.
    # Windows [0,0], [0,1], [1,0]; counts (e0, e1, e2): (2,0,0), (1,1,0), (1,1,0).
    # (window, expert) pairs by count c: c=0: 4 (e2 thrice, e1 once), c=1: 4, c=2: 1.
    # routed slots a = 1*4 + 2*1 = 6 (3 windows x 2 tokens x top-1).
    # theta=0: matches 6, predictions 2 x 9 = 18, F1 = 2*6/(18+6) = 0.5
    # theta=1: matches 6, predictions 2 x 5 = 10, F1 = 12/16 = 0.75   <- best
    # theta=2: matches 2, predictions 2 x 1 = 2,  F1 = 4/8 = 0.5
    ex, rows, start = _one_seq([[0], [0], [1], [0]], 1)
    hist = srp_hist(ex, rows, start, 2, 3)
    assert hist.tolist() == [4, 4, 1]
    assert srp_from_hist(hist) == (0.75, 1, 10 / 6)
    # a sequence shorter than the segment has no window: no SRP
    assert srp_from_hist(srp_hist(ex, rows, start, 8, 3)) == (None, None, None)


def test_srp_hist_counts_levels_across_sequences():
    """srp_hist keeps per-count levels and credits them lazily: sequences of every length around m
    (shorter: no window; equal: one), rows out of order, top-k with repeats across tokens, exactly
    the naive twin's histogram summed over the sequences."""
    rng = np.random.default_rng(7)
    E, k = 5, 2
    lens = [3, 1, 7, 4, 12]
    seqs = [[list(rng.choice(E, k, replace=False)) for _ in range(n)] for n in lens]
    flat = [t for s in seqs for t in s]
    perm = rng.permutation(len(flat))  # rows[t] points at the token's row in a shuffled table
    ex = np.zeros((len(flat), k), np.int64)
    ex[perm] = np.array(flat, np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    for m in range(1, 14):
        want = [sum(x) for x in zip(*(naive_srp_hist(s, m, E) for s in seqs))]
        assert srp_hist(ex, perm.astype(np.int64), starts, m, E).tolist() == want, m


def test_sch_hand_checked():
    # m = 1: only the current token counts, and its own use is spent at the access, so every
    # priority is (0, last use): the stack is LRU's. Tokens route 0, 1, 0, 2, 0 (top-1, 3 experts).
    # depths: 0 (first use, nothing seen before), 1 (first use, one expert seen), 1 (stack [1, 0]),
    # 2 (first use, two seen), 1 (stack [2, 0, 1]) -> per depth [1, 3, 1]:
    # SCH(C=1) = 1/5 = 20%, SCH(2) = 4/5 = 80%, SCH(3) = 100%.
    ex, rows, start = _one_seq([[0], [1], [0], [2], [0]], 1)
    assert sch_depths(ex, rows, start, 1, 3).tolist() == [1, 3, 1]
    # m = 4 sees the future: tokens 0, 1, 2, 0. Before token 2 the counts in tokens 2..3 are
    # e0: 1, e1: 0, so on 2's miss the stack [1, 0] keeps 0 above 1: [2, 0, 1], and the last 0 is
    # found at depth 1 (LRU's stack [2, 1, 0] has it at depth 2). Depths [1, 2, 1]: SCH(2) = 3/4,
    # where LRU with the same first-use rule gives 2/4.
    ex, rows, start = _one_seq([[0], [1], [2], [0]], 1)
    assert sch_depths(ex, rows, start, 4, 3).tolist() == [1, 2, 1]
    assert sch_depths(ex, rows, start, 1, 3).tolist() == [1, 1, 2]
    # top-2: a token's experts are found in the stack before the token (they do not evict each other)
    ex, rows, start = _one_seq([[0, 1], [1, 0]], 2)
    assert sch_depths(ex, rows, start, 1, 2).tolist() == [2, 2]  # first uses at 0, 1; then 1 at 0, 0 at 1


def test_popularity_row_hand_checked():
    # counts 6, 2, 0, 0 (top-1, 4 experts): top1 = 6/8 = 75%, top2 = 100%; hot set 50% and 80%: 1, 2;
    # Gini: sum |xi - xj| over ordered pairs = 2 * (4 + 6 + 6 + 2 + 2 + 0) = 40, / (2 * 4 * 8) = 0.625;
    # hottest vs uniform: 6 / (8 / 4) = 3.
    row = popularity_row(np.array([6, 2, 0, 0]), 1)
    assert row["top1_pct"] == 75.0 and row["top2_pct"] == 100.0 and row["top4_pct"] == 100.0
    assert (row["hot_set_50"], row["hot_set_80"], row["hot_set_95"]) == (1, 2, 2)
    assert row["gini"] == 0.625 and row["experts_never_routed"] == 2 and row["hottest_vs_uniform"] == 3.0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs, data=st.data())
def test_reuse_distance_reproduces_lru_and_infinite(spec, data):
    """LRU at B bytes hits a lookup exactly when its reuse distance is <= B, or when its entry was in
    the load just before (that load, larger than B, overflowed and kept all its entries); the
    infinite cache hits every lookup with a distance."""
    loads = _loads(spec)
    _, _, dist, _, gap = reuse_distances(loads.entries, loads.load_start, loads.batch_start, loads.entry_bytes,
                                         loads.n_entries)
    budget = data.draw(st.integers(1, max(1, loads.working_set_bytes + 2)))
    res = replay(loads, "lru", budget / 2**20)
    assert res.hits == int(lru_hits(dist, gap, budget).sum())
    if res.overflow_loads == 0:  # without overflow the plain statement holds
        assert res.hits == int(((dist >= 0) & (dist <= budget)).sum())
    assert replay(loads, "infinite", 1.0).hits == int((dist >= 0).sum())


def test_overflow_keeps_the_previous_load():
    """A load larger than the budget keeps its entries: the next lookup of one of them hits
    although its distance exceeds the budget (the one place the plain distance rule fails)."""
    spec = {"n_layer": 1, "n_expert": 4, "k": 2, "sizes": [10], "request": False,
            "rows": [{"turn": 0, "batch": 0, "phase": 0, "step": s, "layer": 0, "experts": ex}
                     for s, ex in enumerate([[0, 1], [2, 3]])]
            + [{"turn": 0, "batch": 1, "phase": 1, "step": 2, "layer": 0, "experts": [3, 0]}]}
    loads = _loads(spec)
    _, _, dist, _, gap = reuse_distances(loads.entries, loads.load_start, loads.batch_start, loads.entry_bytes,
                                         loads.n_entries)
    # 3 was the last entry visited (10 bytes: itself); 0 sits behind 1, 2 and 3 (40 bytes)
    assert dist.tolist() == [-1, -1, -1, -1, 10, 40]
    res = replay(loads, "lru", 15 / 2**20)  # 15 bytes: both loads overflow
    assert res.overflow_loads == 2 and res.hits == 2  # 3 and 0: the prefill load kept all four
    assert int(lru_hits(dist, gap, 15).sum()) == 2
    assert int(((dist >= 0) & (dist <= 15)).sum()) == 1  # the distance alone misses 0


REAL = ("qwen", "gemma", "gptoss")


@pytest.mark.parametrize("name", REAL)
def test_real_traces_agree_with_cache(real_trace_dir, name):
    """On the phone traces: LRU's decode hit % at the recorded budget and at T, and the infinite
    cache's, equal the profile's reuse figures."""
    from traces import open_trace

    t = open_trace(real_trace_dir(name))
    prof = profile(t)
    overall = prof.reuse.filter(pl.col("layer").is_null()).row(0, named=True)
    from replay.api import cache

    budget = prof.budget_mib
    rows = cache(t, policies=["lru", "infinite"], budgets_mib=[budget, prof.token_cycle_bytes / 2**20])
    lru = rows.filter((pl.col("policy") == "lru") & pl.col("layer").is_null())
    assert lru["hit_pct_decode"].to_list() == [overall["lru_hit_pct_at_budget"], overall["lru_hit_pct_at_token_cycle"]]
    inf = rows.filter((pl.col("policy") == "infinite") & pl.col("layer").is_null())["hit_pct_decode"][0]
    assert inf == overall["reused_pct"]
    if lru["overflow_loads"][0] == 0:  # no load overflows: the byte-distance CDF at the budget is LRU's hit %
        at = prof.reuse_cdf.filter(pl.col("layer").is_null() & (pl.col("distance_mib") == budget))
        assert at["within_pct"][0] == overall["lru_hit_pct_at_budget"]
    assert prof.answer["hot_set_80_mib"] is not None


# -- the verb and the API ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    import replay

    return replay.synth(tmp_path_factory.mktemp("profile") / "trace", layers=3, experts=8, top_k=2, embd=8, tokens=40,
                        prompt_tokens=6, seed=3, routing_only=True).path


def test_api_profile_rows(small_trace):
    import replay

    rows = replay.profile(small_trace, budget_mib=1)
    assert rows["layer"].to_list()[-1] is None and rows.height == 4
    run = replay.profile_run(small_trace, budget_mib=1)
    assert run.answer["budget_mib"] == 1.0 and run.answer["sch_2k_16_pct"] is not None
    with pytest.raises(replay.ReplayError, match="segment_lengths"):
        replay.profile(small_trace, segment_lengths=[0])
    with pytest.raises(replay.ReplayError, match="phase"):
        replay.profile(small_trace, phase="decoding")


def test_cli_profile_json_text_and_out(small_trace, tmp_path):
    import json

    from tests.helpers import run_cli

    res = run_cli("profile", small_trace, "--json", "--budget-mib", "1")
    assert res.code == 0, res.err
    obj = json.loads(res.out)
    assert obj["command"] == "profile" and obj["rows"][-1]["layer"] is None
    assert {"popularity", "reuse", "srp", "sch", "drift", "pairs", "transitions", "top_transitions"} <= set(obj)
    assert obj["answer"]["lru_hit_pct_at_budget"] == obj["rows"][-1]["lru_hit_pct_at_budget"]
    text = run_cli("profile", small_trace, "--budget-mib", "1")
    assert text.code == 0 and text.out.startswith("Is this routing cacheable?")
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        assert run_cli("profile", small_trace, "-o", d, "--budget-mib", "1", "--pair-layer", "1").code == 0
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert {"coverage.png", "reuse_mib_cdf.png", "reuse_steps_cdf.png", "transitions_L1_L2.png", "drift.png",
            "answer.json", "tables/summary.csv", "tables/srp.parquet"} <= {str(f) for f in files}
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)  # same input, same bytes
    assert_one_sentence_error(run_cli("profile", small_trace, "-o", a), "exists")
    assert_one_sentence_error(run_cli("profile", small_trace, "--segments", "4,x"), "--segments")
    assert_one_sentence_error(run_cli("profile", small_trace, "--pair-layer", "2"), "--pair-layer")
    assert_one_sentence_error(run_cli("profile", small_trace, "-o", small_trace / "out"), "")


def test_sweep_profile_kind_cells_are_the_verbs_rows_and_the_report_answers(small_trace, tmp_path):
    """A [profile] table: one cell per (budget, phase); its rows are `profile --json`'s rows, the
    pooled row also holds the json's answer (answer_*), and sweep-report prints each cell's answer."""
    import json

    from replay.core.frames import rows_of
    from tests.helpers import run_cli

    grid = tmp_path / "grid.toml"
    grid.write_text(f'traces = ["{small_trace}"]\n[profile]\nbudgets_mib = [1, 40]\nphases = ["decode", "all"]\n')
    assert run_cli("sweep", grid, "-o", tmp_path / "out", "--workers", "1").code == 0
    table = pl.read_parquet(tmp_path / "out" / "profile.parquet")
    assert table.select("cell_budget_mib", "cell_phase").unique(maintain_order=True).rows() == [
        (b, p) for b in (1.0, 40.0) for p in ("decode", "all")]
    answers = []
    for b, p in ((1.0, "decode"), (1.0, "all"), (40.0, "decode"), (40.0, "all")):
        obj = json.loads(run_cli("profile", small_trace, "--json", "--budget-mib", str(b), "--phase", p).out)
        got = table.filter((pl.col("cell_budget_mib") == b) & (pl.col("cell_phase") == p))
        assert [{k: r[k] for k in obj["rows"][0]} for r in rows_of(got)] == obj["rows"]
        pooled = rows_of(got.filter(pl.col("layer").is_null()))[0]
        assert {k: pooled[f"answer_{k}"] for k in obj["answer"]} == obj["answer"]
        assert got.filter(pl.col("layer").is_not_null())["answer_phase"].null_count() == got.height - 1
        answers.append(obj["answer"])
    rep = json.loads(run_cli("sweep-report", tmp_path / "out", "--json").out)
    assert rep["rows"] == [] and [{k: r[k] for k in a} for r, a in zip(rep["profile"], answers)] == answers
    text = run_cli("sweep-report", tmp_path / "out").out
    lines = [ln for ln in text.splitlines() if ln.startswith(str(small_trace))]
    assert len(lines) == 4 and "budget_mib 1, phase all" in lines[1]  # the hot 80% is ~21 MiB: no at 1, yes at 40
    assert ["Not by popularity at 1 MiB" in ln for ln in lines] == [True, True, False, False]
    assert ["Yes at 40 MiB" in ln for ln in lines] == [False, False, True, True]
    grid.write_text(f'traces = ["{small_trace}"]\n[profile]\nsegment_lengths = [4]\n')
    assert_one_sentence_error(run_cli("sweep", grid, "-o", tmp_path / "bad"), "segment_lengths", "--segments")


def test_qwen_report_verdict_opens_with_the_cacheability_answer(real_trace_dir, tmp_path):
    """The report's verdict opens with profile's answer, figure for figure (which
    test_real_traces_agree_with_cache holds against the cache replays), at the recorded budget."""
    import json

    from tests.helpers import run_cli
    from traces import open_trace

    trace = real_trace_dir("qwen")
    out = tmp_path / "r"
    res = run_cli("report", trace, "-o", out)
    assert res.code == 0, res.err
    rows = json.loads((out / "verdict.json").read_text())["rows"]
    assert rows[0]["kind"] == "cacheable" and rows[0]["budget_mib"] == 4000.0
    answer = profile(open_trace(trace), budget_mib=4000.0).answer
    assert {k: rows[0][k] for k in answer} == answer
    md = (out / "index.md").read_text()
    first = md.split("## Verdict\n\n")[1].splitlines()[0]
    assert first.startswith("- Is this routing cacheable? Yes at 4000 MiB: the experts taking 80% of decode routed "
                            "slots (3333.5 MiB) fit in the budget; LRU hits 80.3% of decode lookups there")
    assert first.endswith("[→ Expert popularity](#expert-popularity)")
    assert (out / "tables" / "locality.csv").is_file() and (out / "tables" / "srp_sch.csv").is_file()


def test_cdf_points_draw_the_per_lookup_curve():
    """The reuse plots step through the distance histograms: the points are the sorted per-lookup
    CDF's (value, 100 i / n) less those strictly inside a run of equal values (on its vertical)."""
    from replay.present.profile import _cdf_points

    rng = np.random.default_rng(3)
    for _ in range(20):
        per_lookup = np.sort(rng.integers(0, 6, size=int(rng.integers(1, 30))))
        n = per_lookup.size + int(rng.integers(0, 5))  # lookups never reused count in n, not in the curve
        want = [(int(v), 100.0 * (i + 1) / n) for i, v in enumerate(per_lookup)
                if i == 0 or i == per_lookup.size - 1 or per_lookup[i - 1] != v or per_lookup[i + 1] != v]
        vals, counts = np.unique(per_lookup, return_counts=True)
        x, y = _cdf_points(vals, counts, n)
        assert list(zip(x.tolist(), y.tolist())) == want


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs, phase=st.sampled_from(sorted(PHASES)), rows_per_chunk=st.integers(1, 4))
def test_chunk_sizes_change_nothing(spec, phase, rows_per_chunk):
    """The passes that walk the rows in chunks (popularity counts, the token order check, the token
    numbers) and the histogram merges give every table and histogram unchanged at any chunk size,
    rows in token order or not (several requests)."""
    from unittest import mock

    import replay.analyses.locality as loc

    kw = {"segment_lengths": (2,), "drift_window": 2, "min_pair_routings": 1, "top_pairs": 1000}
    want = _profile(spec, phase, **kw)
    with mock.patch.multiple(loc, TOKEN_CHUNK_ROWS=rows_per_chunk, POPULARITY_CHUNK_ROWS=rows_per_chunk,
                             HIST_MERGE_MIN=0):
        got = _profile(spec, phase, reuse_chunk_loads=rows_per_chunk, **kw)
    for name, frame in want.tables().items():
        assert got.tables()[name].equals(frame, null_equal=True), name
    assert [a.tolist() for a in got.reuse_bytes_hist] == [a.tolist() for a in want.reuse_bytes_hist]
    assert got.reuse_steps_hist.tolist() == want.reuse_steps_hist.tolist()
    assert {k: v.tolist() for k, v in got.transition_matrices.items()} == \
        {k: v.tolist() for k, v in want.transition_matrices.items()}


def test_reuse_histograms_merge_in_any_order(monkeypatch):
    """The chunks' distance histograms merged after every chunk (HIST_MERGE_MIN = 0) or once at
    the end give the same profile: two layers of different expert sizes (many distinct distances)."""
    import replay.analyses.locality as loc

    rng = np.random.default_rng(5)
    rows = [{"turn": 0, "batch": t, "phase": 1, "step": t, "layer": layer,
             "experts": [int(x) for x in rng.choice(6, 2, replace=False)]} for t in range(40) for layer in range(2)]
    spec = {"n_layer": 2, "n_expert": 6, "k": 2, "sizes": [7, 11], "request": False, "rows": rows}
    once = _profile(spec, "decode", reuse_chunk_loads=3, budget_mib=40 / 2**20)
    monkeypatch.setattr(loc, "HIST_MERGE_MIN", 0)
    every = _profile(spec, "decode", reuse_chunk_loads=3, budget_mib=40 / 2**20)
    assert once.reuse.equals(every.reuse) and once.reuse_cdf.equals(every.reuse_cdf)
    assert once.reuse_bytes_hist[0].tolist() == every.reuse_bytes_hist[0].tolist()
    assert once.reuse_bytes_hist[1].tolist() == every.reuse_bytes_hist[1].tolist()
    assert len(once.reuse_bytes_hist[0]) > 10  # distinct distances indeed
    lk = naive_reuse(rows, spec["sizes"])
    assert sorted(v for v, c in zip(*(a.tolist() for a in every.reuse_bytes_hist)) for _ in range(c)) == \
        sorted(x[4] for x in lk if x[4] >= 0)
