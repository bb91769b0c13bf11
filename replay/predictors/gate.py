"""Router-based predictors: ``stale-gate[d]`` and the fresh-gate control ``ctrl``.

- ``stale-gate[d]`` (d >= 1): MoE layer l's router matrix applied to the gate input of the MoE
  layer d places earlier in ``moe_layers`` (d=1 is the FATE mechanism: predict layer l while
  layer l-1 runs), ranked by the architecture's selection rule (activation, selection bias,
  expert groups; :func:`traces.gating.selection_scores`). The first d MoE layers have no source
  and are unscored, as is a routing whose source row the trace lacks.
- ``ctrl``: layer l's router on layer l's own gate input with the same rule. On a trace whose
  gate inputs and router matrices are consistent it reproduces every routing: 100.0%. Anything
  less is a defect of the trace or of this tool; :func:`diagnose_ctrl` names a likely cause.

Logits are recomputed in float64 from the stored float32 (or float16) values: the synthetic
generator computes them that way, and float32 recomputation can flip near-ties.

Streaming: the gate inputs (n_embd floats per row, ~2 GB on a 5,000-token 48-layer trace) are
read one part file at a time, straight into one reused float64 buffer sorted by layer
(:func:`_gate_parts`); only whole batches are evaluated (a batch cut by a part boundary is
carried into the next part), so memory is bounded by one part plus one batch, whatever the trace
length. Per part, one matrix product per (target, source) layer pair, on the source layer's
contiguous block of the buffer.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
import pyarrow.parquet as pq

from replay.predictors.base import NONE, Prediction, stale_gate_name
from replay.predictors.metrics import warm_up as metrics_warm_up
from traces.gating import activation, selection_scores, top_indices
from traces.pages import ValuePages, plan_fixed_list
from traces.reader import Trace, fixed_list_to_numpy
from traces.rounding import round_input

CTRL = "ctrl"


def gate_unavailable(trace: Trace) -> str | None:
    """Why router-based predictors cannot run on ``trace`` (one sentence), or None."""
    if not trace.has("gate_input"):
        return "the trace has no gate_input column (routings only); capture gate inputs to evaluate router-based predictors"
    if not trace.has_router:
        return "the trace has no router.parquet, so the router matrices to recompute the routing are missing"
    if not trace.gating.get("activation"):
        return "trace.json gives no gating activation, so the architecture's selection rule is unknown"
    n_group = int(trace.gating.get("n_group", 1) or 1)
    if n_group > 1 and trace.n_expert % n_group:
        return f"trace.json gating n_group {n_group} does not divide n_expert {trace.n_expert}"
    return None


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
    _scatter_rows(np.zeros(2, np.float32), 0, 2, np.zeros(1, np.int64), np.zeros((1, 2)))
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
        first = pf.read_row_group(0, columns=["batch"]).column("batch")
        out.append(int(first[0].as_py()))
    return out


@numba.njit(cache=True, nogil=True)
def _scatter_rows(vals: np.ndarray, v0: int, width: int, dest: np.ndarray, out: np.ndarray) -> None:
    """Values ``vals`` (flat, row-major, starting at flat index ``v0`` of a [rows, width] column)
    into ``out[dest[row]]`` as float64: one page of a part, into its layer-sorted buffer."""
    n = vals.shape[0]
    i = 0
    while i < n:
        v = v0 + i
        r = v // width
        c = v - r * width
        m = min(width - c, n - i)
        out[dest[r], c:c + m] = vals[i:i + m]  # a slice copy vectorises; an indexed loop ran 1.5x slower
        i += m


def _read_sorted(plan: ValuePages, dest: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> bool:
    """The planned float32 column into ``out[dest[row]]`` as float64, page by page (one pass over
    the values: from the file into a small scratch, from there to their place in ``out``)."""
    v = 0
    with open(plan.path, "rb", buffering=0) as fh:
        for offset, nbytes in plan.spans:
            buf = scratch[:nbytes]
            if os.preadv(fh.fileno(), [buf], offset) != nbytes:
                return False
            vals = buf.view(np.float32)
            _scatter_rows(vals, v, plan.width, dest, out)
            v += vals.shape[0]
    return True


def _gate_parts(trace: Trace, columns: list[str], rounding: str):
    """Successive part files: (row-aligned numpy columns, gate buffer, first batch of the next
    non-empty part or None).

    The gate inputs come as float64 (rounded first, as the engine rounds the router input, when
    the trace says so) in a buffer that is *not* row-aligned: the row-aligned column
    ``gate_row`` gives each row's buffer row. Where the part's pages allow it (:mod:`traces.pages`:
    uncompressed PLAIN float32, as this package writes them) the values go from the file straight
    to their place in one reused buffer sorted by layer (stable, so each layer's rows stay in
    order): a layer's rows are then one contiguous block, which the matrix products read fastest,
    and the values cross memory once, with no Arrow level decoding and no fresh 400 MB
    allocation per part. The buffer is overwritten by the next part, so a consumer copies what
    it keeps (:func:`_chunks` does). Otherwise (float16, rounding, another layout) Arrow decodes
    the part, numpy converts it, and ``gate_row`` is the identity.

    Read and compute are deliberately *not* overlapped: on a 2-core machine a reader thread
    slowed the 2-thread matrix products by more than the reading it hid (measured: 3.2 s instead
    of 2.5 s of products for 0.5 s of reading).
    """
    n_embd = int(trace.model["n_embd"])
    narrow = [c for c in columns if c != "gate_input"]
    if "layer" not in narrow:
        narrow.append("layer")
    fast = rounding in ("none", "unknown")
    firsts = _first_batches(trace)
    buffer: np.ndarray | None = None
    scratch = np.empty(0, np.uint8)
    for k, part in enumerate(trace.parts):
        pf = pq.ParquetFile(part)
        narrow_table = pf.read(columns=narrow)  # one read for all of them
        out = {c: narrow_table.column(c).to_numpy() for c in narrow}
        n = out["layer"].shape[0]
        plan = plan_fixed_list(part, "gate_input", pf) if fast else None
        g64 = None
        if plan is not None and plan.dtype == np.float32:
            if buffer is None:
                buffer = np.empty((max(trace.part_rows), n_embd))
            largest = max((nb for _, nb in plan.spans), default=0)
            if scratch.shape[0] < largest:
                scratch = np.empty(largest, np.uint8)
            order = np.argsort(out["layer"], kind="stable")
            dest = np.empty(n, np.int64)
            dest[order] = np.arange(n)
            g64 = buffer[:n]
            if _read_sorted(plan, dest, g64, scratch):
                out["gate_row"] = dest
            else:
                g64 = None
        if g64 is None:
            g = fixed_list_to_numpy(pf.read(columns=["gate_input"]).column("gate_input"))
            if not fast:
                g = round_input(g, rounding)  # the engine rounds the router input to the weight's dot type
            g64 = g.astype(np.float64)
            out["gate_row"] = np.arange(n)
        yield out, g64, next((b for b in firsts[k + 1:] if b is not None), None)


def _rows(a: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """``a[pos]`` for sorted row positions: a view when they are evenly spaced (a layer's rows in a
    layer-sorted buffer are contiguous; in row order a decode run holds them every n_moe rows),
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
    columns, ``gate_row`` among them, and ``gate_input``, the buffer ``gate_row`` points into.

    A part's last batch may continue in the next part (part files end anywhere): unless the next
    part starts a new batch, its rows are held back (copied out of the reused buffer, in row
    order) and completed with the next part's leading rows of that batch, and flushed when a
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
                g = np.concatenate([carry["gate_input"], gate[cur["gate_row"][:j]]])
                carry = {c: np.concatenate([carry[c], cur[c][:j]]) for c in aligned}
                carry["gate_input"], carry["gate_row"] = g, np.arange(g.shape[0])
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
            carry["gate_input"] = gate[carry["gate_row"]]  # a copy: the buffer is reused
            carry["gate_row"] = np.arange(n - cut)
            carry_start = start + cut
        else:
            cut = n  # the part ends with a whole batch
        if cut:
            yield start, {**{c: cur[c][:cut] for c in aligned}, "gate_input": gate}
    if carry is not None:
        yield carry_start, carry


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
    wt = {l: np.array(w.T, dtype=np.float64, order="C") for l, (w, _) in mats.items()}  # [n_embd, n_expert]
    bias = {l: b.astype(np.float64) for l, (_, b) in mats.items()}

    def work(start: int, cur: dict[str, np.ndarray]) -> None:
        layer = cur["layer"]
        keys = (cur["batch"].astype(np.int64) << 32) | cur["step"].astype(np.int64)
        gate, gate_row = cur["gate_input"], cur["gate_row"]
        g_phase = in_phase[start:start + layer.shape[0]]
        order = np.argsort(layer, kind="stable")  # per layer, rows keep their (batch, step) order
        lay_sorted = layer[order]
        present = np.unique(lay_sorted)
        bounds = np.searchsorted(lay_sorted, present, side="left"), np.searchsorted(lay_sorted, present, side="right")
        pos = {int(l): order[a:b] for l, a, b in zip(present, *bounds)}
        for src, targets in by_source.items():
            src_pos = pos.get(src)
            if src_pos is None:
                continue
            src_keys = keys[src_pos]
            g64 = None
            for tgt, name in targets:
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
                    g64 = _rows(gate, gate_row[src_pos])  # float64; a view of a contiguous block (or strided)
                sel = i_c[ok]
                src_g = g64 if (sel.size == src_pos.size and (sel == np.arange(sel.size)).all()) else g64[sel]
                logits = src_g @ wt[tgt]
                top = rank(logits, gating, bias[tgt], width)
                ranked, scored = preds[name]
                rows = start + tgt_pos[ok]
                if with_weights:
                    pw[name][rows] = applied_weights(logits, top, gating)
                ranked[rows] = top
                scored[rows] = True

    for start, cur in _chunks(trace, ["batch", "step", "layer", "gate_input"], rounding):
        work(start, cur)
        if on_part is not None:
            on_part()
    return {name: Prediction(name, r, s, pw.get(name)) for name, (r, s) in preds.items()}


def applied_weights(logits: np.ndarray, ids: np.ndarray, gating: dict[str, Any]) -> np.ndarray:
    """The routing weights the experts ``ids`` [T, w] would receive if they were the selection
    (the rule of :func:`traces.gating.select`: unbiased probs of the chosen, normalized if
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
def _agree(g: np.ndarray, w: np.ndarray, b: np.ndarray, gating: dict[str, Any], experts: np.ndarray) -> float:
    """Share of sample routings whose expert set the matrix ``w`` reproduces exactly."""
    k = experts.shape[1]
    top = top_indices(selection_scores(g @ w.astype(np.float64).T, gating, b), k)
    return float(np.mean([set(a) == set(e) for a, e in zip(top.tolist(), experts.tolist())]))


def diagnose_ctrl(trace: Trace, failing: list[int], mats: dict[int, tuple[np.ndarray, np.ndarray]],
                  sample: int = 64) -> str:
    """A likely cause for ctrl failing on ``failing`` layers, from a sample of their routings."""
    cols = ["layer", "experts", "gate_input"] + (["logits"] if trace.has("logits") else [])
    got: dict[int, list[dict[str, np.ndarray]]] = {l: [] for l in failing}
    for table in trace.iter_tables(cols):
        lay = table.column("layer").to_numpy()
        for l in failing:
            have = sum(x["experts"].shape[0] for x in got[l])
            rows = np.flatnonzero(lay == l)[: max(0, sample - have)]
            if rows.size:
                t = table.take(rows)
                got[l].append({c: (fixed_list_to_numpy(t.column(c)) if c != "layer" else None) for c in cols})
        if all(sum(x["experts"].shape[0] for x in got[l]) >= sample for l in failing):
            break
    gating = trace.gating
    causes = []
    for l in failing:
        if not got[l]:
            continue
        g = round_input(np.concatenate([x["gate_input"] for x in got[l]]),
                        trace.meta.get("router_input_rounding", "none")).astype(np.float64)
        ex = np.concatenate([x["experts"] for x in got[l]])
        w, b = mats[l]
        own = _agree(g, w, b, gating, ex)
        others = {m: _agree(g, mats[m][0], mats[m][1], gating, ex) for m in trace.moe_layers if m != l}
        best = max(others, key=lambda m: (others[m], -m)) if others else None
        if best is not None and others[best] == 1.0 and own < 1.0:
            causes.append(f"layer {l}'s routings match layer {best}'s router matrix (router.parquet rows swapped "
                          "between layers, or the wrong layer's matrix written)")
            continue
        if w.shape[0] == w.shape[1] and _agree(g, w.T, b, gating, ex) == 1.0:
            causes.append(f"layer {l}'s routings match the transpose of its router matrix (stored transposed)")
            continue
        if "logits" in got[l][0]:
            stored = np.concatenate([x["logits"] for x in got[l]]).astype(np.float64)
            recomputed = g @ w.astype(np.float64).T
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

