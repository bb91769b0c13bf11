"""Expert-cache replay: what each policy would have hit, read and missed at each byte budget.

Definitions used everywhere here (docs/design.md, "Replay semantics"):

- a *load* is one (batch, layer) group; a *lookup* is one unique (layer, expert) inside a load
  (a repeated id in the same load, e.g. two prefill tokens routing to the same expert, is not a
  second lookup: it only promotes recency);
- hit% = hits / lookups x 100. ``hit_pct_decode`` counts decode loads only (phase 1);
  ``hit_pct_cum`` counts all loads, prefill included (what the engine's ``cache_hit_pct`` is);
- ``read_mib`` = bytes the misses read, all phases, in MiB (2^20 bytes); bytes are not time;
- budgets are bytes = floor(budget_mib x 2^20); an entry costs its layer's ``expert_bytes``;
- ``peak_resident_mib`` = the most bytes resident at once (all layers), after any load's
  eviction step; ``overflow_loads`` = loads after which their group still held more than its
  budget (or, under ``layer``/``layerlfu``, its layer's share): nothing left to evict but the
  load's own entries. A cell with ``overflow_loads > 0`` is *over budget* (``over_budget``): its hit
  rate needs more memory than the budget it is listed under, and every table and verdict marks
  it or leaves it out (:func:`within_budget`, :func:`pick_best`; the sentence naming such cells is
  :func:`replay.present.cache.over_budget_note`).

Library API (frames in, frames out; :mod:`replay.present.cache` formats them, :mod:`replay.cli.cache`
only parses options):

- :func:`prepare_loads` / :func:`loads_of` -> :class:`Loads` (budget-independent arrays)
- :func:`replay` -> :class:`ReplayResult` (one policy at one budget; optional per-slot flags)
- :func:`sweep` -> pl.DataFrame of cache rows (many cells, parallel over cores)
- :func:`result_rows`, :func:`batch_series`, :func:`decode_token_series`
- :func:`default_budgets_mib`, :func:`validate`
- :func:`within_budget`, :func:`pick_best`: the one way every verb and the report choose a
  "best"/"fastest" cell and leave over-budget ones out
- :func:`validate_ok`: did ``--validate`` reproduce the engine (within :data:`VALIDATE_TOLERANCE_PP`)
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from replay.core.driver import (
    ACC_HITS,
    ACC_LOOKUPS,
    ACC_READ,
    ERR_VICTIM_NOT_RESIDENT,
    ERR_VICTIM_RANGE,
    N_ACC,
    N_STATS,
    OPT_AHEAD,
    OPT_CAP,
    OPT_FILL,
    OPT_GUARD,
    OPT_RETAIN,
    STAT_ERR,
    STAT_ERR_LOAD,
    STAT_ERR_VALUE,
    STAT_EVICTIONS,
    STAT_OVERFLOW,
    STAT_PEAK_BYTES,
    make_kernel,
    next_loads,
    no_options,
)
from replay.core.state import BUDGET, MAX_SLOTS, RESIDENT, new_state
from replay.policies import REG, is_plugin, names, policy_module
from traces.format.errors import UserError
from traces.io.reader import RoutingArrays, Trace, fixed_list_to_numpy
from traces.util.units import MIB, budget_bytes  # noqa: F401 (budget_bytes: re-exported, callers import it from here)

if TYPE_CHECKING:
    import polars as pl

UNBOUNDED_BYTES = np.int64(1) << np.int64(62)

_KERNELS: dict[tuple, Any] = {}
_KERNELS_LOCK = threading.Lock()


def kernel_for(policy: str, whatif: bool = False, slots: bool = False):
    """The compiled driver for ``policy``, ready to run: compiled, or loaded from Numba's on-disk
    cache, once per process, by running it on a tiny input here (so a caller's timing, or a thread
    pool's first calls, never include compilation; on a terminal the CLI's
    :func:`replay.core.progress.compile_notice` says when this compiles). ``whatif`` = the variant with
    the drop / prediction paths (a plain replay has them compiled out); ``slots`` = a plain
    variant that writes per-slot residency codes (a what-if variant always can)."""
    key = (policy, whatif, slots and not whatif)
    with _KERNELS_LOCK:
        if key not in _KERNELS:
            pm = policy_module(policy)
            try:
                kern = make_kernel(policy, pm, whatif, slots, checked=is_plugin(policy))
                tiny = _tiny_loads()
                args, stats, _ = _driver_args(tiny, pm, MIB, 0, bool(slots), None, None, no_options(), policy=policy)
                run_kernel(kern, args, is_plugin(policy), policy=policy)
                driver_error(stats, policy, pm, tiny.n_entries)
            except Exception as e:
                if not is_plugin(policy):
                    raise
                raise _plugin_error(policy, pm, e) from e
            _KERNELS[key] = kern
        return _KERNELS[key]


def _plugin_error(policy: str, pm: Any, e: Exception) -> UserError:
    """A user policy that does not compile or run in the driver: one sentence naming its file (the
    Numba traceback only under --debug, as the cause)."""
    import numba

    from replay.plugins import numba_error, where

    if isinstance(e, UserError):
        return e
    if isinstance(e, numba.core.errors.NumbaError):  # the underlying error, at its line, not Numba's pipeline header
        line, what = numba_error(e, where(pm))
        at = f"{where(pm)}" + (f", line {line}" if line is not None else "")
        return UserError(f"{at}: policy {policy!r} does not compile with Numba: {what}.")
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.startswith("\x1b")), type(e).__name__)
    return UserError(f"{where(pm)}: policy {policy!r} failed in the replay driver ({type(e).__name__}: {first[:200]}).")


def run_kernel(kern: Any, args: tuple, interruptible: bool, policy: str | None = None) -> None:
    """``kern(*args)``; with ``interruptible`` (a plugin policy's kernel) on a daemon thread that the
    caller waits for, so SIGINT / SIGTERM still reach their handlers while a plugin's compiled hook
    loops forever (a signal handler only runs in the main thread, between bytecodes, which a
    kernel running there never reaches; the kernels release the GIL). A waiting thread other than
    the main one gives up when the CLI's handler has set ``stop_requested`` (a pool's shutdown
    would otherwise join it forever); the abandoned kernel spins on until the process exits with
    the interrupt's status. Built-ins run in the calling thread (no thread per cell in sweeps).
    ``policy``: the plugin whose kernel this is; an IndexError from its bounds-checked kernel
    (:func:`replay.core.driver.make_kernel`) becomes one sentence naming its file and its state."""
    if not interruptible:
        kern(*args)
        return
    from traces.util.signals import Abandoned, stop_requested

    failed: list[BaseException] = []

    def work() -> None:
        try:
            kern(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            failed.append(e)

    t = threading.Thread(target=work, name="moe-replay plugin kernel", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.05)  # in the main thread a signal's handler runs here and its exception ends the wait
        if stop_requested.is_set() and t.is_alive():
            raise Abandoned("a plugin's kernel was left running: the command was interrupted")
    if failed:
        if policy is not None and isinstance(failed[0], IndexError):
            raise _index_error(policy, args[9], failed[0]) from failed[0]
        raise failed[0]


def _index_error(policy: str, ps: Any, e: IndexError) -> UserError:
    """A plugin's hook indexed outside an array (caught by the bounds-checked kernel): one sentence
    naming the file, the state's shape and the way to have a wrong state refused up front."""
    from replay.plugins import where

    pm = policy_module(policy)
    shape = tuple(ps.shape) if isinstance(ps, np.ndarray) else None
    hint = ("its state_shape" if hasattr(pm, "state_shape") else
            "declare state_shape(ent, grp) so that a state of the wrong shape is refused before the replay")
    return UserError(f"{where(pm)}: policy {policy!r}: a hook indexed outside an array ({e}); the state init returned has "
                     f"shape {shape}: check its size against what the hooks index ({hint}).")


def wait_result(future: Any) -> Any:
    """``future.result()``, waiting in short slices: a signal delivered to another thread of the
    process (any thread may receive it) only sets a flag the main thread checks between bytecodes,
    which a wait without a timeout never reaches; a plugin's kernel that never returns would keep
    SIGINT from being handled."""
    from concurrent.futures import TimeoutError as FutureTimeout

    while True:
        try:
            return future.result(timeout=0.1)
        except FutureTimeout:
            continue


_VICTIM_PROBLEMS = {
    ERR_VICTIM_RANGE: "which is no entry (entries are 0..{n})",
    ERR_VICTIM_NOT_RESIDENT: "an entry that is not resident",
}


def driver_error(stats: np.ndarray, policy: str, pm: Any, n_entries: int) -> None:
    """Raise, in one sentence naming the policy's file, the hook and the value, what the driver
    refused from a hook (``stats[STAT_ERR]``, :mod:`replay.core.driver`); nothing if it refused nothing."""
    code = int(stats[STAT_ERR])
    if code == 0:
        return
    from replay.plugins import where

    problem = _VICTIM_PROBLEMS.get(code, f"refused with code {code}").format(n=n_entries - 1)
    raise UserError(f"{where(pm)}: policy {policy!r}: pick_victim returned {int(stats[STAT_ERR_VALUE])} at load "
                    f"{int(stats[STAT_ERR_LOAD])}, {problem}; it must return a resident, evictable entry of the group "
                    "it is asked about, or -1.")


def check_state(ps: Any, policy: str, pm: Any, ent: np.ndarray, grp: np.ndarray, hook: str) -> None:
    """Refuse, in one sentence naming the policy's file and ``hook`` (init or setup), a state that is
    no numeric array or that differs from the shape the module declares (``state_shape(ent, grp)``,
    replay/plugin_spec.py): a hook indexing past a short state writes outside it (a crash, or
    silently wrong figures), so the shape is checked once, before the replay, never per access."""
    from replay.plugins import where

    if not isinstance(ps, np.ndarray) or ps.dtype.kind not in "iuf" or ps.ndim == 0:
        what = f"a {ps.dtype} array of shape {ps.shape}" if isinstance(ps, np.ndarray) else type(ps).__name__
        raise UserError(f"{where(pm)}: policy {policy!r}: {hook} returned {what}; the state must be a numeric numpy array.")
    if not hasattr(pm, "state_shape"):
        return
    want = pm.state_shape(ent, grp)
    try:
        want = tuple(int(x) for x in (want if isinstance(want, (tuple, list)) else (want,)))
    except (TypeError, ValueError):
        raise UserError(f"{where(pm)}: policy {policy!r}: state_shape returned {want!r}, not a tuple of sizes.") from None
    if tuple(ps.shape) != want:
        raise UserError(f"{where(pm)}: policy {policy!r}: {hook} returned a state of shape {tuple(ps.shape)}; "
                        f"its state_shape declares {want}.")


def _tiny_loads() -> Loads:
    ra = RoutingArrays(
        turn=np.zeros(2, np.int32), batch=np.array([0, 1], np.int32), phase=np.array([0, 1], np.int8),
        step=np.array([0, 1], np.int32), layer=np.zeros(2, np.int16), experts=np.array([[0], [1]], np.int32),
        weights=np.zeros((2, 1), np.float32),
    )
    return prepare_loads(ra, [0], 2, np.array([MIB]))


def check_policies(policies: list[str] | tuple[str, ...], option: str = "--policies") -> list[str]:
    """The known, distinct policy names; ``option`` is the flag the names came from (for the error)."""
    out = []
    for p in policies:
        p = p.strip()
        if not REG.known(p):
            raise UserError(f"{option}: unknown policy {p!r} (known: {', '.join(names())}).")
        if p not in out:
            out.append(p)
    if not out:
        raise UserError(f"{option}: no policy given.")
    return out


def check_policy_options(policy: str, options: dict[str, Any] | None, loads: Loads) -> dict[str, Any]:
    """``options`` for ``policy`` checked against the module's ``OPTIONS`` and resolved by its
    ``prepare_options`` (once: a resolved dict is passed through). A policy without ``OPTIONS``
    takes none."""
    if options is not None and options.get("_prepared"):
        return options
    pm = policy_module(policy)
    known = tuple(getattr(pm, "OPTIONS", ()))
    options = dict(options or {})
    for k in options:
        if k not in known:
            raise UserError(f"policy {policy}: unknown option {k!r} "
                            + (f"(it takes {', '.join(known)})." if known else "(it takes no options)."))
    if hasattr(pm, "prepare_options"):
        options = pm.prepare_options(loads, options)
    options["_prepared"] = True
    return options


@dataclass(frozen=True)
class Loads:
    """A trace cut into loads, ready for the kernels (independent of budget and policy).

    ``entries`` [R, k] int32 = lidx * n_expert + expert; rows of load ``g`` are
    ``load_start[g]:load_start[g+1]``; ``load_lidx`` indexes ``moe_layers``. Batches are
    renumbered 0..B-1 in order, and a batch's loads are consecutive: loads of batch ``b`` are
    ``batch_start[b]:batch_start[b+1]``; ``batch_turn/step/phase`` describe them (step = first
    step of the batch; a load's phase is its batch's). Per load the arrays hold only what the
    replay reads at every load (10 bytes: at top-1 decode every routing is a load); a load's
    batch and phase are derived on demand (:attr:`load_batch`, :attr:`load_phase`) for the
    analyses that want them per load.
    """

    entries: np.ndarray
    load_start: np.ndarray  # int64 [G+1]
    load_lidx: np.ndarray  # int16 [G] (MoE layers < 2^15: the format's layer column is int16)
    batch_start: np.ndarray  # int64 [B+1]
    moe_layers: tuple[int, ...]
    n_expert: int
    layer_expert_bytes: np.ndarray  # int64 [L] bytes of one expert of each MoE layer
    batch_turn: np.ndarray  # int32 [B]
    batch_step: np.ndarray  # int32 [B]
    batch_phase: np.ndarray  # int8 [B]
    # int32 [B]: tokens in each batch, the most rows any of its loads holds (a load holds one row
    # per token at its layer). One per decode batch for a single request; with many requests in
    # one batch, several: a per-token figure divides by decode_tokens, never by decode batches.
    batch_tokens: np.ndarray | None = None

    @cached_property
    def load_batch(self) -> np.ndarray:
        """int32 [G]: each load's batch (derived from ``batch_start``; not read by the replay)."""
        return np.repeat(np.arange(self.batch_start.shape[0] - 1, dtype=np.int32), np.diff(self.batch_start))

    @cached_property
    def load_phase(self) -> np.ndarray:
        """int8 [G]: each load's phase, its batch's (derived; not read by the replay)."""
        return np.repeat(self.batch_phase, np.diff(self.batch_start)).astype(np.int8, copy=False)

    @property
    def decode_tokens(self) -> int:
        """Decoded tokens (all requests): the tokens of the decode batches."""
        dec = self.batch_phase == 1
        if self.batch_tokens is None:
            return int(np.count_nonzero(dec))
        return int(self.batch_tokens[dec].sum())

    @property
    def n_entries(self) -> int:
        return len(self.moe_layers) * self.n_expert

    @cached_property
    def entry_bytes(self) -> np.ndarray:
        return np.repeat(self.layer_expert_bytes, self.n_expert).astype(np.int64)

    @cached_property
    def next_load(self) -> np.ndarray:
        return next_loads(self.entries, self.load_start, self.n_entries)

    @property
    def token_cycle_bytes(self) -> int:
        """T: one token's full routing, sum over MoE layers of top_k x expert_bytes."""
        return int(self.entries.shape[1] * self.layer_expert_bytes.sum())

    @cached_property
    def working_set_bytes(self) -> int:
        """Bytes of every distinct (layer, expert) the trace touches: where no policy misses again."""
        seen = np.zeros(self.n_entries, dtype=bool)
        seen[self.entries.ravel()] = True
        return int(self.entry_bytes[seen].sum())


def prepare_loads(arrays: RoutingArrays, moe_layers: list[int] | tuple[int, ...], n_expert: int,
                  expert_bytes: np.ndarray) -> Loads:
    """Cut routing arrays (rows ordered by (batch, layer, step), or (batch, layer, request, step)
    with many requests in one batch) into loads: one (batch, layer) group each, whatever requests
    it holds.

    ``expert_bytes`` is indexed by model layer (as ``Trace.expert_bytes``). Rows need not come
    from a valid trace: duplicate ids inside a routing are replayed as repeats. Batches must come
    in order, each of one phase (every valid trace's do; a :class:`Loads` holds a batch's loads
    consecutively and a load's phase is its batch's): anything else is refused.
    """
    moe_layers, lidx, leb = _routing_checked(arrays, moe_layers, n_expert, expert_bytes)
    experts, layer, batch = arrays.experts, arrays.layer, arrays.batch
    wide = len(moe_layers) * int(n_expert) > np.iinfo(np.int32).max
    idt = np.int64 if wide else np.int32
    entries = np.ascontiguousarray(experts.astype(idt, copy=True))
    entries += lidx[:, None] * idt(n_expert)
    entries = np.ascontiguousarray(entries, dtype=np.int32)
    R = batch.shape[0]
    if R and (batch[1:] < batch[:-1]).any():
        raise UserError("routing rows go back to an earlier batch; a replay needs rows in (batch, layer, step) order")
    bchange = np.ones(R, dtype=bool)
    bchange[1:] = batch[1:] != batch[:-1]
    if R and (~bchange[1:] & (arrays.phase[1:] != arrays.phase[:-1])).any():
        raise UserError("a batch mixes prefill and decode rows; a replay needs one phase per batch")
    change = bchange.copy()
    change[1:] |= layer[1:] != layer[:-1]
    starts = np.flatnonzero(change)
    load_start = np.append(starts, R).astype(np.int64)
    bfirst = np.flatnonzero(bchange)
    batch_start = np.append(np.flatnonzero(bchange[starts]), starts.shape[0]).astype(np.int64)
    batch_tokens = np.zeros(bfirst.shape[0], dtype=np.int32)
    if R:  # loads come in batch order: one reduceat over each batch's loads
        batch_tokens = np.maximum.reduceat(np.diff(load_start), batch_start[:-1]).astype(np.int32)
    return Loads(
        entries=entries, load_start=load_start, load_lidx=lidx[starts].astype(np.int16), batch_start=batch_start,
        moe_layers=moe_layers, n_expert=int(n_expert), layer_expert_bytes=leb,
        batch_turn=arrays.turn[bfirst].astype(np.int32), batch_step=arrays.step[bfirst].astype(np.int32),
        batch_phase=arrays.phase[bfirst].astype(np.int8), batch_tokens=batch_tokens,
    )


def _routing_checked(arrays: RoutingArrays, moe_layers: list[int] | tuple[int, ...], n_expert: int,
                     expert_bytes: np.ndarray) -> tuple[tuple[int, ...], np.ndarray, np.ndarray]:
    """What the kernels cannot check per slot, refused in words: a layer that is not a MoE layer,
    a MoE layer without expert bytes, an expert id out of range. Returns the MoE layers, each
    row's MoE layer index and each MoE layer's expert bytes."""
    moe_layers = tuple(int(x) for x in moe_layers)
    if len(moe_layers) > MAX_MOE_LAYERS:
        raise UserError(f"{len(moe_layers):,} MoE layers; a replay holds at most {MAX_MOE_LAYERS:,} (int16 layer indexes)")
    # Narrow dtypes throughout (int32 entries and layer indexes, comparisons instead of int64
    # diffs): a part of a large trace is prepared with a few bytes per row of temporaries.
    wide = len(moe_layers) * int(n_expert) > np.iinfo(np.int32).max
    idt = np.int64 if wide else np.int32
    lidx_of = np.full(max(moe_layers) + 1, -1, dtype=idt)
    lidx_of[list(moe_layers)] = np.arange(len(moe_layers))
    layer = arrays.layer
    if layer.size and (layer.min() < 0 or layer.max() >= lidx_of.shape[0]):
        raise UserError("routing rows name a layer that is not a MoE layer")
    lidx = lidx_of[layer]
    if (lidx < 0).any():
        raise UserError("routing rows name a layer that is not a MoE layer")
    leb = np.array([int(expert_bytes[l]) for l in moe_layers], dtype=np.int64)
    if (leb <= 0).any():
        # Never default a size to 0: a free layer is admitted free, never evicted, ~100% hit.
        raise UserError("a MoE layer has no expert_bytes > 0; the replay would report a free layer as hits")
    experts = arrays.experts
    if experts.size and (experts.min() < 0 or experts.max() >= n_expert):
        # The kernels index state by entry without bounds checks: an id out of range must not reach them.
        raise UserError(f"routing rows name an expert outside 0..{n_expert - 1}")
    return moe_layers, lidx, leb


# Loads.load_lidx is int16 (0..MAX_MOE_LAYERS - 1; the format's layer column is int16 too).
MAX_MOE_LAYERS = int(np.iinfo(np.int16).max) + 1

# Bytes of replay state per (layer, expert) entry: the driver's int32 field rows (cache_state.N_ENT),
# a policy's int64 rows, entry bytes and group; two replays may be alive at once (a what-if and its
# baseline, or two cells of a sweep).
STATE_BYTES_PER_ENTRY = 2 * 96


def check_state_fits(trace: Trace) -> None:
    """Refuse, before allocating anything, a trace whose (MoE layer, expert) entries the replay
    cannot hold: more than int32 entry ids, or more state than the memory available."""
    from traces.util.memory import check_fits

    L, n = len(trace.moe_layers), trace.n_expert
    what = f"{trace.path / 'trace.json'}: n_expert {n:,} x {L} MoE layers"
    check_fits(L * n * STATE_BYTES_PER_ENTRY, f"{what} (one cache-state entry per (layer, expert))")
    if L * n > np.iinfo(np.int32).max:
        raise UserError(f"{what} = {L * n:,} (layer, expert) entries, more than the replay's int32 entry ids hold "
                        f"({np.iinfo(np.int32).max:,}).")
    if L > MAX_MOE_LAYERS:
        raise UserError(f"{what}: more MoE layers than the replay's int16 layer indexes hold ({MAX_MOE_LAYERS:,}).")


# The columns a replay reads (never weights, request, token or the recorded ones).
LOAD_COLUMNS = ("turn", "batch", "phase", "step", "layer", "experts")


@dataclass(frozen=True)
class LoadPart:
    """One part's complete loads, in trace order (:func:`iter_load_parts`). ``loads`` numbers its
    batches 0.. locally; ``row0``/``load0``/``batch0`` are the global indexes of its first row, load
    and (local batch 0's) batch; ``continues``: local batch 0 is the previous part's last batch."""

    loads: Loads
    row0: int
    load0: int
    batch0: int
    continues: bool


def iter_load_parts(trace: Trace, chunk_rows: int | None = None) -> Iterator[LoadPart]:
    """The trace's loads part by part (each part file's complete loads, handed out in pieces of at
    most ``chunk_rows`` rows where given; a load longer than that is a piece of its own), reading
    only :data:`LOAD_COLUMNS`. The load a part ends with may go on in the next part: it is held
    back and handed out with the next part's loads, so every piece holds complete loads; memory is
    one part's arrays plus that load. A piece's arrays are reused for the next part: use or copy
    them before asking for the next.

    A trace opened with ``defer_rows`` (:attr:`traces.io.reader.Trace.rows_pending`) has each part's
    rows checked here as they are read, in the same pass that cuts them
    (:func:`replay.core.loads.cut_loads`), before any of its loads is handed out (the checker's
    columns are read with it: the part is read once), so a replay reads the trace once, not twice;
    a bad row raises the :class:`traces.format.errors.TraceError` that :func:`traces.open_trace` would."""
    from replay.core.loads import AT_BATCHES, AT_LOADS, AT_ROWS, new_at

    check_state_fits(trace)
    buf = _CutBuffers(trace.top_k)
    at = new_at()
    row0 = load0 = gbatch0 = 0  # global indexes of the buffers' row 0, load 0 and batch 0
    prev_gbatch: int | None = None  # global batch of the last load handed out
    for last_part in _cut_parts(trace, buf, at, stream=True):
        G = int(at[AT_LOADS])
        done = G if last_part else G - 1  # complete loads: all but the last, which may go on
        ls = buf.load_start
        ga = 0
        while ga < done:
            gb = done
            if chunk_rows:
                gb = max(ga + 1, min(done, int(np.searchsorted(ls[:done + 1], ls[ga] + chunk_rows, side="right")) - 1))
            lp, b_first, b_last = _slice_loads(trace, buf, ga, gb, int(at[AT_BATCHES]))
            gfirst = gbatch0 + b_first
            yield LoadPart(lp, row0 + int(ls[ga]), load0 + ga, gfirst, prev_gbatch is not None and gfirst == prev_gbatch)
            prev_gbatch = gbatch0 + b_last
            ga = gb
        if not last_part and done > 0:  # the held-back load becomes load 0 (and its batch batch 0)
            s, n = int(ls[done]), int(at[AT_ROWS]) - int(ls[done])
            buf.entries[:n] = buf.entries[s:s + n].copy()
            b = int(at[AT_BATCHES]) - 1  # the last load's batch is the last batch
            buf.load_start[0] = 0
            buf.load_lidx[0] = buf.load_lidx[done]
            buf.batch_start[0] = 0
            buf.batch_turn[0], buf.batch_step[0] = buf.batch_turn[b], buf.batch_step[b]
            buf.batch_phase[0], buf.batch_tokens[0] = buf.batch_phase[b], buf.batch_tokens[b]
            row0, load0, gbatch0 = row0 + s, load0 + done, gbatch0 + b
            at[AT_ROWS], at[AT_LOADS], at[AT_BATCHES] = n, 1, 1


def _cut_parts(trace: Trace, buf: _CutBuffers, at: np.ndarray, stream: bool) -> Iterator[bool]:
    """Read every part (the next on one background thread), check its rows where the trace's are
    pending, and cut them into ``buf`` after what ``at`` says it holds, in one pass
    (:func:`replay.core.loads.cut_loads`); yields after each part whether it was the last.
    ``stream``: ``buf`` holds a part (grown to fit each, keeping what it holds), not the whole trace."""
    from replay.core.loads import AT_ROWS, CUT_OK, CUT_PHASE, CUT_ROWS, CUT_UNSORTED, cut_loads, new_lay_last
    from traces.io.reader import RowChecker

    checker = RowChecker(trace) if trace.rows_pending else None
    gate = checker is not None and checker.simple
    columns = list(LOAD_COLUMNS) + (["weights"] if gate else []) if checker is None or gate else \
        list(dict.fromkeys([*LOAD_COLUMNS, *checker.columns]))
    moe = np.zeros(trace.n_layer, dtype=np.bool_)
    moe[trace.moe_layers] = True
    lidx_of = np.full(max(trace.moe_layers, default=0) + 1, -1, dtype=np.int32)
    lidx_of[trace.moe_layers] = np.arange(len(trace.moe_layers), dtype=np.int32)
    no_weights = _readonly(np.zeros((0, trace.top_k), np.float32))
    lay_last = new_lay_last(trace.n_layer)  # the gate's step state (one request), carried from part to part
    n_parts = len(trace.parts)
    n_expert, by_rank = int(trace.n_expert), bool(checker.by_rank) if checker is not None else False
    for i, t in enumerate(trace.iter_tables(columns, read_ahead=True)):
        # Read-only views of Arrow's buffers (one Numba signature whatever made them).
        c = {x: _readonly(_column_numpy(t.column(x))) for x in LOAD_COLUMNS if x != "experts"}
        c["experts"] = _readonly(fixed_list_to_numpy(t.column("experts")))
        w = _readonly(np.ascontiguousarray(fixed_list_to_numpy(t.column("weights")))) if gate else no_weights  # read flat by the gate
        if stream:
            buf.ensure(int(at[AT_ROWS]) + t.num_rows, at)
        if checker is not None and not gate:
            checker.check(trace.parts[i], t)

        cols = (c["turn"], c["batch"], c["phase"], c["step"], c["layer"], c["experts"], w, lidx_of, n_expert)
        outs = (at, buf.entries, buf.load_start, buf.load_lidx, buf.batch_start, buf.batch_turn, buf.batch_step,
                buf.batch_phase, buf.batch_tokens)
        lay_before = lay_last.copy() if gate else lay_last
        status = int(cut_loads(*cols, gate, moe, by_rank, lay_last, *outs))
        if status == CUT_ROWS:
            # The checker's own sentence, from the step state before this part; or (the gate was
            # stricter) on, the step state the checker carried past it.
            checker.req_last = {(0, int(l)): (int(lay_before[l, 0]), int(lay_before[l, 1]))  # type: ignore[union-attr]
                                for l in np.flatnonzero(lay_before[:, 0] >= 0)}
            checker.check(trace.parts[i], t)  # type: ignore[union-attr]
            lay_last = new_lay_last(trace.n_layer)
            for (_, l), (s, tu) in checker.req_last.items():  # type: ignore[union-attr]
                lay_last[l] = s, tu
            status = int(cut_loads(*cols, False, moe, by_rank, lay_last, *outs))
        elif gate:
            checker.passed(trace.parts[i], t)  # type: ignore[union-attr]
        if status != CUT_OK:
            # Only rows never checked (a trace opened with check_rows=False) get here: a layer or an
            # expert out of range is refused in prepare_loads' words, anything else in this part's.
            _routing_checked(RoutingArrays(turn=c["turn"], batch=c["batch"], phase=c["phase"], step=c["step"], layer=c["layer"],
                                           experts=c["experts"], weights=np.empty((t.num_rows, 0), np.float32)),
                             trace.moe_layers, trace.n_expert, trace.expert_bytes)
            what = {CUT_UNSORTED: "rows go back to an earlier batch", CUT_PHASE: "a batch mixes prefill and decode rows"}.get(
                status, f"rows the replay cannot cut (status {status})")
            raise UserError(f"{trace.parts[i]}: {what}; a replay needs rows in (batch, layer, step) order, one phase per batch.")
        del t, c, w, cols
        if i == 0:
            _layer_bytes(trace)
        yield i == n_parts - 1
    if checker is not None:
        trace.rows_pending = False


def _layer_bytes(trace: Trace) -> np.ndarray:
    """Bytes of one expert of each MoE layer; never 0 (a free layer would be admitted free, never
    evicted: ~100% hits)."""
    leb = np.array([int(trace.expert_bytes[l]) for l in trace.moe_layers], dtype=np.int64)
    if (leb <= 0).any():
        raise UserError("a MoE layer has no expert_bytes > 0; the replay would report a free layer as hits")
    return leb


def _column_numpy(col: Any) -> np.ndarray:
    """A scalar column as NumPy: a view of Arrow's buffer when it is one chunk without nulls
    (ChunkedArray.to_numpy copies: ~5 ms per 196,608-row part for the five key columns)."""
    if col.num_chunks == 1 and col.null_count == 0:
        return col.chunk(0).to_numpy(zero_copy_only=True)
    return col.to_numpy()


_CUT_FIELDS = (("entries", np.int32, 1), ("load_start", np.int64, 1), ("load_lidx", np.int16, 0), ("batch_start", np.int64, 1),
               ("batch_turn", np.int32, 0), ("batch_step", np.int32, 0), ("batch_phase", np.int8, 0),
               ("batch_tokens", np.int32, 0))


class _CutBuffers:
    """The arrays :func:`replay.core.loads.cut_loads` writes loads into: room for ``rows`` rows
    and as many loads and batches (``load_start`` and ``batch_start`` one more). :func:`loads_of` sizes them once for
    the whole trace; :func:`iter_load_parts` reuses them from part to part (grown when a part is
    longer: new arrays, so a piece handed out before stays valid until the next is asked for)."""

    def __init__(self, k: int, rows: int = 0) -> None:
        self.k = k
        self.rows = -1
        self.ensure(rows)

    def ensure(self, rows: int, at: np.ndarray | None = None) -> None:
        """Room for ``rows``, keeping what ``at`` says the arrays hold."""
        from replay.core.loads import AT_BATCHES, AT_LOADS, AT_ROWS

        if rows <= self.rows:
            return
        keep = {"entries": 0, "load_start": 0, "load": 0, "batch_start": 0, "batch": 0} if at is None else \
            {"entries": int(at[AT_ROWS]), "load_start": int(at[AT_LOADS]) + 1, "load": int(at[AT_LOADS]),
             "batch_start": int(at[AT_BATCHES]) + 1, "batch": int(at[AT_BATCHES])}
        for name, dt, extra in _CUT_FIELDS:
            shape = (rows, self.k) if name == "entries" else (rows + extra,)
            new = np.empty(shape, dt)
            n = keep[name] if name in keep else keep[name.split("_")[0]]
            if n and self.rows >= 0:
                new[:n] = getattr(self, name)[:n]
            setattr(self, name, new)
        self.rows = rows


def _readonly(a: np.ndarray) -> np.ndarray:
    if not a.flags.writeable:
        return a
    v = a.view()
    v.flags.writeable = False
    return v


def _slice_loads(trace: Trace, buf: _CutBuffers, ga: int, gb: int, n_batch: int) -> tuple[Loads, int, int]:
    """Loads ``ga:gb`` of ``buf`` (which holds ``n_batch`` batches) as a :class:`Loads` of their
    own (views, renumbered from 0 where they do not start at 0), and the buffer's numbers of their
    first and last batch."""
    ls = buf.load_start[ga:gb + 1]
    r_a, r_b = int(ls[0]), int(ls[-1])
    bs = buf.batch_start[:n_batch + 1]
    b_a = int(np.searchsorted(bs, ga, side="right")) - 1  # the batch of load ga
    b_b = int(np.searchsorted(bs, gb - 1, side="right"))  # one past the batch of load gb - 1
    # A batch cut by the slice starts at its first load here and ends at its last.
    starts = np.clip(bs[b_a:b_b + 1], ga, gb) - ga
    loads = Loads(entries=buf.entries[r_a:r_b], load_start=ls - r_a if r_a else ls, load_lidx=buf.load_lidx[ga:gb],
                  batch_start=starts, moe_layers=tuple(int(x) for x in trace.moe_layers), n_expert=trace.n_expert,
                  layer_expert_bytes=_layer_bytes(trace), batch_turn=buf.batch_turn[b_a:b_b],
                  batch_step=buf.batch_step[b_a:b_b], batch_phase=buf.batch_phase[b_a:b_b],
                  batch_tokens=buf.batch_tokens[b_a:b_b])
    return loads, b_a, b_b - 1


def _grow(a: np.ndarray, n: int) -> np.ndarray:
    """``a`` resized in place to ``n`` rows (realloc: no copy of the pages already written)."""
    a.resize((n, *a.shape[1:]), refcheck=False)
    return a


def loads_of(trace: Trace, chunk_rows: int | None = None) -> Loads:
    """The whole trace's :class:`Loads`: each part read, checked (where pending) and cut in one pass
    straight into arrays allocated once for the whole trace (a load or batch that runs on across
    parts just goes on; peak: the result, 10 bytes per load + 4 x top_k per routing row + 21 per batch, plus
    one part's columns). ``chunk_rows`` is accepted for :func:`iter_load_parts`' callers and changes nothing."""
    from replay.core.loads import AT_BATCHES, AT_LOADS, AT_ROWS, new_at

    check_state_fits(trace)
    buf = _CutBuffers(trace.top_k, trace.n_rows)
    at = new_at()
    for _ in _cut_parts(trace, buf, at, stream=False):
        pass
    R, G, B = int(at[AT_ROWS]), int(at[AT_LOADS]), int(at[AT_BATCHES])
    if R == 0:
        buf.load_start[0] = 0
    if B == 0:
        buf.batch_start[0] = 0
    return Loads(
        entries=_grow(buf.entries, R), load_start=_grow(buf.load_start, G + 1), load_lidx=_grow(buf.load_lidx, G),
        batch_start=_grow(buf.batch_start, B + 1), moe_layers=tuple(int(x) for x in trace.moe_layers),
        n_expert=trace.n_expert, layer_expert_bytes=_layer_bytes(trace), batch_turn=_grow(buf.batch_turn, B),
        batch_step=_grow(buf.batch_step, B), batch_phase=_grow(buf.batch_phase, B), batch_tokens=_grow(buf.batch_tokens, B),
    )


@dataclass(frozen=True)
class ReplayResult:
    """One policy at one budget. ``acc`` [2, L, N_ACC = 7] int64: per phase (0 prefill, 1 decode)
    and MoE layer, the fields ``ACC_*`` of :mod:`replay.core.driver` (lookups, hits, bytes read by
    misses, slots dropped, speculative hits, speculative fills, speculative bytes); ``bacc``
    [B, N_ACC] the same per batch; ``slots`` [R, k]
    uint8 residency code per routed slot (0 miss, 1 hit, 2 speculative hit; a repeat inside a load
    carries its lookup's code, as the engine's recorded residency does) or None."""

    policy: str
    budget_mib: float
    budget_bytes: int
    acc: np.ndarray
    bacc: np.ndarray
    evictions: int
    overflow_loads: int
    slots: np.ndarray | None
    seconds: float
    stats: np.ndarray | None = None  # int64 [N_STATS] (replay.core.driver.STAT_*)
    preload_bytes: np.ndarray | None = None  # int64 [L] bytes a policy preloaded per MoE layer before the replay (pin)
    layer_share_bytes: np.ndarray | None = None  # int64 [L] each layer's group budget under a per-layer partition, else None
    fills: np.ndarray | None = None  # int8 [R, w] what the speculative step did with each prediction (driver FILL_*), if asked

    @property
    def lookups(self) -> int:
        return int(self.acc[:, :, ACC_LOOKUPS].sum())

    @property
    def peak_resident_bytes(self) -> int | None:
        """Most bytes resident in all groups together, after any load's eviction step (or its
        speculative fills); above the budget only when a load overflowed."""
        return int(self.stats[STAT_PEAK_BYTES]) if self.stats is not None else None

    @property
    def over_budget(self) -> bool:
        """A load left its group above its budget (or its layer's share): the hit rate needs more memory."""
        return self.overflow_loads > 0

    @property
    def hits(self) -> int:
        return int(self.acc[:, :, ACC_HITS].sum())

    @property
    def hit_pct_cum(self) -> float:
        n = self.lookups
        return 100.0 * self.hits / n if n else math.nan


def _groups(loads: Loads, pm, budget: int, options: dict[str, Any] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(group of each entry, byte budget of each group): one group (the whole budget), or one per
    MoE layer (floor(budget_bytes / MoE layers) each, unless the module's ``group_budgets`` says)."""
    L, n = len(loads.moe_layers), loads.n_expert
    if pm.PARTITION == "layer":
        group = np.repeat(np.arange(L, dtype=np.int32), n)
        gbud = np.full(L, budget // L, dtype=np.int64)  # floor(budget_bytes / MoE layers) per layer
    else:
        group = np.zeros(L * n, dtype=np.int32)
        gbud = np.array([budget], dtype=np.int64)
    if hasattr(pm, "group_budgets"):
        own = np.asarray(pm.group_budgets(loads, budget, options or {}), dtype=np.int64)
        if own.shape != gbud.shape or (own < 0).any() or int(own.sum()) > budget:
            raise ValueError(f"{pm.__name__}.group_budgets: {own.shape[0]} group budgets summing to {int(own.sum())}; "
                             f"need {gbud.shape[0]} >= 0 within {budget} bytes")
        gbud = own
    if pm.UNBOUNDED:
        gbud[:] = UNBOUNDED_BYTES
    return group, gbud


def replay(loads: Loads, policy: str, budget_mib: float, seed: int = 0, slots: bool = False, *,
           drop: np.ndarray | None = None, pred: np.ndarray | None = None, ahead: int = 1, cap: int | None = None,
           guard: bool = False, retain: bool = False, fill: bool = False,
           policy_options: dict[str, Any] | None = None, fills: bool = False) -> ReplayResult:
    """Replay ``loads`` through ``policy`` at ``budget_mib`` MiB (2^20 bytes).

    ``policy_options``: the policy's parameters (its module's ``OPTIONS``), e.g. for ``pin``
    ``{"per_layer": 4, "profile": "other/trace"}``; for ``layer-opt`` ``{"entries_per_layer": [...]}``.

    What-ifs (:mod:`replay.core.driver`): ``drop`` [R, k] uint8 (1 drop-cold: skip if not
    resident, 2 skip always); ``pred`` [R, w] int32 entries predicted for each routing row (-1
    none), used by ``retain`` (protect the next ``ahead`` layers' predictions from eviction) and
    ``fill`` (read the predictions ``ahead`` layers on speculatively, at most ``cap`` predicted
    misses per layer, with the eviction ``guard`` if asked). ``fills``: record what the speculative
    step did with each prediction (``ReplayResult.fills`` [R, w] int8, the driver's FILL_* codes).
    """
    check_policies([policy], option="--policy")
    budget = budget_bytes(budget_mib)
    if loads.entries.size > MAX_SLOTS:
        raise UserError(f"the trace holds {loads.entries.size:,} routed slots; one replay handles at most {MAX_SLOTS:,}")
    pm = policy_module(policy)
    if drop is not None and drop.shape != loads.entries.shape:
        raise ValueError(f"drop flags must be [R, k] = {loads.entries.shape}, got {drop.shape}")
    if pred is not None and (retain or fill) and pred.shape[0] != loads.entries.shape[0]:
        raise ValueError(f"predictions must have one row per routing ({loads.entries.shape[0]}), got {pred.shape[0]}")
    if (retain or fill) and ahead < 1:
        raise UserError(f"predictions {ahead} layers ahead: must be >= 1.")
    if cap is not None and cap < 0:
        raise UserError(f"--cap {cap}: must be >= 0 predicted misses per layer.")
    popts = check_policy_options(policy, policy_options, loads)
    if hasattr(pm, "solve"):  # a bound computed, not replayed (opt-bound); no what-if applies to it
        if drop is not None or retain or fill or slots:
            raise UserError(f"policy {policy} is a computed bound: no what-if (drop, predictions) and no per-slot codes.")
        return pm.solve(loads, policy, float(budget_mib), budget, popts)
    kern = kernel_for(policy, whatif=drop is not None or retain or fill, slots=slots)
    opts = no_options()
    opts[OPT_AHEAD] = ahead
    opts[OPT_CAP] = -1 if cap is None else cap
    opts[OPT_GUARD] = int(guard)
    opts[OPT_RETAIN] = int(retain)
    opts[OPT_FILL] = int(fill)
    args, stats, slot_out = _driver_args(loads, pm, budget, seed, slots, drop, pred if (retain or fill) else None, opts, popts,
                                         policy=policy, fills=fills and fill)
    ent, grp = args[7], args[8]
    L = len(loads.moe_layers)
    pre = np.bincount(np.repeat(np.arange(L), loads.n_expert), weights=ent[RESIDENT, :loads.n_entries] * loads.entry_bytes,
                      minlength=L).astype(np.int64)
    shares = grp[:, BUDGET].copy() if pm.PARTITION == "layer" and not pm.UNBOUNDED else None
    t0 = time.perf_counter()
    run_kernel(kern, args, is_plugin(policy), policy=policy)
    dt = time.perf_counter() - t0
    driver_error(stats, policy, pm, loads.n_entries)
    acc, bacc = args[10], args[11]
    return ReplayResult(policy, float(budget_mib), budget, acc, bacc, int(stats[STAT_EVICTIONS]), int(stats[STAT_OVERFLOW]),
                        slot_out if slots else None, dt, stats, pre, shares, args[-1] if fills and fill else None)


def _driver_args(loads: Loads, pm, budget: int, seed: int, slots: bool, drop: np.ndarray | None, pred: np.ndarray | None,
                 opts: np.ndarray, policy_options: dict[str, Any] | None = None, *,
                 policy: str = "", fills: bool = False) -> tuple[tuple, np.ndarray, np.ndarray]:
    """The driver's arguments for one replay (fresh state, after the policy's ``setup``), its stats
    array and its slot_out array."""
    group, gbud = _groups(loads, pm, budget, policy_options)
    ent, grp = new_state(loads.entry_bytes, group, gbud)
    ps = pm.init(ent, grp, int(seed))
    check_state(ps, policy, pm, ent, grp, "init")
    if hasattr(pm, "setup"):
        built = pm.setup(ps, ent, grp, loads, budget, policy_options or {})
        if built is not None:
            ps = built  # a policy whose state depends on the trace (colibri's pass schedule) builds it here
            check_state(ps, policy, pm, ent, grp, "setup")
    L, B = len(loads.moe_layers), loads.batch_turn.shape[0]
    acc = np.zeros((2, L, N_ACC), np.int64)
    bacc = np.zeros((B, N_ACC), np.int64)
    stats = np.zeros(N_STATS, np.int64)
    R, k = loads.entries.shape
    slot_out = np.zeros((R if slots else 0, k), np.uint8)
    nxt = np.ascontiguousarray(loads.next_load) if pm.NEEDS_NEXT_USE else np.zeros((0, k), np.int32)
    drop = np.zeros((0, k), np.uint8) if drop is None else np.ascontiguousarray(drop, np.uint8)
    pred = np.zeros((0, 1), np.int32) if pred is None else np.ascontiguousarray(pred, np.int32)
    layer_info = np.stack([group[::loads.n_expert], loads.layer_expert_bytes]).T.astype(np.int64).copy()
    # The driver reads the per-slot arrays [R, k] as flat views: C-contiguous (no copy when they are already).
    args = (np.ascontiguousarray(loads.entries), loads.load_start, loads.load_lidx, loads.batch_start, loads.batch_phase,
            layer_info, nxt, ent, grp, ps, acc, bacc, stats, slot_out, drop, pred, opts,
            np.zeros((pred.shape[0] if fills else 0, pred.shape[1]), np.int8))
    return args, stats, slot_out


def warm_up(policies: list[str], whatif: bool = False, slots: bool = False) -> None:
    """Compile (or load from cache) the kernels, so timings (and a sweep's threads) exclude compilation."""
    for p in check_policies(policies):
        if not hasattr(policy_module(p), "solve"):  # a computed bound (opt-bound) has no driver to compile
            kernel_for(p, whatif, slots)


def result_rows(loads: Loads, res: ReplayResult, per_layer: bool = False, extras: bool = False) -> list[dict[str, Any]]:
    """Cache rows (docs/design.md keys first). ``lookups``/``hits``/``misses``/``read_mib`` are all
    phases (cumulative); the ``_decode`` columns count decode loads only.

    ``extras`` (a sweep sets it when a policy preloads entries or sets its own per-layer budgets,
    so other tables keep their columns) adds ``preload_mib`` (bytes a policy made resident before
    the replay, e.g. ``pin``'s pinned experts: read once up front, not in ``read_mib``; 0 for the
    others) and ``share_mib`` (a layer's budget under a per-layer partition; on the overall row
    the sum of the shares; None for a global cache)."""
    from replay.core.rows import cache_row

    out = []
    layers: list[int | None] = [None] + (list(loads.moe_layers) if per_layer else [])
    for i, layer in enumerate(layers):
        a = res.acc if layer is None else res.acc[:, i - 1: i, :]
        lk, ht, rd = ([int(x) for x in a[:, :, f].sum(axis=1)] for f in (ACC_LOOKUPS, ACC_HITS, ACC_READ))  # per phase
        overall = layer is None
        out.append(cache_row(res.policy, res.budget_mib, layer, lk, ht, rd,
                             evictions=res.evictions if overall else None, overflow_loads=res.overflow_loads if overall else None,
                             peak_resident_bytes=res.peak_resident_bytes if overall else None,
                             over_budget=res.over_budget if overall else None))
        if extras:
            pre = res.preload_bytes
            sh = res.layer_share_bytes
            out[-1]["preload_mib"] = (0.0 if pre is None else float(pre.sum() if layer is None else pre[i - 1]) / MIB)
            out[-1]["share_mib"] = None if sh is None else float(sh.sum() if layer is None else sh[i - 1]) / MIB
    return out


# -- over-budget cells and the one tie-break for "best" / "fastest" -----------------------------

def is_over_budget(row: dict[str, Any]) -> bool:
    """A cache row whose replay overflowed (some load left its group above its budget or share)."""
    return bool(row.get("overflow_loads") or 0)


def within_budget(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rows within budget, rows over budget), each in the given order."""
    ok = [r for r in rows if not is_over_budget(r)]
    over = [r for r in rows if is_over_budget(r)]
    return ok, over


def pick_best(rows: list[dict[str, Any]], value: str, highest: bool) -> dict[str, Any] | None:
    """The row with the highest (``highest``) or lowest ``value``; a missing or NaN value ranks last;
    ties go to the policy name first in alphabetical order. Every "best online" / "fastest" choice
    (the ``cache`` CLI, ``replay.present.cost.verdict``, the report) goes through here, so they break ties alike.
    Callers pass within-budget rows (:func:`within_budget`) and say which they left out."""
    def rank(r: dict[str, Any]) -> tuple:
        v = r.get(value)
        missing = v is None or (isinstance(v, float) and math.isnan(v))
        return (missing, 0.0 if missing else (-v if highest else v), str(r.get("policy")))

    return min(rows, key=rank) if rows else None



def batch_series(loads: Loads, res: ReplayResult) -> pl.DataFrame:
    """Per batch (prefill batches and decoded tokens): turn, phase, step, lookups, hits, misses, read_bytes."""
    import polars as pl

    b = res.bacc
    return pl.DataFrame({
        "turn": loads.batch_turn, "phase": loads.batch_phase, "step": loads.batch_step,
        "lookups": b[:, ACC_LOOKUPS], "hits": b[:, ACC_HITS], "misses": b[:, ACC_LOOKUPS] - b[:, ACC_HITS],
        "read_bytes": b[:, ACC_READ],
    })


def decode_token_series(loads: Loads, res: ReplayResult) -> pl.DataFrame:
    """Per decoded token (one decode batch = one token), in order: turn, step, lookups, hits,
    misses, read_bytes. Bytes are what the misses read for that token, not time: the cost model
    turns them into time. A trace whose decode batches hold several requests' tokens has no such
    series (a batch's reads are shared by its tokens): refused, never divided up silently."""
    if loads.batch_tokens is not None and (loads.batch_tokens[loads.batch_phase == 1] > 1).any():
        raise UserError(f"per-token figures need one decoded token per decode batch; this trace's decode batches hold up to "
                        f"{int(loads.batch_tokens[loads.batch_phase == 1].max())} tokens of several requests.")
    import polars as pl

    return batch_series(loads, res).filter(pl.col("phase") == 1).drop("phase")


def default_budgets_mib(loads: Loads, recorded_mib: float | None = None, n: int = 9) -> list[float]:
    """``n`` budgets, geometric from T/2 (below one token cycle, where global LRU collapses) to
    the working set W (every distinct (layer, expert) the trace touches: from there on nothing
    misses twice), each rounded to 2 significant figures; the recorded budget, if any and inside
    that span, replaces the nearest one."""
    lo = max(loads.token_cycle_bytes / 2 / MIB, 1.0)
    hi = max(loads.working_set_bytes / MIB, lo * 2)
    raw = np.geomspace(lo, hi, n)
    out = sorted({float(f"{x:.2g}") for x in raw})
    if recorded_mib is not None and lo <= recorded_mib <= hi * 1.5:
        i = int(np.argmin([abs(math.log(x / recorded_mib)) for x in out]))
        out[i] = float(recorded_mib)
        out = sorted(set(out))
    return out


def sweep(loads: Loads, policies: list[str], budgets_mib: list[float], per_layer: bool = False, seed: int = 0,
          threads: int | None = None, show_progress: bool = True, policy_options: dict[str, dict[str, Any]] | None = None,
          series: dict | None = None, **whatif: Any) -> pl.DataFrame:
    """Every (policy, budget) cell, in parallel over the cores (the kernels release the GIL): one
    row per cell as :func:`result_rows` makes it, as a frame (:func:`replay.core.rows.cache_frame`).

    Rows ordered by policy (as given) then budget (as given). ``infinite`` ignores the budget, so
    it is replayed once and its row repeated for every budget. ``whatif`` (e.g. ``pred``,
    ``ahead``, ``retain``) is passed to every :func:`replay`. ``policy_options`` maps a policy
    name to its options (:func:`replay`'s ``policy_options``). When a policy preloads entries or
    sets its own per-layer budgets (``pin``, ``layer-opt``), every row gains ``preload_mib`` and
    ``share_mib`` (:func:`result_rows`). ``series`` (a dict): filled with each cell's decode
    batches, (policy, budget) -> :class:`replay.core.series.DecodeSeries`, for paired comparisons.
    """
    from replay.core.progress import progress
    from replay.core.rows import cache_frame

    policies = check_policies(policies)
    budgets = [float(b) for b in budgets_mib]
    for b in budgets:
        budget_bytes(b)
    policy_options = dict(policy_options or {})
    for p in policy_options:
        if p not in policies:
            raise UserError(f"options given for policy {p}, which is not among the policies replayed.")
    popts = {p: check_policy_options(p, policy_options.get(p), loads) for p in policies}
    extras = any(hasattr(policy_module(p), "setup") or hasattr(policy_module(p), "group_budgets") for p in policies)
    warm_up(policies, whatif=whatif.get("drop") is not None or bool(whatif.get("retain")) or bool(whatif.get("fill")))
    if any(policy_module(p).NEEDS_NEXT_USE for p in policies):
        _ = loads.next_load
    cells = [(p, b) for p in policies for b in budgets]
    unique = {}
    for p, b in cells:
        key = (p, None) if policy_module(p).UNBOUNDED else (p, b)
        unique.setdefault(key, (p, b))
    threads = threads or min(os.cpu_count() or 1, len(unique)) or 1
    results: dict[tuple, ReplayResult] = {}
    bar_ctx = progress(len(unique), "cache replay", unit="cell", enabled=show_progress)
    with bar_ctx as bar, ThreadPoolExecutor(max_workers=threads) as pool:
        futs = {key: pool.submit(replay, loads, p, b, seed, policy_options=popts[p], **whatif) for key, (p, b) in unique.items()}
        for key, f in futs.items():
            results[key] = wait_result(f)
            bar.update(1)
    rows = []
    for p, b in cells:
        key = (p, None) if policy_module(p).UNBOUNDED else (p, b)
        r = results[key]
        if r.budget_mib != b:
            r = ReplayResult(p, b, budget_bytes(b), r.acc, r.bacc, r.evictions, r.overflow_loads, None, r.seconds, r.stats,
                             r.preload_bytes, r.layer_share_bytes)
        rows.extend(result_rows(loads, r, per_layer, extras))
        if series is not None:
            from replay.core.series import series_of

            series[(p, b)] = series_of(loads, r)
    return cache_frame(rows, extras)


def validate(trace: Trace, budget_mib: float | None = None) -> dict[str, Any]:
    """Replay LRU at the engine's budget and compare with what the engine recorded.

    Returns one row: the cache row of LRU at that budget plus ``recorded_hit_pct_cum`` (the
    engine's cumulative hit%, prefill included), ``diff_pp`` (replay - recorded, percentage
    points), ``token_max_abs_diff_pp`` (largest gap between the replay's and the engine's
    cumulative hit% after each decoded token, from metrics.parquet), and the row-by-row
    comparison with the recorded ``residency`` column: ``slots_compared``, ``slot_agree_pct``
    (routed slots whose hit/miss matches; a repeat inside a load carries its lookup's outcome on
    both sides, because that is how the engine records it), ``read_bytes_agree_pct`` (per slot
    bytes read: the first visit of a missed expert reads it, repeats read 0 on both sides) and
    ``recorded_spec_hits`` (slots the engine marked 2; prefetch is not replayed here).
    """
    rec = trace.recorded
    if budget_mib is None:
        budget_mib = rec.get("budget_mib")
        if budget_mib is None:
            raise UserError(f"{trace.path}: the trace records no cache budget; pass --budget-mib for --validate.")
    check_state_fits(trace)
    arrays = trace.arrays(recorded=True)
    loads = prepare_loads(arrays, trace.moe_layers, trace.n_expert, trace.expert_bytes)
    res = replay(loads, "lru", float(budget_mib), slots=True)
    row = result_rows(loads, res)[0]
    rec_cum = rec.get("cache_hit_pct_cum")
    row["recorded_budget_mib"] = rec.get("budget_mib")
    row["recorded_hit_pct_cum"] = rec_cum
    row["diff_pp"] = row["hit_pct_cum"] - rec_cum if rec_cum is not None else None
    row["token_max_abs_diff_pp"] = None
    m = trace.metrics()
    if m is not None:
        # Another run's metrics, or these out of order, would pass or fail the per-token comparison
        # by chance (and fewer rows than tokens would drop it in silence): the same check as cost fit.
        from replay.core.run_identity import check_metrics_of_run

        check_metrics_of_run(trace, m, arrays)
    ser = batch_series(loads, res)
    if m is not None and "cache_hit_pct" in m.columns:
        cum_l = np.cumsum(ser["lookups"].to_numpy())
        cum_h = np.cumsum(ser["hits"].to_numpy())
        dec = ser["phase"].to_numpy() == 1
        ours = 100.0 * cum_h[dec] / np.maximum(cum_l[dec], 1)
        theirs = m["cache_hit_pct"].to_numpy()
        if len(theirs) == len(ours):
            # The engine prints 2 decimals per token: a gap up to 0.005 is rounding.
            row["token_max_abs_diff_pp"] = float(np.max(np.abs(ours - theirs))) if len(ours) else None
    row["slots_compared"] = None
    row["slot_agree_pct"] = None
    row["read_bytes_agree_pct"] = None
    row["recorded_spec_hits"] = None
    row["first_disagreement"] = None
    if arrays.residency is not None:
        ours = res.slots > 0
        theirs = arrays.residency > 0
        agree = ours == theirs
        row["slots_compared"] = int(agree.size)
        row["slot_agree_pct"] = 100.0 * float(agree.mean()) if agree.size else None
        row["recorded_spec_hits"] = int((arrays.residency == 2).sum())
        if not agree.all():
            r, j = (int(x) for x in np.argwhere(~agree)[0])
            row["first_disagreement"] = (f"turn {arrays.turn[r]} step {arrays.step[r]} layer {arrays.layer[r]} slot {j} "
                                         f"expert {arrays.experts[r, j]}: replay {'hit' if ours[r, j] else 'miss'}, "
                                         f"engine {'hit' if theirs[r, j] else 'miss'}")
        if arrays.read_bytes is not None:
            mine = _slot_read_bytes(loads, res.slots)
            row["read_bytes_agree_pct"] = 100.0 * float((mine == arrays.read_bytes.astype(np.int64)).mean())
    return row


def _slot_read_bytes(loads: Loads, slots: np.ndarray) -> np.ndarray:
    """Bytes read per routed slot: the first visit of a missed entry in its load reads it, the rest 0."""
    out = np.zeros(slots.shape, np.int64)
    eb = loads.entry_bytes
    for g in range(loads.load_start.shape[0] - 1):
        lo, hi = loads.load_start[g], loads.load_start[g + 1]
        ent = loads.entries[lo:hi].ravel()
        _, first = np.unique(ent, return_index=True)
        flat = np.zeros(ent.shape[0], bool)
        flat[first] = True
        miss = slots[lo:hi].ravel() == 0
        out[lo:hi] = (np.where(flat & miss, eb[ent], 0)).reshape(hi - lo, -1)
    return out


VALIDATE_TOLERANCE_PP = 0.1  # the engine prints its cumulative hit % with one decimal


def validate_ok(row) -> bool | None:
    """Did the replay reproduce the engine (cumulative hit % within the tolerance)? None when the
    trace records no engine hit rate to compare with."""
    if row.get("diff_pp") is None:
        return None
    return abs(row["diff_pp"]) <= VALIDATE_TOLERANCE_PP
