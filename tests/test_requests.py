"""Many requests in one batch: everything "previous" is per request (prev-token against its naive
twin on multi-request traces), tokens are counted per request, the reader validates the request
and token columns, and info shows requests and batch sizes."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.analyses.accuracy import evaluate
from replay.analyses.info import info_rows
from replay.core.simulate import loads_of
from tests.helpers import assert_one_sentence_error, run_cli
from tests.naive.predict import naive_evaluate
from tests.trace_strategies import recorded_traces, write_trace
from traces import TraceError, TraceWriter, open_trace
from traces.format.schema import default_gating

NAMES = ["prev-token", "static-hot", "static-hot-prompt"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(spec=recorded_traces(max_requests=4), phase=st.sampled_from(["decode", "prefill", "all"]))
def test_prev_token_per_request_matches_naive_twin(tmp_path_factory, spec, phase):
    path = write_trace(spec, tmp_path_factory.mktemp("req"))
    tr = open_trace(path)
    # in-sample: every routing of the phase scored (the held-out split is tested in test_predict_learned.py)
    got = evaluate(tr, NAMES, phase=phase, train="in-sample").frame.to_dicts()
    want = naive_evaluate(path, NAMES, phase=phase, train="in-sample")
    assert [{c: g[c] for c in w} for g, w in zip(got, want)] == want
    # Scored per request: each (request, layer)'s first token of the phase is the only unscored one.
    codes = {"decode": (1,), "prefill": (0,), "all": (0, 1)}[phase]
    rows = [r for r in spec["rows"] if r["phase"] in codes]
    firsts = {(r.get("request", 0), r["layer"]) for r in rows}
    overall = next(r for r in got if r["predictor"] == "prev-token" and r["layer"] is None)
    assert overall["unscored"] == len(firsts) and overall["scored"] == len(rows) - len(firsts)
    # Tokens: distinct (request, step), whatever the batch holds.
    want_dec = len({(r.get("request", 0), r["step"]) for r in spec["rows"] if r["phase"] == 1})
    assert tr.token_counts()["tokens_decode"] == want_dec
    assert loads_of(tr).decode_tokens == want_dec


def _meta(L=1, E=8, k=1):
    return {
        "model": {"name": "r", "arch": "test", "n_layer": L, "moe_layers": list(range(L)), "n_expert": E,
                  "top_k": k, "top_k_native": k, "n_embd": None},
        "expert_bytes": [1000] * L, "dense_bytes": [None] * L,
        "gating": default_gating("softmax", True), "provenance": {"engine": "test"},
    }


def _write(path, rows, columns=("request",), check=True):
    """rows: (batch, phase, step, request[, token], expert) at layer 0, top-1."""
    w = TraceWriter(path, _meta(), columns=columns)
    for r in rows:
        opt = {"request": [r[3]]}
        if "token" in columns:
            opt["token"] = [r[4]]
        w.append(turn=0, batch=r[0], phase=r[1], step=r[2], layer=0, experts=[[r[-1]]], weights=[[1.0]], **opt)
    w.close()
    return path


def test_prev_token_is_the_previous_token_of_the_same_request(tmp_path):
    # Two requests decode together; request 5 always routes expert 0, request 9 always expert 1.
    # Per request the previous token predicts perfectly; the previous row of the file (the other
    # request's token at the same step) never does.
    rows = [(0, 0, 0, 5, 0), (0, 0, 0, 9, 1)]
    for b in range(1, 6):
        rows += [(b, 1, b, 5, 0), (b, 1, b, 9, 1)]
    tr = open_trace(_write(tmp_path / "t", rows))
    row = evaluate(tr, ["prev-token"]).frame.filter(pl.col("layer").is_null()).row(0, named=True)
    assert row["scored"] == 8 and row["unscored"] == 2  # the first decoded token of each request
    assert row["slot_acc_pct"] == 100.0
    info = info_rows(tr)[0]
    assert info["has_request"] and not info["has_token"] and info["requests"] == 2
    assert (info["batches_decode"], info["decode_batch_tokens_min"], info["decode_batch_tokens_max"]) == (5, 2, 2)
    assert info["tokens_decode"] == 10 and info["tokens_prefill"] == 2
    res = run_cli("info", tmp_path / "t")
    assert res.code == 0 and "decode 5 batches of 2 tokens; prefill 1 batch of 2 tokens" in res.out
    assert "of 2 requests" in res.out


def test_info_batch_sizes_without_requests(tmp_path):
    rows = [(0, 0, 0, 0, 3), (0, 0, 1, 0, 3), (0, 0, 2, 0, 3), (1, 1, 3, 0, 2), (2, 1, 4, 0, 2)]
    w = TraceWriter(tmp_path / "t", _meta())
    for b, ph, s, _, e in rows:
        w.append(turn=0, batch=b, phase=ph, step=s, layer=0, experts=[[e]], weights=[[1.0]])
    w.close()
    info = info_rows(open_trace(tmp_path / "t"))[0]
    assert not info["has_request"] and info["requests"] == 1
    assert (info["decode_batch_tokens_min"], info["decode_batch_tokens_median"], info["decode_batch_tokens_max"]) == (1, 1.0, 1)
    assert (info["batches_prefill"], info["prefill_batch_tokens_max"]) == (1, 3)


@pytest.mark.parametrize("rows, columns, needle", [
    # request 4's step 2 comes after its step 3 (two batches apart): its tokens are out of order
    ([(0, 1, 3, 4, 0), (1, 1, 2, 4, 0)], ("request",), "request 4, layer 0) has step 2, not after that request's previous token"),
    ([(0, 1, -1, 4, 0)], ("request",), "step is the position inside its request"),
    ([(0, 1, 0, 4, -3, 0)], ("request", "token"), "token id -3, which is negative"),
    # inside one load, request 9 before request 4: not (batch, layer, request, step) order
    ([(0, 1, 0, 9, 0), (0, 1, 0, 4, 0)], ("request",), "breaks the (batch, layer, request, step) row order"),
])
def test_reader_refuses_bad_request_rows(tmp_path, rows, columns, needle):
    path = tmp_path / "t"
    # Write the rows bypassing the writer's order check (the reader must catch what a foreign writer does).
    w = TraceWriter(path, _meta(), columns=columns)
    w._check_order = lambda *a, **k: None  # type: ignore[method-assign]
    if "token" in columns:
        w._scalar_column = lambda name, v: np.asarray(v).astype(np.int32 if name == "token" else np.int64)  # type: ignore[method-assign]
    for r in rows:
        opt = {"request": [r[3]]}
        if "token" in columns:
            opt["token"] = [r[4]]
        w.append(turn=0, batch=r[0], phase=r[1], step=r[2], layer=0, experts=[[r[-1]]], weights=[[1.0]], **opt)
    w.close()
    with pytest.raises(TraceError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        open_trace(path)
    assert_one_sentence_error(run_cli("info", path), needle)


def test_writer_refuses_request_rows_out_of_order(tmp_path):
    w = TraceWriter(tmp_path / "t", _meta(), columns=("request",))
    w.append(turn=0, batch=0, phase=1, step=5, layer=0, experts=[[0]], weights=[[1.0]], request=[9])
    with pytest.raises(ValueError, match=r"\(batch, layer, request, step\) order"):
        w.append(turn=0, batch=0, phase=1, step=7, layer=0, experts=[[0]], weights=[[1.0]], request=[4])
    # Same step, another request, same load: fine (steps repeat across requests).
    w.append(turn=0, batch=0, phase=1, step=5, layer=0, experts=[[0]], weights=[[1.0]], request=[10])


def test_traces_without_request_columns_still_read(tmp_path):
    spec = {"n_layer": 1, "n_expert": 2, "k": 1, "sizes": [10], "rows": [
        {"turn": 0, "batch": b, "phase": 1, "step": b, "layer": 0, "experts": [b % 2], "weights": [1.0],
         "residency": [0], "read_bytes": [10]} for b in range(3)]}
    tr = open_trace(write_trace(spec, tmp_path))
    a = tr.arrays()
    assert a.request is None and a.token is None and (a.request_or_zero == 0).all()


def test_writer_refuses_a_negative_token_id(tmp_path):
    from traces import UserError

    w = TraceWriter(tmp_path / "t", _meta(), columns=("token",))
    with pytest.raises(UserError, match="token id -1, outside 0..2"):
        w.append(turn=0, batch=0, phase=1, step=0, layer=0, experts=[[0]], weights=[[1.0]], token=[-1])
    w.append(turn=0, batch=0, phase=1, step=0, layer=0, experts=[[0]], weights=[[1.0]], token=[7])
    w.close()
    tr = open_trace(tmp_path / "t")
    assert tr.arrays().token.tolist() == [7] and tr.arrays().request is None
