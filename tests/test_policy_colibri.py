"""``colibri``: the kernel agrees exactly with its naive twin with options drawn (re-pins happen on
these traces), plain and under the what-ifs; hand-built checks of heat halving, the 25% + 4 margin
and demand-only heat; the CLI options."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from replay.core.driver import ACC_HITS, ACC_LOOKUPS, ACC_READ, ACC_SPEC_FILLS, OPT_FILL, STAT_PEAK_BYTES, no_options
from replay.core.simulate import _driver_args, budget_bytes, check_policy_options, kernel_for, replay
from replay.policies import DEFAULT_POLICIES, REGISTRY, colibri, policy_module
from tests.naive.cache import NaiveColibri, naive_replay
from tests.naive.whatif import naive_whatif
from tests.test_cache_twin import UNIT, assert_same_as_naive, drawn_loads
from traces.format.errors import UserError


@st.composite
def long_traces(draw):
    """Up to 3 MoE layers of 2..5 experts, a short prompt, 10..40 decode tokens whose routings lean
    on one hot expert in the first half and another in the second (so heat shifts and re-pins swap)."""
    n_moe = draw(st.integers(1, 3))
    moe_layers = list(range(n_moe))
    n_expert = draw(st.integers(2, 5))
    k = draw(st.integers(1, 2))
    eb = {l: draw(st.integers(1, 3)) * UNIT for l in moe_layers}
    expert = st.integers(0, n_expert - 1)
    rows = []  # (turn, batch, phase, step, layer, experts)
    n_prefill = draw(st.integers(0, 4))
    batch = step = 0
    if n_prefill:
        for layer in moe_layers:
            for s in range(n_prefill):
                rows.append((0, 0, 0, s, layer, [draw(expert) for _ in range(k)]))
        batch, step = 1, n_prefill
    hot = [draw(expert), draw(expert)]
    n_decode = draw(st.integers(10, 40))
    for t in range(n_decode):
        h = hot[0] if t < n_decode // 2 else hot[1]
        lean = st.sampled_from([h] * 2 * n_expert + list(range(n_expert)))
        for layer in moe_layers:
            rows.append((0, batch, 1, step, layer, [draw(lean) for _ in range(k)]))
        batch += 1
        step += 1
    budget_units = draw(st.integers(1, sum(eb.values()) // UNIT * n_expert + 2))
    return moe_layers, n_expert, k, eb, rows, budget_units


def _loads(moe_layers, n_expert, k, eb, rows):
    return drawn_loads(moe_layers, max(moe_layers) + 1, n_expert, k, eb, rows)


def _plain(rows):
    return [(r[1], r[2], r[4], r[5]) for r in rows]


def _fits(opts, eb, budget_units):
    return opts.get("per_layer") is None or opts["per_layer"] * sum(eb.values()) <= budget_units * UNIT


def _twin(t, opts):
    moe_layers, n_expert, k, eb, rows, budget_units = t
    loads = _loads(moe_layers, n_expert, k, eb, rows)
    if not _fits(opts, eb, budget_units):
        with pytest.raises(UserError, match="colibri: .* pinned experts per layer"):
            replay(loads, "colibri", budget_units / 16, policy_options=opts)
        return None
    res = replay(loads, "colibri", budget_units / 16, slots=True, policy_options=opts)
    want = naive_replay(_plain(rows), moe_layers, n_expert, eb, "colibri", budget_units * UNIT, colibri_options=opts)
    assert_same_as_naive(res, want, moe_layers)
    event("re-pinned" if want["colibri_swaps"] else "no swap")
    return want


# Mostly re-pin on and one or two pins a layer (where swaps happen); the defaults and the rest too.
options = st.fixed_dictionaries({}, optional={"per_layer": st.sampled_from([0, 1, 1, 2, 2, 3, 5]),
                                              "repin": st.sampled_from([0, 1, 1, 2, 3, 4])})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=long_traces(), opts=options)
def test_kernel_matches_naive_twin_with_options(t, opts):
    if opts.get("per_layer", 0) > t[1]:
        return  # more than a layer holds: refused up front (test_options_refused)
    _twin(t, opts)


def test_repins_happen_on_the_twin_traces():
    """The traces above do swap: over seeded random examples the naive twin swaps pins, and the
    kernel agrees with it on every one (so the twin test exercises re-pins, not only static pins)."""
    rng = np.random.default_rng(7)
    swaps = 0
    for _ in range(25):
        n_expert, k = 4, 1
        moe_layers = [0, 1]
        hot = rng.integers(0, n_expert, 2)
        rows = [(0, 0, 0, s, l, [int(rng.integers(0, n_expert))]) for l in moe_layers for s in range(2)]
        for t in range(30):
            h = hot[0] if t < 15 else hot[1]
            for l in moe_layers:
                x = int(h) if rng.random() < 0.7 else int(rng.integers(0, n_expert))
                rows.append((0, 1 + t, 1, 2 + t, l, [x]))
        eb = {0: UNIT, 1: UNIT}
        opts = {"per_layer": 1, "repin": int(rng.integers(1, 4))}
        loads = _loads(moe_layers, n_expert, k, eb, rows)
        res = replay(loads, "colibri", 4 / 16, slots=True, policy_options=opts)
        want = naive_replay(_plain(rows), moe_layers, n_expert, eb, "colibri", 4 * UNIT, colibri_options=opts)
        assert_same_as_naive(res, want, moe_layers)
        swaps += want["colibri_swaps"]
    assert swaps >= 10


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), t=long_traces(), opts=options, guard=st.booleans(), retain=st.booleans())
def test_whatif_matches_naive_twin_with_options(data, t, opts, guard, retain):
    """Drops and speculative fills (a fill adds no heat, enters the LRU tier as most recent) agree
    with the what-if twin, with re-pins."""
    moe_layers, n_expert, k, eb, rows, budget_units = t
    if opts.get("per_layer", 0) > n_expert or not _fits(opts, eb, budget_units):
        return
    loads = _loads(moe_layers, n_expert, k, eb, rows)
    drop = [[data.draw(st.sampled_from([0, 0, 0, 1, 2])) for _ in range(k)] for _ in rows]
    ex = st.one_of(st.none(), st.integers(0, n_expert - 1))
    preds = [[data.draw(ex) for _ in range(2)] for _ in rows]
    pred_arr = np.full((len(rows), 2), -1, np.int32)
    for r, p in enumerate(preds):
        for j, x in enumerate(p):
            if x is not None:
                pred_arr[r, j] = rows[r][4] * n_expert + x
    res = replay(loads, "colibri", budget_units / 16, slots=True, drop=np.array(drop, np.uint8), pred=pred_arr,
                 guard=guard, retain=retain, fill=True, policy_options=opts)
    want = naive_whatif(_plain(rows), moe_layers, n_expert, eb, "colibri", budget_units * UNIT, drop=drop, preds=preds,
                        guard=guard, retain=retain, fill=True, colibri_options=opts)
    assert res.slots.tolist() == want["codes"]
    for name, f in (("lookups", ACC_LOOKUPS), ("hits", ACC_HITS), ("read", ACC_READ), ("spec_fills", ACC_SPEC_FILLS)):
        for i, layer in enumerate(moe_layers):
            for ph in (0, 1):
                assert res.acc[ph, i, f] == want[name].get((ph, layer), 0), (name, ph, layer)
    assert res.evictions == want["stats"].get("evictions", 0)
    assert res.stats[STAT_PEAK_BYTES] == want["stats"]["peak_bytes"]


# -- hand-built ------------------------------------------------------------------------------------


def _decode(prompt, seq, layer=0):
    """One MoE layer, top-1: a prompt batch (its experts as prompt tokens), then one decode token per batch."""
    rows = [(0, 0, 0, s, layer, [x]) for s, x in enumerate(prompt)]
    return rows + [(0, 1 + t, 1, len(prompt) + t, layer, [x]) for t, x in enumerate(seq)]


def _state_after(rows, n_expert, budget_units, opts, pred=None, layers=(0,)):
    """Run the kernel as :func:`replay` does and return (colibri's ps, the replay's acc)."""
    loads = _loads(list(layers), n_expert, 1, {l: UNIT for l in layers}, rows)
    pm = policy_module("colibri")
    popts = check_policy_options("colibri", opts, loads)
    o = no_options()
    o[OPT_FILL] = int(pred is not None)
    args, _, _ = _driver_args(loads, pm, budget_bytes(budget_units / 16), 0, False, None, pred, o, popts)
    kernel_for("colibri", whatif=pred is not None)(*args)
    return args[9], args[10]


def _heat(ps, e):
    return int(ps[colibri._heat(ps) + e])


def _pins(ps):
    return [int(x) for x in ps[colibri._pins(ps, 0): colibri._pins(ps, 0) + ps[colibri.NPIN]]]


def test_swap_halves_the_layers_heat():
    """Prompt routes expert 0 (pinned, heat 1); six decode tokens of expert 1 make its score clear
    the margin (5 do not), so the pass before the 7th token swaps 1 in and halves every heat of the
    layer: 1 -> 0 for expert 0, 6 -> 3 for expert 1. The 7th token (expert 3) then adds 1 to 3."""
    opts = {"per_layer": 1, "repin": 1}
    ps, _ = _state_after(_decode([0], [1] * 6 + [3]), 4, 2, opts)
    assert _pins(ps) == [1]
    assert [_heat(ps, e) for e in range(4)] == [0, 3, 0, 1]
    ps, _ = _state_after(_decode([0], [1] * 5 + [3]), 4, 2, opts)
    assert _pins(ps) == [0]
    assert [_heat(ps, e) for e in range(4)] == [1, 5, 0, 1]  # no swap: nothing halved
    ps, _ = _state_after(_decode([0], [1] * 6 + [3]), 4, 2, {"per_layer": 1, "repin": 0})
    assert _pins(ps) == [0] and [_heat(ps, e) for e in range(4)] == [1, 6, 0, 1]  # re-pin off


@pytest.mark.parametrize("lead, swaps", [(0, False), (1, True)])
def test_margin_is_25_percent_plus_4_heat(lead, swaps):
    """The hottest unpinned expert takes the coldest pin only with a score above
    cold + cold // 4 + 4 * 256: at that threshold it does not swap, one above it does; the kernel's
    pass and the naive twin's agree."""
    rows = _decode([0, 1], [2])
    loads = _loads([0], 4, 1, {0: UNIT}, rows)
    ent, grp = _fresh(loads, 3)
    ps = colibri.setup(None, ent, grp, loads, budget_bytes(3 / 16), {"per_layer": 2, "repin": 1})
    assert _pins(ps) == [0, 1]
    cold_heat, cold_rec, clock = 40, 100, 1000
    cs = (cold_heat << 8) | cold_rec
    target = cs + cs // 4 + 4 * 256 + lead  # the hot score wanted
    hot_heat, hot_rec = target >> 8, target & 255
    hp, lp = colibri._heat(ps), colibri._last(ps)
    ps[colibri.CLOCK] = clock
    for e, h, rec in ((0, cold_heat + 7, 255), (1, cold_heat, cold_rec), (2, hot_heat, hot_rec), (3, 1, 0)):
        ps[hp + e] = h
        ps[lp + e] = clock - (255 - rec) if rec > 0 else 0
        assert colibri.score(ps, e) == (h << 8) | rec
    assert colibri.score(ps, 2) - (cs + cs // 4 + 4 * 256) == lead
    naive = NaiveColibri({0: [0, 1]}, 4, set(), {})
    naive.clock = clock
    for e in range(4):
        naive.heat[(0, e)], naive.last[(0, e)] = int(ps[hp + e]), int(ps[lp + e])
    colibri._repin_pass(ps, ent)
    naive.repin_pass()
    assert _pins(ps) == ([0, 2] if swaps else [0, 1])  # the cold slot (index 1) takes expert 2
    assert naive.pins[0] == _pins(ps)


def _fresh(loads, budget_units):
    from replay.core.simulate import _groups
    from replay.core.state import new_state

    pm = policy_module("colibri")
    group, gbud = _groups(loads, pm, budget_bytes(budget_units / 16), {"per_layer": 2})
    return new_state(loads.entry_bytes, group, gbud)


def test_speculative_fill_adds_no_heat():
    """Two MoE layers; after each layer-0 load, expert 3 of layer 1 (never demanded) is prefetched
    for the next layer: its heat stays 0 and the access clock counts the demand lookups only; the
    same run without the fill gives every demanded expert the same heat."""
    seq = [1, 2, 1, 2]
    rows = [(0, t, 1, t, l, [x]) for t, x in enumerate(seq) for l in (0, 1)]
    pred = np.full((len(rows), 1), -1, np.int32)
    pred[1::2, 0] = 1 * 4 + 3  # layer 1's rows: entry (layer index 1, expert 3)
    ps, acc = _state_after(rows, 4, 6, {"per_layer": 0}, pred=pred, layers=(0, 1))
    assert int(acc[:, 1, ACC_SPEC_FILLS].sum()) >= 1  # the fill did happen
    assert _heat(ps, 4 + 3) == 0
    assert int(ps[colibri.CLOCK]) == 8  # eight demand lookups, no fill among them
    plain, _ = _state_after(rows, 4, 6, {"per_layer": 0}, layers=(0, 1))
    want = [0, 2, 2, 0, 0, 2, 2, 0]
    assert [_heat(ps, e) for e in range(8)] == [_heat(plain, e) for e in range(8)] == want


def test_shares_and_defaults():
    """Equal expert sizes: the LRU slots left after the pins split evenly, the remainder to the
    first layers (colibri's split); N defaults to half the budget, or every expert when all fit."""
    rows = [(0, 0, 1, 0, l, [0]) for l in range(3)]
    loads = _loads([0, 1, 2], 8, 1, {0: UNIT, 1: UNIT, 2: UNIT}, rows)
    b = budget_bytes(11 / 16)  # 11 entries: 1 pinned per layer (11 // 2 // 3), 8 LRU slots -> 3, 3, 2
    assert colibri.per_layer_for(loads, b, {}) == 1
    assert (colibri.group_budgets(loads, b, {}) // UNIT).tolist() == [4, 4, 3]
    assert colibri.per_layer_for(loads, budget_bytes(24 / 16), {}) == 8
    assert (colibri.group_budgets(loads, budget_bytes(30 / 16), {"per_layer": 2}) // UNIT).tolist() == [8, 8, 8]


def test_registered_not_default_and_options_refused():
    assert "colibri" in REGISTRY and "colibri" not in DEFAULT_POLICIES
    loads = _loads([0], 4, 1, {0: UNIT}, _decode([0], [1]))
    for bad in (-1, 1.5, True):
        with pytest.raises(UserError, match="colibri: repin"):
            check_policy_options("colibri", {"repin": bad}, loads)
    with pytest.raises(UserError, match="more than the 4 experts"):
        check_policy_options("colibri", {"per_layer": 5}, loads)
    with pytest.raises(UserError, match="unknown option"):
        check_policy_options("colibri", {"pins": 1}, loads)


def test_cli_options(synth_trace_dir):
    from tests.helpers import assert_one_sentence_error, run_cli

    small = synth_trace_dir(layers=4, experts=16, top_k=2, embd=16, tokens=40, prompt_tokens=6, routing_only=True,
                            expert_bytes=1 << 20)
    res = run_cli("cache", small, "--budgets", "12,24", "--policies", "lru,colibri", "--colibri-pin", "1",
                  "--colibri-repin", "4")
    assert res.code == 0, res.err
    assert "colibri = per MoE layer a pinned tier" in res.out and "re-pin every 4 tokens" in res.out
    assert "1 per layer (given)" in res.out
    assert_one_sentence_error(run_cli("cache", small, "--policies", "lru", "--colibri-repin", "4"), "--colibri-repin",
                              "only meaningful with colibri")
    assert_one_sentence_error(run_cli("cache", small, "--budgets", "2", "--policies", "colibri", "--colibri-pin", "1"),
                              "more than the 2 MiB budget")
