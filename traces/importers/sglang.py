"""Importer for SGLang's routing logs: the expert distribution recorder's ``per_token`` dumps and
``return_routed_experts`` responses.

What SGLang writes (read in its own source, sgl-project/sglang:
``python/sglang/srt/eplb/expert_distribution.py`` at 02295fe5, ``python/sglang/srt/layers/moe/
routed_experts_capturer.py`` at 0837e911, the tokenizer manager's ``meta_info`` fields):

- ``--expert-distribution-recorder-mode per_token``, then ``/start_expert_distribution_record``,
  ``/stop_...`` and ``/dump_expert_distribution_record``: ``torch.save`` of
  ``{"records": [...], "last_physical_to_logical_map": int tensor [layers, physical experts]}`` as
  ``expert_distribution_recorder_{time}_{rank}.pt`` in ``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR``.
  One record per forward pass: ``forward_pass_id``, ``rank``, ``gatherer_key``, ``input_ids`` and
  ``positions`` (lists, one per token), ``extend_seq_lens`` (the requests' token counts of an extend
  pass; None for decode), ``forward_mode`` (``ForwardMode`` value: 1 EXTEND, 2 DECODE, 3 MIXED,
  4 IDLE), ``topk_ids_of_layer`` int32 [layers, tokens, 8] padded with -1 (slots past top_k; layers
  without experts stay -1), ``misc_objects``, ``global_physical_count``. Ids are *physical* expert
  slots; ``last_physical_to_logical_map`` (the map at dump time: "last") turns them into the
  model's expert ids. One forward pass = one batch. The dump names no request: requests are linked
  across passes by position continuity in batch order (SGLang keeps a running batch's order, new
  requests join at the end), said in the provenance notes.
- ``--enable-return-routed-experts`` with ``"return_routed_experts": true`` on ``/generate``: the
  response's ``meta_info.routed_experts`` is base64 of little-endian int32, C order, logical shape
  [prompt_tokens + completion_tokens - 1, layers, top_k] (the last token is never forwarded), with
  ``prompt_tokens`` / ``completion_tokens`` / ``cached_tokens`` beside it. The first
  ``cached_tokens`` prompt positions came from the radix cache, not from this run: not routed here.
  These responses carry no batch structure: the batches come from a stated schedule, as for vLLM.

A ``.pt`` is read with ``torch.load(weights_only=True)``: a file that would run code or build any
object other than tensors, lists, dicts and numbers is refused, never executed.
"""

from __future__ import annotations

import base64
import binascii
import re
from pathlib import Path
from typing import Any

import numpy as np

from traces.format.errors import UserError
from traces.importers import json_objects, repeated_expert_rows
from traces.importers.vllm import Routes, import_routes, moe_layer_axis
from traces.util.units import PHASE_DECODE, PHASE_PREFILL

NAME = "sglang"
ENGINE = "SGLang"
SUMMARY = ("SGLang: expert_distribution_recorder per_token dumps (.pt, one forward pass = one batch) or "
           "return_routed_experts responses (JSON/JSONL, meta_info.routed_experts)")
TAKES_SIZES = True
MAX_SOURCES = None

MODE_EXTEND, MODE_DECODE, MODE_MIXED, MODE_IDLE = 1, 2, 3, 4
_PT_NAME = re.compile(r"expert_distribution_recorder_([0-9.]+)_(\d+)\.pt$")


# -- per_token .pt dumps --------------------------------------------------------------------------

def load_pt(path: Path) -> Any:
    """``torch.load(weights_only=True)``: tensors, lists, dicts and numbers only; anything that would
    run code is refused (and not run)."""
    try:
        import torch
    except ImportError:
        raise UserError(f"{path}: reading an SGLang .pt dump needs torch (pip install torch).") from None
    import pickle
    import zipfile

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "unsupported object"
        if "weights only" in str(e).lower() or "weights_only" in str(e).lower():
            raise UserError(f"{path}: refused without loading it: it asks to run code or build objects an SGLang "
                            f"routing dump never holds ({first[:160]}).") from None
        raise UserError(f"{path}: is not a readable torch .pt file (truncated or corrupt: {first[:160]}).") from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError, KeyError, IndexError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{path}: is not a readable torch .pt file (truncated or corrupt: {first[:160]}).") from None


def _np(x: Any, where: str) -> np.ndarray:
    try:
        import torch

        if isinstance(x, torch.Tensor):
            return x.cpu().numpy()
    except ImportError:  # pragma: no cover - load_pt needed torch already
        pass
    raise UserError(f"{where}: is not a tensor.")


def _ints(x: Any, where: str) -> list[int]:
    if not isinstance(x, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in x):
        raise UserError(f"{where}: is not a list of integers.")
    return x


def read_dump(path: Path) -> tuple[list[dict], np.ndarray, int | None]:
    """(records, physical->logical map [layers, physical], rank) of one per_token dump."""
    data = load_pt(path)
    if not isinstance(data, dict) or "records" not in data:
        raise UserError(f"{path}: has no 'records'; not an SGLang per_token expert distribution dump "
                        "(the stat modes hold counts, not routings).")
    recs = data["records"]
    if not isinstance(recs, list):
        raise UserError(f"{path}: 'records' is not a list.")
    if "last_physical_to_logical_map" not in data:
        raise UserError(f"{path}: has no last_physical_to_logical_map to turn physical expert slots into expert ids.")
    p2l = _np(data["last_physical_to_logical_map"], f"{path}: last_physical_to_logical_map")
    if p2l.ndim != 2 or p2l.dtype.kind not in "iu":
        raise UserError(f"{path}: last_physical_to_logical_map has shape {list(p2l.shape)} ({p2l.dtype}), expected "
                        "an integer [layers, physical experts] map.")
    m = _PT_NAME.search(path.name)
    return recs, p2l.astype(np.int64), int(m.group(2)) if m else None


def dump_passes(path: Path, recs: list[dict], p2l: np.ndarray) -> list[dict]:
    """Each forward pass checked: tokens, positions, segments (request token counts), phase per
    token, physical ids [layers, tokens, 8]."""
    out = []
    last_id = None
    L = p2l.shape[0]
    for i, rec in enumerate(recs):
        where = f"{path}: record {i}"
        if not isinstance(rec, dict):
            raise UserError(f"{where}: is not a dict.")
        missing = [k for k in ("forward_pass_id", "input_ids", "positions", "forward_mode", "topk_ids_of_layer") if k not in rec]
        if missing:
            raise UserError(f"{where}: lacks {', '.join(missing)}; not a per_token record.")
        fid = rec["forward_pass_id"]
        if not isinstance(fid, int) or (last_id is not None and fid <= last_id):
            raise UserError(f"{where}: forward_pass_id {fid!r} does not follow {last_id} (records out of order or repeated).")
        last_id = fid
        ids = _ints(rec["input_ids"], f"{where}: input_ids")
        pos = _ints(rec["positions"], f"{where}: positions")
        for name, vals in (("input_ids", ids), ("positions", pos)):
            neg = next((j for j, v in enumerate(vals) if v < 0), None)
            if neg is not None:
                raise UserError(f"{where}: {name}[{neg}] is {vals[neg]}, negative.")
        T = len(ids)
        if len(pos) != T:
            raise UserError(f"{where}: has {T} input_ids but {len(pos)} positions.")
        mode = rec["forward_mode"]
        topk = _np(rec["topk_ids_of_layer"], f"{where}: topk_ids_of_layer")
        if topk.ndim != 3 or topk.shape[0] != L or topk.shape[1] != T or topk.dtype.kind not in "iu":
            raise UserError(f"{where}: topk_ids_of_layer has shape {list(topk.shape)}, expected [{L}, {T}, slots] "
                            f"integers (layers of the physical-to-logical map, this pass's tokens).")
        if T == 0 or mode == MODE_IDLE:
            continue
        if mode == MODE_DECODE:
            seg = [1] * T
        elif mode in (MODE_EXTEND, MODE_MIXED):
            seg = _ints(rec.get("extend_seq_lens"), f"{where}: extend_seq_lens")
            if sum(seg) != T or any(s <= 0 for s in seg):
                raise UserError(f"{where}: extend_seq_lens {seg[:8]} do not add up to its {T} tokens.")
        else:
            raise UserError(f"{where}: forward_mode {mode!r} is not EXTEND (1), DECODE (2), MIXED (3) or IDLE (4); "
                            "speculative-decoding passes are not imported.")
        seg_arr = np.asarray(seg, dtype=np.int64)
        if mode == MODE_DECODE:
            phase = np.full(T, PHASE_DECODE, np.int8)
        elif mode == MODE_EXTEND:
            phase = np.full(T, PHASE_PREFILL, np.int8)
        else:  # MIXED: decoding requests ride along as one-token extends
            phase = np.repeat(np.where(seg_arr == 1, PHASE_DECODE, PHASE_PREFILL), seg_arr).astype(np.int8)
        posa = np.asarray(pos, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(seg_arr)[:-1]])
        for s, n in zip(starts, seg_arr):
            if n > 1 and (np.diff(posa[s:s + n]) != 1).any():
                raise UserError(f"{where}: positions of one request's tokens are not consecutive.")
        out.append({"where": where, "mode": mode, "ids": np.asarray(ids, np.int64), "pos": posa, "seg": seg_arr,
                    "phase": phase, "topk": topk.astype(np.int64)})
    return out


def link_requests(passes: list[dict]) -> tuple[list[np.ndarray], int, int]:
    """Request id per token of every pass, linking a request's segments across passes by position
    continuity in batch order (SGLang keeps its running batch's order; new requests join at the end).

    A decode (or mixed) pass holds every running request, so a decoding request missing from one has
    finished and cannot claim a later token; a request seen only in extend passes may be part-way
    through a chunked prompt and stays linkable. Where two running requests wait for the same
    position, the first in batch order takes the token: the third value counts such ambiguous links
    (positions cannot tell them apart: a request that just finished looks like one that goes on)."""
    active: list[list[int]] = []  # [request id, next position, decoding (0/1)], in batch order
    next_id = 0
    ambiguous = 0
    out = []
    for p in passes:
        req = np.empty(p["ids"].size, np.int64)
        decode_pass = p["mode"] in (MODE_DECODE, MODE_MIXED)
        by_pos: dict[int, list[int]] = {}  # next position -> indices into active, ascending
        for j, a in enumerate(active):
            by_pos.setdefault(a[1], []).append(j)
        taken: set[int] = set()
        cursor = 0
        start = 0
        for n in p["seg"]:
            first = int(p["pos"][start])
            cands = [j for j in by_pos.get(first, ()) if j >= cursor and j not in taken] if first > 0 else []
            if cands:
                found = cands[0]
                ambiguous += len(cands) > 1
                cursor = found + 1
            else:
                active.append([next_id, 0, 0])
                next_id += 1
                found = len(active) - 1
            taken.add(found)
            entry = active[found]
            entry[1] = int(p["pos"][start + n - 1]) + 1
            if decode_pass and n == 1:
                entry[2] = 1
            req[start:start + n] = entry[0]
            start += n
        if decode_pass:
            active = [a for j, a in enumerate(active) if j in taken or not a[2]]
        out.append(req)
    return out, next_id, ambiguous


def import_dumps(sources: list[Path], out_dir: Path, *, sizes: Any, force: bool, drop_warmup: bool = False) -> Path:
    from traces.format.schema import default_gating
    from traces.importers import provenance, write_trace
    from traces.importers._sizes import require_sizes

    where = str(sources[0]) if len(sources) == 1 else f"{sources[0]} (and {len(sources) - 1} more)"
    sizes = require_sizes(sizes, where, NAME)
    notes: list[str] = []
    passes: list[dict] = []
    p2l_all: np.ndarray | None = None
    ranks = set()
    for path in sources:
        recs, p2l, rank = read_dump(path)
        if p2l_all is not None and p2l.shape != p2l_all.shape:
            raise UserError(f"{path}: its physical-to-logical map is {list(p2l.shape)}, the first dump's "
                            f"{list(p2l_all.shape)}; not the same model.")
        ranks.add(rank)
        p2l_all = p2l
        for p in dump_passes(path, recs, p2l):
            # Physical slot -> logical expert with this dump's own map.
            topk = p["topk"]
            if (topk < -1).any():
                lay, tok, slot = (int(x) for x in np.argwhere(topk < -1)[0])
                raise UserError(f"{p['where']}: topk_ids_of_layer[{lay}][{tok}][{slot}] is {int(topk[lay, tok, slot])}; "
                                "a physical expert slot is >= 0, or -1 for none.")
            valid = topk >= 0
            if (topk[valid] >= p2l.shape[1]).any():
                raise UserError(f"{p['where']}: names physical expert slot {int(topk[valid].max())}, but the map has "
                                f"{p2l.shape[1]} slots.")
            p["logical"] = np.where(valid, p2l[np.arange(p2l.shape[0])[:, None, None], np.where(valid, topk, 0)], -1)
            passes.append(p)
    if len(ranks) > 1:
        raise UserError(f"{where}: dumps of ranks {sorted(r for r in ranks if r is not None)}; import one rank's dumps "
                        "at a time (each rank serves its own batches).")
    if not passes:
        raise UserError(f"{where}: holds no forward pass with tokens; was the recorder started before the requests?")
    assert p2l_all is not None
    L = p2l_all.shape[0]
    # Slots past top_k are -1 padding; a layer without experts is -1 everywhere.
    counts = np.concatenate([(p["logical"] >= 0).sum(axis=2) for p in passes], axis=1)  # [L, tokens]
    moe = np.flatnonzero(counts.any(axis=1))
    if moe.size == 0:
        raise UserError(f"{where}: every expert id is -1 (no layer was recorded).")
    ks = np.unique(counts[moe][counts[moe] > 0])
    if ks.size != 1:
        raise UserError(f"{where}: tokens select {', '.join(str(int(x)) for x in ks)} experts at MoE layers; a "
                        "routing has one top_k (a truncated or mixed dump).")
    k = int(ks[0])
    empty = int((counts[moe] == 0).sum())
    if empty:
        notes.append(f"{empty} (token, MoE layer) pair(s) hold no expert ids (-1): not routed there, absent")
    for p in passes:
        lg = p["logical"][moe]
        lead = lg[..., :k]
        n_valid = (lg >= 0).sum(axis=2)
        if ((n_valid > 0) & (lead < 0).any(axis=2)).any() or (lg[..., k:] >= 0).any():
            raise UserError(f"{p['where']}: expert ids are not the first {k} slots of each routing (-1 padding inside).")
    n_layer, layer_ids = _dump_layers(L, moe, sizes, where, notes)
    n_expert = sizes.n_expert if sizes.n_expert is not None else int(p2l_all.max()) + 1
    if sizes.n_expert is None:
        notes.append(f"n_expert = largest logical id in the physical-to-logical map + 1 = {n_expert}")
    if int(p2l_all.max()) >= n_expert or int(p2l_all.min()) < 0:
        raise UserError(f"{where}: the physical-to-logical map names expert ids outside 0..{n_expert - 1}.")
    reqs, n_req, ambiguous = link_requests(passes)
    notes.append("one forward pass = one batch; SGLang's dump names no request: requests linked across passes by "
                 f"position continuity in batch order ({n_req} requests; {ambiguous} token(s) where two running "
                 "requests waited for the same position went to the first in batch order)")
    notes.append("physical expert slots mapped to expert ids with last_physical_to_logical_map (the map at dump time; "
                 "if EPLB rebalanced during recording, earlier passes used another map)")
    # Rows: (batch, layer, request, step).
    cols: dict[str, list[np.ndarray]] = {c: [] for c in ("batch", "phase", "step", "layer", "experts", "request", "token")}
    b = 0
    split = 0
    for p, req in zip(passes, reqs):
        lg = p["logical"][moe][..., :k]  # [moe layers, T, k]
        ok = (lg >= 0).all(axis=2)
        # A MIXED pass holds prefill and decode tokens; trace format v1 holds one phase per batch, so
        # it becomes a prefill batch then a decode batch (said in the notes: their loads count apart).
        two = bool((p["phase"] == PHASE_PREFILL).any() and (p["phase"] == PHASE_DECODE).any())
        split += two
        tb = b + (two & (p["phase"] == PHASE_DECODE)).astype(np.int32)
        order = np.lexsort((p["pos"], req))
        for li, layer in enumerate(layer_ids):
            sel = order[ok[li][order]]
            cols["batch"].append(tb[sel])
            cols["phase"].append(p["phase"][sel])
            cols["step"].append(p["pos"][sel].astype(np.int32))
            cols["layer"].append(np.full(sel.size, layer, np.int16))
            cols["experts"].append(lg[li][sel].astype(np.int32))
            cols["request"].append(req[sel])
            cols["token"].append(p["ids"][sel].astype(np.int32))
        b += 1 + two
    if split:
        notes.append(f"{split} MIXED forward pass(es) (--enable-mixed-chunk: prompt chunks with decode tokens) each "
                     "became a prefill batch then a decode batch (a trace batch holds one phase); their loads count apart")
    cat = {c: np.concatenate(v) for c, v in cols.items()}
    ex = cat["experts"]
    dup = repeated_expert_rows(ex)
    if dup.size:
        i = int(dup[0])
        raise UserError(f"{where}: forward pass {int(cat['batch'][i])}, layer {int(cat['layer'][i])}: a token "
                        "selects the same expert twice.")
    expert_bytes, dense_bytes = sizes.for_layers(n_layer, layer_ids, where)
    meta = {
        "model": {"name": sizes.name or "unknown", "arch": sizes.arch or "unknown", "n_layer": n_layer,
                  "moe_layers": layer_ids, "n_expert": n_expert, "top_k": k, "top_k_native": sizes.top_k,
                  "n_embd": sizes.n_embd},
        "expert_bytes": expert_bytes, "dense_bytes": dense_bytes, "gating": default_gating(),
        "provenance": provenance(NAME, sources, engine=ENGINE, engine_version=None, notes=notes, sizes=sizes.source,
                                 batching="one forward pass of the engine = one batch (forward_pass_id order); "
                                 "a MIXED pass = a prefill batch then a decode batch",
                                 rank=next(iter(ranks))),
    }
    weights = np.full(ex.shape, np.nan, np.float32)
    return write_trace(out_dir, meta, batch=cat["batch"], phase=cat["phase"], step=cat["step"], layer=cat["layer"],
                       experts=ex, weights=weights, optional={"request": cat["request"], "token": cat["token"]},
                       force=force, inputs=sources, what=where, drop_warmup=drop_warmup)


def _dump_layers(L: int, moe: np.ndarray, sizes: Any, where: str, notes: list[str]) -> tuple[int, list[int]]:
    n_layer = sizes.n_layer
    if n_layer is not None and n_layer != L:
        raise UserError(f"{where}: the dump has {L} layers but the model of the sizes has {n_layer}; not this model's dump.")
    n_layer = L
    dense = sorted(set(range(L)) - set(int(x) for x in moe))
    if dense:
        notes.append(f"layer(s) {dense} hold no expert ids (-1 throughout): layers without experts, absent")
    return n_layer, [int(x) for x in moe]


# -- return_routed_experts responses -------------------------------------------------------------

def read_responses(path: Path) -> list[dict]:
    objs = json_objects(path)
    out = []
    for where, o in objs:
        mi = o.get("meta_info") if isinstance(o, dict) else None
        if not isinstance(mi, dict):
            raise UserError(f"{where}: has no meta_info object; not an SGLang /generate response.")
        if not isinstance(mi.get("routed_experts"), str):
            raise UserError(f"{where}: meta_info has no routed_experts (start the server with "
                            "--enable-return-routed-experts and send \"return_routed_experts\": true).")
        for key in ("prompt_tokens", "completion_tokens"):
            if not isinstance(mi.get(key), int) or isinstance(mi.get(key), bool) or mi[key] < 0:
                raise UserError(f"{where}: meta_info.{key} is missing or not a token count.")
        out.append({"where": where, "meta": mi, "output_ids": o.get("output_ids"),
                    "fields": [k for k in o if k != "meta_info"] + [f"meta_info.{k}" for k in mi]})
    if not out:
        raise UserError(f"{path}: holds no responses.")
    return out


def response_routes(resp: dict, L: int | None, k: int | None, notes_cached: list[int]) -> tuple[Routes, int, int]:
    where, mi = resp["where"], resp["meta"]
    try:
        raw = base64.b64decode(mi["routed_experts"], validate=True)
    except (binascii.Error, ValueError):
        raise UserError(f"{where}: meta_info.routed_experts is not base64.") from None
    P, C = mi["prompt_tokens"], mi["completion_tokens"]
    rows = P + C - 1
    if len(raw) % 4:
        raise UserError(f"{where}: meta_info.routed_experts holds {len(raw)} bytes, not whole int32 ids (truncated?).")
    n = len(raw) // 4
    if rows <= 0 or n % rows:
        raise UserError(f"{where}: meta_info.routed_experts holds {n} ids, not a whole number of rows for "
                        f"{P} prompt + {C} completion - 1 = {rows} positions (truncated?).")
    lk = n // rows
    if L is not None:
        if lk % L:
            raise UserError(f"{where}: {lk} ids per position is not a multiple of the model's {L} layers.")
        k_here = lk // L
    elif k is not None:
        if lk % k:
            raise UserError(f"{where}: {lk} ids per position is not a multiple of --top-k {k}.")
        k_here = k
    else:
        raise UserError(f"{where}: SGLang's routed_experts is a flat int32 list; add --sizes-from MODEL (its layer "
                        "count) or --top-k K to cut it into [positions, layers, top_k].")
    arr = np.frombuffer(raw, dtype="<i4").astype(np.int64).reshape(rows, lk // k_here, k_here)
    if (arr < 0).any():
        raise UserError(f"{where}: meta_info.routed_experts holds a negative expert id.")
    routed = np.ones(rows, bool)
    cached = mi.get("cached_tokens")
    # A count the engine cannot have written is refused, never clipped: -3 is not "none cached", and a
    # count beyond the prompt would drop the whole prompt as cached.
    if cached is not None and (not isinstance(cached, int) or isinstance(cached, bool) or cached < 0):
        raise UserError(f"{where}: meta_info.cached_tokens {cached!r} is not a token count (an integer >= 0).")
    if cached is not None and cached > P:
        raise UserError(f"{where}: meta_info.cached_tokens {cached} is more than the {P} prompt tokens "
                        "(only prompt positions come from the radix cache).")
    if cached:
        routed[:cached] = False
        notes_cached.append(cached)
    return Routes(where=where, prompt_len=min(P, rows), experts=arr, routed=routed, token_ids=None), lk // k_here, k_here


def import_responses(sources: list[Path], out_dir: Path, *, sizes: Any, force: bool, schedule: str, max_batch: int,
                     prefill_chunk: int | None, top_k: int | None, drop_warmup: bool = False) -> Path:
    where = str(sources[0]) if len(sources) == 1 else f"{sources[0]} (and {len(sources) - 1} more)"
    from traces.importers._sizes import require_sizes

    sizes = require_sizes(sizes, where, NAME)
    notes: list[str] = []
    cached: list[int] = []
    routes: list[Routes] = []
    shape = None
    fields: list[str] = []
    for path in sources:
        for resp in read_responses(path):
            fields += resp["fields"]
            r, L, k = response_routes(resp, sizes.n_layer, top_k, cached)
            if shape is not None and (L, k) != shape:
                raise UserError(f"{r.where}: routes {L} layers x top-{k}, the first response {shape[0]} x top-{shape[1]}.")
            shape = (L, k)
            routes.append(r)
    from traces.importers import field_notes

    notes[:0] = field_notes({"meta_info.routed_experts": "experts", "meta_info.prompt_tokens": "prompt length",
                             "meta_info.completion_tokens": "positions", "meta_info.cached_tokens": "positions absent "
                             "(radix cache)"}, fields, "response fields")
    if cached:
        notes.append(f"{sum(cached)} prompt position(s) in {len(cached)} response(s) came from the radix cache "
                     "(meta_info.cached_tokens): not routed in this run, absent")
    keep = moe_layer_axis(routes, where, notes, engine=ENGINE)
    return import_routes(routes, keep, sources, Path(out_dir), fmt=NAME, engine=ENGINE, sizes=sizes, force=force,
                         schedule=schedule, max_batch=max_batch, prefill_chunk=prefill_chunk, notes=notes,
                         engine_version=None, model_name=None, drop_warmup=drop_warmup)


# -- the registry's interface --------------------------------------------------------------------

def _options():
    from traces.importers import DROP_WARMUP, ImportOption
    from traces.importers.vllm import SCHEDULE_HELP

    return (
        ImportOption("schedule", "--schedule", str, SCHEDULE_HELP + " (responses only; a .pt dump has its batches)",
                     "sequential"),
        ImportOption("max_batch", "--max-batch", int, "requests decoding together (continuous schedule)", 1),
        ImportOption("prefill_chunk", "--prefill-chunk", int,
                     "prompt positions per prefill batch (continuous schedule; default: a whole prompt)", None),
        ImportOption("top_k", "--top-k", int, "experts per token, to shape a response's flat ids when the sizes "
                     "do not give the layer count", None),
        DROP_WARMUP,
    )


OPTIONS = _options()


def sniff(paths: list[Path]) -> bool:
    from traces.importers import head_bytes

    if not paths:
        return False
    if all(p.suffix == ".pt" and _PT_NAME.search(p.name) for p in paths):
        return True
    for p in paths:
        if p.suffix.lower() not in (".json", ".jsonl"):
            return False
        head = head_bytes(p, 1 << 16)
        if b'"meta_info"' not in head or b'"routed_experts"' not in head:
            return False
    return True


def import_(sources: list[Path], out_dir: Path, *, sizes: Any, force: bool = False, schedule: str = "sequential",
            max_batch: int = 1, prefill_chunk: int | None = None, top_k: int | None = None,
            drop_warmup: bool = False) -> Path:
    """Import SGLang per_token dumps (``.pt``) or return_routed_experts responses (JSON/JSONL)."""
    from traces.importers import check_source

    sources = [check_source(Path(s)) for s in sources]
    pts = [p for p in sources if p.suffix.lower() == ".pt"]
    if pts and len(pts) != len(sources):
        raise UserError(f"{pts[0]}: .pt dumps and JSON responses in one import; import them separately.")
    if pts:
        if schedule != "sequential" or max_batch != 1 or prefill_chunk is not None:
            raise UserError("--schedule/--max-batch/--prefill-chunk: a per_token dump records the engine's own forward "
                            "passes (its batches); they apply to return_routed_experts responses only.")
        return import_dumps(sorted(pts, key=_dump_order), Path(out_dir), sizes=sizes, force=force,
                            drop_warmup=drop_warmup)
    for p in sources:
        if p.suffix.lower() not in (".json", ".jsonl"):
            raise UserError(f"{p}: is not a .pt dump or a .json/.jsonl response file.")
    return import_responses(sources, Path(out_dir), sizes=sizes, force=force, schedule=schedule, max_batch=max_batch,
                            prefill_chunk=prefill_chunk, top_k=top_k, drop_warmup=drop_warmup)


def _dump_order(p: Path) -> tuple[float, str]:
    m = _PT_NAME.search(p.name)
    return (float(m.group(1)) if m else float("inf"), p.name)
