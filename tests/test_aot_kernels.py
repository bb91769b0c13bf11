"""The ahead-of-time compiled kernels (replay/_aot.c, through replay.aot) agree exactly with their
Numba twins on random inputs: rows_ok and cut_loads give the same answers and write the same
bytes; replay_lru (lru and layer, whole or in parts with carried clocks) leaves ent, grp, ps, acc,
bacc and stats byte for byte as the Numba driver does, and agrees with the naive twin
(tests/naive/cache.py). Bad arguments raise TypeError / ValueError naming the argument, never crash.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay import aot
from tests.helpers import loader_import_seconds
from tests.trace_strategies import small_shape, turn_rows

AOT = aot.load()
needs_aot = pytest.mark.skipif(AOT is None, reason=f"the compiled kernels are not available: {aot.why_unavailable()}")

ROOT = Path(__file__).resolve().parents[1]
UNIT = 1 << 16  # entry sizes and budgets in 1/16 MiB, so budget_mib is exact in binary
FAST = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _c_compiler() -> str | None:
    import shlex
    import shutil
    import sysconfig

    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    return shutil.which(cc[0]) if cc else None


@pytest.mark.skipif(not os.environ.get("CI"), reason="checked in CI only (a plain pytest run may use a tree built without it)")
def test_built_in_ci_where_a_compiler_is_present():
    """The build is optional (a machine without a C compiler still installs), so a compile error in
    replay/_aot.c would only skip the tests below: in CI, with a compiler, it must have been built."""
    if _c_compiler() is None or os.environ.get(aot.ENV, "").strip() == "0":
        pytest.skip("no C compiler here, or MOE_REPLAY_AOT=0: the Numba kernels are the ones to test")
    assert AOT is not None, aot.why_unavailable()


@needs_aot
def test_layout_matches_the_python_constants():
    """The field numbers compiled into the module are those of replay.cache_state / cache_kernel."""
    from replay import cache_kernel as ck
    from replay import cache_state as cs

    assert (AOT.N_ENT, AOT.N_GRP, AOT.N_ACC, AOT.N_STATS, AOT.N_OPTS) == (cs.N_ENT, cs.N_GRP, ck.N_ACC, ck.N_STATS, ck.N_OPTS)
    assert (AOT.ENT_RESIDENT, AOT.ENT_PIN, AOT.ENT_BYTES) == (cs.RESIDENT, cs.PIN, cs.BYTES)
    assert (AOT.GRP_BUDGET, AOT.GRP_USED, AOT.GRP_COUNT) == (cs.BUDGET, cs.USED, cs.COUNT)
    assert (AOT.OPT_TICK0, AOT.OPT_LOAD0) == (ck.OPT_TICK0, ck.OPT_LOAD0)
    assert (AOT.STAT_TICKS, AOT.STAT_PEAK_BYTES, AOT.STAT_EVICTIONS, AOT.STAT_OVERFLOW) == (
        ck.STAT_TICKS, ck.STAT_PEAK_BYTES, ck.STAT_EVICTIONS, ck.STAT_OVERFLOW)
    assert (AOT.ACC_LOOKUPS, AOT.ACC_HITS, AOT.ACC_READ) == (ck.ACC_LOOKUPS, ck.ACC_HITS, ck.ACC_READ)


# -- rows_ok ------------------------------------------------------------------------------------------

# "none" last: hypothesis draws a sampled_from's first element most often
CORRUPT = ("layer_range", "layer_negative", "layer_not_moe", "phase", "batch_back", "step_repeat", "step_back",
           "phase_mix", "expert_range", "expert_negative", "expert_dup", "weight_neg", "weight_neg_zero", "weight_inf",
           "weight_ninf", "weight_partial_nan", "weight_all_nan", "weight_rank", "weight_tiny", "none")


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


def _rows_ok_args(p):
    return (p["batch"], p["layer"], p["step"], p["phase"], p["experts"], p["weights"], p["moe"], p["n_expert"],
            p["by_rank"], p["has_last"], p["last"])


@needs_aot
@settings(max_examples=300, **FAST)
@given(p=row_parts())
def test_rows_ok_equals_numba(p):
    from replay.load_kernel import rows_ok

    got, want = AOT.rows_ok(*_rows_ok_args(p)), rows_ok(*_rows_ok_args(p))
    assert isinstance(got, bool)
    assert got == want, p
    if p["valid"] and not p["has_last"]:
        assert got, p  # valid rows pass (the gate is not stricter than the checker on these)


@needs_aot
@settings(max_examples=150, **FAST)
@given(seed=st.integers(0, 2**32 - 1), R=st.integers(0, 13), k=st.integers(1, 9), by_rank=st.booleans(),
       has_last=st.booleans())
def test_rows_ok_equals_numba_on_noise(seed, R, k, by_rank, has_last):
    """Columns of random values (mostly invalid, now and then valid) and special floats."""
    from replay.load_kernel import rows_ok

    rng = np.random.default_rng(seed)
    specials = np.array([0, 0.5, 1, -0.0, -1, np.nan, np.inf, -np.inf, 1e-45, 3e38], np.float32)
    args = (np.sort(rng.integers(-1, 3, R)).astype(np.int32), rng.integers(-1, 3, R).astype(np.int16),
            rng.integers(-1, 5, R).astype(np.int32), rng.integers(0, 3, R).astype(np.int8) % (1 + (seed % 3 == 0)),
            rng.integers(-1, 4, (R, k)).astype(np.int32), rng.choice(specials, (R, k)).astype(np.float32),
            rng.integers(0, 2, 3).astype(np.bool_), 4, by_rank, has_last, rng.integers(-2, 4, 4).astype(np.int64))
    assert AOT.rows_ok(*args) == rows_ok(*args)


@needs_aot
@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_rows_ok_across_blocks(k):
    """Parts longer than the C kernel's block of rows: a valid one passes, and one bad row in a
    later block (or at a block's first row, whose predecessor is the previous block's last) fails."""
    from replay.load_kernel import rows_ok

    rng = np.random.default_rng(k)
    n_layer, n_expert, tokens = 3, 16, 3500  # 10,500 rows: three blocks of 4,096
    R = n_layer * tokens
    batch = np.repeat(np.arange(tokens, dtype=np.int32), n_layer)
    layer = np.tile(np.arange(n_layer, dtype=np.int16), tokens)
    step = batch.copy()
    phase = np.ones(R, np.int8)
    experts = np.array([rng.permutation(n_expert)[:k] for _ in range(R)], np.int32)
    weights = -np.sort(-rng.random((R, k), dtype=np.float32), axis=1)
    moe = np.ones(n_layer, np.bool_)
    args = [batch, layer, step, phase, experts, weights, moe, n_expert, True, False, np.zeros(4, np.int64)]
    assert AOT.rows_ok(*args) is True and rows_ok(*args)
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
            assert AOT.rows_ok(*bad) is False and not rows_ok(*bad), (r, what)


# -- cut_loads ------------------------------------------------------------------------------------------


def _cut_buffers(R, k, rng):
    """Output buffers with room for R rows and some more, filled with the same garbage for both kernels."""
    cap = R + int(rng.integers(0, 3))

    def junk(shape, dt):
        return rng.integers(-99, 99, shape).astype(dt)

    return [junk((cap, k), np.int32), junk(cap + 1, np.int64), junk(cap, np.int32), junk(cap, np.int8), junk(cap, np.int32),
            junk(cap, np.int32), junk(cap, np.int32), junk(cap, np.int8), junk(cap, np.int32)]


@needs_aot
@settings(max_examples=300, **FAST)
@given(seed=st.integers(0, 2**32 - 1), R=st.integers(0, 30), k=st.integers(1, 3), sorted_batches=st.integers(0, 3),
       bad_layer=st.integers(0, 4), bad_expert=st.integers(0, 4), readonly=st.booleans())
def test_cut_loads_equals_numba(seed, R, k, sorted_batches, bad_layer, bad_expert, readonly):
    """Same status, counts and every byte of every output buffer; on valid rows also prepare_loads' arrays."""
    from replay.cache import prepare_loads
    from replay.load_kernel import cut_loads
    from traces.reader import RoutingArrays

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
    cols = dict(turn=rng.integers(0, 3, R).astype(np.int32), batch=batch, phase=rng.integers(0, 2, R).astype(np.int8),
                step=rng.integers(0, 50, R).astype(np.int32), layer=layer, experts=experts)
    if readonly:  # columns straight from Arrow are read-only
        for v in cols.values():
            v.flags.writeable = False
    ins = (cols["turn"], cols["batch"], cols["phase"], cols["step"], cols["layer"], cols["experts"], lidx_of, n_expert)
    b_c = _cut_buffers(R, k, np.random.default_rng(seed + 1))
    b_n = _cut_buffers(R, k, np.random.default_rng(seed + 1))
    got = AOT.cut_loads(*ins, *b_c)
    want = cut_loads(*ins, *b_n)
    assert got == tuple(int(x) for x in want)
    for x, y in zip(b_c, b_n):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
    status, G, B = got
    if status == 0:
        ra = RoutingArrays(weights=np.zeros((R, k), np.float32), **cols)
        ref = prepare_loads(ra, moe_layers, n_expert, np.array([0, 5, 0, 7, 9], np.int64))
        assert np.array_equal(b_c[0][:R], ref.entries) and np.array_equal(b_c[1][:G + 1], ref.load_start)
        assert np.array_equal(b_c[2][:G], ref.load_lidx) and np.array_equal(b_c[4][:G], ref.load_batch)
        assert np.array_equal(b_c[8][:B], ref.batch_tokens)
    elif sorted_batches and bad_layer and bad_expert:
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


def _loads(t):
    from replay.cache import prepare_loads
    from traces.reader import RoutingArrays

    moe_layers, n_layer, n_expert, k, eb, rows, _ = t
    R = len(rows)
    ra = RoutingArrays(turn=np.array([r[0] for r in rows], np.int32).reshape(R),
                       batch=np.array([r[1] for r in rows], np.int32).reshape(R),
                       phase=np.array([r[2] for r in rows], np.int8).reshape(R),
                       step=np.array([r[3] for r in rows], np.int32).reshape(R),
                       layer=np.array([r[4] for r in rows], np.int16).reshape(R),
                       experts=np.array([r[5] for r in rows], np.int32).reshape(R, k), weights=np.zeros((R, k), np.float32))
    expert_bytes = np.zeros(n_layer, np.int64)
    for l, b in eb.items():
        expert_bytes[l] = b
    return prepare_loads(ra, moe_layers, n_expert, expert_bytes)


def _state(loads, policy, budget):
    """A fresh cell, as replay.cache_stream builds it: (ent, grp, ps, acc, layer_info)."""
    from replay.cache import _groups
    from replay.cache_kernel import N_ACC
    from replay.cache_state import new_state
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
    """Loads a..b of the trace as one part's arrays (rows renumbered from 0, batches from its first)."""
    r0, r1 = int(loads.load_start[a]), int(loads.load_start[b])
    batch0 = int(loads.load_batch[a]) if b > a else 0
    lb = (loads.load_batch[a:b] - batch0).astype(np.int32)
    n_batch = int(lb[-1]) + 1 if b > a else 0
    return (np.ascontiguousarray(loads.entries[r0:r1]), (loads.load_start[a:b + 1] - r0).astype(np.int64),
            loads.load_lidx[a:b].copy(), loads.load_phase[a:b].copy(), lb), batch0, n_batch


_NUMBA: dict[str, object] = {}


def _numba(policy):
    """The Numba driver for ``policy`` (plain: no what-ifs, no per-slot codes), compiled here, not
    through replay.cache.kernel_for (which runs the compiled twin when it is built)."""
    if policy not in _NUMBA:
        from replay.cache_kernel import make_kernel
        from replay.policies import policy_module

        _NUMBA[policy] = make_kernel(policy, policy_module(policy), whatif=False, slots=False)
        assert hasattr(_NUMBA[policy], "py_func")  # a Numba dispatcher: the twin compared with is not C itself
    return _NUMBA[policy]


def _with_empty_loads(part, rng):
    """The part's load arrays with empty loads inserted (load_start repeated), their layer, phase
    and batch garbage: the driver skips an empty load before reading any of them."""
    entries, load_start, lidx, phase, lbatch = part
    G = lidx.shape[0]
    at = np.sort(rng.integers(0, G + 1, int(rng.integers(1, 4))))
    return (entries, np.insert(load_start, at, load_start[at]), np.insert(lidx, at, 999).astype(np.int32),
            np.insert(phase, at, 7).astype(np.int8), np.insert(lbatch, at, -5).astype(np.int32))


def _replay_parts(kern, numba, loads, policy, budget, cuts, tick0, stats0, load_base=0, empty_seed=None):
    """Replay the trace part by part with the clocks carried as replay.cache_stream carries them
    (the load clock from ``load_base``; with ``empty_seed``, empty loads inserted); the state, the
    per-part outputs and the final stats, for a byte-for-byte comparison."""
    from replay.cache_kernel import OPT_BATCH0, OPT_LOAD0, OPT_TICK0, STAT_TICKS, no_options

    ent, grp, ps, acc, layer_info = _state(loads, policy, budget)
    k = loads.entries.shape[1]
    empty_next, slot_out, drop, pred = (np.zeros((0, k), np.int32), np.zeros((0, k), np.uint8), np.zeros((0, k), np.uint8),
                                        np.zeros((0, 1), np.int32))
    outs = []
    tick = tick0
    prev_batch = None
    for a, b in zip(cuts[:-1], cuts[1:]):
        part, batch0, n_batch = _part(loads, a, b)
        if empty_seed is not None:
            part = _with_empty_loads(part, np.random.default_rng(empty_seed + a))
        bacc = np.zeros((n_batch, 7), np.int64)
        stats = stats0.copy()
        opts = no_options()
        opts[OPT_TICK0] = tick
        opts[OPT_LOAD0] = load_base + a
        opts[OPT_BATCH0] = 0 if prev_batch == batch0 else -1
        if numba:
            kern(*part, layer_info, empty_next, ent, grp, ps, acc, bacc, stats, slot_out, drop, pred, opts)
        else:
            assert kern(*part, layer_info, ent, grp, ps, acc, bacc, stats, opts) is None
        tick = int(stats[STAT_TICKS])
        prev_batch = batch0 + n_batch - 1
        outs.append((bacc, stats, ent.copy(), grp.copy(), ps.copy(), acc.copy()))
    return outs


def _parts_plan(t, n_cuts, seed):
    """(loads, load indexes where parts are cut, stats a replay starts from (nonzero), budget bytes) for a drawn trace."""
    loads = _loads(t)
    rng = np.random.default_rng(seed)
    cuts = _cuts(loads, n_cuts, rng)
    return loads, cuts, rng.integers(0, 1000, 12).astype(np.int64), t[6] * UNIT


def _same(x, y):
    assert len(x) == len(y)
    for i, (px, py) in enumerate(zip(x, y)):
        for name, u, v in zip(("bacc", "stats", "ent", "grp", "ps", "acc"), px, py):
            assert u.dtype == v.dtype and u.shape == v.shape, (i, name)
            assert u.tobytes() == v.tobytes(), (i, name, u, v)


@needs_aot
@settings(max_examples=200, **FAST)
@given(t=small_traces(), policy=st.sampled_from(["lru", "layer"]), n_cuts=st.integers(0, 6), seed=st.integers(0, 2**32 - 1),
       tick0=st.sampled_from([0, 1, 12345, 2**40]), load_base=st.sampled_from([0, 1000, 2**31 - 3]), empty=st.booleans())
def test_replay_lru_equals_numba_part_by_part(t, policy, n_cuts, seed, tick0, load_base, empty):
    """Every output array and the state after every part, byte for byte, for lru and layer at a
    random budget (0 and overflowing ones included), whole or in parts with carried clocks, and
    stats that start nonzero (the driver adds evictions and overflows to them, sets the rest).
    Also: load numbers past int32 (ent[PIN] is int32: the stored stamp wraps and never equals the
    load again, so a repeat is looked up twice, in both) and empty loads with garbage fields."""
    if not t[5]:
        return
    loads, cuts, stats0, budget = _parts_plan(t, n_cuts, seed)
    es = seed if empty else None
    got = _replay_parts(AOT.replay_lru, False, loads, policy, budget, cuts, tick0, stats0, load_base, es)
    want = _replay_parts(_numba(policy), True, loads, policy, budget, cuts, tick0, stats0, load_base, es)
    _same(got, want)


def _replay_rows_parts(loads, t, policy, budget, cuts, tick0, stats0, load_base):
    """replay_lru_rows on the same parts' rows (cut_loads and replay_lru in one pass): the state after
    each part, with bacc left out (it keeps no per-batch totals)."""
    from replay.cache_kernel import OPT_LOAD0, OPT_TICK0, STAT_TICKS, no_options

    moe_layers, n_layer, n_expert, k, eb, rows, _ = t
    ent, grp, ps, acc, layer_info = _state(loads, policy, budget)
    lidx_of = np.full(n_layer, -1, np.int32)
    lidx_of[moe_layers] = np.arange(len(moe_layers), dtype=np.int32)
    outs, tick = [], tick0
    for a, b in zip(cuts[:-1], cuts[1:]):
        r0, r1 = int(loads.load_start[a]), int(loads.load_start[b])
        part = rows[r0:r1]
        n = len(part)
        stats = stats0.copy()
        opts = no_options()
        opts[OPT_TICK0] = tick
        opts[OPT_LOAD0] = load_base + a
        def col(i, dtype, *shape, part=part, n=n):
            return np.array([r[i] for r in part], dtype).reshape(n, *shape)

        got = AOT.replay_lru_rows(col(1, np.int32), col(2, np.int8), col(4, np.int16), col(5, np.int32, k),
                                  lidx_of, n_expert, layer_info, ent, grp, ps, acc, stats, opts)
        assert got == b - a  # the loads cut_loads cuts
        tick = int(stats[STAT_TICKS])
        outs.append((np.zeros(0), stats, ent.copy(), grp.copy(), ps.copy(), acc.copy()))
    return outs


@needs_aot
@settings(max_examples=200, **FAST)
@given(t=small_traces(), policy=st.sampled_from(["lru", "layer"]), n_cuts=st.integers(0, 6), seed=st.integers(0, 2**32 - 1),
       tick0=st.sampled_from([0, 12345, 2**40]), load_base=st.sampled_from([0, 1000, 2**31 - 3]))
def test_replay_lru_rows_equals_cut_then_replay(t, policy, n_cuts, seed, tick0, load_base):
    """The fused kernel leaves the state, acc and stats byte for byte as cut_loads then replay_lru
    (itself held to Numba above), part by part with carried clocks; bacc apart."""
    if not t[5]:
        return
    loads, cuts, stats0, budget = _parts_plan(t, n_cuts, seed)
    got = _replay_rows_parts(loads, t, policy, budget, cuts, tick0, stats0, load_base)
    want = _replay_parts(AOT.replay_lru, False, loads, policy, budget, cuts, tick0, stats0, load_base)
    _same(got, [(np.zeros(0), *w[1:]) for w in want])


@needs_aot
@pytest.mark.parametrize("bad, needle", [("layer", "MoE layer"), ("expert", "outside 0..n_expert-1"), ("order", "out of order"),
                                         ("phase", "load_phase")])
def test_replay_lru_rows_refuses_rows_cut_loads_refuses(bad, needle):
    from replay.cache_kernel import no_options

    rows = [(0, 0, 1, 0, 0, [1]), (0, 0, 1, 0, 1, [2]), (0, 1, 1, 1, 0, [0]), (0, 1, 1, 1, 1, [3])]
    t = ([0, 1], 3, 4, 1, {0: UNIT, 1: UNIT}, rows, 2)
    loads = _loads(t)
    ent, grp, ps, acc, layer_info = _state(loads, "lru", 2 * UNIT)
    batch, phase = np.array([0, 0, 1, 1], np.int32), np.array([1, 1, 1, 1], np.int8)
    layer, experts = np.array([0, 1, 0, 1], np.int16), np.array([[1], [2], [0], [3]], np.int32)
    if bad == "layer":
        layer[2] = 2  # lidx_of[2] = -1: not a MoE layer
    elif bad == "expert":
        experts[3, 0] = 4
    elif bad == "order":
        batch[3] = 0
    else:
        phase[2] = 2
    lidx_of = np.array([0, 1, -1], np.int32)
    with pytest.raises(ValueError, match=needle):
        AOT.replay_lru_rows(batch, phase, layer, experts, lidx_of, 4, layer_info, ent, grp, ps, acc, np.zeros(12, np.int64),
                            no_options())


@needs_aot
@settings(max_examples=150, **FAST)
@given(t=small_traces(), policy=st.sampled_from(["lru", "layer"]), n_cuts=st.integers(0, 4), seed=st.integers(0, 2**32 - 1))
def test_replay_lru_equals_naive_twin(t, policy, n_cuts, seed):
    """Per (phase, layer) lookups, hits and bytes read, per-batch totals, evictions, overflowed loads
    and the peak resident bytes equal the naive twin's, whether replayed whole or in parts."""
    from tests.naive.cache import naive_replay

    moe_layers, n_layer, n_expert, k, eb, rows, budget_units = t
    if not rows:
        return
    loads = _loads(t)
    cuts = _cuts(loads, n_cuts, np.random.default_rng(seed))
    outs = _replay_parts(AOT.replay_lru, False, loads, policy, budget_units * UNIT, cuts, 0, np.zeros(12, np.int64))
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


@needs_aot
def test_replay_lru_counts_a_known_sequence():
    """One layer of 4 experts, room for 2, top-1 decode: 0 1 0 2 1 0 -> miss miss hit miss miss miss
    (LRU keeps {0, 2} after the fourth, so 1 misses and evicts 0, which then misses)."""
    t = ([0], 1, 4, 1, {0: UNIT}, [(0, b, 1, b, 0, [x]) for b, x in enumerate([0, 1, 0, 2, 1, 0])], 2)
    loads = _loads(t)
    (bacc, stats, ent, grp, ps, acc), = _replay_parts(AOT.replay_lru, False, loads, "lru", 2 * UNIT, [0, 6], 0,
                                                      np.zeros(12, np.int64))
    assert bacc[:, 1].tolist() == [0, 0, 1, 0, 0, 0]
    assert acc[1, 0, :3].tolist() == [6, 1, 5 * UNIT]
    assert (stats[0], stats[1], stats[3], stats[11]) == (3, 0, 6, 2 * UNIT)
    assert ent[0, :4].tolist() == [1, 1, 0, 0]  # resident: 0 and 1
    assert grp[0, 2:4].tolist() == [2 * UNIT, 2]


@needs_aot
def test_replay_lru_from_threads_equals_one_thread():
    """The kernel runs without the GIL: cells replayed on threads give what they give alone."""
    rng = np.random.default_rng(3)
    rows = [(0, b, 1, b, lay, rng.integers(0, 16, 2).tolist()) for b in range(300) for lay in (0, 1, 2)]
    t = ([0, 1, 2], 3, 16, 2, {0: UNIT, 1: 2 * UNIT, 2: UNIT}, rows, 0)
    loads = _loads(t)
    budgets = [u * UNIT for u in (3, 8, 20, 40)]
    alone = [_replay_parts(AOT.replay_lru, False, loads, "lru", b, [0, len(rows)], 0, np.zeros(12, np.int64)) for b in budgets]
    got: dict[int, list] = {}
    threads = [threading.Thread(target=lambda i=i, b=b: got.__setitem__(
        i, _replay_parts(AOT.replay_lru, False, loads, "lru", b, [0, len(rows)], 0, np.zeros(12, np.int64))))
        for i, b in enumerate(budgets)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for i in range(len(budgets)):
        _same(got[i], alone[i])


# -- bad arguments: an exception naming the argument, never a crash ---------------------------------------


def _good_lru_args():
    t = ([0, 1], 2, 4, 2, {0: UNIT, 1: UNIT}, [(0, b, 1, b, lay, [0, 1]) for b in range(3) for lay in (0, 1)], 2)
    loads = _loads(t)
    ent, grp, ps, acc, layer_info = _state(loads, "lru", 2 * UNIT)
    from replay.cache_kernel import no_options

    return [loads.entries, loads.load_start, loads.load_lidx, loads.load_phase, loads.load_batch, layer_info, ent, grp, ps,
            acc, np.zeros((3, 7), np.int64), np.zeros(12, np.int64), no_options()]


LRU_NAMES = ("entries", "load_start", "load_lidx", "load_phase", "load_batch", "layer_info", "ent", "grp", "ps", "acc",
             "bacc", "stats", "opts")


def _bad_variants(a: np.ndarray):
    """(what, bad array) for one good argument: another dtype, not contiguous, another shape, a list."""
    other = np.int64 if a.dtype != np.int64 else np.int32
    yield "dtype", a.astype(other)
    if a.dtype.kind == "i":
        yield "dtype-unsigned", a.view(a.dtype.str.replace("i", "u"))
    wide = np.repeat(a, 2, axis=-1)
    yield "strided", wide[..., ::2]
    yield "ndim", a.reshape(-1)[:, None] if a.ndim == 1 else a.reshape(-1)
    yield "list", a.tolist()
    if a.dtype.itemsize > 1:
        yield "big-endian", a.astype(a.dtype.newbyteorder(">"))


@needs_aot
def test_replay_lru_refuses_bad_arguments():
    args = _good_lru_args()
    AOT.replay_lru(*[a.copy() for a in args])  # the good ones run
    for i, name in enumerate(LRU_NAMES):
        for _what, bad in _bad_variants(args[i]):
            call = [a.copy() for a in args]
            call[i] = bad
            with pytest.raises((TypeError, ValueError), match=name):
                AOT.replay_lru(*call)
    for i, name in [(6, "ent"), (7, "grp"), (8, "ps"), (9, "acc"), (10, "bacc"), (11, "stats")]:
        call = [a.copy() for a in args]
        call[i].flags.writeable = False
        with pytest.raises(ValueError, match=f"{name} must be a C-contiguous, writable"):
            AOT.replay_lru(*call)
    with pytest.raises(TypeError):
        AOT.replay_lru(*args[:-1])
    with pytest.raises(TypeError):
        AOT.replay_lru(*args, args[0])


@needs_aot
def test_arrays_that_share_memory_are_refused():
    """An output sharing memory with another argument would change what the kernel reads as it
    writes (the C kernels take their arrays as restrict): refused, naming both."""
    args = _good_lru_args()
    both = np.zeros(20, np.int64)
    call = [a.copy() for a in args]
    call[11], call[12] = both[:12], both[8:16]
    call[12][:] = args[12]
    with pytest.raises(ValueError, match="stats and opts share memory"):
        AOT.replay_lru(*call)
    call = [a.copy() for a in args]
    call[0] = call[6].reshape(-1)[:args[0].size].reshape(args[0].shape)  # entries: a view of ent, which the replay writes
    with pytest.raises(ValueError, match="entries and ent share memory"):
        AOT.replay_lru(*call)
    R, k = 4, 1
    ins = [np.zeros(R, np.int32), np.zeros(R, np.int32), np.zeros(R, np.int8), np.arange(R, dtype=np.int32),
           np.zeros(R, np.int16), np.zeros((R, k), np.int32), np.array([0], np.int32), 4]
    outs = [np.zeros((R, k), np.int32), np.zeros(R + 1, np.int64)] + [np.zeros(R, dt) for dt in (
        np.int32, np.int8, np.int32, np.int32, np.int32, np.int8, np.int32)]
    outs[5] = outs[4]  # batch_turn is load_batch
    with pytest.raises(ValueError, match="load_batch and batch_turn share memory"):
        AOT.cut_loads(*ins, *outs)
    outs[5] = np.zeros(R, np.int32)
    outs[0] = ins[5]  # entries written over experts
    with pytest.raises(ValueError, match="experts and entries share memory"):
        AOT.cut_loads(*ins, *outs)


@needs_aot
@pytest.mark.parametrize("i, value, needle", [
    (0, 1 << 20, "entries names an entry outside"),
    (0, -1, "entries names an entry outside"),
    (1, 99, "load_start"),
    (2, 7, "load_lidx"),
    (3, 2, "load_phase"),
    (3, -1, "load_phase"),
    (4, 9, "load_batch"),
    (5, 4, "eviction group"),
])
def test_replay_lru_refuses_indexes_out_of_range(i, value, needle):
    """Values used as indexes are checked before use: a bad one raises, it never reads or writes
    out of bounds (valid traces never trip these; prepare_loads and cut_loads refuse them first)."""
    args = _good_lru_args()
    arr = args[i]
    if i == 5:
        arr[0, 0] = value
    elif i == 1:
        arr[1] = value
    else:
        arr.reshape(-1)[0] = value
    with pytest.raises(ValueError, match=needle):
        AOT.replay_lru(*args)


@needs_aot
@pytest.mark.parametrize("corrupt", ["link_out", "cycle"])
def test_replay_lru_refuses_a_corrupt_list(corrupt):
    """A policy state that is not lru's list (a link out of range, a cycle) raises, never loops or
    writes out of bounds. Entries 4 and 5 resident and touched by the load being replayed, nothing
    fits: the victim search walks 4 -> 5 -> ..., into the corruption."""
    args = _good_lru_args()
    ent, grp, ps = args[6], args[7], args[8]
    ent[0, [4, 5]] = 1  # RESIDENT
    ent[7, [4, 5]] = 0  # PIN == the first load's number: not evictable after it
    grp[0, 1], grp[0, 2] = 0, 2 * UNIT  # BUDGET 0, USED: the two entries
    g = ps.shape[0] - 2
    ps[g], ps[g + 1] = 4, 6  # HEAD 4 ... TAIL 6 (the first load's misses are appended after 6)
    ps[2 * 4 + 1], ps[2 * 5 + 0] = 5, 4
    ps[2 * 5 + 1] = 1 << 20 if corrupt == "link_out" else 4
    with pytest.raises(ValueError, match="ps holds a list " + ("link outside" if corrupt == "link_out" else "with a cycle")):
        AOT.replay_lru(*args)


@needs_aot
def test_rows_ok_and_cut_loads_refuse_bad_arguments():
    R, k = 4, 2
    good_rows = [np.zeros(R, np.int32), np.zeros(R, np.int16), np.arange(R, dtype=np.int32), np.zeros(R, np.int8),
                 np.tile(np.arange(k, dtype=np.int32), (R, 1)), np.full((R, k), 0.5, np.float32), np.ones(2, np.bool_), 4,
                 False, False, np.zeros(4, np.int64)]
    names = ("batch", "layer", "step", "phase", "experts", "weights", "moe", None, None, None, "last")
    assert AOT.rows_ok(*good_rows) is True
    for i, name in enumerate(names):
        if name is None:
            continue
        for _what, bad in _bad_variants(good_rows[i]):
            call = list(good_rows)
            call[i] = bad
            with pytest.raises((TypeError, ValueError), match=name):
                AOT.rows_ok(*call)
    call = list(good_rows)
    call[5] = np.full((R, k + 1), 0.5, np.float32)
    with pytest.raises(ValueError, match="weights must have the shape of experts"):
        AOT.rows_ok(*call)
    call[5], call[10] = good_rows[5], np.zeros(3, np.int64)
    with pytest.raises(ValueError, match="last must hold 4"):
        AOT.rows_ok(*call)
    call[10], call[7] = good_rows[10], 4.0
    with pytest.raises(TypeError):
        AOT.rows_ok(*call)

    lidx_of = np.array([0, -1], np.int32)
    ins = [np.zeros(R, np.int32), np.zeros(R, np.int32), np.zeros(R, np.int8), np.arange(R, dtype=np.int32),
           np.zeros(R, np.int16), np.zeros((R, k), np.int32), lidx_of, 4]
    outs = [np.zeros((R, k), np.int32), np.zeros(R + 1, np.int64)] + [np.zeros(R, dt) for dt in (
        np.int32, np.int8, np.int32, np.int32, np.int32, np.int8, np.int32)]
    cut_names = ("turn", "batch", "phase", "step", "layer", "experts", "lidx_of", None, "entries", "load_start", "load_lidx",
                 "load_phase", "load_batch", "batch_turn", "batch_step", "batch_phase", "batch_tokens")
    assert AOT.cut_loads(*ins, *outs) == (0, 1, 1)
    good = ins + outs
    for i, name in enumerate(cut_names):
        if name is None:
            continue
        for _what, bad in _bad_variants(good[i]):
            call = [a.copy() if isinstance(a, np.ndarray) else a for a in good]
            call[i] = bad
            with pytest.raises((TypeError, ValueError), match=name):
                AOT.cut_loads(*call)
    for i in range(8, 17):  # an output with no room for one load (or batch) per row
        call = [a.copy() if isinstance(a, np.ndarray) else a for a in good]
        call[i] = call[i][:-1] if call[i].ndim == 1 else call[i][:-1]
        with pytest.raises(ValueError, match=cut_names[i]):
            AOT.cut_loads(*call)
        call[i] = np.zeros_like(good[i])
        call[i].flags.writeable = False
        with pytest.raises(ValueError, match="writable"):
            AOT.cut_loads(*call)


# -- replay.aot ------------------------------------------------------------------------------------------


@needs_aot
def test_env_turns_it_off(monkeypatch):
    assert aot.AVAILABLE and aot.load() is AOT and aot.why_unavailable() is None
    monkeypatch.setenv("MOE_REPLAY_AOT", "0")
    assert aot.load() is None and not aot.AVAILABLE
    assert "MOE_REPLAY_AOT=0" in aot.why_unavailable()


def test_a_build_older_than_its_source_is_refused(tmp_path):
    src, so = tmp_path / "_aot.c", tmp_path / "_aot.so"
    so.write_text("")
    src.write_text("")
    os.utime(so, (1000, 1000))
    os.utime(src, (2000, 2000))
    assert aot.stale(str(src), str(so))
    os.utime(so, (3000, 3000))
    assert not aot.stale(str(src), str(so))
    assert not aot.stale(str(tmp_path / "absent.c"), str(so))  # a wheel: no source beside the build


@needs_aot
def test_importing_it_needs_no_numba():
    assert loader_import_seconds("replay.aot", ("numba", "numpy")) < 0.05  # about a millisecond; generous for a loaded machine
