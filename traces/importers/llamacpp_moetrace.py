"""Importer for llama.cpp's ``examples/moe-trace`` CSV (``llama-moe-trace``, output in ``MOE_TRACE_OUT``).

Two shapes exist, both written from the scheduler's eval callback on the ``ffn_moe_topk-<layer>``
tensor, one llama_decode (one ubatch) at a time, layers in increasing order:

- the upstream example: no header, one ``<layer>,<expert>`` line per routed activation, the ids
  of each layer's [k, n_tokens] top-k tensor token-major. It carries no token, phase or top-k, so
  this importer infers them and says how: top-k from ``--top-k`` or the model (``--sizes-from``);
  a layer's rows are ``n_tokens x k``; a forward pass ends where the layer index stops rising;
  positions count up through the passes; the prompt is the passes before the first one-token
  pass (or exactly ``--prompt-tokens N``).
- the extended fork (header ``phase,token,layer,rank,expert``): ``phase`` prefill|decode,
  ``token`` the position in the one sequence, ``rank`` the slot. Passes are read the same way.

In both, llama.cpp computes only the output rows in the last layer of a prompt pass (the rest
feed nothing), so that layer's block is shorter than the others: its rows belong to the pass's
last token(s). The extended writer numbers them from the pass's first token; they are placed at
the last and the notes say so. Neither shape has routing weights: the trace's weights are NaN.
"""

from __future__ import annotations

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
    write_trace,
)
from traces.importers._sizes import require_sizes
from traces.util.units import PHASE_DECODE, PHASE_PREFILL

NAME = "llamacpp-moetrace"
SUMMARY = "llama.cpp examples/moe-trace CSV (MOE_TRACE_OUT): 'layer,expert' rows or 'phase,token,layer,rank,expert'"
ENGINE = "llama.cpp (llama-moe-trace)"
TAKES_SIZES = True
MAX_SOURCES = 1
OPTIONS = (
    ImportOption("top_k", "--top-k", int, "Experts routed per token (the plain 'layer,expert' CSV does not say; "
                 "default: the model's, from --sizes-from)."),
    ImportOption("prompt_tokens", "--prompt-tokens", int, "Prompt length in tokens, for the plain CSV (default: the "
                 "passes before the first one-token pass)."),
    DROP_WARMUP,
)

EXTENDED_HEADER = "phase,token,layer,rank,expert"
PLAIN_HEADER = "layer,expert"
_PLAIN_ROW = re.compile(r"^-?\d+,-?\d+$")


def sniff(paths: list[Path]) -> bool:
    if len(paths) != 1:
        return False
    lines = [ln.strip() for ln in head_lines(paths[0], 2048) if ln.strip()]
    if not lines:
        return False
    if lines[0] == EXTENDED_HEADER:
        return True
    body = lines[1:] if lines[0] == PLAIN_HEADER else lines
    return bool(body) and all(_PLAIN_ROW.match(ln) for ln in body[:50])


def _ints(fields: list[str], path: Path, lineno: int, names: tuple[str, ...]) -> list[int]:
    out = []
    for f, name in zip(fields, names):
        try:
            v = int(f)
        except ValueError:
            raise UserError(f"{path}: line {lineno}: {name} {f!r} is not an integer.") from None
        if not -(1 << 31) <= v < (1 << 31):  # every field is an int32 of the trace: bounded here, not by an OverflowError
            raise UserError(f"{path}: line {lineno}: {name} {f} is beyond int32 (at most {(1 << 31) - 1}).")
        out.append(v)
    return out


def _blocks(keys: np.ndarray) -> np.ndarray:
    """Start index of each run of equal consecutive rows of ``keys`` [n, c]."""
    n = keys.shape[0]
    change = np.ones(n, dtype=bool)
    if n > 1:
        change[1:] = (keys[1:] != keys[:-1]).any(axis=1)
    return np.flatnonzero(change)


def parse(path: Path, top_k: int | None, prompt_tokens: int | None, notes: list[str]) -> dict[str, Any]:
    """Routings of a moe-trace CSV: per routing phase, step, layer, experts [R, k]; plus k."""
    text = read_text(path)
    lines = text.splitlines()
    if text and not text.endswith("\n"):
        # The writer ends every row with a newline: a last line without one was cut off mid-write.
        raise UserError(f"{path}: line {len(lines)}: the last row has no line end; the file is truncated.")
    numbered = [(i + 1, ln.strip()) for i, ln in enumerate(lines) if ln.strip()]
    if not numbered:
        raise UserError(f"{path}: is empty; not a moe-trace CSV.")
    if numbered[0][1] == EXTENDED_HEADER:
        if prompt_tokens is not None:
            raise UserError(f"--prompt-tokens: {path} has a phase column that says which rows are the prompt; drop the option.")
        return _parse_extended(path, numbered[1:], notes)
    body = numbered[1:] if numbered[0][1] == PLAIN_HEADER else numbered
    return _parse_plain(path, body, top_k, prompt_tokens, notes)


def _parse_extended(path: Path, body: list[tuple[int, str]], notes: list[str]) -> dict[str, Any]:
    if not body:
        raise UserError(f"{path}: has a header but no rows.")
    n = len(body)
    phase = np.empty(n, dtype=np.int64)
    vals = np.empty((n, 4), dtype=np.int64)
    linenos = np.array([ln for ln, _ in body], dtype=np.int64)
    for r, (lineno, ln) in enumerate(body):
        f = ln.split(",")
        if len(f) != 5:
            raise UserError(f"{path}: line {lineno}: has {len(f)} fields, expected 5 ({EXTENDED_HEADER}).")
        if f[0] not in ("prefill", "decode"):
            raise UserError(f"{path}: line {lineno}: phase {f[0]!r} is not prefill or decode.")
        phase[r] = PHASE_PREFILL if f[0] == "prefill" else PHASE_DECODE
        vals[r] = _ints(f[1:], path, lineno, ("token", "layer", "rank", "expert"))
    token, layer, rank, expert = vals.T
    for name, col in (("token", token), ("layer", layer), ("rank", rank), ("expert", expert)):
        bad = np.flatnonzero(col < 0)
        if bad.size:
            raise UserError(f"{path}: line {linenos[bad[0]]}: {name} {col[bad[0]]} is negative.")
    bad = np.flatnonzero(token > np.iinfo(np.int32).max)
    if bad.size:
        raise UserError(f"{path}: line {linenos[bad[0]]}: token {token[bad[0]]} is beyond int32.")
    # One routing = the rows of one (phase, token, layer), ranks 0..k-1 in order, as the writer emits them.
    starts = np.flatnonzero(rank == 0)
    if starts.size == 0 or starts[0] != 0:
        raise UserError(f"{path}: line {linenos[0]}: the first row has rank {rank[0]}, expected 0.")
    sizes = np.diff(np.append(starts, n))
    k = int(sizes[0])
    bad = np.flatnonzero(sizes != k)
    if bad.size:
        s = starts[bad[0]]
        raise UserError(f"{path}: line {linenos[s]}: the routing of token {token[s]} at layer {layer[s]} has "
                        f"{sizes[bad[0]]} ranks, the first routing {k} (a truncated or mixed file).")
    R = starts.size
    idx = starts[:, None] + np.arange(k)[None, :]
    if (rank[idx] != np.arange(k)[None, :]).any() or (token[idx] != token[starts][:, None]).any() \
            or (layer[idx] != layer[starts][:, None]).any() or (phase[idx] != phase[starts][:, None]).any():
        r = int(np.flatnonzero((rank[idx] != np.arange(k)).any(axis=1) | (token[idx] != token[starts][:, None]).any(axis=1)
                               | (layer[idx] != layer[starts][:, None]).any(axis=1)
                               | (phase[idx] != phase[starts][:, None]).any(axis=1))[0])
        raise UserError(f"{path}: line {linenos[starts[r]]}: ranks 0..{k - 1} of one token and layer are not "
                        "consecutive rows (not written by moe-trace).")
    r_phase, r_token, r_layer = phase[starts], token[starts], layer[starts]
    experts = expert[idx]
    # Blocks: consecutive routings of one layer and phase with rising tokens (one layer of one pass).
    brk = np.ones(R, dtype=bool)
    brk[1:] = (r_layer[1:] != r_layer[:-1]) | (r_phase[1:] != r_phase[:-1]) | (r_token[1:] <= r_token[:-1])
    bstart = np.flatnonzero(brk)
    batch_of_block = batches_from_file_order(r_layer[bstart], r_phase[bstart])
    block_of = np.cumsum(brk) - 1
    batch = batch_of_block[block_of]
    step = r_token.copy()
    moved = _place_short_blocks(batch, block_of, step)
    if moved:
        notes.append(f"{moved} routing(s) of prompt passes' last-layer blocks cover only the pass's output token: "
                     "the writer numbers them from the pass's first token, they are placed at its last")
    return {"phase": r_phase, "step": step, "layer": r_layer, "experts": experts, "batch": batch, "k": k,
            "linenos": linenos[starts]}


def _place_short_blocks(batch: np.ndarray, block_of: np.ndarray, step: np.ndarray) -> int:
    """Give the routings of a block shorter than its pass's longest block the pass's last positions
    (llama.cpp computes only the output rows in a prompt pass's last layer). Returns how many moved."""
    moved = 0
    nb = int(block_of.max()) + 1 if block_of.size else 0
    bsize = np.bincount(block_of, minlength=nb)
    first_row = np.searchsorted(block_of, np.arange(nb))
    block_batch = batch[first_row]
    for b in np.unique(block_batch):
        blocks = np.flatnonzero(block_batch == b)
        full = blocks[np.argmax(bsize[blocks])]
        pos = step[first_row[full]:first_row[full] + bsize[full]]
        for blk in blocks:
            m = bsize[blk]
            if m < bsize[full]:
                rows = slice(first_row[blk], first_row[blk] + m)
                want = pos[-m:]
                if not np.array_equal(step[rows], want):
                    step[rows] = want
                    moved += m
    return moved


def _parse_plain(path: Path, body: list[tuple[int, str]], top_k: int | None, prompt_tokens: int | None,
                 notes: list[str]) -> dict[str, Any]:
    if not body:
        raise UserError(f"{path}: has no rows.")
    if top_k is None:
        raise UserError(f"{path}: a plain 'layer,expert' moe-trace CSV does not say how many experts each token "
                        "routes; add --top-k K (or --sizes-from MODEL.gguf, whose expert_used_count it is).")
    if top_k <= 0:
        raise UserError(f"--top-k {top_k} is not a positive number of experts.")
    n = len(body)
    vals = np.empty((n, 2), dtype=np.int64)
    linenos = np.array([ln for ln, _ in body], dtype=np.int64)
    for r, (lineno, ln) in enumerate(body):
        f = ln.split(",")
        if len(f) != 2:
            raise UserError(f"{path}: line {lineno}: has {len(f)} fields, expected 2 (layer,expert).")
        vals[r] = _ints(f, path, lineno, ("layer", "expert"))
    layer, expert = vals.T
    bad = np.flatnonzero((layer < 0) | (expert < 0))
    if bad.size:
        raise UserError(f"{path}: line {linenos[bad[0]]}: layer or expert id is negative.")
    bstart = _blocks(layer[:, None])
    bsize = np.diff(np.append(bstart, n))
    bad = np.flatnonzero(bsize % top_k)
    if bad.size:
        s = bstart[bad[0]]
        raise UserError(f"{path}: line {linenos[s]}: layer {layer[s]}'s block has {bsize[bad[0]]} rows, not a "
                        f"multiple of top-k {top_k} (a truncated file, or the wrong --top-k).")
    if np.unique(layer).size < 2:
        raise UserError(f"{path}: routes a single layer; without a token column the passes cannot be told apart.")
    k = top_k
    b_layer = layer[bstart]
    b_ntok = bsize // k
    batch_of_block = batches_from_file_order(b_layer)
    R = n // k
    experts = expert.reshape(R, k)
    r_layer = layer[::k]
    block_of = np.repeat(np.arange(bstart.size), b_ntok)
    batch = batch_of_block[block_of]
    # Positions: each pass covers as many tokens as its longest block, counted on from the last pass.
    nbatch = int(batch_of_block.max()) + 1
    ntok = np.zeros(nbatch, dtype=np.int64)
    np.maximum.at(ntok, batch_of_block, b_ntok)
    pass_start = np.concatenate([[0], np.cumsum(ntok)[:-1]])
    within = np.arange(R) - np.repeat(np.searchsorted(block_of, np.arange(bstart.size)), b_ntok)
    step = pass_start[batch] + within
    moved = _place_short_blocks(batch, block_of, step)
    prefill_pass = prompt_passes(ntok, prompt_tokens, path, notes)
    notes.append(f"the plain CSV has no token column: passes end where the layer index stops rising, a layer's "
                 f"rows are tokens x top-k {k}, positions count up from 0 through the passes")
    if moved:
        notes.append(f"{moved} routing(s) of short last-layer blocks (llama.cpp computes only a prompt pass's "
                     "output rows there) are placed at their pass's last token(s)")
    phase = np.where(prefill_pass[batch], PHASE_PREFILL, PHASE_DECODE)
    return {"phase": phase, "step": step, "layer": r_layer, "experts": experts, "batch": batch, "k": k,
            "linenos": linenos[::k]}


def import_(sources: list[Path], out_dir: Path, *, sizes: Any = None, force: bool = False,
            top_k: int | None = None, prompt_tokens: int | None = None, drop_warmup: bool = False) -> Path:
    src = check_source(Path(sources[0]))
    sizes = require_sizes(sizes, src, NAME)
    notes: list[str] = []
    if top_k is None and sizes.top_k is not None:
        top_k = sizes.top_k
    p = parse(src, top_k, prompt_tokens, notes)
    layer, experts, k = p["layer"], p["experts"], p["k"]
    twice = repeated_expert_rows(experts)
    if twice.size:
        raise UserError(f"{src}: line {p['linenos'][twice[0]]}: a token selects the same expert twice at layer "
                        f"{layer[twice[0]]}.")
    key = np.stack([p["step"], layer], axis=1)
    _, counts = np.unique(key, axis=0, return_counts=True)
    if (counts > 1).any():
        raise UserError(f"{src}: routes some token twice at one layer (two runs in one file?); import one run per file.")
    n_layer, n_expert = infer_shape(src, layer, experts, sizes, notes=notes)
    if k > n_expert:
        raise UserError(f"{src}: routes {k} experts per token but the model has {n_expert}.")
    prov = provenance(NAME, [src], engine=ENGINE, notes=notes,
                      batching="one pass of llama_decode (one ubatch) = one batch, read from the file order")
    meta = meta_from_sizes(what=src, stem=src.stem, sizes=sizes, n_layer=n_layer, n_expert=n_expert, layer=layer, top_k=k,
                           prov=prov)
    weights = np.full(experts.shape, np.nan, dtype=np.float32)  # the format carries no weights
    return write_trace(out_dir, meta, batch=p["batch"], phase=p["phase"], step=p["step"], layer=layer,
                       experts=experts, weights=weights, force=force, inputs=[src], what=src, drop_warmup=drop_warmup)
