"""``moe-replay schedule``: re-batch a multi-request trace by a schedule; the same routings, new
batches; bad input refused in one sentence with nothing written."""

from __future__ import annotations

import json

import pytest

import replay
from tests.helpers import assert_one_sentence_error, run_cli
from traces import TraceWriter, open_trace
from traces.format.schema import default_gating

SHAPE = dict(layers=3, experts=16, top_k=2, embd=8, tokens=5, prompt_tokens=4, requests=5, seed=2)
ALL = ["turn", "batch", "phase", "step", "layer", "experts", "weights", "request", "logits", "gate_input"]


@pytest.fixture(scope="module")
def synths(tmp_path_factory):
    root = tmp_path_factory.mktemp("sched")
    return root, {b: replay.synth(root / f"b{b}", max_batch=b, **SHAPE).path for b in (1, 3)}


def test_rebatch_equals_scheduling_the_requests_directly(synths, tmp_path):
    root, src = synths
    # Batch-1 log re-batched at --max-batch 3 == the requests generated and batched at 3 (every
    # column, gate inputs and logits included); and back to sequential == the batch-1 log.
    res = run_cli("schedule", src[1], tmp_path / "c3", "--schedule", "continuous", "--max-batch", "3")
    assert res.code == 0, res.err
    assert "5 requests re-batched (continuous, --max-batch 3)" in res.out
    assert open_trace(tmp_path / "c3").table(ALL).equals(open_trace(src[3]).table(ALL))
    res = run_cli("schedule", src[3], tmp_path / "s", "--schedule", "sequential", "--json")
    assert res.code == 0, res.err
    row = res.json()["rows"][0]
    assert row["decode_batch_tokens_max"] == 1 and row["requests"] == 5 and row["dropped_columns"] == []
    assert open_trace(tmp_path / "s").table(ALL).equals(open_trace(src[1]).table(ALL))
    meta = json.loads((tmp_path / "s" / "trace.json").read_text())
    assert meta["provenance"]["rebatched"]["schedule"] == "sequential"
    assert (tmp_path / "s" / "router.parquet").read_bytes() == (src[3] / "router.parquet").read_bytes()
    # Deterministic: the same command twice writes the same bytes.
    run_cli("schedule", src[3], tmp_path / "s2", "--schedule", "sequential")
    for f in sorted(p.relative_to(tmp_path / "s") for p in (tmp_path / "s").rglob("*") if p.is_file()):
        if f.name != "trace.json":
            assert (tmp_path / "s" / f).read_bytes() == (tmp_path / "s2" / f).read_bytes()


def _meta(L=2):
    return {"model": {"name": "m", "arch": "test", "n_layer": L, "moe_layers": list(range(L)), "n_expert": 4, "top_k": 1,
                      "top_k_native": 1, "n_embd": None},
            "expert_bytes": [100] * L, "dense_bytes": [None] * L, "gating": default_gating("softmax", True),
            "provenance": {"engine": "test"}}


def test_unrouted_positions_and_recorded_columns(tmp_path):
    # Request 7's steps 0-1 were served from a prefix cache (absent from the trace): they keep
    # their positions, and its prompt (step 2) is its only prefill work.
    w = TraceWriter(tmp_path / "t", _meta(), columns=("residency", "request", "token"))
    rows = [(0, 0, 2, 7), (0, 0, 0, 3), (1, 1, 3, 7), (1, 1, 1, 3), (2, 1, 4, 7)]  # (batch, phase, step, request)
    for b in sorted({r[0] for r in rows}):
        for l in range(2):
            for bb, ph, s, r in sorted((x for x in rows if x[0] == b), key=lambda x: (x[3], x[2])):
                w.append(turn=0, batch=bb, phase=ph, step=s, layer=l, experts=[[s % 4]], weights=[[1.0]],
                         residency=[[0]], request=[r], token=[100 + s])
    w.close()
    res = run_cli("schedule", tmp_path / "t", tmp_path / "o", "--schedule", "sequential")
    assert res.code == 0, res.err
    assert "left out (they describe the original run): residency" in res.out
    tr = open_trace(tmp_path / "o")
    assert not tr.has("residency") and tr.has("token")
    df = tr.routings(["batch", "request", "step", "layer", "token"]).filter(layer=0)
    # Admission order = order of each request's first row in the file: rows of a load are
    # (request, step) ordered, so request 3 comes first and runs first.
    assert df["request"].to_list() == [3, 3, 7, 7, 7]
    assert df["step"].to_list() == [0, 1, 2, 3, 4]
    assert df["batch"].to_list() == [0, 1, 2, 3, 4]
    assert df["token"].to_list() == [100, 101, 102, 103, 104]


def test_bad_input_one_sentence_nothing_written(synths, tmp_path):
    root, src = synths
    out = tmp_path / "o"
    cases = [
        (("schedule", src[1], out, "--schedule", "round-robin"), "--schedule 'round-robin' is not one of"),
        (("schedule", src[1], out, "--schedule", "continuous", "--max-batch", "0"), "--max-batch 0 must be an integer >= 1"),
        (("schedule", src[1], out, "--schedule", "sequential", "--max-batch", "8"), "--max-batch 8: the sequential schedule"),
        (("schedule", src[1], out, "--schedule", "continuous", "--prefill-chunk", "0"), "--prefill-chunk 0"),
        (("schedule", src[1], src[3], "--schedule", "sequential"), "exists"),
    ]
    plain = replay.synth(tmp_path / "plain", layers=2, experts=4, top_k=1, embd=4, tokens=3, prompt_tokens=1).path
    cases.append((("schedule", plain, out, "--schedule", "sequential"), "has no request column"))
    for args, needle in cases:
        assert_one_sentence_error(run_cli(*args), needle)
        assert not out.exists()
    # A request routed at some MoE layers but not others cannot be re-batched.
    w = TraceWriter(tmp_path / "half", _meta(), columns=("request",))
    w.append(turn=0, batch=0, phase=0, step=0, layer=0, experts=[[1]], weights=[[1.0]], request=[1])
    w.append(turn=0, batch=0, phase=0, step=0, layer=1, experts=[[1]], weights=[[1.0]], request=[1])
    w.append(turn=0, batch=1, phase=1, step=1, layer=0, experts=[[1]], weights=[[1.0]], request=[1])
    w.close()
    assert_one_sentence_error(run_cli("schedule", tmp_path / "half", out, "--schedule", "sequential"),
                              "request 1 step 1 is routed at some MoE layers and not at others")
    assert not out.exists()


def test_synth_request_options(tmp_path):
    # The batching options need --requests; the one-request trace records none of them (its
    # trace.json is byte-identical to the one written before they existed).
    assert_one_sentence_error(run_cli("synth", tmp_path / "x", "--max-batch", "4"), "give --requests N too")
    assert_one_sentence_error(run_cli("synth", tmp_path / "x", "--requests", "0"), "--requests 0")
    assert not (tmp_path / "x").exists()
    one = replay.synth(tmp_path / "one", layers=2, experts=4, top_k=1, embd=4, tokens=2, prompt_tokens=1)
    assert set(one.meta["provenance"]["synth"]) & {"requests", "max_batch", "prefill_chunk"} == set()
    assert not one.has("request")
    many = replay.synth(tmp_path / "many", layers=2, experts=4, top_k=1, embd=4, tokens=2, prompt_tokens=1,
                        requests=3, max_batch=2)
    assert many.meta["provenance"]["synth"]["requests"] == 3 and many.has("request")
    # Requests differ from one another (each its own seeded stream).
    r = many.routings(["request", "step", "layer", "experts"])
    per = {i: r.filter(request=i).sort("step", "layer")["experts"].to_list() for i in range(3)}
    assert per[0] != per[1] or per[1] != per[2]
