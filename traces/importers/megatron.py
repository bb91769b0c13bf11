"""Importer for Megatron-LM's router trace (``--moe-routing-trace-path DIR``).

What Megatron-LM writes (read in its own source, NVIDIA/Megatron-LM
``megatron/core/transformer/moe/router_trace.py`` at c1560d94, and
``examples/inference/README.md``):

- ``DIR/router_trace_rank{r}.jsonl``: one JSON record per (step, block, layer), flushed a step at
  a time: ``step``, ``stage`` ("pre_dispatch"), ``block`` ("decoder" or "mtp"), ``layer`` (the
  ``decoder.layers.N`` index of the router's module), ``rank``, ``num_tokens``, ``topk``,
  ``top_indices`` [num_tokens][topk] and, for multi-token-prediction heads, ``mtp_idx``. In
  inference a step is one forward pass (a new step starts when a layer fires again); in training
  one iteration, in which a layer fires once per micro-batch. Here one batch is one firing of the
  layers: a step, split again wherever a layer repeats inside it.
- ``--moe-routing-trace-capture-hidden-states``: ``DIR/hidden_states_rank{r}.bin``, the router's
  input as raw bfloat16 [num_tokens, hidden], each record locating its block by ``hs_offset``,
  ``hs_bytes``, ``hs_shape`` -> the trace's ``gate_input`` (bf16 widened to float32 exactly).
- ``--moe-routing-trace-capture-logits``: ``DIR/logits_rank{r}.bin``, bfloat16 pre-top-k router
  logits [num_tokens, num_experts] by ``logit_offset`` / ``logit_bytes`` / ``logit_shape`` -> the
  trace's ``logits``.
- ``--moe-enable-routing-replay`` (the "sink", CUDA graphs on) writes the same JSONL from the
  in-pipeline recorder: ids only, no sidecars.

The log records no token positions, no requests and no phase: tokens are numbered in file order
as one stream (``step`` = the token's index in the run), and the first ``--prefill-steps`` steps
(default 1, the prompt's pass in inference) are prefill, the rest decode; all of this is said in
the provenance notes. Megatron's hook path takes a routing's experts from the routing map, which
lists them in ascending expert id, not router rank order (the sink keeps the router's order); no
weights are recorded (NaN). MTP-head records (``mtp_idx``) route the draft head's own experts, not
the model's layers: left out, counted in the notes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from traces.format.errors import UserError
from traces.format.schema import MAX_INT32, MAX_LAYERS
from traces.importers import repeated_expert_rows
from traces.util.bounded_json import BoundsError, parse_bounded
from traces.util.units import PHASE_DECODE, PHASE_PREFILL

NAME = "megatron"
ENGINE = "Megatron-LM"
SUMMARY = ("Megatron-LM --moe-routing-trace-path: router_trace_rank{r}.jsonl (+ hidden_states/logits_rank{r}.bin "
           "sidecars -> gate_input, logits)")
TAKES_SIZES = True
MAX_SOURCES = None

_JSONL = re.compile(r"router_trace_rank(\d+)\.jsonl$")
_SIDECAR = re.compile(r"(hidden_states|logits)_rank(\d+)\.bin$")
SIDECARS = {"gate_input": ("hidden_states", "hs_offset", "hs_bytes", "hs_shape", "--moe-routing-trace-capture-hidden-states"),
            "logits": ("logits", "logit_offset", "logit_bytes", "logit_shape", "--moe-routing-trace-capture-logits")}


def bf16_to_f32(raw: bytes) -> np.ndarray:
    """Raw little-endian bfloat16 -> float32 (exact: bf16 is the top half of a float32)."""
    u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
    return u.view(np.float32)


# Largest value of each integer field of a record: layer indices are int16, steps and counts int32.
_LIMITS = {"step": MAX_INT32, "layer": MAX_LAYERS - 1, "num_tokens": MAX_INT32, "topk": MAX_INT32}


def read_records(path: Path) -> list[tuple[int, dict]]:
    """(line number, record) of every line, checked for the fields an index record has."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path}: is not a text file (not UTF-8).") from None
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = parse_bounded(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: line {n}: is not valid JSON ({e.msg}; a truncated file?).") from None
        except BoundsError as e:
            raise UserError(f"{path}: line {n}: {e}.") from None
        if not isinstance(rec, dict):
            raise UserError(f"{path}: line {n}: is not a JSON object.")
        for key in ("step", "layer", "num_tokens", "topk", "top_indices"):
            if key not in rec:
                raise UserError(f"{path}: line {n}: has no {key!r}; not a Megatron-LM router trace record.")
        for key in ("step", "layer", "num_tokens", "topk"):
            v = rec[key]
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise UserError(f"{path}: line {n}: {key} {v!r} is not a non-negative integer.")
            if v > _LIMITS[key]:  # the trace's limits, named here rather than by the trace writer
                raise UserError(f"{path}: line {n}: {key} {v} is beyond what a trace holds (at most {_LIMITS[key]}).")
        out.append((n, rec))
    if not out:
        raise UserError(f"{path}: holds no records.")
    return out


def _indices(rec: dict, path: Path, n: int) -> np.ndarray:
    T, k = rec["num_tokens"], rec["topk"]
    # Read the JSON numbers as they are, never cast: np.asarray(..., dtype=int64) would store an id of
    # 1.5 as expert 1 (and true as 1), a routing the engine never made.
    try:
        arr = np.asarray(rec["top_indices"])
    except (ValueError, TypeError, OverflowError):
        raise UserError(f"{path}: line {n}: top_indices is not a [num_tokens][topk] list of integers.") from None
    if T == 0 and arr.size == 0:
        return np.zeros((0, k), np.int64)
    if arr.shape != (T, k):
        raise UserError(f"{path}: line {n}: top_indices has shape {list(arr.shape)}, but num_tokens={T} and topk={k}.")
    # numpy reads [1, true] as integers and [1, 1.5] as floats: look at the JSON values themselves.
    bad = next((v for row in rec["top_indices"] for v in row if type(v) is not int), None)
    if bad is not None or arr.dtype.kind not in "iu":
        raise UserError(f"{path}: line {n}: top_indices holds {bad!r}, not an integer expert id.")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > np.iinfo(np.int64).max:
        raise UserError(f"{path}: line {n}: top_indices holds {int(arr.max())}, beyond any expert id.")
    arr = arr.astype(np.int64)
    if (arr < 0).any():
        t, s = (int(x) for x in np.argwhere(arr < 0)[0])
        raise UserError(f"{path}: line {n}: top_indices[{t}][{s}] is {int(arr[t, s])}, a negative expert id.")
    if (arr > MAX_INT32).any():
        raise UserError(f"{path}: line {n}: top_indices holds expert id {int(arr.max())}, beyond int32.")
    return arr


class _Sidecar:
    """One bf16 sidecar file, read block by block where the records point."""

    def __init__(self, path: Path, jsonl: Path, flag: str) -> None:
        if not path.is_file():
            raise UserError(f"{jsonl}: its records point into {path.name} ({flag}), which is not beside it; copy it "
                            "there, or pass --routings-only to import the expert ids alone.")
        self.path = path
        self.size = path.stat().st_size
        self.fh = open(path, "rb")

    def read(self, offset: Any, nbytes: Any, shape: Any, rows: int, where: str) -> np.ndarray:
        if not (isinstance(offset, int) and isinstance(nbytes, int) and isinstance(shape, list) and len(shape) == 2
                and all(isinstance(x, int) and x > 0 for x in shape)):
            raise UserError(f"{where}: the offset/bytes/shape fields for {self.path.name} are not integers and a 2-D shape.")
        if shape[0] != rows or nbytes != shape[0] * shape[1] * 2:
            raise UserError(f"{where}: {self.path.name} block of shape {shape} and {nbytes} bytes does not match its "
                            f"{rows} tokens in bfloat16.")
        if offset < 0 or offset + nbytes > self.size:
            raise UserError(f"{self.path}: holds {self.size} bytes, but {where} reads bytes {offset}..{offset + nbytes} "
                            "(a truncated sidecar).")
        self.fh.seek(offset)
        return bf16_to_f32(self.fh.read(nbytes)).reshape(shape)

    def close(self) -> None:
        self.fh.close()


def import_(sources: list[Path], out_dir: Path, *, sizes: Any, force: bool = False, prefill_steps: int = 1,
            routings_only: bool = False, drop_warmup: bool = False) -> Path:
    """Import one rank's ``router_trace_rank{r}.jsonl`` (and its sidecars beside it) into a trace."""
    from traces.format.schema import default_gating
    from traces.importers import check_source, provenance, write_trace
    from traces.importers._sizes import require_sizes

    sources = [check_source(Path(s)) for s in sources]
    jsonls = [p for p in sources if p.suffix.lower() == ".jsonl"]
    others = [p for p in sources if p.suffix.lower() != ".jsonl"]
    for p in others:
        if not _SIDECAR.search(p.name):
            raise UserError(f"{p}: is not a router_trace_rank{{r}}.jsonl or one of its .bin sidecars.")
    if len(jsonls) != 1:
        raise UserError(f"{', '.join(str(p) for p in sources)}: name one rank's router_trace_rank{{r}}.jsonl "
                        f"(got {len(jsonls)}); each rank routes its own tokens, import them one at a time.")
    jsonl = jsonls[0]
    where = str(jsonl)
    sizes = require_sizes(sizes, where, NAME)
    if isinstance(prefill_steps, bool) or not isinstance(prefill_steps, int) or prefill_steps < 0:
        raise UserError(f"--prefill-steps {prefill_steps!r} must be an integer >= 0 (the leading steps that were prompt passes).")
    m = _JSONL.search(jsonl.name)
    file_rank = int(m.group(1)) if m else None
    records = read_records(jsonl)
    notes: list[str] = []
    seen_fields = [k for _, r in records for k in r]
    mtp = [r for _, r in records if r.get("block") == "mtp" or r.get("mtp_idx") is not None]
    if mtp:
        notes.append(f"{len(mtp)} record(s) of multi-token-prediction heads (mtp_idx) left out: they route the draft "
                     "head's experts, not the model's layers")
    records = [(n, r) for n, r in records if not (r.get("block") == "mtp" or r.get("mtp_idx") is not None)]
    if not records:
        raise UserError(f"{jsonl}: holds only multi-token-prediction head records; no decoder layer was traced.")
    ranks = {r.get("rank") for _, r in records}
    if len(ranks) > 1 or (file_rank is not None and ranks != {file_rank} and ranks != {None}):
        raise UserError(f"{jsonl}: holds records of rank(s) {sorted(str(x) for x in ranks)}, not one rank "
                        f"{file_rank if file_rank is not None else ''}.")
    rank = next(iter(ranks)) if ranks != {None} else file_rank
    ks = {r["topk"] for _, r in records}
    if len(ks) != 1:
        raise UserError(f"{jsonl}: records have topk {sorted(ks)}; a trace has one top_k.")
    k = ks.pop()
    if k == 0:
        raise UserError(f"{jsonl}: topk is 0; no expert was routed.")
    # Sidecars: every record points into one, or none does (the capture was on or off for the run).
    wanted: dict[str, _Sidecar] = {}
    for col, (stem, off, _, _, flag) in SIDECARS.items():
        has = [off in r for _, r in records]
        if not any(has) or routings_only:
            continue
        if not all(has):
            n = records[has.index(False)][0]
            raise UserError(f"{jsonl}: line {n}: has no {off} while other records do; the {stem} capture is incomplete "
                            "(pass --routings-only to import the expert ids alone).")
        side = rank if rank is not None else 0
        wanted[col] = _Sidecar(jsonl.parent / f"{stem}_rank{side}.bin", jsonl, flag)
    if routings_only and any(SIDECARS[c][1] in r for c in SIDECARS for _, r in records):
        notes.append("sidecars not read (--routings-only): no gate_input or logits")
    from traces.importers import field_notes

    read = {"top_indices": "experts", "layer": "layer", "step": "batch (split where a layer repeats)",
            "num_tokens": "tokens per record", "topk": "top_k", "rank": "provenance rank",
            "block": "MTP records left out", "mtp_idx": "MTP records left out"}
    for col, (_, off, nb, shp, _) in SIDECARS.items():
        if col in wanted:
            read.update({off: col, nb: col, shp: col})
    notes[:0] = field_notes(read, seen_fields, "record fields")
    try:
        return _build(jsonl, records, wanted, sources, out_dir, sizes=sizes, force=force, k=k, rank=rank,
                      prefill_steps=prefill_steps, notes=notes, provenance=provenance, write_trace=write_trace,
                      default_gating=default_gating, drop_warmup=drop_warmup)
    finally:
        for s in wanted.values():
            s.close()


def _build(jsonl: Path, records: list[tuple[int, dict]], sidecars: dict[str, Any], sources: list[Path], out_dir: Path, *,
           sizes: Any, force: bool, k: int, rank: int | None, prefill_steps: int, notes: list[str], provenance: Any,
           write_trace: Any, default_gating: Any, drop_warmup: bool = False) -> Path:
    # Batches: a step, split again wherever a layer fires a second time inside it.
    batch_of: list[int] = []
    b = -1
    last_step = None
    seen: set[int] = set()
    step_ids: list[int] = []
    for n, r in records:
        if r["step"] != last_step or r["layer"] in seen:
            if last_step is not None and r["step"] < last_step:
                raise UserError(f"{jsonl}: line {n}: step {r['step']} follows step {last_step} (records out of order).")
            b += 1
            seen = set()
            if r["step"] != last_step:
                step_ids.append(r["step"])
            last_step = r["step"]
        seen.add(r["layer"])
        batch_of.append(b)
    prefill_step_set = set(step_ids[:prefill_steps])
    tokens_of_batch: dict[int, int] = {}
    cols: dict[str, list[np.ndarray]] = {c: [] for c in ("batch", "phase", "step", "layer", "experts", "line", *sidecars)}
    first_token = 0
    cur = -1
    for (n, r), bb in zip(records, batch_of):
        T = r["num_tokens"]
        ex = _indices(r, jsonl, n)
        if bb != cur:
            first_token += tokens_of_batch.get(cur, 0)
            cur = bb
            tokens_of_batch[bb] = T
        elif tokens_of_batch[bb] != T:
            raise UserError(f"{jsonl}: line {n}: layer {r['layer']} has {T} tokens, the other layers of its forward "
                            f"pass {tokens_of_batch[bb]}.")
        if T == 0:
            continue
        cols["batch"].append(np.full(T, bb, np.int32))
        cols["phase"].append(np.full(T, PHASE_PREFILL if r["step"] in prefill_step_set else PHASE_DECODE, np.int8))
        cols["step"].append(np.arange(first_token, first_token + T, dtype=np.int64))
        cols["layer"].append(np.full(T, r["layer"], np.int64))
        cols["experts"].append(ex)
        cols["line"].append(np.full(T, n, np.int64))
        for col, side in sidecars.items():
            _, off, nb, shp, _ = SIDECARS[col]
            cols[col].append(side.read(r.get(off), r.get(nb), r.get(shp), T, f"{jsonl}: line {n}"))
    if not cols["batch"]:
        raise UserError(f"{jsonl}: every record has num_tokens 0; nothing was routed.")
    cat = {c: np.concatenate(v) for c, v in cols.items()}
    total = int(cat["step"].max()) + 1
    if total > np.iinfo(np.int32).max:
        raise UserError(f"{jsonl}: holds {total} tokens, more than a trace's int32 steps number.")
    layers = cat["layer"]
    ex = cat["experts"]
    where = str(jsonl)
    n_layer = sizes.n_layer if sizes.n_layer is not None else int(layers.max()) + 1
    if sizes.n_layer is None:
        notes.append(f"the log does not state the layer count: n_layer = largest layer index + 1 = {n_layer}")
    if int(layers.max()) >= n_layer:
        i = int(np.argmax(layers >= n_layer))
        raise UserError(f"{where}: line {int(cat['line'][i])}: routes layer {int(layers[i])}, but the model has {n_layer} "
                        f"layers (0..{n_layer - 1}).")
    n_expert = sizes.n_expert
    if "logits" in cat:
        width = cat["logits"].shape[1]
        if n_expert is not None and width != n_expert:
            raise UserError(f"{where}: its logits cover {width} experts, the model of the sizes {n_expert}.")
        n_expert = width
    if n_expert is None:
        n_expert = int(ex.max()) + 1
        notes.append(f"the log does not state the expert count: n_expert = largest expert id + 1 = {n_expert} "
                     "(add --sizes-from MODEL to take it from the model)")
    if int(ex.max()) >= n_expert:
        i = int(np.flatnonzero((ex >= n_expert).any(axis=1))[0])
        raise UserError(f"{where}: line {int(cat['line'][i])}: top_indices routes expert {int(ex[i].max())}, but the "
                        f"model has {n_expert} experts (ids 0..{n_expert - 1}).")
    dup = repeated_expert_rows(ex)
    if dup.size:
        raise UserError(f"{where}: line {int(cat['line'][dup[0]])}: layer {int(layers[dup[0]])} of forward pass "
                        f"{int(cat['batch'][dup[0]])}: a token "
                        "selects the same expert twice.")
    n_embd = sizes.n_embd
    if "gate_input" in cat:
        width = cat["gate_input"].shape[1]
        if n_embd is not None and width != n_embd:
            raise UserError(f"{where}: its hidden states have {width} values per token, the model {n_embd}.")
        n_embd = width
    moe_layers = sorted(int(x) for x in np.unique(layers))
    expert_bytes, dense_bytes = sizes.for_layers(n_layer, moe_layers, where)
    notes.append("the log records no positions, requests or phase: tokens numbered in file order as one stream "
                 f"(step = token index in the run); the first {prefill_steps} step(s) taken as prefill, the rest decode")
    notes.append("slot order as recorded: Megatron's hook path takes a routing's experts from the routing map, in "
                 "ascending id, not router rank order (the --moe-enable-routing-replay sink keeps the router's order); "
                 "no routing weights recorded (NaN)")
    meta = {
        "model": {"name": sizes.name or "unknown", "arch": sizes.arch or "unknown", "n_layer": n_layer,
                  "moe_layers": moe_layers, "n_expert": n_expert, "top_k": k, "top_k_native": sizes.top_k,
                  "n_embd": n_embd},
        "expert_bytes": expert_bytes, "dense_bytes": dense_bytes, "gating": default_gating(),
        "provenance": provenance(NAME, sources, engine=ENGINE, engine_version=None, notes=notes, sizes=sizes.source,
                                 rank=rank, batching="one firing of the router layers (a Megatron step, split where a "
                                 "layer repeats) = one batch"),
    }
    optional = {c: cat[c] for c in sidecars}
    weights = np.full(ex.shape, np.nan, np.float32)
    return write_trace(Path(out_dir), meta, batch=cat["batch"], phase=cat["phase"], step=cat["step"].astype(np.int32),
                       layer=layers.astype(np.int16), experts=ex.astype(np.int32), weights=weights, optional=optional,
                       force=force, inputs=sources + [s.path for s in sidecars.values()], what=where,
                       drop_warmup=drop_warmup)


def _options():
    from traces.importers import DROP_WARMUP, ImportOption

    return (
        ImportOption("prefill_steps", "--prefill-steps", int, "the leading steps that were prompt passes (prefill); "
                     "the log does not say (default 1: inference's first pass)", 1),
        ImportOption("routings_only", "--routings-only", bool, "import the expert ids without the .bin sidecars", False),
        DROP_WARMUP,
    )


OPTIONS = _options()


def sniff(paths: list[Path]) -> bool:
    from traces.importers import head_bytes

    jsonls = [p for p in paths if p.suffix.lower() == ".jsonl"]
    if len(jsonls) != 1 or any(p.suffix.lower() not in (".jsonl", ".bin") for p in paths):
        return False
    # A record's first line can be megabytes (top_indices); its leading keys are what Megatron writes first.
    head = head_bytes(jsonls[0], 4096)
    return head.startswith(b"{") and all(key in head for key in (b'"step"', b'"layer"', b'"num_tokens"', b'"topk"'))
