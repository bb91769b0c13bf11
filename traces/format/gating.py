"""Router selection rules: from router logits to the selected experts and their applied weights.

This is the architecture's own rule, as llama.cpp's ``build_moe_ffn`` applies it:

1. ``probs = activation(logits)`` (softmax over experts, or element-wise sigmoid; for
   ``softmax_weight`` (gpt-oss) the raw logits rank and the softmax is over the selected ones);
2. ``selection = probs + bias`` where the architecture has a selection bias;
3. with expert groups (``n_group`` > 1): each group scores the sum of its top-2 selection values,
   only the best ``topk_group`` groups stay eligible;
4. the ``top_k`` largest selection values win, in descending order (ties: lower id first);
5. weights are the *unbiased* probs of the winners, normalized to sum 1 if ``norm_topk``,
   times ``scale``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Known gating of architectures whose route logs carry no gating metadata: (activation, norm_topk).
KNOWN_ARCH_GATING: dict[str, tuple[str, bool | None]] = {
    "qwen3moe": ("softmax", True),
    "qwen2moe": ("softmax", False),
    "olmoe": ("softmax", False),
    "mixtral": ("softmax", True),
    "gpt-oss": ("softmax_weight", None),
}


def activation(logits: np.ndarray, kind: str) -> np.ndarray:
    """probs from logits ``[T, E]`` in float64 (the ranking is what matters; f64 avoids ties)."""
    x = logits.astype(np.float64, copy=False)
    if kind == "sigmoid":
        with np.errstate(over="ignore"):  # exp(-x) = inf for x < -709: the probability is 0.0, as it should be
            return 1.0 / (1.0 + np.exp(-x))
    if kind in ("softmax", "softmax_weight"):
        z = np.exp(x - x.max(axis=1, keepdims=True))
        return z / z.sum(axis=1, keepdims=True)
    raise ValueError(f"unknown activation {kind!r}")


def selection_scores(logits: np.ndarray, gating: dict[str, Any], bias: np.ndarray | None = None) -> np.ndarray:
    """The values ranked to choose experts ``[T, E]`` (float64), groups already masked to -inf."""
    act = gating.get("activation") or "softmax"
    probs = logits.astype(np.float64) if act == "softmax_weight" else activation(logits, act)
    sel = probs + bias.astype(np.float64)[None, :] if (bias is not None and gating.get("selection_bias")) else probs
    n_group = int(gating.get("n_group", 1) or 1)
    if n_group > 1:
        t, e = sel.shape
        grouped = sel.reshape(t, n_group, e // n_group)
        top2 = -np.sort(-grouped, axis=2)[:, :, :2].sum(axis=2)  # [T, n_group]
        keep = top_indices(top2, int(gating.get("topk_group", 1)))
        mask = np.zeros((t, n_group), dtype=bool)
        np.put_along_axis(mask, keep, True, axis=1)
        sel = np.where(np.repeat(mask, e // n_group, axis=1), sel, -np.inf)
    return sel


def top_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest per row, descending; ties go to the lower index.

    Exactly the first k of a stable argsort of ``-scores`` (NaN ranks last), without sorting the
    whole row: the k-th smallest ``-score`` of each row is found by a partition, the entries below
    it and the lowest-index ones equal to it are kept (k per row, in index order), and only those
    k are sorted, stably, so ties keep the lower index first."""
    neg = -np.asarray(scores)
    T, E = neg.shape if neg.ndim == 2 else (0, 0)
    if k >= E or T == 0 or np.isnan(neg).any():
        return np.argsort(neg, axis=1, kind="stable")[:, :k]
    kth = np.partition(neg, k - 1, axis=1)[:, k - 1:k]
    below = neg < kth
    ties = neg == kth
    room = k - below.sum(axis=1, keepdims=True)
    keep = below | (ties & (np.cumsum(ties, axis=1) <= room))
    idx = np.nonzero(keep)[1].reshape(T, k)  # row-major: each row's k kept indices, ascending
    order = np.argsort(np.take_along_axis(neg, idx, axis=1), axis=1, kind="stable")
    return np.take_along_axis(idx, order, axis=1)


def select(logits: np.ndarray, gating: dict[str, Any], top_k: int,
           bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids ``[T, k]`` int32 in rank order, applied weights ``[T, k]`` float32)."""
    sel = selection_scores(logits, gating, bias)
    ids = top_indices(sel, top_k)
    act = gating.get("activation") or "softmax"
    if act == "softmax_weight":
        chosen = np.take_along_axis(logits.astype(np.float64), ids, axis=1)
        w = activation(chosen, "softmax")
    else:
        w = np.take_along_axis(activation(logits, act), ids, axis=1)
        if gating.get("norm_topk"):
            w = w / w.sum(axis=1, keepdims=True)
    w = w * float(gating.get("scale", 1.0) or 1.0)
    return ids.astype(np.int32), w.astype(np.float32)
