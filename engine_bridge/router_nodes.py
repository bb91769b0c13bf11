"""The router's nodes in llama.cpp's compute graph: their kinds and names (read by hook and native_ask)."""

from __future__ import annotations

LOGITS, LOGITS_BIASED, PROBS, PROBS_BIASED, GROUP_TOPK, TOPK, WEIGHTS = range(7)

WEIGHT_CHAIN = ("ffn_moe_weights", "ffn_moe_weights_softmax", "ffn_moe_weights_norm", "ffn_moe_weights_scaled")

_STRUCT_NAMES = {
    "ffn_moe_logits": LOGITS,
    "ffn_moe_logits_biased": LOGITS_BIASED,
    "ffn_moe_probs": PROBS,
    "ffn_moe_probs_biased": PROBS_BIASED,
    "ffn_moe_group_topk": GROUP_TOPK,
    "ffn_moe_topk": TOPK,
}
