"""Importer for vLLM's returned routed experts (``--enable-return-routed-experts``).

What vLLM writes (read in its own source, vllm-project/vllm: ``vllm/outputs.py`` at 003d3ee2 and
``vllm/model_executor/layers/fused_moe/routed_experts_capturer.py`` at 00bd1493; the OpenAI
server's response fields as in ``vllm/entrypoints/openai/*/protocol.py``):

- per request, ``prompt_routed_experts`` [prompt_len, layers, top_k] (``RequestOutput`` attribute
  and top-level field of a ``/v1/completions`` or ``/v1/chat/completions`` response), and per
  completion ``routed_experts`` [generated positions, layers, top_k] (``CompletionOutput``
  attribute, ``choices[i].routed_experts``). The last generated token is never fed back, so a
  completion holds one row fewer than its tokens (a row per token is accepted too);
- older vLLM returned only ``routed_experts`` covering the whole sequence (prompt and generated,
  [prompt_len + generated - 1, layers, top_k]); the prompt length then comes from
  ``prompt_token_ids`` and the split is said in the provenance notes;
- the ids are integers (int16/int32, or uint8/uint16 on the wire); on the HTTP API the arrays are
  nested JSON lists or a base64-encoded ``.npy`` (``np.save``, no pickle);
- a position served from the prefix cache was not computed in this run: vLLM fills its row with
  -1. Those positions are *not routed* here (absent from the trace, never expert -1, never a
  miss) but keep their place, so later positions keep their step;
- the layer axis is the model's ``num_hidden_layers``: a dense layer (never captured) stays 0 in
  vLLM's zero-initialised buffer. A layer that is 0 in every routed row of every request, where
  top_k > 1 (a routing cannot pick expert 0 twice), is such a dense layer and is left out;
- every id 0 in every row is a known engine bug (the capture hook never ran with some MoE
  kernels): refused, since it is not a routing.

Files read: ``.npz`` (keys ``prompt_routed_experts`` / ``routed_experts``, optional
``prompt_token_ids`` / ``token_ids``), ``.npy`` named ``*prompt_routed_experts.npy`` or
``*routed_experts.npy`` (a pair with the same stem prefix is one request), ``.json`` (one
response / RequestOutput dict, or a list of them) and ``.jsonl`` (one per line). Requests are
numbered in file order; vLLM keeps no record of which requests shared a forward pass, so the
batches come from a stated schedule (:mod:`traces.synth.schedule`).
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from traces.format.errors import UserError
from traces.importers import json_objects

NAME = "vllm"
ENGINE = "vLLM"
SUMMARY = ("vLLM --enable-return-routed-experts: prompt_routed_experts / routed_experts per request "
           "(.npy, .npz, or JSON/JSONL responses with nested lists or base64 .npy)")
TAKES_SIZES = True
MAX_SOURCES = None

NPY_MAGIC = b"\x93NUMPY"
ALL_ZERO_BUG = ("every routed expert id is 0: a known vLLM bug with some MoE kernels returns all-zero "
                "routed_experts when the capture never ran, so this log holds no routing")


@dataclass
class RawRequest:
    """One request as the engine returned it, before checking: arrays [positions, layers, k]."""

    where: str  # file (and record) for messages
    prompt: np.ndarray | None  # prompt rows, or None when the engine gave them inside ``generated``
    generated: list[np.ndarray]  # one array per completion (n > 1: several)
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[list[int] | None] = field(default_factory=list)
    cached_tokens: int | None = None  # what the response says was served from the prefix cache
    request_id: str | None = None


# -- decoding one array --------------------------------------------------------------------------

def decode_array(value: Any, where: str) -> np.ndarray | None:
    """An integer array [positions, layers, k] from nested lists, a base64 ``.npy`` string or an
    ndarray; None stays None. Never unpickles (``allow_pickle=False``)."""
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise UserError(f"{where}: is a string but not base64 (expected a base64-encoded .npy array).") from None
        if not raw.startswith(NPY_MAGIC):
            raise UserError(f"{where}: base64 that does not decode to a .npy array (no NUMPY header).")
        arr = load_npy_bytes(raw, where)
    elif isinstance(value, list):
        try:
            arr = np.array(value)
        except ValueError:
            raise UserError(f"{where}: nested lists of uneven lengths, not a [positions, layers, top_k] array.") from None
        if arr.size == 0:
            return np.zeros((0, 0, 0), dtype=np.int64)
    else:
        raise UserError(f"{where}: is a {type(value).__name__}, not nested lists or a base64 .npy array.")
    if arr.ndim != 3:
        raise UserError(f"{where}: has shape {list(arr.shape)}, expected [positions, layers, top_k].")
    if arr.dtype.kind not in "iu":
        raise UserError(f"{where}: holds {arr.dtype} values, expected integer expert ids.")
    return arr.astype(np.int64)


def load_npy_bytes(raw: bytes, where: str) -> np.ndarray:
    try:
        return np.load(io.BytesIO(raw), allow_pickle=False)
    except ValueError as e:
        if "pickle" in str(e).lower():
            raise UserError(f"{where}: is a pickled object array, not integer expert ids; refused (not unpickled).") from None
        raise UserError(f"{where}: is a truncated or malformed .npy array ({e}).") from None
    except (EOFError, OSError) as e:
        raise UserError(f"{where}: is a truncated or malformed .npy array ({e}).") from None


# -- reading files ------------------------------------------------------------------------------

def _int_list(value: Any, where: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise UserError(f"{where}: is not a list of integer token ids.")
    return value


def _engine_version(obj: dict) -> str | None:
    fp = obj.get("system_fingerprint")
    if isinstance(fp, str):
        m = re.match(r"vllm-([0-9][^-\s]*)", fp)
        if m:
            return m.group(1)
    return None


def request_from_obj(obj: Any, where: str) -> RawRequest:
    """One vLLM request from a response / RequestOutput dict (or a flat dict with the two arrays)."""
    if not isinstance(obj, dict):
        raise UserError(f"{where}: is a JSON {type(obj).__name__}, not a request output object.")
    choices = obj.get("choices", obj.get("outputs"))
    if choices is None:
        choices = [obj] if "routed_experts" in obj else []
    if not isinstance(choices, list):
        raise UserError(f"{where}: 'choices' is not a list.")
    prompt = decode_array(obj.get("prompt_routed_experts"), f"{where}: prompt_routed_experts")
    gens, toks = [], []
    for i, ch in enumerate(choices):
        if not isinstance(ch, dict):
            raise UserError(f"{where}: choice {i} is not an object.")
        g = decode_array(ch.get("routed_experts"), f"{where}: choices[{i}].routed_experts")
        if g is None:
            continue
        gens.append(g)
        toks.append(_int_list(ch.get("token_ids", ch.get("output_token_ids")), f"{where}: choices[{i}].token_ids"))
    if prompt is None and not gens:
        raise UserError(f"{where}: has neither prompt_routed_experts nor routed_experts (was the server started "
                        "with --enable-return-routed-experts, and the response not streamed?).")
    usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
    details = usage.get("prompt_tokens_details") if isinstance(usage.get("prompt_tokens_details"), dict) else {}
    cached = obj.get("num_cached_tokens", details.get("cached_tokens"))
    rid = obj.get("request_id", obj.get("id"))
    return RawRequest(where=where, prompt=prompt, generated=gens,
                      prompt_token_ids=_int_list(obj.get("prompt_token_ids"), f"{where}: prompt_token_ids"),
                      output_token_ids=toks, cached_tokens=cached if isinstance(cached, int) else None,
                      request_id=str(rid) if rid is not None else None)


# What each response field becomes (issue 30: every source column accounted for); choice fields as
# "choices[].X" (or "outputs[].X" for a RequestOutput dump).
JSON_READ = {"prompt_routed_experts": "experts (prompt positions)", "choices[].routed_experts": "experts (generated)",
             "outputs[].routed_experts": "experts (generated)", "routed_experts": "experts",
             "prompt_token_ids": "token (prompt)", "choices[].token_ids": "token (generated)",
             "outputs[].token_ids": "token (generated)", "choices[].output_token_ids": "token (generated)",
             "model": "model name", "system_fingerprint": "engine version", "choices": "completions",
             "outputs": "completions"}


def json_fields(o: Any) -> list[str]:
    """The field names of one response: top-level keys and each choice's keys as "choices[].X"."""
    if not isinstance(o, dict):
        return []
    out = list(o)
    for box in ("choices", "outputs"):
        if isinstance(o.get(box), list):
            out += [f"{box}[].{k}" for ch in o[box] if isinstance(ch, dict) for k in ch]
    return out


def read_json(path: Path, fields: list[str] | None = None) -> tuple[list[RawRequest], set[str], str | None]:
    """Requests of a .json (object or list) or .jsonl file; the model names and engine version seen
    (``fields``: every field name seen is appended)."""
    objs = json_objects(path)
    if not objs:
        raise UserError(f"{path}: holds no request outputs.")
    models: set[str] = set()
    version = None
    reqs = []
    for where, o in objs:
        if fields is not None:
            fields += json_fields(o)
        reqs.append(request_from_obj(o, where))
        if isinstance(o, dict):
            if isinstance(o.get("model"), str):
                models.add(o["model"])
            version = version or _engine_version(o)
    return reqs, models, version


def read_npz(path: Path) -> RawRequest:
    try:
        with np.load(path, allow_pickle=False) as z:
            keys = set(z.files)
            if not keys & {"prompt_routed_experts", "routed_experts"}:
                raise UserError(f"{path}: holds {', '.join(sorted(keys)) or 'no arrays'}, not prompt_routed_experts / "
                                "routed_experts.")
            arrays = {k: z[k] for k in keys}
    except (zipfile.BadZipFile, EOFError, OSError) as e:
        raise UserError(f"{path}: is not a readable .npz archive (truncated or corrupt: {e}).") from None
    except ValueError as e:
        if "pickle" in str(e).lower():
            raise UserError(f"{path}: holds a pickled object array, not integer expert ids; refused (not unpickled).") from None
        raise UserError(f"{path}: is a truncated or malformed .npz archive ({e}).") from None
    prompt = decode_array(arrays.get("prompt_routed_experts"), f"{path}: prompt_routed_experts")
    gen = decode_array(arrays.get("routed_experts"), f"{path}: routed_experts")

    def ids(key: str) -> list[int] | None:
        if key not in arrays:
            return None
        a = arrays[key]
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise UserError(f"{path}: {key} is not a 1-D integer array of token ids.")
        return [int(x) for x in a]

    return RawRequest(where=str(path), prompt=prompt, generated=[gen] if gen is not None else [],
                      prompt_token_ids=ids("prompt_token_ids"), output_token_ids=[ids("token_ids")] if gen is not None else [])


def read_npy_group(paths: list[Path]) -> list[RawRequest]:
    """``.npy`` files paired by name: ``STEM.prompt_routed_experts.npy`` + ``STEM.routed_experts.npy``
    (or ``STEM_prompt_routed_experts.npy``); one request per stem, in the order first given."""
    order: list[str] = []
    parts: dict[str, dict[str, Path]] = {}
    for p in paths:
        name = p.name[:-len(".npy")]
        if name.endswith("prompt_routed_experts"):
            stem, role = name[:-len("prompt_routed_experts")], "prompt"
        elif name.endswith("routed_experts"):
            stem, role = name[:-len("routed_experts")], "generated"
        else:
            raise UserError(f"{p}: a .npy file must be named *prompt_routed_experts.npy or *routed_experts.npy "
                            "to say whether it holds prompt or generated positions (or use .npz with those keys).")
        if stem not in parts:
            parts[stem] = {}
            order.append(stem)
        if role in parts[stem]:
            raise UserError(f"{p}: a second {role} array for the request {stem.rstrip('._-') or p.name}.")
        parts[stem][role] = p
    out = []
    for stem in order:
        arrs: dict[str, np.ndarray] = {}
        for role, p in parts[stem].items():
            raw = p.read_bytes()
            if not raw.startswith(NPY_MAGIC):
                raise UserError(f"{p}: is not a .npy file (no NUMPY header).")
            arrs[role] = decode_array(load_npy_bytes(raw, str(p)), str(p))
        where = str(parts[stem].get("generated", parts[stem].get("prompt")))
        out.append(RawRequest(where=where, prompt=arrs.get("prompt"),
                              generated=[arrs["generated"]] if "generated" in arrs else [],
                              output_token_ids=[None] if "generated" in arrs else []))
    return out


def read_sources(paths: list[Path]) -> tuple[list[RawRequest], dict[str, Any]]:
    """Every request in ``paths`` (file order), and what the files say about the run."""
    reqs: list[RawRequest] = []
    models: set[str] = set()
    version = None
    fields: list[str] = []
    npys = [p for p in paths if p.suffix.lower() == ".npy"]
    for p in paths:
        suf = p.suffix.lower()
        if suf == ".npz":
            reqs.append(read_npz(p))
        elif suf in (".json", ".jsonl"):
            r, m, v = read_json(p, fields)
            reqs += r
            models |= m
            version = version or v
        elif suf == ".npy":
            if p == npys[0]:
                reqs += read_npy_group(npys)
        else:
            raise UserError(f"{p}: is not a .npy, .npz, .json or .jsonl file; vLLM's routed experts come as one of these.")
    return reqs, {"models": sorted(models), "engine_version": version, "fields": fields}


# -- checking and shaping -----------------------------------------------------------------------

@dataclass
class Routes:
    """One request's checked routing: positions in request order (prompt first)."""

    where: str
    prompt_len: int
    experts: np.ndarray  # int64 [positions, layers, k], unrouted rows set to 0
    routed: np.ndarray  # bool [positions]
    token_ids: np.ndarray | None


def unrouted_rows(arr: np.ndarray, where: str, prompt_len: int | None = None) -> np.ndarray:
    """bool [positions]: True where the engine routed the position. Only -1 on a whole position marks
    one the engine did not route (its prefix cache); any other negative id is refused with the
    position and field named, never taken for a cached position (-5 is no routing vLLM writes)."""
    other = arr < -1
    if other.any():
        pos, lay, slot = (int(x) for x in np.argwhere(other)[0])
        if prompt_len is None:
            field_ = f"position {pos}"
        elif pos < prompt_len:
            field_ = f"prompt_routed_experts position {pos}"
        else:
            field_ = f"routed_experts position {pos - prompt_len} (sequence position {pos})"
        raise UserError(f"{where}: {field_}, layer {lay}, slot {slot}: expert id {int(arr[pos, lay, slot])} is negative "
                        "(only -1 on a whole position marks a prefix-cached token).")
    neg = arr < 0
    whole = neg.reshape(arr.shape[0], -1).all(axis=1) if arr.size else np.zeros(arr.shape[0], bool)
    if arr.size and arr.shape[1] * arr.shape[2] == 0:
        whole = np.zeros(arr.shape[0], bool)
    bad = neg.reshape(arr.shape[0], -1).any(axis=1) & ~whole if arr.size else np.zeros(arr.shape[0], bool)
    if bad.any():
        i = int(np.argmax(bad))
        raise UserError(f"{where}: position {i} has negative expert ids on some layers or slots only "
                        "(-1 on a whole position marks a prefix-cached token; anything else is not a routing).")
    if arr.size and (arr[~whole] < 0).any():  # pragma: no cover - covered by the two checks above
        raise UserError(f"{where}: holds a negative expert id.")
    return ~whole


def shape_requests(raw: list[RawRequest], notes: list[str]) -> list[Routes]:
    """Join each request's prompt and completions into position-ordered arrays, with the unrouted
    (prefix-cached) positions marked; refuses shapes that disagree."""
    out: list[Routes] = []
    shape: tuple[int, int] | None = None
    split_full = 0
    forked = 0
    cached_rows = 0
    for r in raw:
        arrays = ([r.prompt] if r.prompt is not None else []) + list(r.generated)
        for a in arrays:
            if a.shape[0] == 0:
                continue
            if shape is None:
                shape = (a.shape[1], a.shape[2])
            elif (a.shape[1], a.shape[2]) != shape:
                raise UserError(f"{r.where}: routes {a.shape[1]} layers x top-{a.shape[2]}, the first request "
                                f"{shape[0]} x top-{shape[1]}.")
        if shape is not None:  # an empty list decodes as [0, 0, 0]: give it the log's layers and k
            r.prompt = r.prompt.reshape((0, *shape)) if r.prompt is not None and r.prompt.size == 0 else r.prompt
            r.generated = [g.reshape((0, *shape)) if g.size == 0 else g for g in r.generated]
        gens = r.generated or [np.zeros((0,) + (shape or (0, 0)), np.int64)]
        for j, gen in enumerate(gens):
            ptoks = r.prompt_token_ids
            otoks = r.output_token_ids[j] if j < len(r.output_token_ids) else None
            if r.prompt is not None:
                prompt = r.prompt
                if ptoks is not None and len(ptoks) != prompt.shape[0]:
                    raise UserError(f"{r.where}: prompt_routed_experts has {prompt.shape[0]} positions but "
                                    f"prompt_token_ids has {len(ptoks)} tokens.")
                P = prompt.shape[0]
                full = np.concatenate([prompt, gen])
            elif ptoks is not None:
                # Older vLLM: one array over the whole sequence; the prompt length splits it.
                P = len(ptoks)
                if gen.shape[0] < P:
                    raise UserError(f"{r.where}: routed_experts has {gen.shape[0]} positions, fewer than the "
                                    f"{P} prompt tokens, and there is no prompt_routed_experts.")
                full = gen
                split_full += 1
            else:
                raise UserError(f"{r.where}: has routed_experts but neither prompt_routed_experts nor prompt_token_ids, "
                                "so prompt and generated positions cannot be told apart.")
            gen_rows = full.shape[0] - P
            token_ids = None
            if ptoks is not None and otoks is not None:
                if gen_rows > len(otoks):
                    raise UserError(f"{r.where}: completion {j} has {gen_rows} routed positions but only "
                                    f"{len(otoks)} generated tokens.")
                token_ids = np.asarray(list(ptoks) + list(otoks[:gen_rows]), dtype=np.int64)
            routed = unrouted_rows(full, r.where, P if r.prompt is not None else None)
            cached_rows += int((~routed).sum())
            if j > 0:
                # n > 1: vLLM computes a shared prompt once; the other completions reuse it.
                routed = routed.copy()
                routed[:P] = False
                forked += 1
            out.append(Routes(where=r.where, prompt_len=P, experts=np.where(full < 0, 0, full), routed=routed,
                              token_ids=token_ids))
    if cached_rows:
        notes.append(f"{cached_rows} position(s) not routed in this run (-1: served from the prefix cache) are absent "
                     "from the trace, never counted as expert -1 or as misses")
    if split_full:
        notes.append(f"{split_full} request(s) carry one routed_experts array over the whole sequence (older vLLM): "
                     "split at len(prompt_token_ids)")
    if forked:
        notes.append(f"{forked} extra completion(s) of n > 1 requests: their shared prompt is routed once, "
                     "with the first completion")
    if not out or shape is None:
        raise UserError(f"{raw[0].where if raw else 'the sources'}: hold no routed positions.")
    return out


def moe_layer_axis(routes: list[Routes], where: str, notes: list[str], engine: str = "vLLM") -> np.ndarray:
    """Indices of the layer axis that are MoE layers: every routed id 0 everywhere is refused (the
    engine bug); with top_k > 1 a layer that is 0 in every routed row is a dense layer the engine
    never captured, left out."""
    L, k = routes[0].experts.shape[1:]
    any_nonzero = np.zeros(L, bool)
    total = 0
    for r in routes:
        e = r.experts[r.routed]
        total += e.shape[0]
        if e.size:
            any_nonzero |= (e != 0).reshape(e.shape[0], L, k).any(axis=(0, 2))
    if total == 0:
        raise UserError(f"{where}: every position is marked not routed (-1: served from the prefix cache); "
                        "nothing was routed in this run.")
    if not any_nonzero.any():
        raise UserError(f"{where}: {ALL_ZERO_BUG}." if engine == "vLLM" else
                        f"{where}: every routed expert id is 0; the engine's capture buffer was never filled.")
    for r in routes:
        e = r.experts[r.routed]
        if e.size and not e.any() and L * k > 1:
            raise UserError(f"{r.where}: {ALL_ZERO_BUG if engine == 'vLLM' else 'every routed expert id is 0'} "
                            "(in this request).")
    if k == 1:
        return np.arange(L)
    keep = np.flatnonzero(any_nonzero)
    if keep.size < L:
        dense = [int(x) for x in np.flatnonzero(~any_nonzero)]
        notes.append(f"layer(s) {dense} are 0 in every routed row (a top-{k} routing cannot pick expert 0 twice): "
                     f"dense layers the engine never captured, left out")
    return keep


def check_routings(routes: list[Routes], keep: np.ndarray, n_expert: int) -> None:
    """Each routed row: ids in 0..n_expert-1, no id twice in one (position, layer)."""
    for r in routes:
        e = r.experts[r.routed][:, keep, :]
        if e.size and e.max() >= n_expert:
            raise UserError(f"{r.where}: routes expert {int(e.max())}, but the model has {n_expert} experts "
                            f"(ids 0..{n_expert - 1}).")
        if e.shape[-1] > 1 and e.size:
            s = np.sort(e, axis=-1)
            dup = (s[..., 1:] == s[..., :-1]).any(axis=-1)
            if dup.any():
                p, layer = (int(x) for x in np.argwhere(dup)[0])
                pos = int(np.flatnonzero(r.routed)[p])
                raise UserError(f"{r.where}: position {pos} selects the same expert twice at layer {int(keep[layer])}.")


def layer_numbers(L: int, keep: np.ndarray, sizes: Any, where: str, notes: list[str]) -> tuple[int, list[int]]:
    """(n_layer, the model layer of each kept axis index). The engine's layer axis is the model's
    layers; where the sizes' model has as many MoE layers as the axis (and more layers in all), the
    axis is its MoE layers in order (said in ``notes``)."""
    n_layer = getattr(sizes, "n_layer", None)
    if n_layer is None or n_layer == L:
        return (n_layer or L), [int(x) for x in keep]
    moe = sizes.model_moe_layers
    if moe is not None and len(moe) == L:
        notes.append(f"the log's layer axis has {L} entries, the model's MoE layers: axis i is MoE layer moe_layers[i]")
        return n_layer, [int(moe[i]) for i in keep]
    raise UserError(f"{where}: the routed-experts arrays have {L} layers, but the model of the sizes has {n_layer} "
                    f"layers{f' and {len(moe)} MoE layers' if moe is not None else ''}; not this model's log.")


def import_routes(routes: list[Routes], keep: np.ndarray, sources: list[Path], out_dir: Path, *, fmt: str, engine: str,
                  sizes: Any, force: bool, schedule: str, max_batch: int, prefill_chunk: int | None,
                  notes: list[str], engine_version: str | None, model_name: str | None,
                  drop_warmup: bool = False) -> Path:
    """Batch per-request routings by the named schedule and write the trace (shared by the vLLM
    and SGLang-response importers)."""
    from traces.format.schema import default_gating
    from traces.importers import provenance, write_trace
    from traces.importers._sizes import require_sizes
    from traces.synth.schedule import RequestRoutes
    from traces.synth.schedule import schedule as build_batches

    where = str(sources[0]) if len(sources) == 1 else f"{sources[0]} (and {len(sources) - 1} more)"
    sizes = require_sizes(sizes, where, fmt)
    L, k = routes[0].experts.shape[1:]
    n_layer, layer_ids = layer_numbers(L, keep, sizes, where, notes)
    n_expert = sizes.n_expert
    if n_expert is None:
        n_expert = max(int(r.experts[r.routed][:, keep].max(initial=0)) for r in routes) + 1
        notes.append(f"the log does not state the expert count: n_expert = largest expert id + 1 = {n_expert} "
                     "(add --sizes-from MODEL to take it from the model)")
    check_routings(routes, keep, n_expert)
    if sizes.top_k is not None and sizes.top_k != k:
        notes.append(f"the log routes top-{k}; the model's config says top-{sizes.top_k}")
    has_tokens = all(r.token_ids is not None for r in routes)
    if not has_tokens and any(r.token_ids is not None for r in routes):
        notes.append("some requests carry no token ids: the trace has no token column")
    reqs = [RequestRoutes(request=i, prompt_len=r.prompt_len, experts=r.experts[:, keep, :].astype(np.int32),
                          routed=r.routed, token_ids=r.token_ids.astype(np.int32) if has_tokens else None)
            for i, r in enumerate(routes)]
    cols = build_batches(reqs, mode=schedule, max_batch=max_batch, prefill_chunk=prefill_chunk, moe_layers=layer_ids)
    batching = (f"schedule {schedule}" + (f", max_batch {max_batch}" if schedule == "continuous" else "")
                + (f", prefill_chunk {prefill_chunk}" if prefill_chunk is not None else "")
                + f": {engine} records no forward-pass structure; batches built by traces.synth.schedule")
    notes.append(f"requests numbered 0..{len(routes) - 1} in file order; batches by {batching.split(':')[0]}")
    expert_bytes, dense_bytes = sizes.for_layers(n_layer, sorted(layer_ids), where)
    meta = {
        "model": {"name": sizes.name or model_name or "unknown", "arch": sizes.arch or "unknown", "n_layer": n_layer,
                  "moe_layers": sorted(layer_ids), "n_expert": n_expert, "top_k": int(k), "top_k_native": sizes.top_k,
                  "n_embd": sizes.n_embd},
        "expert_bytes": expert_bytes,
        "dense_bytes": dense_bytes,
        "gating": default_gating(),
        "provenance": provenance(fmt, sources, engine=engine, engine_version=engine_version, notes=notes,
                                 sizes=sizes.source, batching=batching, requests=len(routes)),
    }
    optional = {"request": cols["request"]}
    if "token" in cols:
        optional["token"] = cols["token"]
    return write_trace(out_dir, meta, batch=cols["batch"], phase=cols["phase"], step=cols["step"], layer=cols["layer"],
                       experts=cols["experts"], weights=cols["weights"], turn=cols["turn"], optional=optional,
                       force=force, inputs=sources, what=where, drop_warmup=drop_warmup)


SCHEDULE_HELP = ("how to batch the requests: sequential (one after another) or continuous (admitted in file order, "
                 "up to --max-batch decoding together)")


def _options():
    from traces.importers import DROP_WARMUP, ImportOption

    return (
        ImportOption("schedule", "--schedule", str, SCHEDULE_HELP, "sequential"),
        ImportOption("max_batch", "--max-batch", int, "requests decoding together (continuous schedule)", 1),
        ImportOption("prefill_chunk", "--prefill-chunk", int,
                     "prompt positions per prefill batch (continuous schedule; default: a whole prompt)", None),
        DROP_WARMUP,
    )


OPTIONS = _options()


def sniff(paths: list[Path]) -> bool:
    from traces.importers import head_bytes

    for p in paths:
        suf = p.suffix.lower()
        if suf == ".npy":
            if not (p.name.endswith("routed_experts.npy") and head_bytes(p, 6) == NPY_MAGIC):
                return False
        elif suf == ".npz":
            try:
                with zipfile.ZipFile(p) as z:
                    names = set(z.namelist())
            except (OSError, zipfile.BadZipFile):
                return False
            if not names & {"prompt_routed_experts.npy", "routed_experts.npy"}:
                return False
        elif suf in (".json", ".jsonl"):
            head = head_bytes(p, 1 << 16)
            if b'"meta_info"' in head or not (b'"prompt_routed_experts"' in head or b'"routed_experts"' in head):
                return False
        else:
            return False
    return bool(paths)


def import_(sources: list[Path], out_dir: Path, *, sizes: Any, force: bool = False, schedule: str = "sequential",
            max_batch: int = 1, prefill_chunk: int | None = None, drop_warmup: bool = False) -> Path:
    """Import vLLM routed experts (module docstring: the files) into a trace at ``out_dir``."""
    from traces.importers import check_source

    sources = [check_source(Path(s)) for s in sources]
    where = str(sources[0]) if len(sources) == 1 else f"{sources[0]} (and {len(sources) - 1} more)"
    raw, info = read_sources(sources)
    notes: list[str] = []
    if info["fields"]:
        from traces.importers import field_notes

        notes += field_notes(JSON_READ, info["fields"], "response fields")
    routes = shape_requests(raw, notes)
    keep = moe_layer_axis(routes, where, notes)
    models = info["models"]
    return import_routes(routes, keep, sources, Path(out_dir), fmt=NAME, engine=ENGINE, sizes=sizes, force=force,
                         schedule=schedule, max_batch=max_batch, prefill_chunk=prefill_chunk, notes=notes,
                         engine_version=info["engine_version"], model_name=models[0] if len(models) == 1 else None,
                         drop_warmup=drop_warmup)
