"""Tiny random-weight Hugging Face MoE checkpoints (tests, demos, benchmarks): no download.

:func:`write_tiny_hf_model` builds a config of one of the MoE families capture-hf knows at tiny sizes
(float32, weights drawn from a seeded generator), saves it with ``save_pretrained`` (safetensors)
next to a small byte-level BPE tokenizer trained in memory on a fixed corpus (so any prompt
tokenizes, and the same arguments give the same files), and returns the directory.

Router weights are drawn wider than the families' default init (``router_std``) so the routing of a
random model is decisive rather than a set of near-ties; the selection bias of the sigmoid families
(``e_score_correction_bias``) is drawn too, so the tests see it change selections.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traces.format.errors import UserError

# The corpus the tiny tokenizer's merges are learned from: fixed, so the vocabulary is too.
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a mixture of experts routes every token to a few experts",
    "the router picks the top experts by their scores and the cache keeps the hot ones",
    "one two three four five six seven eight nine ten",
    "hello world, this is a tiny model for tests of the capture",
]
TOKENIZER_VOCAB = 320  # 256 byte tokens + 3 specials + merges

TINY_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss", "glm4_moe", "flex_olmo", "dots1",
                 "glm4_moe_lite", "minimax", "minimax_m2", "hunyuan_v1_moe", "lfm2_moe", "ernie4_5_moe", "deepseek_v2")


@dataclass
class TinyHfConfig:
    family: str = "qwen3_moe"  # a transformers model_type (see TINY_FAMILIES)
    layers: int = 3
    experts: int = 8
    top_k: int = 2
    hidden: int = 64
    expert_ff: int = 32
    seed: int = 0
    router_std: float = 0.5


def build_tokenizer() -> Any:
    """A byte-level BPE tokenizer (PreTrainedTokenizerFast) with <s> = BOS, </s> = EOS, <pad>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def tiny_config(cfg: TinyHfConfig, vocab_size: int, bos: int, eos: int, pad: int) -> Any:
    """The transformers config of ``cfg.family`` at tiny sizes (every layer MoE except where the
    family has dense first layers: DeepSeek-V3 and GLM-4.5 keep layer 0 dense, Qwen2-MoE too, via
    ``mlp_only_layers``, to exercise a dense layer between MoE ones)."""
    from transformers import AutoConfig

    if cfg.family not in TINY_FAMILIES:
        raise UserError(f"--family {cfg.family!r} is not one of {', '.join(TINY_FAMILIES)}.")
    if not 1 <= cfg.top_k <= cfg.experts:
        raise UserError(f"--top-k {cfg.top_k} must be in 1..--experts ({cfg.experts}).")
    if cfg.layers < 2 or cfg.hidden % 16 or cfg.hidden < 16:
        raise UserError("--layers must be at least 2 and --hidden a multiple of 16.")
    h, ff, e, k = cfg.hidden, cfg.expert_ff, cfg.experts, cfg.top_k
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=h, num_hidden_layers=cfg.layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=h // 4, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=bos, eos_token_id=eos,
        pad_token_id=pad, num_experts_per_tok=k, intermediate_size=2 * ff,
    )
    f = cfg.family
    if f == "qwen3_moe":
        kw = dict(num_experts=e, moe_intermediate_size=ff, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    elif f == "qwen2_moe":
        kw = dict(num_experts=e, moe_intermediate_size=ff, shared_expert_intermediate_size=2 * ff, norm_topk_prob=False,
                  decoder_sparse_step=1, mlp_only_layers=[0])
    elif f == "mixtral":
        kw = dict(num_local_experts=e, intermediate_size=ff)
    elif f == "olmoe":
        kw = dict(num_experts=e, intermediate_size=ff, norm_topk_prob=False)
    elif f in ("deepseek_v3", "glm4_moe"):
        groups = 4 if f == "deepseek_v3" and e % 4 == 0 and k <= e // 2 else 1
        kw = dict(n_routed_experts=e, moe_intermediate_size=ff, n_shared_experts=1, first_k_dense_replace=1,
                  n_group=groups, topk_group=max(1, groups // 2), norm_topk_prob=True,
                  routed_scaling_factor=2.5 if f == "deepseek_v3" else 1.0)
        if f == "deepseek_v3":
            kw.update(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=h // 4,
                      head_dim=8, rope_interleave=True)
    elif f == "gpt_oss":
        kw = dict(num_local_experts=e, intermediate_size=ff, sliding_window=16,
                  rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
                  layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.layers)])
    elif f == "deepseek_v2":
        kw = dict(n_routed_experts=e, num_experts=e, moe_intermediate_size=ff, n_shared_experts=1, first_k_dense_replace=1,
                  topk_method="greedy", routed_scaling_factor=1.5, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                  qk_nope_head_dim=8, v_head_dim=h // 4, head_dim=8, num_key_value_heads=4)
    elif f == "flex_olmo":
        kw = dict(num_experts=e, intermediate_size=ff, norm_topk_prob=False)
    elif f == "dots1":
        kw = dict(n_routed_experts=e, moe_intermediate_size=ff, n_shared_experts=1, first_k_dense_replace=1,
                  n_group=2 if e % 2 == 0 and k <= e // 2 else 1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.5,
                  layer_types=["full_attention"] * cfg.layers)
    elif f == "glm4_moe_lite":
        kw = dict(n_routed_experts=e, moe_intermediate_size=ff, n_shared_experts=1, n_group=1, topk_group=1,
                  norm_topk_prob=True, routed_scaling_factor=1.8, mlp_layer_types=["dense"] + ["sparse"] * (cfg.layers - 1),
                  kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=h // 4,
                  num_key_value_heads=4)
    elif f == "minimax":
        kw = dict(num_local_experts=e, intermediate_size=ff, block_size=16,
                  layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.layers)])
    elif f == "minimax_m2":
        kw = dict(num_local_experts=e, intermediate_size=ff)
    elif f == "hunyuan_v1_moe":
        kw = dict(num_experts=e, moe_topk=k, intermediate_size=ff)
    elif f == "lfm2_moe":
        kw = dict(num_experts=e, moe_intermediate_size=ff, num_dense_layers=1, use_expert_bias=True, norm_topk_prob=True,
                  routed_scaling_factor=1.0, layer_types=["conv" if i % 2 == 0 else "full_attention" for i in range(cfg.layers)])
    elif f == "ernie4_5_moe":
        kw = dict(moe_num_experts=e, moe_k=k, moe_intermediate_size=ff, moe_num_shared_experts=1, moe_layer_start_index=1,
                  moe_layer_end_index=cfg.layers - 1, moe_layer_interval=1)
    common.update(kw)
    conf = AutoConfig.for_model(f, **common)
    conf.dtype = "float32"
    return conf


def build_tiny_model(cfg: TinyHfConfig) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer): random weights from ``cfg.seed``."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    conf = tiny_config(cfg, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    with torch.no_grad():
        for name, mod in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("gate", "router", "wg") and hasattr(mod, "weight") and getattr(mod, "weight", None) is not None \
                    and mod.weight.ndim == 2 and mod.weight.shape[0] == cfg.experts:
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen) * cfg.router_std)
                if getattr(mod, "bias", None) is not None:  # gpt-oss: the router's logit bias
                    mod.bias.copy_(torch.randn(mod.bias.shape, generator=gen) * cfg.router_std)
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("e_score_correction_bias", "expert_bias")) and t.numel() == cfg.experts:
                t.copy_(torch.randn(t.shape, generator=gen) * 0.1)  # selection bias: drawn so it changes selections
    model.eval()
    return model, tokenizer


def write_tiny_hf_model(out: str | Path, cfg: TinyHfConfig, force: bool = False) -> Path:
    """Save a tiny random checkpoint + tokenizer into the directory ``out`` (created)."""
    from engine_bridge.hf import quiet_transformers

    quiet_transformers()
    from traces.io.atomic import check_not_special

    out = Path(out)
    check_not_special(out)  # a device or a FIFO is refused, --force or not
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a directory.")
    if out.exists() and any(out.iterdir()) and not force:
        raise UserError(f"{out}: exists and is not empty (give --force to replace its files).")
    model, tokenizer = build_tiny_model(cfg)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
