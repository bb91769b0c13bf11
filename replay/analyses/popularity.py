"""Expert popularity per MoE layer: how routed slots spread over a layer's experts (the report's
popularity heatmap and concentration table). Arrays in, arrays and one frame out."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from traces.io.reader import Trace


@dataclass(frozen=True)
class Popularity:
    phase: str  # "decode", or "prefill" when the trace decoded nothing
    sorted_share_pct: np.ndarray  # [MoE layers, experts]: % of the phase's routings selecting the rank-r expert (0 = hottest)
    frame: pl.DataFrame  # per layer: routings, hot{k}_share_pct, hottest_expert_pct, experts_never_routed


def popularity(trace: Trace) -> Popularity:
    """Per MoE layer, the share of the phase's routings that selected each expert, experts sorted by
    popularity within the layer; and the concentration: the share of routed slots taken by the
    layer's k hottest experts (uniform routing gives k / n_expert)."""
    a = trace.arrays(recorded=False)
    k, E = trace.top_k, trace.n_expert
    layers = trace.moe_layers
    dec = a.phase == 1
    use = dec if dec.any() else np.ones_like(dec)
    phase = "decode" if dec.any() else "prefill"
    counts = np.zeros((len(layers), E))
    idx = {l: i for i, l in enumerate(layers)}
    li = np.array([idx[int(l)] for l in a.layer[use]])
    np.add.at(counts, (np.repeat(li, k), a.experts[use].reshape(-1)), 1)
    routings = counts.sum(axis=1) / k
    sorted_share = -np.sort(-counts, axis=1) / np.maximum(routings[:, None], 1) * 100.0
    hot_k = sorted_share[:, :k].sum(axis=1) / k  # share of routed slots taken by the hottest k experts
    frame = pl.DataFrame({"layer": layers, "routings": routings.astype(np.int64), f"hot{k}_share_pct": hot_k,
                          "hottest_expert_pct": sorted_share[:, 0],
                          "experts_never_routed": (counts == 0).sum(axis=1)})
    return Popularity(phase, sorted_share, frame)
