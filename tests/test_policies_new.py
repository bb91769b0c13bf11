"""s3fifo, sieve, least-stale: exact agreement with their naive twins (more examples than the
all-policy twin test gives each), and hand-built traces that pin each policy's distinctive move."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_cache_twin import UNIT, _replay_both, traces

NEW = ["s3fifo", "sieve", "least-stale"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=traces(), policy=st.sampled_from(NEW))
def test_new_policies_match_naive_twin(t, policy):
    moe_layers, _n_layer, n_expert, k, eb, rows, budget_units = t
    if rows:
        _replay_both(rows, moe_layers, n_expert, eb, policy, budget_units, k)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seq=st.lists(st.integers(0, 29), min_size=20, max_size=200), budget=st.integers(10, 30),
       policy=st.sampled_from(["s3fifo", "sieve"]))
def test_long_top1_sequences_match_naive_twin(seq, budget, policy):
    """Budgets of 10..30 entries (the small queue holds 1..3), long enough for ghost hits, moves
    from S to M, reinsertion in M and the hand wrapping round."""
    _replay_both(_rows(seq), [0], 30, {0: UNIT}, policy, budget, 1)


def _rows(seq, layer=0):
    """One decode token per batch, one MoE layer, top-1."""
    return [(0, b, 1, b, layer, [x]) for b, x in enumerate(seq)]


def _codes(res):
    return res.slots[:, 0].tolist()


def test_s3fifo_one_hit_wonder_leaves_through_small_queue_re_referenced_moves_to_main():
    """Budget 20 entries: small queue 2, main 18. Warm-up: S takes 0 and 1, and once S is full
    (before the first eviction) 2..19 go to M. Then 40 and 41 arrive in S; 41 is hit twice
    (frequency 2), 40 never: the run of new ids pushes 40 out through S into the ghost, while 41
    moves to M and survives. 40 then comes back through the ghost straight into M and survives the
    next one-hit wonders."""
    warm = list(range(20))  # S = [0, 1] (2 entries), then S is full and 2..19 go to M
    seq = warm + [0, 1, 0, 1]  # 0 and 1 reach frequency 2 in S
    seq += [40, 41, 41, 41]  # 40 evicts from S: 0 and 1 move to M, M overflows -> M evicts; ...
    seq += [50, 51, 52, 53, 54, 55]  # one-hit wonders through S
    seq += [41, 40]
    res = _replay_both(_rows(seq), [0], 60, {0: UNIT}, "s3fifo", 20, 1)
    c = _codes(res)
    assert c[-2] == 1, "41, re-referenced in S, moved to M and is still resident"
    assert c[-1] == 0, "40, a one-hit wonder, left through S"
    seq2 = seq + [60, 61, 62, 63, 40]
    c2 = _codes(_replay_both(_rows(seq2), [0], 70, {0: UNIT}, "s3fifo", 20, 1))
    assert c2[-1] == 1


def test_s3fifo_differs_from_fifo_and_lru_on_scan():
    """A hot set of 3 re-used between scans of new ids: s3fifo keeps the hot set (in M), LRU loses it."""
    hot = [0, 1, 2]
    seq = list(range(20)) + hot * 3
    for r in range(4):
        seq += list(range(100 + 10 * r, 110 + 10 * r)) + hot
    s3 = _replay_both(_rows(seq), [0], 200, {0: UNIT}, "s3fifo", 20, 1)
    lru = _replay_both(_rows(seq), [0], 200, {0: UNIT}, "lru", 5, 1)
    assert _codes(s3)[-3:] == [1, 1, 1]
    assert _codes(lru)[-3:] == [0, 0, 0]


def test_sieve_hand_skips_visited_and_clears_their_bit():
    """Budget 3: A B C resident, then B and A hit (visited; LRU order now C, B, A). D's eviction:
    the hand passes A and B, clearing their bits, and evicts C. E's eviction starts again from the
    oldest (C was the newest old entry): A's bit is clear now, so A goes (LRU evicts B, the least
    recent). So B then hits under sieve and misses under LRU; A misses under sieve. A hand that did
    not clear bits would have passed A and B again and evicted D."""
    A, B, C, D, E = 0, 1, 2, 3, 4
    seq = [A, B, C, B, A, D, E, B, A]
    c = _codes(_replay_both(_rows(seq), [0], 5, {0: UNIT}, "sieve", 3, 1))
    assert c == [0, 0, 0, 1, 1, 0, 0, 1, 0]
    lru = _codes(_replay_both(_rows(seq), [0], 5, {0: UNIT}, "lru", 3, 1))
    assert lru[7] == 0


def test_least_stale_keeps_a_fresh_entry_over_an_older_stale_one():
    """Two MoE layers, budget 2 entries. Token 0 loads (L0: x, L1: y); token 1 loads L0: x (hit,
    fresh), then L1: z. After z's load, x (older admission but touched in this token pass) is fresh
    and y is stale: least-stale evicts y; FIFO order alone (oldest admission) would evict x."""
    rows = [(0, 0, 1, 0, 0, [0]), (0, 0, 1, 0, 1, [0]),  # token 0: L0 e0, L1 e0
            (0, 1, 1, 1, 0, [0]), (0, 1, 1, 1, 1, [1]),  # token 1: L0 e0 (hit), L1 e1 (miss)
            (0, 2, 1, 2, 0, [0])]  # token 2: L0 e0 again
    eb = {0: UNIT, 1: UNIT}
    res = _replay_both(rows, [0, 1], 2, eb, "least-stale", 2, 1)
    assert _codes(res) == [0, 0, 1, 0, 1]
    # The stale tier is what keeps it: with the entry touched in an earlier token instead, FIFO
    # order evicts the oldest admission (L0 e0) at token 1's L1 load.
    rows2 = [(0, 0, 1, 0, 0, [0]), (0, 0, 1, 0, 1, [0]), (0, 1, 1, 1, 1, [1]), (0, 2, 1, 2, 0, [0])]
    assert _codes(_replay_both(rows2, [0, 1], 2, eb, "least-stale", 2, 1)) == [0, 0, 0, 0]


def test_least_stale_batch_cell_is_written_only_when_asked():
    """NEEDS_BATCH compiles the per-batch write in: a policy without it leaves grp[:, BATCH_LOAD] at -1."""
    from replay.core.driver import make_kernel
    from replay.policies import policy_module

    for name, want in (("least-stale", True), ("lru", False)):
        assert bool(getattr(policy_module(name), "NEEDS_BATCH", False)) is want
    k = make_kernel("least-stale", policy_module("least-stale"), whatif=False, slots=False)
    assert k.py_func.__globals__["KEEP_BATCH"] is True
    k = make_kernel("lru", policy_module("lru"), whatif=False, slots=False)
    assert k.py_func.__globals__["KEEP_BATCH"] is False
    assert np.int64(-1) == -1
