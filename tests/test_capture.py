"""End-to-end capture through the real llama.cpp (llama-cpp-python) on tiny generated models.

These run whenever llama_cpp is importable (``make test`` installs it); they skip, with the
reason, only when it is not installed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'moe-replay[capture]')")
pytest.importorskip("gguf", reason="gguf-py is not installed (pip install 'moe-replay[capture]')")

from engine_bridge.capture import CaptureOptions, capture  # noqa: E402
from engine_bridge.tinymodel import TinyModelConfig, write_tiny_model  # noqa: E402
from traces import open_trace  # noqa: E402
from traces.format.gating import activation, select  # noqa: E402
from traces.io.reader import fixed_list_to_numpy  # noqa: E402
from traces.util.rounding import round_input  # noqa: E402

pytestmark = pytest.mark.capture

PROMPT = "Mixture-of-Experts routers pick a few experts per token; capture what they chose."
N_DECODE = 20
UBATCH = 16
ARCHS = ["qwen3moe", "minimax-m2", "gpt-oss"]


def _capture(model, out, **kw):
    opts = CaptureOptions(model=str(model), prompt=kw.pop("prompt", PROMPT), out=str(out), n_decode=kw.pop("n_decode", N_DECODE),
                          ubatch=kw.pop("ubatch", UBATCH), threads=2, ignore_eos=True, tokens_per_part=8, **kw)
    return capture(opts)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    # qwen3moe with an F16 router: exercises the engine's input rounding in the fresh-gate control.
    q = write_tiny_model(d / "qwen.gguf", TinyModelConfig(arch="qwen3moe", layers=4, experts=16, top_k=4, embd=64,
                                                           router_type="f16", seed=1))
    m = write_tiny_model(d / "minimax.gguf", TinyModelConfig(arch="minimax-m2", layers=3, experts=16, top_k=4, embd=64, seed=2))
    # gpt-oss: a router logit bias (ffn_gate_inp.bias), softmax over the k chosen logits
    g = write_tiny_model(d / "gptoss.gguf", TinyModelConfig(arch="gpt-oss", layers=3, experts=16, top_k=4, embd=64, seed=3))
    return {"qwen3moe": q, "minimax-m2": m, "gpt-oss": g}


@pytest.fixture(scope="module")
def traces_full(models, tmp_path_factory):
    out = {}
    for arch, path in models.items():
        d = tmp_path_factory.mktemp(f"cap-{arch}") / "trace"
        out[arch] = (d, _capture(path, d))
    return out


def _wide(trace, name):
    return np.concatenate([fixed_list_to_numpy(t.column(name)) for t in trace.iter_tables([name])])


@pytest.mark.parametrize("arch", ARCHS)
def test_every_layer_and_token_present(traces_full, arch):
    d, res = traces_full[arch]
    t = open_trace(d)
    assert t.complete and res.complete
    a = t.arrays()
    n_prompt = res.prompt_tokens
    assert n_prompt >= 32 and res.decode_tokens == N_DECODE
    assert res.prefill_batches == -(-n_prompt // UBATCH) >= 3
    L = len(t.moe_layers)
    assert t.n_rows == (n_prompt + N_DECODE) * L
    # every (step, layer) exactly once, steps 0..P+N-1
    keys = set(zip(a.step.tolist(), a.layer.tolist()))
    assert keys == {(s, l) for s in range(n_prompt + N_DECODE) for l in t.moe_layers}
    # prefill batches hold UBATCH consecutive positions; each decode batch one token
    pre = a.phase == 0
    assert np.array_equal(a.batch[pre], a.step[pre] // UBATCH)
    dec_batches = a.batch[~pre]
    assert np.array_equal(np.unique(dec_batches), res.prefill_batches + np.arange(N_DECODE))
    assert t.token_counts() == {"tokens_prefill": n_prompt, "tokens_decode": N_DECODE}
    # gate+up+down, f16, one expert; gpt-oss adds its float32 expert biases (gate/up 32, down 64)
    want = 3 * 32 * 64 * 2 + (4 * (32 + 32 + 64) if arch == "gpt-oss" else 0)
    assert all(t.expert_bytes[l] == want for l in t.moe_layers)


@pytest.mark.parametrize("arch", ARCHS)
def test_ids_are_topk_of_logits_and_weights_follow_the_rule(traces_full, arch):
    d, res = traces_full[arch]
    t = open_trace(d)
    a = t.arrays()
    logits = _wide(t, "logits")
    routers = t.router_matrices()
    for l in t.moe_layers:
        idx = a.layer == l
        ids, w = select(logits[idx], t.gating, t.top_k, routers[l][1])
        assert np.array_equal(ids, a.experts[idx]), f"layer {l}"
        np.testing.assert_allclose(a.weights[idx], w, atol=2e-6)
    if t.gating["norm_topk"]:
        np.testing.assert_allclose(a.weights.sum(axis=1), 1.0, atol=1e-5)
    assert res.checks["passed"] and res.checks["topk_of_logits"]["agree_pct"] == 100.0


def test_gating_read_from_the_engine_graph(traces_full):
    q = open_trace(traces_full["qwen3moe"][0]).gating
    m = open_trace(traces_full["minimax-m2"][0]).gating
    assert (q["activation"], q["selection_bias"], q["norm_topk"]) == ("softmax", False, True)
    assert (m["activation"], m["selection_bias"], m["norm_topk"]) == ("sigmoid", True, True)
    g = open_trace(traces_full["gpt-oss"][0])
    assert (g.gating["activation"], g.gating["selection_bias"], g.gating["norm_topk"]) == ("softmax_weight", False, False)
    assert g.meta["router_logit_bias"] is True and g.has_router_logit_bias
    assert open_trace(traces_full["qwen3moe"][0]).meta["router_logit_bias"] is False


def test_router_logit_bias_is_stored_and_changes_the_routing(models, traces_full):
    """gpt-oss: the logits column holds what the router ranks (matmul + ffn_gate_inp.bias, as the
    engine adds them); router.parquet stores the bias; ranking without it picks other experts."""
    from engine_bridge.gguf_static import read_static

    t = open_trace(traces_full["gpt-oss"][0])
    static = read_static(models["gpt-oss"])
    lb = t.router_logit_bias()
    assert set(lb) == set(t.moe_layers)
    for l in t.moe_layers:
        np.testing.assert_array_equal(lb[l], static.logit_bias[l])
    a = t.arrays()
    logits, gate = _wide(t, "logits"), _wide(t, "gate_input")
    routers = t.router_matrices()
    changed = 0
    for l in t.moe_layers:
        idx = a.layer == l
        matmul = gate[idx].astype(np.float64) @ routers[l][0].astype(np.float64).T
        np.testing.assert_allclose(logits[idx], matmul + lb[l], rtol=0, atol=1e-5)
        no_bias, _ = select(matmul, t.gating, t.top_k, None)
        changed += int((no_bias != a.experts[idx]).any(axis=1).sum())
    assert changed > 0.2 * t.n_rows


def test_selection_bias_changes_the_routing(traces_full):
    """The minimax-m2 check is not vacuous: ranking without the bias picks other experts."""
    t = open_trace(traces_full["minimax-m2"][0])
    a = t.arrays()
    logits = _wide(t, "logits")
    routers = t.router_matrices()
    changed = 0
    for l in t.moe_layers:
        idx = a.layer == l
        no_bias, _ = select(logits[idx], t.gating, t.top_k, None)
        changed += int((no_bias != a.experts[idx]).any(axis=1).sum())
        assert np.abs(routers[l][1]).max() > 0
    assert changed > 0.2 * t.n_rows


@pytest.mark.parametrize("arch", ARCHS)
def test_fresh_gate_control_reproduces_routing(traces_full, arch):
    """router.parquet x gate_input, with the engine's input rounding, gives the captured logits and ids."""
    d, res = traces_full[arch]
    t = open_trace(d)
    a = t.arrays()
    logits, gate = _wide(t, "logits"), _wide(t, "gate_input")
    routers = t.router_matrices()
    lbias = t.router_logit_bias()  # gpt-oss only
    rounding = t.meta["router_input_rounding"]
    assert rounding == ("f16" if arch == "qwen3moe" else "none")
    for l in t.moe_layers:
        idx = a.layer == l
        W, bias = routers[l]
        fresh = round_input(gate[idx], rounding).astype(np.float64) @ W.astype(np.float64).T + lbias.get(l, 0.0)
        ref = logits[idx].astype(np.float64)
        assert np.abs(fresh - ref).max() <= 1e-5 * np.abs(ref).max()
        ids, _ = select(fresh, t.gating, t.top_k, bias)
        assert np.array_equal(ids, a.experts[idx]), f"layer {l}"
    assert res.checks["fresh_gate"]["agree_pct"] == 100.0


def test_f16_router_needs_the_input_rounding(traces_full):
    """Without the f16 rounding the recomputed logits are visibly off (what the emulation fixes)."""
    t = open_trace(traces_full["qwen3moe"][0])
    a = t.arrays()
    logits, gate = _wide(t, "logits"), _wide(t, "gate_input")
    W = t.router_matrices()[0][0]
    idx = a.layer == 0
    raw = gate[idx].astype(np.float64) @ W.astype(np.float64).T
    rounded = round_input(gate[idx], "f16").astype(np.float64) @ W.astype(np.float64).T
    assert np.abs(raw - logits[idx]).max() > 10 * np.abs(rounded - logits[idx]).max()


def test_routing_only_capture_routes_identically(models, traces_full, tmp_path):
    d_full, _ = traces_full["qwen3moe"]
    res = _capture(models["qwen3moe"], tmp_path / "r", logits=False, gate_input=False)
    t, full = open_trace(res.out), open_trace(d_full)
    assert t.columns == ["token"] and res.checks["topk_of_logits"].get("skipped")
    a, b = t.arrays(), full.arrays()
    assert np.array_equal(a.experts, b.experts) and np.array_equal(a.step, b.step)
    np.testing.assert_array_equal(a.weights, b.weights)


def test_n_expert_used_override(models, tmp_path):
    res = _capture(models["qwen3moe"], tmp_path / "k2", n_expert_used=2, n_decode=4)
    t = open_trace(res.out)
    assert (t.top_k, t.model["top_k_native"]) == (2, 4)
    a = t.arrays()
    logits = _wide(t, "logits")
    ids, w = select(logits, t.gating, 2, None)
    assert np.array_equal(ids, a.experts)
    np.testing.assert_allclose(a.weights.sum(axis=1), 1.0, atol=1e-5)


def test_trace_json_records_provenance_and_checks(traces_full):
    d, _ = traces_full["qwen3moe"]
    meta = json.loads((d / "trace.json").read_text())
    prov = meta["provenance"]
    assert prov["engine_build"]["llama_cpp_python"] == "0.3.36"
    assert prov["prompts"] == [PROMPT]
    assert meta["checks"]["passed"] is True
    assert meta["model"]["arch"] == "qwen3moe" and meta["model"]["n_embd"] == 64
    assert all(b > 0 for b in meta["dense_bytes"])


def test_make_model_is_deterministic(tmp_path):
    cfg = TinyModelConfig(layers=2, experts=8, top_k=2, embd=32, seed=7)
    a = write_tiny_model(tmp_path / "a.gguf", cfg).read_bytes()
    b = write_tiny_model(tmp_path / "b.gguf", cfg).read_bytes()
    c = write_tiny_model(tmp_path / "c.gguf", TinyModelConfig(layers=2, experts=8, top_k=2, embd=32, seed=8)).read_bytes()
    assert a == b and a != c


def test_bf16_rounding_matches_ml_dtypes_style_rounding():
    x = np.array([1.0, 1.00390625, 1.01171875, -3.14159, 1e-3], dtype=np.float32)
    r = round_input(x[None, :], "bf16")[0]
    # bf16 keeps 8 mantissa bits: representable values survive, others move by < 2^-8 relative
    assert r[0] == 1.0 and np.all(np.abs(r - x) <= np.abs(x) * 2.0**-8)
    assert np.all((r.view(np.uint32) & 0xFFFF) == 0)


def test_activation_helper_agrees_with_engine_probs(traces_full):
    """Weights of the softmax model are renormalized softmax probs of the captured logits."""
    t = open_trace(traces_full["qwen3moe"][0])
    a = t.arrays()
    probs = activation(_wide(t, "logits"), "softmax")
    chosen = np.take_along_axis(probs, a.experts.astype(np.int64), axis=1)
    np.testing.assert_allclose(a.weights, chosen / chosen.sum(axis=1, keepdims=True), atol=2e-6)


def test_same_input_same_bytes(models, tmp_path):
    """Same model, prompt and options: byte-identical trace directories."""
    a = _capture(models["minimax-m2"], tmp_path / "a", n_decode=5).out
    b = _capture(models["minimax-m2"], tmp_path / "b", n_decode=5).out
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_quantized_router_fresh_gate(tmp_path):
    """A Q8_0 router: the control rounds the gate input to Q8_0 blocks as the engine's matmul does."""
    path = write_tiny_model(tmp_path / "q8.gguf", TinyModelConfig(layers=2, experts=8, top_k=2, embd=64, router_type="q8_0", seed=4))
    res = _capture(path, tmp_path / "t", n_decode=4)
    t = open_trace(res.out)
    assert t.meta["router_input_rounding"] == "q8_0" and t.meta["router_stored_type"] == "Q8_0"
    fg = res.checks["fresh_gate"]
    assert fg["agree"] == fg["rows"] == t.n_rows and fg["logits_within_tol"]


@pytest.mark.parametrize("arch", ARCHS)
def test_ctrl_predictor_reads_100_on_captures(traces_full, arch):
    """The predictor issue's ctrl (router.parquet x gate_input with the engine's input rounding and
    the architecture's selection rule) reproduces every captured routing."""
    from replay.analyses.accuracy import evaluate

    d, _ = traces_full[arch]
    t = open_trace(d)
    res = evaluate(t, ["ctrl", "stale-gate"], phase="all")
    row = res.overall().filter(res.overall()["predictor"] == "ctrl").row(0, named=True)
    assert row["slot_acc_pct"] == 100.0 and row["whole_acc_pct"] == 100.0
    assert row["scored"] == t.n_rows and row["unscored"] == 0
    assert not res.ctrl_failing_layers


@pytest.mark.parametrize("arch", ARCHS)
def test_token_column_holds_the_prompt_and_the_decoded_tokens(models, traces_full, arch):
    """Each row carries the token id of its position (compare checks two runs saw the same tokens):
    the prompt as the model's vocabulary tokenizes it, then the tokens decoded greedily."""
    import polars as pl

    from engine_bridge.engine import Vocab

    d, res = traces_full[arch]
    t = open_trace(d)
    assert "token" in t.columns
    df = t.routings(["step", "layer", "token"])
    per_step = df.group_by("step").agg(pl.col("token").n_unique().alias("n"), pl.col("token").first().alias("tok")).sort("step")
    assert per_step["n"].max() == 1  # every layer of a position carries the same token
    with Vocab(str(models[arch])) as v:
        prompt = v.tokenize(PROMPT)
    toks = per_step["tok"].to_list()
    assert toks[:len(prompt)] == prompt and len(toks) == len(prompt) + N_DECODE


def test_kv_type_and_flash_attn_options(models, traces_full, tmp_path):
    """--kv-type f32 --flash-attn off computes attention in float32: recorded in provenance, the same
    routings as llama.cpp's default (f16 cache) on this model, logits that differ by f16 rounding only."""
    from replay.analyses.trace_compare import compare
    from tests.helpers import assert_one_sentence_error, run_cli
    from traces.format.errors import UserError

    res = _capture(models["qwen3moe"], tmp_path / "f32", kv_type="f32", flash_attn="off")
    t = open_trace(res.out)
    cap = t.meta["provenance"]["capture"]
    assert (cap["kv_type"], cap["flash_attn"]) == ("f32", "off")
    assert open_trace(traces_full["qwen3moe"][0]).meta["provenance"]["capture"]["kv_type"] == "f16"
    # on a random model the f16 rounding flips a greedy choice of the vocabulary late in the run:
    # compare refuses, and --align step compares the positions before the first differing token
    with pytest.raises(UserError, match="token ids differ"):
        compare(open_trace(traces_full["qwen3moe"][0]), t)
    res_c = compare(open_trace(traces_full["qwen3moe"][0]), t, tol=1e-2, align="step")
    ov = res_c.overall()
    assert res_c.positions >= res.prompt_tokens and ov["logit_max_abs_diff"] > 0 and ov["set_agree_pct"] >= 99.0, ov
    for flag, bad in (("--kv-type", "q3"), ("--flash-attn", "maybe")):
        r = run_cli("capture", models["qwen3moe"], "--prompt", "hi", "-n", 1, "--out", tmp_path / "x", flag, bad)
        assert_one_sentence_error(r, flag, repr(bad))
        assert not (tmp_path / "x").exists()
