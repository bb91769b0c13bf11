"""The what-if paths of the Numba driver (closed-loop drop, top-k cut, prefetch with cap and guard,
retention) agree exactly with the naive twin in tests/naive/whatif.py."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.core.driver import (
    ACC_HITS,
    ACC_LOOKUPS,
    ACC_READ,
    ACC_SKIPPED,
    ACC_SPEC_FILLS,
    ACC_SPEC_HITS,
    ACC_SPEC_READ,
    STAT_OVERFLOW,
    STAT_PEAK_BYTES,
    STAT_SPEC_CAPPED,
    STAT_SPEC_EVICTED_UNUSED,
    STAT_SPEC_FILLS,
    STAT_SPEC_HITS,
    STAT_SPEC_NO_ROOM,
    STAT_SPEC_REFUSED,
    STAT_SPEC_RESIDENT,
    STAT_SPEC_UNUSED_END,
)
from replay.core.simulate import replay
from replay.policies import REGISTRY
from tests.naive.whatif import naive_whatif
from tests.test_cache_twin import UNIT, drawn_loads, traces
from tests.trace_strategies import recorded_traces

REPLAYED = sorted(set(REGISTRY) - {"opt-bound"})  # opt-bound is computed, not replayed: no what-if applies
ACC = {"lookups": ACC_LOOKUPS, "hits": ACC_HITS, "read": ACC_READ, "skipped": ACC_SKIPPED, "spec_hits": ACC_SPEC_HITS,
       "spec_fills": ACC_SPEC_FILLS, "spec_read": ACC_SPEC_READ}
STATS = {"overflow": STAT_OVERFLOW, "peak_bytes": STAT_PEAK_BYTES, "spec_capped": STAT_SPEC_CAPPED,
         "spec_evicted_unused": STAT_SPEC_EVICTED_UNUSED, "spec_fills": STAT_SPEC_FILLS, "spec_hits": STAT_SPEC_HITS,
         "spec_no_room": STAT_SPEC_NO_ROOM, "spec_refused": STAT_SPEC_REFUSED, "spec_resident": STAT_SPEC_RESIDENT,
         "spec_unused_end": STAT_SPEC_UNUSED_END}


def _compare(t, policy, seed, drop=None, preds=None, **opts):
    moe_layers, n_layer, n_expert, k, eb, rows, budget_units = t
    loads = drawn_loads(*t)
    pred_arr = None
    if preds is not None:
        w = max(len(p) for p in preds)
        pred_arr = np.full((len(rows), w), -1, np.int32)
        lidx = {l: i for i, l in enumerate(moe_layers)}
        for r, p in enumerate(preds):
            for j, ex in enumerate(p):
                if ex is not None:
                    pred_arr[r, j] = lidx[rows[r][4]] * n_expert + ex
    drop_arr = None if drop is None else np.array(drop, np.uint8).reshape(len(rows), k)
    res = replay(loads, policy, budget_units / 16, seed=seed, slots=True, drop=drop_arr, pred=pred_arr, fills=True, **opts)
    want = naive_whatif([(r[1], r[2], r[4], r[5]) for r in rows], moe_layers, n_expert, eb, policy, budget_units * UNIT,
                        seed, drop=drop, preds=preds, **opts)
    for name, f in ACC.items():
        for i, layer in enumerate(moe_layers):
            for ph in (0, 1):
                assert res.acc[ph, i, f] == want[name].get((ph, layer), 0), (name, ph, layer)
        for b in range(res.bacc.shape[0]):
            assert res.bacc[b, f] == want["per_batch"].get(b, {}).get(name, 0), (name, b)
    assert res.slots.tolist() == want["codes"]
    if opts.get("fill") and pred_arr is not None:  # which predictions each speculative step read (the timeline's input)
        for g in range(loads.load_start.shape[0] - 1):
            lo, hi = loads.load_start[g], loads.load_start[g + 1]
            got = [(moe_layers[int(e) // n_expert], int(e) % n_expert) for e in pred_arr[lo:hi][res.fills[lo:hi] == 2]]
            assert got == want["filled"].get(g, []), g
    else:
        assert res.fills is None
    assert res.evictions == want["stats"].get("evictions", 0)
    for name, f in STATS.items():
        if name.startswith("spec_") and not opts.get("fill"):
            continue
        assert res.stats[f] == want["stats"].get(name, 0), name
    return res, want


@st.composite
def drops(draw, rows, k):
    return [[draw(st.sampled_from([0, 0, 1, 1, 2])) for _ in range(k)] for _ in rows]


@st.composite
def predictions(draw, rows, n_expert, w):
    ex = st.one_of(st.none(), st.integers(0, n_expert - 1))
    return [[draw(ex) for _ in range(w)] for _ in rows]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), t=traces(), policy=st.sampled_from(REPLAYED), seed=st.integers(0, 1000))
def test_closed_drop_matches_naive_twin(data, t, policy, seed):
    rows, k = t[5], t[3]
    if not rows:
        return
    _compare(t, policy, seed, drop=data.draw(drops(rows, k)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), t=traces(), policy=st.sampled_from(["lru", "lfru"]), ahead=st.integers(1, 3),
       cap=st.one_of(st.none(), st.integers(0, 3)), guard=st.booleans(), retain=st.booleans(),
       fill=st.booleans())
def test_prefetch_and_retention_match_naive_twin(data, t, policy, ahead, cap, guard, retain, fill):
    rows, n_expert = t[5], t[2]
    if not rows:
        return
    w = data.draw(st.integers(1, 4))
    preds = data.draw(predictions(rows, n_expert, w))
    _compare(t, policy, 0, preds=preds, ahead=ahead, cap=cap, guard=guard, retain=retain, fill=fill)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), t=traces(), policy=st.sampled_from(sorted(set(REPLAYED) - {"belady"})), retain=st.booleans())
def test_prefetch_under_every_policy_matches_naive_twin(data, t, policy, retain):
    rows, n_expert = t[5], t[2]
    if not rows:
        return
    preds = data.draw(predictions(rows, n_expert, 2))
    _compare(t, policy, 3, preds=preds, ahead=1, cap=None, guard=True, retain=retain, fill=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(spec=recorded_traces(), policy=st.sampled_from(REPLAYED), frac=st.sampled_from([0.25, 0.5, 1.0, 2.0]),
       phase=st.sampled_from(["decode", "prefill", "all"]), data=st.data())
def test_closed_drop_shares_match_naive_twin(tmp_path_factory, spec, policy, frac, phase, data):
    """closed_drop's two dropped shares (routings with a drop, routed experts dropped) and its
    per-phase hit rates agree exactly with the naive twin's replay."""
    from replay.analyses.drop_cold import closed_drop
    from tests.naive.whatif import naive_closed_drop
    from tests.trace_strategies import write_trace
    from traces import open_trace

    phases = {"decode": (1,), "prefill": (0,), "all": (0, 1)}[phase]
    if not any(r["phase"] in phases for r in spec["rows"]):
        return
    k, n_layer = spec["k"], spec["n_layer"]
    budget_bytes = data.draw(st.integers(1, sum(spec["sizes"]) * spec["n_expert"] + 3))
    tr = open_trace(write_trace(spec, tmp_path_factory.mktemp("closed")))
    got = closed_drop(tr, [frac], budget_mib=budget_bytes / (1 << 20), policy=policy, phase=phase, keep_ks=[]).row(0, named=True)
    want = naive_closed_drop([(r["batch"], r["phase"], r["layer"], r["experts"]) for r in spec["rows"]],
                             [r["weights"] for r in spec["rows"]], list(range(n_layer)), spec["n_expert"],
                             dict(enumerate(spec["sizes"])), policy, budget_bytes, k, frac, phases)
    assert got["routings"] == want["routings"]
    assert got["routings_dropped_pct"] == want["routings_dropped"] / want["routings"] * 100
    assert got["experts_dropped_pct"] == want["experts_dropped"] / want["experts_routed"] * 100
    assert got["slots_dropped"] == want["experts_dropped"]
    for name in ("", "_baseline"):
        for key, ph in (("decode", (1,)), ("prefill", (0,)), ("cum", (0, 1))):
            lk = sum(want[f"lookups_{p}{name}"] for p in ph)
            ht = sum(want[f"hits_{p}{name}"] for p in ph)
            assert got[f"hit_pct_{key}{name}"] == (100.0 * float(ht) / float(lk) if lk else None), (key, name)
    assert "hit_pct" not in got and "hit_pct_baseline" not in got  # docs/design.md's phase keys only
