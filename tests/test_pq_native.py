"""The strict Parquet column-chunk reader (traces/_pq.c, through traces.pq_native) agrees exactly
with pyarrow (tests/naive/pqread.py) on every chunk it accepts, and refuses the rest with a status
naming why: random tables of the kinds the trace writer writes, written with random pyarrow options
(codecs, dictionary, page sizes and versions, statistics, checksums, row groups, encodings), must
read back bit for bit (floats included, NaN payloads too) or be refused for a reason those options
explain; chunks with nulls or ragged lists are refused; corrupted chunks give a status, or the
values pyarrow reads from the same bytes, never a crash or a value pyarrow would not read; bad
arguments raise TypeError / ValueError.

The chunks are located from pyarrow's footer metadata here (the coordinator parses footers itself).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.helpers import loader_import_seconds
from tests.naive.pqread import read_column
from traces import pq_native

PQ = pq_native.load()
needs_pq = pytest.mark.skipif(PQ is None, reason=f"the compiled Parquet reader is not available: {pq_native.why_unavailable()}")

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

CODECS = {"UNCOMPRESSED": 0, "SNAPPY": 1, "GZIP": 2, "LZO": 3, "BROTLI": 4, "LZ4": 5, "ZSTD": 6, "LZ4_RAW": 7}
PHYSICAL = {"BOOLEAN": 0, "INT32": 1, "INT64": 2, "INT96": 3, "FLOAT": 4, "DOUBLE": 5, "BYTE_ARRAY": 6,
            "FIXED_LEN_BYTE_ARRAY": 7}


def status(text: str) -> int:
    """A status code by its reason (STATUS is the module's own table)."""
    return PQ.STATUS.index(text) if PQ is not None else -1


if PQ is not None:
    ST_CODEC = status("unsupported compression codec")
    ST_TYPE = status("unsupported physical type, or an output type that does not match it")
    ST_LAYOUT = status("unsupported column layout (only required scalars and non-null fixed-size lists)")
    ST_ZSTD_MISSING = status("zstd library unavailable")
    ST_READ = status("the file could not be read")
    ST_SHORT = status("truncated: the file ends inside the chunk")
    ST_PAST = status("page header or page runs past the end of the chunk")
    ST_DICT = status("dictionary page or dictionary-encoded values")
    ST_ENCODING = status("unsupported encoding (values must be PLAIN, levels RLE)")
    ST_V2_FLAG = status("data page v2 with is_compressed unset, or false under a codec")
    ST_NULL = status("a null value (definition level below the maximum)")
    ST_LIST = status("an empty list or a list of the wrong length")
    ST_LEVELS = status("repetition or definition levels malformed")
    ST_COUNT = status("value count differs from rows times width")
    ST_RANGE = status("value out of range for the narrowed output type")


@dataclass(frozen=True)
class Chunk:
    """One column chunk as the footer describes it, and what read_chunk is asked to write."""

    name: str
    row_group: int
    offset: int
    size: int
    codec: int
    physical: int
    max_rep: int
    max_def: int
    width: int
    rows: int
    dtype: np.dtype

    def args(self, fd: int) -> tuple:
        return (fd, self.offset, self.size, self.codec, self.physical, self.max_rep, self.max_def, self.width, self.rows)


def chunks(path: Path, widths: dict[str, int] | None = None) -> list[Chunk]:
    """Every column chunk of the file. A list column's width is its fixed size, or ``widths[name]``
    for a variable list presented as if it were fixed (what the reader must then catch)."""
    pf = pq.ParquetFile(path)
    md = pf.metadata
    out = []
    for i in range(md.num_row_groups):
        rg = md.row_group(i)
        for j in range(rg.num_columns):
            c, leaf = rg.column(j), pf.schema.column(j)
            name = c.path_in_schema.split(".")[0]
            typ = pf.schema_arrow.field(name).type
            if pa.types.is_fixed_size_list(typ):
                width, typ = typ.list_size, typ.value_type
            elif pa.types.is_list(typ):
                width, typ = (widths or {})[name], typ.value_type
            else:
                width = 0
            start = c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset
            out.append(Chunk(name, i, start, c.total_compressed_size, CODECS[c.compression], PHYSICAL[c.physical_type],
                             leaf.max_repetition_level, leaf.max_definition_level, width, rg.num_rows,
                             np.dtype(typ.to_pandas_dtype())))
    return out


def _thrift_struct(b: bytes, i: int) -> tuple[dict, int]:
    """A Thrift compact struct at b[i:] as {field id: value} (nested structs as dicts; lists
    skipped), and where it ends. Enough to walk page headers in tests."""
    def varint(i: int) -> tuple[int, int]:
        v = shift = 0
        while True:
            x = b[i]
            i += 1
            v |= (x & 0x7F) << shift
            shift += 7
            if not x & 0x80:
                return v, i

    out: dict = {}
    last = 0
    while True:
        h = b[i]
        i += 1
        if h == 0:
            return out, i
        t, d = h & 15, h >> 4
        if d:
            fid = last + d
        else:
            v, i = varint(i)
            fid = (v >> 1) ^ -(v & 1)
        last = fid
        if t in (1, 2):
            out[fid] = t == 1
        elif t in (4, 5, 6):
            v, i = varint(i)
            out[fid] = (v >> 1) ^ -(v & 1)
        elif t == 8:
            n, i = varint(i)
            out[fid] = b[i:i + n]
            i += n
        elif t == 12:
            out[fid], i = _thrift_struct(b, i)
        else:
            raise ValueError(f"compact type {t} not expected in a page header")


def stored_v2_pages(path: Path, ch: Chunk) -> int:
    """How many of the chunk's data pages v2 are stored uncompressed (is_compressed false): pyarrow
    writes a page that does not compress so, even under a codec."""
    b = path.read_bytes()[ch.offset:ch.offset + ch.size]
    i = n = 0
    while i < len(b):
        h, i = _thrift_struct(b, i)
        n += h[1] == 3 and not h[8].get(7, False)
        i += h[3]
    return n


def compressed_payloads(path: Path, ch: Chunk) -> list[range]:
    """The file offsets of the chunk's zstd frames (a v1 page's body; a v2 page's values, after its
    levels, when is_compressed)."""
    if ch.codec != 6:
        return []
    b = path.read_bytes()[ch.offset:ch.offset + ch.size]
    i, out = 0, []
    while i < len(b):
        h, i = _thrift_struct(b, i)
        if h[1] == 0:
            out.append(range(ch.offset + i, ch.offset + i + h[3]))
        elif h[1] == 3 and h[8].get(7, False):
            out.append(range(ch.offset + i + h[8][5] + h[8][6], ch.offset + i + h[3]))
        i += h[3]
    return out


def new_out(ch: Chunk, form: str = "numpy", dtype: np.dtype | None = None):
    """A buffer for the chunk's values, pre-filled with a pattern (a value left unwritten shows)."""
    dtype = np.dtype(dtype or ch.dtype)
    n = ch.rows * max(ch.width, 1)
    if form == "memoryview":  # what the native path hands over: no NumPy
        return memoryview(bytearray(b"\xa5" * (n * dtype.itemsize))).cast(dtype.char)
    out = np.full(n * dtype.itemsize, 0xA5, dtype=np.uint8).view(dtype)
    return out.reshape(ch.rows, ch.width) if form == "2d" and ch.width else out


def as_bytes(out) -> bytes:
    return memoryview(out).tobytes()


def read(path: Path, ch: Chunk, out) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return PQ.read_chunk(*ch.args(fd), out)
    finally:
        os.close(fd)


def check_chunk(path: Path, ch: Chunk, allowed: set[int], form: str = "numpy") -> int:
    """read_chunk on one chunk: status 0 and pyarrow's values bit for bit, or a refusal in
    ``allowed``; a chunk pyarrow finds a null in is always refused."""
    out = new_out(ch, form)
    st = read(path, ch, out)
    ref = read_column(path, ch.row_group, ch.name)
    assert 0 <= st < len(PQ.STATUS)
    if st == 0:
        assert ref is not None, f"{ch}: accepted a chunk holding a null"
        assert ref.dtype == ch.dtype
        assert as_bytes(out) == ref.tobytes(), f"{ch}: values differ from pyarrow's"
    else:
        assert st in allowed, f"{ch}: refused with {PQ.STATUS[st]!r}, expected {sorted(PQ.STATUS[a] for a in allowed) or 'ok'}"
    return st


# -- random tables, random options ------------------------------------------------------------------

SCALARS = {"int8": pa.int8(), "int16": pa.int16(), "int32": pa.int32(), "int64": pa.int64(),
           "float32": pa.float32(), "float64": pa.float64()}
LISTS = {"list_int32": pa.int32(), "list_float32": pa.float32()}


def random_values(rng: np.random.Generator, typ: pa.DataType, n: int, style: str) -> np.ndarray:
    dtype = np.dtype(typ.to_pandas_dtype())
    if style == "small":  # long runs and few distinct values: what compresses, what dictionaries like
        return np.repeat(rng.integers(0, 4, max(1, n // 16 + 1)), 16)[:n].astype(dtype)
    if dtype.kind == "f":
        if style == "bits":  # every bit pattern: NaNs with payloads, infinities, subnormals, -0.0
            return rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8).view(dtype)
        v = rng.standard_normal(n).astype(dtype)
        v[rng.random(n) < 0.1] = np.nan
        return v
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, n, endpoint=True, dtype=dtype)


@dataclass
class Column:
    name: str
    kind: str
    width: int
    nulls: bool


@st.composite
def tables(draw) -> tuple[pa.Table, list[Column]]:
    seed = draw(st.integers(0, 2**32 - 1))
    rows = draw(st.one_of(st.integers(0, 40), st.integers(0, 1500)))
    kinds = draw(st.lists(st.sampled_from(list(SCALARS) + list(LISTS)), min_size=1, max_size=4))
    rng = np.random.default_rng(seed)
    arrays, fields, cols = [], [], []
    for i, kind in enumerate(kinds):
        name, style = f"c{i}", draw(st.sampled_from(["small", "full", "bits"]))
        if kind in SCALARS:
            typ = SCALARS[kind]
            arrays.append(pa.array(random_values(rng, typ, rows, style), type=typ))
            fields.append(pa.field(name, typ, nullable=False))
            cols.append(Column(name, kind, 0, False))
        else:
            typ, width = LISTS[kind], draw(st.integers(1, 9))
            nulls = draw(st.sampled_from([False, False, False, True]))
            flat = random_values(rng, typ, rows * width, style)
            mask = rng.random(rows * width) < 0.05 if nulls else None
            items = pa.array(flat, type=typ, mask=mask)
            lt = pa.list_(pa.field("element", typ, nullable=True), width)
            arrays.append(pa.FixedSizeListArray.from_arrays(items, type=lt))
            fields.append(pa.field(name, lt, nullable=False))
            cols.append(Column(name, kind, width, bool(nulls and mask.any())))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields)), cols


def leaf(c: Column) -> str:
    return f"{c.name}.list.element" if c.width else c.name


@st.composite
def write_options(draw, cols: list[Column], rows: int) -> tuple[dict, dict[str, set]]:
    """pyarrow.parquet.write_table options, and per column the refusals they explain."""
    codec_names = st.sampled_from(["none", "zstd", "zstd", "snappy", "gzip", "lz4"])
    if draw(st.booleans()):
        comp = {leaf(c): draw(codec_names) for c in cols}
    else:
        one = draw(codec_names)
        comp = {leaf(c): one for c in cols}
    opts = {
        "compression": comp,
        "use_dictionary": draw(st.sampled_from([False, False, True])),
        "data_page_version": draw(st.sampled_from(["1.0", "2.0"])),
        "write_statistics": draw(st.booleans()),
        "write_page_checksum": draw(st.booleans()),
        "write_page_index": draw(st.booleans()),
    }
    if draw(st.booleans()):
        opts["data_page_size"] = draw(st.sampled_from([1, 64, 500, 4096]))
    if draw(st.booleans()):
        opts["write_batch_size"] = draw(st.integers(1, 300))
    if draw(st.booleans()):  # at most ~20 row groups: each is read by pyarrow once per column
        opts["row_group_size"] = max(draw(st.integers(1, 700)), rows // 20)
    encodings = {}
    if not opts["use_dictionary"]:
        for c in cols:
            if draw(st.sampled_from([False, False, False, True])):
                choices = ["BYTE_STREAM_SPLIT"] + (["DELTA_BINARY_PACKED"] if "int" in c.kind and "int8" not in c.kind
                                                   and "int16" not in c.kind else [])
                encodings[leaf(c)] = draw(st.sampled_from(choices))
    if encodings:
        opts["column_encoding"] = encodings
    allowed: dict[str, set] = {}
    for c in cols:
        a = set()
        if opts["use_dictionary"]:
            a.add(ST_DICT)
        if comp[leaf(c)] not in ("none", "zstd"):
            a.add(ST_CODEC)
        if leaf(c) in encodings:
            a.add(ST_ENCODING)
        if c.nulls:
            a.add(ST_NULL)
        allowed[c.name] = a
    return opts, allowed


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="pq-native-") as d:
        yield Path(d)


@needs_pq
@settings(max_examples=150, **FAST)
@given(data=st.data())
def test_agrees_with_pyarrow_or_refuses_for_a_reason(workdir, data):
    table, cols = data.draw(tables())
    opts, allowed = data.draw(write_options(cols, table.num_rows))
    path = workdir / "t.parquet"
    try:
        pq.write_table(table, path, **opts)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:  # an option pyarrow refuses for this type
        assume(not str(e))
    form = data.draw(st.sampled_from(["numpy", "memoryview", "2d"]))
    for ch in chunks(path):
        check_chunk(path, ch, allowed[ch.name] | v2_stored(path, ch), form)


def v2_stored(path: Path, ch: Chunk) -> set[int]:
    """{ST_V2_FLAG} for a zstd chunk with a data page v2 stored uncompressed: pyarrow writes a page
    that does not compress so (is_compressed false), as Arrow before 3.0.0 wrote compressed pages
    too; pyarrow tells them apart by the footer's created_by, which read_chunk is not given: refused."""
    return {ST_V2_FLAG} if ch.codec == 6 and stored_v2_pages(path, ch) else set()


def routings_table(rng: np.random.Generator, rows: int, k: int, wide: int) -> pa.Table:
    from traces.writer import _fixed_list

    cols = {
        "turn": pa.array(np.sort(rng.integers(0, 3, rows)).astype(np.int32)),
        "batch": pa.array(np.sort(rng.integers(0, 1 << 20, rows)).astype(np.int32)),
        "phase": pa.array(rng.integers(0, 2, rows).astype(np.int8)),
        "step": pa.array(rng.integers(0, 1 << 16, rows).astype(np.int32)),
        "layer": pa.array(rng.integers(0, 60, rows).astype(np.int16)),
        "experts": _fixed_list(rng.integers(0, 256, (rows, k)).astype(np.int32), k, pa.int32()),
        "weights": _fixed_list(rng.random((rows, k)).astype(np.float32), k, pa.float32()),
        "request": pa.array(rng.integers(0, 1 << 40, rows).astype(np.int64)),
        "token": pa.array(rng.integers(0, 150000, rows).astype(np.int32)),
        "logits": _fixed_list(rng.standard_normal((rows, wide)).astype(np.float32), wide, pa.float32()),
    }
    fields = [pa.field(n, a.type, nullable=False) for n, a in cols.items()]
    return pa.Table.from_arrays(list(cols.values()), schema=pa.schema(fields))


@needs_pq
@settings(max_examples=25, **FAST)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 5000), k=st.integers(1, 9), wide=st.integers(1, 40))
def test_the_writers_own_options_are_always_read(workdir, seed, rows, k, wide):
    """Parts written as traces.writer writes them (zstd, no dictionary, 8 MiB pages; logits
    uncompressed): every chunk is read, none refused: the case that must be fast."""
    from traces.writer import routings_write_options

    table = routings_table(np.random.default_rng(seed), rows, k, wide)
    path = workdir / "part.parquet"
    opts = routings_write_options(table.schema)
    pq.write_table(table, path, **opts)
    for ch in chunks(path):
        assert ch.codec == (0 if ch.name == "logits" else 6)
        for form in ("numpy", "memoryview"):
            assert check_chunk(path, ch, set(), form) == 0


@needs_pq
def test_the_bench_trace_part_is_read_when_present():
    part = Path(tempfile.gettempdir()) / "moe-replay-bench-top1-100k" / "routings" / "part-00000.parquet"
    if not part.is_file():
        pytest.skip(f"{part} is absent (benchmarks/cache_e2e.py writes it)")
    for ch in chunks(part):
        assert check_chunk(part, ch, set(), "memoryview") == 0


# -- nulls, ragged lists, narrowing ------------------------------------------------------------------


@needs_pq
@settings(max_examples=60, **FAST)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 300), width=st.integers(1, 20),
       version=st.sampled_from(["1.0", "2.0"]), comp=st.sampled_from(["none", "zstd"]),
       page=st.sampled_from([None, 64]), how=st.sampled_from(["longer", "shorter", "empty", "null item", "shuffle"]))
def test_ragged_lists_and_nulls_are_refused(workdir, seed, rows, width, version, comp, page, how):
    """A variable list column (same levels as a fixed one: max_rep 1, max_def 2) presented as if it
    were fixed_size_list[width]: when one list is not exactly width long, or an item is null,
    the reader refuses; when every list happens to be width long with no null, it reads pyarrow's values."""
    rng = np.random.default_rng(seed)
    lengths = np.full(rows, width)
    i = int(rng.integers(0, rows))
    if how == "longer":
        lengths[i] += 1
    elif how == "shorter":
        lengths[i] -= 1
    elif how == "empty":
        lengths[i] = 0
    elif how == "shuffle" and rows > 1:  # the total stays rows * width: only the per-list check catches it
        j = (i + 1) % rows
        lengths[i] += 1
        lengths[j] -= 1
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    n = int(offsets[-1])
    mask = None
    if how == "null item" and n:
        mask = np.zeros(n, dtype=bool)
        mask[int(rng.integers(0, n))] = True
    items = pa.array(rng.integers(-1000, 1000, n).astype(np.int32), type=pa.int32(), mask=mask)
    lt = pa.list_(pa.field("element", pa.int32(), nullable=True))
    col = pa.ListArray.from_arrays(pa.array(offsets), items, type=lt)
    table = pa.Table.from_arrays([col], schema=pa.schema([pa.field("x", lt, nullable=False)]))
    path = workdir / "ragged.parquet"
    opts = {"use_dictionary": False, "compression": comp, "data_page_version": version}
    if page:
        opts.update(data_page_size=page, write_batch_size=7)
    pq.write_table(table, path, **opts)
    (ch,) = chunks(path, {"x": width})
    assert (ch.max_rep, ch.max_def) == (1, 2)
    out = new_out(ch)
    st_ = read(path, ch, out)
    ragged = bool((lengths != width).any())
    if v2_stored(path, ch):
        assert st_ == ST_V2_FLAG or (st_ in {ST_LIST, ST_NULL, ST_COUNT} and (ragged or mask is not None))
        return
    if ragged or mask is not None:
        assert st_ in {ST_LIST, ST_NULL, ST_COUNT}, PQ.STATUS[st_]
        if mask is not None and not ragged:
            assert st_ == ST_NULL
        if how == "empty" or (how == "shuffle" and rows > 1 and width > 1):
            # as many level entries as a good chunk (an empty list takes one): the lists are wrong
            assert st_ == ST_LIST
    else:
        assert st_ == 0 and as_bytes(out) == read_column(path, 0, "x").tobytes()


@needs_pq
@pytest.mark.parametrize("layout", ["optional scalar", "nullable list", "required items"])
def test_other_layouts_are_refused(workdir, layout):
    if layout == "optional scalar":
        field = pa.field("x", pa.int32(), nullable=True)
        arr = pa.array([1, 2, 3], type=pa.int32())
    elif layout == "nullable list":
        field = pa.field("x", pa.list_(pa.int32(), 1), nullable=True)
        arr = pa.FixedSizeListArray.from_arrays(pa.array([1, 2, 3], type=pa.int32()), 1)
    else:
        lt = pa.list_(pa.field("element", pa.int32(), nullable=False), 1)
        field = pa.field("x", lt, nullable=False)
        arr = pa.FixedSizeListArray.from_arrays(pa.array([1, 2, 3], type=pa.int32()), type=lt)
    path = workdir / "layout.parquet"
    pq.write_table(pa.Table.from_arrays([arr], schema=pa.schema([field])), path, use_dictionary=False, compression="zstd")
    (ch,) = chunks(path)
    assert (ch.max_rep, ch.max_def) in {(0, 1), (1, 3), (1, 1)}
    assert read(path, ch, new_out(ch)) == ST_LAYOUT


@needs_pq
@settings(max_examples=40, **FAST)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 2000), lim=st.sampled_from([8, 16]),
       comp=st.sampled_from(["none", "zstd"]), version=st.sampled_from(["1.0", "2.0"]), width=st.sampled_from([0, 3]),
       spill=st.booleans())
def test_int32_narrowed_to_int8_int16_when_every_value_fits(workdir, seed, rows, lim, comp, version, width, spill):
    """An INT32 column read into int8 / int16 (how Parquet stores Arrow's int8 / int16): the values
    pyarrow would cast to, when every one fits; a value out of range is refused."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(f"int{lim}")
    info = np.iinfo(dtype)
    v = rng.integers(info.min, info.max, rows * max(width, 1), endpoint=True).astype(np.int32)
    if spill:
        v[int(rng.integers(0, v.size))] = rng.choice([info.min - 1, info.max + 1, 2**31 - 1, -(2**31)])
    arr = pa.array(v) if not width else pa.FixedSizeListArray.from_arrays(pa.array(v), width)
    path = workdir / "narrow.parquet"
    pq.write_table(pa.Table.from_arrays([arr], schema=pa.schema([pa.field("x", arr.type, nullable=False)])), path,
                   use_dictionary=False, compression=comp, data_page_version=version)
    (ch,) = chunks(path)
    out = new_out(ch, dtype=dtype)
    st_ = read(path, ch, out)
    if v2_stored(path, ch):
        assert st_ in {ST_V2_FLAG, ST_RANGE}
    elif spill:
        assert st_ == ST_RANGE
    else:
        assert st_ == 0 and as_bytes(out) == v.astype(dtype).tobytes()
    # wider or of another kind: refused
    for other in (np.int64, np.float32, np.uint8):
        o = new_out(ch, dtype=other)
        if np.dtype(other).kind == "u":
            with pytest.raises(ValueError, match="format"):
                read(path, ch, o)
        else:
            assert read(path, ch, o) == ST_TYPE


@needs_pq
@pytest.mark.parametrize("paged", [False, True])
def test_v2_pages_that_compress_are_read(workdir, paged):
    """Data pages v2 under zstd whose values compress (is_compressed true): read, every layout and
    output kind (in place, narrowed, lists), across many pages when they are small."""
    rng = np.random.default_rng(3)
    rows = 5000
    small = np.repeat(rng.integers(0, 3, rows // 50), 50).astype(np.int32)
    table = pa.Table.from_arrays(
        [pa.array(small), pa.array(small.astype(np.int8)), pa.array(small.astype(np.float64)),
         pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(small, 3)), 3),
         pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(small, 2).astype(np.float32)), 2)],
        schema=pa.schema([pa.field("i", pa.int32(), nullable=False), pa.field("b", pa.int8(), nullable=False),
                          pa.field("d", pa.float64(), nullable=False),
                          pa.field("l", pa.list_(pa.int32(), 3), nullable=False),
                          pa.field("f", pa.list_(pa.float32(), 2), nullable=False)]))
    path = workdir / "v2.parquet"
    pq.write_table(table, path, use_dictionary=False, compression="zstd", data_page_version="2.0",
                   **({"data_page_size": 1024, "write_batch_size": 1000} if paged else {}))  # 5 pages of 1000 rows
    stored = 0
    for ch in chunks(path):
        stored += stored_v2_pages(path, ch)
        assert check_chunk(path, ch, v2_stored(path, ch)) == (ST_V2_FLAG if v2_stored(path, ch) else 0)
    assert stored <= 5  # at most a short last page per column


# -- pages built by hand: every valid way to write the levels ----------------------------------------


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        if v < 0x80:
            return bytes(out + bytes([v]))
        out.append(v & 0x7F | 0x80)
        v >>= 7


def _zigzag(v: int) -> int:
    return (v << 1) ^ (v >> 63)


def _thrift_i32s(fields: dict[int, int | bytes]) -> bytes:
    """A Thrift compact struct of i32 fields (int values) and struct fields (bytes: already encoded)."""
    out, last = bytearray(), 0
    for fid in sorted(fields):
        v = fields[fid]
        kind = 12 if isinstance(v, bytes) else 5
        out.append((fid - last) << 4 | kind)
        out += v if isinstance(v, bytes) else _varint(_zigzag(v))
        last = fid
    return bytes(out + b"\0")


def encode_levels(levels: list[int], bw: int, plan: list[tuple[str, int]], pad: int) -> bytes:
    """The RLE / bit-packing hybrid, run by run as ``plan`` says: ("rle", n) repeats levels[i]
    n times (the next n levels must be equal), ("bits", n) packs n levels (a multiple of 8, but the
    last run's final group may be short: padded with ``pad``)."""
    out, i = bytearray(), 0
    for kind, n in plan:
        chunk = levels[i:i + n]
        if kind == "rle":
            out += _varint(n << 1) + bytes([chunk[0]])
        else:
            groups = -(-len(chunk) // 8)
            vals = chunk + [pad] * (groups * 8 - len(chunk))
            bits = 0
            for j, v in enumerate(vals):
                bits |= v << (j * bw)
            out += _varint(groups << 1 | 1) + bits.to_bytes(groups * bw, "little")
        i += n
    return bytes(out)


@st.composite
def level_plans(draw, levels: list[int]) -> list[tuple[str, int]]:
    """A random valid segmentation of ``levels`` into RLE runs (of equal values) and bit-packed runs."""
    plan, i = [], 0
    while i < len(levels):
        same = 1
        while i + same < len(levels) and levels[i + same] == levels[i]:
            same += 1
        left = len(levels) - i
        if draw(st.booleans()):
            n = draw(st.integers(1, same))
            plan.append(("rle", n))
        else:
            n = 8 * draw(st.integers(1, max(1, left // 8))) if left >= 8 else left
            n = min(n, left)
            if n % 8 and n != left:
                n = left
            plan.append(("bits", n))
        i += n
    return plan


@needs_pq
@settings(max_examples=200, **FAST)
@given(data=st.data(), rows=st.integers(1, 60), width=st.integers(1, 20), version=st.sampled_from([1, 2]),
       fault=st.sampled_from([None, None, "rep", "def"]))
def test_levels_in_any_valid_encoding_are_read(workdir, data, rows, width, version, fault):
    """Pages written by hand (uncompressed, PLAIN values), their levels cut into RLE and bit-packed
    runs at random, the chunk into pages at random (lists may straddle pages): read exactly when
    every definition level is 2 and every repetition level is 0 at a list start, 1 elsewhere
    (pyarrow reads these levels the same whatever their runs); one wrong level: refused."""
    n = rows * width
    values = np.arange(n, dtype=np.int32) * 7 - 3
    rep = [0 if g % width == 0 else 1 for g in range(n)]
    dfn = [2] * n
    if fault:
        g = data.draw(st.integers(0, n - 1))
        if fault == "rep":
            rep[g] ^= 1
        else:
            dfn[g] = data.draw(st.sampled_from([0, 1, 3]))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, n - 1)), max_size=4)))) if n > 1 else []
    bounds = [0, *cuts, n]
    chunk = bytearray()
    for a, b in zip(bounds, bounds[1:]):
        r = encode_levels(rep[a:b], 1, data.draw(level_plans(rep[a:b])), data.draw(st.integers(0, 1)))
        d = encode_levels(dfn[a:b], 2, data.draw(level_plans(dfn[a:b])), data.draw(st.integers(0, 3)))
        vals = values[a:b].tobytes()
        if version == 1:
            body = len(r).to_bytes(4, "little") + r + len(d).to_bytes(4, "little") + d + vals
            sub = {1: b - a, 2: 0, 3: 3, 4: 3}
            header = {1: 0, 2: len(body), 3: len(body), 5: _thrift_i32s(sub)}
        else:
            body = r + d + vals
            sub = _thrift_i32s({1: b - a, 2: 0, 3: sum(1 for g in range(a, b) if g % width == 0), 4: 0, 5: len(d), 6: len(r)})
            sub = sub[:-1] + bytes([0x11]) + b"\0"  # field 7 (is_compressed): true
            header = {1: 3, 2: len(body), 3: len(body), 8: sub}
        chunk += _thrift_i32s(header) + body
    path = workdir / "levels.bin"
    path.write_bytes(bytes(chunk))
    out = np.full(n, -1, np.int32)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = PQ.read_chunk(fd, 0, len(chunk), 0, 1, 1, 2, width, rows, out)
    finally:
        os.close(fd)
    if fault is None:
        assert got == 0 and np.array_equal(out, values)
    elif fault == "rep":
        assert got == ST_LIST
    else:
        assert got == {0: ST_LIST, 1: ST_NULL, 3: ST_LEVELS}[dfn[g]]


# -- corruption -------------------------------------------------------------------------------------


def corruption_files(base: Path) -> list[tuple[Path, Chunk]]:
    """A few real chunks of different shapes (scalar, lists; v1, v2; zstd, none; checksums, statistics)."""
    rng = np.random.default_rng(7)
    rows = 400
    table = pa.table({
        "s": pa.array(rng.integers(-5, 5, rows).astype(np.int32)),
        "l": pa.FixedSizeListArray.from_arrays(pa.array(rng.integers(0, 100, rows * 3).astype(np.int32)), 3),
        "f": pa.FixedSizeListArray.from_arrays(pa.array(rng.random(rows).astype(np.float32)), 1),
        "q": pa.array(rng.integers(-(2**40), 2**40, rows)),
    })
    table = table.cast(pa.schema([pa.field(f.name, f.type, nullable=False) for f in table.schema]))
    out = []
    for i, (version, comp, extra) in enumerate([("1.0", "zstd", {}), ("2.0", "zstd", {}), ("1.0", "none", {}),
                                                ("2.0", "none", {"write_page_checksum": True}),
                                                ("1.0", "zstd", {"data_page_size": 200, "write_batch_size": 50})]):
        path = base / f"corrupt-{i}.parquet"
        pq.write_table(table, path, use_dictionary=False, compression=comp, data_page_version=version, **extra)
        out += [(path, ch) for ch in chunks(path)]
    return out


@pytest.fixture(scope="module")
def originals(workdir):
    return corruption_files(workdir)


@needs_pq
@settings(max_examples=300, **FAST)
@given(data=st.data())
def test_corrupted_chunks_give_a_status_or_pyarrows_values(workdir, originals, data):
    """Random bytes of a chunk flipped in place (the footer intact, so pyarrow reads the same bytes):
    read_chunk returns a status, or exactly what pyarrow reads; when pyarrow refuses the file, so
    does read_chunk. Never a crash (run once under ASan too: see traces/_pq.c)."""
    path, ch = data.draw(st.sampled_from(originals))
    blob = bytearray(path.read_bytes())
    # mostly the page headers and the first bytes of a page, where a flip changes the structure
    where = st.one_of(st.integers(ch.offset, min(ch.offset + 40, ch.offset + ch.size - 1)),
                      st.integers(ch.offset, ch.offset + ch.size - 1))
    flips = data.draw(st.lists(where, min_size=1, max_size=4))
    for pos in flips:
        blob[pos] ^= data.draw(st.integers(1, 255))
    bad = workdir / "corrupt.parquet"
    bad.write_bytes(bytes(blob))
    out = new_out(ch)
    st_ = read(bad, ch, out)
    assert 0 <= st_ < len(PQ.STATUS)
    # A corrupt zstd frame often still decodes (no frame checksum: pyarrow writes none), to garbage
    # that depends on the zstd build: the system's libzstd and pyarrow's bundled one were seen to
    # decode the same corrupt frame to different values, both without an error. Only a flip outside
    # the frames (page headers, v2 levels, an uncompressed chunk) has one right answer to demand.
    frames = compressed_payloads(path, ch)
    if any(pos in r for pos in flips for r in frames):
        return
    try:
        ref = read_column(bad, ch.row_group, ch.name)
    except Exception:  # pyarrow refuses the file: so must we
        assert st_ != 0, "accepted a chunk pyarrow refuses"
        return
    if st_ == 0:
        assert ref is not None and as_bytes(out) == ref.tobytes(), "accepted a chunk pyarrow reads differently"


@needs_pq
@settings(max_examples=100, **FAST)
@given(data=st.data())
def test_truncated_or_garbage_chunks_are_refused(workdir, originals, data):
    """A chunk cut short (size smaller than the footer says) is always refused; so is one followed
    by garbage, or pure random bytes; none crashes."""
    path, ch = data.draw(st.sampled_from(originals))
    out = new_out(ch)
    fd = os.open(path, os.O_RDONLY)
    try:
        cut = data.draw(st.integers(0, ch.size - 1))
        args = list(ch.args(fd))
        args[2] = cut
        assert PQ.read_chunk(*args, out) != 0
        args[2] = ch.size + data.draw(st.integers(1, 64))  # the next chunk's or the footer's bytes after it
        assert PQ.read_chunk(*args, out) != 0
    finally:
        os.close(fd)
    junk = workdir / "junk.bin"
    junk.write_bytes(data.draw(st.binary(min_size=1, max_size=300)))
    fd = os.open(junk, os.O_RDONLY)
    try:
        args = list(ch.args(fd))
        args[1:3] = [0, junk.stat().st_size]
        assert 0 < PQ.read_chunk(*args, out) < len(PQ.STATUS)
    finally:
        os.close(fd)


# -- the arguments ----------------------------------------------------------------------------------


@needs_pq
def test_bad_arguments_raise(workdir, originals):
    path, ch = next((p, c) for p, c in originals if c.name == "l")
    fd = os.open(path, os.O_RDONLY)
    try:
        good = list(ch.args(fd))
        assert PQ.read_chunk(*good, new_out(ch)) == 0
        n = ch.rows * ch.width
        with pytest.raises(ValueError, match="elements"):
            PQ.read_chunk(*good, np.empty(n - 1, np.int32))
        with pytest.raises(ValueError, match="elements"):
            PQ.read_chunk(*good, np.empty(n + 1, np.int32))
        ro = np.empty(n, np.int32)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="writable"):
            PQ.read_chunk(*good, ro)
        with pytest.raises(ValueError, match="writable"):
            PQ.read_chunk(*good, bytes(4 * n))
        with pytest.raises(ValueError, match="contiguous"):
            PQ.read_chunk(*good, np.empty(2 * n, np.int32)[::2])
        with pytest.raises(TypeError, match="buffer"):
            PQ.read_chunk(*good, [0] * n)
        for bad_out in (memoryview(bytearray(4 * n)), np.empty(2 * n, np.float16), np.empty(n, np.uint32),
                        np.empty(n, ">i4"), np.empty(n, np.dtype([("a", np.int32)]))):
            with pytest.raises(ValueError, match="format"):
                PQ.read_chunk(*good, bad_out)
        for i, name in enumerate(["fd", "offset", "size", "codec", "physical", "max_rep", "max_def", "width", "rows"]):
            bad = list(good)
            bad[i] = 1.0
            with pytest.raises(TypeError, match=name):
                PQ.read_chunk(*bad, new_out(ch))
            bad[i] = "1"
            with pytest.raises(TypeError, match=name):
                PQ.read_chunk(*bad, new_out(ch))
            bad[i] = 2**70
            with pytest.raises(ValueError, match=name):
                PQ.read_chunk(*bad, new_out(ch))
            if name not in ("codec", "physical"):
                bad[i] = -1
                with pytest.raises(ValueError, match=name):
                    PQ.read_chunk(*bad, new_out(ch))
        with pytest.raises(ValueError, match="offset"):
            PQ.read_chunk(fd, 2**63 - 10, 100, *good[3:], new_out(ch))
        with pytest.raises(TypeError):
            PQ.read_chunk(*good)
        # statuses, not exceptions: what the chunk is, or where it is
        for i, value, want in [(3, 1, ST_CODEC), (3, -3, ST_CODEC), (4, 0, ST_TYPE), (4, 2, ST_TYPE), (4, 99, ST_TYPE),
                               (5, 0, ST_LAYOUT), (6, 1, ST_LAYOUT), (7, 0, ST_LAYOUT), (1, 1 << 40, ST_SHORT),
                               (7, 1, ST_COUNT), (7, 4, ST_LIST), (2, ch.size - 1, ST_PAST), (2, 1 << 50, ST_SHORT)]:
            bad = list(good)
            bad[i] = value
            out = np.empty(ch.rows * max(bad[7], 1), np.int32)
            assert PQ.read_chunk(*bad, out) == want, (i, value, PQ.STATUS[PQ.read_chunk(*bad, out)])
    finally:
        os.close(fd)
    closed = os.open(path, os.O_RDONLY)
    os.close(closed)
    assert PQ.read_chunk(closed, *good[1:], new_out(ch)) == ST_READ


@needs_pq
def test_output_formats_numpy_and_struct_forms(workdir):
    """Every spelling of each output type a buffer exports: NumPy's (b h i l q f d), memoryview.cast's
    (native, with or without @), ctypes' (< prefixed; its c_long is '<q')."""
    import ctypes

    types = {"b": (pa.int8(), np.int8, ctypes.c_int8), "h": (pa.int16(), np.int16, ctypes.c_int16),
             "i": (pa.int32(), np.int32, ctypes.c_int32), "q": (pa.int64(), np.int64, ctypes.c_int64),
             "f": (pa.float32(), np.float32, ctypes.c_float), "d": (pa.float64(), np.float64, ctypes.c_double)}
    for code, (typ, dtype, ctype) in types.items():
        v = np.arange(-50, 50).astype(dtype)
        path = workdir / f"fmt-{code}.parquet"
        pq.write_table(pa.Table.from_arrays([pa.array(v, type=typ)], schema=pa.schema([pa.field("x", typ, nullable=False)])),
                       path, use_dictionary=False, compression="zstd")
        (ch,) = chunks(path)
        forms = [np.empty(100, dtype), np.empty((10, 10), dtype), memoryview(bytearray(100 * v.itemsize)).cast(code),
                 memoryview(bytearray(100 * v.itemsize)).cast("@" + code), (ctype * 100)()]
        if code == "q":  # NumPy's int64 is 'l' (C long: 8 bytes here), and its longlong 'q'
            forms += [np.empty(100, np.longlong), memoryview(bytearray(800)).cast("l")]
        for out in forms:
            assert read(path, ch, out) == 0, (code, memoryview(out).format)
            assert as_bytes(out) == v.tobytes()


# -- threads, zstd, the loader -----------------------------------------------------------------------


@needs_pq
def test_threads_read_chunks_at_once(originals):
    """Many calls on threads at once (the GIL released, zstd loaded once): each gets its own values."""
    want = {(p, c): read_column(p, c.row_group, c.name).tobytes() for p, c in originals}

    def one(item):
        p, c = item
        out = new_out(c, "memoryview")
        return read(p, c, out), as_bytes(out)

    with ThreadPoolExecutor(4) as pool:
        for item, (st_, got) in zip(originals * 4, pool.map(one, originals * 4)):
            assert st_ == 0 and got == want[item]


@needs_pq
def test_zstd_version():
    v = PQ.zstd_version()
    assert v is not None and v.count(".") == 2 and all(x.isdigit() for x in v.split("."))


@needs_pq
def test_without_libzstd_zstd_chunks_are_refused_and_the_rest_read(workdir, originals):
    """A libzstd without the functions found first (LD_LIBRARY_PATH): zstd_version() is None, a zstd
    chunk is refused with "zstd library unavailable", an uncompressed one still reads."""
    import shutil
    import sysconfig

    cc = shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0])
    if cc is None or sys.platform != "linux":
        pytest.skip("needs a C compiler and Linux's dlopen search order to plant a fake libzstd")
    fake = workdir / "fakezstd"
    fake.mkdir(exist_ok=True)
    src = fake / "fake.c"
    src.write_text("int not_zstd(void) { return 0; }\n")
    for name in ("libzstd.so.1", "libzstd.so"):
        subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(fake / name)], check=True)
    zstd = next((p, c) for p, c in originals if c.codec == 6 and c.name == "l")
    plain = next((p, c) for p, c in originals if c.codec == 0 and c.name == "l")
    jobs = [(str(p), c.args(0)) for p, c in (zstd, plain)]
    code = textwrap.dedent(f"""
        import os, sys
        from traces import pq_native as p
        m = p.load()
        assert m is not None, p.why_unavailable()
        print(m.zstd_version())
        out = []
        for path, args in {jobs!r}:
            fd = os.open(path, os.O_RDONLY)
            buf = memoryview(bytearray(4 * args[-1] * args[-2])).cast("i")
            out.append(m.read_chunk(fd, *args[1:], buf))
            os.close(fd)
        print(out)
        assert "numpy" not in sys.modules and "pyarrow" not in sys.modules
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LD_LIBRARY_PATH": str(fake)}
    env.pop("MOE_REPLAY_AOT", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:2] == ["None", f"[{ST_ZSTD_MISSING}, 0]"]


@needs_pq
def test_statuses_are_short_and_distinct():
    assert PQ.STATUS[0] == "ok"
    assert len(set(PQ.STATUS)) == len(PQ.STATUS) and all(0 < len(s) <= 90 for s in PQ.STATUS)


@needs_pq
def test_env_turns_it_off(monkeypatch):
    assert pq_native.AVAILABLE and pq_native.load() is PQ and pq_native.why_unavailable() is None
    monkeypatch.setenv("MOE_REPLAY_AOT", "0")
    assert pq_native.load() is None and not pq_native.AVAILABLE
    assert "compiled Parquet reader" in pq_native.why_unavailable() and "MOE_REPLAY_AOT=0" in pq_native.why_unavailable()


def test_an_extension_found_outside_its_package_or_stale_is_refused(tmp_path, monkeypatch):
    """traces.compiled.Extension: a build older than its source, or importable from elsewhere, is
    refused with a sentence naming it (replay.aot's messages, tested there, are the same helper's)."""
    from traces.compiled import Extension

    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_ext.py").write_text("X = 1\n")
    (pkg / "_ext.c").write_text("")
    os.utime(pkg / "_ext.py", (1000, 1000))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("MOE_REPLAY_AOT", raising=False)
    ext = Extension("fakepkg._ext", "fakepkg/_ext.c", purpose="to test", what="it is")
    assert ext.load() is None and "is older than fakepkg/_ext.c" in ext.why_unavailable()
    os.utime(pkg / "_ext.py", None)
    os.utime(pkg / "_ext.c", (1000, 1000))
    ext = Extension("fakepkg._ext", "fakepkg/_ext.c", purpose="to test", what="it is")
    assert ext.load() is not None and ext.why_unavailable() is None
    missing = Extension("fakepkg._absent", "fakepkg/_absent.c", purpose="to test", what="it is")
    assert missing.load() is None and missing.why_unavailable().startswith("fakepkg._absent is not built")
    monkeypatch.setenv("MOE_REPLAY_AOT", "0")
    assert ext.load() is None and ext.why_unavailable() == "it is turned off (MOE_REPLAY_AOT=0 in the environment)"


@needs_pq
def test_importing_it_needs_no_numpy_or_pyarrow():
    # a few milliseconds; generous for a loaded machine
    assert loader_import_seconds("traces.pq_native", ("numpy", "pyarrow", "numba", "polars")) < 0.05


def _c_compiler() -> str | None:
    import shlex
    import shutil
    import sysconfig

    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    return shutil.which(cc[0]) if cc else None


@pytest.mark.skipif(not os.environ.get("CI"), reason="checked in CI only (a plain pytest run may use a tree built without it)")
def test_built_in_ci_where_a_compiler_is_present():
    """The build is optional, so a compile error in traces/_pq.c would only skip the tests above:
    in CI, with a compiler, it must have been built."""
    if _c_compiler() is None or os.environ.get("MOE_REPLAY_AOT", "").strip() == "0":
        pytest.skip("no C compiler here, or MOE_REPLAY_AOT=0")
    assert PQ is not None, pq_native.why_unavailable()
