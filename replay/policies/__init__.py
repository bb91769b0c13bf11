"""Cache policies: one module per policy, each with the same hooks (see :mod:`replay.core.driver`).

A new built-in policy is one new module here plus one line in :data:`REGISTRY`. A user's policy
module anywhere on disk is added with :func:`add_policy_file` (``policy_file=`` in the API,
``--policy-file`` on the CLI; its ``NAME`` constant is the name to ask for) or through the
entry-point group ``moe_replay.policies``. Every module, built-in or not, is loaded and checked
by the same code (:mod:`replay.plugins`, :func:`validate`) and compiled into the same driver.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

from replay.plugins import Registry, where
from traces.format.errors import UserError

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
    "opt-bound": "replay.policies.opt_bound",
}

DEFAULT_POLICIES = ("lru", "lfu", "layer", "lfru", "belady", "infinite")


ENTRY_POINT_GROUP = "moe_replay.policies"
HOOKS = ("init", "on_admit", "on_touch", "pick_victim", "on_evict")
CONSTANTS = ("PARTITION", "UNBOUNDED", "NEEDS_NEXT_USE")


def validate(mod: ModuleType, name: str | None = None) -> str:
    """The policy's name (``NAME``, or the registry's key for a built-in), or one sentence naming
    the module's file and the hook or constant that is missing or wrong."""
    from traces.util.jit import is_jitted

    src = where(mod)
    got = getattr(mod, "NAME", name)
    if not isinstance(got, str) or not re.fullmatch(r"[A-Za-z0-9_.+-]+", got or ""):
        raise UserError(f"{src}: a policy module must define NAME, the policy's name (letters, digits and _ . + -).")
    if name is not None and got != name:
        raise UserError(f"{src}: NAME is {got!r} but the module is registered as {name!r}.")
    for h in HOOKS:
        f = getattr(mod, h, None)
        if f is None:
            raise UserError(f"{src}: policy {got!r} has no {h}() hook (every policy defines {', '.join(HOOKS)}; see "
                            "replay/core/driver.py).")
        if h != "init" and not is_jitted(f):
            raise UserError(f"{src}: policy {got!r}'s {h}() is not compiled with Numba: decorate it with "
                            "@njit(inline=\"always\").")
    for c in CONSTANTS:
        if not hasattr(mod, c):
            raise UserError(f"{src}: policy {got!r} does not define the constant {c} (PARTITION = \"global\" or \"layer\", "
                            "UNBOUNDED = False, NEEDS_NEXT_USE = False).")
    if mod.PARTITION not in ("global", "layer"):
        raise UserError(f"{src}: policy {got!r}: PARTITION is {mod.PARTITION!r}, must be \"global\" or \"layer\".")
    if getattr(mod, "FREQ_SINCE", "admission") not in ("run", "admission"):
        raise UserError(f"{src}: policy {got!r}: FREQ_SINCE is {mod.FREQ_SINCE!r}, must be \"run\" or \"admission\".")
    return got


REG = Registry("policy", REGISTRY, ENTRY_POINT_GROUP, validate)


def add_policy_file(path: str | Path) -> str:
    """Register the policy module in file ``path`` (any directory); returns its ``NAME``."""
    return REG.add_file(path)


def names() -> tuple[str, ...]:
    """Every registered policy: built-ins in registry order, then entry points and files."""
    return REG.names()


def policy_module(name: str) -> ModuleType:
    return REG.module(name)


def is_plugin(name: str) -> bool:
    """Whether ``name`` comes from outside this package (a file or an entry point)."""
    return REG.is_plugin(name)


def bound_policies() -> tuple[str, ...]:
    """The registry's offline bounds (a module constant ``BOUND = True``: it sees the whole trace),
    which no "best online" verdict may pick: ``belady``, ``infinite``, ``layer-opt``, ``opt-bound``."""
    return tuple(p for p in names() if getattr(policy_module(p), "BOUND", False))
