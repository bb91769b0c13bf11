"""Router-based predictors: ``stale-gate[d]`` and the fresh-gate control ``ctrl``.

- ``stale-gate[d]`` (d >= 1): MoE layer l's router matrix applied to the gate input of the MoE
  layer d places earlier in ``moe_layers`` (d=1 is the FATE mechanism: predict layer l while
  layer l-1 runs), ranked by the architecture's selection rule (activation, selection bias,
  expert groups; :func:`traces.format.gating.selection_scores`). The first d MoE layers have no source
  and are unscored, as is a routing whose source row the trace lacks.
- ``ctrl``: layer l's router on layer l's own gate input with the same rule. On a trace whose
  gate inputs and router matrices are consistent it reproduces every routing: 100.0%. Anything
  less is a defect of the trace or of this tool; :func:`diagnose_ctrl` names a likely cause.

Logits are recomputed in float64 from the stored float32 (or float16) values: the synthetic
generator computes them that way, and float32 recomputation can flip near-ties.

Streaming: the gate inputs (n_embd floats per row, ~2 GB on a 5,000-token 48-layer trace) are
read one part file at a time (:func:`_gate_parts`): the part is mapped, and each source layer's
rows are gathered as float64 into a per-thread scratch right before its matrix products. Only
whole batches are evaluated (a batch cut by a part boundary is carried into the next part), so
memory is bounded by one mapped part, one scratch per thread and one batch, whatever the trace
length. Per part, one matrix product per (target, source) layer pair; the source layers are
shared out among the cores, each thread running single-threaded BLAS (:func:`_blas_threads`).
The results do not depend on the number of threads: each pair writes only its own rows.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numba
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from threadpoolctl import threadpool_limits

from replay.predictors.base import NONE, Prediction, stale_gate_name
from replay.predictors.metrics import warm_up as metrics_warm_up
from traces.format.errors import UserError
from traces.format.gating import activation, selection_scores, top_indices
from traces.io.reader import Trace, fixed_list_to_numpy
from traces.util.jit import resolve
from traces.util.rounding import round_input

resolve()  # this module compiles with Numba itself: the lazy stand-ins (traces.util.jit) become dispatchers, the compile notice listens

CTRL = "ctrl"


def gate_unavailable(trace: Trace) -> str | None:
    """Why router-based predictors cannot run on ``trace`` (one sentence), or None."""
    if not trace.has("gate_input"):
        return "the trace has no gate_input column (routings only); capture gate inputs to evaluate router-based predictors"
    if not trace.has_router:
        return "the trace has no router.parquet, so the router matrices to recompute the routing are missing"
    if not trace.gating.get("activation"):
        return "trace.json gives no gating activation, so the architecture's selection rule is unknown"
    if trace.meta.get("router_logit_bias") and not trace.has_router_logit_bias:
        return ("trace.json says the router adds a bias to its logits (router_logit_bias, as gpt-oss does) but "
                "router.parquet stores none (no logit_bias column), so the logits cannot be recomputed")
    n_group = int(trace.gating.get("n_group", 1) or 1)
    if n_group > 1 and trace.n_expert % n_group:
        return f"trace.json gating n_group {n_group} does not divide n_expert {trace.n_expert}"
    return None


def unavailable(trace: Trace) -> str | None:
    """The registry hook: why the router predictors cannot run (the trace's columns, metadata or
    router matrices), or None."""
    reason = gate_unavailable(trace)
    return reason or matrix_problem(trace, trace.router_matrices())


def predict_many(trace: Trace, arr: Any, in_phase: np.ndarray, width: int, requested: list[tuple[str, int | None]],
                 progress: Any = None, with_weights: bool = False) -> dict[str, Prediction]:
    """The registry hook shared by ``stale-gate`` and ``ctrl``: every requested horizon (and ctrl)
    in one pass over the gate inputs. ``progress``: a tqdm-like object advanced once per part."""
    horizons = [d for fam, d in requested if fam != CTRL]
    if progress is not None:
        progress.reset(total=len(trace.parts))
    return predict_gate(trace, in_phase, horizons, any(fam == CTRL for fam, _ in requested), width,
                        trace.router_matrices(), on_part=(progress.update if progress is not None else None),
                        with_weights=with_weights)


def matrix_problem(trace: Trace, mats: dict[int, tuple[np.ndarray, np.ndarray]]) -> str | None:
    """A defect of the router matrices that makes recomputation impossible (missing, wrong shape)."""
    want = (trace.n_expert, int(trace.model.get("n_embd") or 0))
    missing = [l for l in trace.moe_layers if l not in mats]
    if missing:
        return f"router.parquet holds no matrix for MoE layer(s) {_layers(missing)}"
    for l in trace.moe_layers:
        w, b = mats[l]
        if w.shape != want:
            hint = " (stored transposed?)" if w.shape == want[::-1] else ""
            return (f"router.parquet: layer {l}'s router matrix is {list(w.shape)}, expected [n_expert, n_embd] = "
                    f"{list(want)}{hint}")
        if b.shape != (want[0],):
            return f"router.parquet: layer {l}'s selection bias has {b.shape[0]} entries, expected n_expert = {want[0]}"
    return None


def _layers(ls: list[int]) -> str:
    return ", ".join(str(l) for l in ls)


# -- kernels ------------------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def _top_w(scores: np.ndarray, w: int) -> np.ndarray:
    """The ``w`` largest per row, descending; ties go to the lower id (= a stable argsort of -scores).

    Insertion into a sorted list of w: O(n_expert * w) per row at worst instead of a full sort,
    and one comparison against the current w-th value for the (many) entries that do not enter.
    An entry enters only if strictly greater than the current w-th (an equal later id loses the
    tie); the first w entries always enter, so -inf (group-masked) experts still fill a list
    wider than the eligible set, in id order, exactly as the argsort would.
    """
    m, e = scores.shape
    out = np.empty((m, w), dtype=np.int32)
    val = np.empty(w, dtype=np.float64)
    for i in range(m):
        row = scores[i]
        thr = 0.0  # the current w-th value, once w entries are in
        for x in range(e):
            v = row[x]
            if x < w:
                p = x  # the first w always enter, insertion-sorted (stable: an equal value stays behind)
            elif v > thr:  # False for NaN too
                p = w - 1
            else:
                continue
            while p > 0 and v > val[p - 1]:
                val[p] = val[p - 1]
                out[i, p] = out[i, p - 1]
                p -= 1
            val[p] = v
            out[i, p] = x
            if x >= w - 1:
                thr = val[w - 1]
    return out


@numba.njit(cache=True, nogil=True)
def _top_w_gap(scores: np.ndarray, w: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_top_w` and, per row, the gap between the largest and the w-th value."""
    out = _top_w(scores, w)
    gap = np.empty(scores.shape[0], dtype=np.float64)
    for i in range(scores.shape[0]):
        gap[i] = scores[i, out[i, 0]] - scores[i, out[i, w - 1]]
    return out, gap


# exp(x - max) underflows to 0 below about -745: past this gap the softmax could tie experts whose
# logits differ, so such rows take the full rule.
_SOFTMAX_SAFE_GAP = 700.0


def rank(logits: np.ndarray, gating: dict[str, Any], bias: np.ndarray, width: int) -> np.ndarray:
    """Ranked expert ids ``[T, width]`` int32 by the architecture's selection rule (float64).

    Softmax without selection bias or groups ranks the logits themselves: within a row softmax
    is increasing in the logit, so the order is the same without computing it (the activation was
    ~40% of stale-gate's non-matmul time). Rows whose w-th logit lies more than 700 below the
    row's maximum take the full rule, because there exp underflows and the probabilities tie
    (ties go to the lower id). Sigmoid keeps the full rule: it saturates to exactly 1.0 for large
    logits, and those ties are real. ``softmax_weight`` ranks raw logits by definition.
    """
    act = gating.get("activation") or "softmax"
    plain = not (gating.get("selection_bias") and bias is not None) and int(gating.get("n_group", 1) or 1) <= 1
    if plain and act in ("softmax", "softmax_weight"):
        top, gap = _top_w_gap(np.ascontiguousarray(logits, dtype=np.float64), width)
        if act == "softmax":
            far = np.flatnonzero(gap > _SOFTMAX_SAFE_GAP)
            if far.size:
                top[far] = _top_w(np.ascontiguousarray(selection_scores(logits[far], gating, bias)), width)
        return top
    sel = selection_scores(logits, gating, bias)
    return _top_w(np.ascontiguousarray(sel), width)


def warm_up() -> None:
    """Compile (or load from cache) the kernels, so their compile time stays out of timings."""
    _top_w(np.zeros((1, 3)), 2)
    _top_w_gap(np.zeros((1, 3)), 2)
    z = np.zeros(4, np.float32)
    one = np.zeros(1, np.int64)
    _gather_rows(z, z, z, z, np.array([0, 4]), one, one, 2, one, np.zeros((1, 2)))
    metrics_warm_up()


# -- streaming evaluation -----------------------------------------------------------------------
def pairs_for(moe_layers: list[int], horizons: list[int], ctrl: bool) -> dict[str, list[tuple[int, int]]]:
    """{predictor name: [(target layer, source layer)]}: horizon d pairs MoE layer i with i-d."""
    out: dict[str, list[tuple[int, int]]] = {}
    for d in horizons:
        out[stale_gate_name(d)] = [(moe_layers[i], moe_layers[i - d]) for i in range(d, len(moe_layers))]
    if ctrl:
        out[CTRL] = [(l, l) for l in moe_layers]
    return out


def _first_batches(trace: Trace) -> list[int | None]:
    """The batch of each part's first row (rows are ordered by batch), None for an empty part."""
    out: list[int | None] = []
    for part in trace.parts:
        pf = pq.ParquetFile(part)
        if pf.metadata.num_rows == 0:
            out.append(None)
            continue
        try:
            first = pf.read_row_group(0, columns=["batch"]).column("batch")
        except (pa.ArrowException, OSError) as e:  # a corrupt data page: name the file, not an Arrow error
            raise UserError(f"{part}: has a corrupt or unreadable data page in column batch ({e}).") from None
        out.append(int(first[0].as_py()))
    return out


_F32 = numba.types.Array(numba.types.float32, 2, "C", readonly=True)
_I64 = numba.types.Array(numba.types.int64, 1, "A", readonly=True)
_GATHER_SIG = numba.types.void(_F32, _I64, numba.types.Array(numba.types.float64, 2, "C"))


@numba.njit(_GATHER_SIG, cache=True, nogil=True)
def _gather_rows(values: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """Rows ``rows`` of the float32 ``values`` ``[n, width]`` (a mapped file) into ``out`` as float64:
    one pass, no float32 intermediate."""
    for i in range(rows.shape[0]):
        out[i, :] = values[rows[i], :]


class _MappedGate:
    """One part's float32 gate inputs, mapped (not copied): :meth:`take` gathers rows as float64
    into a reused scratch, right before the matrix product that reads them.

    Why a map: version 2 stores the gate inputs in an Arrow IPC file (``part-NNNNN.gate_input.arrow``)
    whose values lie in the file exactly as numpy wants them; mapped, a layer's rows (5.9 MB of
    float32 on the benchmark trace) are read once, by the worker that uses them, straight into a
    scratch that stays in cache for the matrix product (a float64 copy of the whole part cost ~1 s
    per GB of first touch per call). The map lives as long as ``values`` (one part at a time). A
    file truncated *while* it is mapped would kill the process (SIGBUS); one truncated before is
    refused when it is opened.
    """

    def __init__(self, values: np.ndarray) -> None:
        self._values = values
        self.rows, self.width = values.shape

    def take(self, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (ascending is fastest) as float64 ``[len(rows), width]``: a view of this
        thread's scratch, valid until the thread's next :meth:`take`."""
        return self._gather(rows, _scratch(rows.shape[0], self.width))

    def take_copy(self, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` as a new float64 array (for what outlives the part, e.g. a carried batch,
        which can be large: it does not go through, or grow, the scratch)."""
        return self._gather(rows, np.empty((rows.shape[0], self.width)))

    def _gather(self, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        if rows.shape[0]:
            rows = np.asarray(rows, dtype=np.int64)
            if rows.min() < 0 or rows.max() >= self.rows:  # the kernel does not check bounds
                bad = int(rows[(rows < 0) | (rows >= self.rows)][0])
                raise IndexError(f"row {bad} outside the part's {self.rows} rows")
            _gather_rows(self._values, rows, out)
        return out

    def close(self) -> None:
        self._values = None  # type: ignore[assignment]  # the map goes with the last reference


def mapped_values(arr: pa.Array) -> np.ndarray:
    """A non-null fixed_size_list array's values as a ``[rows, width]`` numpy view (no copy)."""
    width = arr.type.list_size
    flat = arr.values.slice(arr.offset * width, len(arr) * width)
    return flat.to_numpy(zero_copy_only=True).reshape(-1, width)


_LOCAL = threading.local()


def _scratch(n: int, width: int) -> np.ndarray:
    """This thread's reusable float64 ``[n, width]`` buffer (grown on demand): one per worker, so a
    layer's gathered rows stay in that core's cache for its matrix product."""
    buf = getattr(_LOCAL, "buf", None)
    if buf is None or buf.shape[0] < n or buf.shape[1] != width:
        buf = _LOCAL.buf = np.empty((n, width))
    return buf[:n]


class _InMemory:
    """Gate inputs already decoded into a float64 array (the Arrow path, or a carried batch)."""

    def __init__(self, g64: np.ndarray) -> None:
        self.g64 = g64

    def take(self, rows: np.ndarray) -> np.ndarray:
        return _rows(self.g64, rows)

    def take_copy(self, rows: np.ndarray) -> np.ndarray:
        return self.g64[rows]

    def close(self) -> None:
        self.g64 = None


def _gate_parts(trace: Trace, columns: list[str], rounding: str):
    """Successive part files: (row-aligned numpy columns, gate source, first batch of the next
    non-empty part or None).

    The gate source's ``take(rows)`` gives the gate inputs of those rows as float64 (rounded
    first, as the engine rounds the router input, when the trace says so); the row-aligned
    column ``gate_row`` gives each row's index in the source. In a version 2 trace with float32
    gate inputs the source is the mapped Arrow IPC file (:class:`_MappedGate`): rows are converted on demand, one layer at a time,
    and nothing of the part is copied ahead. Otherwise (float16, rounding, another layout) Arrow
    decodes the part and numpy converts it (:class:`_InMemory`). The source is closed when the
    next part is asked for, so a consumer copies what it keeps (:func:`_chunks` does).

    Reading is not a separate stage: the workers gather each source layer's rows themselves
    (page faults included), next to the products that use them. (A reader thread beside 2-thread
    BLAS products, tried earlier, slowed the products by more than the reading it hid.)
    """
    narrow = [c for c in columns if c != "gate_input"]
    if "layer" not in narrow:
        narrow.append("layer")
    fast = rounding in ("none", "unknown")
    firsts = _first_batches(trace)
    for k in range(len(trace.parts)):
        narrow_table = trace.read_part(k, narrow)  # one read for all of them; a corrupt page names the file
        out = {c: narrow_table.column(c).to_numpy() for c in narrow}
        n = out["layer"].shape[0]
        out["gate_row"] = np.arange(n)
        gin = trace.wide(k, "gate_input")
        source: _MappedGate | _InMemory
        if fast and trace.version >= 2 and gin.type.value_type == pa.float32():
            source = _MappedGate(mapped_values(gin))  # version 2: the IPC file, mapped
        else:
            g = fixed_list_to_numpy(gin)
            if not fast:
                g = round_input(g, rounding)  # the engine rounds the router input to the weight's dot type
            source = _InMemory(g.astype(np.float64))
        del gin
        try:
            yield out, source, next((b for b in firsts[k + 1:] if b is not None), None)
        finally:
            source.close()


def _rows(a: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """``a[pos]`` for sorted row positions: a view when they are evenly spaced (in row order a
    decode run holds a layer's rows every n_moe rows; BLAS reads such a view without a copy),
    else a copy."""
    n = pos.shape[0]
    if n == 0:
        return a[:0]
    step = int(pos[1] - pos[0]) if n > 1 else 1
    if step > 0 and int(pos[-1]) == int(pos[0]) + step * (n - 1) and (n < 3 or (np.diff(pos) == step).all()):
        return a[int(pos[0]):int(pos[-1]) + 1:step]
    return a[pos]


def _chunks(trace: Trace, columns: list[str], rounding: str = "none"):
    """Yield (first global row, columns) per run of *whole* batches: the row-aligned numpy
    columns, ``gate_row`` among them, and ``gate_input``, the gate source ``gate_row`` indexes
    (``take(rows)``, see :func:`_gate_parts`).

    A part's last batch may continue in the next part (part files end anywhere): unless the next
    part starts a new batch, its rows are held back (their gate inputs copied out of the part's
    source, which closes with the part) and completed with the next part's leading rows of that batch, and flushed when a
    different batch begins or the trace ends.
    """
    aligned = [c for c in columns if c != "gate_input"] + ["gate_row"]
    carry: dict[str, np.ndarray] | None = None
    carry_start = 0
    offset = 0
    for cur, gate, next_first in _gate_parts(trace, columns, rounding):
        start = offset
        n = cur["gate_row"].shape[0]
        offset += n
        if carry is not None:
            j = int(np.searchsorted(cur["batch"], carry["batch"][0], side="right"))  # rows of the carried batch
            if j:
                g = np.concatenate([carry["gate_input"].g64, gate.take_copy(cur["gate_row"][:j])])
                carry = {c: np.concatenate([carry[c], cur[c][:j]]) for c in aligned}
                carry["gate_input"], carry["gate_row"] = _InMemory(g), np.arange(g.shape[0])
                cur = {c: cur[c][j:] for c in aligned}
                start += j
                n -= j
            if n == 0:
                continue  # the whole part belonged to the carried batch, which may go on
            yield carry_start, carry
            carry = None
        if n == 0:
            continue
        if next_first is not None and next_first == int(cur["batch"][-1]):
            cut = int(np.searchsorted(cur["batch"], cur["batch"][-1], side="left"))
            carry = {c: cur[c][cut:].copy() for c in aligned}
            carry["gate_input"] = _InMemory(gate.take_copy(carry["gate_row"]))  # the source closes with its part
            carry["gate_row"] = np.arange(n - cut)
            carry_start = start + cut
        else:
            cut = n  # the part ends with a whole batch
        if cut:
            yield start, {**{c: cur[c][:cut] for c in aligned}, "gate_input": gate}
    if carry is not None:
        yield carry_start, carry


def _workers() -> int:
    """Threads for the source layers: the cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@contextmanager
def _blas_threads(workers: int):
    """One BLAS thread per worker while the workers run matrix products side by side.

    Measured here (2 cores, OpenBLAS): two threads each running 1-thread products of these shapes
    reach the throughput of one 2-thread product, and the gathering and ranking around them then
    run on both cores too. Left as it is, OpenBLAS's idle worker spins on the second core between
    products, which halved the speed of any other thread there (a parallel gather ran 2x slower).
    """
    if workers <= 1:
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield


def predict_gate(trace: Trace, in_phase: np.ndarray, horizons: list[int], ctrl: bool, width: int,
                 mats: dict[int, tuple[np.ndarray, np.ndarray]],
                 on_part: Callable[[], None] | None = None, with_weights: bool = False) -> dict[str, Prediction]:
    """Stream the gate inputs once and rank every (target, source) pair of the requested predictors.

    Returns {name: Prediction} with ``ranked`` ``[R, width]``. Only rows with ``in_phase`` are
    computed (the others stay unscored and are never counted).
    """
    n_rows = trace.n_rows
    pairs = pairs_for(trace.moe_layers, horizons, ctrl)
    preds = {name: (np.full((n_rows, width), NONE, dtype=np.int32), np.zeros(n_rows, dtype=bool)) for name in pairs}
    pw = {name: np.full((n_rows, width), np.nan, dtype=np.float32) for name in pairs} if with_weights else {}
    by_source: dict[int, list[tuple[int, str]]] = {}
    for name, ps in pairs.items():
        for tgt, src in ps:
            by_source.setdefault(src, []).append((tgt, name))
    gating = trace.gating
    rounding = trace.meta.get("router_input_rounding", "none")
    # [n_embd, n_expert] views of the float64 matrices (Fortran order: BLAS reads the transpose as
    # fast, and the 48 transposing copies cost ~0.1 s on the benchmark trace)
    wt = {l: np.asarray(w, dtype=np.float64).T for l, (w, _) in mats.items()}
    bias = {l: b.astype(np.float64) for l, (_, b) in mats.items()}
    logit_bias = {l: b.astype(np.float64) for l, b in trace.router_logit_bias().items()}  # {} but for gpt-oss

    def one_source(start: int, cur: dict[str, np.ndarray], keys: np.ndarray, pos: dict[int, np.ndarray],
                   src: int) -> None:
        """Every target of source layer ``src`` in this chunk (the rows each target writes are its own)."""
        gate, gate_row, g_phase = cur["gate_input"], cur["gate_row"], in_phase[start:start + keys.shape[0]]
        src_pos = pos[src]
        src_keys = keys[src_pos]
        g64 = None
        for tgt, name in by_source[src]:
            tgt_pos = pos.get(tgt)
            if tgt_pos is None:
                continue
            tgt_pos = tgt_pos[g_phase[tgt_pos]]
            if not tgt_pos.size:
                continue
            i = np.searchsorted(src_keys, keys[tgt_pos])
            i_c = np.minimum(i, src_keys.size - 1)
            ok = src_keys[i_c] == keys[tgt_pos]  # the same token's row at the source layer
            if g64 is None:
                g64 = gate.take(gate_row[src_pos])  # float64, in this thread's scratch
            sel = i_c[ok]
            src_g = g64 if (sel.size == src_pos.size and (sel == np.arange(sel.size)).all()) else g64[sel]
            logits = src_g @ wt[tgt]
            if tgt in logit_bias:
                logits += logit_bias[tgt]
            top = rank(logits, gating, bias[tgt], width)
            ranked, scored = preds[name]
            rows = start + tgt_pos[ok]
            if with_weights:
                pw[name][rows] = applied_weights(logits, top, gating)
            ranked[rows] = top
            scored[rows] = True

    workers = _workers()
    with ThreadPoolExecutor(workers, thread_name_prefix="moe-replay-gate") as pool, _blas_threads(workers):
        req_col = ["request"] if trace.has("request") else []
        for start, cur in _chunks(trace, ["batch", "step", "layer", *req_col, "gate_input"], rounding):
            layer = cur["layer"]
            keys = _token_keys(cur)
            order = np.argsort(layer, kind="stable")  # per layer, rows keep their (batch, step) order
            lay_sorted = layer[order]
            present = np.unique(lay_sorted)
            bounds = np.searchsorted(lay_sorted, present, side="left"), np.searchsorted(lay_sorted, present, side="right")
            pos = {int(l): order[a:b] for l, a, b in zip(present, *bounds)}
            sources = [src for src in by_source if src in pos]
            # list() waits for every source and re-raises the first error
            list(pool.map(lambda src: one_source(start, cur, keys, pos, src), sources))  # noqa: B023 (waited on here)
            if on_part is not None:
                on_part()
    return {name: Prediction(name, r, s, pw.get(name)) for name, (r, s) in preds.items()}


def _token_keys(cur: dict[str, np.ndarray]) -> np.ndarray:
    """int64 [rows]: one key per token, equal at every layer of that token, increasing along each
    layer's rows (which come in (batch[, request], step) order). A token is (batch, step) -- and,
    with many requests in one batch, (batch, request, step): steps repeat across requests."""
    keys = (cur["batch"].astype(np.int64) << 32) | cur["step"].astype(np.int64)
    if "request" not in cur:
        return keys
    # Dense ranks of (batch, request, step) in that order (request ids span all of int64: no packing).
    b, r, s = cur["batch"].astype(np.int64), cur["request"].astype(np.int64), cur["step"].astype(np.int64)
    order = np.lexsort((s, r, b))
    bo, ro, so = b[order], r[order], s[order]
    new = np.r_[True, (bo[1:] != bo[:-1]) | (ro[1:] != ro[:-1]) | (so[1:] != so[:-1])]
    out = np.empty(b.size, dtype=np.int64)
    out[order] = np.cumsum(new) - 1
    return out


def applied_weights(logits: np.ndarray, ids: np.ndarray, gating: dict[str, Any]) -> np.ndarray:
    """The routing weights the experts ``ids`` [T, w] would receive if they were the selection
    (the rule of :func:`traces.format.gating.select`: unbiased probs of the chosen, normalized if
    ``norm_topk``, times ``scale``), float32."""
    act = gating.get("activation") or "softmax"
    if act == "softmax_weight":
        w = activation(np.take_along_axis(logits.astype(np.float64), ids, axis=1), "softmax")
    else:
        w = np.take_along_axis(activation(logits, act), ids, axis=1)
        if gating.get("norm_topk"):
            w = w / w.sum(axis=1, keepdims=True)
    return (w * float(gating.get("scale", 1.0) or 1.0)).astype(np.float32)


# -- ctrl diagnosis -----------------------------------------------------------------------------
def _agree(g: np.ndarray, w: np.ndarray, b: np.ndarray, gating: dict[str, Any], experts: np.ndarray,
           lb: np.ndarray | None = None) -> float:
    """Share of sample routings whose expert set the matrix ``w`` (plus logit bias ``lb``) reproduces exactly."""
    k = experts.shape[1]
    logits = g @ w.astype(np.float64).T
    if lb is not None:
        logits = logits + lb.astype(np.float64)
    top = top_indices(selection_scores(logits, gating, b), k)
    return float(np.mean([set(a) == set(e) for a, e in zip(top.tolist(), experts.tolist())]))


def diagnose_ctrl(trace: Trace, failing: list[int], mats: dict[int, tuple[np.ndarray, np.ndarray]],
                  sample: int = 64) -> str:
    """A likely cause for ctrl failing on ``failing`` layers, from a sample of their routings."""
    cols = ["layer", "step", "experts", "gate_input"] + (["logits"] if trace.has("logits") else [])
    got: dict[int, list[dict[str, np.ndarray]]] = {l: [] for l in failing}
    # Non-finite values are named as such (not blamed on near-ties): in the matrices (in memory
    # already) and in any gate input of a failing layer (the whole layer is scanned, not a sample).
    causes = []
    for l in failing:
        if l in mats and not (np.isfinite(mats[l][0]).all() and np.isfinite(mats[l][1]).all()):
            causes.append(f"router.parquet's matrix or selection bias for layer {l} holds NaN or infinite values")
    nan_rows: dict[int, list[int]] = {l: [0, -1] for l in failing}  # [rows with a non-finite gate input, first step]
    for table in trace.iter_tables(cols):
        lay = table.column("layer").to_numpy()
        gin = None
        for l in failing:
            sel = np.flatnonzero(lay == l)
            if not sel.size:
                continue
            if gin is None:
                gin = fixed_list_to_numpy(table.column("gate_input"))
            bad = sel[~np.isfinite(gin[sel]).all(axis=1)]
            if bad.size:
                if not nan_rows[l][0]:
                    nan_rows[l][1] = int(table.column("step")[int(bad[0])].as_py())
                nan_rows[l][0] += int(bad.size)
            have = sum(x["experts"].shape[0] for x in got[l])
            rows = sel[: max(0, sample - have)]
            if rows.size:
                t = table.take(rows)
                got[l].append({c: (fixed_list_to_numpy(t.column(c)) if c not in ("layer", "step") else None) for c in cols})
    for l in failing:
        if nan_rows[l][0]:
            causes.append(f"layer {l}: {nan_rows[l][0]} routing(s) have a gate input holding NaN or infinity (the first "
                          f"at step {nan_rows[l][1]}), so no router can reproduce them")
    named = {l for l in failing if nan_rows[l][0] or (l in mats and not (np.isfinite(mats[l][0]).all()
                                                                           and np.isfinite(mats[l][1]).all()))}
    failing = [l for l in failing if l not in named]
    gating = trace.gating
    lbias = trace.router_logit_bias()  # {} but for gpt-oss; stored logits include it (what the router ranks)
    for l in failing:
        if not got[l]:
            continue
        g = round_input(np.concatenate([x["gate_input"] for x in got[l]]),
                        trace.meta.get("router_input_rounding", "none")).astype(np.float64)
        ex = np.concatenate([x["experts"] for x in got[l]])
        w, b = mats[l]
        own = _agree(g, w, b, gating, ex, lbias.get(l))
        others = {m: _agree(g, mats[m][0], mats[m][1], gating, ex, lbias.get(m)) for m in trace.moe_layers if m != l}
        best = max(others, key=lambda m: (others[m], -m)) if others else None
        if best is not None and others[best] == 1.0 and own < 1.0:
            causes.append(f"layer {l}'s routings match layer {best}'s router matrix (router.parquet rows swapped "
                          "between layers, or the wrong layer's matrix written)")
            continue
        if w.shape[0] == w.shape[1] and _agree(g, w.T, b, gating, ex, lbias.get(l)) == 1.0:
            causes.append(f"layer {l}'s routings match the transpose of its router matrix (stored transposed)")
            continue
        if "logits" in got[l][0]:
            stored = np.concatenate([x["logits"] for x in got[l]]).astype(np.float64)
            if not np.isfinite(stored).all():
                causes.append(f"layer {l}: the stored logits hold NaN or infinite values")
                continue
            recomputed = g @ w.astype(np.float64).T + (lbias[l].astype(np.float64) if l in lbias else 0.0)
            scale = max(float(np.abs(stored).max()), 1e-30)
            err = float(np.abs(recomputed - stored).max()) / scale
            from_stored = float(np.mean([set(a) == set(e) for a, e in zip(
                top_indices(selection_scores(stored, gating, b), ex.shape[1]).tolist(), ex.tolist())]))
            if err > 1e-3:
                causes.append(f"layer {l}: recomputed logits differ from the stored logits (max relative error {err:.2g}): "
                              "the gate inputs or the router matrix are not the ones the engine used")
                continue
            if from_stored < 1.0:
                causes.append(f"layer {l}: even the stored logits do not reproduce the routings under trace.json's gating "
                              f"({gating.get('activation')}, selection_bias={gating.get('selection_bias')}, "
                              f"n_group={gating.get('n_group')}): the gating metadata does not describe this engine")
                continue
            causes.append(f"layer {l}: logits match to {err:.2g} but near-ties flip (a float16/quantized router "
                          "recomputed in float64?)")
            continue
        causes.append(f"layer {l}: no other layer's matrix nor the transpose explains it; check trace.json's gating "
                      "(activation, selection bias, groups) and whether the router is quantized")
    return "; ".join(causes) if causes else "no sample routings to diagnose"

