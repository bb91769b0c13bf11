"""Trace reader: validates a trace (format version 2, or 1) on open and hands back frames and
dense arrays.

Nothing downstream ever sees a half-valid trace: :func:`open_trace` checks the metadata, every
part file's schema (and, in version 2, each wide column's Arrow IPC file: its schema and row
count) and the row-level invariants (ids in range, distinct inside a routing, layers that are MoE
layers, row order, one phase per batch) before it returns. Wide columns (logits, gate_input) are
never read unless a caller names them.

Whatever the version, a part is handed out as the *logical* columns (``experts`` ``[rows, k]``
and so on, :func:`traces.format.schema.routings_schema`): version 2's slot columns are joined (for top-1
without a copy), its wide columns mapped from their IPC files. Every read goes through pyarrow.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from traces.format.errors import TraceError
from traces.format.schema import (
    METRICS_FILE,
    PHASE_DECODE,
    PHASE_PREFILL,
    RECORDED_COLUMNS,
    REQUEST_COLUMNS,
    ROUTER_FILE,
    ROUTINGS_DIR,
    SLOT_STEMS,
    TRACE_JSON,
    WIDE_COLUMNS,
    metrics_first_problem,
    part_schema,
    routings_schema,
    slot_names,
    validate_meta,
    wide_file,
    wide_schemas,
)
from traces.io.atomic import note_input
from traces.util.bounded_json import BoundsError, parse_bounded

if TYPE_CHECKING:
    import polars as pl

NARROW = ("turn", "batch", "phase", "step", "layer", "experts", "weights")


@dataclass(frozen=True)
class RoutingArrays:
    """Dense per-row arrays ready for the Numba kernels (R rows, k slots).

    ``experts``/``weights`` are ``[R, k]`` in router rank order; the recorded per-slot columns
    are ``None`` when the trace has none.
    """

    turn: np.ndarray  # int32 [R]
    batch: np.ndarray  # int32 [R]
    phase: np.ndarray  # int8 [R]  0 prefill, 1 decode
    step: np.ndarray  # int32 [R] absolute context position
    layer: np.ndarray  # int16 [R]
    experts: np.ndarray  # int32 [R, k]
    weights: np.ndarray  # float32 [R, k], NaN where the engine exposed none
    residency: np.ndarray | None = None  # uint8 [R, k]
    read_bytes: np.ndarray | None = None  # uint32 [R, k]
    dropped: np.ndarray | None = None  # bool [R, k]
    request: np.ndarray | None = None  # int64 [R]: the request of each row; None = one request
    token: np.ndarray | None = None  # int32 [R]: the token id at that position, when recorded

    @property
    def n_rows(self) -> int:
        return int(self.batch.shape[0])

    @property
    def request_or_zero(self) -> np.ndarray:
        """int64 [R]: the request column, or zeros for a trace of one request. Everything
        "previous" (prev-token, a token's identity) is keyed by it: with many requests in one
        batch, ``step`` is the position inside its request and repeats across requests."""
        return self.request if self.request is not None else np.zeros(self.batch.shape[0], dtype=np.int64)


def fixed_list_to_numpy(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A fixed_size_list column as a 2-D numpy array (zero-copy where Arrow allows)."""
    if isinstance(col, pa.ChunkedArray):
        width = col.type.list_size
        if col.num_chunks == 0:
            return np.empty((0, width), dtype=col.type.value_type.to_pandas_dtype())
        chunks = [fixed_list_to_numpy(c) for c in col.chunks]
        return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
    width = col.type.list_size
    if col.null_count == 0 and col.values.null_count == 0:
        # The child values of this slice, without Arrow's compute layer (flatten() imports
        # pyarrow.compute, ~30 ms of a short command's start).
        flat = col.values.slice(col.offset * width, len(col) * width)
    else:
        flat = col.flatten()  # respects the array's offset
    arr = flat.to_numpy(zero_copy_only=False)
    return arr.reshape(-1, width)


def read_part(part: Path, columns: list[str], threads: bool = True) -> pa.Table:
    """``columns`` of one Parquet file as an Arrow table (pyarrow's reader).

    A file whose footer is intact but whose data pages are not (a bad compressed frame, a cut page)
    is only found out here, at the first read: that is a :class:`TraceError` naming the file."""
    try:
        return pq.ParquetFile(part).read(columns=columns, use_threads=threads).select(columns)
    except (pa.ArrowException, OSError, ValueError, EOFError) as e:
        raise _fail(part, f"has a corrupt or unreadable data page in column(s) {', '.join(columns)} ({_short(e)})") from None


def _one_chunk(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    if isinstance(col, pa.Array):
        return col
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()


def join_slots(slots: list[pa.ChunkedArray | pa.Array], typ: pa.DataType) -> pa.Array:
    """Version 2's slot columns (``expert_0 .. expert_{k-1}``) as the logical ``fixed_size_list[k]``
    ``typ``: for k = 1 the column itself (no copy), else one interleaving copy."""
    if len(slots) == 1:
        return pa.FixedSizeListArray.from_arrays(_one_chunk(slots[0]), type=typ)
    cols = [_one_chunk(c).to_numpy(zero_copy_only=False) for c in slots]
    values = np.empty((len(cols[0]), len(cols)), dtype=typ.value_type.to_pandas_dtype())
    for j, c in enumerate(cols):
        values[:, j] = c
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), type=typ.value_type), type=typ)


def read_wide(path: Path, field: pa.Field) -> pa.Array:
    """A version 2 wide column's Arrow IPC file, memory-mapped (its values are the file's bytes,
    nothing is decoded or copied), checked against ``field``; a :class:`TraceError` naming the file."""
    if not path.is_file():
        raise _fail(path, f"is missing (the part's {field.name} column)")
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(path)))
        schema = reader.schema
        if not (len(schema) == 1 and schema.field(0).equals(field)):
            got = ", ".join(f"{f.name} {f.type}{'' if f.nullable else ' not null'}" for f in schema)
            raise _fail(path, f"holds column(s) {got}, expected {field.name} {field.type} not null")
        batches = [reader.get_batch(i).column(0) for i in range(reader.num_record_batches)]
        arr = batches[0] if len(batches) == 1 else pa.concat_arrays(batches) if batches else pa.array([], field.type)
        arr.validate()
    except (pa.ArrowException, OSError, ValueError, EOFError) as e:
        raise _fail(path, f"is not a readable Arrow IPC file (truncated or corrupt: {_short(e)})") from None
    if arr.null_count:
        raise _fail(path, f"holds a null {field.name} row")
    return arr


class Trace:
    """An opened, validated trace directory (format version 1 or 2)."""

    def __init__(self, path: Path, meta: dict[str, Any], parts: list[Path], part_rows: list[int]) -> None:
        self.path = path
        self.meta = meta
        self.parts = parts
        self.part_rows = part_rows
        # Opened with defer_rows: the row invariants are not checked yet. Whatever reads rows
        # through table()/arrays()/routings()/distinct() checks them first; a reader that checks
        # each part as it reads it (replay.core.simulate.iter_load_parts) clears this after a whole pass.
        self.rows_pending = False

    def check_rows(self) -> None:
        """Check the row invariants now if :func:`open_trace` deferred them (a :class:`TraceError` naming the part)."""
        if self.rows_pending:
            _check_rows(self)

    # -- metadata shortcuts -------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The format version of the files (1 or 2; the writer writes 2)."""
        return int(self.meta["version"])

    @property
    def model(self) -> dict[str, Any]:
        return self.meta["model"]

    @property
    def n_expert(self) -> int:
        return int(self.model["n_expert"])

    @property
    def top_k(self) -> int:
        return int(self.model["top_k"])

    @property
    def n_layer(self) -> int:
        return int(self.model["n_layer"])

    @property
    def moe_layers(self) -> list[int]:
        return list(self.model["moe_layers"])

    @property
    def n_rows(self) -> int:
        return int(sum(self.part_rows))

    @property
    def columns(self) -> list[str]:
        return list(self.meta.get("columns", []))

    @property
    def complete(self) -> bool:
        return bool(self.meta["complete"])

    @property
    def gating(self) -> dict[str, Any]:
        return self.meta["gating"]

    def has(self, column: str) -> bool:
        return column in self.columns

    @property
    def has_router(self) -> bool:
        return (self.path / ROUTER_FILE).is_file()

    @property
    def has_metrics(self) -> bool:
        return (self.path / METRICS_FILE).is_file()

    @cached_property
    def expert_bytes(self) -> np.ndarray:
        """int64 [n_layer]: bytes to read one expert of each layer (0 for non-MoE layers)."""
        return np.array([v or 0 for v in self.meta["expert_bytes"]], dtype=np.int64)

    @property
    def token_cycle_bytes(self) -> int:
        """T: bytes of one token's full routing, sum over MoE layers of top_k x expert_bytes."""
        return int(sum(self.top_k * int(self.expert_bytes[l]) for l in self.moe_layers))

    @property
    def recorded(self) -> dict[str, Any]:
        """What the engine recorded about its own run (budget, hit rate), or {}."""
        return dict(self.meta.get("recorded") or {})

    # -- rows -------------------------------------------------------------------------------
    def logical_schema(self) -> pa.Schema:
        """The schema of the logical routing columns (:func:`traces.format.schema.routings_schema`)."""
        return routings_schema(self.meta, tuple(self.columns), self.meta.get("gate_input_dtype", "float32"))

    def read_part(self, i: int, columns: tuple[str, ...] | list[str], threads: bool = True) -> pa.Table:
        """The logical ``columns`` of part ``i`` as an Arrow table, whatever the version: a corrupt
        data page or wide file is a :class:`TraceError` naming the file."""
        columns = list(columns)
        part = self.parts[i]
        schema = self.logical_schema()
        if self.version == 1:
            return read_part(part, columns, threads)
        k = self.top_k
        phys: list[str] = []
        for c in columns:
            if c not in WIDE_COLUMNS:
                phys += slot_names(c, k) if c in SLOT_STEMS else [c]
        t = read_part(part, phys, threads) if phys else None
        arrays: list[pa.Array | pa.ChunkedArray] = []
        for c in columns:
            if c in WIDE_COLUMNS:
                arrays.append(self.wide(i, c))
            elif c in SLOT_STEMS:
                arrays.append(join_slots([t.column(n) for n in slot_names(c, k)], schema.field(c).type))  # type: ignore[union-attr]
            else:
                arrays.append(t.column(c))  # type: ignore[union-attr]
        return pa.Table.from_arrays(arrays, schema=pa.schema([schema.field(c) for c in columns]))

    def wide(self, i: int, column: str) -> pa.Array:
        """Wide ``column`` (logits, gate_input) of part ``i``: version 2 maps its Arrow IPC file
        (no decoding, no copy), version 1 decodes the Parquet column."""
        if self.version == 1:
            return _one_chunk(read_part(self.parts[i], [column]).column(column))
        field = wide_schemas(self.meta, (column,), self.meta.get("gate_input_dtype", "float32"))[column].field(column)
        arr = read_wide(wide_file(self.parts[i], column), field)
        if len(arr) != self.part_rows[i]:
            raise _fail(wide_file(self.parts[i], column), f"holds {len(arr)} rows, its part {self.part_rows[i]}")
        return arr

    def iter_tables(self, columns: tuple[str, ...] | list[str], read_ahead: bool = False) -> Iterator[pa.Table]:
        """Yield one Arrow table per part file with only the logical ``columns`` (streaming).

        ``read_ahead``: decode the next part on one background thread while the caller works on
        this one (two parts in memory at once; for a caller that runs a kernel on each part).
        """
        columns = list(columns)
        if not read_ahead or len(self.parts) < 2:
            for i in range(len(self.parts)):
                yield self.read_part(i, columns)
            return
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-replay-read") as pool:
            nxt = pool.submit(self.read_part, 0, columns, False)
            for i in range(len(self.parts)):
                t = nxt.result()
                if i + 1 < len(self.parts):
                    nxt = pool.submit(self.read_part, i + 1, columns, False)
                yield t
                del t

    def table(self, columns: tuple[str, ...] | list[str] = NARROW) -> pa.Table:
        self.check_rows()
        columns = list(columns)
        missing = [c for c in columns if c not in NARROW and c not in self.columns]
        if missing:
            raise TraceError(self.path, f"has no {', '.join(missing)} column")
        tables = list(self.iter_tables(columns))
        if not tables:
            return self.logical_schema().empty_table().select(columns)
        return pa.concat_tables(tables)

    def routings(self, columns: tuple[str, ...] | list[str] = NARROW) -> pl.DataFrame:
        """The rows as a Polars frame (narrow columns by default; wide ones only when named)."""
        import polars as pl  # only where a frame is returned: synth never imports it (about 0.1 s of start-up)

        return pl.from_arrow(self.table(columns))  # type: ignore[return-value]

    def arrays(self, recorded: bool = True) -> RoutingArrays:
        """Dense numpy arrays of the narrow columns (and the recorded ones when present)."""
        extra = [c for c in RECORDED_COLUMNS if recorded and self.has(c)]
        scalars = [c for c in REQUEST_COLUMNS if self.has(c)]
        t = self.table(list(NARROW) + scalars + extra)
        out: dict[str, Any] = {}
        for name in ("turn", "batch", "phase", "step", "layer", *scalars):
            out[name] = t.column(name).to_numpy()
        for name in ["experts", "weights", *extra]:
            out[name] = fixed_list_to_numpy(t.column(name))
        return RoutingArrays(**out)

    def router(self) -> pl.DataFrame | None:
        """router.parquet as a frame (layer, expert, weight list, bias), or None."""
        if not self.has_router:
            return None
        import polars as pl

        path = self.path / ROUTER_FILE
        return pl.from_arrow(read_part(path, pq.ParquetFile(path).schema_arrow.names))  # type: ignore[return-value]

    def router_matrices(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """{layer: (W [n_expert, n_embd] float32, bias [n_expert] float32)} from router.parquet."""
        if not self.has_router:
            return {}
        t = read_part(self.path / ROUTER_FILE, ["layer", "expert", "weight", "bias"])
        w = _router_by_layer(t, fixed_list_to_numpy(t.column("weight")))
        b = _router_by_layer(t, t.column("bias").to_numpy())
        return {l: (w[l], b[l]) for l in w}

    @property
    def has_router_logit_bias(self) -> bool:
        """Whether router.parquet stores a per-expert bias the router adds to its logits."""
        return self.has_router and "logit_bias" in pq.ParquetFile(self.path / ROUTER_FILE).schema_arrow.names

    def router_logit_bias(self) -> dict[int, np.ndarray]:
        """{layer: [n_expert] float32} added to the router logits before the activation (gpt-oss),
        from router.parquet's optional ``logit_bias`` column; {} when it has none."""
        if not self.has_router_logit_bias:
            return {}
        t = read_part(self.path / ROUTER_FILE, ["layer", "expert", "logit_bias"])
        return _router_by_layer(t, t.column("logit_bias").to_numpy())

    def metrics(self) -> pl.DataFrame | None:
        """The engine's recorded per-token metrics (metrics.parquet), or None."""
        if not self.has_metrics:
            return None
        import polars as pl

        return pl.from_arrow(_read_metrics(self.path / METRICS_FILE))  # type: ignore[return-value]

    # -- summaries ----------------------------------------------------------------------------
    def distinct(self, columns: tuple[str, ...] | list[str]) -> pl.DataFrame:
        """The distinct rows of ``columns`` (in no particular order), read part by part: memory is
        one part's columns plus the distinct rows (for token keys, one per token, not one per
        routing: a token routes at every MoE layer), never the whole trace's columns."""
        import polars as pl

        self.check_rows()
        columns = list(columns)
        seen: list[pl.DataFrame] = []
        for t in self.iter_tables(columns):
            seen.append(pl.from_arrow(t).unique())  # type: ignore[union-attr]
            del t
        if not seen:
            return self.routings(columns)
        return pl.concat(seen).unique()

    def token_counts(self) -> dict[str, int]:
        """Distinct (request, turn, step) tokens per phase (request only when the trace has it)."""
        df = self.distinct((["request"] if self.has("request") else []) + ["turn", "phase", "step"])
        return {
            "tokens_prefill": int((df["phase"] == PHASE_PREFILL).sum()),
            "tokens_decode": int((df["phase"] == PHASE_DECODE).sum()),
        }


def _fail(path: Path, problem: str) -> TraceError:
    return TraceError(path, problem)


def open_trace(path: str | Path, check_rows: bool = True, defer_rows: bool = False) -> Trace:
    """Open and validate a trace directory; raise :class:`TraceError` naming the bad file.

    ``defer_rows``: check the metadata and schemas now and the row invariants when the rows are
    first read (:attr:`Trace.rows_pending`): a verb that reads every row once anyway (a cache
    replay, :func:`replay.core.simulate.iter_load_parts`) then reads them once, not twice. Nothing sees an
    unchecked row either way, and a bad one is refused with the same sentence.
    ``check_rows=False``: never check them (for traces this package has just written)."""
    root = Path(path)
    note_input(root)  # an input of the command: no output of it may replace or write into it
    if not root.exists():
        raise _fail(root, "no such trace directory")
    if not root.is_dir():
        raise _fail(root, "is not a trace directory (a trace is a directory holding trace.json and routings/)")
    meta_path = root / TRACE_JSON
    if not meta_path.is_file():
        raise _fail(root, "is not a trace: trace.json is missing")
    try:
        meta = parse_bounded(meta_path.read_text(encoding="utf-8"), "trace.json")  # nesting and integers bounded
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(meta_path, f"is not valid JSON ({e.__class__.__name__}: {e})") from None
    except BoundsError as e:
        raise _fail(meta_path, str(e)) from None
    problems = validate_meta(meta, TRACE_JSON)
    if problems:
        raise _fail(meta_path, problems[0])
    rdir = root / ROUTINGS_DIR
    if not rdir.is_dir():
        raise _fail(root, "has no routings/ directory")
    parts = sorted(rdir.glob("part-*.parquet"))
    expected_names = [f"part-{i:05d}.parquet" for i in range(len(parts))]
    if [p.name for p in parts] != expected_names:
        raise _fail(rdir, "part files are not numbered part-00000.parquet, part-00001.parquet, ... without gaps")
    columns, gdtype = tuple(meta.get("columns", [])), meta.get("gate_input_dtype", "float32")
    v2 = meta["version"] == 2
    schema = part_schema(meta, columns) if v2 else routings_schema(meta, columns, gdtype)
    part_rows = []
    for part in parts:
        try:
            pf = pq.ParquetFile(part)
        except (pa.ArrowException, OSError) as e:
            raise _fail(part, f"is not a readable Parquet file (truncated or corrupt: {_short(e)})") from None
        got = pf.schema_arrow
        if not got.equals(schema, check_metadata=False):
            raise _fail(part, f"has the wrong columns or types for format version {meta['version']}: {_schema_diff(got, schema)}")
        part_rows.append(pf.metadata.num_rows)
    trace = Trace(root, meta, parts, part_rows)
    if v2:
        for i in range(len(parts)):
            for c in columns:
                if c in WIDE_COLUMNS:
                    trace.wide(i, c)  # schema and row count, mapped (nothing is decoded)
    if meta["complete"] and not parts:
        raise _fail(rdir, "holds no part files although trace.json says the trace is complete")
    if "rows" in meta and meta["complete"] and meta["rows"] != trace.n_rows:
        raise _fail(rdir, f"holds {trace.n_rows} rows but trace.json says {meta['rows']}")
    if check_rows and defer_rows:
        trace.rows_pending = True
    elif check_rows:
        _check_rows(trace)
    if trace.has_router:
        _check_router(trace)
    if trace.has_metrics:
        _read_metrics(root / METRICS_FILE)
    return trace


def _short(e: Exception) -> str:
    return str(e).splitlines()[0][:160] if str(e) else e.__class__.__name__


def _schema_diff(got: pa.Schema, want: pa.Schema) -> str:
    for f in want:
        if f.name not in got.names:
            return f"column {f.name} is missing"
        g = got.field(f.name)
        if not g.type.equals(f.type):
            return f"column {f.name} is {g.type}, expected {f.type}"
    extra = [n for n in got.names if n not in want.names]
    if extra:
        return f"unexpected column(s) {', '.join(extra)} (not listed in trace.json 'columns')"
    return "column order differs from the format"


def _check_rows(trace: Trace) -> None:
    """Row-level invariants, one part at a time (bounded memory on long traces)."""
    ck = RowChecker(trace)
    for part, t in zip(trace.parts, trace.iter_tables(ck.columns)):
        ck.check(part, t)
    trace.rows_pending = False


class RowChecker:
    """The row-level invariants of :func:`open_trace`, checked one part table at a time, in order
    (what carries from part to part: the last row's key, the row offset, each (request, layer)'s
    last step). :attr:`columns`: what a part table must hold. A reader that checks the rows as it
    reads them (:func:`replay.core.simulate.iter_load_parts` on a trace opened with ``defer_rows``) calls
    :meth:`check` on each part, or :meth:`passed` when its own equivalent check found nothing."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.recorded = [c for c in RECORDED_COLUMNS if trace.has(c)]
        self.columns = list(NARROW) + self.recorded + [c for c in REQUEST_COLUMNS if trace.has(c)]
        self.moe = np.zeros(trace.n_layer, dtype=bool)
        self.moe[trace.moe_layers] = True
        self.last: tuple[int, ...] | None = None  # batch, layer, step, phase[, request]
        self.offset = 0
        self.by_rank = not trace.gating.get("selection_bias")
        self.has_req = trace.has("request")
        self.req_last: dict[tuple[int, int], tuple[int, int]] = {}  # (request, layer) -> (its last step, turn)

    @property
    def simple(self) -> bool:
        """No request, token or recorded column: the invariants are those of the narrow columns only."""
        return not self.has_req and not self.trace.has("token") and not self.recorded

    def passed(self, part: Path, t: pa.Table) -> None:
        """Advance past a part another check (the row gate fused into :func:`replay.core.loads.cut_loads`) found valid, only for
        :attr:`simple` traces. That gate carries the step rules (each layer's last step and turn)
        itself: :attr:`req_last` is not kept here, and a caller that runs :meth:`check` after the
        gate sets it from the gate's state first."""
        n = t.num_rows
        if n:
            cols = [t.column(c)[n - 1].as_py() for c in ("batch", "layer", "step", "phase")]
            self.last = (*cols, 0)
        self.offset += n

    def check(self, part: Path, t: pa.Table) -> None:
        try:
            self._check(t)
        except ValueError as e:
            raise _fail(part, str(e)) from None

    def _check(self, t: pa.Table) -> None:
        trace, recorded, moe, offset = self.trace, self.recorded, self.moe, self.offset
        k, n_expert = trace.top_k, trace.n_expert
        last, by_rank, has_req = self.last, self.by_rank, self.has_req
        n = t.num_rows
        if n == 0:
            return
        b = t.column("batch").to_numpy().astype(np.int64)
        lay = t.column("layer").to_numpy().astype(np.int64)
        s = t.column("step").to_numpy().astype(np.int64)
        ph = t.column("phase").to_numpy()
        bad = np.flatnonzero((lay < 0) | (lay >= trace.n_layer))
        if bad.size:
            raise ValueError(f"row {offset + bad[0]} has layer {lay[bad[0]]} outside 0..{trace.n_layer - 1}")
        bad = np.flatnonzero(~moe[lay])
        if bad.size:
            raise ValueError(f"row {offset + bad[0]} routes at layer {lay[bad[0]]}, which is not a MoE layer")
        bad = np.flatnonzero((ph != PHASE_PREFILL) & (ph != PHASE_DECODE))
        if bad.size:
            raise ValueError(f"row {offset + bad[0]} has phase {ph[bad[0]]} (0 prefill, 1 decode)")
        if has_req:
            _check_requests(t, offset, self.req_last)
        if "token" in t.column_names:
            tok = t.column("token").to_numpy()
            bad = np.flatnonzero(tok < 0)
            if bad.size:
                raise ValueError(f"row {offset + bad[0]} has token id {tok[bad[0]]}, which is negative")
        req = t.column("request").to_numpy().astype(np.int64) if has_req else np.zeros(n, dtype=np.int64)
        prepended = last is not None
        if prepended:
            b = np.concatenate([[last[0]], b])
            lay = np.concatenate([[last[1]], lay])
            s = np.concatenate([[last[2]], s])
            ph = np.concatenate([[last[3]], ph])
            req = np.concatenate([[last[4]], req])
        # (batch, layer[, request], step): with many requests, steps repeat across requests in
        # a load. Comparisons, not np.diff: request ids may span the whole int64 range.
        db, dl = np.diff(b), np.diff(lay)
        r_gt, r_eq = req[1:] > req[:-1], req[1:] == req[:-1]
        s_gt, s_eq = s[1:] > s[:-1], s[1:] == s[:-1]
        ok = (db > 0) | ((db == 0) & ((dl > 0) | ((dl == 0) & (r_gt | (r_eq & s_gt)))))
        if not ok.all():
            i = int(np.argmin(ok))
            kind = "duplicates the row before it" if (db[i] == 0 and dl[i] == 0 and r_eq[i] and s_eq[i]) else \
                ("breaks the (batch, layer, request, step) row order" if has_req else "breaks the (batch, layer, step) row order")
            raise ValueError(f"row {offset + i + 1 - int(prepended)} {kind}")
        same_batch_phase_change = (db == 0) & (np.diff(ph) != 0)
        if same_batch_phase_change.any():
            i = int(np.argmax(same_batch_phase_change))
            raise ValueError(f"batch {b[i + 1]} mixes prefill and decode rows")
        if not has_req:
            # The step rules hold without a request column too (the trace is then one request): a
            # negative step or a token routed twice at a layer would count tokens wrong.
            _check_requests(t, offset, self.req_last, False)
        self.last = (int(b[-1]), int(lay[-1]), int(s[-1]), int(ph[-1]), int(req[-1]))
        ex = fixed_list_to_numpy(t.column("experts"))
        bad = np.flatnonzero(((ex < 0) | (ex >= n_expert)).any(axis=1))
        if bad.size:
            raise ValueError(f"row {offset + bad[0]} has an expert id outside 0..{n_expert - 1}")
        if k > 1:
            srt = np.sort(ex, axis=1)
            bad = np.flatnonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))
            if bad.size:
                raise ValueError(f"row {offset + bad[0]} selects the same expert twice")
        w = fixed_list_to_numpy(t.column("weights"))
        nan = np.isnan(w)
        partial = nan.any(axis=1) & ~nan.all(axis=1)
        bad = np.flatnonzero(partial | np.isinf(w).any(axis=1))
        if bad.size:
            raise ValueError(
                f"row {offset + bad[0]} has weights that are infinite or only partly NaN "
                "(NaN is allowed only for a whole routing whose engine exposed no weights)"
            )
        _check_weights(w, lay[int(prepended):], offset, by_rank)
        if "residency" in recorded:
            r = fixed_list_to_numpy(t.column("residency"))
            bad = np.flatnonzero((r > 2).any(axis=1))
            if bad.size:
                raise ValueError(f"row {offset + bad[0]} has a residency code above 2 (0 miss, 1 hit, 2 speculative hit)")
        self.offset += n


def _check_requests(t: pa.Table, offset: int, req_last: dict[tuple[int, int], tuple[int, int]],
                    has_req: bool = True) -> None:
    """``step`` is the position inside its request (without a request column, the trace is one
    request): >= 0, and a request's tokens come in order (at each layer its steps strictly increase
    from batch to batch, inside one turn or across later turns). ``req_last`` carries each
    (request, layer)'s last (step, turn) from part to part."""
    s = t.column("step").to_numpy().astype(np.int64)
    bad = np.flatnonzero(s < 0)
    if bad.size:
        raise ValueError(f"row {offset + bad[0]} has step {s[bad[0]]}; step is the position inside its request, >= 0")
    req = t.column("request").to_numpy().astype(np.int64) if has_req else np.zeros(s.size, np.int64)
    lay = t.column("layer").to_numpy().astype(np.int64)
    turn = t.column("turn").to_numpy().astype(np.int64)
    # Rows grouped by (request, layer), file order kept inside a group (file order = batch order).
    order = np.lexsort((np.arange(req.size), lay, req))
    r, l_, st, tu = req[order], lay[order], s[order], turn[order]
    first = np.r_[True, (r[1:] != r[:-1]) | (l_[1:] != l_[:-1])]
    back = np.r_[False, ~first[1:]]  # a row whose group's previous row is in this part
    later_turn = tu[1:] > tu[:-1]
    bad_in = back[1:] & ~((st[1:] > st[:-1]) & (tu[1:] >= tu[:-1]) | later_turn)
    if bad_in.any():
        i = int(order[1:][np.argmax(bad_in)])
        raise ValueError(_out_of_order(offset + i, req[i], lay[i], s[i], has_req))
    for j in np.flatnonzero(first):
        key = (int(r[j]), int(l_[j]))
        prev = req_last.get(key)
        if prev is not None and not (int(tu[j]) > prev[1] or (int(tu[j]) == prev[1] and int(st[j]) > prev[0])):
            i = int(order[j])
            raise ValueError(_out_of_order(offset + i, req[i], lay[i], s[i], has_req))
    last_of = np.r_[first[1:], True]
    for j in np.flatnonzero(last_of):
        req_last[(int(r[j]), int(l_[j]))] = (int(st[j]), int(tu[j]))


def _out_of_order(row: int, req: int, layer: int, step: int, has_req: bool) -> str:
    if has_req:
        return (f"row {row} (request {req}, layer {layer}) has step {step}, not after that request's previous token "
                "at this layer: step must be the position inside its request, and a request's tokens must come in order")
    return (f"row {row} (layer {layer}) has step {step}, not after the previous token at this layer: in a trace "
            "without a request column step is the token's position, and each token routes once per layer, in order")


def _check_weights(w: np.ndarray, layer: np.ndarray, offset: int, by_rank: bool) -> None:
    """Routing weights are the final applied weights: >= 0, and (without a selection bias, which
    ranks by a biased score instead) in router rank order, descending. A negative weight or an
    order that is not the rank order makes drop-cold skip the wrong experts without a word."""
    with np.errstate(invalid="ignore"):
        bad = np.flatnonzero((w < 0).any(axis=1))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"row {offset + i} (layer {layer[i]}) has a negative routing weight "
                             f"({float(w[i].min()):g}); weights are the applied routing weights, >= 0")
        if by_rank and w.shape[1] > 1:
            bad = np.flatnonzero((w[:, 1:] > w[:, :-1]).any(axis=1))
            if bad.size:
                i = int(bad[0])
                raise ValueError(
                    f"row {offset + i} (layer {layer[i]}) lists its experts with weights "
                    f"{', '.join(f'{x:.6g}' for x in w[i])}, not in router rank order (descending weight), and "
                    "trace.json's gating has no selection bias that would explain another order")


def _read_metrics(path: Path) -> pa.Table:
    """metrics.parquet, checked: numeric columns with plausible values (times in ms, bytes, hit %),
    at least ``wall_ms`` and ``read_bytes``; a :class:`TraceError` naming the file otherwise."""
    try:
        t = pq.read_table(path)
    except (pa.ArrowException, OSError, ValueError, EOFError) as e:
        raise _fail(path, f"is not a readable Parquet file (truncated or corrupt: {_short(e)})") from None
    missing = [c for c in ("wall_ms", "read_bytes") if c not in t.column_names]
    if missing:
        raise _fail(path, f"has no {', '.join(missing)} column (engine per-token metrics need wall_ms and read_bytes)")
    for name in t.column_names:
        col = t.column(name)
        if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
            raise _fail(path, f"column {name} is {col.type}, not a number")
        if col.null_count:
            raise _fail(path, f"column {name} holds a null")
        bad = metrics_first_problem(name, col.to_numpy())
        if bad:
            raise _fail(path, f"row {bad[0]}: {bad[1]}")
    if t.num_rows and (t.column("wall_ms").to_numpy() <= 0).any():
        raise _fail(path, "column wall_ms holds a time <= 0 ms")
    return t


def _router_by_layer(t: pa.Table, values: np.ndarray) -> dict[int, np.ndarray]:
    """{layer: ``values``' rows of that layer in expert order, float32} for a router.parquet table."""
    layer, expert = t.column("layer").to_numpy(), t.column("expert").to_numpy()
    values = values.astype(np.float32, copy=False)
    out = {}
    for l in np.unique(layer):
        sel = np.flatnonzero(layer == l)
        out[int(l)] = np.ascontiguousarray(values[sel[np.argsort(expert[sel], kind="stable")]])
    return out


def _check_router(trace: Trace) -> None:
    path = trace.path / ROUTER_FILE
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise _fail(path, f"is not a readable Parquet file ({_short(e)})") from None
    n_embd = trace.model.get("n_embd")
    if not n_embd:
        raise _fail(path, "exists but trace.json gives no model.n_embd")
    want = pa.schema(
        [
            pa.field("layer", pa.int16()),
            pa.field("expert", pa.int32()),
            pa.field("weight", pa.list_(pa.float32(), n_embd)),
            pa.field("bias", pa.float32()),
        ]
    )
    got = pf.schema_arrow
    for f in want:
        if f.name not in got.names or not got.field(f.name).type.equals(f.type):
            raise _fail(path, f"column {f.name} is missing or not {f.type}")
    if "logit_bias" in got.names:
        if not got.field("logit_bias").type.equals(pa.float32()):
            raise _fail(path, "column logit_bias (optional) is not float32")
        lb = read_part(path, ["logit_bias"]).column("logit_bias")
        if lb.null_count or not np.isfinite(lb.to_numpy(zero_copy_only=False)).all():
            raise _fail(path, "column logit_bias holds a null, NaN or infinite value")
    t = read_part(path, ["layer", "expert"])  # a corrupt data page is named, not an Arrow error
    lay = t.column("layer").to_numpy()
    ex = t.column("expert").to_numpy()
    for l in trace.moe_layers:
        sel = np.sort(ex[lay == l])
        if sel.size and not np.array_equal(sel, np.arange(trace.n_expert)):
            raise _fail(path, f"layer {l} does not hold exactly one row per expert 0..{trace.n_expert - 1}")
