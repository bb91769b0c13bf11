"""The curve's slow twin: replay the existing kernels (``replay.core.simulate.replay``, the
entry point every verb uses) once per budget, and read the same figures off each replay."""

from __future__ import annotations

import numpy as np

from replay.core.driver import ACC_HITS, ACC_LOOKUPS, ACC_READ
from replay.core.simulate import replay
from traces.util.units import MIB


def naive_curve(loads, policy: str, budgets_bytes, policy_options=None) -> dict[int, dict]:
    """{budget_bytes: {lookups, hits, read: [prefill, decode], overflow, over_budget, per_layer}}
    from one driver replay of ``policy`` at each budget."""
    out = {}
    for b in budgets_bytes:
        res = replay(loads, policy, int(b) / MIB, policy_options=policy_options)
        a = res.acc
        out[int(b)] = {
            "lookups": [int(a[p, :, ACC_LOOKUPS].sum()) for p in (0, 1)],
            "hits": [int(a[p, :, ACC_HITS].sum()) for p in (0, 1)],
            "read": [int(a[p, :, ACC_READ].sum()) for p in (0, 1)],
            "overflow": res.overflow_loads, "over_budget": res.over_budget,
            "shares": None if res.layer_share_bytes is None else np.asarray(res.layer_share_bytes).tolist(),
        }
    return out


def naive_layer_curve(loads, layer_index: int, entries: int) -> dict:
    """One layer's own LRU curve point: every layer replayed with a share of ``entries`` entries
    (layer-opt's ``entries_per_layer``; the layers do not interact) and layer ``layer_index``'s figures read."""
    L = len(loads.moe_layers)
    full = int((entries * loads.layer_expert_bytes).sum()) + 1
    res = replay(loads, "layer-opt", full / MIB, policy_options={"entries_per_layer": [entries] * L})
    a = res.acc[:, layer_index, :]
    return {"lookups": [int(a[p, ACC_LOOKUPS]) for p in (0, 1)], "hits": [int(a[p, ACC_HITS]) for p in (0, 1)],
            "read": int(a[:, ACC_READ].sum())}
