"""The timeline (replay.analyses.timeline): the Numba kernel equals the event-by-event twin in
tests/naive/timeline.py exactly, on random traces, predictions and device profiles."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.analyses.timeline import Profile, kernel_params, time_replay
from replay.core.simulate import prepare_loads, replay
from tests.naive.timeline import naive_timeline
from tests.test_cache_twin import _arrays, traces
from tests.test_whatif_twin import predictions

STATUS = {0: "wasted", 1: "useful", 2: "late", 3: "untimed"}


@st.composite
def profiles(draw):
    return Profile(lanes=draw(st.integers(1, 4)), lane_mib_s=draw(st.sampled_from([0.5, 3.0, 100.0, 1000.0])),
                   read_latency_ms=draw(st.sampled_from([0.0, 0.05, 1.0])),
                   compute_ms_per_layer=draw(st.sampled_from([0.0, 0.3, 2.5])), overlap=draw(st.booleans()),
                   expert_share=draw(st.sampled_from([0.0, 0.4, 1.0])),
                   token_overhead_ms=draw(st.sampled_from([0.0, 1.5])), serial_ms_per_mib=draw(st.sampled_from([0.0, 0.7])))


def _naive_loads(loads, res, pred):
    out = []
    for g in range(loads.load_start.shape[0] - 1):
        lo, hi = int(loads.load_start[g]), int(loads.load_start[g + 1])
        rows = []
        for r in range(lo, hi):
            slots = [(int(e), int(c)) for e, c in zip(loads.entries[r], res.slots[r], strict=True)]
            preds = [] if res.fills is None else [(int(e), int(c)) for e, c in zip(pred[r], res.fills[r], strict=True)]
            rows.append((slots, preds))
        b = int(loads.load_batch[g])
        out.append({"batch": b, "phase": int(loads.batch_phase[b]), "pos": int(loads.load_lidx[g]), "rows": rows})
    return out


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), t=traces(), prof=profiles(), policy=st.sampled_from(["lru", "lfru"]), ahead=st.integers(1, 3),
       fill=st.booleans(), layer_issue=st.booleans())
def test_timeline_matches_event_by_event_twin(data, t, prof, policy, ahead, fill, layer_issue):
    moe_layers, n_layer, n_expert, k, eb, rows, budget_units = t
    if not rows:
        return
    expert_bytes = np.zeros(n_layer, np.int64)
    for layer, b in eb.items():
        expert_bytes[layer] = b
    loads = prepare_loads(_arrays(rows, k), moe_layers, n_expert, expert_bytes)
    pred = None
    if fill:
        preds = data.draw(predictions(rows, n_expert, data.draw(st.integers(1, 3))))
        lidx = {layer: i for i, layer in enumerate(moe_layers)}
        pred = np.full((len(rows), len(preds[0])), -1, np.int32)
        for r, p in enumerate(preds):
            for j, ex in enumerate(p):
                if ex is not None:
                    pred[r, j] = lidx[rows[r][4]] * n_expert + ex
        res = replay(loads, policy, budget_units / 16, slots=True, pred=pred, ahead=ahead, fill=True, fills=True)
    else:
        res = replay(loads, policy, budget_units / 16, slots=True)
    issue = ahead if layer_issue else 0
    got = time_replay(loads, res, prof, pred, issue)
    want = naive_timeline(_naive_loads(loads, res, pred), [int(x) for x in loads.layer_expert_bytes],
                          [float(x) for x in kernel_params(prof)], issue, prof.lanes, prof.overlap)
    assert got.tok.tolist() == want["tok"]
    assert [STATUS[int(s)] for s in got.fill_status] == [f["status"] for f in want["fills"]]
    assert got.fill_bytes.tolist() == [f["bytes"] for f in want["fills"]]
    assert all(_same(a, f["lead"]) for a, f in zip(got.fill_lead_ms.tolist(), want["fills"], strict=True))
    assert got.read_ms_total == want["read_ms_total"]
