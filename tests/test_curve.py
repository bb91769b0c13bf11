"""The one-pass curve (replay.analyses.curve) against its twin, per-budget replays of the driver
(tests/naive/curve.py): hits per phase, bytes read and overflow marks exact at every budget where
the curve changes, between them and at requested budgets; each layer's own curve against per-layer
replays; layer-opt's rows against layer-opt replays; on random traces and the three real ones."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.analyses.curve import compute_curve, sample_entries
from tests.naive.curve import naive_curve, naive_layer_curve
from tests.test_cache_twin import UNIT, drawn_loads, traces
from traces.format.errors import UserError
from traces.util.units import MIB

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _budget(r) -> int:
    b = int(round(r["budget_mib"] * MIB))
    assert b / MIB == r["budget_mib"]  # the row's MiB is the budget in bytes exactly
    return b


def assert_rows_equal_replays(frame, loads, policy: str, extra: list[int] = (), pick: list[int] | None = None) -> int:
    """Every row of ``policy`` (or the rows at indexes ``pick``) equals a replay at its budget; a
    budget between two rows (or below the first) equals the row in force there. Returns the rows checked."""
    all_rows = sorted((r for r in frame.to_dicts() if r["policy"] == policy), key=_budget)
    all_budgets = [_budget(r) for r in all_rows]
    rows = all_rows if pick is None else [all_rows[i] for i in pick]
    budgets = [_budget(r) for r in rows]
    # between change points the curve is flat: probe one byte below each point (and 1 byte)
    probes = sorted({max(1, b - 1) for b in budgets} | {1} | set(extra))
    want = naive_curve(loads, policy, budgets + probes)
    for r, b in zip(rows, budgets):
        w = want[b]
        got = {"lookups": [r["lookups"] - r["lookups_decode"], r["lookups_decode"]],
               "hits": [r["hits"] - r["hits_decode"], r["hits_decode"]],
               "read": r["read_mib"] * MIB, "overflow": r["overflow_loads"], "over_budget": r["over_budget"]}
        assert got == {"lookups": w["lookups"], "hits": w["hits"], "read": float(sum(w["read"])),
                       "overflow": w["overflow"], "over_budget": w["over_budget"]}, (policy, b)
        assert r["read_mib_decode"] * MIB == w["read"][1]
    for p in probes:
        in_force = [r for r, b in zip(all_rows, all_budgets) if b <= p]
        w = want[p]
        if in_force:
            r = in_force[-1]
            assert [r["hits"] - r["hits_decode"], r["hits_decode"]] == w["hits"], (policy, p)
            assert r["overflow_loads"] == w["overflow"]
        elif all_rows:  # below the first change point: no more hits than there
            assert sum(w["hits"]) <= all_rows[0]["hits"]
    return len(rows)


@SETTINGS
@given(t=traces(), extra=st.lists(st.integers(1, 200), max_size=3))
def test_curve_equals_per_budget_replays(t, extra):
    """lru and layer: at every change point, one byte below each and at requested budgets, the
    curve's hits (both phases), bytes read (both phases), overflowed loads and over-budget mark
    equal a replay of the driver at that budget."""
    moe_layers, _, n_expert, _, eb, rows, budget_units = t
    if not rows:
        return
    loads = drawn_loads(*t)
    req = [budget_units * UNIT] + [x * UNIT // 4 for x in extra]
    c = compute_curve(loads, policies=("lru", "layer", "layer-opt"), budgets_bytes=req)
    for pol in ("lru", "layer"):
        assert assert_rows_equal_replays(c.frame, loads, pol, extra=req) > 0
        got = {_budget(r) for r in c.frame.to_dicts() if r["policy"] == pol and r["requested"]}
        assert got == set(req)
    # layer-opt at the requested budgets: its shares are layer-opt's and its figures a replay's
    lo = sorted((r for r in c.frame.to_dicts() if r["policy"] == "layer-opt"), key=_budget)
    want = naive_curve(loads, "layer-opt", [_budget(r) for r in lo])
    for r in lo:
        w = want[_budget(r)]
        assert [r["hits"] - r["hits_decode"], r["hits_decode"]] == w["hits"]
        assert r["read_mib"] * MIB == sum(w["read"])
        assert r["overflow_loads"] == w["overflow"]


@SETTINGS
@given(t=traces())
def test_each_layers_curve_equals_its_replays(t):
    moe_layers, _, n_expert, _, eb, rows, _ = t
    if not rows:
        return
    loads = drawn_loads(*t)
    c = compute_curve(loads, policies=("layer",))
    pl_rows = c.per_layer.to_dicts()
    assert len(pl_rows) == len(moe_layers) * (n_expert + 1)
    for r in pl_rows:
        i = moe_layers.index(r["layer"])
        w = naive_layer_curve(loads, i, r["entries"])
        assert r["read_mib"] * MIB == w["read"]
        lk, ht = w["lookups"], w["hits"]
        want_cum = 100.0 * sum(ht) / sum(lk) if sum(lk) else None
        got_cum = r["hit_pct_cum"] if r["hit_pct_cum"] == r["hit_pct_cum"] else None
        assert got_cum == want_cum


def test_curve_row_budgets_cover_one_entry_to_the_working_set(synth_trace_dir):
    from replay.core.simulate import loads_of
    from traces import open_trace

    loads = loads_of(open_trace(synth_trace_dir(layers=3, experts=8, top_k=2, tokens=40, prompt_tokens=5, seed=3)))
    c = compute_curve(loads, policies=("lru",))
    b = sorted(c.frame["budget_mib"].to_list())
    assert b[-1] * MIB <= loads.working_set_bytes
    assert c.frame["hit_pct_cum"].to_list() == sorted(c.frame["hit_pct_cum"].to_list())  # LRU: more budget, no fewer hits
    a = c.answer
    assert a["plateau_pct"] == max(c.frame["hit_pct_decode"].to_list())
    for k in a["knees"]:
        assert k["hit_pct"] >= a["plateau_pct"] - k["tolerance_pp"]
        smaller = [r for r in c.frame.to_dicts() if r["budget_mib"] < k["budget_mib"] and not r["over_budget"]]
        assert all(r["hit_pct_decode"] < a["plateau_pct"] - k["tolerance_pp"] for r in smaller)


@st.composite
def long_traces(draw):
    """Traces long and wide enough that both passes use several words and blocks of visit positions
    and compact them several times: 4-6 MoE layers of 56-64 experts (>= 224 entries: the global
    pass's 1,024+ positions in 2+ blocks of 8 words; 2 words per layer in the per-layer pass), about
    3,000 visits; expert sizes drawn per layer (weighted sums) or one for every layer (popcounts)."""
    from tests.trace_strategies import turn_rows

    moe_layers = list(range(draw(st.integers(4, 6))))
    n_expert, k = draw(st.integers(56, 64)), draw(st.integers(1, 3))
    one = draw(st.integers(1, 3)) * UNIT
    eb = {l: one for l in moe_layers} if draw(st.booleans()) else {l: draw(st.integers(1, 3)) * UNIT for l in moe_layers}
    hot = draw(st.integers(4, n_expert))  # most lookups among a few experts, some among all
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))  # ids from a drawn seed: thousands of routings

    def pick() -> list[int]:
        return [int(rng.integers(0, n_expert if rng.random() < 0.2 else hot)) for _ in range(k)]

    n_decode = 3000 // (len(moe_layers) * k)
    rows = turn_rows([(draw(st.integers(0, 4)), n_decode)], moe_layers, pick)
    return moe_layers, len(moe_layers), n_expert, k, eb, rows, 1


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=long_traces())
def test_long_traces_compact_positions_and_stay_exact(t):
    """lru and layer on traces that compact the passes' visit positions across several blocks:
    ~16 change points of each, spread over the curve, (and a byte below each) equal a replay."""
    loads = drawn_loads(*t)
    c = compute_curve(loads, policies=("lru", "layer"))
    for pol in ("lru", "layer"):
        n = int((c.frame["policy"] == pol).sum())
        pick = sorted({int(x) for x in np.linspace(0, n - 1, 16).round()})
        assert assert_rows_equal_replays(c.frame, loads, pol, pick=pick) == len(pick)


@st.composite
def single_lookup_loads(draw):
    """Loads of one entry each (top-1, one token per batch) of one expert size: where belady is a stack algorithm."""
    from replay.core.simulate import Loads

    L, n = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    G = draw(st.integers(1, 60))
    seq = draw(st.lists(st.integers(0, L * n - 1), min_size=G, max_size=G))
    ph = draw(st.lists(st.integers(0, 1), min_size=G, max_size=G))
    e = np.array(seq, np.int32).reshape(G, 1)
    return Loads(entries=e, load_start=np.arange(G + 1, dtype=np.int64), load_lidx=(e[:, 0] // n).astype(np.int16),
                 batch_start=np.arange(G + 1, dtype=np.int64), moe_layers=tuple(range(L)),
                 n_expert=n, layer_expert_bytes=np.full(L, UNIT, np.int64), batch_turn=np.zeros(G, np.int32),
                 batch_step=np.arange(G, dtype=np.int32), batch_phase=np.array(ph, np.int8))


@SETTINGS
@given(loads=single_lookup_loads(), extra=st.lists(st.integers(1, 40), max_size=2))
def test_belady_curve_equals_replays_where_it_is_a_stack_algorithm(loads, extra):
    """One lookup per load, one expert size: furthest-next-use's curve (Mattson's OPT stack) equals
    belady replays at every change point, a byte below each and at requested budgets."""
    req = [x * UNIT // 4 for x in extra]
    c = compute_curve(loads, policies=("belady",), budgets_bytes=req)
    assert assert_rows_equal_replays(c.frame, loads, "belady", extra=req) > 0


def test_listed_distances_equal_the_dense_histogram(synth_trace_dir, monkeypatch):
    """Past DENSE_BINS bins the distances are listed and sorted instead: the same curve."""
    from replay.analyses import curve as mod
    from replay.core.simulate import loads_of
    from traces import open_trace

    loads = loads_of(open_trace(synth_trace_dir(layers=3, experts=8, top_k=2, tokens=40, prompt_tokens=5, seed=3)))
    dense = compute_curve(loads, policies=("lru",), budgets_bytes=[MIB]).frame
    monkeypatch.setattr(mod, "DENSE_BINS", 0)
    listed = compute_curve(loads, policies=("lru",), budgets_bytes=[MIB]).frame
    assert listed.equals(dense)


def test_refusals():
    from replay.core.simulate import Loads

    loads = Loads(entries=np.zeros((1, 1), np.int32), load_start=np.array([0, 1]), load_lidx=np.zeros(1, np.int16),
                  batch_start=np.array([0, 1], np.int64), moe_layers=(0,), n_expert=1,
                  layer_expert_bytes=np.array([MIB]), batch_turn=np.zeros(1, np.int32), batch_step=np.zeros(1, np.int32),
                  batch_phase=np.ones(1, np.int8))
    two = Loads(entries=np.array([[0], [1]], np.int32), load_start=np.array([0, 2]), load_lidx=np.zeros(1, np.int16),
                batch_start=np.array([0, 1], np.int64), moe_layers=(0,), n_expert=2,
                layer_expert_bytes=np.array([MIB]), batch_turn=np.zeros(1, np.int32), batch_step=np.zeros(1, np.int32),
                batch_phase=np.ones(1, np.int8))
    with pytest.raises(UserError, match=r"belady has no exact one-pass curve for this trace \(loads of up to 2 entries\)"):
        compute_curve(two, policies=("belady",))
    with pytest.raises(UserError, match="give --budgets"):
        compute_curve(loads, policies=("layer-opt",))
    with pytest.raises(UserError, match="not in"):
        compute_curve(loads, sample_rate=1.5)



def test_sample_is_seeded_and_sized():
    a, ra = sample_entries(6144, size=61, seed=4)
    b, rb = sample_entries(6144, size=61, seed=4)
    c, _ = sample_entries(6144, size=61, seed=5)
    assert a.sum() == 61 and ra == 61 / 6144 and (a == b).all() and not (a == c).all()
    d, rd = sample_entries(6144, rate=0.1, seed=4)
    assert rd == 0.1 and 400 < d.sum() < 830


def test_full_sample_is_the_exact_curve(synth_trace_dir):
    from replay.core.simulate import loads_of
    from traces import open_trace

    loads = loads_of(open_trace(synth_trace_dir(layers=3, experts=8, top_k=2, tokens=40, prompt_tokens=5, seed=3)))
    exact = compute_curve(loads, policies=("lru",)).frame
    full = compute_curve(loads, policies=("lru",), sample_rate=1.0).frame
    cols = ["budget_mib", "hits", "hits_decode", "read_mib", "overflow_loads"]
    assert full.select(cols).equals(exact.select(cols))
    assert full["sampled"].all()


@pytest.mark.parametrize("name", ["qwen", "gemma", "gptoss"])
def test_real_trace_curve_equals_replays(real_trace_dir, name):
    """On each real trace: lru and layer at ~12 of their change points (spread over the curve), at
    the recorded budget and one byte below each point, equal the driver's replays exactly."""
    from replay.core.simulate import loads_of
    from traces import open_trace

    t = open_trace(real_trace_dir(name))
    loads = loads_of(t)
    rec = t.recorded.get("budget_mib")
    req = [int(rec * MIB)] if rec else []
    c = compute_curve(loads, policies=("lru", "layer"), budgets_bytes=req)
    for pol in ("lru", "layer"):
        f = c.frame.filter(c.frame["policy"] == pol).sort("budget_mib")
        idx = set(np.unique(np.linspace(0, f.height - 1, 12).astype(int)).tolist())
        idx |= {i for i, r in enumerate(f["requested"].to_list()) if r}
        assert assert_rows_equal_replays(f, loads, pol, pick=sorted(idx)) >= 3


def _small_trace(synth_trace_dir):
    return synth_trace_dir(layers=3, experts=8, top_k=2, tokens=40, prompt_tokens=5, seed=3)


def test_cli_json_out_and_api_agree(synth_trace_dir, tmp_path):
    """curve --json rows are replay.curve()'s; -o writes Parquet or CSV of the same rows; the budget
    answer rides in the JSON; bad input is one sentence and exit 2, with nothing written."""
    import json

    import polars as pl

    import replay
    from tests.helpers import assert_one_sentence_error, run_cli

    d = _small_trace(synth_trace_dir)
    res = run_cli("curve", d, "--budgets", "3,5", "--json", "-o", tmp_path / "c.parquet")
    assert res.code == 0, res.err
    obj = json.loads(res.out)
    api = replay.curve(d, budgets_mib=[3, 5])
    assert [r["hits"] for r in obj["rows"]] == api["hits"].to_list()
    assert pl.read_parquet(tmp_path / "c.parquet")["budget_mib"].to_list() == api["budget_mib"].to_list()
    assert {r["budget_mib"] for r in obj["rows"] if r["requested"]} == {3.0, 5.0}
    assert obj["budget_answer"]["knees"] and obj["per_layer"]
    res = run_cli("curve", d, "--csv", tmp_path / "c.csv")
    assert res.code == 0 and "budget answer" in res.out and "knee" in res.out
    assert pl.read_csv(tmp_path / "c.csv")["budget_mib"].to_list() == replay.curve(d)["budget_mib"].to_list()
    for args, needle in ((("--policies", "belady"), "belady has no exact one-pass curve"),
                         (("--sample-rate", "2"), "--sample-rate 2.0 is not in"),
                         (("--tolerance", "x"), "--tolerance"),
                         (("--policies", "layer-opt"), "give --budgets")):
        res = run_cli("curve", d, *args, "-o", tmp_path / "bad.csv")
        assert res.code == 2
        assert_one_sentence_error(res, needle)
        assert not (tmp_path / "bad.csv").exists()
    with pytest.raises(UserError, match="^curve: layer-opt's allocation is solved per budget: give budgets_mib"):
        replay.curve(d, policies=["layer-opt"])  # the library names the keyword, not the flag


def test_bad_row_refused_as_at_open_nothing_written(synth_trace_dir, tmp_path):
    """curve reads the rows once (checked as its pass reads them, as cache does): a bad row is
    refused with open_trace's own sentence, exit 2, nothing written; replay.curve(path) raises it."""
    import shutil

    import replay
    from tests.helpers import assert_one_sentence_error, run_cli
    from tests.test_cache_stream import _corrupt
    from traces import open_trace
    from traces.format.errors import TraceError

    d = tmp_path / "t"
    shutil.copytree(_small_trace(synth_trace_dir), d)
    t0 = open_trace(d)
    _corrupt(d, "expert_range", 0, 7, t0.n_layer, t0.n_expert)
    with pytest.raises(TraceError) as at_open:
        open_trace(d)
    res = run_cli("curve", d, "-o", tmp_path / "c.csv")
    assert res.code == 2
    assert_one_sentence_error(res, str(at_open.value))
    assert not (tmp_path / "c.csv").exists()
    with pytest.raises(TraceError) as got:
        replay.curve(d)
    assert str(got.value) == str(at_open.value)


def test_with_cost_model_rows_carry_time(synth_trace_dir):
    import replay

    d = _small_trace(synth_trace_dir)
    f = replay.curve(d, cost_model=replay.manual_cost_model(flash_mib_s=1000.0, compute_ms=10.0))
    assert "ms_per_token" in f.columns and f["ms_per_token"].is_not_null().all()
    ms = f.filter(f["policy"] == "lru")["ms_per_token"].to_list()
    assert ms == sorted(ms, reverse=True)  # more budget, fewer bytes read, no more time


def test_sweep_curve_kind_cells_are_the_api_rows(synth_trace_dir, tmp_path):
    """A [curve] table: one cell per policy, each the policy's whole curve (replay.curve's rows)."""
    import polars as pl

    import replay

    d = _small_trace(synth_trace_dir)
    grid = tmp_path / "grid.toml"
    grid.write_text(f'traces = ["{d}"]\n[curve]\npolicies = ["lru", "layer"]\nbudgets_mib = [3]\n')
    replay.sweep(grid, tmp_path / "out", workers=1)
    f = pl.read_parquet(tmp_path / "out" / "curve.parquet")
    for pol in ("lru", "layer"):
        want = replay.curve(d, policies=[pol], budgets_mib=[3])
        got = f.filter(pl.col("policy") == pol)
        assert got["hits"].to_list() == want["hits"].to_list()
        assert got["budget_mib"].to_list() == want["budget_mib"].to_list()


def test_report_shows_the_curve_and_the_verdict_names_the_knee(synth_trace_dir, tmp_path):
    """The report's cache section leads with LRU's exact curve (cache_lru_curve.png), the budget
    answer's table holds the curve's knee, and the verdict's budget line names it."""
    import json

    import polars as pl

    import replay

    d = synth_trace_dir(layers=3, experts=8, top_k=2, tokens=60, prompt_tokens=5, seed=3)
    out = replay.write_report(d, tmp_path / "rep", force=True, policies=["lru", "lfu"])
    ans = replay.curve_run(d, policies=["lru"]).answer
    knee = next(k for k in ans["knees"] if k["budget_mib"] is not None)
    assert (out / "cache_lru_curve.png").is_file()
    t = pl.read_csv(out / "tables" / "cache_budget_answer.csv")
    assert any(abs(x - knee["budget_mib"]) < 1e-5 for x in t["at_mib"].to_list())  # the CSV holds 6 decimals
    rows = json.loads((out / "verdict.json").read_text())["rows"]
    rows = rows[[r["kind"] for r in rows].index("budget"):]  # after the cacheability answer
    assert rows[0]["curve_knee_mib"] == knee["budget_mib"] and rows[0]["curve_plateau_pct"] == ans["plateau_pct"]
    assert all("curve_knee_mib" not in r for r in rows[1:])
    md = (out / "index.md").read_text()
    verdict = md.split("## Verdict\n\n")[1].split("\n\n")[0]
    assert f"LRU's exact curve bends at **{knee['budget_mib']:.1f} MiB**" in verdict
    assert md.index("cache_lru_curve.png") < md.index("cache_curves.png")  # the section's main figure
