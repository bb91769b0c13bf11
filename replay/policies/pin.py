"""``pin``: the N hottest experts of every MoE layer are pinned (resident from the start, never
evicted, their bytes taken off the budget); LRU over the rest of the budget. The "pin by
frequency or trust recency?" question engine authors ask, answered on a trace.

Where the hot list comes from (options, ``policy_options={"per_layer": N, "profile": ...}``):

- default: learned from the trace's own prompt: the routed slots of the prefill loads before the
  first decode load (what the engine has processed before it decodes anything, so the choice is
  online-legal; on a multi-turn trace later turns' prompts are not used); per MoE layer the N
  experts routed most often there, ties to the lower expert id (an expert the prompt never routed
  ranks by id after the routed ones);
- ``profile``: another trace (a trace directory, or its :class:`replay.core.simulate.Loads`, or counts
  int [MoE layers, n_expert]): its whole-run routed-slot counts per layer, all phases. It must
  have the same MoE layers and expert count.

N (``per_layer``): default = as many as fit in half the budget with the same N in every layer,
floor(budget_bytes / 2 / sum over MoE layers of expert_bytes), capped at n_expert (0 below that:
pin is then plain LRU). An explicit N whose pinned bytes exceed the budget is refused.

Pinned entries are resident from the start, so their first lookup is a hit; the bytes that put
them there are not hidden: every row reports them as ``preload_mib`` (read once before the
replay, not in ``read_mib``), and they count in ``peak_resident_mib``. With N = 0 the policy is
exactly ``lru``.

Hooks: ``lru``'s list over the unpinned entries; a pinned entry is marked in the link array
(``PREV = -2``), never linked, so the victim search never sees it and a hit on it moves nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from replay.core.state import preload
from replay.policies import lru
from replay.policies.lru import PREV, init, on_admit, on_evict, pick_victim  # noqa: F401
from traces.format.errors import UserError
from traces.util.jit import njit
from traces.util.units import exact

PARTITION = "global"
UNBOUNDED = False
NEEDS_NEXT_USE = False
NEEDS_LAST_LOAD = False
NEEDS_TICK = False
NEEDS_FREQ = False
OPTIONS = ("per_layer", "profile")

PINNED = -2  # ps[2e + PREV] of a pinned entry (never in the list)


@njit(cache=True, inline="always")
def on_touch(ps, ent, grp, g, e):
    if ps[2 * e + PREV] != PINNED:
        lru.on_touch(ps, ent, grp, g, e)


def prepare_options(loads, options: dict) -> dict:
    """Check ``per_layer`` and resolve ``profile`` (a trace directory is read once) to counts
    [L, n_expert]; ``profile_name`` says where they came from."""
    out = dict(options)
    n = out.get("per_layer")
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise UserError(f"pin: per_layer {n!r} is not a whole number of experts >= 0.")
        if n > loads.n_expert:
            raise UserError(f"pin: per_layer {n} is more than the {loads.n_expert} experts of a layer.")
        out["per_layer"] = int(n)
    prof = out.get("profile")
    if prof is None:
        return out
    L = len(loads.moe_layers)
    if isinstance(prof, (str, Path)):
        from replay.core.simulate import loads_of
        from traces import open_trace

        name = str(prof)
        other = loads_of(open_trace(Path(prof)))
    elif hasattr(prof, "entries") and hasattr(prof, "moe_layers"):
        name, other = "the given loads", prof
    else:
        name, other = "the given counts", None
    if other is not None:
        if tuple(other.moe_layers) != tuple(loads.moe_layers) or other.n_expert != loads.n_expert:
            raise UserError(f"pin profile {name}: its MoE layers / experts ({len(other.moe_layers)} x {other.n_expert}) are "
                            f"not this trace's ({L} x {loads.n_expert}), so its hot list does not apply.")
        counts = np.bincount(other.entries.ravel().astype(np.int64), minlength=other.n_entries).reshape(L, other.n_expert)
    else:
        counts = np.asarray(prof)
        if counts.shape != (L, loads.n_expert) or not np.issubdtype(counts.dtype, np.integer):
            raise UserError(f"pin profile counts: must be whole counts of shape ({L}, {loads.n_expert}) "
                            f"(MoE layers x experts), got {counts.dtype} {counts.shape}.")
    out["profile"] = counts.astype(np.int64)
    out["profile_name"] = name
    return out


def hot_counts(loads, options: dict) -> tuple[np.ndarray, str]:
    """Routed-slot counts [L, n_expert] the hot list ranks by, and where they come from."""
    if options.get("profile") is not None:
        return np.asarray(options["profile"], np.int64), f"profile {options.get('profile_name', 'given')} (whole run, all phases)"
    dec = np.flatnonzero(loads.load_phase == 1)
    first = int(dec[0]) if dec.size else loads.load_start.shape[0] - 1
    prompt = loads.entries[: loads.load_start[first]].ravel().astype(np.int64)
    counts = np.bincount(prompt, minlength=loads.n_entries).reshape(len(loads.moe_layers), loads.n_expert)
    return counts, "this trace's prompt (prefill routings before the first decoded token)"


def per_layer_for(loads, budget_bytes: int, options: dict) -> int:
    """N: the option, or as many per layer as fit in half the budget (capped at n_expert)."""
    n = options.get("per_layer")
    if n is None:
        n = min(loads.n_expert, budget_bytes // 2 // int(loads.layer_expert_bytes.sum()))
    return int(n)


def hot_list(loads, budget_bytes: int, options: dict) -> np.ndarray:
    """Pinned entries int64 [L, N] (entry = lidx * n_expert + expert), each layer's hottest first;
    ties to the lower expert id."""
    counts, _ = hot_counts(loads, options)
    n = per_layer_for(loads, budget_bytes, options)
    ids = np.arange(loads.n_expert)
    out = np.empty((len(loads.moe_layers), n), np.int64)
    for li in range(len(loads.moe_layers)):
        order = np.lexsort((ids, -counts[li]))
        out[li] = li * loads.n_expert + order[:n]
    return out


def setup(ps, ent, grp, loads, budget_bytes: int, options: dict) -> None:
    pinned = hot_list(loads, budget_bytes, options)
    n = pinned.shape[1]
    need = n * int(loads.layer_expert_bytes.sum())
    if need > budget_bytes:
        raise UserError(f"pin: {n} experts per layer take {exact(need / (1 << 20))} MiB, more than the "
                        f"{exact(budget_bytes / (1 << 20))} MiB budget; pin fewer per layer.")
    for e in pinned.ravel():
        preload(ent, grp, int(e))
        ps[2 * int(e) + PREV] = PINNED


def describe(loads, budgets_bytes: list[int], options: dict) -> str:
    _, src = hot_counts(loads, options)
    ns = [per_layer_for(loads, b, options) for b in budgets_bytes]
    how = (f"{ns[0]} per layer (given)" if options.get("per_layer") is not None else
           "per layer as many as fit in half the budget (" + ", ".join(str(n) for n in ns) + " at the budgets above)")
    return (f"pin = the most-routed experts of each MoE layer in {src}, {how}, ties to the lower id, resident from the start "
            "and never evicted (their first lookup is a hit; the bytes that preloaded them are preload_mib, not in read_mib); "
            "LRU over the rest of the budget.")
