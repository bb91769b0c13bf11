"""``opt-bound`` (replay/policies/opt_bound.py) against its naive twins (tests/naive/bound.py) and
against every replay it bounds.

- On small traces, each phase's dual value D equals the exact rational LP optimum (the method's
  slack is float rounding only), the flow's primal value P too, and the exhaustive integer
  optimum over the class P of replays is never above it.
- On the shared twin traces (any sizes, budgets from one unit to past the working set), the
  bound's hits, per phase, are never below any replay in the class P: every global policy, and
  every within-budget cell of the per-layer ones; never above ``infinite``'s.
- With one expert size everywhere, the bound equals ``belady`` (furthest-next-use is then optimal).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.core.simulate import ACC_HITS, replay
from replay.policies import REGISTRY, opt_bound, policy_module
from tests.naive.bound import naive_lp, naive_opt
from tests.test_cache_twin import UNIT, drawn_loads, traces
from tests.trace_strategies import turn_rows

# Policies whose every replay is in the class P (global, start empty, demand reads only).
GLOBAL = [p for p in REGISTRY if p not in ("opt-bound", "infinite", "pin", "colibri")
          and policy_module(p).PARTITION == "global"]
PARTITIONED = [p for p in REGISTRY if policy_module(p).PARTITION == "layer" and p != "colibri"]  # colibri preloads


@st.composite
def tiny_traces(draw):
    """1-2 MoE layers of 1-4 experts, top-1..2, up to 3 prefill and 5 decode tokens per turn,
    sizes 1-3 units, budgets 1-8 units: small enough for the exact simplex and the exhaustive search."""
    n_moe = draw(st.integers(1, 2))
    moe_layers = list(range(n_moe))
    n_expert = draw(st.integers(1, 4))
    k = draw(st.integers(1, min(2, n_expert)))
    eb = {l: draw(st.integers(1, 3)) * UNIT for l in moe_layers}
    plan = [(draw(st.integers(0, 3)), draw(st.integers(0, 5))) for _ in range(draw(st.integers(1, 2)))]
    rows = turn_rows(plan, moe_layers, lambda: draw(st.lists(st.integers(0, n_expert - 1), min_size=k, max_size=k)))
    return moe_layers, n_moe, n_expert, k, eb, rows, draw(st.integers(1, 8))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=tiny_traces())
def test_dual_equals_exact_lp_and_bounds_the_integer_optimum(t):
    moe_layers, n_layer, n_expert, k, eb, rows, budget_units = t
    if not rows:
        return
    loads = drawn_loads(moe_layers, n_layer, n_expert, k, eb, rows)
    budget = budget_units * UNIT
    ivs = opt_bound.prepare_options(loads, {})["_intervals"]
    naive_rows = [(r[1], r[2], r[4], r[5]) for r in rows]
    res = replay(loads, "opt-bound", budget_units / 16)
    for ph in (0, 1):
        _, _, _, P, D = opt_bound.phase_bound(loads, ivs, budget, ph)
        lp = naive_lp(naive_rows, eb, budget, ph)
        # the documented slack: float rounding only, below SLACK_HITS
        assert abs(D - float(lp)) <= opt_bound.SLACK_HITS / 10
        assert abs(P - float(lp)) <= opt_bound.SLACK_HITS / 10
        opt = naive_opt(naive_rows, eb, budget, ph)
        assert opt <= lp
        assert int(res.acc[ph, :, ACC_HITS].sum()) == math.floor(lp)


def _phase_hits(res):
    return [int(res.acc[ph, :, ACC_HITS].sum()) for ph in (0, 1)]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=traces(), seed=st.integers(0, 1000))
def test_never_below_a_replay_it_bounds(t, seed):
    moe_layers, n_layer, n_expert, k, eb, rows, budget_units = t
    if not rows:
        return
    loads = drawn_loads(moe_layers, n_layer, n_expert, k, eb, rows)
    mib = budget_units / 16
    bound = _phase_hits(replay(loads, "opt-bound", mib))
    for p in GLOBAL + PARTITIONED:
        res = replay(loads, p, mib, seed=seed)
        if p in PARTITIONED and res.over_budget:
            continue  # one layer's share overflowed while the others hold theirs: outside the class
        got = _phase_hits(res)
        assert got[0] <= bound[0] and got[1] <= bound[1], (p, got, bound)
    inf = _phase_hits(replay(loads, "infinite", mib))
    assert bound[0] <= inf[0] and bound[1] <= inf[1]
    if len(set(eb.values())) == 1:
        bel = _phase_hits(replay(loads, "belady", mib))
        if len({r[2] for r in rows}) == 1:
            assert bel == bound  # one phase: its LP is integral and furthest-next-use reaches it
        else:
            assert sum(bel) <= sum(bound)  # each phase's bound is that phase's best on its own


def test_equal_sizes_two_phases_each_bounded_on_its_own():
    """One size, two phases: belady keeps entry 0 for the prefill hit (prefill 1, decode 2); the
    decode bound counts keeping entry 1 instead (decode 3), so it is above belady's decode hits and
    still a bound (the exhaustive search over P reaches 3 decode hits with 0 prefill hits). Five
    entries fit; load 2 needs four of them."""
    seq = [(1, [0, 1]), (1, [2, 3, 4, 5]), (0, [0]), (1, [0]), (1, [0, 1])]
    rows = [(0 if b < 2 else 1, b, ph, b, 0, ids) for b, (ph, ids) in enumerate(seq)]
    loads = drawn_loads([0], 1, 6, 4, {0: 3 * UNIT}, [(t, b, ph, s, l, ids + [ids[0]] * (4 - len(ids)))
                                                      for t, b, ph, s, l, ids in rows])
    mib = 15 / 16
    assert _phase_hits(replay(loads, "belady", mib)) == [1, 2]
    assert _phase_hits(replay(loads, "opt-bound", mib)) == [1, 3]


def test_unequal_sizes_beat_furthest_next_use():
    """Furthest-next-use is no bound when sizes differ. Layer 0's entries take 2 units, layer 1's
    1 unit, the budget 3 units; decode loads L0:1, L1:1, L0:2, L0:1, L1:1. After the third load
    (2 units forced) one unit is left: furthest-next-use first evicts L1:1 (used last), then still
    has to evict L0:1, and hits nothing; keeping L1:1 hits once, and the bound says so."""
    seq = [(0, [1]), (1, [1]), (0, [2]), (0, [1]), (1, [1])]
    rows = [(0, b, 1, b, layer, ids) for b, (layer, ids) in enumerate(seq)]
    eb = {0: 2 * UNIT, 1: UNIT}
    loads = drawn_loads([0, 1], 2, 3, 1, eb, rows)
    naive_rows = [(r[1], r[2], r[4], r[5]) for r in rows]
    assert naive_opt(naive_rows, eb, 3 * UNIT, 1) == 1
    assert _phase_hits(replay(loads, "belady", 3 / 16))[1] == 0
    assert _phase_hits(replay(loads, "opt-bound", 3 / 16))[1] == 1


def test_refuses_what_ifs():
    rows = [(0, 0, 1, 0, 0, [0]), (0, 1, 1, 1, 0, [0])]
    loads = drawn_loads([0], 1, 1, 1, {0: UNIT}, rows)
    from traces.format.errors import UserError

    with pytest.raises(UserError, match="computed bound"):
        replay(loads, "opt-bound", 1.0, slots=True)


def test_report_past_the_load_limit_says_the_bound_was_not_computed(synth_trace_dir, tmp_path, monkeypatch):
    import replay
    from replay.analyses import report as report_mod

    t = synth_trace_dir(layers=4, experts=16, top_k=2, embd=8, tokens=40, prompt_tokens=4, routing_only=True)
    monkeypatch.setattr(report_mod, "OPT_BOUND_MAX_LOADS", 10)  # the trace has 4 x 41 loads
    replay.write_report(t, tmp_path / "r", force=True)
    text = (tmp_path / "r" / "index.md").read_text()
    assert "a heuristic with these unequal expert sizes, not a bound" in text
    assert "is not computed in the report on 164 loads" in text and "the upper bound (opt-bound)" not in text
