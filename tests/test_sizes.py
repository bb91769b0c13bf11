"""Issue 16 item 3: expert sizes from an option, a GGUF (as stored, quantisation included) or a Hugging
Face config.json at a storage type -- never guessed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers import assert_one_sentence_error, run_cli
from traces.format.errors import UserError
from traces.importers._sizes import DTYPES, load_sizes, matrix_bytes, require_sizes


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_gguf_sizes_equal_the_engine_bridge_reading(tmp_path, arch):
    from engine_bridge.gguf_static import read_static
    from engine_bridge.tinymodel import TinyModelConfig, write_tiny_model

    p = write_tiny_model(tmp_path / "m.gguf", TinyModelConfig(arch=arch, layers=3, experts=8, top_k=2, embd=64))
    s = load_sizes(sizes_from=p)
    ref = read_static(p, with_router=False)
    assert s.expert_bytes == ref.expert_bytes and s.dense_bytes == ref.dense_bytes
    assert (s.n_layer, s.n_expert, s.top_k, s.n_embd, s.arch) == (3, 8, 2, 64, arch)
    assert s.source["kind"] == "gguf" and len(s.source["sha256"]) == 64


def test_gguf_quantised_experts_count_their_stored_bytes(tmp_path):
    import gguf
    from gguf.quants import quantize

    E, F, D = 4, 8, 64
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "qwen3moe")
    w.add_block_count(2)
    w.add_embedding_length(D)
    w.add_expert_count(E)
    w.add_expert_used_count(2)
    for il in range(2):
        p = f"blk.{il}."
        w.add_tensor(p + "ffn_gate_inp.weight", rng.random((E, D), dtype=np.float32))
        for name, shape, qt in (("ffn_gate_exps", (E, F, D), gguf.GGMLQuantizationType.Q8_0),
                                ("ffn_up_exps", (E, F, D), gguf.GGMLQuantizationType.Q8_0),
                                ("ffn_down_exps", (E, D, F * 4), gguf.GGMLQuantizationType.Q4_0)):
            w.add_tensor(p + name + ".weight", quantize(rng.random(shape, dtype=np.float32), qt), raw_dtype=qt)
        w.add_tensor(p + "ffn_gate_shexp.weight", rng.random((F, D), dtype=np.float32))  # shared: dense
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    s = load_sizes(sizes_from=tmp_path / "q.gguf")
    per_expert = 2 * F * (D // 32) * 34 + D * (F * 4 // 32) * 18  # q8_0 gate + up, q4_0 down
    assert s.expert_bytes == [per_expert, per_expert]
    assert s.dense_bytes == [E * D * 4 + F * D * 4] * 2  # router + shared expert, float32


QWEN3_30B = {"model_type": "qwen3_moe", "hidden_size": 2048, "moe_intermediate_size": 768, "intermediate_size": 6144,
             "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128}


def cfg_file(tmp_path, cfg):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


def test_config_sizes_qwen3(tmp_path):
    p = cfg_file(tmp_path, QWEN3_30B)
    s = load_sizes(sizes_from=p, dtype="bf16")
    assert s.expert_bytes == [3 * 2048 * 768 * 2] * 48 and (s.n_expert, s.top_k, s.n_layer) == (128, 8, 48)
    # q4_k: 144 bytes per 256 weights of a row; the real Qwen3-30B-A3B Q4_K_M preamble says 3,059,712 bytes
    # per expert = gate/up in q4_k + down in q6_k, which these block sizes reproduce exactly.
    q4 = load_sizes(sizes_from=p, dtype="q4_k").expert_bytes[0]
    assert q4 == 1536 * 8 * 144 + 2048 * 3 * 144
    assert matrix_bytes(1536, 2048, "q4_k", "gate/up") + matrix_bytes(2048, 768, "q6_k", "down") == 3_059_712
    # attention (GQA) + norms + router in dense bytes
    attn = (32 * 128 * 2048 + 2 * 4 * 128 * 2048 + 2048 * 32 * 128) * 2
    assert s.dense_bytes[0] == attn + 2 * 2048 * 2 + 128 * 2048 * 2
    # the directory holding config.json works too
    assert load_sizes(sizes_from=tmp_path, dtype="bf16").expert_bytes == s.expert_bytes


def test_config_layer_patterns_and_shared_experts(tmp_path):
    ds = {"hidden_size": 7168, "moe_intermediate_size": 2048, "intermediate_size": 18432, "n_routed_experts": 256,
          "n_shared_experts": 1, "num_hidden_layers": 61, "first_k_dense_replace": 3, "moe_layer_freq": 1,
          "num_attention_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
          "qk_nope_head_dim": 128, "v_head_dim": 128}
    s = load_sizes(sizes_from=cfg_file(tmp_path, ds), dtype="fp8")
    assert s.expert_bytes[:3] == [None] * 3 and s.expert_bytes[3:] == [3 * 7168 * 2048] * 58
    assert s.model_moe_layers == list(range(3, 61))
    shared = 3 * 7168 * 2048
    assert s.dense_bytes[3] - s.dense_bytes[0] == shared + 256 * 7168 - 3 * 7168 * 18432  # shared + router - dense MLP
    assert any("scale" in n for n in s.notes)
    q2 = {"hidden_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 128, "num_experts": 8,
          "num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    s2 = load_sizes(sizes_from=cfg_file(tmp_path, q2), dtype="f32")
    assert s2.model_moe_layers == [1]  # (layer + 1) % 2 == 0 and not mlp-only
    mix = {"hidden_size": 64, "intermediate_size": 96, "num_local_experts": 8, "num_hidden_layers": 2}
    assert load_sizes(sizes_from=cfg_file(tmp_path, mix), dtype="f16").expert_bytes == [3 * 64 * 96 * 2] * 2


@pytest.mark.parametrize("args, needle", [
    (dict(expert_bytes=0), "--expert-bytes 0"),
    (dict(expert_bytes=(1 << 40) + 1), "1..2^40"),
    (dict(expert_bytes=5, sizes_from="x"), "pass one"),
    (dict(dtype="bf16"), "--dtype needs --sizes-from"),
])
def test_bad_size_options(args, needle):
    with pytest.raises(UserError, match=needle.replace("^", r"\^").replace(".", r"\.")):
        load_sizes(**args)


def test_bad_configs(tmp_path):
    p = cfg_file(tmp_path, QWEN3_30B)
    with pytest.raises(UserError, match="add --dtype"):
        load_sizes(sizes_from=p)
    with pytest.raises(UserError, match="unknown storage type"):
        load_sizes(sizes_from=p, dtype="q3_xs")
    with pytest.raises(UserError, match="blocks of 256"):
        load_sizes(sizes_from=cfg_file(tmp_path, {**QWEN3_30B, "moe_intermediate_size": 100}), dtype="q4_k")
    with pytest.raises(UserError, match="hidden_size"):
        load_sizes(sizes_from=cfg_file(tmp_path, {"num_experts": 8}), dtype="bf16")
    (tmp_path / "junk.bin").write_bytes(b"\x00\x01garbage")
    with pytest.raises(UserError, match="neither a GGUF nor a JSON"):
        load_sizes(sizes_from=tmp_path / "junk.bin", dtype="bf16")
    with pytest.raises(UserError, match="no such file"):
        load_sizes(sizes_from=tmp_path / "absent.json", dtype="bf16")
    assert set(DTYPES) >= {"bf16", "f16", "f32", "fp8", "int8", "q8_0", "q4_0", "q4_k"}


def test_no_sizes_is_refused_naming_the_options():
    with pytest.raises(UserError, match="--expert-bytes N, --sizes-from MODEL.gguf, or --sizes-from config.json --dtype D"):
        require_sizes(None, "log.csv", "table")


def test_a_routed_layer_the_model_says_is_dense_is_refused(tmp_path):
    ds = {"hidden_size": 64, "moe_intermediate_size": 32, "n_routed_experts": 8, "num_hidden_layers": 4,
          "first_k_dense_replace": 2}
    src = tmp_path / "r.csv"
    src.write_text("layer,experts\n0,1 2\n2,3 4\n")
    res = run_cli("import", "table", src, tmp_path / "o", "--sizes-from", cfg_file(tmp_path, ds), "--dtype", "bf16")
    assert_one_sentence_error(res, "routes layer 0", "no experts")
    assert not (tmp_path / "o").exists()
