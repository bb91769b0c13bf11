"""The Numba cache kernels agree exactly with the naive twin, for every policy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.core.simulate import batch_series, prepare_loads, replay
from replay.policies import REGISTRY, add_policy_file
from tests.naive.cache import naive_replay
from tests.trace_strategies import small_shape, turn_rows
from traces.io.reader import RoutingArrays

# The example plugin (examples/fifo_policy.py) goes through the same registry and driver as the built-ins.
FIFO = add_policy_file(Path(__file__).resolve().parents[1] / "examples" / "fifo_policy.py")
UNIT = 1 << 16  # expert sizes and budgets in 1/16 MiB, so budget_mib is exact in binary


@st.composite
def traces(draw):
    moe_layers, n_layer, n_expert, k, eb = small_shape(draw, UNIT)
    turns = draw(st.integers(1, 2))
    expert = st.integers(0, n_expert - 1)
    plan = [(draw(st.integers(0, 6)), draw(st.integers(0, 8))) for _ in range(turns)]
    # Ids drawn freely: duplicates inside one routing are allowed here on purpose.
    rows = turn_rows(plan, moe_layers, lambda: [draw(expert) for _ in range(k)])  # (turn, batch, phase, step, layer, experts)
    total = sum(eb[l] for l in moe_layers) * n_expert
    budget_units = draw(st.integers(1, total // UNIT + 3))
    return moe_layers, n_layer, n_expert, k, eb, rows, budget_units


def assert_same_as_naive(res, want, moe_layers) -> None:
    """A kernel replay (``slots=True``) agrees exactly with the naive twin's result: per layer
    and phase lookups, hits and bytes read, every slot's code, the eviction count, the overflowed
    loads and the peak resident bytes; and per batch (the per-decoded-token figures a paired
    comparison resamples, replay.analyses.paired) lookups, hits and bytes read."""
    for i, layer in enumerate(moe_layers):
        for ph in (0, 1):
            assert res.acc[ph, i, 0] == want["lookups"].get((ph, layer), 0)
            assert res.acc[ph, i, 1] == want["hits"].get((ph, layer), 0)
            assert res.acc[ph, i, 2] == want["read"].get((ph, layer), 0)
    assert res.slots.tolist() == want["codes"]
    assert res.evictions == want["evictions"]
    assert res.overflow_loads == want["overflow"]
    assert res.peak_resident_bytes == want["peak_bytes"]
    keys = sorted(want["per_batch"])  # the kernel numbers batches 0.. in trace order
    assert res.bacc.shape[0] == len(keys)
    assert res.bacc[:, :3].tolist() == [want["per_batch"][b] for b in keys]


def _arrays(rows, k):
    R = len(rows)
    return RoutingArrays(
        turn=np.array([r[0] for r in rows], np.int32).reshape(R),
        batch=np.array([r[1] for r in rows], np.int32).reshape(R),
        phase=np.array([r[2] for r in rows], np.int8).reshape(R),
        step=np.array([r[3] for r in rows], np.int32).reshape(R),
        layer=np.array([r[4] for r in rows], np.int16).reshape(R),
        experts=np.array([r[5] for r in rows], np.int32).reshape(R, k),
        weights=np.zeros((R, k), np.float32),
    )


def drawn_loads(moe_layers, n_layer, n_expert, k, eb, rows, *_):
    """The kernel's Loads of a drawn trace, :func:`traces`' tuple in order (``eb``: bytes of each
    MoE layer's experts; any other of the ``n_layer`` layers holds none)."""
    expert_bytes = np.zeros(n_layer, np.int64)
    for l, b in eb.items():
        expert_bytes[l] = b
    return prepare_loads(_arrays(rows, k), moe_layers, n_expert, expert_bytes)


# opt-bound is computed, not replayed: tests/test_opt_bound.py holds it to its twins
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=traces(), policy=st.sampled_from(sorted(set(REGISTRY) - {"opt-bound"}) + [FIFO]), seed=st.integers(0, 1000))
def test_kernel_matches_naive_twin(t, policy, seed):
    moe_layers, n_layer, n_expert, k, eb, rows, budget_units = t
    if not rows:
        return
    loads = drawn_loads(*t)
    res = replay(loads, policy, budget_units / 16, seed=seed, slots=True)
    want = naive_replay([(r[1], r[2], r[4], r[5]) for r in rows], moe_layers, n_expert, eb, policy, budget_units * UNIT, seed)
    assert_same_as_naive(res, want, moe_layers)
    ser = batch_series(loads, res)
    got = {b: [lk, h, rd] for b, lk, h, rd in zip(range(ser.height), ser["lookups"], ser["hits"], ser["read_bytes"])}
    assert got == {b: want["per_batch"].get(b, [0, 0, 0]) for b in got}


def _replay_both(rows, moe_layers, n_expert, eb, policy, budget_units, k):
    loads = drawn_loads(moe_layers, max(moe_layers) + 1, n_expert, k, eb, rows)
    res = replay(loads, policy, budget_units / 16, slots=True)
    want = naive_replay([(r[1], r[2], r[4], r[5]) for r in rows], moe_layers, n_expert, eb, policy, budget_units * UNIT)
    assert_same_as_naive(res, want, moe_layers)
    return res


def _decode_rows(experts, layer=0):
    """One decode token per batch, one MoE layer, top-1: the expert ids in order."""
    return [(0, b, 1, b, layer, [x]) for b, x in enumerate(experts)]


def test_lfu_counts_survive_eviction_lfu_incache_restart():
    """Two entries fit. Expert 0 is used twice, then evicted when 2 arrives (1 has 3 uses), and comes
    back after 2 has 3 uses. Whole-run LFU counts 0's readmission as its third use, so 3 (one use)
    cannot keep it out; in-cache LFU restarts 0 at 1 use, so 0 is evicted again and again."""
    seq = [0, 0, 1, 1, 1, 2, 2, 2, 0, 3, 0, 3, 0]
    rows = _decode_rows(seq)
    eb = {0: UNIT}
    # budget = 2 entries
    run = _replay_both(rows, [0], 4, eb, "lfu", 2, 1)
    inc = _replay_both(rows, [0], 4, eb, "lfu-incache", 2, 1)
    assert run.slots[:, 0].tolist() != inc.slots[:, 0].tolist()
    # The last three uses of expert 0 (positions 8, 10, 12): whole-run keeps it after readmission.
    assert run.slots[[8, 10, 12], 0].tolist() == [0, 1, 1]
    assert inc.slots[[8, 10, 12], 0].tolist() == [0, 0, 0]
    assert run.hits > inc.hits
    # lfru ranks exactly like lfu-incache (its frequency is the in-cache count).
    assert _replay_both(rows, [0], 4, eb, "lfru", 2, 1).slots.tolist() == inc.slots.tolist()
    # layerlfu / layerlfu-incache with one MoE layer are the same caches.
    assert _replay_both(rows, [0], 4, eb, "layerlfu", 2, 1).slots.tolist() == run.slots.tolist()
    assert _replay_both(rows, [0], 4, eb, "layerlfu-incache", 2, 1).slots.tolist() == inc.slots.tolist()


def test_overflow_and_peak_resident():
    """A load larger than its budget overflows: the peak is what it held, above the budget."""
    # 2 MoE layers, 2 entries of 1 unit each per layer, budget 2 units -> share 1 per layer: every
    # top-2 load overflows its layer's share under `layer`, and the peak is 4 units; global LRU
    # holds 2 (one load fills the budget exactly) and never overflows.
    rows = [(0, b, 1, b, layer, [0, 1]) for b in range(3) for layer in (0, 1)]
    eb = {0: UNIT, 1: UNIT}
    lay = _replay_both(rows, [0, 1], 2, eb, "layer", 2, 2)
    assert lay.overflow_loads == 6 and lay.peak_resident_bytes == 4 * UNIT
    lru = _replay_both(rows, [0, 1], 2, eb, "lru", 2, 2)
    assert lru.overflow_loads == 0 and lru.peak_resident_bytes == 2 * UNIT


def test_expert_id_out_of_range_is_refused():
    # The kernels index their state by entry without bounds checks: prepare_loads must refuse first.
    import pytest

    from traces.format.errors import UserError

    for bad in (-1, 4):
        rows = [(0, 0, 1, 0, 0, [0, bad])]
        with pytest.raises(UserError, match="outside 0..3"):
            prepare_loads(_arrays(rows, 2), [0], 4, np.array([1 << 16]))
