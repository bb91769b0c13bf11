"""``pin`` and ``layer-opt``: naive twins with options, the stack-distance miss curves against
per-layer LRU replays at every share, the bound over per-layer partitions, preload accounting,
refusals, and layer-opt kept out of every "best online" choice."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.core.simulate import prepare_loads, replay, sweep
from replay.policies import bound_policies, layer_opt, pin
from tests.helpers import assert_one_sentence_error, run_cli
from tests.naive.cache import naive_largest_loads, naive_layer_opt_shares, naive_lru_misses, naive_replay
from tests.test_cache_twin import UNIT, _arrays, assert_same_as_naive, drawn_loads, traces
from traces.format.errors import UserError

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _naive_rows(rows):
    return [(r[1], r[2], r[4], r[5]) for r in rows]


def _misses(res) -> int:
    return res.lookups - res.hits


@SETTINGS
@given(t=traces())
def test_miss_curves_equal_per_layer_lru_replays_at_every_share(t):
    """The one-pass stack-distance curve equals, at every share C = 0..n_expert entries, the misses
    of each layer under the driver's per-layer LRU with C entries (and the naive twin's)."""
    moe_layers, _, n_expert, _, eb, rows, _ = t
    if not rows:
        return
    loads = drawn_loads(*t)
    curves, largest = layer_opt.miss_curves(loads)
    full = sum(eb.values()) * n_expert / UNIT / 16  # MiB: every share fits
    for c in range(n_expert + 1):
        res = replay(loads, "layer-opt", full, policy_options={"entries_per_layer": [c] * len(moe_layers)})
        got = res.acc[:, :, 0].sum(axis=0) - res.acc[:, :, 1].sum(axis=0)
        assert got.tolist() == curves[:, c].tolist()
        naive = naive_lru_misses(_naive_rows(rows), moe_layers, n_expert, eb, c)
        assert [naive[l] for l in moe_layers] == curves[:, c].tolist()
    big = naive_largest_loads(_naive_rows(rows), moe_layers)
    assert largest.tolist() == [[big[(ph, l)] for l in moe_layers] for ph in (0, 1)]


@SETTINGS
@given(t=traces(), data=st.data())
def test_layer_opt_is_the_best_per_layer_partition(t, data):
    """layer-opt's shares are the brute-force optimum (fewest misses, then bytes, then entries per
    layer), and its misses are never above `layer` (uniform shares) nor any other partition of the
    budget replayed through the same driver, like with like: partitions whose shares hold at least
    layer-opt's floor (the largest load, else the largest decode load, else nothing: partitions below
    it overflow more loads, using memory outside the budget)."""
    moe_layers, _, n_expert, _, eb, rows, budget_units = t
    if not rows:
        return
    loads = drawn_loads(*t)
    budget = budget_units * UNIT
    mib = budget_units / 16
    opt = replay(loads, "layer-opt", mib, slots=True)
    want = naive_layer_opt_shares(_naive_rows(rows), moe_layers, n_expert, eb, budget)
    assert opt.layer_share_bytes.tolist() == [want[l] for l in moe_layers]
    assert_same_as_naive(opt, naive_replay(_naive_rows(rows), moe_layers, n_expert, eb, "layer-opt", budget), moe_layers)
    w = loads.layer_expert_bytes
    curves, largest = layer_opt.miss_curves(loads)
    floor = layer_opt.share_floor(largest, w, budget)
    uniform = (budget // len(moe_layers)) // w
    lay = replay(loads, "layer", mib)
    if (uniform >= floor).all():
        assert _misses(opt) <= _misses(lay)
    if not floor.any():  # no floor: the optimum over every partition, overflowing ones included
        assert _misses(opt) <= _misses(lay)
    for _ in range(3):
        c = np.array([data.draw(st.integers(int(f), n_expert)) for f in floor], np.int64)
        while int((c * w).sum()) > budget and (c > floor).any():
            i = int(np.flatnonzero(c > floor)[0])
            c[i] -= 1
        if int((c * w).sum()) > budget:
            continue
        other = replay(loads, "layer-opt", mib, policy_options={"entries_per_layer": c})
        assert _misses(opt) <= _misses(other)
        assert _misses(other) == int(curves[np.arange(len(moe_layers)), c].sum())


@SETTINGS
@given(t=traces(), data=st.data())
def test_pin_with_options_matches_naive_twin(t, data):
    """pin with an explicit N and/or a profile's counts agrees exactly with the naive twin given
    the same options (the default options are covered by test_cache_twin over the registry)."""
    moe_layers, _, n_expert, _, eb, rows, budget_units = t
    if not rows:
        return
    loads = drawn_loads(*t)
    budget = budget_units * UNIT
    max_n = min(n_expert, budget // sum(eb.values()))
    opts, nopts = {}, {}
    if data.draw(st.booleans()):
        n = data.draw(st.integers(0, max_n))
        opts["per_layer"] = nopts["per_layer"] = n
    if data.draw(st.booleans()):
        counts = np.array([[data.draw(st.integers(0, 3)) for _ in range(n_expert)] for _ in moe_layers], np.int64)
        opts["profile"] = counts
        nopts["profile"] = {(l, x): int(counts[i, x]) for i, l in enumerate(moe_layers) for x in range(n_expert)}
    res = replay(loads, "pin", budget_units / 16, slots=True, policy_options=opts)
    want = naive_replay(_naive_rows(rows), moe_layers, n_expert, eb, "pin", budget, pin_options=nopts)
    assert_same_as_naive(res, want, moe_layers)


def _decode_rows(experts_per_token, layer=0):
    return [(0, b, 1, b, layer, list(x)) for b, x in enumerate(experts_per_token)]


def test_pinned_entries_hit_on_first_lookup_and_their_bytes_are_reported_apart():
    """A 3-entry budget, top-1, one layer; the prompt routes expert 2 most: with N = 1 it is resident
    from the start (its first decode lookup hits, it is never evicted by the sweep 0, 1, 3, 0, 1, 3),
    and preload_mib reports the entry pinned, not read_mib."""
    prompt = [(0, 0, 0, s, 0, [x]) for s, x in enumerate([2, 2, 5])]
    decode = [(0, 1 + b, 1, 3 + b, 0, [x]) for b, x in enumerate([2, 0, 1, 3, 0, 1, 3, 2])]
    rows = prompt + decode
    loads = prepare_loads(_arrays(rows, 1), [0], 8, np.array([UNIT]))
    res = replay(loads, "pin", 3 / 16, slots=True, policy_options={"per_layer": 1})
    codes = res.slots[:, 0].tolist()
    assert codes[:3] == [1, 1, 0]  # prompt: the pinned expert 2 hits at once (a repeat carries the lookup's code)
    assert codes[3] == 1 and codes[-1] == 1  # decode: 2 never left
    lru = replay(loads, "lru", 3 / 16, slots=True)
    assert lru.slots[-1, 0] == 0  # plain LRU (3 entries) evicted 2 under the 0, 1, 3 sweep
    frame = sweep(loads, ["lru", "pin"], [3 / 16], per_layer=True, policy_options={"pin": {"per_layer": 1}}, show_progress=False)
    rows_ = {(r["policy"], r["layer"]): r for r in frame.to_dicts()}
    assert rows_[("pin", None)]["preload_mib"] == UNIT / (1 << 20)
    assert rows_[("pin", 0)]["preload_mib"] == UNIT / (1 << 20)
    assert rows_[("lru", None)]["preload_mib"] == 0.0
    assert rows_[("pin", None)]["peak_resident_mib"] <= 3 / 16
    # Without pin or layer-opt in the sweep the frame keeps its columns (the demo report's tables).
    plain = sweep(loads, ["lru"], [3 / 16], show_progress=False)
    assert "preload_mib" not in plain.columns and "share_mib" not in plain.columns


def test_pin_default_n_is_half_the_budget_and_zero_pins_is_lru():
    rows = _decode_rows([[0, 1], [2, 3], [0, 4], [1, 2]]) + [(0, b, 1, b, 1, [b % 3, 3]) for b in range(4)]
    rows.sort(key=lambda r: (r[1], r[4]))
    loads = prepare_loads(_arrays(rows, 2), [0, 1], 5, np.array([UNIT, 2 * UNIT]))
    # sum of one expert per layer = 3 units; budget 13 units -> floor(13 / 2 / 3) = 2 per layer
    assert pin.per_layer_for(loads, 13 * UNIT, {}) == 2
    assert pin.per_layer_for(loads, 5 * UNIT, {}) == 0
    a = replay(loads, "pin", 5 / 16, slots=True)
    b = replay(loads, "lru", 5 / 16, slots=True)
    assert a.slots.tolist() == b.slots.tolist() and a.evictions == b.evictions


def test_pin_refusals():
    rows = _decode_rows([[0], [1], [2]])
    loads = prepare_loads(_arrays(rows, 1), [0], 4, np.array([UNIT]))
    with pytest.raises(UserError, match="more than the .* budget"):
        replay(loads, "pin", 2 / 16, policy_options={"per_layer": 3})
    with pytest.raises(UserError, match="more than the 4 experts"):
        replay(loads, "pin", 2 / 16, policy_options={"per_layer": 5})
    other = prepare_loads(_arrays(rows, 1), [0], 3, np.array([UNIT]))
    with pytest.raises(UserError, match="not this trace's"):
        replay(loads, "pin", 2 / 16, policy_options={"profile": other})
    with pytest.raises(UserError, match="shape"):
        replay(loads, "pin", 2 / 16, policy_options={"profile": np.zeros((2, 4), np.int64)})
    with pytest.raises(UserError, match="unknown option 'n'"):
        replay(loads, "pin", 2 / 16, policy_options={"n": 1})
    with pytest.raises(UserError, match="takes no options"):
        replay(loads, "lru", 2 / 16, policy_options={"per_layer": 1})
    with pytest.raises(UserError, match="not among the policies"):
        sweep(loads, ["lru"], [1.0], policy_options={"pin": {}}, show_progress=False)


def test_pin_profile_from_another_trace_is_its_whole_run_counts():
    rows = _decode_rows([[0], [1], [2], [3]])
    loads = prepare_loads(_arrays(rows, 1), [0], 4, np.array([UNIT]))
    prof = prepare_loads(_arrays(_decode_rows([[3], [3], [1], [0]]), 1), [0], 4, np.array([UNIT]))
    got = pin.hot_list(loads, 4 * UNIT, pin.prepare_options(loads, {"profile": prof, "per_layer": 2}))
    assert got.tolist() == [[3, 0]]  # 3 twice, then 0 and 1 once each: the lower id


@pytest.fixture(scope="module")
def small(synth_trace_dir):
    return synth_trace_dir(layers=4, experts=16, top_k=2, embd=16, tokens=40, prompt_tokens=6, routing_only=True, expert_bytes=1 << 20)


def test_cli_pin_and_layer_opt(small, synth_trace_dir):
    res = run_cli("cache", small, "--budgets", "12,24", "--policies", "lru,pin,layer-opt,belady", "--pin-per-layer", "1",
                  "--per-layer")
    assert res.code == 0, res.err
    assert "pin = the most-routed experts of each MoE layer in this trace's prompt" in res.out
    assert "1 per layer (given)" in res.out
    assert "offline bound over per-layer LRU partitions" in res.out
    assert "share_mib" in res.out and "preload_mib" in res.out
    assert "pin 4.0 MiB at 12 MiB" in res.out  # 4 layers x 1 pinned x 1 MiB
    js = run_cli("cache", small, "--budgets", "24", "--policies", "layer-opt", "--per-layer", "--json").json()
    shares = [r["share_mib"] for r in js["rows"] if r["layer"] is not None]
    assert sum(shares) <= 24 and [r["share_mib"] for r in js["rows"] if r["layer"] is None] == [sum(shares)]
    prof = run_cli("cache", small, "--budgets", "24", "--policies", "pin", "--pin-profile", small)
    assert prof.code == 0 and f"profile {small} (whole run, all phases)" in prof.out
    assert_one_sentence_error(run_cli("cache", small, "--policies", "lru", "--pin-per-layer", "2"), "--pin-per-layer",
                              "only meaningful with pin")
    other = synth_trace_dir(layers=4, experts=8, top_k=2, embd=16, tokens=10, prompt_tokens=2, routing_only=True,
                            expert_bytes=1 << 20)
    assert_one_sentence_error(run_cli("cache", small, "--policies", "pin", "--pin-profile", other), "pin profile",
                              "not this trace's")
    assert_one_sentence_error(run_cli("cache", small, "--budgets", "2", "--policies", "pin", "--pin-per-layer", "1"),
                              "more than the 2 MiB budget")


def test_layer_opt_is_a_bound_never_the_best_online():
    from replay.analyses.cost_model import BOUNDS
    from replay.present.cost import verdict

    assert set(bound_policies()) == {"belady", "infinite", "layer-opt", "opt-bound"} and set(BOUNDS) == set(bound_policies())
    assert "pin" not in BOUNDS
    rows = [{"policy": p, "budget_mib": 8.0, "layer": None, "ms_per_token": ms, "tok_s": 1000 / ms, "hit_pct_decode": h,
             "overflow_loads": 0} for p, ms, h in (("lru", 20.0, 50.0), ("layer-opt", 10.0, 70.0), ("belady", 9.0, 80.0))]
    text = "\n".join(verdict(rows))
    assert "8 MiB: lru" in text and "belady/infinite/layer-opt are bounds" in text
