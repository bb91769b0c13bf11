"""The load kernel and the LRU driver as the streamed replay runs them, part by part
(replay/core/loads.py, replay/core/driver.py): cut_loads' row gate lets valid parts through and
stops a bad row in any block; its cut gives prepare_loads' arrays, in one call or continued over
several; the Numba driver for lru and layer, whole or in parts with carried clocks, agrees with
the naive twin (tests/naive/cache.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_cache_twin import drawn_loads
from tests.trace_strategies import small_shape, turn_rows

UNIT = 1 << 16  # entry sizes and budgets in 1/16 MiB, so budget_mib is exact in binary
FAST = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- the row gate (cut_loads with check on) ------------------------------------------------------------

# "none" last: hypothesis draws a sampled_from's first element most often
CORRUPT = ("layer_range", "layer_negative", "layer_not_moe", "phase", "batch_back", "step_repeat", "step_back",
           "phase_mix", "expert_range", "expert_negative", "expert_dup", "weight_neg", "weight_neg_zero", "weight_inf",
           "weight_ninf", "weight_partial_nan", "weight_all_nan", "weight_rank", "weight_tiny", "step_negative",
           "step_layer_back", "none")


@st.composite
def row_parts(draw):
    """A part's columns as read from a file (valid rows, then perhaps one corruption; k up to 9: the
    kernel unrolls k = 2, 4, 6, 8 and loops otherwise), with the
    previous part's last row or none."""
    R = draw(st.integers(1, 13)) if draw(st.integers(0, 9)) else 0
    k = draw(st.integers(1, 9))
    n_layer = draw(st.integers(1, 4))
    moe = np.array(draw(st.lists(st.booleans(), min_size=n_layer, max_size=n_layer)), np.bool_)
    moe[draw(st.integers(0, n_layer - 1))] = True
    n_expert = draw(st.integers(k, 10))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    layers = np.flatnonzero(moe)
    batch0 = int(rng.integers(0, 5))
    rows = []  # (batch, layer, step, phase), ordered by (batch, layer, step), one phase per batch
    b, step = batch0, int(rng.integers(0, 10))
    while len(rows) < R:
        phase = int(rng.integers(0, 2))
        n_tok = int(rng.integers(1, 4))
        for lay in layers:
            for t in range(n_tok):
                rows.append((b, int(lay), step + t, phase))
        b += int(rng.integers(1, 3))
        step += n_tok
    rows = rows[:R]
    batch = np.array([r[0] for r in rows], np.int32).reshape(R)
    layer = np.array([r[1] for r in rows], np.int16).reshape(R)
    steps = np.array([r[2] for r in rows], np.int32).reshape(R)
    phase = np.array([r[3] for r in rows], np.int8).reshape(R)
    experts = np.array([rng.permutation(n_expert)[:k] for _ in range(R)], np.int32).reshape(R, k)
    weights = -np.sort(-rng.integers(0, 5, (R, k)).astype(np.float32) / 4, axis=1)  # rank order, ties on purpose
    nan_row = int(rng.integers(0, R)) if R and draw(st.booleans()) else -1
    if nan_row >= 0:
        weights[nan_row] = np.nan  # a row the engine exposed no weights for
    kind = draw(st.sampled_from(CORRUPT))
    r = int(rng.integers(0, R)) if R else 0
    j = int(rng.integers(0, k))
    prev = max(r - 1, 0)
    if R:
        if kind == "layer_range":
            layer[r] = n_layer
        elif kind == "layer_negative":
            layer[r] = -1
        elif kind == "layer_not_moe" and not moe.all():
            layer[r] = int(np.flatnonzero(~moe)[0])
        elif kind == "phase":
            phase[r] = 2
        elif kind == "batch_back":
            batch[r] = batch[prev] - 1
        elif kind == "step_repeat":
            steps[r] = steps[prev]
        elif kind == "step_back":
            steps[r] = steps[prev] - 1
        elif kind == "phase_mix":
            phase[r] = 1 - phase[r]
        elif kind == "expert_range":
            experts[r, j] = n_expert
        elif kind == "expert_negative":
            experts[r, j] = -1
        elif kind == "expert_dup" and k > 1:
            experts[r, 1] = experts[r, 0]
        elif kind == "weight_neg":
            weights[r, j] = -0.25
        elif kind == "weight_neg_zero":
            weights[r, j] = -0.0
        elif kind == "weight_inf":
            weights[r, j] = np.inf
        elif kind == "weight_ninf":
            weights[r, j] = -np.inf
        elif kind == "weight_partial_nan":
            weights[r, :] = 0.5
            weights[r, j] = np.nan
        elif kind == "weight_all_nan":
            weights[r, :] = np.nan
        elif kind == "weight_rank" and k > 1:
            weights[r, :] = np.linspace(0.1, 0.5, k)
        elif kind == "weight_tiny":
            weights[r, j] = np.float32(1e-45)  # a subnormal: valid, and must stay valid in C (no flush to zero)
        elif kind == "step_negative":
            steps[r] = -1
        elif kind == "step_layer_back":  # the step of an earlier batch's row at the same layer: not a later token
            same = np.flatnonzero((layer[:r] == layer[r]) & (batch[:r] != batch[r]))
            if same.size:
                steps[r] = steps[same[-1]]
    has_last = draw(st.booleans())
    if has_last and R:
        lr = draw(st.sampled_from(["before", "same", "after"]))
        shift = {"before": -1, "same": 0, "after": 1}[lr]
        last = np.array([batch[0] + (shift if lr != "same" else 0), layer[0] if lr == "same" else 0,
                         steps[0] - 1 if lr == "same" else 0, phase[0]], np.int64)
    else:
        last = rng.integers(-3, 30, 4).astype(np.int64)
    # Still valid: no corruption, or one that a valid trace may hold (unless it made the NaN row partly NaN).
    by_rank = draw(st.booleans())
    valid = kind in ("none", "weight_all_nan") or (
        kind in ("weight_neg_zero", "weight_tiny") and r != nan_row and not (R and by_rank and (np.diff(weights[r]) > 0).any()))
    return dict(batch=batch, layer=layer, step=steps, phase=phase, experts=experts, weights=weights, moe=moe,
                n_expert=n_expert, by_rank=by_rank, has_last=has_last, last=last, kind=kind, valid=valid)


def _gate(batch, layer, step, phase, experts, weights, moe, n_expert, by_rank, has_last, last):
    """cut_loads with its row gate on, into fresh buffers: True when it lets the rows through."""
    from replay.core.loads import AT_BATCH, AT_HAS_LAST, CUT_OK, CUT_ROWS, cut_loads, new_at, new_lay_last

    R, k = experts.shape
    lidx_of = np.full(moe.shape[0], -1, np.int32)
    lidx_of[np.flatnonzero(moe)] = np.arange(int(moe.sum()), dtype=np.int32)
    at = new_at()
    at[AT_HAS_LAST] = int(has_last)
    at[AT_BATCH:AT_BATCH + 4] = last
    status = int(cut_loads(np.zeros(R, np.int32), batch, phase, step, layer, experts, weights, lidx_of, n_expert, True, moe,
                           by_rank, new_lay_last(moe.shape[0]), at, *_cut_buffers(R, k, np.random.default_rng(R))))
    assert status in (CUT_OK, CUT_ROWS)  # with the gate on, a row the cut would decline is the gate's
    return status == CUT_OK


def _gate_args(p):
    return (p["batch"], p["layer"], p["step"], p["phase"], p["experts"], p["weights"], p["moe"], p["n_expert"],
            p["by_rank"], p["has_last"], p["last"])


@settings(max_examples=300, **FAST)
@given(p=row_parts())
def test_gate_lets_valid_rows_through(p):
    got = _gate(*_gate_args(p))
    if p["valid"] and not p["has_last"]:
        assert got, p  # valid rows pass (the gate is not stricter than the checker on these)


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_gate_across_blocks(k):
    """Long parts: a valid one passes, and one bad row anywhere (a row whose predecessor is
    the one before it in the part) fails."""
    rng = np.random.default_rng(k)
    n_layer, n_expert, tokens = 3, 16, 3500  # 10,500 rows
    R = n_layer * tokens
    batch = np.repeat(np.arange(tokens, dtype=np.int32), n_layer)
    layer = np.tile(np.arange(n_layer, dtype=np.int16), tokens)
    step = batch.copy()
    phase = np.ones(R, np.int8)
    experts = np.array([rng.permutation(n_expert)[:k] for _ in range(R)], np.int32)
    weights = -np.sort(-rng.random((R, k), dtype=np.float32), axis=1)
    moe = np.ones(n_layer, np.bool_)
    args = [batch, layer, step, phase, experts, weights, moe, n_expert, True, False, np.zeros(4, np.int64)]
    assert _gate(*args)
    for r in (4096, 4097, 8191, 8192, R - 1):
        for what in ("step", "expert", "weight"):
            bad = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
            if what == "step":  # the row before repeated: same (batch, layer, step)
                for c in range(3):
                    bad[c][r] = bad[c][r - 1]
            elif what == "expert":
                bad[4][r, k - 1] = n_expert
            else:
                bad[5][r, 0] = -1.0
            assert not _gate(*bad), (r, what)


@pytest.mark.parametrize("steps, turns, ok", [
    ([0, 1, 2, 3], [0, 0, 0, 0], True),
    ([0, 2, 5, 9], [0, 0, 1, 1], True),
    ([0, 3, 1, 4], [0, 0, 1, 1], True),  # a later turn may start again lower
    ([0, 1, 1, 2], [0, 0, 0, 0], False),  # the same token twice at a layer
    ([0, 2, 1, 3], [0, 0, 0, 0], False),  # a token before the layer's previous one
    ([0, 2, 1, 3], [0, 1, 0, 1], False),  # a turn back
    ([0, 1, -1, 3], [0, 0, 0, 0], False),  # a negative step
])
@pytest.mark.parametrize("split", [0, 1, 2, 3, 4, 6, 8])
def test_gate_holds_the_step_rules_across_calls(steps, turns, ok, split):
    """One request, two MoE layers, one token per batch: the gate refuses a token that is not after
    its layer's previous one (RowChecker's step rules), also when the two are in different calls
    (``lay_last`` carries each layer's last step and turn)."""
    from replay.core.loads import CUT_OK, CUT_ROWS, cut_loads, new_at, new_lay_last

    n_tok, k = len(steps), 1
    R = 2 * n_tok
    cols = (np.repeat(np.array(turns, np.int32), 2), np.repeat(np.arange(n_tok, dtype=np.int32), 2), np.ones(R, np.int8),
            np.repeat(np.array(steps, np.int32), 2), np.tile(np.arange(2, dtype=np.int16), n_tok), np.zeros((R, k), np.int32),
            np.ones((R, k), np.float32))
    lidx_of = np.arange(2, dtype=np.int32)
    at, lay_last, bufs = new_at(), new_lay_last(2), _cut_buffers(R, k, np.random.default_rng(0))
    got = CUT_OK
    for a, b in ((0, split), (split, R)):
        got = int(cut_loads(*(c[a:b] for c in cols), lidx_of, 4, True, np.ones(2, np.bool_), True, lay_last, at, *bufs))
        if got != CUT_OK:
            break
    assert got == (CUT_OK if ok else CUT_ROWS)


# -- cut_loads ------------------------------------------------------------------------------------------




def _cut_buffers(R, k, rng):
    """Output buffers with room for R rows and some more, filled with the same garbage for both kernels."""
    cap = R + int(rng.integers(0, 3))

    def junk(shape, dt):
        return rng.integers(-99, 99, shape).astype(dt)

    return [junk((cap, k), np.int32), junk(cap + 1, np.int64), junk(cap, np.int16), junk(cap + 1, np.int64),
            junk(cap, np.int32), junk(cap, np.int32), junk(cap, np.int8), junk(cap, np.int32)]


@settings(max_examples=300, **FAST)
@given(seed=st.integers(0, 2**32 - 1), R=st.integers(0, 30), k=st.integers(1, 3), sorted_batches=st.integers(0, 3),
       bad_layer=st.integers(0, 4), bad_expert=st.integers(0, 4), bad_phase=st.integers(0, 4), readonly=st.booleans())
def test_cut_loads_gives_prepare_loads_arrays(seed, R, k, sorted_batches, bad_layer, bad_expert, bad_phase, readonly):
    """On rows in order, one phase per batch, prepare_loads' arrays; anything else declined with a
    nonzero status (the caller then refuses it in words)."""
    from replay.core.loads import cut_loads
    from replay.core.simulate import prepare_loads
    from traces.io.reader import RoutingArrays

    rng = np.random.default_rng(seed)
    moe_layers = [1, 3, 4]
    n_expert = 7
    lidx_of = np.full(5, -1, np.int32)
    lidx_of[moe_layers] = np.arange(3, dtype=np.int32)
    batch = rng.integers(0, 6, R).astype(np.int32)
    if sorted_batches:
        batch = np.sort(batch)
    layer = rng.choice(moe_layers, R).astype(np.int16)
    if sorted_batches:  # rows in (batch, layer) order, as a trace has them
        layer = layer[np.lexsort((layer, batch))]
    experts = rng.integers(0, n_expert, (R, k)).astype(np.int32)
    if R and bad_layer == 0:
        layer[rng.integers(0, R)] = rng.choice([0, 2, 5, -1, 300])
    if R and bad_expert == 0:
        experts[rng.integers(0, R), rng.integers(0, k)] = rng.choice([-1, n_expert, 1 << 30])
    phase = rng.integers(0, 2, 6).astype(np.int8)[batch]  # one phase per batch
    mixed = False
    if R and bad_phase == 0:
        r = int(rng.integers(0, R))
        phase[r] = 1 - phase[r]
        mixed = bool((r > 0 and batch[r - 1] == batch[r]) or (r + 1 < R and batch[r + 1] == batch[r]))
    cols = dict(turn=rng.integers(0, 3, R).astype(np.int32), batch=batch, phase=phase,
                step=rng.integers(0, 50, R).astype(np.int32), layer=layer, experts=experts)
    if readonly:  # columns straight from Arrow are read-only
        for v in cols.values():
            v.flags.writeable = False
    from replay.core.loads import AT_BATCHES, AT_LOADS, AT_ROWS, new_at

    no_check = (np.zeros((R, k), np.float32), lidx_of, n_expert, False, np.ones(5, np.bool_), False, np.zeros((0, 2), np.int64))
    ins = (cols["turn"], cols["batch"], cols["phase"], cols["step"], cols["layer"], cols["experts"])
    b_c = _cut_buffers(R, k, np.random.default_rng(seed + 1))
    at = new_at()
    status = int(cut_loads(*ins, *no_check, at, *b_c))
    G, B = int(at[AT_LOADS]), int(at[AT_BATCHES])
    if status == 0:
        assert int(at[AT_ROWS]) == R
        ra = RoutingArrays(weights=np.zeros((R, k), np.float32), **cols)
        ref = prepare_loads(ra, moe_layers, n_expert, np.array([0, 5, 0, 7, 9], np.int64))
        assert not mixed  # a batch of both phases is declined
        assert np.array_equal(b_c[0][:R], ref.entries) and np.array_equal(b_c[1][:G + 1], ref.load_start)
        assert np.array_equal(b_c[2][:G], ref.load_lidx) and np.array_equal(b_c[3][:B + 1], ref.batch_start)
        assert np.array_equal(b_c[4][:B], ref.batch_turn) and np.array_equal(b_c[5][:B], ref.batch_step)
        assert np.array_equal(b_c[6][:B], ref.batch_phase) and np.array_equal(b_c[7][:B], ref.batch_tokens)
        # The same rows in two calls (cut anywhere, through a load or a batch): the same arrays.
        cut = int(np.random.default_rng(seed + 2).integers(0, R + 1))
        b2 = _cut_buffers(R, k, np.random.default_rng(seed + 3))
        at2 = new_at()
        for a, b in ((0, cut), (cut, R)):
            assert int(cut_loads(*(v[a:b] for v in ins), *no_check[:0], np.zeros((b - a, k), np.float32), *no_check[1:], at2,
                                 *b2)) == 0
        assert at2.tolist()[:3] == at.tolist()[:3]
        for got, want, n in zip(b2, b_c, (R, G + 1, G, B + 1, B, B, B, B), strict=True):
            assert np.array_equal(got[:n], want[:n])
    elif sorted_batches and bad_layer and bad_expert and not mixed:
        pytest.fail(f"valid rows declined with status {status}")


# -- replay_lru ------------------------------------------------------------------------------------------


@st.composite
def small_traces(draw):
    """(moe_layers, n_layer, n_expert, k, expert bytes per layer, rows, budget in UNITs): rows are
    (turn, batch, phase, step, layer, experts) in file order, duplicate ids inside a routing allowed."""
    moe_layers, n_layer, n_expert, k, eb = small_shape(draw, UNIT)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    skew = draw(st.floats(0.0, 2.0))  # popular experts: hits happen
    pop = np.arange(1, n_expert + 1, dtype=np.float64) ** -skew
    pop /= pop.sum()
    plan = [(draw(st.integers(0, 6)), draw(st.integers(0, 10))) for _ in range(draw(st.integers(1, 2)))]
    rows = turn_rows(plan, moe_layers, lambda: rng.choice(n_expert, k, p=pop).tolist())
    total = sum(eb.values()) * n_expert
    budget_units = draw(st.integers(0, total // UNIT + 3))  # 0 and small budgets overflow
    return moe_layers, n_layer, n_expert, k, eb, rows, budget_units


def _state(loads, policy, budget):
    """A fresh cell, as replay.core.streaming builds it: (ent, grp, ps, acc, layer_info)."""
    from replay.core.driver import N_ACC
    from replay.core.simulate import _groups
    from replay.core.state import new_state
    from replay.policies import policy_module

    pm = policy_module(policy)
    group, gbud = _groups(loads, pm, budget)
    ent, grp = new_state(loads.entry_bytes, group, gbud)
    ps = pm.init(ent, grp, 0)
    acc = np.zeros((2, len(loads.moe_layers), N_ACC), np.int64)
    layer_info = np.stack([group[::loads.n_expert], loads.layer_expert_bytes]).T.astype(np.int64).copy()
    return ent, grp, ps, acc, layer_info


def _cuts(loads, n_cuts, rng):
    """Load indexes where the trace is cut into parts (0 and G included), as iter_load_parts hands
    them out: whole loads, a batch possibly continuing into the next part."""
    G = loads.load_start.shape[0] - 1
    inner = sorted(set(rng.integers(1, G, n_cuts).tolist())) if G > 1 and n_cuts else []
    return [0, *inner, G]


def _part(loads, a, b):
    """Loads a..b of the trace as one part's arrays (rows renumbered from 0, batches from its first;
    a batch the cut goes through starts or ends at the part's edge)."""
    r0, r1 = int(loads.load_start[a]), int(loads.load_start[b])
    batch0 = int(loads.load_batch[a]) if b > a else 0
    n_batch = int(loads.load_batch[b - 1]) + 1 - batch0 if b > a else 0
    starts = (np.clip(loads.batch_start[batch0:batch0 + n_batch + 1], a, b) - a).astype(np.int64)
    return (np.ascontiguousarray(loads.entries[r0:r1]), (loads.load_start[a:b + 1] - r0).astype(np.int64),
            loads.load_lidx[a:b].copy(), starts, loads.batch_phase[batch0:batch0 + n_batch].copy()), batch0, n_batch


_NUMBA: dict[str, object] = {}


def _numba(policy):
    """The Numba driver for ``policy`` (plain: no what-ifs, no per-slot codes)."""
    if policy not in _NUMBA:
        from replay.core.driver import make_kernel
        from replay.policies import policy_module

        _NUMBA[policy] = make_kernel(policy, policy_module(policy), whatif=False, slots=False)
    return _NUMBA[policy]


def _replay_parts(kern, loads, policy, budget, cuts, tick0, stats0, load_base=0):
    """Replay the trace part by part with the clocks carried as replay.core.streaming carries them
    (the load clock from ``load_base``); the state, the
    per-part outputs and the final stats, for a byte-for-byte comparison."""
    from replay.core.driver import OPT_BATCH0, OPT_LOAD0, OPT_TICK0, STAT_TICKS, no_options

    ent, grp, ps, acc, layer_info = _state(loads, policy, budget)
    k = loads.entries.shape[1]
    empty_next, slot_out, drop, pred = (np.zeros((0, k), np.int32), np.zeros((0, k), np.uint8), np.zeros((0, k), np.uint8),
                                        np.zeros((0, 1), np.int32))
    outs = []
    tick = tick0
    prev_batch = None
    for a, b in zip(cuts[:-1], cuts[1:]):
        part, batch0, n_batch = _part(loads, a, b)
        bacc = np.zeros((n_batch, 7), np.int64)
        stats = stats0.copy()
        opts = no_options()
        opts[OPT_TICK0] = tick
        opts[OPT_LOAD0] = load_base + a
        opts[OPT_BATCH0] = 0 if prev_batch == batch0 else -1
        kern(*part, layer_info, empty_next, ent, grp, ps, acc, bacc, stats, slot_out, drop, pred, opts,
             np.zeros((0, 1), np.int8))
        tick = int(stats[STAT_TICKS])
        prev_batch = batch0 + n_batch - 1
        outs.append((bacc, stats, ent.copy(), grp.copy(), ps.copy(), acc.copy()))
    return outs


@settings(max_examples=150, **FAST)
@given(t=small_traces(), policy=st.sampled_from(["lru", "layer"]), n_cuts=st.integers(0, 4), seed=st.integers(0, 2**32 - 1))
def test_replay_lru_equals_naive_twin(t, policy, n_cuts, seed):
    """Per (phase, layer) lookups, hits and bytes read, per-batch totals, evictions, overflowed loads
    and the peak resident bytes equal the naive twin's, whether replayed whole or in parts."""
    from tests.naive.cache import naive_replay

    moe_layers, n_layer, n_expert, k, eb, rows, budget_units = t
    if not rows:
        return
    loads = drawn_loads(*t)
    cuts = _cuts(loads, n_cuts, np.random.default_rng(seed))
    outs = _replay_parts(_numba(policy), loads, policy, budget_units * UNIT, cuts, 0, np.zeros(12, np.int64))
    want = naive_replay([(r[1], r[2], r[4], r[5]) for r in rows], moe_layers, n_expert, eb, policy, budget_units * UNIT)
    acc = outs[-1][5]
    for i, layer in enumerate(moe_layers):
        for ph in (0, 1):
            assert acc[ph, i, 0] == want["lookups"].get((ph, layer), 0)
            assert acc[ph, i, 1] == want["hits"].get((ph, layer), 0)
            assert acc[ph, i, 2] == want["read"].get((ph, layer), 0)
    # per-batch totals: a batch cut between parts has its totals split, and they add up
    per_batch = np.zeros((int(loads.load_batch[-1]) + 1, 3), np.int64)
    for (a, _), (bacc, *_rest) in zip(zip(cuts[:-1], cuts[1:]), outs):
        b0 = int(loads.load_batch[a])
        per_batch[b0:b0 + bacc.shape[0]] += bacc[:, :3]
    assert {b: per_batch[b].tolist() for b in range(per_batch.shape[0])} == {
        b: want["per_batch"].get(b, [0, 0, 0]) for b in range(per_batch.shape[0])}
    assert sum(int(o[1][0]) for o in outs) == want["evictions"]
    assert sum(int(o[1][1]) for o in outs) == want["overflow"]
    assert max(int(o[1][11]) for o in outs) == want["peak_bytes"]
    assert int(outs[-1][1][3]) == loads.entries.size  # one tick per routed slot


def test_replay_lru_counts_a_known_sequence():
    """One layer of 4 experts, room for 2, top-1 decode: 0 1 0 2 1 0 -> miss miss hit miss miss miss
    (LRU keeps {0, 2} after the fourth, so 1 misses and evicts 0, which then misses)."""
    t = ([0], 1, 4, 1, {0: UNIT}, [(0, b, 1, b, 0, [x]) for b, x in enumerate([0, 1, 0, 2, 1, 0])], 2)
    loads = drawn_loads(*t)
    (bacc, stats, ent, grp, ps, acc), = _replay_parts(_numba("lru"), loads, "lru", 2 * UNIT, [0, 6], 0,
                                                      np.zeros(12, np.int64))
    assert bacc[:, 1].tolist() == [0, 0, 1, 0, 0, 0]
    assert acc[1, 0, :3].tolist() == [6, 1, 5 * UNIT]
    assert (stats[0], stats[1], stats[3], stats[11]) == (3, 0, 6, 2 * UNIT)
    assert ent[0, :4].tolist() == [1, 1, 0, 0]  # resident: 0 and 1
    assert grp[0, 2:4].tolist() == [2 * UNIT, 2]



def test_a_kernel_name_covers_every_policy_helper_module():
    # The driver's kernel name hashes the hook sources: a helper module the hooks inline
    # (_lists.py, _heap.py, _scan.py, _blocks.py) left out of it let an edited helper run from an
    # old cached kernel (the glob once pointed at replay/core/policies, which does not exist).
    from pathlib import Path

    import replay.policies
    from replay.core.driver import _source_hash, hashed_sources
    from replay.policies import policy_module

    pdir = Path(replay.policies.__file__).resolve().parent
    names = {p.name for p in hashed_sources(policy_module("lru"))}
    helpers = {p.name for p in pdir.glob("_*.py")} - {"__init__.py"}
    assert {"_lists.py", "_heap.py"} <= helpers <= names
    assert {p.name for p in pdir.glob("*.py")} <= names
    assert len(_source_hash(policy_module("lru"))) == 10
