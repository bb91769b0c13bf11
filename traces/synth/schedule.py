"""Batch per-request routing logs into engine compute batches by a stated schedule.

Server engines (vLLM's ``return_routed_experts``, SGLang's ``return_routed_experts``) hand back
the routing of each request on its own, with no record of which requests shared a forward pass.
The replay needs batches (one (batch, layer) group is one load), so an importer builds them by a
schedule it names; the same log re-batched at ``max_batch`` 1, 8 or 64 answers "how does the
expert cache behave at batch 1, 8, 64?".

Schedules (the rule is the whole contract; README "Many requests in one batch" says the same):

- ``sequential``: one request after another, in the order given. A request's prompt is one
  prefill batch (all its routed prompt positions), then each generated position is one decode
  batch of one token.
- ``continuous``: SGLang's default scheduler (prefill first, no mixed batches). Requests are
  admitted in the order given. At every engine step:

  1. if a request is part-way through its prompt (a chunked prefill), or a request waits and fewer
     than ``max_batch`` requests are admitted, the step is a *prefill batch*: first the next chunk
     of the part-way prompt, then waiting requests are admitted in order while fewer than
     ``max_batch`` are admitted and the step's token budget (``prefill_chunk`` routed prompt
     positions; ``None`` = unbounded) is not spent. Each takes as many of its remaining prompt
     positions as the budget leaves; a prompt that does not fit is continued by the next prefill
     batch (at most one prompt is part-way at a time, so the batch closes there);
  2. otherwise the step is a *decode batch*: every admitted request whose prompt is done routes
     its next generated position (one token each, so a decode batch holds at most ``max_batch``
     tokens); a request leaves after its last position.

  Decoding requests wait while a prefill batch runs (as SGLang without ``--enable-mixed-chunk``);
  a batch therefore never mixes prefill and decode rows. ``sequential`` is exactly
  ``continuous`` with ``max_batch=1`` and no ``prefill_chunk``.

A position the engine did not route in this run (``routed`` False: vLLM's prefix cache) is absent
from the output but keeps its position: the ``step`` of every later position is its index in the
request. An unrouted prompt position was not computed, so it takes no prefill budget; an unrouted
generated position still takes its decode step (its batch), with no rows.

The output is the routing columns of :class:`traces.io.writer.TraceWriter` (``turn`` 0 throughout:
requests are not turns), rows in the format's order for traces with a request column: (batch,
layer, request, step). Batches are numbered 0, 1, ... over the batches that hold rows.
"""

from __future__ import annotations

import shutil
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from traces.format.errors import UserError
from traces.format.schema import MAX_INT32, MAX_LAYERS
from traces.util.units import PHASE_DECODE, PHASE_PREFILL

MODES = ("sequential", "continuous")


@dataclass(frozen=True)
class RequestRoutes:
    """The routing of one request, as a server engine returns it (positions in request order)."""

    request: int  # request id
    prompt_len: int  # number of prompt (prefill) positions at the start
    experts: np.ndarray  # int32 [positions, moe_layers, k], prompt positions first, then generated
    weights: np.ndarray | None = None  # float32 same shape, or None (-> NaN)
    routed: np.ndarray | None = None  # bool [positions]; False = not routed in this run (prefix cache): absent, keeps its step
    token_ids: np.ndarray | None = None  # int32 [positions]
    logits: np.ndarray | None = None  # float32 [positions, moe_layers, n_expert] or None


def _check_requests(requests: Sequence[RequestRoutes]) -> tuple[int, int, bool, bool, int | None]:
    """(moe_layers, k, has_token, has_logits, n_expert) shared by all requests, or a UserError."""
    if len(requests) == 0:
        raise UserError("schedule: no requests to schedule.")
    seen: set[int] = set()
    shape: tuple[int, int] | None = None
    n_expert: int | None = None
    with_tokens = [r.token_ids is not None for r in requests]
    with_logits = [r.logits is not None for r in requests]
    if any(with_tokens) and not all(with_tokens):
        i = with_tokens.index(False)
        raise UserError(f"schedule: request {requests[i].request} has no token ids while others have them "
                        "(a trace's token column is all or nothing).")
    if any(with_logits) and not all(with_logits):
        i = with_logits.index(False)
        raise UserError(f"schedule: request {requests[i].request} has no router logits while others have them "
                        "(a trace's logits column is all or nothing).")
    for r in requests:
        rid = r.request
        if isinstance(rid, (bool, np.bool_)) or not isinstance(rid, (int, np.integer)) or not -(1 << 63) <= int(rid) < 1 << 63:
            raise UserError(f"schedule: request id {rid!r} is not a 64-bit integer.")
        if int(rid) in seen:
            raise UserError(f"schedule: request id {rid} appears twice.")
        seen.add(int(rid))
        ex = np.asarray(r.experts)
        if ex.ndim != 3 or not np.issubdtype(ex.dtype, np.integer):
            raise UserError(f"schedule: request {rid}'s experts are not an integer array [positions, moe_layers, k] "
                            f"(got {ex.dtype} with shape {ex.shape}).")
        P, L, k = ex.shape
        if L < 1 or k < 1 or L > MAX_LAYERS:
            raise UserError(f"schedule: request {rid}'s experts have shape {ex.shape}: need 1..{MAX_LAYERS} MoE layers and k >= 1.")
        if shape is None:
            shape = (L, k)
        elif shape != (L, k):
            raise UserError(f"schedule: request {rid} routes {L} MoE layers x top-{k}, the first request "
                            f"{shape[0]} x top-{shape[1]}.")
        if P > MAX_INT32:
            raise UserError(f"schedule: request {rid} has {P} positions, more than int32 steps hold.")
        pl_ = r.prompt_len
        if isinstance(pl_, (bool, np.bool_)) or not isinstance(pl_, (int, np.integer)) or not 0 <= pl_ <= P:
            raise UserError(f"schedule: request {rid} has prompt_len {pl_!r}, not an integer in 0..{P} (its positions).")
        if ex.size and (ex.min() < 0 or ex.max() > MAX_INT32):
            raise UserError(f"schedule: request {rid} names a negative expert id (or one beyond int32); an unrouted "
                            "position is marked in 'routed', never by an expert id.")
        if r.weights is not None and np.shape(r.weights) != ex.shape:
            raise UserError(f"schedule: request {rid}'s weights have shape {np.shape(r.weights)}, its experts {ex.shape}.")
        if r.routed is not None:
            m = np.asarray(r.routed)
            if m.shape != (P,) or m.dtype != np.bool_:
                raise UserError(f"schedule: request {rid}'s routed mask is not a bool array of its {P} positions "
                                f"(got {m.dtype} with shape {m.shape}).")
        if r.token_ids is not None:
            t = np.asarray(r.token_ids)
            if t.shape != (P,) or not np.issubdtype(t.dtype, np.integer):
                raise UserError(f"schedule: request {rid}'s token ids are not an integer array of its {P} positions "
                                f"(got {t.dtype} with shape {t.shape}).")
            if t.size and (t.min() < 0 or t.max() > MAX_INT32):
                raise UserError(f"schedule: request {rid} has a token id outside 0..{MAX_INT32}.")
        if r.logits is not None:
            lg = np.asarray(r.logits)
            if lg.ndim != 3 or lg.shape[:2] != (P, L):
                raise UserError(f"schedule: request {rid}'s logits have shape {lg.shape}, not [{P}, {L}, n_expert].")
            if n_expert is None:
                n_expert = lg.shape[2]
            elif lg.shape[2] != n_expert:
                raise UserError(f"schedule: request {rid} has logits over {lg.shape[2]} experts, the first request {n_expert}.")
    assert shape is not None
    return shape[0], shape[1], all(with_tokens), all(with_logits), n_expert


def _check_options(mode: str, max_batch: object, prefill_chunk: object) -> None:
    if mode not in MODES:
        raise UserError(f"schedule {mode!r} is not one of {', '.join(MODES)}.")
    if isinstance(max_batch, (bool, np.bool_)) or not isinstance(max_batch, (int, np.integer)) or max_batch < 1:
        raise UserError(f"max_batch {max_batch!r} must be an integer >= 1 (requests decoding together).")
    if prefill_chunk is not None and (isinstance(prefill_chunk, (bool, np.bool_)) or
                                      not isinstance(prefill_chunk, (int, np.integer)) or prefill_chunk < 1):
        raise UserError(f"prefill_chunk {prefill_chunk!r} must be an integer >= 1 (prompt positions per prefill batch) or None.")
    if mode == "sequential" and (max_batch != 1 or prefill_chunk is not None):
        given = " and ".join(f"{n} {v}" for n, v, d in (("max_batch", max_batch, 1), ("prefill_chunk", prefill_chunk, None)) if v != d)
        raise UserError(f"{given}: the sequential schedule runs one request at a time, its whole prompt in one batch "
                        "(these options apply to the continuous schedule).")


def plan(requests: Sequence[RequestRoutes], *, max_batch: int, prefill_chunk: int | None) -> list[list[tuple[int, np.ndarray]]]:
    """The continuous schedule as engine steps: per step, [(request index, positions)] in the
    order the step took them (an unrouted decode position gives an empty position array; a step
    may then hold no rows). Options are not validated here (see :func:`schedule`)."""
    routed = [np.ones(np.shape(r.experts)[0], bool) if r.routed is None else np.asarray(r.routed) for r in requests]
    # Routed prompt positions per request: the prefill work (an unrouted one was not computed).
    prompt = [np.flatnonzero(m[:r.prompt_len]) for r, m in zip(requests, routed)]
    waiting = deque(range(len(requests)))
    admitted: list[int] = []  # in admission order
    done_prompt: dict[int, int] = {}  # request index -> prompt positions already prefilled
    next_pos: dict[int, int] = {}  # request index -> next generated position
    partial: int | None = None  # the request whose prompt is part-way
    steps: list[list[tuple[int, np.ndarray]]] = []
    budget_max = prefill_chunk if prefill_chunk is not None else None
    while waiting or admitted:
        if partial is not None or (waiting and len(admitted) < max_batch):
            budget = budget_max
            step: list[tuple[int, np.ndarray]] = []
            closed = False
            if partial is not None:
                i = partial
                take = prompt[i].size - done_prompt[i] if budget is None else min(budget, prompt[i].size - done_prompt[i])
                step.append((i, prompt[i][done_prompt[i]:done_prompt[i] + take]))
                done_prompt[i] += take
                budget = None if budget is None else budget - take
                if done_prompt[i] < prompt[i].size:
                    closed = True  # still part-way: the next prefill batch continues it
                else:
                    partial = None
            while not closed and waiting and len(admitted) < max_batch and (budget is None or budget > 0):
                i = waiting.popleft()
                admitted.append(i)
                next_pos[i] = requests[i].prompt_len
                done_prompt[i] = 0
                take = prompt[i].size if budget is None else min(budget, prompt[i].size)
                if take:
                    step.append((i, prompt[i][:take]))
                done_prompt[i] = take
                budget = None if budget is None else budget - take
                if take < prompt[i].size:
                    partial, closed = i, True
            steps.append(step)
        else:
            step = []
            for i in list(admitted):
                if i == partial:
                    continue
                P = routed[i].shape[0]
                if next_pos[i] < P:
                    p = next_pos[i]
                    step.append((i, np.array([p] if routed[i][p] else [], dtype=np.int64)))
                    next_pos[i] = p + 1
            steps.append(step)
        # A request whose every position is scheduled leaves (it frees its batch slot).
        admitted = [i for i in admitted if i == partial or next_pos[i] < routed[i].shape[0]]
    return steps


def schedule(requests: Sequence[RequestRoutes], *, mode: Literal["sequential", "continuous"], max_batch: int = 1,
             prefill_chunk: int | None = None, moe_layers: Sequence[int] | None = None) -> dict[str, np.ndarray]:
    """Batch per-request routings by the schedule ``mode`` (module docstring: the rule).

    Returns the routing columns for :meth:`traces.io.writer.TraceWriter.append`: ``turn`` int32 (0),
    ``batch`` int32, ``phase`` int8 (0 prompt position, 1 generated), ``step`` int32 (the
    position inside its request), ``layer`` int16 (``moe_layers[i]`` for the i-th MoE layer of
    the arrays; default i), ``experts`` int32 [R, k], ``weights`` float32 [R, k] (NaN where a
    request has none), ``request`` int64, and ``token`` int32 / ``logits`` float32 [R, n_expert]
    when every request has them. Rows are in (batch, layer, request, step) order.

    >>> import numpy as np
    >>> r = [RequestRoutes(7, 2, np.zeros((3, 1, 1), np.int32)), RequestRoutes(3, 1, np.ones((2, 1, 1), np.int32))]
    >>> out = schedule(r, mode="continuous", max_batch=2)
    >>> out["batch"].tolist(), out["request"].tolist(), out["step"].tolist()
    ([0, 0, 0, 1, 1], [3, 7, 7, 3, 7], [0, 0, 1, 1, 2])
    """
    _check_options(mode, max_batch, prefill_chunk)
    L, k, has_token, has_logits, n_expert = _check_requests(requests)
    rb, ri, rp, rl = schedule_index(requests, mode=mode, max_batch=max_batch, prefill_chunk=prefill_chunk)
    if moe_layers is None:
        layer_ids = np.arange(L, dtype=np.int64)
    else:
        layer_ids = np.asarray(list(moe_layers), dtype=np.int64)
        if layer_ids.shape != (L,) or (np.diff(layer_ids) <= 0).any() or (layer_ids.size and layer_ids[0] < 0) \
                or (layer_ids.size and layer_ids[-1] >= MAX_LAYERS):
            raise UserError(f"schedule: moe_layers {list(moe_layers)} is not {L} strictly increasing layer indices "
                            f"(one per MoE layer of the requests' arrays).")
    rid = np.array([int(r.request) for r in requests], dtype=np.int64)
    R = rb.size
    experts = np.empty((R, k), np.int32)
    weights = np.full((R, k), np.nan, np.float32)
    out: dict[str, np.ndarray] = {}
    token = np.empty(R, np.int32) if has_token else None
    logits = np.empty((R, n_expert or 0), np.float32) if has_logits else None
    for i, r in enumerate(requests):
        sel = np.flatnonzero(ri == i)
        if not sel.size:
            continue
        experts[sel] = np.asarray(r.experts)[rp[sel], rl[sel]]
        if r.weights is not None:
            weights[sel] = np.asarray(r.weights, dtype=np.float32)[rp[sel], rl[sel]]
        if token is not None:
            token[sel] = np.asarray(r.token_ids)[rp[sel]]
        if logits is not None:
            logits[sel] = np.asarray(r.logits, dtype=np.float32)[rp[sel], rl[sel]]
    prompt_len = np.array([r.prompt_len for r in requests], dtype=np.int64)
    phase = np.where(rp < prompt_len[ri], PHASE_PREFILL, PHASE_DECODE)
    out["turn"] = np.zeros(R, np.int32)
    out["batch"] = rb.astype(np.int32)
    out["phase"] = phase.astype(np.int8)
    out["step"] = rp.astype(np.int32)
    out["layer"] = layer_ids[rl].astype(np.int16)
    out["experts"] = experts
    out["weights"] = weights
    out["request"] = rid[ri]
    if token is not None:
        out["token"] = token
    if logits is not None:
        out["logits"] = logits
    return out


def schedule_index(requests: Sequence[RequestRoutes], *, mode: Literal["sequential", "continuous"], max_batch: int = 1,
                   prefill_chunk: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Where each output row of :func:`schedule` comes from: int64 arrays (batch, request index
    into ``requests``, position, MoE layer index), rows in (batch, layer, request, step) order.
    For a caller that gathers columns :class:`RequestRoutes` does not carry (gate inputs)."""
    _check_options(mode, max_batch, prefill_chunk)
    L = _check_requests(requests)[0]
    steps = plan(requests, max_batch=int(max_batch) if mode == "continuous" else 1,
                 prefill_chunk=prefill_chunk if mode == "continuous" else None)
    # One event per scheduled routed position: (batch, request index, position).
    ev_b, ev_i, ev_p = [], [], []
    b = 0
    for step in steps:
        if not sum(pos.size for _, pos in step):
            continue  # a step with no routed position (all unrouted): no batch number
        for i, pos in step:
            ev_b.append(np.full(pos.size, b, np.int64))
            ev_i.append(np.full(pos.size, i, np.int64))
            ev_p.append(pos.astype(np.int64))
        b += 1
    eb, ei, ep = (np.concatenate(xs) if xs else np.zeros(0, np.int64) for xs in (ev_b, ev_i, ev_p))
    rid = np.array([int(r.request) for r in requests], dtype=np.int64)
    # Rows: each event at every MoE layer, ordered (batch, layer, request, step).
    rb, ri, rp = np.repeat(eb, L), np.repeat(ei, L), np.repeat(ep, L)
    rl = np.tile(np.arange(L, dtype=np.int64), eb.size)
    order = np.lexsort((rp, rid[ri], rl, rb))
    return rb[order], ri[order], rp[order], rl[order]


def rebatch_trace(src: str | Path, out_dir: str | Path, *, mode: Literal["sequential", "continuous"], max_batch: int = 1,
                  prefill_chunk: int | None = None, force: bool = False) -> dict[str, Any]:
    """Re-batch a trace that has a request column by the schedule ``mode`` into a new trace
    ``out_dir`` (atomically: nothing is left behind on an error). Each request keeps every routing,
    position and column it has (token, logits, gate_input); requests are admitted in the order of
    their first row in ``src``. The engine-recorded columns (residency, read_bytes, dropped) and
    metrics.parquet describe the original run's batching and cache, so they are not carried over
    (the returned dict says which were left out; provenance.rebatched records the schedule).

    Returns {"requests", "batches", "dropped_columns"}."""
    import copy

    from traces.format.errors import TraceError
    from traces.format.schema import RECORDED_COLUMNS, ROUTER_FILE
    from traces.io.atomic import staged_dir
    from traces.io.reader import fixed_list_to_numpy, open_trace
    from traces.io.writer import TraceWriter

    _check_options(mode, max_batch, prefill_chunk)
    tr = open_trace(src)
    if not tr.has("request"):
        raise UserError(f"{tr.path}: has no request column, so there are no requests to re-batch "
                        "(a trace of one request is already batched one token per decode step).")
    turns = tr.routings(["turn"])["turn"].unique()
    if turns.len() > 1:
        raise UserError(f"{tr.path}: holds {turns.len()} turns; schedule re-batches the requests of one turn.")
    wide = [c for c in ("token", "logits", "gate_input") if tr.has(c)]
    t = tr.table(["batch", "phase", "step", "layer", "experts", "weights", "request", *wide])
    req = t.column("request").to_numpy().astype(np.int64)
    step = t.column("step").to_numpy().astype(np.int64)
    phase = t.column("phase").to_numpy()
    moe = tr.moe_layers
    lidx = np.searchsorted(np.array(moe), t.column("layer").to_numpy().astype(np.int64))  # rows are MoE layers (reader-checked)
    experts = fixed_list_to_numpy(t.column("experts"))
    weights = fixed_list_to_numpy(t.column("weights"))
    L = len(moe)
    # Requests in the order of their first row (admission order), each a dense [positions, L] map of rows.
    ids, first = np.unique(req, return_index=True)
    ids = ids[np.argsort(first, kind="stable")]
    order = np.lexsort((lidx, step, req))
    reqs: list[RequestRoutes] = []
    row_of: list[np.ndarray] = []
    bounds = np.searchsorted(req[order], np.sort(ids)), np.searchsorted(req[order], np.sort(ids), side="right")
    span = {int(r): (int(a), int(b)) for r, a, b in zip(np.sort(ids), *bounds)}
    for rid in ids.tolist():
        a, b = span[rid]
        rows = order[a:b]
        P = int(step[rows].max()) + 1
        rmap = np.full((P, L), -1, dtype=np.int64)
        rmap[step[rows], lidx[rows]] = rows
        routed = (rmap >= 0).any(axis=1)
        partial = np.flatnonzero(routed & (rmap < 0).any(axis=1))
        if partial.size:
            raise UserError(f"{tr.path}: request {rid} step {partial[0]} is routed at some MoE layers and not at others; "
                            "a re-batched token needs its routing at every MoE layer.")
        pre = step[rows][phase[rows] == 0]
        dec = step[rows][phase[rows] == 1]
        prompt_len = int(pre.max()) + 1 if pre.size else (int(dec.min()) if dec.size else P)
        if dec.size and int(dec.min()) < prompt_len:
            raise UserError(f"{tr.path}: request {rid} has a decode token at step {int(dec.min())} before its last "
                            f"prompt token (step {prompt_len - 1}); its prompt must come first.")
        safe = np.where(rmap >= 0, rmap, rows[0])
        reqs.append(RequestRoutes(rid, prompt_len, experts[safe], routed=routed))
        row_of.append(safe)
    rb, ri, rp, rl = schedule_index(reqs, mode=mode, max_batch=max_batch, prefill_chunk=prefill_chunk)
    src_rows = np.empty(rb.size, dtype=np.int64)
    for i, safe in enumerate(row_of):
        sel = np.flatnonzero(ri == i)
        src_rows[sel] = safe[rp[sel], rl[sel]]
    meta = {k: copy.deepcopy(v) for k, v in tr.meta.items() if k not in ("format", "version", "complete", "columns", "rows",
                                                                          "gate_input_dtype", "recorded")}
    dropped = [c for c in RECORDED_COLUMNS if tr.has(c)] + (["metrics.parquet"] if tr.has_metrics else [])
    if tr.recorded:
        dropped.append("recorded (trace.json)")
    meta.setdefault("provenance", {})["rebatched"] = {
        "from": str(tr.path), "schedule": mode, "max_batch": int(max_batch), "prefill_chunk": prefill_chunk,
        "dropped": dropped}
    columns = ("request", *wide)
    with staged_dir(out_dir, force=force, inputs=[tr.path]) as stage:
        w = TraceWriter(stage, meta, columns=columns, gate_input_dtype=tr.meta.get("gate_input_dtype", "float32"))
        cols = {"turn": np.zeros(rb.size, np.int32), "batch": rb, "phase": phase[src_rows], "step": rp,
                "layer": np.array(moe, dtype=np.int64)[rl], "experts": experts[src_rows], "weights": weights[src_rows],
                "request": req[src_rows]}
        for c in wide:
            col = t.column(c)
            cols[c] = col.to_numpy()[src_rows] if c == "token" else fixed_list_to_numpy(col)[src_rows]
        step_rows = max(1, w.rows_per_part)
        for a in range(0, rb.size, step_rows):
            w.append(**{c: v[a:a + step_rows] for c, v in cols.items()})
        w.close()
        if tr.has_router:
            shutil.copyfile(tr.path / ROUTER_FILE, stage / ROUTER_FILE)
        try:
            open_trace(stage)
        except TraceError as e:
            raise UserError(f"{out_dir}: the re-batched trace would be invalid ({e.problem}); nothing was written.") from None
    return {"requests": len(reqs), "batches": int(rb.max()) + 1 if rb.size else 0, "dropped_columns": dropped}
