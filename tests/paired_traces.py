"""Synthetic traces with a known difference between policies, for the paired comparisons
(:mod:`replay.analyses.paired`): ``kind="win"`` routes each MoE layer's tokens to a few hot experts half the
time and to a scan over many cold ones otherwise, so a frequency policy (lfu) keeps the hot ones and
beats LRU by many points; ``kind="null"`` routes uniformly at random (i.i.d.), where every demand
policy that cannot see the future has the same expected hit rate (budget / experts): no true difference."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from traces import TraceWriter
from traces.format.schema import default_gating

LAYERS, EXPERTS, EXPERT_BYTES = 4, 64, 1 << 20


def write_routing_trace(out: Path, kind: str, tokens: int = 400, seed: int = 0, layers: int = LAYERS,
                        experts: int = EXPERTS, requests: int = 0) -> Path:
    """``requests`` > 0: that many requests one after another (a ``request`` column), each a one-token
    prompt then ``tokens // requests`` decoded tokens, one batch per token."""
    rng = np.random.default_rng(seed)
    meta = {
        "model": {"name": f"paired-{kind}", "arch": "test", "n_layer": layers, "moe_layers": list(range(layers)),
                  "n_expert": experts, "top_k": 1, "top_k_native": 1, "n_embd": None},
        "expert_bytes": [EXPERT_BYTES] * layers, "dense_bytes": [None] * layers,
        "gating": default_gating("softmax", True), "provenance": {"engine": "test"},
    }
    w = TraceWriter(out, meta, tokens_per_part=1 << 20, columns=("request",) if requests else ())
    scan = 0
    per = tokens // requests + 1 if requests else tokens + 1
    for t in range(per * requests if requests else tokens + 1):  # each request: a prompt batch, then one batch per token
        phase = 0 if t % per == 0 else 1
        extra = {"request": np.array([t // per], np.int64)} if requests else {}
        for layer in range(layers):
            if kind == "win":
                if rng.random() < 0.5:
                    e = int(rng.integers(0, 4))
                else:
                    e = 4 + scan % (experts - 4)
                    scan += 1 if layer == layers - 1 else 0
            else:
                e = int(rng.integers(0, experts))
            w.append(turn=0, batch=t, phase=phase, step=t % per if requests else t, layer=layer,
                     experts=np.array([[e]], np.int32), weights=np.ones((1, 1), np.float32), **extra)
    w.close()
    return out
