"""Random-weight MoE GGUF files that llama.cpp loads: for tests, demos and the overhead benchmark.

Three architectures with different selection rules:

- ``qwen3moe``: softmax over the router logits, top-k, weights renormalized over the top-k;
- ``minimax-m2``: sigmoid gating with a per-expert selection bias (``exp_probs_b``) added to the
  probabilities for ranking only (the weights are the unbiased probabilities, renormalized);
- ``gpt-oss``: a router with a bias (``ffn_gate_inp.bias`` [E], added to the logits), top-k of
  the biased logits, weights = softmax over the k chosen ("softmax_weight").

qwen3moe and minimax-m2 share one layer layout (RMS norms, GQA attention with Q/K norms, router
``ffn_gate_inp`` [E, D], stacked experts gate/up [E, F, D] and down [E, D, F]); minimax-m2's Q/K
norms span all heads and it adds ``blk.N.exp_probs_b.bias`` [E]. gpt-oss has no Q/K norms but
biases on every projection, per-head attention sinks [H], a post-attention norm, expert biases
(gate/up [E, F], down [E, D]) and sliding-window attention on every other layer; llama.cpp wants
its biases and sinks in float32 (float16 ones load, then abort at decode). The tokenizer is a minimal SPM
vocabulary (``<unk> <s> </s>`` + 256 byte tokens), so any UTF-8 prompt tokenizes (byte fallback).
Weights are drawn from one seeded generator: the same options give a byte-identical file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from traces.format.errors import UserError

ARCHS = ("qwen3moe", "minimax-m2", "gpt-oss")
WEIGHT_TYPES = ("f32", "f16")
ROUTER_TYPES = ("f32", "f16", "q8_0")


@dataclass(frozen=True)
class TinyModelConfig:
    arch: str = "qwen3moe"
    layers: int = 4
    experts: int = 16
    top_k: int = 4
    embd: int = 64
    expert_ff: int | None = None  # default embd // 2
    heads: int = 4
    kv_heads: int = 2
    seed: int = 0
    router_type: str = "f32"  # storage type of ffn_gate_inp (f16 exercises the engine's input rounding)
    weight_type: str = "f16"  # storage type of the other matrices
    bias_scale: float = 0.3  # minimax-m2: spread of the selection bias (sigmoid probs lie in 0..1)
    router_bias_scale: float = 1.0  # gpt-oss: spread of the router's logit bias (logits spread ~2)
    context: int = 4096  # the training context (<arch>.context_length)
    tokenizer: str = "llama"  # "llama" (SPM, byte fallback) | "none" (no tokenizer: feed token ids)

    @property
    def ff(self) -> int:
        return self.expert_ff or max(8, self.embd // 2)

    @property
    def head_dim(self) -> int:
        return self.embd // self.heads

    def check(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise UserError(msg)

        need(self.arch in ARCHS, f"--arch {self.arch!r} is not one of {', '.join(ARCHS)}.")
        need(self.layers >= 1, "--layers must be at least 1.")
        need(2 <= self.experts <= 512, "--experts must be between 2 and 512.")
        need(1 <= self.top_k <= self.experts, f"--top-k must be between 1 and --experts ({self.experts}).")
        need(self.heads >= 1 and self.kv_heads >= 1 and self.heads % self.kv_heads == 0,
             "the head count must be a multiple of the KV head count.")
        need(self.embd >= 16 and self.embd % (2 * self.heads) == 0,
             f"--embd must be at least 16 and a multiple of {2 * self.heads} (heads x an even head size).")
        need(self.ff >= 1, "--expert-ff must be positive.")
        need(self.router_type in ROUTER_TYPES, f"--router-type must be one of {', '.join(ROUTER_TYPES)}.")
        need(self.weight_type in WEIGHT_TYPES, f"--weight-type must be one of {', '.join(WEIGHT_TYPES)}.")
        need(self.router_type != "q8_0" or self.embd % 32 == 0, "--router-type q8_0 needs --embd a multiple of 32.")
        need(1 <= self.context <= 2**31 - 1, "--context must be between 1 and 2147483647 tokens.")
        need(self.tokenizer in ("llama", "none"), "the tokenizer must be llama or none.")


VOCAB_SPECIAL = ["<unk>", "<s>", "</s>"]


def _vocab() -> tuple[list[str], list[float], list[int]]:
    from gguf import TokenType

    tokens = VOCAB_SPECIAL + [f"<0x{b:02X}>" for b in range(256)]
    scores = [0.0] * len(tokens)
    types = [int(TokenType.UNKNOWN), int(TokenType.CONTROL), int(TokenType.CONTROL)] + [int(TokenType.BYTE)] * 256
    return tokens, scores, types


def write_tiny_model(out: str | os.PathLike[str], cfg: TinyModelConfig, force: bool = False) -> Path:
    """Write the GGUF to ``out`` atomically (temporary sibling, then rename); return the path."""
    from traces.io.atomic import check_not_special, staged_file

    cfg.check()
    out = Path(out)
    check_not_special(out)  # a device or a FIFO is refused even with --force
    if out.exists() and not force:
        raise UserError(f"{out}: file exists (pass --force to replace it).")
    if out.is_dir():
        raise UserError(f"{out}: is a directory.")
    if not out.resolve().parent.is_dir():
        raise UserError(f"{out}: the parent directory does not exist.")
    from engine_bridge.engine import import_gguf

    gguf = import_gguf("make-model")
    with staged_file(out) as tmp:  # the output guard, a temporary sibling, one checked rename
        _write(tmp, cfg, gguf)
    return out


def _write(path: Path, cfg: TinyModelConfig, gguf) -> None:  # noqa: ANN001 - gguf module
    rng = np.random.default_rng([cfg.seed, 0x6A11])
    L, E, K, D, F = cfg.layers, cfg.experts, cfg.top_k, cfg.embd, cfg.ff
    H, KV, hd = cfg.heads, cfg.kv_heads, cfg.head_dim
    tokens, scores, types = _vocab()
    V = len(tokens)
    wt = np.float16 if cfg.weight_type == "f16" else np.float32
    rt = np.float16 if cfg.router_type == "f16" else np.float32  # q8_0: quantized from f32 below

    def mat(*shape: int, scale: float = 1.0, dtype=wt) -> np.ndarray:
        fan_in = shape[-1]
        return (rng.standard_normal(shape) * (scale / np.sqrt(fan_in))).astype(dtype)

    w = gguf.GGUFWriter(str(path), cfg.arch)
    w.add_name(f"tiny-{cfg.arch}-L{L}-E{E}-k{K}-d{D}-seed{cfg.seed}")
    w.add_context_length(cfg.context)
    w.add_embedding_length(D)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_expert_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    if cfg.arch == "minimax-m2":
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if cfg.arch == "gpt-oss":
        w.add_sliding_window(128)  # required key; the gating is fixed by the architecture
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if cfg.weight_type == "f16" else gguf.LlamaFileType.ALL_F32)
    if cfg.tokenizer == "none":
        w.add_tokenizer_model("none")
        w.add_vocab_size(V)
    else:
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(True)

    ones = np.ones(D, dtype=np.float32)
    w.add_tensor("token_embd.weight", mat(V, D, scale=np.sqrt(D)))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", mat(V, D))
    qn = H * hd if cfg.arch == "minimax-m2" else hd
    kn = KV * hd if cfg.arch == "minimax-m2" else hd

    def vec(*shape: int, scale: float = 0.1) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)  # biases, sinks: float32 only

    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        w.add_tensor(p + "attn_q.weight", mat(H * hd, D))
        w.add_tensor(p + "attn_k.weight", mat(KV * hd, D))
        w.add_tensor(p + "attn_v.weight", mat(KV * hd, D))
        w.add_tensor(p + "attn_output.weight", mat(D, H * hd, scale=0.5))
        if cfg.arch == "gpt-oss":
            w.add_tensor(p + "attn_q.bias", vec(H * hd))
            w.add_tensor(p + "attn_k.bias", vec(KV * hd))
            w.add_tensor(p + "attn_v.bias", vec(KV * hd))
            w.add_tensor(p + "attn_output.bias", vec(D))
            w.add_tensor(p + "attn_sinks.weight", vec(H, scale=1.0))
            w.add_tensor(p + "post_attention_norm.weight", ones)
        else:
            w.add_tensor(p + "attn_q_norm.weight", np.ones(qn, dtype=np.float32))
            w.add_tensor(p + "attn_k_norm.weight", np.ones(kn, dtype=np.float32))
            w.add_tensor(p + "ffn_norm.weight", ones)
        # Router: logits with a spread of about 2 so that several experts compete per token.
        router = mat(E, D, scale=2.0, dtype=rt)
        if cfg.router_type == "q8_0":
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(p + "ffn_gate_inp.weight", gguf.quants.quantize(router, q8), raw_dtype=q8)
        else:
            w.add_tensor(p + "ffn_gate_inp.weight", router)
        w.add_tensor(p + "ffn_gate_exps.weight", mat(E, F, D))
        w.add_tensor(p + "ffn_up_exps.weight", mat(E, F, D))
        w.add_tensor(p + "ffn_down_exps.weight", mat(E, D, F, scale=0.5))
        if cfg.arch == "minimax-m2":
            w.add_tensor(p + "exp_probs_b.bias", (rng.standard_normal(E) * cfg.bias_scale).astype(np.float32))
        if cfg.arch == "gpt-oss":
            w.add_tensor(p + "ffn_gate_inp.bias", vec(E, scale=cfg.router_bias_scale))
            w.add_tensor(p + "ffn_gate_exps.bias", vec(E, F))
            w.add_tensor(p + "ffn_up_exps.bias", vec(E, F))
            w.add_tensor(p + "ffn_down_exps.bias", vec(E, D))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
