"""Importer for any table of routings: CSV, JSONL or Parquet, one routing (token, layer) per row.

``--map key=column,...`` names the columns; a key not mapped reads the column of its own name
when the file has one. Keys:

- ``experts`` (required): the selected expert ids in router rank order -- a list (JSONL,
  Parquet) or a string (CSV): ``[3, 7]``, ``3 7``, ``3;7`` or ``3|7``; or ``expert_*``, one
  column per expert (or per slot, with ``weights=weight_*``). With no experts column and no
  --map, one family of numbered expert columns is read so (said: an inference);
- ``weights``: the applied routing weights, same shape (absent: NaN, the engine exposed none);
- ``layer``: the MoE layer index. Absent, each file is one layer: the first group of
  ``--layer-from-path REGEX`` in its path, else the number after "layer" in its file name
  (``router_layer_07.jsonl`` -> 7; any other number is refused, not guessed), said in the notes;
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
from itertools import chain
from operator import methodcaller
from pathlib import Path
from typing import Any

import numpy as np

from traces.format.errors import UserError
from traces.importers import (
    DROP_WARMUP,
    ImportOption,
    check_source,
    head_bytes,
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
from traces.util.rows import unique_rows
from traces.util.units import PHASE_DECODE, PHASE_PREFILL

NAME = "table"
SUMMARY = "any CSV / JSONL / Parquet table, one routing per row, columns named with --map"
ENGINE = "unknown"
TAKES_SIZES = True
MAX_SOURCES = None
GENERIC = True  # any table: where a dedicated importer recognises the files too, import auto takes that one
OPTIONS = (
    ImportOption("map", "--map", str, "Column mapping, e.g. token=token_idx,layer=layer,experts=topk_ids,"
                 "weights=topk_weights,request=req_id (keys: experts, weights, layer, token, request, batch, phase, "
                 "token_id)."),
    ImportOption("where", "--where", str, "Keep only records whose fields equal these values, e.g. type=route."),
    ImportOption("engine", "--engine", str, "The engine that wrote the log (provenance)."),
    DROP_WARMUP,
    ImportOption("phase", "--phase", str, "Every routing's phase, for a log with no phase column: prefill (e.g. "
                 "prompt-only forward passes) or decode."),
    ImportOption("prompt_tokens", "--prompt-tokens", str, "Where each request's prompt ends: a count N (its positions "
                 "0..N-1 are prefill) or the column that holds each request's prompt length."),
    ImportOption("request_per_file", "--request-per-file", bool, "Each source file is one request (e.g. one file "
                 "per prompt).", False),
    ImportOption("batch_per_file", "--batch-per-file", bool, "Each source file is one forward pass (batch).", False),
    ImportOption("layer_from_path", "--layer-from-path", str, "A regular expression whose first group, found in "
                 "each file's path, is the layer of all its rows, e.g. 'layer_(\\d+)' (for one file per layer)."),
    ImportOption("request_from_path", "--request-from-path", str, "A regular expression whose first group, found in "
                 "each file's path, is the request of all its rows, e.g. 'prompt_(\\d+)'."),
    ImportOption("top_k", "--top-k", int, "For one score column per expert (--map experts=expert_*): take each row's "
                 "K largest columns as its routing (default: its non-zero columns, the same count in every row)."),
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
SUFFIXES = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet",
            ".npy": "array", ".npz": "array"}
_SPLIT = re.compile(r"[\s,;|]+")


def _kind(path: Path) -> str | None:
    return SUFFIXES.get(path.suffix.lower())


def columns_of(path: Path) -> set[str] | None:
    """The column names a sniffer sees (first CSV line, the first JSONL object that carries experts,
    after any leading metadata lines; Parquet schema; an .npz archive's array names)."""
    kind = _kind(path)
    if kind == "csv":
        lines = head_lines(path, 1 << 16)
        return set(next(iter(_csv_rows(lines[:1])), [])) if lines else None
    if kind == "jsonl":
        for ln in head_lines(path, 1 << 16):
            try:
                obj = parse_bounded(ln)
            except (ValueError, BoundsError):
                return None
            if isinstance(obj, dict) and (_names(obj, "experts") or wide_patterns(obj) is not None):
                return set(obj)
        return None
    if kind == "parquet":
        try:
            import pyarrow.parquet as pq

            return set(pq.read_schema(path).names)
        except Exception:  # noqa: BLE001 - not a Parquet file
            return None
    if kind == "array" and path.suffix.lower() == ".npz":
        import zipfile

        try:
            with zipfile.ZipFile(path) as z:
                return {n[:-4] for n in z.namelist() if n.endswith(".npy")}
        except (OSError, zipfile.BadZipFile):
            return None
    return None


# A wide table's column families: a prefix naming experts, then the number (expert_0 .. expert_63).
_WIDE_EXPERTS = re.compile(r"^(.*expert\w*?_?)(\d+)$", flags=re.I)
_WIDE_WEIGHTS = re.compile(r"^(.*(?:weight|prob|score|gate|gating)\w*?_?)(\d+)$", flags=re.I)


def wide_patterns(cols: Any) -> tuple[str, str | None] | None:
    """A wide table's ``--map experts=PATTERN`` (and ``weights=PATTERN`` when a weight family has the
    same numbers: one column per slot) found by the columns' names, or None when the columns hold no
    family of numbered expert columns or more than one (then --map must say which)."""
    fams: dict[str, set[int]] = {}
    for c in cols:
        if isinstance(c, str) and (m := _WIDE_EXPERTS.match(c)):
            fams.setdefault(m.group(1), set()).add(int(m.group(2)))
    if len(fams) != 1:
        return None
    (pre, nums), = fams.items()
    wfams: dict[str, set[int]] = {}
    for c in cols:
        if isinstance(c, str) and not _WIDE_EXPERTS.match(c) and (m := _WIDE_WEIGHTS.match(c)):
            wfams.setdefault(m.group(1), set()).add(int(m.group(2)))
    same = [w for w, wn in wfams.items() if wn == nums]
    return f"{pre}*", (f"{same[0]}*" if len(same) == 1 else None)


def _layer_in_name(path: Path) -> bool:
    return len(re.findall(r"layer[_\-.]?(\d+)", path.stem, flags=re.I)) == 1


def _npy_header(path: Path) -> tuple[tuple[int, ...], np.dtype] | None:
    """Shape and dtype from a .npy file's header (a few hundred bytes read), None if it has none."""
    try:
        with open(path, "rb") as fh:
            major, _ = np.lib.format.read_magic(fh)
            read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(fh)
            return shape, dtype
    except Exception:  # noqa: BLE001 - not an array file
        return None


def recognise(path: Path) -> tuple[bool, str | None]:
    """Whether ``import table`` reads ``path`` with no option (``import auto``'s question), and when
    it would read it but one thing is missing, what: a clause naming the option that settles it."""
    kind = _kind(path)
    if kind == "array" and path.suffix.lower() == ".npy":
        head = _npy_header(path)
        if head is None or head[1].kind not in "iu" or len(head[0]) not in (2, 3):
            return False, None
        if len(head[0]) == 2 and not _layer_in_name(path):
            return False, (f"{path.name} holds ids [{head[0][0]}x{head[0][1]}] of one layer but no number after "
                           "'layer' in its name says which; --layer-from-path REGEX says where its path holds it")
        return True, None
    cols = columns_of(path)
    if not cols:
        return False, None
    if not _names(cols, "experts"):
        if wide_patterns(cols) is None:
            fams = sorted({m.group(1) for c in cols if isinstance(c, str) and (m := _WIDE_EXPERTS.match(c))})
            if len(fams) > 1:
                return False, (f"{path.name} has several families of numbered expert columns ({', '.join(f + '*' for f in fams)}); "
                               f"--map experts={fams[0]}* names the one that holds the routing")
            return False, None
    if kind == "array":  # an .npz: ids [tokens, layers, k], or [tokens, k] of the layer its name says
        import zipfile

        try:
            with zipfile.ZipFile(path) as z, z.open(_names(cols, "experts")[0] + ".npy") as fh:
                major, _ = np.lib.format.read_magic(fh)
                read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                shape, _, dtype = read(fh)
        except Exception:  # noqa: BLE001 - not an archive of arrays
            return False, None
        if dtype.kind not in "iu" or len(shape) not in (2, 3):
            return False, None
        if len(shape) == 2 and not _layer_in_name(path):
            return False, (f"{path.name} holds ids of one layer but no number after 'layer' in its name says which; "
                           "--layer-from-path REGEX says where its path holds it")
        return True, None
    if not _names(cols, "layer") and not _layer_in_name(path):
        return False, (f"{path.name} has no layer column and no number after 'layer' in its file name; "
                       "--layer-from-path REGEX (or --map layer=COLUMN) says where the layer is")
    return True, None


def sniff(paths: list[Path]) -> bool:
    """Recognised without an option only: every file has an experts column (by name: ``experts``,
    a common name, or one family of numbered columns ``expert_0..``), and a layer column or the number
    after "layer" in its name (an array file: ids of integers, [tokens, layers, k], or [tokens, k] of
    the layer its name says)."""
    return bool(paths) and all(recognise(Path(p))[0] for p in paths)


def auto_refusal(paths: list[Path]) -> str | None:
    """Why ``import auto`` does not take these files as tables though they look like ones: the first
    file's missing piece and the option of ``import table`` that settles it (None: not a table)."""
    for p in paths:
        ok, why = recognise(Path(p))
        if not ok:
            return why
    return None


def _names(cols: Any, key: str) -> list[str]:
    """The columns among ``cols`` that could be ``key``'s: its own name, then its common names."""
    return [c for c in (key, *SYNONYMS.get(key, ())) if c in cols]


def resolve_columns(mapping: dict[str, str], cols: Any, skip: Any = (), off: Any = ()) -> tuple[dict[str, str], list[str]]:
    """Which source column each key reads: the --map column, else the key's own name, else the first
    of its common names the table has (a column is read by one key only; ``skip``: columns taken by
    --where; ``off``: keys an option says instead, read from no column). Returns (key -> column, the
    keys whose column a common name chose)."""
    taken = set(mapping.values()) | set(skip)
    out: dict[str, str] = {}
    auto: list[str] = []
    for k in KEYS:
        if k in off:
            continue
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


def _read_table(path: Path) -> _Table:
    """Every record of a CSV / JSONL / Parquet file, as columns, in file order (each with its line
    or row number)."""
    check_source(path)
    kind = _kind(path)
    if kind is None:
        raise UserError(f"{path}: unknown table type (expected .csv, .jsonl, .ndjson, .parquet, .npy or .npz); another "
                        "engine's log: 'moe-replay import --list' names the formats, 'import auto' recognises them.")
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise UserError(f"{path}: is not a readable Parquet file ({str(e)[:120]}); 'import table' reads it as "
                            "Parquet by its suffix ('import --list' names the other formats).") from None
        names = table.column_names
        cols = {c: table.column(j) for j, c in enumerate(names)}  # a repeated name: the last column, as a record reads
        return _Table(np.arange(1, table.num_rows + 1, dtype=np.int64), list(dict.fromkeys(names)), cols)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise UserError(f"{path}: is not a text file (not UTF-8); 'import table' reads it as {kind.upper()} by its "
                        "suffix (.npy / .npz / .parquet for binary tables; 'import --list' for other engines' logs).") from None
    if text and not text.endswith("\n"):
        raise UserError(f"{path}: the last line has no line end; the file is truncated.")
    lines = text.splitlines()
    if kind == "jsonl":
        out, rowno = [], []
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
                raise UserError(f"{path}: line {i + 1}: is JSON but not an object (one routing record per line; a "
                                "server's responses are read by 'import vllm' or 'import sglang').")
            out.append(obj)
            rowno.append(i + 1)
        return _Table(np.array(rowno, dtype=np.int64), [], {}, out)
    if lines and lines[0] and not _CSV_SPECIAL.search(text) and text.count("\r") == text.count("\r\n"):
        return _plain_csv(path, lines)
    rows = _csv_rows(lines)
    if not rows:
        raise UserError(f"{path}: is empty.")
    header, body = rows[0], rows[1:]
    lens = np.fromiter(map(len, body), np.int64, len(body))
    wrong = np.flatnonzero((lens != 0) & (lens != len(header)))
    if wrong.size:
        i = int(wrong[0])
        raise UserError(f"{path}: line {i + 2}: has {lens[i]} fields, the header {len(header)}.")
    kept = np.flatnonzero(lens)  # blank lines hold no record
    if kept.size != len(body):
        body = [body[i] for i in kept.tolist()]
    columns = list(zip(*body)) if body else [()] * len(header)
    cols = {c: columns[j] for j, c in enumerate(header)}  # a repeated name: the last column, as a record reads
    return _Table(kept + 2, list(dict.fromkeys(header)), cols)


# What makes the csv module read a line as more than its text split at commas: a quote, a NUL, and
# the line ends that str.splitlines() knows besides "\n" and "\r\n" (a "\r" alone is checked apart);
# text with none of them is "plain".
_CSV_SPECIAL = re.compile('["\x00\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]')


def _plain_csv(path: Path, lines: list[str]) -> _Table:
    """A CSV file with no quote (and only "\n" or "\r\n" line ends) as the csv module reads it -- each line its
    text split at the commas, an empty line no record -- by whole columns: every field split at
    once, each column every H-th field."""
    header = lines[0].split(",")
    h = len(header)
    body = lines[1:]
    full = np.fromiter(map(bool, body), bool, len(body))
    kept = np.flatnonzero(full)  # blank lines hold no record
    if kept.size != len(body):
        body = list(filter(None, body))
    lens = np.fromiter(map(methodcaller("count", ","), body), np.int64, len(body)) + 1
    wrong = np.flatnonzero(lens != h)
    if wrong.size:
        i = int(wrong[0])
        raise UserError(f"{path}: line {kept[i] + 2}: has {lens[i]} fields, the header {h}.")
    fields = ",".join(body).split(",") if body else []
    cols = {c: tuple(fields[j::h]) for j, c in enumerate(header)}  # a repeated name: the last column, as a record reads
    return _Table(kept + 2, list(dict.fromkeys(header)), cols)


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


def _is_int_str(s: str) -> bool:
    return bool(re.fullmatch(r"-?\d+", s.strip()))


# -- a file's records as columns: the one core of every shape -------------------------------------
#
# Every shape (CSV, JSONL, Parquet, NPY / NPZ) becomes a _Table: one value sequence per column
# (a tuple of strings for CSV, an Arrow array for Parquet, a NumPy array for an array file, the
# records themselves for JSONL, whose records may differ in their keys). Each column is converted
# once, by whole columns (the converters below), and every check finds its first failing row by
# whole columns too; the first failing row of a file (and, within a row, the check that the
# record-by-record order of the checks puts first) is reported with the sentence the per-value
# definitions (_int, _list, _float, _phase) give for it. Those definitions stay the meaning: a
# converter's fast path takes only values whose result is the definition's by construction (ints
# already, or strings through the same int() / float()), and hands anything else to them.

_MISSING = object()  # a JSONL record without the column


class _Table:
    """One source file's records as columns: ``rowno`` (each record's line or row number),
    ``names`` (its columns in order of first appearance), ``cols`` (column -> values), or ``recs``
    for JSONL (the records themselves: their keys may differ)."""

    def __init__(self, rowno: np.ndarray, names: list[str], cols: dict[str, Any],
                 recs: list[dict[str, Any]] | None = None):
        self.rowno, self.names, self.cols, self.recs = rowno, names, cols, recs
        self.n = int(rowno.size)

    def values(self, name: str) -> Any:
        """The column as stored (``_MISSING`` where a record lacks it)."""
        if self.recs is not None:
            return [r.get(name, _MISSING) for r in self.recs]
        v = self.cols.get(name)
        return [_MISSING] * self.n if v is None else v

    def pylist(self, name: str) -> list:
        return _pylist(self.values(name))

    def present(self, name: str) -> np.ndarray:
        if self.recs is not None:
            return np.fromiter((name in r for r in self.recs), bool, self.n)
        return np.full(self.n, name in self.cols)

    def row(self, i: int) -> dict[str, Any]:
        """Record ``i`` as a dict (as the engine wrote it)."""
        if self.recs is not None:
            return self.recs[i]
        return {c: _pylist(self.cols[c][i:i + 1])[0] for c in self.names}

    def take(self, idx: np.ndarray) -> _Table:
        if self.recs is not None:
            return _Table(self.rowno[idx], self.names, {}, [self.recs[i] for i in idx.tolist()])
        return _Table(self.rowno[idx], self.names, {c: _take(v, idx) for c, v in self.cols.items()})


def _pylist(v: Any) -> list:
    if isinstance(v, np.ndarray):
        return v.tolist()
    if hasattr(v, "to_pylist"):
        return v.to_pylist()
    return list(v)


def _take(v: Any, idx: np.ndarray) -> Any:
    if isinstance(v, np.ndarray):
        return v[idx]
    if hasattr(v, "take"):
        return v.take(idx)
    return [v[i] for i in idx.tolist()]


def _arrow(v: Any) -> Any:
    """An Arrow column as one Array (None for anything else)."""
    import pyarrow as pa

    if isinstance(v, pa.ChunkedArray):
        return v.combine_chunks()
    return v if isinstance(v, pa.Array) else None


Bad = tuple[int, UserError] | None  # the first value a column refuses: (its index, the sentence)


def _scan(vals: list, conv: Any) -> tuple[list, Bad]:
    """``conv(value, index)`` on each value in order (the per-value definition): the results, and
    the first refusal (the scan stops there)."""
    out: list = []
    for i, v in enumerate(vals):
        if v is _MISSING:
            out.append(None)
            continue
        try:
            out.append(conv(v, i))
        except UserError as e:
            return out, (i, e)
    return out, None


def _ints(vals: Any, path: Path, rowno: np.ndarray, what: str) -> tuple[np.ndarray, Bad]:
    """A column of integers (each value as :func:`_int` reads it) as int64."""
    n = len(vals)
    arr = _arrow(vals)
    if arr is not None:
        import pyarrow as pa

        if pa.types.is_integer(arr.type) and arr.null_count == 0:
            vals = arr.to_numpy()
        else:
            vals = arr.to_pylist()
    if isinstance(vals, np.ndarray):
        if vals.dtype.kind == "i" or (vals.dtype.kind == "u" and (n == 0 or int(vals.max()) < _INT64)):
            return vals.astype(np.int64), None
        vals = vals.tolist()
    try:
        kinds = set(map(type, vals))
        if kinds <= {int}:
            return np.array(vals, dtype=np.int64).reshape(n), None
        if kinds == {str}:
            return np.fromiter(map(int, vals), np.int64, n), None
        if kinds == {float}:  # whole numbers written as floats (a column with gaps, once)
            a = np.array(vals, dtype=np.float64)
            if (np.isfinite(a) & (a == np.floor(a)) & (np.abs(a) < 2.0 ** 63)).all():
                return a.astype(np.int64), None
    except (ValueError, OverflowError):
        pass
    out, bad = _scan(vals, lambda v, i: _int(v, path, rowno[i], what))
    return np.array([0 if x is None else x for x in out] + [0] * (n - len(out)), dtype=np.int64), bad


def _floats(vals: Any, path: Path, rowno: np.ndarray, what: str) -> tuple[np.ndarray, Bad]:
    """A column of finite numbers (each value as :func:`_float` reads it: an empty string is 0) as float64."""
    n = len(vals)
    arr = _arrow(vals)
    if arr is not None:
        import pyarrow as pa

        t = arr.type
        vals = (arr.to_numpy().astype(np.float64) if (pa.types.is_floating(t) or pa.types.is_integer(t))
                and arr.null_count == 0 else arr.to_pylist())
    out: np.ndarray | None = None
    if isinstance(vals, np.ndarray) and vals.dtype.kind in "iuf":
        out = vals.astype(np.float64)
    else:
        vals = _pylist(vals)
        try:
            kinds = set(map(type, vals))
            if kinds <= {int, float}:
                out = np.array(vals, dtype=np.float64).reshape(n)
            elif kinds == {str}:
                out = np.fromiter(map(float, (s if s else "0" for s in vals)), np.float64, n)
        except (ValueError, OverflowError):
            out = None
    if out is not None and np.isfinite(out).all():
        return out, None
    vals = _pylist(vals)
    res, bad = _scan(vals, lambda v, i: _float(v, path, rowno[i], what))
    return np.array([0.0 if x is None else x for x in res] + [0.0] * (n - len(res)), dtype=np.float64), bad


# A JSON list of small non-negative integers, or of plain decimal numbers: read exactly as the same
# text split on its commas would be (the JSON parser gives those values), so it takes the split path.
_JSON_INTS = re.compile(r"\[[ \t]*(?:0|[1-9][0-9]{0,17})(?:[ \t]*,[ \t]*(?:0|[1-9][0-9]{0,17}))*[ \t]*\]")
_NUM = r"-?(?:0|[1-9][0-9]{0,17})(?:\.[0-9]+)?(?:[eE][-+]?[0-9]{1,3})?"
_JSON_NUMS = re.compile(rf"\[[ \t]*{_NUM}(?:[ \t]*,[ \t]*{_NUM})*[ \t]*\]")
_SEPS = str.maketrans(",;|", "   ")
_SEPS_JSON = str.maketrans(",;|[]", "     ")


def _lists(vals: Any, path: Path, rowno: np.ndarray, what: str, cast: type) -> tuple[np.ndarray, np.ndarray, Bad]:
    """A column of lists (each value as :func:`_list` reads it): the values of every list, one after
    another (int64 or float64), and each list's length."""
    n = len(vals)
    dtype = np.int64 if cast is int else np.float64
    if isinstance(vals, np.ndarray) and vals.ndim == 2:  # an array file's [rows, k]
        if (vals.dtype.kind == "i" or (vals.dtype.kind == "u" and (vals.size == 0 or int(vals.max()) < _INT64))
                or (cast is float and vals.dtype.kind == "f")):
            return vals.reshape(-1).astype(dtype), np.full(n, vals.shape[1], np.int64), None
        vals = vals.tolist()
    arr = _arrow(vals)
    if arr is not None:
        import pyarrow as pa
        import pyarrow.compute as pc

        t = arr.type
        if (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)) and arr.null_count == 0:
            flat = arr.flatten()
            vt = flat.type
            if flat.null_count == 0 and (pa.types.is_integer(vt) or (cast is float and pa.types.is_floating(vt))):
                a = flat.to_numpy()
                if a.dtype.kind != "u" or a.size == 0 or int(a.max()) < _INT64:
                    return a.astype(dtype), pc.list_value_length(arr).to_numpy().astype(np.int64), None
        vals = arr.to_pylist()
    vals = _pylist(vals)
    try:
        kinds = set(map(type, vals))
        if kinds <= {list}:
            lens = np.fromiter(map(len, vals), np.int64, n)
            flat = list(chain.from_iterable(vals))
            fk = set(map(type, flat))
            if fk <= ({int} if cast is int else {int, float}):
                return np.array(flat, dtype=dtype).reshape(len(flat)), lens, None
        elif kinds == {str}:
            # _list's split: runs of whitespace or , ; | between the values, empty pieces dropped --
            # str.split() after , ; | become spaces (the same whitespace as the pattern's \s). A JSON
            # list takes that path only when it is plain numbers (the regexes above).
            text = "\x00".join(vals)
            if "[" in text or "]" in text:
                rx = _JSON_INTS if cast is int else _JSON_NUMS
                if not all(rx.fullmatch(s) for s in map(str.strip, vals)):
                    raise ValueError  # a list written otherwise: each value read by _list
                seps = _SEPS_JSON
            else:
                seps = _SEPS
            flat, lens = _split_rows(vals, seps)
            return np.fromiter(map(cast, flat), dtype, len(flat)), lens, None
    except (ValueError, OverflowError):
        pass
    out, bad = _scan(vals, lambda v, i: _list(v, path, rowno[i], what, cast))
    got = [[] if x is None else x for x in out] + [[]] * (n - len(out))
    return (np.array(list(chain.from_iterable(got)), dtype=dtype), np.fromiter(map(len, got), np.int64, n), bad)


def _per_value(vals: list, f: Any) -> list:
    """``f`` of each value, computed once per distinct value (a column of a few request ids or two
    phases); value by value where the values are not hashable."""
    try:
        if len(set(map(type, vals))) == 1:  # one type: equal values are the same value
            memo1 = {v: f(v) for v in dict.fromkeys(vals)}
            return list(map(memo1.__getitem__, vals))
        keys = list(zip(map(type, vals), vals))  # 1, 1.0 and True are equal keys, but not the same value
        memo = {key: f(key[1]) for key in dict.fromkeys(keys)}
        return list(map(memo.__getitem__, keys))
    except (TypeError, KeyError):  # unhashable, or NaN (not equal to itself)
        return [f(v) for v in vals]


# str.split()'s whitespace among ASCII characters (str.isspace: the file, group, record and unit
# separators are whitespace too).
_ASCII_SPACE = np.zeros(128, dtype=bool)
_ASCII_SPACE[[9, 10, 11, 12, 13, 28, 29, 30, 31, 32]] = True


def _split_rows(vals: list[str], seps: dict[int, Any]) -> tuple[list[str], np.ndarray]:
    """Each string's ``.translate(seps).split()``: the pieces of all of them, one after another,
    and each one's count. ASCII text is split at once (its pieces counted per row by NumPy); other
    text string by string."""
    n = len(vals)
    text = "\n".join(vals).translate(seps)
    if text.isascii() and text.count("\n") == n - 1:
        raw = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
        space = _ASCII_SPACE[raw]
        starts = ~space
        starts[1:] &= space[:-1]  # a piece starts after whitespace (or at the beginning)
        row = np.searchsorted(np.flatnonzero(raw == 10), np.flatnonzero(starts))  # newlines before each piece
        return text.split(), np.bincount(row, minlength=n).astype(np.int64)
    pieces = list(map(str.split, map(methodcaller("translate", seps), vals)))
    return list(chain.from_iterable(pieces)), np.fromiter(map(len, pieces), np.int64, n)


_PHASE_OF = {"0": PHASE_PREFILL, "prefill": PHASE_PREFILL, "prompt": PHASE_PREFILL,
             "1": PHASE_DECODE, "decode": PHASE_DECODE, "generate": PHASE_DECODE}


def _phases(vals: Any, path: Path, rowno: np.ndarray) -> tuple[np.ndarray, Bad]:
    """A column of phases (each value as :func:`_phase` reads it)."""
    vals = _pylist(vals)
    got = _per_value(vals, lambda v: _PHASE_OF.get(str(v).strip().lower()))
    if None not in got:
        return np.array(got, dtype=np.int64).reshape(len(vals)), None
    out, bad = _scan(vals, lambda v, i: _phase(v, path, rowno[i]))
    return np.array([0 if x is None else x for x in out] + [0] * (len(vals) - len(out)), dtype=np.int64), bad


# -- the options that say what the log does not (issue 30 item 3) ---------------------------------

def _check_options(mapping: dict[str, str], phase: str | None, prompt_tokens: str | None, request_per_file: bool,
                   batch_per_file: bool, layer_from_path: str | None, request_from_path: str | None,
                   top_k: int | None) -> tuple[set[str], int | str | None]:
    """The keys an option takes over (not read from a column) and --prompt-tokens as a count or a
    column name; contradictory options refused in one sentence naming them."""
    if phase is not None and phase not in ("prefill", "decode"):
        raise UserError(f"--phase {phase!r}: is prefill or decode.")
    if phase is not None and prompt_tokens is not None:
        raise UserError("--phase and --prompt-tokens both say where the prompt ends; give one.")
    if request_per_file and request_from_path is not None:
        raise UserError("--request-per-file and --request-from-path both name the request; give one.")
    if top_k is not None and top_k < 1:
        raise UserError(f"--top-k {top_k}: is at least 1.")
    off: set[str] = set()
    for key, flag, on in (("layer", "--layer-from-path", layer_from_path is not None),
                          ("request", "--request-per-file" if request_per_file else "--request-from-path",
                           request_per_file or request_from_path is not None),
                          ("batch", "--batch-per-file", batch_per_file),
                          ("phase", "--phase" if phase is not None else "--prompt-tokens",
                           phase is not None or prompt_tokens is not None)):
        if on:
            if key in mapping:
                raise UserError(f"--map {key}={mapping[key]} and {flag} both say the {key}; give one.")
            if key != "phase":  # a phase column the log has is refused beside --phase, not ignored
                off.add(key)
    pt: int | str | None = None
    if prompt_tokens is not None:
        s = str(prompt_tokens).strip()
        if _is_int_str(s):
            pt = int(s)
            if pt < 0:
                raise UserError(f"--prompt-tokens {pt}: is negative.")
        elif not s:
            raise UserError("--prompt-tokens: give a token count or the column that holds each request's prompt length.")
        else:
            pt = s
    return off, pt


def _path_value(path: Path, regex: str, key: str, flag: str) -> str:
    """What ``regex`` (its group named ``key``, else its first group, else the whole match) finds in
    ``path`` (searched in the path as given, '/'-separated)."""
    try:
        rx = re.compile(regex)
    except re.error as e:
        raise UserError(f"{flag} {regex!r}: is not a regular expression ({e}).") from None
    m = rx.search(path.as_posix())
    if m is None:
        raise UserError(f"{path}: {flag} {regex!r} does not match its path; give a pattern that does, its first "
                        f"group the {key} (e.g. {flag} '{key}_(\\d+)').")
    return m.group(key) if key in rx.groupindex else (m.group(1) if rx.groups else m.group(0))


def _layer_from_name(path: Path) -> int:
    """The layer of a file without a layer column: the number after "layer" in its file name
    (``router_layer_07.jsonl`` -> 7). Any other number is refused, not guessed: the last number of
    ``scores_rank0.csv`` or ``run3_layer12_gpu0.csv`` would read layer 0 (a silent misread)."""
    found = re.findall(r"layer[_\-.]?(\d+)", path.stem, flags=re.I)
    if len(found) != 1:
        nums = re.findall(r"\d+", path.stem)
        said = f"no number after 'layer' in its file name{' (it holds ' + ', '.join(nums) + ')' if nums else ''}"
        raise UserError(f"{path}: has no layer column and {said}; name the layer column with --map layer=COLUMN, or "
                        "say where its path holds the layer with --layer-from-path REGEX (e.g. 'layer_(\\d+)').")
    return _int(found[0], path, 0, "layer (from the file name)")


# -- one parser per shape: rows (CSV / JSONL / Parquet), arrays (NPY / NPZ), wide columns --------

AXIS_POSITION, AXIS_LAYER = "axis 0 (position)", "axis 1 (layer)"


def _array_table(path: Path, mapping: dict[str, str]) -> tuple[_Table, dict[str, str], list[str], str]:
    """The records of a ``.npy`` (ids ``[tokens, layers, k]``, or ``[tokens, k]`` for a file of one
    layer) or a ``.npz`` (ids and optional weights of that shape, found by --map or by name), one
    per (position, layer); the columns they imply; the archive's other arrays; a note on the axes.
    Never unpickles (``allow_pickle=False``)."""
    import zipfile

    check_source(path)
    hint = "(ids [tokens, layers, k] or [tokens, k], written by numpy.save / numpy.savez)"
    magic = head_bytes(path, 6)
    if magic[:6] != b"\x93NUMPY" and magic[:2] != b"PK":
        raise UserError(f"{path}: is not a .npy / .npz array file {hint}: no NUMPY or zip header.")
    try:
        data = np.load(path, allow_pickle=False)
        arrays = {k: data[k] for k in data.files} if isinstance(data, np.lib.npyio.NpzFile) else {"array": data}
    except ValueError as e:
        if "pickle" in str(e):
            raise UserError(f"{path}: holds a pickled object array, not integer expert ids; refused (not unpickled).") from None
        raise UserError(f"{path}: is not a readable .npy / .npz array file {hint}: {str(e)[:100]}.") from None
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise UserError(f"{path}: is not a readable .npy / .npz array file {hint}: {str(e)[:100]}.") from None
    npz = path.suffix.lower() == ".npz"
    if npz:
        chosen, _ = resolve_columns({k: v for k, v in mapping.items() if k in ("experts", "weights")}, arrays)
        ek, wk = chosen.get("experts"), chosen.get("weights")
        if ek is None or ek not in arrays:
            raise UserError(f"{path}: holds the arrays {', '.join(sorted(arrays)) or 'none'}, none of them the expert "
                            f"ids; name it with --map experts=NAME (and weights=NAME).")
        if wk is not None and wk not in arrays:
            raise UserError(f"{path}: has no array {wk!r} (--map weights={wk}); its arrays: {', '.join(sorted(arrays))}.")
    else:
        ek, wk = "array", None
    ids = arrays[ek]
    if ids.dtype.kind not in "iu":
        raise UserError(f"{path}: {ek} holds {ids.dtype} values, not integer expert ids {hint}.")
    if ids.ndim not in (2, 3) or 0 in ids.shape:
        raise UserError(f"{path}: {ek} has shape {list(ids.shape)}, not [tokens, layers, k] or [tokens, k] (one layer).")
    w = arrays[wk] if wk is not None else None
    if w is not None and (w.shape != ids.shape or w.dtype.kind != "f"):
        raise UserError(f"{path}: {wk} has shape {list(w.shape)} ({w.dtype}), not the ids' {list(ids.shape)} of floats.")
    name_e = ek if npz else path.name
    t = ids.shape[0]
    if ids.ndim == 3:  # one record per (position, layer), positions first
        nl = ids.shape[1]
        cols: dict[str, Any] = {AXIS_POSITION: np.repeat(np.arange(t, dtype=np.int64), nl),
                                name_e: ids.reshape(t * nl, ids.shape[2]),
                                AXIS_LAYER: np.tile(np.arange(nl, dtype=np.int64), t)}
    else:
        cols = {AXIS_POSITION: np.arange(t, dtype=np.int64), name_e: ids}
    if w is not None:
        cols[wk] = w.reshape(cols[name_e].shape)
    tbl = _Table(np.arange(1, cols[name_e].shape[0] + 1, dtype=np.int64), list(cols), cols)
    implied = {"experts": name_e, "token": AXIS_POSITION}
    if ids.ndim == 3:
        implied["layer"] = AXIS_LAYER
    if wk is not None:
        implied["weights"] = wk
    others = [k for k in arrays if k not in (ek, wk)]
    shape = "x".join(str(x) for x in ids.shape)
    note = (f"{path.name}: the array {ek if npz else ''}{' ' if npz else ''}[{shape}] read as "
            + ("[tokens, layers, k]: axis 0 the position, axis 1 the layer" if ids.ndim == 3
               else "[tokens, k] of one layer: axis 0 the position")
            + (f", weights from {wk}" if wk is not None else ", no weights"))
    return tbl, implied, others, note


class _Wide:
    """A wide table's experts (``--map experts=expert_*``): the columns the pattern matches, in
    numeric order. With ``weights=weight_*`` too, one column per *slot* (values: the ids and their
    weights); alone, one column per *expert* (the number in the name is the id, the value its
    weight: the non-zero columns of a row are its routing, or its ``--top-k`` largest)."""

    def __init__(self, epat: str, wpat: str | None, rec: dict[str, Any], top_k: int | None, path: Path, rowno: int):
        self.epat, self.wpat, self.top_k = epat, wpat, top_k
        self.ecols = _pattern_columns(epat, rec, path, rowno, "experts")
        self.wcols = _pattern_columns(wpat, rec, path, rowno, "weights") if wpat else None
        self.per_slot = self.wcols is not None
        if self.per_slot and [n for n, _ in self.ecols] != [n for n, _ in self.wcols]:
            raise UserError(f"{path}: the columns {epat} and {wpat} are numbered differently "
                            f"({_span(self.ecols)} and {_span(self.wcols)}); one weight column per expert slot.")
        if top_k is not None and self.per_slot:
            raise UserError(f"--top-k {top_k}: applies to one score column per expert; with --map weights={wpat} the "
                            f"columns {epat} are slots already.")
        self.mask = True  # every value read so far is 0 or 1 (a routing mask: no weights)

    def columns(self) -> list[str]:
        return [c for _, c in self.ecols] + ([c for _, c in self.wcols] if self.wcols else [])

    def read(self, tbl: _Table, path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, list]:
        """Every row's routing: its ids and weights, the rows' one after another, each row's count,
        and the first row each check refuses: (row, the check's place in a row's order, sentence)."""
        rowno, n, bad = tbl.rowno, tbl.n, []
        if self.per_slot:
            assert self.wcols is not None
            ids, ws = [], []
            for j, (_, c) in enumerate(self.ecols):
                a, b = _ints(tbl.values(c), path, rowno, c)
                ids.append(a)
                if b:
                    bad.append((b[0], j, b[1]))
            for j, (_, c) in enumerate(self.wcols):
                a, b = _floats(tbl.values(c), path, rowno, c)
                ws.append(a)
                if b:
                    bad.append((b[0], len(self.ecols) + j, b[1]))
            return (np.stack(ids, axis=1).reshape(-1), np.full(n, len(ids), np.int64), np.stack(ws, axis=1).reshape(-1),
                    bad)
        m = len(self.ecols)
        nums = np.array([num for num, _ in self.ecols], dtype=np.int64)
        v = np.zeros((n, m))
        for j, (_, c) in enumerate(self.ecols):
            v[:, j], b = _floats(tbl.values(c), path, rowno, c)
            if b:
                bad.append((b[0], j, b[1]))
        # Rows past a refused value hold zeros there; a check failing on them is never the first.
        neg = (v < 0).any(axis=1)
        if neg.any():
            i = int(np.argmax(neg))
            j = int(np.argmax(v[i] < 0))
            bad.append((i, m, UserError(f"{path}: row {rowno[i]}: expert column {nums[j]} holds {float(v[i, j])} "
                                        "(negative: raw logits?); one column per expert holds the applied weight, 0 "
                                        "where the expert was not routed.")))
        ints = (v == np.floor(v)).all(axis=1) & (v.max(axis=1, initial=-np.inf) > 1)
        if ints.any():
            i = int(np.argmax(ints))
            bad.append((i, m + 1, UserError(
                f"{path}: row {rowno[i]}: the columns {self.epat} hold integers above 1 (expert ids, one column "
                f"per slot?), not one weight per expert; for slots name their weights too: --map "
                f"'experts={self.epat},weights=weight_*'.")))
        nz = v != 0
        cnt = nz.sum(axis=1)
        if self.top_k is not None:
            few = cnt < self.top_k
            if few.any():
                i = int(np.argmax(few))
                bad.append((i, m + 2, UserError(f"{path}: row {rowno[i]}: only {cnt[i]} expert column(s) are non-zero, "
                                                f"fewer than --top-k {self.top_k}.")))
            # the K largest, ties by column number (a stable sort of the negated values)
            order = np.argsort(-v, axis=1, kind="stable")[:, :self.top_k]
            ids, w = nums[order].reshape(-1), np.take_along_axis(v, order, axis=1).reshape(-1)
            lens = np.full(n, self.top_k, np.int64)
        else:
            dense = (cnt == m) & (m > 1)
            if dense.any():
                i = int(np.argmax(dense))
                bad.append((i, m + 2, UserError(
                    f"{path}: row {rowno[i]}: every one of the {m} expert columns is non-zero (dense scores, not a "
                    "routing); give --top-k K to take each row's K largest as its routing.")))
            ids, w, lens = np.broadcast_to(nums, v.shape)[nz], v[nz], cnt.astype(np.int64)
        self.mask = self.mask and bool((w == 1).all())
        return ids.astype(np.int64), lens, w, bad


def _pattern_columns(pat: str, rec: dict[str, Any], path: Path, rowno: int, key: str) -> list[tuple[int, str]]:
    if pat.count("*") != 1:
        raise UserError(f"--map {key}={pat}: a wide pattern has one '*' standing for the number (e.g. expert_*).")
    rx = re.compile("^" + re.escape(pat).replace(r"\*", r"(\d+)") + "$")
    found = sorted((int(m.group(1)), c) for c in rec if (m := rx.match(str(c))))
    if not found:
        raise UserError(f"{path}: row {rowno}: no column matches --map {key}={pat}; its columns: "
                        f"{', '.join(sorted(str(c) for c in rec))[:300]}.")
    nums = [n for n, _ in found]
    if len(set(nums)) != len(nums):
        dup = next(n for n in nums if nums.count(n) > 1)
        raise UserError(f"{path}: two columns match --map {key}={pat} with the number {dup} "
                        f"({', '.join(c for n, c in found if n == dup)}).")
    return found


def _span(cols: list[tuple[int, str]]) -> str:
    return cols[0][1] if len(cols) == 1 else f"{cols[0][1]}..{cols[-1][1]}"


def _float(v: Any, path: Path, where: int, what: str) -> float:
    if isinstance(v, bool) or v is None:
        raise UserError(f"{path}: row {where}: {what} {v!r} is not a number.")
    try:
        out = float(v) if not isinstance(v, str) else (float(v.strip()) if v.strip() else 0.0)
    except ValueError:
        raise UserError(f"{path}: row {where}: {what} {v!r} is not a number.") from None
    if not np.isfinite(out):
        raise UserError(f"{path}: row {where}: {what} {v!r} is not finite.")
    return out


# -- a log's metadata lines -----------------------------------------------------------------------

_META_KEY = re.compile(r"^(?:engine|version|model|model_name|model_id)$|_version$")  # the keys _meta_of reads
KNOWN_ENGINES = ("vllm", "sglang", "llama_cpp", "llamacpp", "tensorrt_llm", "trtllm", "megatron", "deepspeed",
                 "transformers", "colibri")


def _meta_of(rec: dict[str, Any]) -> dict[str, str]:
    """Engine, its version and the model a metadata record states: ``engine`` / ``engine_version`` /
    ``version``, else a ``NAME_version`` key (an engine's name preferred: ``vllm_version`` says the
    engine is vllm), and ``model`` / ``model_name`` / ``model_id``."""
    out: dict[str, str] = {}

    def text(v: Any) -> str | None:
        return str(v)[:120] if isinstance(v, (str, int, float)) and not isinstance(v, bool) else None

    if text(rec.get("engine")):
        out["engine"] = text(rec["engine"])  # type: ignore[assignment]
    for vk in ("engine_version", "version"):
        if text(rec.get(vk)) and "engine_version" not in out:
            out["engine_version"], out["version_key"] = text(rec[vk]), vk  # type: ignore[assignment]
    if "engine_version" not in out:
        vkeys = [k for k in rec if isinstance(k, str) and k.endswith("_version") and text(rec[k])]
        vkeys = [k for _, k in sorted(enumerate(vkeys), key=lambda ik: (ik[1][:-len("_version")].lower()
                                                                         not in KNOWN_ENGINES, ik[0]))]
        if vkeys:
            out["engine_version"], out["version_key"] = text(rec[vkeys[0]]), vkeys[0]  # type: ignore[assignment]
            out.setdefault("engine", vkeys[0][:-len("_version")])
    for mk in ("model", "model_name", "model_id"):
        if text(rec.get(mk)) and "model" not in out:
            out["model"] = text(rec[mk])  # type: ignore[assignment]
    return out


# -- the import -----------------------------------------------------------------------------------

def import_(sources: list[Path], out_dir: Path, *, sizes: Any = None, force: bool = False, map: str | None = None,  # noqa: A002
            where: str | None = None, engine: str | None = None, drop_warmup: bool = False, phase: str | None = None,
            prompt_tokens: str | int | None = None, request_per_file: bool = False, batch_per_file: bool = False,
            layer_from_path: str | None = None, request_from_path: str | None = None,
            top_k: int | None = None) -> Path:
    srcs = [check_source(Path(s)) for s in sources]
    sizes = require_sizes(sizes, srcs[0], NAME)
    mapping = parse_map(map)
    cond = parse_where(where)
    off, pt = _check_options(mapping, phase, None if prompt_tokens is None else str(prompt_tokens), request_per_file,
                             batch_per_file, layer_from_path, request_from_path, top_k)
    notes: list[str] = []
    inferred: list[str] = []  # every inference, each also a note (provenance "inferences")

    def infer(s: str) -> None:
        notes.append(s)
        inferred.append(s)

    skipped, skipped_keys, skipped_meta = 0, set(), {}
    meta_lines: list[tuple[str, int, dict[str, Any]]] = []
    req_ids: dict[Any, int] = {}
    int_ids = False
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("experts", "elen", "weights", "wlen", "layer", "token",
                                                          "batch", "token_id", "request", "phase", "prompt", "file",
                                                          "row")}
    have: dict[str, bool] = {}
    col: dict[str, str] | None = None  # key -> source column, resolved on the first routing record
    auto: list[str] = []
    wide: _Wide | None = None
    implied: dict[str, str] = {}
    seen_cols: dict[str, None] = {}  # every column of every record kept, in order of first appearance
    layer_said: list[str] = []
    for fi, path in enumerate(srcs):
        if _kind(path) == "array":
            tbl, implied, others, axes = _array_table(path, mapping)
            seen_cols.update(dict.fromkeys(others))
            notes.append(axes)
        else:
            tbl = _read_table(path)
        emap = {**implied, **mapping}
        if cond:
            keep = np.ones(tbl.n, dtype=bool)
            for kk, v in cond.items():
                keep &= np.array([str(None if x is _MISSING else x) == v for x in tbl.pylist(kk)], dtype=bool)
            if not keep.all():
                skipped += int((~keep).sum())
                gone = np.flatnonzero(~keep)
                if tbl.recs is not None:
                    for i in gone.tolist():
                        skipped_keys.update(tbl.recs[i])
                        for kk, v in _meta_of(tbl.recs[i]).items():
                            skipped_meta.setdefault(kk, v)
                else:
                    skipped_keys.update(tbl.names)
                    said = [c for c in tbl.names if _META_KEY.search(c)]  # what _meta_of reads
                    vals = {c: tbl.pylist(c) for c in said}
                    for i in gone.tolist() if said else []:
                        for kk, v in _meta_of({c: vals[c][i] for c in said}).items():
                            skipped_meta.setdefault(kk, v)
                tbl = tbl.take(np.flatnonzero(keep))
        if _kind(path) == "jsonl" and tbl.n:
            assert tbl.recs is not None
            head = next((i for i, r in enumerate(tbl.recs) if _is_routing(r, emap)), tbl.n)
            # leading metadata lines: provenance, not routing
            meta_lines.extend((path.name, int(tbl.rowno[i]), tbl.recs[i]) for i in range(head))
            tbl = tbl.take(np.arange(head, tbl.n))
        if tbl.n == 0:
            continue
        rowno = tbl.rowno
        if col is None:
            rec, rowno0 = tbl.row(0), int(rowno[0])
            col, auto = resolve_columns(emap, rec, cond, off=off)
            if "experts" not in col and (pats := wide_patterns(rec)) is not None:
                # No experts column, but one family of numbered expert columns: read as the wide
                # table it is (by its names: an inference, said; --map says otherwise).
                col["experts"] = pats[0]
                auto.append("experts")
                if pats[1] is not None and "weights" not in mapping:
                    col["weights"] = pats[1]
                    auto.append("weights")
                infer(f"no experts column: the numbered columns {pats[0]}"
                      + (f" and {pats[1]} taken as one column per slot (ids and weights)" if pats[1] is not None
                         and "weights" not in mapping else " taken as the experts, one column per expert")
                      + f" by their names (--map experts={pats[0]}"
                      + (f",weights={pats[1]}" if pats[1] is not None and "weights" not in mapping else "")
                      + " says so; --map experts=COLUMN to read another)")
            if "*" in col.get("experts", ""):
                wpat = col["weights"] if "*" in col.get("weights", "") else None
                if "weights" in mapping and wpat is None:
                    raise UserError(f"--map experts={col['experts']} is one column per expert (their values are the "
                                    f"weights); --map weights={mapping['weights']} would name a second source; "
                                    f"drop it, or give a slot pattern such as weights=weight_*.")
                wide = _Wide(col["experts"], wpat, rec, top_k, path, rowno0)
                if wpat is None:
                    col.pop("weights", None)
                    auto = [a for a in auto if a != "weights"]
            elif top_k is not None:
                raise UserError(f"--top-k {top_k}: applies to a wide table of one score column per expert "
                                "(--map experts=expert_*); this table has an experts column.")
            if isinstance(pt, str) and pt not in rec:
                raise UserError(f"{path}: row {rowno0}: has no column {pt!r} (--prompt-tokens {pt}); give a count, "
                                f"or one of its columns: {', '.join(sorted(str(c) for c in rec))[:300]}.")
        if tbl.recs is not None:
            seen_cols.update(dict.fromkeys(str(c) for c in chain.from_iterable(tbl.recs)))
        else:
            seen_cols.update(dict.fromkeys(str(c) for c in tbl.names))
        # Every check of every row, by whole columns; the file's first failing row is reported, and
        # within a row the check a record-by-record reading makes first: (row, stage, place, sentence).
        bad: list[tuple[int, int, int, UserError]] = []

        def flag(i: int, stage: int, place: int, err: UserError) -> None:
            bad.append((i, stage, place, err))  # noqa: B023 - used within this file's pass only

        def first(mask: np.ndarray) -> int | None:
            return int(np.argmax(mask)) if mask.any() else None

        def keys_of(i: int) -> str:
            return ", ".join(sorted(str(c) for c in tbl.row(i)))[:300]  # noqa: B023

        present = {kk: (tbl.present(col[kk]) if kk in col else np.zeros(tbl.n, dtype=bool)) for kk in KEYS}
        if wide is not None:
            every = np.ones(tbl.n, dtype=bool)
            for c in wide.columns():
                every &= tbl.present(c)
            present["experts"] = every
            present["weights"] = every if wide.per_slot else np.zeros(tbl.n, dtype=bool)
        hint = "; add --where to keep only the routing records" if not cond else ""
        for place, kk in enumerate(KEYS):
            if kk in mapping and "*" not in mapping[kk] and (i := first(~present[kk])) is not None:
                flag(i, 0, place, UserError(f"{path}: row {rowno[i]}: has no column {col[kk]!r} (--map {kk}={col[kk]}); "
                                            f"its columns: {keys_of(i)}{hint}."))
        if (i := first(~present["experts"])) is not None:
            flag(i, 1, 0, UserError(f"{path}: row {rowno[i]}: has no experts column {col.get('experts', 'experts')!r}; "
                                    f"name it with --map experts=COLUMN (or experts=expert_* for one column per expert)"
                                    f"{hint}."))
        for place, kk in enumerate(("weights", "layer", "token", "request", "batch", "phase", "token_id")):
            have.setdefault(kk, bool(present[kk][0]))
            if (i := first(present[kk] != have[kk])) is not None:
                p_ = bool(present[kk][i])
                flag(i, 2, place, UserError(f"{path}: row {rowno[i]}: {'has' if p_ else 'lacks'} the {kk} column "
                                            f"{col.get(kk, kk)!r} that earlier rows {'lack' if p_ else 'have'}."))
        # experts and weights (stage 3; a wide table's columns are read there, all of them)
        if wide is not None:
            ex, elen, w, wbad = wide.read(tbl, path)
            for i, place, err in wbad:
                flag(i, 3, place, err)
            wlen = elen
        else:
            ex, elen, b = _lists(tbl.values(col["experts"]), path, rowno, "experts", int)
            if b:
                flag(b[0], 3, 0, b[1])
            if have["weights"]:
                w, wlen, b = _lists(tbl.values(col["weights"]), path, rowno, "weights", float)
                if b:
                    flag(b[0], 4, 0, b[1])
                if (i := first(wlen != elen)) is not None:
                    flag(i, 4, 1, UserError(f"{path}: row {rowno[i]}: {wlen[i]} weights for {elen[i]} experts."))
            else:
                w, wlen = np.zeros(0), np.zeros(tbl.n, np.int64)
        if have["layer"]:
            lay, b = _ints(tbl.values(col["layer"]), path, rowno, "layer")
            if b:
                flag(b[0], 5, 0, b[1])
        else:
            try:
                if layer_from_path is not None:
                    file_layer = _int(_path_value(path, layer_from_path, "layer", "--layer-from-path"), path, 0,
                                      "layer (from --layer-from-path)")
                    layer_said.append(f"{path.name}: layer {file_layer} (--layer-from-path)")
                else:
                    file_layer = _layer_from_name(path)
                    infer(f"{path.name}: no layer column: its rows are layer {file_layer} (the number after "
                          "'layer' in the file name; --layer-from-path REGEX to read it elsewhere)")
            except UserError as e:
                flag(0, 5, 0, e)
                file_layer = 0
            lay = np.full(tbl.n, file_layer, dtype=np.int64)
        got: dict[str, np.ndarray] = {}
        for stage, kk in ((6, "token"), (7, "batch"), (8, "token_id")):
            if have[kk]:
                got[kk], b = _ints(tbl.values(col[kk]), path, rowno, kk)
                if b:
                    flag(b[0], stage, 0, b[1])
        # the request: a column, the path, or the file; names numbered in order of first appearance
        rv: Any = None
        if have["request"]:
            rv = tbl.pylist(col["request"])
        elif request_from_path is not None:
            try:
                rv = [_path_value(path, request_from_path, "request", "--request-from-path")] * tbl.n
            except UserError as e:
                flag(0, 9, 0, e)
        elif request_per_file:
            rv = [fi] * tbl.n
        if rv is not None:
            names_before, ints_before = bool(req_ids), int_ids
            named = np.array(_per_value(rv, lambda v: isinstance(v, str) and not _is_int_str(v)), dtype=bool)
            req = np.zeros(tbl.n, dtype=np.int64)
            if (~named).any():
                idx = np.flatnonzero(~named)
                req[idx], b = _ints([rv[i] for i in idx.tolist()], path, rowno[idx], "request")
                if b:
                    flag(int(idx[b[0]]), 9, 0, b[1])
            if named.any():
                req[named] = [req_ids.setdefault(rv[i], len(req_ids)) for i in np.flatnonzero(named).tolist()]
            # integers and names in one log: refused at the first row after which both were read
            both = ((ints_before | np.logical_or.accumulate(~named))
                    & (names_before | np.logical_or.accumulate(named)))
            if (i := first(both)) is not None:
                flag(i, 9, 1, UserError(f"{path}: row {rowno[i]}: request ids mix integers and names; use one kind."))
            int_ids = int_ids or bool((~named).any())
            got["request"] = req
        if have["phase"]:
            got["phase"], b = _phases(tbl.values(col["phase"]), path, rowno)
            if b:
                flag(b[0], 10, 0, b[1])
        if isinstance(pt, str):
            got["prompt"], b = _ints([None if v is _MISSING else v for v in tbl.pylist(pt)], path, rowno,
                                     f"prompt length {pt!r}")
            if b:
                flag(b[0], 11, 0, b[1])
        if bad:
            raise min(bad, key=lambda x: x[:3])[3]
        for kk, v in (("experts", ex), ("elen", elen), ("weights", w), ("wlen", wlen), ("layer", lay),
                      ("file", np.full(tbl.n, fi, np.int64)), ("row", rowno), *got.items()):
            parts[kk].append(v)
    cols = {kk: (np.concatenate(v) if v else np.zeros(0, np.int64)) for kk, v in parts.items()}
    have_request = cols["request"].size > 0
    elen = cols["elen"]
    n = int(elen.size)
    what = srcs[0] if len(srcs) == 1 else f"{srcs[0]} (and {len(srcs) - 1} more)"
    if n == 0:
        raise UserError(f"{what}: holds no routing records" + (f" matching --where {where}" if cond else "")
                        + ("" if cond else " (no record has an experts column: name it with --map experts=COLUMN, or "
                           "experts=expert_* for one column per expert; a log that mixes record types needs --where "
                           "KEY=VALUE)") + ".")
    assert col is not None
    if ((elen != elen[0]) | (elen == 0)).any():
        i = int(np.argmax((elen != elen[0]) | (elen == 0)))
        fix = (" (one top-k per log; give --top-k K to take each row's K largest expert columns)"
               if wide is not None and not wide.per_slot else " (one top-k per log)")
        raise UserError(f"{srcs[cols['file'][i]]}: row {cols['row'][i]}: routes {elen[i]} experts, "
                        f"the first routing {elen[0]}{fix}.")
    k = int(elen[0])
    if wide is not None and not wide.per_slot:
        how = f"its --top-k {top_k} largest" if top_k is not None else "its non-zero columns"
        infer(f"{_span(wide.ecols)} read as one column per expert (the number in the name is the expert id): each "
              f"row's routing is {how}, k = {k}" + (" (the same in every row)" if top_k is None else "")
              + ("; the columns hold only 0 and 1 (a routing mask): no weights" if wide.mask else
                 ", the values their weights"))
        have["weights"] = not wide.mask
    elif wide is not None:
        assert wide.wcols is not None
        notes.append(f"{_span(wide.ecols)} and {_span(wide.wcols)} read as the k = {k} slots, in column-number order")
    experts = cols["experts"].astype(np.int64).reshape(n, k)
    layer = cols["layer"].astype(np.int64)
    fileno, rowno = cols["file"], cols["row"]

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
    request = np.array(cols["request"], dtype=np.int64) if have_request else np.zeros(n, dtype=np.int64)
    if req_ids:
        notes.append(f"request ids are strings: numbered 0..{len(req_ids) - 1} in order of first appearance")
    if request_per_file:
        notes.append(f"--request-per-file: each of the {len(srcs)} file(s) is one request (request = file, in order)")
    elif request_from_path is not None:
        notes.append(f"request from each file's path (--request-from-path {request_from_path})")
    notes.extend(layer_said)
    step = np.array(cols["token"], dtype=np.int64) if have.get("token") else None
    per_file = False
    if len(srcs) > 1 and not request_per_file and request_from_path is None:
        per_file, said = _requests_per_file(srcs, fileno, request, layer, step, have_request)
        if said:
            infer(said)
        if per_file:
            _, request = np.unique(np.stack([fileno, request], axis=1), axis=0, return_inverse=True)
            request = request.reshape(-1).astype(np.int64)
            have_request = True
    if step is None:
        # File order is token order: the n-th row of a (request, layer) is its n-th token.
        key = request * (1 << 20) + layer
        order = np.argsort(key, kind="stable")
        ks_sorted = key[order]
        starts = np.flatnonzero(np.concatenate([[True], ks_sorted[1:] != ks_sorted[:-1]]))
        rank = np.arange(n) - np.repeat(starts, np.diff(np.append(starts, n)))
        step = np.empty(n, dtype=np.int64)
        step[order] = rank
        infer("no token column: file order is token order (the n-th row of a layer"
              + (" and request" if have_request else "") + " is its n-th token, positions from 0)")
    elif (step < 0).any() or (step > np.iinfo(np.int32).max).any():
        refuse_at(int(np.flatnonzero((step < 0) | (step > np.iinfo(np.int32).max))[0]),
                  "token position is negative or beyond int32")
    passes = None
    if have.get("token") and _first_duplicate(np.stack([request, step, layer], axis=1)) is not None:
        # Positions repeat: a counter that restarts (the position within each forward pass).
        step, passes, prefill_mask, said = _passes_from_restarts(srcs, fileno, rowno, request, layer, step,
                                                                 col["token"], have_request)
        infer(said)
    if (step > np.iinfo(np.int32).max).any():
        refuse_at(int(np.argmax(step > np.iinfo(np.int32).max)), "token position is beyond int32")
    dup = _first_duplicate(np.stack([request, step, layer], axis=1))
    if dup is not None:
        refuse_at(dup, f"routes token {step[dup]} of layer {layer[dup]}{f' of request {request[dup]}' if have_request else ''} "
                  "a second time (if it belongs to another request, name the request column with --map "
                  "request=COLUMN or give --request-per-file)")
    # Batches the log states (or an option says): before the phase, which may be inferred from them.
    batch: np.ndarray | None = None
    if batch_per_file:
        batch = fileno.astype(np.int64)
        notes.append(f"--batch-per-file: each of the {len(srcs)} file(s) is one forward pass (batch = file, in order)")
    elif have.get("batch"):
        raw = np.array(cols["batch"], dtype=np.int64)
        if (raw < 0).any():
            refuse_at(int(np.argmax(raw < 0)), "batch is negative")
        if (per_file or request_per_file) and len(srcs) > 1:
            _, batch = np.unique(np.stack([fileno, raw], axis=1), axis=0, return_inverse=True)
            notes.append("batch numbers kept per file (the files' requests are apart): a batch is a (file, batch) pair")
        else:
            _, batch = np.unique(raw, return_inverse=True)
        batch = batch.reshape(-1).astype(np.int64)
    if have.get("phase"):
        if phase is not None or pt is not None:
            raise UserError(f"{what}: has a phase column {col['phase']!r}; drop --phase / --prompt-tokens, or map "
                            "the phase to another column.")
        phase_ = np.array(cols["phase"], dtype=np.int64)
    elif phase is not None:
        phase_ = np.full(n, PHASE_PREFILL if phase == "prefill" else PHASE_DECODE, dtype=np.int64)
        notes.append(f"phase from --phase {phase}: every routing is {phase}")
    elif isinstance(pt, int):
        phase_ = np.where(step < pt, PHASE_PREFILL, PHASE_DECODE).astype(np.int64)
        notes.append(f"phase from --prompt-tokens {pt}: positions 0..{pt - 1} of every request are prefill, the rest decode")
    elif isinstance(pt, str):
        plen = np.array(cols["prompt"], dtype=np.int64)
        ur = np.unique(np.stack([request, plen], axis=1), axis=0)
        if ur.shape[0] != np.unique(request).size:
            r = int(next(r for r in np.unique(ur[:, 0]) if (ur[:, 0] == r).sum() > 1))
            refuse_at(int(np.argmax((request == r) & (plen != plen[np.argmax(request == r)]))),
                      f"the prompt length {pt!r} changes within request {r}; it is one number per request")
        if (plen < 0).any():
            refuse_at(int(np.argmax(plen < 0)), f"prompt length {pt!r} is negative")
        phase_ = np.where(step < plen, PHASE_PREFILL, PHASE_DECODE).astype(np.int64)
        notes.append(f"phase from the column {pt} (--prompt-tokens {pt}): each request's first that many positions "
                     "are prefill, the rest decode")
    elif passes is not None:
        phase_ = np.where(prefill_mask, PHASE_PREFILL, PHASE_DECODE).astype(np.int64)
    elif batch is not None:
        phase_, said = _phase_from_batches(srcs, fileno, rowno, request, batch, layer, step, have_request)
        infer(said)
    else:
        phase_ = np.full(n, PHASE_DECODE, dtype=np.int64)
        infer("no phase column: every routing counts as decode (--phase prefill, or --prompt-tokens N for where each "
              "request's prompt ends, say otherwise)")
    if batch is None:
        if passes is not None:
            _, batch = np.unique(np.stack([_first_seen_rank(request), passes], axis=1), axis=0, return_inverse=True)
            batch = batch.reshape(-1).astype(np.int64)
            notes.append("batches from the restarting positions: each pass of a request is one batch")
        else:
            batch = _sequential_batches(request, phase_, step)
            infer("no batch column: requests one after another, a request's prompt one batch, each decoded "
                  "token its own batch")
    if have.get("weights"):
        weights = cols["weights"].astype(np.float64).reshape(n, k)
        bad = np.flatnonzero(~np.isfinite(weights).all(axis=1) | (weights < 0).any(axis=1))
        if bad.size:
            refuse_at(int(bad[0]), "has a weight that is negative, NaN or infinite")
        experts, weights, moved = slots_by_weight(experts, weights)
        if moved:
            notes.append(f"{moved} routing(s) listed their experts in another order than descending weight; their "
                         "slots are put in descending-weight order (the selected sets are unchanged)")
    else:
        weights = np.full((n, k), np.nan)
    before = len(notes)
    n_layer, n_expert = infer_shape(what, layer, experts, sizes, notes=notes)
    inferred.extend(notes[before:])
    if k > n_expert:
        raise UserError(f"{what}: routes {k} experts per row but the model has {n_expert}.")
    optional: dict[str, np.ndarray] = {}
    if have_request:
        optional["request"] = request
    if have.get("token_id"):
        tid = np.array(cols["token_id"], dtype=np.int64)
        if (tid < 0).any():
            refuse_at(int(np.argmax(tid < 0)), "token_id is negative")
        optional["token"] = tid
    used: dict[str, str] = {}
    used_cols: set[str] = set()
    for kk in KEYS:
        if kk == "experts" and wide is not None:
            used[kk] = _span(wide.ecols)
            used_cols.update(c for _, c in wide.ecols)
        elif kk == "weights" and wide is not None:
            if wide.wcols is not None:
                used[kk] = _span(wide.wcols)
                used_cols.update(c for _, c in wide.wcols)
            elif have.get("weights"):
                used[kk] = f"the values of {_span(wide.ecols)}"
        elif have.get(kk, kk == "experts") and kk in col:
            used[kk] = col[kk]
            used_cols.add(col[kk])
    if isinstance(pt, str):
        used_cols.add(pt)
    unused = [c for c in seen_cols if c not in used_cols and c not in cond]
    said = ", ".join(f"{c} -> {TRACE_COLUMN[kk]}" + (" (matched by name)" if kk in auto else "") for kk, c in used.items())
    if isinstance(pt, str):
        said += f", {pt} -> prompt length (--prompt-tokens)"
    notes.insert(0, f"source columns read: {said}" + ("; chosen by name where --map did not say (--map KEY=COLUMN "
                                                      "to choose another)" if any(kk in auto for kk in used) else ""))
    notes.insert(1, f"source columns not used: {', '.join(unused)}" if unused else "every source column was used")
    extra: dict[str, Any] = {"mapping": used, "mapped_by_name": [kk for kk in used if kk in auto],
                             "unused_columns": unused, "inferences": inferred}
    version = None
    if meta_lines:
        first = {}
        for _, _, rec in meta_lines:
            for kk, v in _meta_of(rec).items():
                first.setdefault(kk, v)
        where_ = ", ".join(f"{f} line {r}" for f, r, _ in meta_lines[:4]) + (" ..." if len(meta_lines) > 4 else "")
        keys = list(dict.fromkeys(str(kk) for _, _, rec in meta_lines for kk in rec))
        got = [f"engine {first['engine']}" if "engine" in first and engine is None else None,
               f"engine version {first['engine_version']} (from {first['version_key']})" if "engine_version" in first else None,
               f"model {first['model']}" if "model" in first else None]
        notes.append(f"{where_}: metadata, not routing (no experts column): read into provenance "
                     f"({'; '.join(g for g in got if g) or 'keys ' + ', '.join(keys)})")
        extra["source_meta"] = {"lines": len(meta_lines), "keys": keys, **{kk: v for kk, v in first.items()
                                                                           if kk != "version_key"}}
        version = first.get("engine_version")
        engine = engine or first.get("engine")
    if cond:
        extra["where"] = cond
        extra["skipped_records"] = {"count": skipped, "keys": sorted(skipped_keys)}
        version = version or skipped_meta.get("engine_version")
        engine = engine or skipped_meta.get("engine")
    prov = provenance(NAME, srcs, engine=engine or ENGINE, engine_version=version, notes=notes, **extra)
    meta = meta_from_sizes(what=what, stem=srcs[0].stem, sizes=sizes, n_layer=n_layer, n_expert=n_expert, layer=layer,
                           top_k=k, prov=prov)
    return write_trace(out_dir, meta, batch=batch, phase=phase_, step=step, layer=layer, experts=experts,
                       weights=weights.astype(np.float32), optional=optional, force=force, inputs=srcs, what=what,
                       drop_warmup=drop_warmup,
                       row_name=lambda i: f"{srcs[fileno[i]].name}:{rowno[i]}" if len(srcs) > 1 else str(rowno[i]))


def _is_routing(rec: dict[str, Any], emap: dict[str, str]) -> bool:
    """Whether a record carries the experts (a leading record that does not is metadata)."""
    e = emap.get("experts")
    if e is None:
        return bool(_names(rec, "experts")) or wide_patterns(rec) is not None
    if "*" in e:
        rx = re.compile("^" + re.escape(e).replace(r"\*", r"\d+") + "$")
        return any(rx.match(str(c)) for c in rec)
    return e in rec


def _first_seen_rank(a: np.ndarray) -> np.ndarray:
    """Each value's rank in order of first appearance."""
    _, first, inv = np.unique(a, return_index=True, return_inverse=True)
    rank = np.empty(first.size, np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(first.size)
    return rank[inv.reshape(-1)]


def _requests_per_file(srcs: list[Path], fileno: np.ndarray, request: np.ndarray, layer: np.ndarray,
                       step: np.ndarray | None, have_request: bool) -> tuple[bool, str | None]:
    """Whether request ids are the files' own (issue 30: two files that each number their requests
    from 0). Where one request routes one layer in two files: with positions and none repeated
    across the files, the files continue each other (one numbering); else each file's ids are its
    own. Returns (per file, the sentence saying which and why; None when no request spans files)."""
    trip = np.unique(np.stack([request, layer, fileno], axis=1), axis=0)
    pairs, counts = np.unique(trip[:, :2], axis=0, return_counts=True)
    if not (counts > 1).any():
        return False, None
    r, lay = (int(x) for x in pairs[np.argmax(counts > 1)])
    files = [srcs[int(f)].name for f in trip[(trip[:, 0] == r) & (trip[:, 1] == lay), 2][:2]]
    who = f"request {r}" if have_request else "the log (no request column)"
    if step is not None and _first_duplicate(np.stack([request, step, layer], axis=1)) is None:
        return False, (f"{who} routes layer {lay} in both {files[0]} and {files[1]} with no position repeated: the "
                       "files are read as one log continued (--request-per-file if each file is a request)")
    why = "the same positions" if step is not None else "no token column to tell them apart"
    return True, (f"{who} routes layer {lay} in both {files[0]} and {files[1]} with {why}: each file's "
                  + ("request ids are taken as its own (numbered again 0.. in file order)" if have_request
                     else "rows are taken as its own request (numbered in file order)")
                  + " (--request-per-file says each file is one request)")


def _passes_from_restarts(srcs: list[Path], fileno: np.ndarray, rowno: np.ndarray, request: np.ndarray,
                          layer: np.ndarray, step: np.ndarray, tcol: str,
                          have_request: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """A token column that restarts within one request and layer counts positions within each
    forward pass (a hook's index into its pass): the first pass (positions 0..P-1) is the prompt,
    each later pass one decoded token at position 0. Read so: steps 0..P-1 for the prompt, P, P+1,
    ... for the decoded tokens in file order. Any other restart (a second multi-position pass, or
    one not from 0: another request, speculative decoding?) is refused, naming what says it.
    Returns (step, pass index within the request, prefill mask, the sentence)."""
    n = step.size
    order = np.lexsort((np.arange(n), layer, request))
    s, r, lay = step[order], request[order], layer[order]
    new_group = np.concatenate([[True], (r[1:] != r[:-1]) | (lay[1:] != lay[:-1])])
    new_seg = new_group | np.concatenate([[False], s[1:] <= s[:-1]])
    seg = np.cumsum(new_seg) - 1
    gstart_seg = np.maximum.accumulate(np.where(new_group, seg, 0))
    pass_ = seg - gstart_seg
    seg_len = np.bincount(seg)
    first_of_seg = np.flatnonzero(new_seg)
    bad = np.zeros(n, bool)
    bad[first_of_seg] = (pass_[first_of_seg] == 0) & (s[first_of_seg] != 0)  # the first pass starts at 0
    later = pass_ > 0
    bad |= later & ((seg_len[seg] != 1) | (s != 0))  # every later pass: one position, 0
    if bad.any():
        i = int(order[np.argmax(bad)])
        raise UserError(f"{srcs[fileno[i]]}: row {rowno[i]}: routes token {int(step[i])} of layer {int(layer[i])}"
                        f"{f' of request {int(request[i])}' if have_request else ''} a second time, and the token "
                        f"column {tcol!r} does not restart as a prompt pass followed by one-token passes would; if "
                        "it begins another request, name the request column with --map request=COLUMN or give "
                        "--request-per-file.")
    plen = seg_len[gstart_seg]  # the prompt pass's length, per row
    new_step = np.where(later, plen + pass_ - 1, s)
    per_req = {}
    for rr, pl in zip(r[new_group], plen[new_group]):
        if per_req.setdefault(int(rr), int(pl)) != int(pl):
            raise UserError(f"{srcs[0]}: the token column {tcol!r} restarts after {per_req[int(rr)]} positions at one "
                            f"layer and after {int(pl)} at another{f' (request {int(rr)})' if have_request else ''}; "
                            "say where the prompt ends with --prompt-tokens N.")
    out_step = np.empty(n, np.int64)
    out_pass = np.empty(n, np.int64)
    out_step[order], out_pass[order] = new_step, pass_
    prefill = out_pass == 0
    npass = {int(rr): int(p) for rr, p in zip(r, pass_)}
    ex = "; ".join(f"{'request ' + str(rr) + ': ' if have_request else ''}positions 0..{pl - 1} in one pass then "
                   f"{npass.get(rr, 0)} one-position pass(es)" for rr, pl in list(per_req.items())[:3])
    more = f" (and {len(per_req) - 3} more requests)" if len(per_req) > 3 else ""
    said = (f"the token column {tcol} restarts at 0 (a position within each forward pass): {ex}{more}; the first pass "
            "taken as the prompt (prefill) and each later pass as one decoded token at the next position "
            "(--prompt-tokens N or --phase to say otherwise)")
    return out_step, out_pass, prefill, said


def _phase_from_batches(srcs: list[Path], fileno: np.ndarray, rowno: np.ndarray, request: np.ndarray, batch: np.ndarray,
                        layer: np.ndarray, step: np.ndarray, have_request: bool) -> tuple[np.ndarray, str]:
    """The phase of a log that states its forward passes but not the phase: a pass that routes many
    positions of one request at a layer is that request's prompt (prefill); one-position passes are
    decode. A multi-position pass after a one-position pass of the same request (a second prompt,
    speculative decoding?) is ambiguous: refused, naming the options that settle it."""
    trip, cnt = np.unique(np.stack([request, batch, layer], axis=1), axis=0, return_counts=True)
    rb = {}
    for (rr, bb, _), c in zip(trip.tolist(), cnt.tolist()):
        rb[(rr, bb)] = max(rb.get((rr, bb), 0), c)
    prefill_pairs: set[tuple[int, int]] = set()
    single_seen: set[int] = set()
    for (rr, bb), c in sorted(rb.items()):
        if c > 1:
            if rr in single_seen:
                i = int(np.argmax((request == rr) & (batch == bb)))
                raise UserError(f"{srcs[fileno[i]]}: row {rowno[i]}: batch {bb} holds {c} positions of "
                                f"{'request ' + str(rr) if have_request else 'the log'} after one-position batches, so "
                                "the batches do not say where the prompt ends; give --prompt-tokens N (or a column), "
                                "or --phase.")
            prefill_pairs.add((rr, bb))
        else:
            single_seen.add(rr)
    if not prefill_pairs:
        return (np.full(step.size, PHASE_DECODE, dtype=np.int64),
                "no phase column: every forward pass (batch) holds one position per request, so every routing counts "
                "as decode (--phase prefill, or --prompt-tokens N, says otherwise)")
    key = request * (1 << 32) + batch
    pre_keys = np.array([rr * (1 << 32) + bb for rr, bb in sorted(prefill_pairs)], dtype=np.int64)
    pre = np.isin(key, pre_keys)
    ex = []
    for rr, bb in sorted(prefill_pairs)[:3]:
        m = (request == rr) & (batch == bb)
        ex.append(f"{'request ' + str(rr) + ': ' if have_request else ''}batch {bb} holds positions "
                  f"{int(step[m].min())}..{int(step[m].max())}")
    more = f" (and {len(prefill_pairs) - 3} more)" if len(prefill_pairs) > 3 else ""
    return (np.where(pre, PHASE_PREFILL, PHASE_DECODE).astype(np.int64),
            f"no phase column: a forward pass (batch) holding many positions of a request is taken as its prompt "
            f"(prefill), one-position passes as decode: {'; '.join(ex)}{more} "
            "(--phase or --prompt-tokens N to say otherwise)")


def _first_duplicate(keys: np.ndarray) -> int | None:
    order = np.lexsort(keys.T[::-1])
    srt = keys[order]
    same = np.flatnonzero((srt[1:] == srt[:-1]).all(axis=1))
    return int(order[same[0] + 1]) if same.size else None


def _sequential_batches(request: np.ndarray, phase: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Batches one request after another (in order of first appearance): its prompt rows one batch,
    each decoded position its own batch."""
    rorder = _first_seen_rank(request)
    bstep = np.where(phase == PHASE_PREFILL, -1, step)
    key = np.stack([rorder, phase, bstep], axis=1)
    return unique_rows(key)[1]

