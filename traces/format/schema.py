"""Trace format (version 2; version 1 still read): the metadata (``trace.json``) and the Arrow
schemas of the logical routing columns and of version 2's files.

See ``docs/format.md``. This module knows the contract and checks it; it does no I/O beyond what
the caller hands it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from traces.format.meta import (  # noqa: F401 (re-exported: the plain-Python half of the contract lives in traces.format.meta)
    ACTIVATIONS,
    FORMAT,
    KEY_TYPES,
    MAX_BUDGET_MIB,
    MAX_BYTES,
    MAX_INT32,
    MAX_LAYERS,
    METRICS_FILE,
    OPTIONAL_COLUMNS,
    PHASE_DECODE,
    PHASE_NAMES,
    PHASE_PREFILL,
    READ_VERSIONS,
    RECORDED_TYPES,
    REQUEST_TYPES,
    RES_HIT,
    RES_HIT_SPEC,
    RES_MISS,
    ROUTER_FILE,
    ROUTINGS_DIR,
    SLOT_STEMS,
    TRACE_JSON,
    VERSION,
    WIDE_COLUMNS,
    _is_int,
    _is_num,
    default_gating,
    part_fields,
    routing_fields,
    slot_names,
    validate_meta,
    wide_fields,
)


def arrow_type(t: tuple) -> pa.DataType:
    """A :mod:`traces.format.meta` type tuple as the Arrow type."""
    if t[0] == "int":
        return getattr(pa, f"{'' if t[2] else 'u'}int{t[1]}")()
    if t[0] == "float":
        return {16: pa.float16(), 32: pa.float32(), 64: pa.float64()}[t[1]]
    if t[0] == "bool":
        return pa.bool_()
    if t[0] == "fixed_size_list":
        return pa.list_(arrow_type(t[2]), t[1])
    raise ValueError(f"unknown type {t!r}")


# Narrow per-row columns: always present, always loaded.
KEY_COLUMNS: dict[str, pa.DataType] = {name: arrow_type(t) for name, t in KEY_TYPES.items()}
# Optional per-slot columns recorded by an engine (width top_k).
RECORDED_COLUMNS: dict[str, pa.DataType] = {name: arrow_type(t) for name, t in RECORDED_TYPES.items()}
# Optional per-row scalars of server engines that batch many requests: the request (sequence) a
# row's token belongs to, and the token id at that position. With ``request``, ``step`` is the
# position inside its request and rows are ordered (batch, layer, request, step).
REQUEST_COLUMNS: dict[str, pa.DataType] = {name: arrow_type(t) for name, t in REQUEST_TYPES.items()}


def routings_schema(meta: dict[str, Any], columns: tuple[str, ...] = (), gate_input_dtype: str = "float32") -> pa.Schema:
    """The Arrow schema of ``routings/`` for a trace with metadata ``meta`` and optional ``columns``
    (:func:`traces.format.meta.routing_fields` as Arrow fields, none nullable)."""
    return pa.schema([pa.field(name, arrow_type(t), nullable=False) for name, t in routing_fields(meta, columns, gate_input_dtype)])


def part_schema(meta: dict[str, Any], columns: tuple[str, ...] = ()) -> pa.Schema:
    """The Arrow schema of a version 2 ``routings/part-NNNNN.parquet`` (:func:`traces.format.meta.part_fields`,
    none nullable)."""
    return pa.schema([pa.field(name, arrow_type(t), nullable=False) for name, t in part_fields(meta, columns)])


def wide_schemas(meta: dict[str, Any], columns: tuple[str, ...] = (), gate_input_dtype: str = "float32") -> dict[str, pa.Schema]:
    """{wide column: the Arrow schema of its version 2 ``part-NNNNN.<column>.arrow`` file} (one
    non-null fixed_size_list column named like the file)."""
    return {name: pa.schema([pa.field(name, arrow_type(t), nullable=False)])
            for name, t in wide_fields(meta, columns, gate_input_dtype)}


def wide_file(part: Path, column: str) -> Path:
    """The Arrow IPC file of wide ``column`` beside version 2 part ``part`` (``part-00000.logits.arrow``)."""
    return part.with_name(f"{part.name.removesuffix('.parquet')}.{column}.arrow")


ROUTER_SCHEMA_BASE = {"layer": pa.int16(), "expert": pa.int32(), "bias": pa.float32()}


# Engine metrics (metrics.parquet, .metrics files): per-token times above one day are not a
# measurement; read bytes above 1 PiB per token neither.
METRICS_MAX_MS = 86_400_000.0
METRICS_MAX_BYTES = float(1 << 50)
METRICS_TIME_COLUMNS = ("wall_ms", "io_ms", "compute_ms", "stall_ms", "mgmt_ms", "cpu_ms")


def metrics_value_problem(column: str, value: float) -> str | None:
    """Why one value of an engine metrics column is not a plausible measurement, or None."""
    if not math.isfinite(value):
        return f"{column} is not finite"
    if value < 0:
        return f"{column} {value:g} is negative"
    if column in METRICS_TIME_COLUMNS and value > METRICS_MAX_MS:
        return f"{column} {value:g} ms is more than a day per token"
    if column == "read_bytes" and value > METRICS_MAX_BYTES:
        return f"read_bytes {value:g} is more than 1 PiB per token"
    if column == "cache_hit_pct" and value > 100:
        return f"cache_hit_pct {value:g} is above 100"
    if column in ("step", "steps") and (value != int(value) or value > MAX_INT32):
        return f"{column} {value:g} is not a token count"
    return None


def metrics_first_problem(column: str, values: np.ndarray) -> tuple[int, str] | None:
    """(row, problem) of the first implausible value of a metrics column, or None."""
    v = np.asarray(values, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        suspect = ~np.isfinite(v) | (v < 0)
        if column in METRICS_TIME_COLUMNS:
            suspect |= v > METRICS_MAX_MS
        elif column == "read_bytes":
            suspect |= v > METRICS_MAX_BYTES
        elif column == "cache_hit_pct":
            suspect |= v > 100
        elif column in ("step", "steps"):
            suspect |= (v != np.floor(v)) | (v > MAX_INT32)
    for i in np.flatnonzero(suspect):
        problem = metrics_value_problem(column, float(v[i]))
        if problem:
            return int(i), problem
    return None
