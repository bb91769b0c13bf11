"""Cache policies: one module per policy, each with the same hooks (see :mod:`replay.cache_kernel`).

A new policy is one new module here plus one line in :data:`REGISTRY`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

REGISTRY: dict[str, str] = {
    "lru": "replay.policies.lru",
    "lfu": "replay.policies.lfu",
    "lfu-incache": "replay.policies.lfu_incache",
    "random": "replay.policies.random",
    "layer": "replay.policies.layer",
    "layerlfu": "replay.policies.layerlfu",
    "layerlfu-incache": "replay.policies.layerlfu_incache",
    "lfru": "replay.policies.lfru",
    "belady": "replay.policies.belady",
    "infinite": "replay.policies.infinite",
    "s3fifo": "replay.policies.s3fifo",
    "sieve": "replay.policies.sieve",
    "least-stale": "replay.policies.least_stale",
    "pin": "replay.policies.pin",
    "layer-opt": "replay.policies.layer_opt",
    "colibri": "replay.policies.colibri",
}

DEFAULT_POLICIES = ("lru", "lfu", "layer", "lfru", "belady", "infinite")


def policy_module(name: str) -> ModuleType:
    return importlib.import_module(REGISTRY[name])


def bound_policies() -> tuple[str, ...]:
    """The registry's offline bounds (a module constant ``BOUND = True``: it sees the whole trace),
    which no "best online" verdict may pick: ``belady``, ``infinite``, ``layer-opt``."""
    return tuple(p for p in REGISTRY if getattr(policy_module(p), "BOUND", False))
