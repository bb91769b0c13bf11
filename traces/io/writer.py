"""Streaming trace writer (format version 2, ``docs/format.md``).

Rows are buffered and written as numbered part files, each closed (and renamed into place) as
soon as it is written, so an interrupted capture loses at most the rows not yet flushed: a
Parquet file of the narrow columns, one primitive column per slot (``expert_0..``), and beside
it, for each wide column (logits, gate_input), an Arrow IPC file (``part-00000.logits.arrow``)
written before the Parquet file, so a part that exists has its wide files. ``trace.json`` is
written atomically first with ``complete: false`` and rewritten with ``complete: true`` only by
:meth:`TraceWriter.close`.
"""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from traces.format.errors import UserError
from traces.format.schema import (
    FORMAT,
    KEY_COLUMNS,
    METRICS_FILE,
    OPTIONAL_COLUMNS,
    REQUEST_COLUMNS,
    ROUTER_FILE,
    ROUTINGS_DIR,
    TRACE_JSON,
    VERSION,
    WIDE_COLUMNS,
    part_schema,
    routings_schema,
    slot_names,
    validate_meta,
    wide_file,
    wide_schemas,
)
from traces.io.atomic import atomic_write_bytes, atomic_write_text

PARQUET_OPTS = {"compression": "zstd", "use_dictionary": False, "write_statistics": True}
# Version 2 parts: every column LZ4 (Parquet's LZ4_RAW), PLAIN, no dictionary, no statistics, one
# row group per part. Measured on the 4.8 M-routing top-1 trace (benchmarks/RESULTS.md, "Trace
# format v2"): pyarrow reads all seven routing columns in about half the time of version 1's
# zstd'd lists, the scalars at memory speed; zstd decodes 2-4x slower for ~40% smaller files,
# dictionaries and delta encodings decoded no faster.
PART_OPTS = {"compression": "lz4", "use_dictionary": False, "write_statistics": False}


def write_part(table: pa.Table, path: Path) -> None:
    """A version 2 Parquet part (``table`` in :func:`traces.format.schema.part_schema`), written atomically."""
    write_parquet_atomic(table, path, {**PART_OPTS, "row_group_size": max(1, table.num_rows)})


def write_wide(array: pa.Array, field: pa.Field, path: Path) -> None:
    """One wide column as a version 2 Arrow IPC file (uncompressed, one record batch: read
    memory-mapped, its values are the file's bytes), written atomically."""
    sink = pa.BufferOutputStream()
    schema = pa.schema([field])
    with pa.ipc.new_file(sink, schema) as w:
        w.write_batch(pa.record_batch([array], schema=schema))
    atomic_write_bytes(path, sink.getvalue().to_pybytes())


def split_slots(table: pa.Table, meta: dict[str, Any], columns: tuple[str, ...]) -> tuple[pa.Table, dict[str, pa.Array]]:
    """A table of logical routing columns (:func:`traces.format.schema.routings_schema`) as version 2
    stores it: the Parquet part (each per-slot list split into one column per slot) and the wide
    columns, one array each."""
    schema = part_schema(meta, columns)
    k = meta["model"]["top_k"]
    arrays: list[pa.Array] = []
    for name in table.column_names:
        if name in WIDE_COLUMNS:
            continue
        col = table.column(name).combine_chunks()
        if pa.types.is_fixed_size_list(col.type):
            flat = col.values.slice(col.offset * k, len(col) * k) if col.null_count == 0 else col.flatten()
            if k == 1:
                arrays.append(flat)
            else:
                v = flat.to_numpy(zero_copy_only=False).reshape(-1, k)
                arrays += [pa.array(np.ascontiguousarray(v[:, j]), type=col.type.value_type) for j in range(k)]
        else:
            arrays.append(col)
    wide = {name: table.column(name).combine_chunks() for name in table.column_names if name in WIDE_COLUMNS}
    return pa.Table.from_arrays(arrays, schema=schema), wide


def _leaf(f: pa.Field) -> str:
    """The Parquet column path of ``f``: per-column options name leaves, and a list's values are
    ``name.list.element`` (an option keyed by the bare list name silently does not apply)."""
    return f"{f.name}.list.element" if pa.types.is_fixed_size_list(f.type) else f.name


def dump_meta(meta: dict[str, Any]) -> str:
    """Canonical JSON for trace.json: sorted keys, fixed indentation (byte-identical reruns)."""
    return json.dumps(meta, indent=1, sort_keys=True, allow_nan=False) + "\n"


def write_parquet_atomic(table: pa.Table, path: Path, options: dict | None = None) -> None:
    buf = io.BytesIO()
    pq.write_table(table, buf, **(options or PARQUET_OPTS))
    atomic_write_bytes(path, buf.getvalue())


def _fixed_list(values: np.ndarray, width: int, typ: pa.DataType) -> pa.Array:
    values = np.ascontiguousarray(values)
    if values.ndim != 2 or values.shape[1] != width:
        raise ValueError(f"expected a [rows, {width}] array, got shape {values.shape}")
    flat = pa.array(values.reshape(-1), type=typ)
    return pa.FixedSizeListArray.from_arrays(flat, width)


def _slot_arrays(arrays: list[pa.Array], values: np.ndarray, k: int, name: str) -> None:
    """Append the ``k`` slot columns of ``values`` ``[rows, k]`` to ``arrays``."""
    if values.ndim != 2 or values.shape[1] != k:
        raise ValueError(f"{name}: expected a [rows, {k}] array, got shape {values.shape}")
    for j in range(k):
        arrays.append(pa.array(np.ascontiguousarray(values[:, j])))


class TraceWriter:
    """Write a version 2 trace into an existing, empty directory ``out_dir``.

    ``meta`` is the trace.json content without ``format``/``version``/``complete``/``columns``
    (the writer sets those). ``columns`` names the optional per-row columns that every
    :meth:`append` will supply. ``tokens_per_part`` sets how many tokens' rows (rows / number of
    MoE layers) a part file holds before it is closed. ``weights_checked``: the caller refuses,
    before every :meth:`append`, each weight the writer would (the synthetic generator's
    one-pass check of its own rows), so the writer does not check them again; logits are still
    checked.
    """

    def __init__(
        self,
        out_dir: str | Path,
        meta: dict[str, Any],
        columns: tuple[str, ...] = (),
        gate_input_dtype: str = "float32",
        tokens_per_part: int = 1024,
        weights_checked: bool = False,
    ) -> None:
        unknown = [c for c in columns if c not in OPTIONAL_COLUMNS]
        if unknown:
            raise ValueError(f"unknown optional columns {unknown}")
        self.dir = Path(out_dir)
        self.meta = copy.deepcopy(meta)
        self.meta.update(format=FORMAT, version=VERSION, complete=False, columns=list(columns))
        if "gate_input" in columns:
            self.meta["gate_input_dtype"] = gate_input_dtype
        problems = validate_meta(self.meta, TRACE_JSON)
        if problems:
            raise ValueError(f"invalid trace metadata: {problems[0]}")
        self.columns = tuple(columns)
        self.schema = routings_schema(self.meta, self.columns, gate_input_dtype)  # the logical columns
        self._part_schema = part_schema(self.meta, self.columns)
        self._wide_schemas = wide_schemas(self.meta, self.columns, gate_input_dtype)
        self._weights_checked = weights_checked
        self.k = self.meta["model"]["top_k"]
        self.rows_per_part = max(1, tokens_per_part * len(self.meta["model"]["moe_layers"]))
        self._buf: list[pa.RecordBatch] = []
        self._wide_buf: dict[str, list[pa.Array]] = {c: [] for c in self._wide_schemas}
        self._buffered = 0
        self._part = 0
        self._last_key: tuple[int, ...] | None = None
        self.rows_written = 0
        self._closed = False
        (self.dir / ROUTINGS_DIR).mkdir(parents=True, exist_ok=True)
        self._write_meta()

    # -- metadata -------------------------------------------------------------------------
    def _write_meta(self) -> None:
        atomic_write_text(self.dir / TRACE_JSON, dump_meta(self.meta))

    def update_meta(self, **fields: Any) -> None:
        """Set top-level trace.json fields (e.g. ``recorded``, ``checks``) and rewrite it."""
        self.meta.update(copy.deepcopy(fields))
        self._write_meta()

    # -- rows -------------------------------------------------------------------------------
    def append(self, *, turn, batch, phase, step, layer, experts, weights, **optional) -> None:
        """Append rows (already in (batch, layer, step) order, continuing the previous ones).

        Scalars among ``turn``/``batch``/``phase``/``step``/``layer`` are broadcast.
        ``experts``/``weights`` are ``[R, top_k]``; each optional column the writer was opened
        with must be given as a 2-D array.
        """
        if self._closed:
            raise RuntimeError("writer is closed")
        experts = np.asarray(experts)
        if experts.ndim != 2:
            raise ValueError("experts must be [rows, top_k]")
        n = experts.shape[0]
        if n == 0:
            return
        keys = {"turn": turn, "batch": batch, "phase": phase, "step": step, "layer": layer}
        arrays: list[pa.Array] = []
        cols: dict[str, np.ndarray] = {}
        for name, typ in KEY_COLUMNS.items():
            v = np.broadcast_to(np.asarray(keys[name]), (n,)).astype(typ.to_pandas_dtype())
            cols[name] = v
            arrays.append(pa.array(v, type=typ))
        weights = np.asarray(weights, dtype=np.float32)
        self._check_values(weights, optional.get("logits"))
        missing = [c for c in self.columns if c not in optional]
        extra = [c for c in optional if c not in self.columns]
        if missing or extra:
            raise ValueError(f"append: missing columns {missing}, unexpected columns {extra}")
        # request / token checked before the order check (which advances the last key): a refused
        # append leaves the writer as it was.
        scalars = {c: self._scalar_column(c, np.broadcast_to(np.asarray(optional[c]), (n,)))
                   for c in REQUEST_COLUMNS if c in self.columns and c in optional}
        self._check_order(cols["batch"], cols["layer"], cols["step"], scalars.get("request"))
        for name, values in (("experts", experts.astype(np.int32, copy=False)), ("weights", weights)):
            _slot_arrays(arrays, values, self.k, name)
        for name in self.columns:
            if name in REQUEST_COLUMNS:  # per-row scalars (scalars broadcast, as the key columns)
                arrays.append(pa.array(scalars[name], type=REQUEST_COLUMNS[name]))
            elif name in WIDE_COLUMNS:
                typ = self._wide_schemas[name].field(name).type
                vals = np.asarray(optional[name]).astype(typ.value_type.to_pandas_dtype(), copy=False)
                self._wide_buf[name].append(_fixed_list(vals, typ.list_size, typ.value_type))
            else:  # a recorded per-slot column
                typ = self._part_schema.field(slot_names(name, self.k)[0]).type
                _slot_arrays(arrays, np.asarray(optional[name]).astype(typ.to_pandas_dtype(), copy=False), self.k, name)
        self._buf.append(pa.RecordBatch.from_arrays(arrays, schema=self._part_schema))
        self._buffered += n
        if self._buffered >= self.rows_per_part:
            self.flush()

    def _check_values(self, weights: np.ndarray, logits: np.ndarray | None) -> None:
        """Refuse rows no reader would accept, before they reach a file: weights infinite, negative
        or only partly NaN (NaN = the engine exposed none, for a whole routing), logits not finite."""
        w = weights.reshape(weights.shape[0], -1)
        if self._weights_checked:
            w = w[:0]
        nan = np.isnan(w)
        with np.errstate(invalid="ignore"):
            bad = np.isinf(w).any(axis=1) | (w < 0).any(axis=1) | (nan.any(axis=1) & ~nan.all(axis=1))
        if bad.any():
            i = int(np.argmax(bad))
            raise UserError(f"{self.dir}: appended row {self.rows_written + self._buffered + i} has weights "
                            f"{w[i].tolist()}: infinite, negative or only partly NaN; refused before writing it.")
        if logits is not None:
            lg = np.asarray(logits, dtype=np.float32)
            fin = np.isfinite(lg).reshape(lg.shape[0], -1).all(axis=1)
            if not fin.all():
                i = int(np.argmin(fin))
                raise UserError(f"{self.dir}: appended row {self.rows_written + self._buffered + i} has logits that are NaN "
                                "or infinite; refused before writing it.")

    def _scalar_column(self, name: str, vals: np.ndarray) -> np.ndarray:
        """``request`` / ``token`` values checked against their column type (one sentence, nothing written)."""
        v = np.asarray(vals)
        if not (np.issubdtype(v.dtype, np.integer) or v.size == 0):
            raise UserError(f"{self.dir}: appended {name} values are {v.dtype}, not integers; refused before writing them.")
        if name == "token" and v.size and (v.min() < 0 or v.max() > np.iinfo(np.int32).max):
            i = int(np.argmax((v < 0) | (v > np.iinfo(np.int32).max)))
            raise UserError(f"{self.dir}: appended row {self.rows_written + self._buffered + i} has token id {v[i]}, "
                            "outside 0..2^31-1; refused before writing it.")
        return v.astype(REQUEST_COLUMNS[name].to_pandas_dtype())

    def _check_order(self, batch: np.ndarray, layer: np.ndarray, step: np.ndarray, request: np.ndarray | None = None) -> None:
        """Rows must continue the (batch, layer, step) order -- (batch, layer, request, step) when
        the trace has a request column (several requests share a batch and may share a step)."""
        keys = [batch.astype(np.int64), layer.astype(np.int64)] + ([request] if request is not None else []) + [step.astype(np.int64)]
        if self._last_key is not None:
            keys = [np.concatenate([[last], k]) for last, k in zip(self._last_key, keys)]
        ok = np.zeros(keys[0].size - 1, dtype=bool)
        tied = np.ones(keys[0].size - 1, dtype=bool)
        for k in keys:  # comparisons, not np.diff: request ids may span the whole int64 range
            ok |= tied & (k[1:] > k[:-1])
            tied &= k[1:] == k[:-1]
        if not ok.all():
            i = int(np.argmin(ok))
            what = "(batch, layer, request, step)" if request is not None else "(batch, layer, step)"
            raise ValueError(f"rows out of {what} order at appended row {i}")
        self._last_key = tuple(int(k[-1]) for k in keys)

    def flush(self) -> None:
        """Close the buffered rows as the next part file (no-op when nothing is buffered)."""
        if not self._buf:
            return
        part = self.dir / ROUTINGS_DIR / f"part-{self._part:05d}.parquet"
        for name, chunks in self._wide_buf.items():  # first: a part that exists has its wide files
            write_wide(pa.concat_arrays(chunks), self._wide_schemas[name].field(name), wide_file(part, name))
        write_part(pa.Table.from_batches(self._buf, schema=self._part_schema), part)
        self._part += 1
        self.rows_written += self._buffered
        self._buf, self._buffered = [], 0
        self._wide_buf = {c: [] for c in self._wide_schemas}

    # -- side tables ------------------------------------------------------------------------
    def write_router(self, layer: np.ndarray, expert: np.ndarray, weight: np.ndarray, bias: np.ndarray,
                     logit_bias: np.ndarray | None = None) -> None:
        """router.parquet: one row per (layer, expert), ``weight`` ``[R, n_embd]`` f32, ``bias`` f32
        (selection bias), and, where the router adds one to its logits (gpt-oss), ``logit_bias`` f32."""
        n_embd = self.meta["model"]["n_embd"]
        cols = {
            "layer": pa.array(np.asarray(layer, dtype=np.int16)),
            "expert": pa.array(np.asarray(expert, dtype=np.int32)),
            "weight": _fixed_list(np.asarray(weight, dtype=np.float32), n_embd, pa.float32()),
            "bias": pa.array(np.asarray(bias, dtype=np.float32)),
        }
        if logit_bias is not None:
            cols["logit_bias"] = pa.array(np.asarray(logit_bias, dtype=np.float32))
        table = pa.table(cols)
        # The matrices uncompressed (float noise: zstd saves little and decodes slowly); the same in both versions.
        write_parquet_atomic(table, self.dir / ROUTER_FILE, {**PARQUET_OPTS, "compression": {
            _leaf(f): ("none" if f.name == "weight" else "zstd") for f in table.schema}})

    def write_metrics(self, table: pa.Table) -> None:
        """metrics.parquet: the engine's own per-token metrics, one row per decoded token."""
        write_parquet_atomic(table, self.dir / METRICS_FILE)

    # -- lifecycle --------------------------------------------------------------------------
    def close(self, complete: bool = True) -> None:
        """Flush the last part and write trace.json with the final ``complete`` flag."""
        if self._closed:
            return
        self.flush()
        self.meta["complete"] = bool(complete)
        self.meta["rows"] = self.rows_written
        self._write_meta()
        self._closed = True

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # On an exception the rows so far stay readable, marked incomplete.
        self.close(complete=exc_type is None)
