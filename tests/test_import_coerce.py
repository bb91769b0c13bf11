"""Importers that coerced (issue 29 item 7): a fractional, negative or out-of-range id or count is
refused with the row (line, position) and the field named, never rounded, clipped or taken for
something the engine writes; the step rules the docs state hold for one-request traces too.

Every log is written as its engine writes it (tests/server_logs.py), then edited by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers import assert_one_sentence_error, run_cli
from tests.server_logs import random_vreqs, sglang_response, vllm_completion, write_megatron
from traces import TraceError, TraceWriter, open_trace
from traces.format.schema import default_gating


def _megatron(tmp_path, edit):
    rng = np.random.default_rng(0)
    steps = [{lay: np.stack([rng.choice(8, 2, replace=False) for _ in range(n)]) for lay in (0, 1)} for n in (3, 1, 1)]
    jl = write_megatron(tmp_path / "mg", steps)
    recs = [json.loads(x) for x in jl.read_text().splitlines()]
    edit(recs)
    jl.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return jl


@pytest.mark.parametrize("value, needles", [
    (1.5, ("line 1", "top_indices holds 1.5", "not an integer expert id")),
    (True, ("line 1", "top_indices holds True",)),
    (-2, ("line 1", "top_indices[0][1] is -2", "negative")),
    ("3", ("line 1", "top_indices holds '3'")),
])
def test_megatron_top_indices_never_cast(tmp_path, value, needles):
    jl = _megatron(tmp_path, lambda rs: rs[0]["top_indices"][0].__setitem__(1, value))
    res = run_cli("import", "megatron", jl, tmp_path / "t", "--expert-bytes", "1000")
    assert_one_sentence_error(res, *needles)
    assert not (tmp_path / "t").exists()


def test_megatron_out_of_range_named_by_line(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2, "num_experts": 8, "moe_intermediate_size": 32,
                               "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 4}))
    jl = _megatron(tmp_path, lambda rs: rs[3]["top_indices"][0].__setitem__(0, 9))
    res = run_cli("import", "megatron", jl, tmp_path / "t", "--sizes-from", cfg, "--dtype", "bf16")
    assert_one_sentence_error(res, "line 4", "top_indices routes expert 9", "8 experts")
    jl = _megatron(tmp_path, lambda rs: rs[0].update(layer=10 ** 6))
    assert_one_sentence_error(run_cli("import", "megatron", jl, tmp_path / "u", "--expert-bytes", "1000"),
                              "line 1", "layer 1000000")
    assert not (tmp_path / "t").exists() and not (tmp_path / "u").exists()


def test_vllm_only_minus_one_marks_a_cached_position(tmp_path):
    reqs = random_vreqs(np.random.default_rng(1), 2, 3, 2, 8, cached_prompt=2)
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps(vllm_completion(r, i)) + "\n" for i, r in enumerate(reqs)))
    assert run_cli("import", "vllm", good, tmp_path / "ok", "--expert-bytes", "1000").code == 0
    for where, field in (("prompt", "prompt_routed_experts position 3"), ("generated", "routed_experts position 1")):
        rs = random_vreqs(np.random.default_rng(1), 2, 3, 2, 8, cached_prompt=2)
        arr = rs[1].prompt if where == "prompt" else rs[1].generated
        arr[3 if where == "prompt" else 1] = -5  # a whole position of -5: no routing vLLM writes
        src = tmp_path / f"{where}.jsonl"
        src.write_text("".join(json.dumps(vllm_completion(r, i)) + "\n" for i, r in enumerate(rs)))
        res = run_cli("import", "vllm", src, tmp_path / where, "--expert-bytes", "1000")
        assert_one_sentence_error(res, "line 2", field, "expert id -5 is negative", "only -1")
        assert not (tmp_path / where).exists()


def _sglang(tmp_path, name, cached, P=5, G=3):
    rng = np.random.default_rng(2)
    rows = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(2)]) for _ in range(P + G - 1)])
    src = tmp_path / name
    src.write_text(json.dumps(sglang_response(P, list(range(G)), rows, cached=cached)) + "\n")
    return run_cli("import", "sglang", src, tmp_path / f"t-{name}", "--expert-bytes", "1000", "--top-k", "2")


@pytest.mark.parametrize("cached, needles", [
    (-3, ("cached_tokens -3", "not a token count")),
    (6, ("cached_tokens 6", "more than the 5 prompt tokens")),
    (1.5, ("cached_tokens 1.5",)),
    ("2", ("cached_tokens '2'",)),
])
def test_sglang_cached_tokens_checked(tmp_path, cached, needles):
    res = _sglang(tmp_path, "bad.jsonl", cached)
    assert_one_sentence_error(res, "line 1", *needles)
    assert not (tmp_path / "t-bad.jsonl").exists()
    ok = _sglang(tmp_path, "ok.jsonl", 2)
    assert ok.code == 0, ok.err
    assert "2 prompt position(s) in 1 response(s) came from the radix cache" in ok.out


def _one_request_trace(path, steps):
    m = {"model": {"name": "t", "arch": "test", "n_layer": 2, "moe_layers": [0, 1], "n_expert": 4, "top_k": 1,
                   "top_k_native": 1, "n_embd": 4},
         "expert_bytes": [1000, 1000], "dense_bytes": [None, None], "gating": default_gating("softmax", True),
         "provenance": {"engine": "test"}}
    path.mkdir()
    w = TraceWriter(path, m, tokens_per_part=2)
    for b, s in enumerate(steps):
        for lay in (0, 1):
            w.append(turn=0, batch=b, phase=1, step=s, layer=lay, experts=[[b % 4]], weights=[[1.0]])
    w.close()
    return path


@pytest.mark.parametrize("steps, needle", [
    ([0, 1, -3, 3], "has step -3; step is the position inside its request, >= 0"),
    ([0, 1, 2, 1], "has step 1, not after the previous token at this layer"),
    ([0, 2, 2, 3], "has step 2, not after the previous token at this layer"),
])
def test_one_request_trace_step_rules(tmp_path, steps, needle):
    t = _one_request_trace(tmp_path / "t", steps)
    with pytest.raises(TraceError, match="part-0000") as e:
        open_trace(t)
    assert needle in str(e.value)
    # The streamed replay (rows checked as they are read, the compiled gate first) refuses it too.
    assert_one_sentence_error(run_cli("cache", t, "--policies", "lru", "--budgets", "1", "--stream", "on"), needle)
    assert_one_sentence_error(run_cli("info", t), needle)


def test_one_request_trace_in_order_accepted(tmp_path):
    t = _one_request_trace(tmp_path / "t", [0, 1, 2, 5])
    open_trace(t)
    res = run_cli("info", t, "--json")
    assert res.code == 0, res.err
    assert json.loads(res.out)["rows"][0]["tokens_decode"] == 4
