"""Streaming trace writer (format v1).

Rows are buffered and written as numbered Parquet part files, each closed (and renamed into
place) as soon as it is written, so an interrupted capture loses at most the rows not yet flushed.
``trace.json`` is written atomically first with ``complete: false`` and rewritten with
``complete: true`` only by :meth:`TraceWriter.close`.
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

from traces.atomic import atomic_write_bytes, atomic_write_text
from traces.errors import UserError
from traces.schema import (
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
    routings_schema,
    validate_meta,
)

PARQUET_OPTS = {"compression": "zstd", "use_dictionary": False, "write_statistics": True}
# Wide float columns (logits, gate_input) are written uncompressed: zstd saves ~8% on float noise
# but triples decode time, and decoding gate inputs is what bounds stale-gate on long traces.
# Row groups of ~32 MiB let readers decode one part on several threads.
ROW_GROUP_BYTES = 32 << 20


def _leaf(f: pa.Field) -> str:
    """The Parquet column path of ``f``: per-column options name leaves, and a list's values are
    ``name.list.element`` (an option keyed by the bare list name silently does not apply)."""
    return f"{f.name}.list.element" if pa.types.is_fixed_size_list(f.type) else f.name


def routings_write_options(schema: pa.Schema) -> dict:
    """Parquet options for a routings part: per-column compression and a row-group size."""
    comp = {_leaf(f): ("none" if f.name in WIDE_COLUMNS else "zstd") for f in schema}
    row_bytes = 0
    for f in schema:
        t = f.type
        row_bytes += (t.list_size * t.value_type.bit_width // 8) if pa.types.is_fixed_size_list(t) else t.bit_width // 8
    # Min/max statistics of float noise prune nothing and add a header field per page; 8 MiB pages
    # (default 1 MiB) mean 8x fewer page headers for readers to parse (traces.pages).
    stats = [_leaf(f) for f in schema if f.name not in WIDE_COLUMNS]
    return {"compression": comp, "use_dictionary": False, "write_statistics": stats, "data_page_size": 8 << 20,
            "row_group_size": max(1024, ROW_GROUP_BYTES // max(1, row_bytes))}


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


class TraceWriter:
    """Write a v1 trace into an existing, empty directory ``out_dir``.

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
        self.schema = routings_schema(self.meta, self.columns, gate_input_dtype)
        self._write_opts = routings_write_options(self.schema)
        self._weights_checked = weights_checked
        self.k = self.meta["model"]["top_k"]
        self.rows_per_part = max(1, tokens_per_part * len(self.meta["model"]["moe_layers"]))
        self._buf: list[pa.RecordBatch] = []
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
        arrays.append(_fixed_list(experts.astype(np.int32, copy=False), self.k, pa.int32()))
        arrays.append(_fixed_list(weights, self.k, pa.float32()))
        for field in list(self.schema)[len(arrays):]:
            if field.name in REQUEST_COLUMNS:  # per-row scalars (scalars broadcast, as the key columns)
                arrays.append(pa.array(scalars[field.name], type=field.type))
                continue
            typ = field.type.value_type
            vals = np.asarray(optional[field.name]).astype(typ.to_pandas_dtype(), copy=False)
            arrays.append(_fixed_list(vals, field.type.list_size, typ))
        self._buf.append(pa.RecordBatch.from_arrays(arrays, schema=self.schema))
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
        table = pa.Table.from_batches(self._buf, schema=self.schema)
        write_parquet_atomic(table, self.dir / ROUTINGS_DIR / f"part-{self._part:05d}.parquet", self._write_opts)
        self._part += 1
        self.rows_written += self._buffered
        self._buf, self._buffered = [], 0

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
        # The matrices uncompressed, like the other wide columns: read by the raw-page fast path.
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
