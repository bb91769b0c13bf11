"""traces.synth.schedule: per-request routing logs batched by a stated schedule (hand-built cases, bad
options, and a hypothesis property over random request sets), and the writer/reader round trip of
the result (request and token columns)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from traces import TraceWriter, UserError, open_trace
from traces.format.schema import default_gating
from traces.synth.schedule import RequestRoutes, schedule


def req(rid, prompt, gen, L=2, k=1, routed=None, tokens=True, base=0):
    """A request whose expert at (position p, layer l) is base + p (mod 64), distinct per slot."""
    P = prompt + gen
    ex = np.zeros((P, L, k), np.int32)
    for p in range(P):
        for s in range(k):
            ex[p, :, s] = (base + p * k + s) % 64
    return RequestRoutes(rid, prompt, ex, routed=None if routed is None else np.asarray(routed, bool),
                         token_ids=(np.arange(P) + 1000 * (rid % 1000)).astype(np.int32) if tokens else None)


def one_layer(out, layer=0):
    sel = out["layer"] == layer
    return list(zip(out["batch"][sel].tolist(), out["request"][sel].tolist(), out["step"][sel].tolist(), out["phase"][sel].tolist()))


def test_sequential_hand_built():
    out = schedule([req(5, 3, 2), req(2, 1, 2)], mode="sequential")
    assert one_layer(out) == [
        (0, 5, 0, 0), (0, 5, 1, 0), (0, 5, 2, 0),  # request 5's prompt: one batch
        (1, 5, 3, 1), (2, 5, 4, 1),  # then one token per batch
        (3, 2, 0, 0), (4, 2, 1, 1), (5, 2, 2, 1),  # then request 2 (file order, not id order)
    ]
    assert one_layer(out, 1) == one_layer(out)
    # Rows in (batch, layer, request, step) order; every column has one value per row.
    R = out["batch"].size
    assert R == 2 * 8 and all(v.shape[0] == R for v in out.values())
    key = list(zip(out["batch"], out["layer"], out["request"], out["step"]))
    assert key == sorted(key)
    assert out["token"][(out["request"] == 2) & (out["layer"] == 0)].tolist() == [2000, 2001, 2002]
    assert out["experts"][(out["request"] == 5) & (out["layer"] == 1), 0].tolist() == [0, 1, 2, 3, 4]
    assert np.isnan(out["weights"]).all()  # no weights given: NaN, never 0
    assert out["turn"].tolist() == [0] * R
    assert out["batch"].dtype == np.int32 and out["layer"].dtype == np.int16 and out["request"].dtype == np.int64


def test_sequential_is_continuous_at_batch_one():
    rs = [req(i, p, g) for i, (p, g) in enumerate([(3, 2), (0, 3), (2, 0), (1, 1)])]
    a = schedule(rs, mode="sequential")
    b = schedule(rs, mode="continuous", max_batch=1)
    assert a.keys() == b.keys() and all(np.array_equal(a[c], b[c], equal_nan=True) for c in a)


def test_continuous_hand_built():
    # Three requests, two may run together; prompts chunked at 3 positions per prefill batch.
    rs = [req(10, 4, 2), req(11, 2, 3), req(12, 1, 1)]
    out = schedule(rs, mode="continuous", max_batch=2, prefill_chunk=3)
    assert one_layer(out) == [
        (0, 10, 0, 0), (0, 10, 1, 0), (0, 10, 2, 0),  # 10's prompt does not fit: part-way, the batch closes
        (1, 10, 3, 0), (1, 11, 0, 0), (1, 11, 1, 0),  # its last position, then 11 admitted (2 of 2)
        (2, 10, 4, 1), (2, 11, 2, 1),  # decode: both
        (3, 10, 5, 1), (3, 11, 3, 1),  # 10 finishes here and leaves
        (4, 12, 0, 0),  # a slot is free: 12's prompt runs before decode resumes (prefill first)
        (5, 11, 4, 1), (5, 12, 1, 1),
    ]


def test_continuous_unbounded_prefill_admits_up_to_max_batch():
    rs = [req(i, 2, 1) for i in range(5)]
    out = schedule(rs, mode="continuous", max_batch=3)
    rows = one_layer(out)
    assert [r for r in rows if r[0] == 0] == [(0, i, s, 0) for i in range(3) for s in range(2)]
    assert [r for r in rows if r[0] == 1] == [(1, i, 2, 1) for i in range(3)]
    assert [r for r in rows if r[0] == 2] == [(2, i, s, 0) for i in (3, 4) for s in range(2)]


def test_unrouted_positions_keep_their_step_and_take_no_prefill_budget():
    # Request 1: positions 0-2 of its prompt came from the prefix cache; position 5 (generated)
    # was not routed either. Request 2 shares the prefill batch because the cached positions
    # took no budget.
    r1 = req(1, 4, 3, routed=[False, False, False, True, True, False, True])
    r2 = req(2, 2, 1)
    out = schedule([r1, r2], mode="continuous", max_batch=2, prefill_chunk=3)
    assert one_layer(out) == [
        (0, 1, 3, 0), (0, 2, 0, 0), (0, 2, 1, 0),
        (1, 1, 4, 1), (1, 2, 2, 1),
        (2, 1, 6, 1),  # position 5 took its decode step (a batch with no rows, not numbered) and has no rows
    ]
    assert 5 not in out["step"][out["request"] == 1].tolist()


def test_weights_logits_and_layer_ids():
    P, L, k, E = 3, 2, 2, 6
    ex = np.array([[[0, 1], [2, 3]], [[4, 5], [0, 2]], [[1, 3], [5, 4]]], np.int32)
    w = np.full((P, L, k), 0.5, np.float32)
    lg = np.arange(P * L * E, dtype=np.float32).reshape(P, L, E)
    out = schedule([RequestRoutes(0, 1, ex, weights=w, logits=lg)], mode="sequential", moe_layers=[3, 7])
    assert out["layer"].tolist() == [3, 7, 3, 7, 3, 7]
    assert out["experts"].tolist() == [[0, 1], [2, 3], [4, 5], [0, 2], [1, 3], [5, 4]]
    assert (out["weights"] == 0.5).all()
    assert np.array_equal(out["logits"], lg.reshape(P * L, E))
    assert "token" not in out


@pytest.mark.parametrize("kw, needle", [
    ({"mode": "continuous", "max_batch": 0}, "max_batch 0 must be an integer >= 1"),
    ({"mode": "continuous", "max_batch": 2, "prefill_chunk": 0}, "prefill_chunk 0"),
    ({"mode": "continuous", "max_batch": 2.5}, "max_batch 2.5"),
    ({"mode": "round-robin"}, "'round-robin' is not one of sequential, continuous"),
    ({"mode": "sequential", "max_batch": 4}, "max_batch 4: the sequential schedule runs one request at a time"),
])
def test_bad_options(kw, needle):
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)")) as e:
        schedule([req(0, 1, 1)], **kw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("requests, needle", [
    ([], "no requests"),
    ([req(1, 1, 1), req(1, 2, 1)], "request id 1 appears twice"),
    ([req(1, 1, 1, L=2), req(2, 1, 1, L=3)], "routes 3 MoE layers"),
    ([RequestRoutes(1, 5, np.zeros((3, 1, 1), np.int32))], "prompt_len 5"),
    ([RequestRoutes(1, 1, np.full((3, 1, 1), -1, np.int32))], "negative expert id"),
    ([RequestRoutes(1, 1, np.zeros((3, 1), np.int32))], "not an integer array"),
    ([RequestRoutes(1, 1, np.zeros((3, 1, 1), np.int32), routed=np.ones(2, bool))], "routed mask"),
    ([req(1, 1, 1), req(2, 1, 1, tokens=False)], "request 2 has no token ids"),
    ([RequestRoutes(1, 1, np.zeros((3, 1, 2), np.int32), weights=np.zeros((3, 1, 1)))], "weights have shape"),
])
def test_bad_requests(requests, needle):
    with pytest.raises(UserError, match=needle) as e:
        schedule(requests, mode="sequential")
    assert "\n" not in str(e.value)


@st.composite
def request_sets(draw):
    n = draw(st.integers(1, 6))
    L = draw(st.integers(1, 3))
    out = []
    ids = draw(st.lists(st.integers(-(1 << 62), 1 << 62), min_size=n, max_size=n, unique=True))
    for rid in ids:
        prompt = draw(st.integers(0, 5))
        gen = draw(st.integers(0, 4))
        routed = draw(st.lists(st.booleans(), min_size=prompt + gen, max_size=prompt + gen)) if draw(st.booleans()) else None
        out.append(req(rid, prompt, gen, L=L, routed=routed, base=draw(st.integers(0, 63))))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rs=request_sets(), max_batch=st.integers(1, 4), chunk=st.one_of(st.none(), st.integers(1, 4)))
def test_schedule_properties(rs, max_batch, chunk):
    out = schedule(rs, mode="continuous", max_batch=max_batch, prefill_chunk=chunk)
    L = rs[0].experts.shape[1]
    # Every routed position appears exactly once at every layer; unrouted ones never.
    want = sorted((int(r.request), p, l) for r in rs for p in range(r.experts.shape[0]) for l in range(L)
                  if r.routed is None or r.routed[p])
    got = sorted(zip(out["request"].tolist(), out["step"].tolist(), out["layer"].tolist()))
    assert got == want
    # Rows in (batch, layer, request, step) order; batches numbered densely from 0.
    key = list(zip(out["batch"].tolist(), out["layer"].tolist(), out["request"].tolist(), out["step"].tolist()))
    assert key == sorted(key)
    if key:
        assert sorted(set(out["batch"].tolist())) == list(range(out["batch"].max() + 1))
    by_id = {int(r.request): r for r in rs}
    first_batch = {}
    l0 = out["layer"] == 0
    for b, rid, s, ph in zip(out["batch"][l0].tolist(), out["request"][l0].tolist(), out["step"][l0].tolist(),
                             out["phase"][l0].tolist()):
        r = by_id[rid]
        assert ph == (0 if s < r.prompt_len else 1)
        # Per-request order: positions in order; a generated position in a later batch than the one before.
        prev = first_batch.get(rid)
        if prev is not None:
            assert (b, s) > prev and (b > prev[0] or ph == 0)
        first_batch[rid] = (b, s)
    src = np.array([by_id[r].experts[s, l, 0] for r, s, l in zip(out["request"], out["step"], out["layer"])], np.int32)
    assert np.array_equal(out["experts"][:, 0], src.reshape(-1))
    tok = np.array([by_id[r].token_ids[s] for r, s in zip(out["request"], out["step"])], np.int32)
    assert np.array_equal(out["token"], tok)
    # Batches: one phase each; a decode batch holds <= max_batch tokens (one per request); a
    # prefill batch <= prefill_chunk tokens and <= max_batch requests.
    for b in np.unique(out["batch"][l0]):
        sel = l0 & (out["batch"] == b)
        phases = set(out["phase"][sel].tolist())
        assert len(phases) == 1
        assert len(set(out["request"][sel].tolist())) <= max_batch
        if phases == {1}:
            assert sel.sum() <= max_batch
        elif chunk is not None:
            assert sel.sum() <= chunk
    if max_batch == 1 and chunk is None:
        seq = schedule(rs, mode="sequential")
        assert all(np.array_equal(seq[c], out[c], equal_nan=True) for c in out)


def _meta(L=2, E=64, k=1):
    return {
        "model": {"name": "s", "arch": "test", "n_layer": L, "moe_layers": list(range(L)), "n_expert": E,
                  "top_k": k, "top_k_native": k, "n_embd": None},
        "expert_bytes": [1000] * L, "dense_bytes": [None] * L,
        "gating": default_gating("softmax", True), "provenance": {"engine": "test"},
    }


def test_scheduled_rows_write_and_read_back(tmp_path):
    rs = [req(7, 3, 4), req(3, 2, 5), req(9, 0, 3)]
    out = schedule(rs, mode="continuous", max_batch=2, prefill_chunk=2)
    w = TraceWriter(tmp_path / "t", _meta(), columns=("request", "token"), tokens_per_part=2)
    R = out["batch"].size
    for a in range(0, R, 5):  # appended in slices: the order check spans appends
        w.append(**{c: v[a:a + 5] for c, v in out.items()})
    w.close()
    t = open_trace(tmp_path / "t")
    assert t.has("request") and t.has("token") and len(t.parts) > 1
    arr = t.arrays()
    assert np.array_equal(arr.request, out["request"]) and np.array_equal(arr.token, out["token"])
    assert np.array_equal(arr.step, out["step"]) and np.array_equal(arr.batch, out["batch"])
    assert t.token_counts() == {"tokens_prefill": 5, "tokens_decode": 12}
