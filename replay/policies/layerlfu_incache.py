"""``layerlfu-incache``: the ``layer`` partition (floor(budget_bytes / MoE layers) per layer, only
the loaded layer evicts) with ``lfu-incache`` inside each layer: the count restarts at admission,
ties to the least recently used."""

from __future__ import annotations

from replay.policies.lfu import init, on_admit, on_evict, on_touch, pick_victim  # noqa: F401

PARTITION = "layer"
UNBOUNDED = False
NEEDS_NEXT_USE = False
NEEDS_LAST_LOAD = False
FREQ_SINCE = "admission"
