"""``layer``: the budget split equally over the MoE layers (floor(budget_bytes / MoE layers)
each); after a load, only the loaded layer evicts, its own least recent entries, never the
current load's, until it fits its share. LRU inside a layer: the ``lru`` hooks, one group per layer.
"""

from __future__ import annotations

from replay.policies.lru import init, on_admit, on_evict, on_touch, pick_victim  # noqa: F401

PARTITION = "layer"
UNBOUNDED = False
NEEDS_NEXT_USE = False
NEEDS_LAST_LOAD = False
NEEDS_TICK = False
NEEDS_FREQ = False
