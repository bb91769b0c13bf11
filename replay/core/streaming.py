"""Cache replay streamed part by part: memory bounded by one part plus the cache state.

:func:`replay_stream` reads the trace's routing parts one at a time (only the columns a replay
needs, :data:`replay.core.simulate.LOAD_COLUMNS`), cuts each into loads (:func:`replay.core.simulate.iter_load_parts`:
a load that straddles a part boundary is handed out whole with the next part) and runs every
cell's kernel on it, the cell's cache state (``ent``, ``grp``, the policy's ``ps``) and its clocks
(tick, load number, current batch; :data:`replay.core.driver.OPT_TICK0` ...) carried from part
to part. The figures are exactly those of :func:`replay.core.simulate.replay` on the whole trace's loads
(``tests/test_cache_stream.py`` checks it for every streamable policy with many tiny parts).

What streams and what does not:

- every policy whose module has no ``setup``, ``group_budgets`` or ``prepare_options`` (these
  see the whole trace before the replay: ``pin``, ``colibri``, ``layer-opt``): :func:`streamable`;
- ``belady`` (``NEEDS_NEXT_USE``) needs, for each routed slot, the next load touching its entry,
  which lies in a later part: a first pass writes each part's entries to a temporary directory,
  a backward pass over those files computes the next-use positions (global load numbers, the
  "seen" table carried from the last part to the first) into one file per part, and the replay
  reads each part's file with the part. Disk: about 8 x top_k bytes per routing row, removed at
  the end; memory: still one part;
- what-ifs (drop, predictions, retention, fills) and per-slot codes are not streamed: retention
  and fills look ahead into the next loads of a batch, which may lie in the next part.

Per-batch totals (``bacc``) are kept for the whole trace (7 int64 per batch: a decode batch of
one token holds one row per MoE layer, so well under a byte per routing row).
"""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from replay.core.driver import (
    N_ACC,
    N_STATS,
    OPT_BATCH0,
    OPT_LOAD0,
    OPT_TICK0,
    STAT_EVICTIONS,
    STAT_OVERFLOW,
    STAT_PEAK_BYTES,
    STAT_TICKS,
    next_loads_from,
    no_options,
)
from replay.core.progress import progress
from replay.core.simulate import (
    Loads,
    ReplayResult,
    _groups,
    budget_bytes,
    check_policies,
    check_state,
    check_state_fits,
    driver_error,
    iter_load_parts,
    kernel_for,
    run_kernel,
    wait_result,
)
from replay.core.state import BUDGET, MAX_SLOTS, N_ENT, NEVER, USED, new_state, row_length
from replay.policies import is_plugin, policy_module
from traces.format.errors import UserError
from traces.io.reader import Trace

# Bytes a streamed replay holds per batch (bacc: N_ACC int64) and per (layer, expert) entry of
# one cell (the driver's int32 fields; a policy's own state is at most a few int64 rows more).
BATCH_BYTES = N_ACC * 8
# ~ bytes per routing row of one part being validated (traces.io.reader's row checks, the largest
# transient) or read and cut into loads: measured about 400 per top-1 row on a 48 x 128 synthetic
# trace (1 CPU, Python 3.11, pyarrow's mimalloc pool); a rough bound, not an exact figure.
PART_BYTES_PER_ROW = 350
PART_BYTES_PER_SLOT = 50


def streamable(policy: str) -> bool:
    """Whether ``policy`` replays streamed: it needs nothing of the whole trace before the replay
    (no ``setup``, ``group_budgets`` or ``prepare_options``). ``belady`` streams with its next-use pass."""
    pm = policy_module(policy)
    return not any(hasattr(pm, h) for h in ("setup", "group_budgets", "prepare_options"))


def _shell(trace: Trace) -> Loads:
    """A :class:`Loads` with the trace's layers and sizes and no rows (what ``_groups``, ``new_state``
    and :func:`replay.core.simulate.result_rows` read)."""
    k = trace.top_k
    leb = np.array([int(trace.expert_bytes[l]) for l in trace.moe_layers], dtype=np.int64)
    if (leb <= 0).any():
        raise UserError("a MoE layer has no expert_bytes > 0; the replay would report a free layer as hits")
    z32, z8 = np.zeros(0, np.int32), np.zeros(0, np.int8)
    return Loads(entries=np.zeros((0, k), np.int32), load_start=np.zeros(1, np.int64), load_lidx=np.zeros(0, np.int16),
                 batch_start=np.zeros(1, np.int64), moe_layers=tuple(int(x) for x in trace.moe_layers), n_expert=trace.n_expert,
                 layer_expert_bytes=leb, batch_turn=z32, batch_step=z32, batch_phase=z8, batch_tokens=z32)


def _next_use_files(trace: Trace, chunk_rows: int | None, n_entries: int, tmp: Path) -> list[Path]:
    """One .npy file per part: each routed slot's next load (global number) touching its entry."""
    parts: list[tuple[Path, Path, int]] = []
    for i, part in enumerate(iter_load_parts(trace, chunk_rows)):
        e, s = tmp / f"entries-{i:06d}.npy", tmp / f"starts-{i:06d}.npy"
        np.save(e, part.loads.entries)
        np.save(s, part.loads.load_start)
        parts.append((e, s, part.load0))
    seen = np.full(n_entries, NEVER, np.int32)
    out = [tmp / f"next-{i:06d}.npy" for i in range(len(parts))]
    for i in range(len(parts) - 1, -1, -1):
        e, s, load0 = parts[i]
        np.save(out[i], next_loads_from(np.load(e), np.load(s), np.int64(load0), seen))
        e.unlink()
        s.unlink()
    return out


def replay_stream(trace: Trace, cells: list[tuple[str, float]], seed: int = 0, chunk_rows: int | None = None,
                  tmp_dir: str | Path | None = None, seen: np.ndarray | None = None, threads: int | None = None,
                  show_progress: bool = False) -> tuple[Loads, list[ReplayResult]]:
    """Replay every (policy, budget_mib) cell over the trace part by part, all cells in one pass.

    Returns (a :class:`Loads` holding the per-batch arrays and no rows, for
    :func:`replay.core.simulate.result_rows` / :func:`replay.core.simulate.batch_series`; one :class:`ReplayResult`
    per cell, equal to :func:`replay.core.simulate.replay` on :func:`replay.core.simulate.loads_of`). ``chunk_rows``
    cuts each part further (tests; a smaller peak). ``tmp_dir``: where belady's next-use files go.
    ``seen`` (bool [MoE layers x n_expert]): set True for every entry the trace touches (the
    working set, in the same pass). With several cells, each part's cells run on ``threads``
    threads (default: the cores; the kernels release the GIL), each cell's parts in order.
    """
    check_state_fits(trace)
    if trace.n_rows * trace.top_k > MAX_SLOTS:
        raise UserError(f"the trace holds {trace.n_rows * trace.top_k:,} routed slots; one replay handles at most {MAX_SLOTS:,}")
    shell = _shell(trace)
    L, k = len(shell.moe_layers), trace.top_k
    states: list[dict[str, Any]] = []
    for policy, budget_mib in cells:
        check_policies([policy], option="--policy")
        check_streamable(policy, "a streamed replay")
        pm = policy_module(policy)
        budget = budget_bytes(budget_mib)
        group, gbud = _groups(shell, pm, budget)
        ent, grp = new_state(shell.entry_bytes, group, gbud)
        ps = pm.init(ent, grp, int(seed))
        check_state(ps, policy, pm, ent, grp, "init")
        states.append({
            "policy": policy, "budget_mib": float(budget_mib), "budget": budget, "pm": pm, "kern": kernel_for(policy),
            "plugin": is_plugin(policy),
            "ent": ent, "grp": grp, "ps": ps, "acc": np.zeros((2, L, N_ACC), np.int64), "bacc": [], "tick": 0,
            "evictions": 0, "overflow": 0, "peak": int(grp[:, USED].sum()), "seconds": 0.0,
            "layer_info": np.stack([group[::shell.n_expert], shell.layer_expert_bytes]).T.astype(np.int64).copy(),
            "shares": grp[:, BUDGET].copy() if pm.PARTITION == "layer" and not pm.UNBOUNDED else None,
        })
    need_next = any(s["pm"].NEEDS_NEXT_USE for s in states)
    batches: dict[str, list[np.ndarray]] = {"turn": [], "step": [], "phase": [], "tokens": []}
    empty_next = np.zeros((0, k), np.int32)
    slot_out, drop, pred = np.zeros((0, k), np.uint8), np.zeros((0, k), np.uint8), np.zeros((0, 1), np.int32)
    ctx = tempfile.TemporaryDirectory(prefix="moe-replay-next-", dir=tmp_dir) if need_next else nullcontext(None)
    threads = max(1, min(threads or os.cpu_count() or 1, len(states)))
    pool = ThreadPoolExecutor(max_workers=threads) if threads > 1 else None
    bar = progress(sum(trace.part_rows), "cache replay (streamed)", unit="row", enabled=show_progress)
    with ctx as tmp, bar, (pool or nullcontext()):
        nexts = _next_use_files(trace, chunk_rows, shell.n_entries, Path(tmp)) if need_next else []
        for i, part in enumerate(iter_load_parts(trace, chunk_rows)):
            lp = part.loads
            B = lp.batch_turn.shape[0]
            s0 = 1 if part.continues else 0
            _append_batches(batches, lp, part.continues)
            if seen is not None and lp.entries.size:
                seen |= np.bincount(lp.entries.ravel(), minlength=seen.shape[0]).astype(np.bool_)  # 2x a fancy-index store
            nxt = np.load(nexts[i]) if need_next else empty_next

            def run(st: dict[str, Any], lp: Loads = lp, nxt: np.ndarray = nxt, B: int = B, s0: int = s0,
                    part: Any = part) -> None:
                bacc = np.zeros((B, N_ACC), np.int64)
                stats = np.zeros(N_STATS, np.int64)
                opts = no_options()
                opts[OPT_TICK0] = st["tick"]
                opts[OPT_LOAD0] = part.load0
                opts[OPT_BATCH0] = 0 if part.continues else -1
                t0 = time.perf_counter()
                run_kernel(st["kern"], (np.ascontiguousarray(lp.entries), lp.load_start, lp.load_lidx, lp.batch_start, lp.batch_phase,
                                        st["layer_info"], nxt if st["pm"].NEEDS_NEXT_USE else empty_next, st["ent"],
                                        st["grp"], st["ps"], st["acc"], bacc, stats, slot_out, drop, pred, opts,
                                        np.zeros((0, 1), np.int8)),
                           st["plugin"], policy=st["policy"])
                st["seconds"] += time.perf_counter() - t0
                driver_error(stats, st["policy"], st["pm"], shell.n_entries)
                st["tick"] = int(stats[STAT_TICKS])
                st["evictions"] += int(stats[STAT_EVICTIONS])
                st["overflow"] += int(stats[STAT_OVERFLOW])
                st["peak"] = max(st["peak"], int(stats[STAT_PEAK_BYTES]))
                if part.continues:  # the batch the previous part ended in: its totals add up
                    next(b for b in reversed(st["bacc"]) if b.shape[0])[-1] += bacc[0]
                st["bacc"].append(bacc[s0:])

            if pool is None:
                for st in states:
                    run(st)
            else:
                for f in [pool.submit(run, st) for st in states]:
                    wait_result(f)
            bar.update(lp.entries.shape[0])
            del nxt
    out = []
    for st in states:
        stats = np.zeros(N_STATS, np.int64)
        stats[STAT_EVICTIONS], stats[STAT_OVERFLOW] = st["evictions"], st["overflow"]
        stats[STAT_TICKS], stats[STAT_PEAK_BYTES] = st["tick"], st["peak"]
        bacc = np.concatenate(st["bacc"]) if st["bacc"] else np.zeros((0, N_ACC), np.int64)
        out.append(ReplayResult(st["policy"], st["budget_mib"], st["budget"], st["acc"], bacc, st["evictions"], st["overflow"],
                                None, st["seconds"], stats, np.zeros(L, np.int64), st["shares"]))

    def cat(xs: list[np.ndarray], dt: type) -> np.ndarray:
        return np.concatenate(xs).astype(dt, copy=False) if xs else np.zeros(0, dt)

    loads = Loads(entries=shell.entries, load_start=shell.load_start, load_lidx=shell.load_lidx,
                  batch_start=shell.batch_start, moe_layers=shell.moe_layers, n_expert=shell.n_expert,
                  layer_expert_bytes=shell.layer_expert_bytes, batch_turn=cat(batches["turn"], np.int32),
                  batch_step=cat(batches["step"], np.int32), batch_phase=cat(batches["phase"], np.int8),
                  batch_tokens=cat(batches["tokens"], np.int32))
    return loads, out


def _append_batches(batches: dict[str, list[np.ndarray]], lp: Loads, continues: bool) -> None:
    tokens = lp.batch_tokens if lp.batch_tokens is not None else np.ones(lp.batch_turn.shape[0], np.int32)
    if continues:
        prev = next(x for x in reversed(batches["tokens"]) if x.size)
        prev[-1] = max(prev[-1], tokens[0])
    s = 1 if continues else 0
    batches["turn"].append(lp.batch_turn[s:].copy())  # the part's arrays are reused for the next part
    batches["step"].append(lp.batch_step[s:].copy())
    batches["phase"].append(lp.batch_phase[s:].copy())
    batches["tokens"].append(tokens[s:].copy())


def stream_memory_bytes(trace: Trace, n_cells: int = 1) -> dict[str, int]:
    """Bytes a ``cache`` replay of ``trace`` holds, estimated from its metadata (no rows read):
    ``in_memory`` (the whole trace's loads, :func:`replay.core.simulate.loads_of`, plus the largest part
    being prepared) and ``streamed`` (the largest part plus the per-batch totals), each plus
    ``n_cells`` cache states."""
    R, k = trace.n_rows, trace.top_k
    L, n = len(trace.moe_layers), trace.n_expert
    part = max(trace.part_rows, default=0) * (PART_BYTES_PER_ROW + PART_BYTES_PER_SLOT * k)
    state = n_cells * (N_ENT * 4 * row_length(L * n) + 2 * 8 * L * n)
    # entries int32 [R, k]; per load (<= one per row) int64 start + int16 layer (10 B), per batch an int64
    # start (8 B, batches below): 17 B per row kept from the wider layout before (so `info`'s figure
    # stays put), which covers 10 + 8 / L for L >= 2 MoE layers (for one layer, 1 B per row short)
    loads = R * (4 * k + 17)
    batches = R // max(L, 1) + 1  # at most one batch per token routed at every MoE layer
    # per-batch totals: per part, then joined at the end (twice, for a moment); 13 B of batch keys
    per_batch = 2 * n_cells * batches * BATCH_BYTES + batches * 13
    return {"in_memory": loads + part + state + per_batch, "streamed": part + state + per_batch}


def stream_sweep(trace: Trace, policies: list[str], budgets_mib: list[float], per_layer: bool = False, seed: int = 0,
                 chunk_rows: int | None = None, show_progress: bool = False, threads: int | None = None,
                 series: dict | None = None) -> tuple[Any, Loads, int]:
    """(:func:`replay.core.simulate.sweep`'s frame, the batch-only :class:`Loads`, the working set in bytes)
    for a plain replay of streamable policies, every cell replayed in one streamed pass over the
    trace. The rows, in the same order, are those of ``sweep(loads_of(trace), policies, budgets_mib,
    per_layer, seed)``, byte for byte; the working set is ``loads_of(trace).working_set_bytes``.
    ``infinite`` (a policy that ignores the budget) is replayed once, its row repeated per budget, as sweep does.
    ``series`` as in :func:`replay.core.simulate.sweep` (each cell's decode batches, for paired comparisons)."""
    from replay.core.rows import cache_frame
    from replay.core.simulate import result_rows

    policies = check_policies(policies)
    budgets = [float(b) for b in budgets_mib]
    for b in budgets:
        budget_bytes(b)
    for p in policies:
        check_streamable(p, "a streamed replay")
    cells = [(p, b) for p in policies for b in budgets]
    unique: dict[tuple, tuple[str, float]] = {}
    for p, b in cells:
        unique.setdefault((p, None) if policy_module(p).UNBOUNDED else (p, b), (p, b))
    seen = np.zeros(len(trace.moe_layers) * trace.n_expert, dtype=np.bool_)
    loads, results = replay_stream(trace, list(unique.values()), seed=seed, chunk_rows=chunk_rows, seen=seen, threads=threads,
                                   show_progress=show_progress)
    by_key = dict(zip(unique, results, strict=True))
    rows = []
    for p, b in cells:
        r = by_key[(p, None) if policy_module(p).UNBOUNDED else (p, b)]
        if r.budget_mib != b:
            r = ReplayResult(p, b, budget_bytes(b), r.acc, r.bacc, r.evictions, r.overflow_loads, None, r.seconds, r.stats,
                             r.preload_bytes, r.layer_share_bytes)
        rows.extend(result_rows(loads, r, per_layer))
        if series is not None:
            from replay.core.series import series_of

            series[(p, b)] = series_of(loads, r)
    return cache_frame(rows), loads, int(loads.entry_bytes[seen].sum())


def sweep_stream(trace: Trace, policies: list[str], budgets_mib: list[float], per_layer: bool = False, seed: int = 0,
                 chunk_rows: int | None = None) -> Any:
    """:func:`replay.core.simulate.sweep`'s frame for a plain replay of streamable policies (:func:`stream_sweep`'s frame)."""
    return stream_sweep(trace, policies, budgets_mib, per_layer, seed, chunk_rows)[0]


def working_set_stream(trace: Trace, chunk_rows: int | None = None) -> int:
    """Bytes of every distinct (layer, expert) the trace touches (``loads_of(trace).working_set_bytes``),
    read part by part: the default budgets of a streamed ``cache`` need it before the replay."""
    shell = _shell(trace)
    seen = np.zeros(shell.n_entries, dtype=np.bool_)
    for part in iter_load_parts(trace, chunk_rows):
        seen[part.loads.entries.ravel()] = True
    return int(shell.entry_bytes[seen].sum())


@dataclass(frozen=True)
class Sizes:
    """What :func:`replay.core.simulate.default_budgets_mib` reads of a trace's loads: T and W, in bytes."""

    token_cycle_bytes: int
    working_set_bytes: int


STREAM_MODES = ("auto", "on", "off")
# --stream auto streams when the in-memory replay would hold more than AUTO_STREAM_MIB (the same
# choice on every machine), or more than this share of the memory available when it runs (the
# rest is the OS's, other programs' and this process's own). Either way the figures are the same.
AUTO_STREAM_MIB = 1024
AUTO_MEMORY_SHARE = 0.25


def check_stream_mode(mode: str, option: str = "--stream") -> str:
    if mode not in STREAM_MODES:
        raise UserError(f"{option} {mode!r} is not one of {', '.join(STREAM_MODES)}.")
    return mode


def why_not_streamable(policy: str) -> str | None:
    """Why ``policy`` cannot replay streamed (one clause), or None when it can."""
    if streamable(policy):
        return None
    return f"policy {policy} plans from the whole trace before its replay"


def check_streamable(policy: str, what: str = "--stream on") -> None:
    why = why_not_streamable(policy)
    if why is not None:
        raise UserError(f"{what}: {why}, so it cannot stream; replay it in memory (--stream off or auto).")


def auto_streams(trace: Trace, n_cells: int = 1) -> bool:
    """Whether ``--stream auto`` streams this trace (every policy must stream too): its in-memory
    estimate (:func:`stream_memory_bytes`) is above :data:`AUTO_STREAM_MIB`, or above
    :data:`AUTO_MEMORY_SHARE` of the memory available now."""
    from traces.util.memory import available_bytes
    from traces.util.units import MIB

    need = stream_memory_bytes(trace, n_cells)["in_memory"]
    return need > AUTO_STREAM_MIB * MIB or need > AUTO_MEMORY_SHARE * available_bytes()


def choose_stream(trace: Trace, policies: list[str], mode: str, in_memory_only: str | None = None, option: str = "--stream") -> bool:
    """Whether a ``cache`` replay of ``policies`` streams under ``mode`` (auto | on | off).
    ``in_memory_only``: an option in use that replays in memory only (e.g. ``--retain``). ``on``
    refuses, in one sentence, what cannot stream; ``auto`` replays it in memory instead."""
    check_stream_mode(mode, option)
    if mode == "off":
        return False
    if mode == "on":
        if in_memory_only is not None:
            raise UserError(f"{option} on: {in_memory_only} replays in memory only (it looks ahead into the next loads of a "
                            f"batch, which may lie in the next part); use {option} off or auto.")
        for p in policies:
            check_streamable(p, f"{option} on")
        return True
    if in_memory_only is not None or any(not streamable(p) for p in policies):
        return False
    return auto_streams(trace, len(policies))
