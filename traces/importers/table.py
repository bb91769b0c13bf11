"""Importer for any table of routings: CSV, JSONL or Parquet, one routing (token, layer) per row.

``--map key=column,...`` names the columns; a key not mapped reads the column of its own name
when the file has one. Keys:

- ``experts`` (required): the selected expert ids in router rank order -- a list (JSONL,
  Parquet) or a string (CSV): ``[3, 7]``, ``3 7``, ``3;7`` or ``3|7``;
- ``weights``: the applied routing weights, same shape (absent: NaN, the engine exposed none);
- ``layer``: the MoE layer index. Absent, each file is one layer, named by the last number in its
  file name (``router_layer_07.jsonl`` -> 7), said in the notes;
- ``token``: the token's position in its request. Absent, file order is token order: the n-th
  row of a (request, layer) is its n-th token, said in the notes;
- ``request``: the request id (integers, or strings numbered in order of first appearance);
- ``batch``: the engine's forward pass. Absent, batches are built one request after another: a
  request's prompt is one batch, then one batch per decoded token (said in the notes);
- ``phase``: ``prefill``/``decode`` or 0/1. Absent, every routing counts as decode (said);
- ``token_id``: the token id at that position (the trace's ``token`` column).

``--where key=value[,key=value]`` keeps only the records whose fields equal the values (a log
that mixes record types, e.g. a meta header line); the skipped records' count and keys go into
provenance, and an ``engine_version`` or ``version`` field of a skipped record becomes the
engine version. Logs that hold some layers only make a trace of those layers: with sizes from the
model, the model's other MoE layers are listed as absent (``model.moe_layers_absent``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from traces.format.errors import UserError
from traces.importers import (
    ImportOption,
    check_source,
    head_lines,
    infer_shape,
    meta_from_sizes,
    provenance,
    repeated_expert_rows,
    slots_by_weight,
    write_trace,
)
from traces.importers._sizes import require_sizes
from traces.util.bounded_json import BoundsError, parse_bounded
from traces.util.units import PHASE_DECODE, PHASE_PREFILL

NAME = "table"
SUMMARY = "any CSV / JSONL / Parquet table, one routing per row, columns named with --map"
ENGINE = "unknown"
TAKES_SIZES = True
MAX_SOURCES = None
OPTIONS = (
    ImportOption("map", "--map", str, "Column mapping, e.g. token=token_idx,layer=layer,experts=topk_ids,"
                 "weights=topk_weights,request=req_id (keys: experts, weights, layer, token, request, batch, phase, "
                 "token_id)."),
    ImportOption("where", "--where", str, "Keep only records whose fields equal these values, e.g. type=route."),
    ImportOption("engine", "--engine", str, "The engine that wrote the log (provenance)."),
    ImportOption("drop_warmup", "--drop-warmup", bool, "Leave out rows that look like an engine's warm-up (profiling "
                 "or dummy) pass: runs of tokens routed alike at every layer or with exactly uniform weights "
                 "(default: keep them and say so).", False),
)

KEYS = ("experts", "weights", "layer", "token", "request", "batch", "phase", "token_id")
# The names engines and analysis scripts commonly give each key's column, in order of preference.
# A key that --map does not name reads the column of its own name, else the first of these the
# table has (said in the notes: which column, and that the name chose it). Names that another
# format's sniffer claims (Megatron's top_indices, vLLM's routed_experts) are left out.
SYNONYMS: dict[str, tuple[str, ...]] = {
    "experts": ("expert_ids", "topk_ids", "topk_idx", "topk_indices", "topk_experts", "selected_experts",
                "expert_indices", "ids"),
    "weights": ("topk_weights", "routing_weights", "expert_weights", "gating_probs", "gate_probs", "gating",
                "topk_probs", "router_probs", "probs", "topk_scores", "scores"),
    "layer": ("layer_id", "layer_idx", "layer_index", "moe_layer"),
    "token": ("token_idx", "token_index", "token_pos", "position", "pos", "position_id", "step"),
    "request": ("request_id", "req_id", "req", "prompt_id", "problem_id", "sample_id", "seq_id", "sequence_id",
                "prompt", "problem"),
    "batch": ("batch_id", "batch_idx", "forward_pass_id", "forward_pass"),
    "phase": ("stage_name",),
    "token_id": ("input_id", "tok_id", "vocab_id"),
}
TRACE_COLUMN = {"experts": "experts", "weights": "weights", "layer": "layer", "token": "step", "request": "request",
                "batch": "batch", "phase": "phase", "token_id": "token"}
SUFFIXES = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
_SPLIT = re.compile(r"[\s,;|]+")


def _kind(path: Path) -> str | None:
    return SUFFIXES.get(path.suffix.lower())


def _columns_of(path: Path) -> set[str] | None:
    """The column names a sniffer sees (first CSV line, first JSONL object, Parquet schema)."""
    kind = _kind(path)
    if kind == "csv":
        lines = head_lines(path, 4096)
        return set(next(iter(_csv_rows(lines[:1])), [])) if lines else None
    if kind == "jsonl":
        for ln in head_lines(path, 8192):
            try:
                obj = parse_bounded(ln)
            except (ValueError, BoundsError):
                return None
            if isinstance(obj, dict) and _names(obj, "experts"):
                return set(obj)
        return None
    if kind == "parquet":
        try:
            import pyarrow.parquet as pq

            return set(pq.read_schema(path).names)
        except Exception:  # noqa: BLE001 - not a Parquet file
            return None
    return None


def sniff(paths: list[Path]) -> bool:
    """Recognised without a --map only: every file has an ``experts`` column (and a layer column, or
    a number in its name)."""
    for p in paths:
        cols = _columns_of(p)
        if not cols or not _names(cols, "experts"):
            return False
        if not _names(cols, "layer") and not re.search(r"\d+", p.stem):
            return False
    return bool(paths)


def _names(cols: Any, key: str) -> list[str]:
    """The columns among ``cols`` that could be ``key``'s: its own name, then its common names."""
    return [c for c in (key, *SYNONYMS.get(key, ())) if c in cols]


def resolve_columns(mapping: dict[str, str], cols: Any, skip: Any = ()) -> tuple[dict[str, str], list[str]]:
    """Which source column each key reads: the --map column, else the key's own name, else the first
    of its common names the table has (a column is read by one key only; ``skip``: columns taken by
    --where). Returns (key -> column, the keys whose column a common name chose)."""
    taken = set(mapping.values()) | set(skip)
    out: dict[str, str] = {}
    auto: list[str] = []
    for k in KEYS:
        if k in mapping:
            out[k] = mapping[k]
            continue
        for i, c in enumerate(_names(cols, k)):
            if c not in taken:
                out[k] = c
                taken.add(c)
                if i > 0 or c != k:
                    auto.append(k)
                break
    return out, auto


def _csv_rows(lines: list[str]) -> list[list[str]]:
    import csv

    return list(csv.reader(lines))


def parse_map(spec: str | None) -> dict[str, str]:
    out: dict[str, str] = {}
    if spec is None:
        return out
    for part in spec.split(","):
        if not part.strip():
            continue
        key, sep, col = part.partition("=")
        key, col = key.strip(), col.strip()
        if not sep or not col:
            raise UserError(f"--map {spec!r}: {part!r} is not key=column.")
        if key not in KEYS:
            raise UserError(f"--map: unknown key {key!r}; keys are {', '.join(KEYS)}.")
        if key in out:
            raise UserError(f"--map: {key} is mapped twice.")
        out[key] = col
    return out


def parse_where(spec: str | None) -> dict[str, str]:
    out: dict[str, str] = {}
    if spec is None:
        return out
    for part in spec.split(","):
        key, sep, val = part.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--where {spec!r}: {part!r} is not key=value.")
        out[key.strip()] = val.strip()
    return out


def _records(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line or row number, record) of every record of the file, in file order."""
    check_source(path)
    kind = _kind(path)
    if kind is None:
        raise UserError(f"{path}: unknown table type (expected .csv, .jsonl, .ndjson or .parquet).")
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError, ValueError) as e:
            raise UserError(f"{path}: is not a readable Parquet file ({str(e)[:120]}).") from None
        return [(i + 1, r) for i, r in enumerate(rows)]
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise UserError(f"{path}: is not a text file (not UTF-8).") from None
    if text and not text.endswith("\n"):
        raise UserError(f"{path}: the last line has no line end; the file is truncated.")
    lines = text.splitlines()
    if kind == "jsonl":
        out = []
        for i, ln in enumerate(lines):
            if not ln.strip():
                continue
            try:
                obj = parse_bounded(ln)
            except ValueError:
                raise UserError(f"{path}: line {i + 1}: is not a JSON object (a truncated or corrupt line).") from None
            except BoundsError as e:
                raise UserError(f"{path}: line {i + 1}: {e}.") from None
            if not isinstance(obj, dict):
                raise UserError(f"{path}: line {i + 1}: is JSON but not an object.")
            out.append((i + 1, obj))
        return out
    rows = _csv_rows(lines)
    if not rows:
        raise UserError(f"{path}: is empty.")
    header = rows[0]
    out = []
    for i, r in enumerate(rows[1:], start=2):
        if not r:
            continue
        if len(r) != len(header):
            raise UserError(f"{path}: line {i}: has {len(r)} fields, the header {len(header)}.")
        out.append((i, dict(zip(header, r))))
    return out


_INT64 = 1 << 63


def _int(v: Any, path: Path, where: int, what: str) -> int:
    """An integer field, within int64 (the columns are gathered as int64 arrays, then checked
    against their own narrower ranges): beyond it, one sentence here, not an OverflowError there."""
    if isinstance(v, bool):
        raise UserError(f"{path}: row {where}: {what} {v!r} is not an integer.")
    if isinstance(v, int):
        out = v
    elif isinstance(v, float) and v.is_integer():
        out = int(v)
    else:
        try:
            out = int(str(v).strip())
        except ValueError:
            raise UserError(f"{path}: row {where}: {what} {v!r} is not an integer.") from None
    if not -_INT64 <= out < _INT64:
        raise UserError(f"{path}: row {where}: {what} {str(v)[:40]} is beyond any count or id (at most 2^63-1).")
    return out


def _list(v: Any, path: Path, where: int, what: str, cast: type) -> list:
    if isinstance(v, str):
        s = v.strip()
        if s.startswith("["):
            try:
                v = parse_bounded(s)
            except ValueError:
                raise UserError(f"{path}: row {where}: {what} {v!r} is not a list.") from None
            except BoundsError as e:
                raise UserError(f"{path}: row {where}: {what}: {e}.") from None
        else:
            v = [x for x in _SPLIT.split(s) if x]
    if not isinstance(v, (list, tuple)):
        raise UserError(f"{path}: row {where}: {what} {v!r} is not a list.")
    if cast is float and any(isinstance(x, bool) for x in v):
        raise UserError(f"{path}: row {where}: {what} {v!r} holds true/false, not numbers.")
    try:
        return [cast(x) if cast is float else _int(x, path, where, what) for x in v]
    except (TypeError, ValueError):
        raise UserError(f"{path}: row {where}: {what} {v!r} is not a list of numbers.") from None


def _phase(v: Any, path: Path, where: int) -> int:
    s = str(v).strip().lower()
    if s in ("0", "prefill", "prompt"):
        return PHASE_PREFILL
    if s in ("1", "decode", "generate"):
        return PHASE_DECODE
    raise UserError(f"{path}: row {where}: phase {v!r} is not prefill/decode (or 0/1).")


def import_(sources: list[Path], out_dir: Path, *, sizes: Any = None, force: bool = False, map: str | None = None,  # noqa: A002
            where: str | None = None, engine: str | None = None, drop_warmup: bool = False) -> Path:
    srcs = [check_source(Path(s)) for s in sources]
    sizes = require_sizes(sizes, srcs[0], NAME)
    mapping = parse_map(map)
    cond = parse_where(where)
    notes: list[str] = []
    skipped, skipped_keys, version = 0, set(), None
    req_ids: dict[Any, int] = {}
    int_ids: bool | None = None
    cols: dict[str, list] = {k: [] for k in ("experts", "weights", "layer", "token", "request", "batch", "phase",
                                             "token_id", "file", "row")}
    have: dict[str, bool] = {}
    col: dict[str, str] | None = None  # key -> source column, resolved on the first record kept
    auto: list[str] = []
    seen_cols: dict[str, None] = {}  # every column of every record kept, in order of first appearance
    for fi, path in enumerate(srcs):
        recs = _records(path)
        layer_from_name = None
        for rowno, rec in recs:
            if cond and any(str(rec.get(k)) != v for k, v in cond.items()):
                skipped += 1
                skipped_keys.update(rec)
                for vk in ("engine_version", "version"):
                    if version is None and isinstance(rec.get(vk), (str, int, float)):
                        version = str(rec[vk])
                continue
            if col is None:
                col, auto = resolve_columns(mapping, rec, cond)
                for k in KEYS:
                    col.setdefault(k, k)
            seen_cols.update(dict.fromkeys(str(c) for c in rec))
            present = {k: col[k] in rec for k in KEYS}
            hint = "; add --where to keep only the routing records" if not cond else ""
            for k in KEYS:
                if k in mapping and not present[k]:
                    raise UserError(f"{path}: row {rowno}: has no column {col[k]!r} (--map {k}={col[k]}); its columns: "
                                    f"{', '.join(sorted(str(c) for c in rec))}{hint}.")
            if not present["experts"]:
                raise UserError(f"{path}: row {rowno}: has no experts column {col['experts']!r}; name it with "
                                f"--map experts=COLUMN{hint}.")
            for k in ("weights", "layer", "token", "request", "batch", "phase", "token_id"):
                if have.setdefault(k, present[k]) != present[k]:
                    raise UserError(f"{path}: row {rowno}: {'has' if present[k] else 'lacks'} the {k} column "
                                    f"{col[k]!r} that earlier rows {'lack' if present[k] else 'have'}.")
            ex = _list(rec[col["experts"]], path, rowno, "experts", int)
            cols["experts"].append(ex)
            if present["weights"]:
                w = _list(rec[col["weights"]], path, rowno, "weights", float)
                if len(w) != len(ex):
                    raise UserError(f"{path}: row {rowno}: {len(w)} weights for {len(ex)} experts.")
                cols["weights"].append(w)
            if present["layer"]:
                cols["layer"].append(_int(rec[col["layer"]], path, rowno, "layer"))
            else:
                if layer_from_name is None:
                    nums = re.findall(r"\d+", path.stem)
                    if not nums:
                        raise UserError(f"{path}: has no layer column {col['layer']!r} and no number in its file name; "
                                        "name the column with --map layer=COLUMN.")
                    layer_from_name = _int(nums[-1], path, 0, "layer (from the file name)")
                cols["layer"].append(layer_from_name)
            for k in ("token", "batch", "token_id"):
                if present[k]:
                    cols[k].append(_int(rec[col[k]], path, rowno, k))
            if present["request"]:
                rv = rec[col["request"]]
                if isinstance(rv, str) and not _is_int_str(rv):
                    cols["request"].append(req_ids.setdefault(rv, len(req_ids)))  # string ids: numbered in order
                else:
                    cols["request"].append(_int(rv, path, rowno, "request"))
                    int_ids = True
                if int_ids and req_ids:
                    raise UserError(f"{path}: row {rowno}: request ids mix integers and names; use one kind.")
            if present["phase"]:
                cols["phase"].append(_phase(rec[col["phase"]], path, rowno))
            cols["file"].append(fi)
            cols["row"].append(rowno)
        if not have.get("layer", True):
            notes.append(f"{path.name}: no layer column: its rows are layer {layer_from_name} (the last number in the file name)")
    n = len(cols["experts"])
    what = srcs[0] if len(srcs) == 1 else f"{srcs[0]} (and {len(srcs) - 1} more)"
    if n == 0:
        raise UserError(f"{what}: holds no routing records" + (f" matching --where {where}" if cond else "") + ".")
    ks = {len(e) for e in cols["experts"]}
    if len(ks) != 1 or 0 in ks:
        i = next(i for i, e in enumerate(cols["experts"]) if len(e) != len(cols["experts"][0]) or not e)
        raise UserError(f"{srcs[cols['file'][i]]}: row {cols['row'][i]}: routes {len(cols['experts'][i])} experts, "
                        f"the first routing {len(cols['experts'][0])} (one top-k per log).")
    k = ks.pop()
    experts = np.array(cols["experts"], dtype=np.int64)
    layer = np.array(cols["layer"], dtype=np.int64)
    fileno, rowno = np.array(cols["file"]), np.array(cols["row"])

    def refuse_at(i: int, what_: str) -> None:
        raise UserError(f"{srcs[fileno[i]]}: row {rowno[i]}: {what_}.")

    if (layer < 0).any():
        refuse_at(int(np.argmax(layer < 0)), f"layer {int(layer[np.argmax(layer < 0)])} is negative")
    if (experts < 0).any():
        i = int(np.flatnonzero((experts < 0).any(axis=1))[0])
        refuse_at(i, f"expert id {int(experts[i].min())} is negative")
    twice = repeated_expert_rows(experts)
    if twice.size:
        refuse_at(int(twice[0]), "selects the same expert twice")
    request = np.array(cols["request"], dtype=np.int64) if have.get("request") else np.zeros(n, dtype=np.int64)
    if have.get("request") and req_ids:
        notes.append(f"request ids are strings: numbered 0..{len(req_ids) - 1} in order of first appearance")
    if have.get("token"):
        step = np.array(cols["token"], dtype=np.int64)
    else:
        # File order is token order: the n-th row of a (request, layer) is its n-th token.
        key = request * (1 << 16) + layer
        order = np.argsort(key, kind="stable")
        ks_sorted = key[order]
        starts = np.flatnonzero(np.concatenate([[True], ks_sorted[1:] != ks_sorted[:-1]]))
        rank = np.arange(n) - np.repeat(starts, np.diff(np.append(starts, n)))
        step = np.empty(n, dtype=np.int64)
        step[order] = rank
        notes.append("no token column: file order is token order (the n-th row of a layer"
                     + (" and request" if have.get("request") else "") + " is its n-th token, positions from 0)")
    if (step < 0).any() or (step > np.iinfo(np.int32).max).any():
        refuse_at(int(np.flatnonzero((step < 0) | (step > np.iinfo(np.int32).max))[0]), "token position is negative or beyond int32")
    dup = _first_duplicate(np.stack([request, step, layer], axis=1))
    if dup is not None:
        refuse_at(dup, f"routes token {step[dup]} of layer {layer[dup]} a second time")
    if have.get("phase"):
        phase = np.array(cols["phase"], dtype=np.int64)
    else:
        phase = np.full(n, PHASE_DECODE, dtype=np.int64)
        notes.append("no phase column: every routing counts as decode")
    if have.get("batch"):
        batch = np.array(cols["batch"], dtype=np.int64)
        if (batch < 0).any():
            refuse_at(int(np.argmax(batch < 0)), "batch is negative")
        _, batch = np.unique(batch, return_inverse=True)
    else:
        batch = _sequential_batches(request, phase, step)
        notes.append("no batch column: requests one after another, a request's prompt one batch, each decoded "
                     "token its own batch")
    if have.get("weights"):
        weights = np.array(cols["weights"], dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(weights).all(axis=1) | (weights < 0).any(axis=1))
        if bad.size:
            refuse_at(int(bad[0]), "has a weight that is negative, NaN or infinite")
        experts, weights, moved = slots_by_weight(experts, weights)
        if moved:
            notes.append(f"{moved} routing(s) listed their experts in another order than descending weight; their "
                         "slots are put in descending-weight order (the selected sets are unchanged)")
    else:
        weights = np.full((n, k), np.nan)
    n_layer, n_expert = infer_shape(what, layer, experts, sizes, notes=notes)
    if k > n_expert:
        raise UserError(f"{what}: routes {k} experts per row but the model has {n_expert}.")
    optional: dict[str, np.ndarray] = {}
    if have.get("request"):
        optional["request"] = request
    if have.get("token_id"):
        tid = np.array(cols["token_id"], dtype=np.int64)
        if (tid < 0).any():
            refuse_at(int(np.argmax(tid < 0)), "token_id is negative")
        optional["token"] = tid
    assert col is not None
    used = {kk: col[kk] for kk in KEYS if have.get(kk, kk == "experts")}
    unused = [c for c in seen_cols if c not in set(used.values()) and c not in cond]
    said = ", ".join(f"{c} -> {TRACE_COLUMN[kk]}" + (" (matched by name)" if kk in auto else "") for kk, c in used.items())
    notes.insert(0, f"source columns read: {said}" + ("; chosen by name where --map did not say (--map KEY=COLUMN "
                                                      "to choose another)" if any(kk in auto for kk in used) else ""))
    notes.insert(1, f"source columns not used: {', '.join(unused)}" if unused else "every source column was used")
    extra: dict[str, Any] = {"mapping": used, "mapped_by_name": [kk for kk in used if kk in auto],
                             "unused_columns": unused}
    if cond:
        extra["where"] = cond
        extra["skipped_records"] = {"count": skipped, "keys": sorted(skipped_keys)}
    prov = provenance(NAME, srcs, engine=engine or ENGINE, engine_version=version, notes=notes, **extra)
    meta = meta_from_sizes(what=what, stem=srcs[0].stem, sizes=sizes, n_layer=n_layer, n_expert=n_expert, layer=layer,
                           top_k=k, prov=prov)
    return write_trace(out_dir, meta, batch=batch, phase=phase, step=step, layer=layer, experts=experts,
                       weights=weights.astype(np.float32), optional=optional, force=force, inputs=srcs, what=what,
                       drop_warmup=drop_warmup,
                       row_name=lambda i: f"{srcs[fileno[i]].name}:{rowno[i]}" if len(srcs) > 1 else str(rowno[i]))


def _is_int_str(s: str) -> bool:
    return bool(re.fullmatch(r"-?\d+", s.strip()))


def _first_duplicate(keys: np.ndarray) -> int | None:
    order = np.lexsort(keys.T[::-1])
    srt = keys[order]
    same = np.flatnonzero((srt[1:] == srt[:-1]).all(axis=1))
    return int(order[same[0] + 1]) if same.size else None


def _sequential_batches(request: np.ndarray, phase: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Batches one request after another (in order of first appearance): its prompt rows one batch,
    each decoded position its own batch."""
    _, first = np.unique(request, return_index=True)
    rank_of = {int(r): i for i, r in enumerate(request[np.sort(first)])}
    rorder = np.array([rank_of[int(r)] for r in request], dtype=np.int64)
    bstep = np.where(phase == PHASE_PREFILL, -1, step)
    key = np.stack([rorder, phase, bstep], axis=1)
    _, inv = np.unique(key, axis=0, return_inverse=True)
    return inv.reshape(-1).astype(np.int64)

