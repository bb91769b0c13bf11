"""Importer for colibri's ``ROUTE_TRACE=<path>`` stream (route_trace.h, ``rt_trace``).

One text line per (MoE call, batch row): ``<call> <row> <layer> <id>:<gate> ...`` with the gate
printed ``%.4f`` -- the weight the layer applies. ``call`` counts MoE invocations (it advances
once per call, after the call's rows), so one call is one (forward pass, layer) load; ``row`` is
the row of the call's batch. No header, no token position, no phase, no engine version.

What is inferred, and said in the notes: a forward pass ends where the layer index stops rising
(passes visit layers in order); a row's position is the pass's first position + row, positions
counting up through the passes; the prompt is the passes before the first one-row pass (or
exactly ``--prompt-tokens N``). Gates are rounded to 4 decimals by the writer; where an engine
lists a routing's experts in another order than descending gate (a selection bias ranks them),
the slots are put in descending-gate order (the set is unchanged) and the notes say how many.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from traces.format.errors import UserError
from traces.importers import (
    DROP_WARMUP,
    ImportOption,
    batches_from_file_order,
    check_source,
    head_lines,
    infer_shape,
    meta_from_sizes,
    prompt_passes,
    provenance,
    read_text,
    repeated_expert_rows,
    slots_by_weight,
    write_trace,
)
from traces.importers._sizes import require_sizes
from traces.util.units import PHASE_DECODE, PHASE_PREFILL

NAME = "colibri"
SUMMARY = "colibri ROUTE_TRACE=<path> text: '<call> <row> <layer> <id>:<gate> ...' per MoE call and batch row"
ENGINE = "colibri"
TAKES_SIZES = True
MAX_SOURCES = 1
OPTIONS = (
    ImportOption("prompt_tokens", "--prompt-tokens", int, "Prompt length in tokens (default: the passes before the "
                 "first one-row pass)."),
    DROP_WARMUP,
)

_LINE = re.compile(r"^\d+ \d+ \d+( -?\d+:-?[0-9.]+(e[-+]?\d+)?)+$")


def sniff(paths: list[Path]) -> bool:
    if len(paths) != 1:
        return False
    lines = [ln.strip() for ln in head_lines(paths[0], 4096) if ln.strip()]
    return bool(lines) and all(_LINE.match(ln) for ln in lines[:50])


def parse(path: Path, notes: list[str]) -> dict[str, Any]:
    text = read_text(path)
    lines = text.splitlines()
    if not text.strip():
        raise UserError(f"{path}: is empty; not a colibri ROUTE_TRACE.")
    if not text.endswith("\n"):
        raise UserError(f"{path}: line {len(lines)}: the last line has no line end; the file is truncated.")
    body = [(i + 1, ln.split()) for i, ln in enumerate(lines) if ln.strip()]
    k = len(body[0][1]) - 3
    n = len(body)
    head = np.empty((n, 3), dtype=np.int64)
    experts = np.empty((n, max(k, 1)), dtype=np.int64)
    gates = np.empty((n, max(k, 1)), dtype=np.float64)
    linenos = np.array([ln for ln, _ in body], dtype=np.int64)
    for r, (lineno, f) in enumerate(body):
        if len(f) < 4:
            raise UserError(f"{path}: line {lineno}: has {len(f)} fields; expected '<call> <row> <layer> <id>:<gate> ...'.")
        if len(f) - 3 != k:
            raise UserError(f"{path}: line {lineno}: routes {len(f) - 3} experts, the first line {k}.")
        for c, name in enumerate(("call", "row", "layer")):
            try:
                head[r, c] = int(f[c])
            except ValueError:
                raise UserError(f"{path}: line {lineno}: {name} {f[c]!r} is not an integer.") from None
        for s, pair in enumerate(f[3:]):
            e, sep, g = pair.partition(":")
            try:
                experts[r, s] = int(e)
                gates[r, s] = float(g)
            except ValueError:
                raise UserError(f"{path}: line {lineno}: {pair!r} is not '<expert id>:<gate>'.") from None
            if not sep:
                raise UserError(f"{path}: line {lineno}: {pair!r} is not '<expert id>:<gate>'.")
            if not math.isfinite(gates[r, s]) or gates[r, s] < 0:
                raise UserError(f"{path}: line {lineno}: gate {g} is not a finite weight >= 0.")
    call, row, layer = head.T
    bad = np.flatnonzero((call < 0) | (row < 0) | (layer < 0) | (experts < 0).any(axis=1))
    if bad.size:
        raise UserError(f"{path}: line {linenos[bad[0]]}: a negative call, row, layer or expert id.")
    # A call's rows are consecutive lines, 0..n-1, one layer; calls rise through the file.
    cstart = np.flatnonzero(np.concatenate([[True], call[1:] != call[:-1]]))
    csize = np.diff(np.append(cstart, n))
    if (np.diff(call[cstart]) <= 0).any():
        i = cstart[1:][np.diff(call[cstart]) <= 0][0]
        raise UserError(f"{path}: line {linenos[i]}: call {call[i]} does not follow call {call[i - 1]} (calls rise through the file).")
    within = np.arange(n) - np.repeat(cstart, csize)
    bad = np.flatnonzero(row != within)
    if bad.size:
        i = bad[0]
        raise UserError(f"{path}: line {linenos[i]}: row {row[i]} of call {call[i]}, expected row {within[i]} "
                        "(a call's rows are numbered 0.. in order).")
    bad = np.flatnonzero(layer != np.repeat(layer[cstart], csize))
    if bad.size:
        raise UserError(f"{path}: line {linenos[bad[0]]}: call {call[bad[0]]} mixes layers.")
    batch_of_call = batches_from_file_order(layer[cstart])
    nbatch = int(batch_of_call.max()) + 1
    ntok = np.zeros(nbatch, dtype=np.int64)
    np.maximum.at(ntok, batch_of_call, csize)
    pass_start = np.concatenate([[0], np.cumsum(ntok)[:-1]])
    batch = np.repeat(batch_of_call, csize)
    step = pass_start[batch] + row
    return {"batch": batch, "step": step, "layer": layer, "experts": experts[:, :k], "gates": gates[:, :k], "k": k,
            "ntok": ntok, "linenos": linenos}


def import_(sources: list[Path], out_dir: Path, *, sizes: Any = None, force: bool = False,
            prompt_tokens: int | None = None, drop_warmup: bool = False) -> Path:
    src = check_source(Path(sources[0]))
    sizes = require_sizes(sizes, src, NAME)
    notes: list[str] = []
    p = parse(src, notes)
    k, experts, gates, layer = p["k"], p["experts"], p["gates"], p["layer"]
    twice = repeated_expert_rows(experts)
    if twice.size:
        raise UserError(f"{src}: line {p['linenos'][twice[0]]}: a row selects the same expert twice.")
    prefill_pass = prompt_passes(p["ntok"], prompt_tokens, src, notes)
    phase = np.where(prefill_pass[p["batch"]], PHASE_PREFILL, PHASE_DECODE)
    notes.append("colibri logs no positions: a pass ends where the layer index stops rising, a row's position is "
                 "its pass's first position + row, positions count up from 0 through the passes")
    experts, gates, moved = slots_by_weight(experts, gates)
    if moved:
        notes.append(f"{moved} routing(s) listed their experts in another order than descending gate; their slots "
                     "are put in descending-gate order (the selected sets are unchanged)")
    notes.append("gates are the applied weights as the engine printed them, rounded to 4 decimals")
    n_layer, n_expert = infer_shape(src, layer, experts, sizes, notes=notes)
    if k > n_expert:
        raise UserError(f"{src}: routes {k} experts per row but the model has {n_expert}.")
    prov = provenance(NAME, [src], engine=ENGINE, notes=notes,
                      batching="one colibri pass (the calls of rising layers) = one batch, read from the file order")
    meta = meta_from_sizes(what=src, stem=src.stem, sizes=sizes, n_layer=n_layer, n_expert=n_expert, layer=layer, top_k=k,
                           prov=prov)
    return write_trace(out_dir, meta, batch=p["batch"], phase=phase, step=p["step"], layer=layer, experts=experts,
                       weights=gates.astype(np.float32), force=force, inputs=[src], what=src,
                       drop_warmup=drop_warmup)
