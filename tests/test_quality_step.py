"""The quality verb's stepped caches (engine_bridge.quality.LruStep, a Python LRU, and KernelStep,
the replay kernel of any steppable policy called once per load; one load at a time, state carried
between calls) agree exactly with the replay's kernel with drop flags (one call over all loads):
the same skipped slots, lookups, hits, bytes read and overflowing loads. Policies that cannot be
stepped (the future, or a plan from the whole trace) are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine_bridge.quality import KernelStep, LruStep, check_steppable, new_cache
from replay.core.driver import ACC_HITS, ACC_LOOKUPS, ACC_READ
from replay.core.simulate import Loads, replay
from traces.format.errors import UserError
from traces.util.units import MIB

STEPPABLE = ("lru", "lfu", "lfu-incache", "random", "layer", "layerlfu", "layerlfu-incache", "lfru", "infinite", "s3fifo",
             "sieve", "least-stale")


@st.composite
def cases(draw):
    L = draw(st.integers(1, 3))
    n = draw(st.integers(2, 6))
    k = draw(st.integers(1, min(3, n)))
    leb = np.array(draw(st.lists(st.integers(1, 4), min_size=L, max_size=L)), np.int64) * 1000
    loads = []
    for _ in range(draw(st.integers(1, 25))):
        lidx = draw(st.integers(0, L - 1))
        rows = [draw(st.permutations(range(n)))[:k] for _ in range(draw(st.integers(1, 3)))]
        flags = [draw(st.lists(st.integers(0, 2), min_size=k, max_size=k)) for _ in rows]
        loads.append((lidx, np.array(rows, np.int32), np.array(flags, np.uint8)))
    budget = draw(st.integers(1, int(leb.sum()) * n + 1000))
    return L, n, k, leb, loads, budget


def _load(rows: list[list[int]]) -> tuple[int, np.ndarray, np.ndarray]:
    ids = np.array(rows, np.int32)
    return 0, ids, np.zeros(ids.shape, np.uint8)


# A repeat inside a load is promoted: after (0, 1, 0), 1 is the least recent and is evicted, so 0 hits.
REPEAT = (1, 3, 1, np.array([1000], np.int64), [_load([[0], [1], [0]]), _load([[2]]), _load([[0]])], 2000)


@settings(max_examples=150, deadline=None)
@given(cases())
@example(REPEAT)
def test_stepped_lru_equals_the_replay_kernel(case):
    L, n, k, leb, loads, budget = case
    step = LruStep(leb, n, budget)
    skipped = np.concatenate([step.step(lidx, ids, flags) for lidx, ids, flags in loads])
    entries = np.concatenate([lidx * n + ids for lidx, ids, _ in loads]).astype(np.int32)
    G = len(loads)
    lo = Loads(entries=entries, load_start=np.cumsum([0] + [ids.shape[0] for _, ids, _ in loads]).astype(np.int64),
               load_lidx=np.array([lidx for lidx, _, _ in loads], np.int16),
               batch_start=np.arange(G + 1, dtype=np.int64), moe_layers=tuple(range(L)), n_expert=n, layer_expert_bytes=leb,
               batch_turn=np.zeros(G, np.int32), batch_step=np.arange(G, dtype=np.int32), batch_phase=np.ones(G, np.int8))
    res = replay(lo, "lru", budget / MIB, slots=True, drop=np.concatenate([f for _, _, f in loads]))
    assert np.array_equal(skipped, res.slots == 3)
    assert step.lookups == int(res.acc[:, :, ACC_LOOKUPS].sum())
    assert step.hits == int(res.acc[:, :, ACC_HITS].sum())
    assert step.read_bytes == int(res.acc[:, :, ACC_READ].sum())
    assert step.overflow_loads == res.overflow_loads


def _one_call(L, n, leb, loads):
    """The kernel's replay of all the loads in one call; a load whose layer index is not above the
    previous load's starts a new batch (one token per forward, layers in order)."""
    lidx = np.array([lidx for lidx, _, _ in loads], np.int32)
    batch = np.cumsum(np.r_[True, lidx[1:] <= lidx[:-1]]).astype(np.int32) - 1
    B = int(batch[-1]) + 1
    entries = np.concatenate([lidx * n + ids for lidx, ids, _ in loads]).astype(np.int32)
    lo = Loads(entries=entries, load_start=np.cumsum([0] + [ids.shape[0] for _, ids, _ in loads]).astype(np.int64),
               load_lidx=lidx.astype(np.int16), batch_start=np.searchsorted(batch, np.arange(B + 1)).astype(np.int64),
               moe_layers=tuple(range(L)), n_expert=n,
               layer_expert_bytes=leb, batch_turn=np.zeros(B, np.int32),
               batch_step=np.arange(B, dtype=np.int32), batch_phase=np.zeros(B, np.int8))
    return lo


def _at(lidx: int, rows: list[list[int]]) -> tuple[int, np.ndarray, np.ndarray]:
    ids = np.array(rows, np.int32)
    return lidx, ids, np.zeros(ids.shape, np.uint8)


# A batch (token) spans loads: at token 1's layer-1 load, least-stale must see (0, 0), touched at
# token 1's layer 0, as fresh and evict the stale (1, 0) instead, so token 2's (0, 0) hits.
BATCH = (2, 4, 1, np.array([1000, 1000], np.int64), [_at(0, [[0]]), _at(1, [[0]]), _at(0, [[0]]), _at(1, [[1]]),
                                                      _at(0, [[0]])], 2000)


@pytest.mark.parametrize("policy", STEPPABLE)
@settings(max_examples=60, deadline=None)
@given(case=cases())
@example(case=REPEAT)
@example(case=BATCH)
def test_stepped_kernel_equals_one_replay(policy, case):
    L, n, k, leb, loads, budget = case
    step = new_cache(policy, leb, n, budget)
    assert isinstance(step, KernelStep)
    skipped = np.concatenate([step.step(lidx, ids, flags) for lidx, ids, flags in loads])
    lo = _one_call(L, n, leb, loads)
    res = replay(lo, policy, budget / MIB, slots=True, drop=np.concatenate([f for _, _, f in loads]))
    assert np.array_equal(skipped, res.slots == 3)
    assert step.lookups == int(res.acc[:, :, ACC_LOOKUPS].sum())
    assert step.hits == int(res.acc[:, :, ACC_HITS].sum())
    assert step.read_bytes == int(res.acc[:, :, ACC_READ].sum())
    assert step.overflow_loads == res.overflow_loads
    assert step.skipped == int(skipped.sum())


@pytest.mark.parametrize("policy, why", [("belady", "next use"), ("layer-opt", "plans from the whole trace"),
                                         ("pin", "plans from the whole trace"), ("colibri", "plans from the whole trace")])
def test_unsteppable_policies_are_refused_by_name(policy, why):
    with pytest.raises(UserError, match=f"--policy {policy}: .*{why}"):
        check_steppable(policy)
