"""Belady's key blocks (replay/policies/_blocks.py) agree exactly with the naive twins.

The shared twin test (tests/test_cache_twin.py) draws at most 32 entries, so every resident key
sits in one block of 64; here the block size is shrunk (a run-time value, no recompile) and the
traces are wider, so the multi-block paths run: the reduction over block minima, an eviction that
moves a key across blocks or empties the last block, and the search going on past entries a
what-if's retention pinned without a visit.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.core.simulate import replay
from replay.policies import _blocks
from tests.naive.cache import naive_replay
from tests.test_cache_twin import UNIT, assert_same_as_naive, drawn_loads
from tests.test_whatif_twin import _compare, drops, predictions
from tests.trace_strategies import turn_rows

BLOCKS = st.sampled_from([1, 2, 4, 8, 64])


@st.composite
def wide_traces(draw):
    """Like tests.test_cache_twin.traces, with up to 3 x 40 entries and longer decodes."""
    n_moe = draw(st.integers(1, 3))
    moe_layers = list(range(n_moe))
    n_expert = draw(st.integers(1, 40))
    k = draw(st.integers(1, 3))
    eb = {l: draw(st.integers(1, 3)) * UNIT for l in moe_layers}
    expert = st.integers(0, n_expert - 1)
    plan = [(draw(st.integers(0, 4)), draw(st.integers(1, 24)))]  # one turn
    rows = turn_rows(plan, moe_layers, lambda: [draw(expert) for _ in range(k)])  # (turn, batch, phase, step, layer, experts)
    total = sum(eb.values()) * n_expert
    budget_units = draw(st.integers(1, total // UNIT + 3))
    return moe_layers, n_moe, n_expert, k, eb, rows, budget_units


def _with_block(block, fn):
    saved = _blocks.BLOCK
    _blocks.BLOCK = block
    try:
        return fn()
    finally:
        _blocks.BLOCK = saved


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=wide_traces(), block=BLOCKS)
def test_belady_matches_naive_twin_across_blocks(t, block):
    moe_layers, n_layer, n_expert, k, eb, rows, budget_units = t
    loads = drawn_loads(*t)
    res = _with_block(block, lambda: replay(loads, "belady", budget_units / 16, slots=True))
    want = naive_replay([(r[1], r[2], r[4], r[5]) for r in rows], moe_layers, n_expert, eb, "belady", budget_units * UNIT)
    assert_same_as_naive(res, want, moe_layers)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), t=wide_traces(), block=BLOCKS, ahead=st.integers(1, 2), with_drop=st.booleans())
def test_belady_with_retention_and_drop_matches_naive_twin(data, t, block, ahead, with_drop):
    # Retention pins predicted entries without visiting them: the search must step past them.
    # (No speculative fills: the twin gives a filled entry its next use, the driver does not.)
    rows, n_expert, k = t[5], t[2], t[3]
    preds = data.draw(predictions(rows, n_expert, 2))
    drop = data.draw(drops(rows, k)) if with_drop else None
    _with_block(block, lambda: _compare(t, "belady", 0, drop=drop, preds=preds, ahead=ahead, retain=True))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), n=st.integers(1, 150), block=BLOCKS, n_load=st.integers(1, 40))
def test_blocks_pick_the_scan_victim_and_keep_exact_block_minima(data, n, block, n_load):
    # The hooks driven directly, victim by victim (the twins compare outcomes, and evicting one
    # never-again entry instead of another changes no outcome): each victim is the evictable
    # resident entry with the smallest (NEVER - next use, last tick), and after every step each
    # block's minimum is exactly the smallest key in it.
    from replay.core.state import LAST_TICK, NEVER, NEXT_USE, PIN, RESIDENT, new_state
    from replay.policies import belady

    ent, grp = new_state(np.ones(n, np.int64), np.zeros(n, np.int32), np.array([n], np.int64))
    ps = _with_block(block, lambda: belady.init(ent, grp, 0))
    blk, dk, bmin = int(ps[_blocks.BLK]), int(ps[_blocks.DKEY]), int(ps[_blocks.BMIN])

    n_blocks = (int(ps[_blocks.DENT]) - dk) // blk

    def check_minima():
        for b in range(n_blocks):
            assert ps[bmin + b] == ps[dk + b * blk: dk + (b + 1) * blk].min()

    entry = st.integers(0, n - 1)
    tick = 0
    for load in range(n_load):
        for e in data.draw(st.lists(entry, min_size=1, max_size=6)):
            tick += 1
            ent[LAST_TICK, e] = tick
            if ent[PIN, e] == load:
                belady.on_touch(ps, ent, grp, 0, e)  # a repeat inside the load
                continue
            ent[PIN, e] = load
            ent[NEXT_USE, e] = data.draw(st.one_of(st.just(NEVER), st.integers(load + 1, n_load + 5)))
            if ent[RESIDENT, e]:
                belady.on_touch(ps, ent, grp, 0, e)
            else:
                ent[RESIDENT, e] = 1
                belady.on_admit(ps, ent, grp, 0, e)
        for e in data.draw(st.lists(entry, max_size=3)):  # retention: pinned without a visit
            ent[PIN, e] = load
        for _ in range(data.draw(st.integers(0, 4))):
            res = [e for e in range(n) if ent[RESIDENT, e] and ent[PIN, e] != load]
            want = min(res, key=lambda e: (NEVER - int(ent[NEXT_USE, e]), int(ent[LAST_TICK, e])), default=-1)
            got = belady.pick_victim(ps, ent, grp, 0, load)
            assert got == want
            check_minima()
            if got < 0:
                break
            belady.on_evict(ps, ent, grp, 0, got)
            ent[RESIDENT, got] = 0
            check_minima()
        assert int(ps[_blocks.CNT]) == int(ent[RESIDENT].sum())
