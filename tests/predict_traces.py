"""Small hand-built traces for the predictor tests (hypothesis-drawn structure, seeded values)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from traces.format.schema import default_gating
from traces.io.writer import TraceWriter

GATINGS = ("softmax", "sigmoid", "sigmoid-bias", "grouped", "softmax_weight")


def gating_meta(kind: str, n_group: int = 1, topk_group: int = 1) -> dict:
    if kind == "softmax":
        return default_gating("softmax", True)
    if kind == "softmax_weight":
        return default_gating("softmax_weight", None)
    g = default_gating("sigmoid", True)
    if kind in ("sigmoid-bias", "grouped"):
        g["selection_bias"] = True
    if kind == "grouped":
        g.update(n_group=n_group, topk_group=topk_group)
    return g


def write_trace(out: Path, *, n_layer: int, moe_layers: list[int], n_expert: int, top_k: int, n_embd: int,
                gating: dict, turns: list[tuple[int, int]], seed: int, drop: float = 0.0, nan_frac: float = 0.0,
                consistent: float = 0.5, tokens_per_part: int = 2, gate_dtype: str = "float32",
                with_gate: bool = True, logit_bias: bool = False, shared_gate: bool = False,
                continuous: bool = False) -> Path:
    """Write a trace: ``turns`` = [(prefill tokens, decode tokens)], values on a dyadic grid.

    Gate inputs and router weights are multiples of 1/8 in [-2, 2] (and n_embd is small), so every
    dot product is exact in float64 whatever the summation order: the fast path and the naive twin
    see identical logits, ties included. A share ``consistent`` of routings is the router's own
    choice (computed here with numpy), the rest random distinct experts; ``drop`` removes rows.
    ``logit_bias``: the router adds a per-expert bias to its logits (gpt-oss), stored in
    router.parquet's ``logit_bias`` column and flagged in trace.json. ``shared_gate``: every MoE
    layer of a token gets the same gate input (layer l+1's router input equals layer l's);
    ``continuous``: gate inputs drawn from a normal distribution (no ties, for the regression).
    """
    rng = np.random.default_rng(seed)
    L = len(moe_layers)
    W = (rng.integers(-16, 17, size=(L, n_expert, n_embd)) / 8).astype(np.float32)
    bias = (rng.integers(-4, 5, size=(L, n_expert)) / 16).astype(np.float32)
    lbias = (rng.integers(-16, 17, size=(L, n_expert)) / 4).astype(np.float32) if logit_bias else np.zeros((L, n_expert), np.float32)
    meta = {
        "model": {"name": "hyp", "arch": "synthetic", "n_layer": n_layer, "moe_layers": moe_layers,
                  "n_expert": n_expert, "top_k": top_k, "top_k_native": top_k, "n_embd": n_embd},
        "expert_bytes": [1000 if l in moe_layers else None for l in range(n_layer)],
        "dense_bytes": [None] * n_layer,
        "gating": gating,
        "provenance": {"engine": "test", "tool": "moe-replay", "tool_version": "0"},
        "router_logit_bias": bool(logit_bias),
    }
    cols = ("gate_input",) if with_gate else ()
    w = TraceWriter(out, meta, columns=cols, gate_input_dtype=gate_dtype, tokens_per_part=tokens_per_part)
    if with_gate:
        w.write_router(np.repeat(moe_layers, n_expert), np.tile(np.arange(n_expert), L), W.reshape(L * n_expert, n_embd),
                       bias.reshape(-1), lbias.reshape(-1) if logit_bias else None)
    from traces.format.gating import select  # test scaffolding only: makes some routings consistent

    batch, step, wrote = 0, 0, 0
    token_gate: dict[tuple[int, int], np.ndarray] = {}

    def row(turn: int, b: int, phase: int, s: int, li: int) -> None:
        nonlocal wrote
        if wrote and rng.random() < drop:
            return
        if continuous:
            g = rng.standard_normal((1, n_embd)).astype(np.float32)
        else:
            g = (rng.integers(-16, 17, size=(1, n_embd)) / 8).astype(np.float32)
        if shared_gate:
            g = token_gate.setdefault((b, s), g)
        if rng.random() < consistent:
            logits = g.astype(np.float64) @ W[li].astype(np.float64).T + lbias[li].astype(np.float64)
            ids, _ = select(logits, gating, top_k, bias[li])
            ex = ids[0]
        else:
            ex = rng.permutation(n_expert)[:top_k]
        wt = np.sort((rng.integers(1, 9, size=top_k) / 8).astype(np.float32))[::-1].copy()  # router rank order
        if rng.random() < nan_frac:
            wt[:] = np.nan
        opt = {"gate_input": g} if with_gate else {}
        w.append(turn=turn, batch=b, phase=phase, step=s, layer=moe_layers[li], experts=ex[None, :],
                 weights=wt[None, :], **opt)
        wrote += 1

    for turn, (n_pre, n_dec) in enumerate(turns):
        if n_pre:
            for li in range(L):
                for s in range(step, step + n_pre):
                    row(turn, batch, 0, s, li)
            batch += 1
            step += n_pre
        for _ in range(n_dec):
            for li in range(L):
                row(turn, batch, 1, step, li)
            batch += 1
            step += 1
    w.close()
    return out
