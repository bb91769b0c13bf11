"""traces.footer, the pure-Python Parquet footer and ARROW:schema reader, against its twin: pyarrow's
own reading of the same files (pf.metadata, pf.schema, pf.schema_arrow).

Random tables of many Arrow types written with random writer options must read exactly as pyarrow
reads them; the trace writer's routings files must too; corrupt files must raise FooterError (and
nothing else, and never hang); and the module must not import numpy or pyarrow.
"""

from __future__ import annotations

import base64
import decimal
import io
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from traces.footer import ArrowField, FooterError, arrow_schema, read_footer

ROOT = Path(__file__).resolve().parent.parent

PHYSICAL = ["BOOLEAN", "INT32", "INT64", "INT96", "FLOAT", "DOUBLE", "BYTE_ARRAY", "FIXED_LEN_BYTE_ARRAY"]
PHYSICAL_PRINTED = ["boolean", "int32", "int64", "int96", "float", "double", "binary", "fixed_len_byte_array"]
CODECS = ["UNCOMPRESSED", "SNAPPY", "GZIP", "LZO", "BROTLI", "LZ4", "ZSTD", "LZ4_RAW"]
ENCODINGS = {0: "PLAIN", 2: "PLAIN_DICTIONARY", 3: "RLE", 4: "BIT_PACKED", 5: "DELTA_BINARY_PACKED",
             6: "DELTA_LENGTH_BYTE_ARRAY", 7: "DELTA_BYTE_ARRAY", 8: "RLE_DICTIONARY", 9: "BYTE_STREAM_SPLIT"}
CONVERTED = ["UTF8", "MAP", "MAP_KEY_VALUE", "LIST", "ENUM", "DECIMAL", "DATE", "TIME_MILLIS", "TIME_MICROS",
             "TIMESTAMP_MILLIS", "TIMESTAMP_MICROS", "UINT_8", "UINT_16", "UINT_32", "UINT_64", "INT_8", "INT_16",
             "INT_32", "INT_64", "JSON", "BSON", "INTERVAL"]
REPETITION = ["required", "optional", "repeated"]
UNITS = {"MILLIS": "milliseconds", "MICROS": "microseconds", "NANOS": "nanoseconds"}
# Schema.fbs Type union numbers of the types the tables below use and arrow_schema reports as "other".
OTHER_IDS = {"struct": 13, "timestamp": 10, "date32": 8, "decimal128": 7, "large_string": 20,
             "large_binary": 19, "time64": 9, "map": 17, "null": 1}


# -- random tables ---------------------------------------------------------------------------------------

def _ints(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


def _values(rng: random.Random, kind: str, n: int) -> pa.Array:
    """n non-null values of a column kind (nulls are added by the caller)."""
    if kind.startswith(("int", "uint")):
        bits = int(kind.lstrip("uint"))
        lo, hi = (0, (1 << bits) - 1) if kind.startswith("u") else (-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
        return pa.array(_ints(rng, n, lo, hi), type=getattr(pa, kind)())
    if kind == "float16":
        return pa.array(np.array([rng.uniform(-9, 9) for _ in range(n)], dtype=np.float16))
    if kind in ("float32", "float64"):
        return pa.array([rng.uniform(-1e6, 1e6) for _ in range(n)], type=getattr(pa, kind)())
    if kind == "bool":
        return pa.array([rng.random() < 0.5 for _ in range(n)], type=pa.bool_())
    if kind in ("string", "large_string"):
        return pa.array(["".join(rng.choice("abcé東") for _ in range(rng.randint(0, 5))) for _ in range(n)],
                        type=getattr(pa, kind)())
    if kind in ("binary", "large_binary"):
        return pa.array([rng.randbytes(rng.randint(0, 6)) for _ in range(n)], type=getattr(pa, kind)())
    if kind == "timestamp_ms":
        return pa.array(_ints(rng, n, 0, 1 << 40), type=pa.timestamp("ms"))
    if kind == "timestamp_us_utc":
        return pa.array(_ints(rng, n, 0, 1 << 50), type=pa.timestamp("us", tz="UTC"))
    if kind == "date32":
        return pa.array(_ints(rng, n, 0, 30000), type=pa.date32())
    if kind == "time64":
        return pa.array(_ints(rng, n, 0, 86_399_999_999), type=pa.time64("us"))
    if kind == "decimal128":
        return pa.array([decimal.Decimal(rng.randint(-99999, 99999)).scaleb(-2) for _ in range(n)],
                        type=pa.decimal128(5, 2))
    if kind == "dictionary":
        return pa.array([rng.choice(["red", "green", "blue"]) for _ in range(n)], type=pa.string()).dictionary_encode()
    raise AssertionError(kind)


SCALARS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
           "float64", "bool", "string", "binary", "large_string", "large_binary", "timestamp_ms", "timestamp_us_utc",
           "date32", "time64", "decimal128", "dictionary"]
NESTED = ["fixed_size_list", "list", "large_list", "struct", "map"]


def _with_nulls(rng: random.Random, arr: pa.Array, nullable: bool) -> pa.Array:
    if not nullable or len(arr) == 0:
        return arr
    mask = pa.array([rng.random() < 0.3 for _ in range(len(arr))])
    if isinstance(arr, pa.DictionaryArray):
        return pa.DictionaryArray.from_arrays(pc.if_else(mask, None, arr.indices), arr.dictionary)
    if pa.types.is_fixed_size_list(arr.type) or pa.types.is_struct(arr.type):
        return pc.if_else(mask, pa.scalar(None, arr.type), arr)
    return pc.if_else(mask, None, arr)


def _column(rng: random.Random, kind: str, nullable: bool, n: int) -> tuple[pa.Field, pa.Array]:
    if kind == "fixed_size_list":
        value_kind = rng.choice(["int32", "float32", "uint8"])
        k = rng.randint(1, 4)
        child_nullable = rng.random() < 0.5
        values = _with_nulls(rng, _values(rng, value_kind, n * k), child_nullable)
        typ = pa.list_(pa.field("item", values.type, nullable=child_nullable), k)
        arr = pa.FixedSizeListArray.from_arrays(values, type=typ)
    elif kind in ("list", "large_list"):
        lengths = _ints(rng, n, 0, 3)
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        values = _values(rng, "int32", int(offsets[-1]))
        cls = pa.ListArray if kind == "list" else pa.LargeListArray
        arr = cls.from_arrays(pa.array(offsets, type=pa.int32() if kind == "list" else pa.int64()), values)
    elif kind == "struct":
        arr = pa.StructArray.from_arrays([_values(rng, "int32", n), _values(rng, "string", n)], names=["x", "y"])
    elif kind == "map":
        lengths = _ints(rng, n, 0, 2)
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int32)])
        m = int(offsets[-1])
        arr = pa.MapArray.from_arrays(pa.array(offsets, type=pa.int32()), _values(rng, "string", m),
                                      _values(rng, "int16", m))
    else:
        arr = _values(rng, kind, n)
    arr = _with_nulls(rng, arr, nullable)
    return arr.type, arr


NAME_CHARS = "abcxyz_019é"


@st.composite
def tables(draw: st.DrawFn) -> tuple[pa.Table, dict]:
    """A random table and random pq.write_table options."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
    n = draw(st.integers(1, 40))  # an empty table: test_empty_table_refused
    kinds = draw(st.lists(st.sampled_from(SCALARS + NESTED), min_size=1, max_size=5))
    names = draw(st.lists(st.text(NAME_CHARS, min_size=1, max_size=6), min_size=len(kinds), max_size=len(kinds),
                          unique=True))
    fields, arrays = [], []
    for name, kind in zip(names, kinds):
        nullable = draw(st.booleans())
        typ, arr = _column(rng, kind, nullable, n)
        fields.append(pa.field(name, typ, nullable=nullable))
        arrays.append(arr)
    meta = draw(st.none() | st.dictionaries(st.text(NAME_CHARS, min_size=1, max_size=5), st.text(max_size=8),
                                            max_size=3))
    table = pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=meta))
    opts = {
        "compression": draw(st.sampled_from(["none", "zstd", "snappy", "gzip"])),
        "use_dictionary": draw(st.booleans()),
        "data_page_size": draw(st.sampled_from([None, 64, 4096])),
        "row_group_size": draw(st.sampled_from([None, 1, 7, 16])),
        "data_page_version": draw(st.sampled_from(["1.0", "2.0"])),
        "write_statistics": draw(st.booleans()),
        "store_schema": draw(st.booleans()),
        "version": draw(st.sampled_from(["1.0", "2.4", "2.6"])),
        "write_page_index": draw(st.booleans()),
    }
    if draw(st.booleans()):
        opts["sorting_columns"] = [pq.SortingColumn(0)]
    if draw(st.booleans()):
        first_leaf = table.schema[0].name  # a plain column's path is its name; a nested one's is refused
        t0 = table.schema[0].type
        if pa.types.is_integer(t0) or pa.types.is_floating(t0) or pa.types.is_string(t0) or pa.types.is_binary(t0):
            opts["bloom_filter_options"] = {first_leaf: {"ndv": 16, "fpp": 0.1}}
    split = [f.name for f in table.schema if f.type in (pa.float32(), pa.float64(), pa.int32(), pa.int64())]
    if split and draw(st.booleans()):
        opts["use_byte_stream_split"] = split
    return table, opts


# -- the twin comparison -----------------------------------------------------------------------------------

_LINE = re.compile(r"^(\s*)(required|optional|repeated) (group|[a-z_0-9]+(?:\((\d+)\))?) field_id=(-?\d+) "
                   r"(\S+)(?: \((.*)\))?( \{|;)$")


def _printed_schema(pf: pq.ParquetFile) -> list[tuple]:
    """pyarrow's printed Parquet schema as (repetition, physical or 'group', type length, field id, name,
    annotation, number of children) per element, in pre-order."""
    out: list[list] = []
    open_groups: list[int] = []
    for line in str(pf.schema).splitlines()[1:]:
        if not line.strip():
            continue
        if line.strip() == "}":
            open_groups.pop()
            continue
        m = _LINE.match(line)
        assert m, line
        _, rep, kind, length, fid, name, note, end = m.groups()
        if open_groups:
            out[open_groups[-1]][6] += 1
        out.append([rep, kind.split("(")[0], int(length) if length else None, int(fid), name, note, 0])
        if end == " {":
            open_groups.append(len(out) - 1)
    assert not open_groups
    return [tuple(x) for x in out]


def _logical_json(logical: tuple | None) -> dict:
    """Our logical tuple as pyarrow's ParquetLogicalType.to_json() spells it."""
    if logical is None:
        return {"Type": "None"}
    kind = logical[0]
    simple = {"STRING": "String", "MAP": "Map", "LIST": "List", "ENUM": "Enum", "DATE": "Date", "JSON": "JSON",
              "BSON": "BSON", "UUID": "UUID", "FLOAT16": "Float16"}
    if kind in simple:
        return {"Type": simple[kind]}
    if kind == "INTEGER":
        return {"Type": "Int", "bitWidth": logical[1], "isSigned": logical[2]}
    if kind == "DECIMAL":
        return {"Type": "Decimal", "scale": logical[1], "precision": logical[2]}
    if kind in ("TIME", "TIMESTAMP"):
        return {"Type": kind.title(), "isAdjustedToUTC": logical[1], "timeUnit": UNITS[logical[2]]}
    raise AssertionError(logical)


def assert_like_pyarrow(path: Path, printed: bool = True) -> None:
    """Every number read_footer reports equals pyarrow's reading of the same file. ``printed=False``
    for a corrupted file: its schema elements are not compared against pyarrow's printed schema
    (which needs names without blanks), nor its stored converted types against those pyarrow derives
    from its logical types."""
    import json

    f = read_footer(path)
    pf = pq.ParquetFile(path)
    md = pf.metadata
    assert f.num_rows == md.num_rows
    assert f.created_by == (md.created_by or None)  # pyarrow presents a missing one as ""
    assert f.kv == {k.decode(): v.decode() for k, v in (md.metadata or {}).items()}
    # The schema elements, against pyarrow's printed tree.
    exact = printed
    printed = _printed_schema(pf) if exact else [(None,) * 7] * len(f.schema)
    ours = []
    for e in f.schema:
        kind = "group" if e.type is None else PHYSICAL_PRINTED[e.type]
        length = e.type_length if e.type == 7 else None
        rep = REPETITION[e.repetition] if e.repetition is not None else "required"
        ours.append((rep, kind, length, -1 if e.field_id is None else e.field_id, e.name))
    if printed[0][0] is not None:
        assert [p[:5] for p in printed] == ours
        assert [p[6] for p in printed] == [e.num_children or 0 for e in f.schema]
    for p, e in zip(printed, f.schema):
        if e.type is None and p[0] is not None:  # a group: its annotation is its logical (or converted) type
            note = {("LIST",): "List", ("MAP",): "Map"}.get(e.logical) if e.logical else \
                {3: "List", 1: "Map"}.get(e.converted_type)
            assert p[5] == note
    # The leaves.
    assert len(f.leaves) == len(pf.schema)
    for j, leaf in enumerate(f.leaves):
        col = pf.schema.column(j)
        assert ".".join(leaf.path) == col.path
        assert leaf.max_def == col.max_definition_level
        assert leaf.max_rep == col.max_repetition_level
        assert PHYSICAL[leaf.element.type] == col.physical_type
        conv = CONVERTED[leaf.element.converted_type] if leaf.element.converted_type is not None else "NONE"
        want = json.loads(col.logical_type.to_json())
        if leaf.element.logical is None:
            assert conv == col.converted_type
            # pyarrow derives a LogicalType from a converted type alone
            assert want["Type"] == "None" or (conv != "NONE" and not exact)
        else:
            # pyarrow presents the converted type its LogicalType maps to, not the stored one (which
            # pyarrow writes as that one, or none)
            assert col.converted_type in (conv, "NONE") or not exact
            got = _logical_json(leaf.element.logical)
            assert {k: want.get(k) for k in got} == got
        if leaf.element.type == 7:
            assert leaf.element.type_length == col.length
    # The row groups and their chunks.
    assert len(f.row_groups) == md.num_row_groups
    for i, g in enumerate(f.row_groups):
        rg = md.row_group(i)
        assert (g.num_rows, g.total_byte_size) == (rg.num_rows, rg.total_byte_size)
        assert len(g.chunks) == rg.num_columns == len(f.leaves)
        for j, c in enumerate(g.chunks):
            cc = rg.column(j)
            assert c.file_path is None and cc.file_path == ""
            assert ".".join(c.path) == cc.path_in_schema
            assert PHYSICAL[c.physical] == cc.physical_type
            assert CODECS[c.codec] == cc.compression
            assert tuple(ENCODINGS[e] for e in c.encodings) == cc.encodings
            assert c.num_values == cc.num_values
            assert c.total_compressed_size == cc.total_compressed_size
            assert c.total_uncompressed_size == cc.total_uncompressed_size
            assert c.data_page_offset == cc.data_page_offset
            assert c.dictionary_page_offset == (cc.dictionary_page_offset if cc.has_dictionary_page else None)
            assert c.index_page_offset is None  # pyarrow neither writes nor exposes it


def arrow_twin(field: pa.Field) -> ArrowField:
    """pyarrow's presented field in arrow_schema's terms (the slow, obvious converter)."""
    t = field.type
    dictionary = pa.types.is_dictionary(t)
    if dictionary:
        t = t.value_type
    if pa.types.is_integer(t):
        typ: tuple = ("int", t.bit_width, pa.types.is_signed_integer(t))
    elif pa.types.is_floating(t):
        typ = ("float", t.bit_width)
    elif pa.types.is_boolean(t):
        typ = ("bool",)
    elif pa.types.is_string(t):
        typ = ("utf8",)
    elif pa.types.is_binary(t):
        typ = ("binary",)
    elif pa.types.is_fixed_size_list(t):
        typ = ("fixed_size_list", t.list_size, arrow_twin(t.value_field))
    elif pa.types.is_list(t):
        typ = ("list", arrow_twin(t.value_field))
    elif pa.types.is_large_list(t):
        typ = ("large_list", arrow_twin(t.value_field))
    else:
        typ = ("other", OTHER_IDS[_other_name(t)])
    return ArrowField(field.name, field.nullable, typ, dictionary)


def _other_name(t: pa.DataType) -> str:
    for name in OTHER_IDS:
        if getattr(pa.types, f"is_{name}")(t):
            return name
    raise AssertionError(f"the tests use no {t}")


SUPPORTED_KINDS = {"int", "float", "bool", "utf8", "binary", "fixed_size_list", "list", "large_list"}
_I32 = ArrowField("item", True, ("int", 32, True))
SUPPORTED_EXAMPLES = [("int", 32, True), ("int", 8, False), ("float", 16), ("float", 64), ("bool",), ("utf8",),
                      ("binary",), ("fixed_size_list", 2, _I32), ("list", _I32), ("large_list", _I32)]


def stored_twin(f) -> list[ArrowField]:
    """The stored ARROW:schema as pyarrow's IPC reader decodes it."""
    stored = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(f.kv["ARROW:schema"])))
    return [arrow_twin(stored.field(i)) for i in range(len(stored))]


def assert_arrow_like_pyarrow(path: Path, may_refuse: bool = False) -> bool:
    """arrow_schema equals pf.schema_arrow, names of list children included; or, where ``may_refuse``,
    it raises FooterError and pyarrow presents some field otherwise than stored. Whether it read."""
    from traces.footer import _stored_schema

    f = read_footer(path)
    pf = pq.ParquetFile(path)
    want = [arrow_twin(pf.schema_arrow.field(i)) for i in range(len(pf.schema_arrow))]
    stored = stored_twin(f)
    assert repr(_stored_schema(f.kv["ARROW:schema"])) == repr(stored)  # the flatbuffer decoder alone
    try:
        got = arrow_schema(f)
    except FooterError:
        assert may_refuse
        assert stored != want  # refused only where pyarrow presents something else than stored
        return False
    assert got == want
    assert repr(got) == repr(want)
    for g, w in zip(got, want):
        assert hash(g) == hash(w)
        if g.type[0] == "other":
            assert all(g != ArrowField(g.name, g.nullable, t, g.dictionary) for t in SUPPORTED_EXAMPLES)
    return True


# -- the tests --------------------------------------------------------------------------------------------

def _write(tmp_path: Path, table: pa.Table, opts: dict, name: str = "t.parquet") -> Path:
    path = tmp_path / name
    pq.write_table(table, path, **opts)
    return path


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tables())
def test_random_tables_read_like_pyarrow(tmp_path, case):
    table, opts = case
    path = _write(tmp_path, table, opts)
    assert_like_pyarrow(path)
    if opts["store_schema"]:
        assert_arrow_like_pyarrow(path, may_refuse=True)
    else:
        with pytest.raises(FooterError, match="stores no Arrow schema"):
            arrow_schema(read_footer(path))


@pytest.mark.parametrize("use_dictionary", [False, True])
def test_empty_table_refused(tmp_path, use_dictionary):
    """pyarrow writes an empty column chunk with data_page_offset 0 and its one (empty) page recorded
    as a dictionary page: refused, the caller falls back (no trace part is empty)."""
    path = _write(tmp_path, pa.table({"a": pa.array([], pa.int32())}), {"use_dictionary": use_dictionary})
    with pytest.raises(FooterError, match="outside the file's data|not before its data pages"):
        read_footer(path)


def test_every_kind_at_least_once(tmp_path):
    """One table holding every column kind the strategy draws from, so none depends on luck."""
    rng = random.Random(5)
    fields, arrays = [], []
    for i, kind in enumerate(SCALARS + NESTED):
        for nullable in (False, True):
            typ, arr = _column(rng, kind, nullable, 9)
            fields.append(pa.field(f"c{i}{'n' if nullable else ''}", typ, nullable=nullable))
            arrays.append(arr)
    table = pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata={"k": "v", "empty": ""}))
    for opts in ({}, {"version": "1.0", "compression": "gzip", "row_group_size": 4, "data_page_version": "2.0"},
                 {"use_dictionary": False, "write_statistics": False, "compression": "none", "write_page_index": True}):
        path = _write(tmp_path, table, opts)
        assert_like_pyarrow(path)
        # Format version 1.0 stores uint32 as a plain INT64, which pyarrow reads as int64: refused.
        v1 = opts.get("version") == "1.0"
        assert assert_arrow_like_pyarrow(path, may_refuse=v1) != v1
    kinds = {a.type[0] for a in arrow_schema(read_footer(path))}
    assert SUPPORTED_KINDS | {"other"} <= kinds


def test_arrow_field_equality():
    i32 = ("int", 32, True)
    item, element = ArrowField("item", True, i32), ArrowField("element", True, i32)
    a = ArrowField("experts", False, ("fixed_size_list", 4, item))
    assert a == ArrowField("experts", False, ("fixed_size_list", 4, element))  # a list child's name is no part
    assert hash(a) == hash(ArrowField("experts", False, ("fixed_size_list", 4, element)))
    assert a != ArrowField("experts", False, ("fixed_size_list", 4, ArrowField("item", False, i32)))
    assert a != ArrowField("experts", False, ("fixed_size_list", 3, item))
    assert a != ArrowField("experts", True, ("fixed_size_list", 4, item))
    assert a != ArrowField("experts", False, ("list", item))
    assert a != ArrowField("experts", False, ("fixed_size_list", 4, item), dictionary=True)
    assert a != ArrowField("expert", False, ("fixed_size_list", 4, item))
    assert ArrowField("x", True, ("other", 13)) != ArrowField("x", True, ("int", 32, True))


# -- the trace writer's files ------------------------------------------------------------------------------

def test_synthetic_trace_parts(synth_trace_dir):
    for routing_only in (True, False):
        trace = synth_trace_dir(layers=3, experts=8, top_k=2, embd=8, tokens=20, prompt_tokens=4,
                                routing_only=routing_only, chunk_tokens=8)
        parts = sorted((trace / "routings").glob("part-*.parquet"))
        assert parts
        for part in parts:
            assert_like_pyarrow(part)
            assert_arrow_like_pyarrow(part)
        for name in ("router.parquet",):
            if (trace / name).exists():
                assert_like_pyarrow(trace / name)


@pytest.mark.parametrize("columns", [(), ("residency", "read_bytes", "dropped", "request", "token", "logits",
                                          "gate_input")])
def test_routings_written_with_writer_options(tmp_path, columns):
    from traces.schema import routings_schema
    from traces.writer import routings_write_options

    k, n_expert, n_embd, n = 3, 8, 4, 50
    meta = {"model": {"top_k": k, "n_expert": n_expert, "n_embd": n_embd}}
    schema = routings_schema(meta, columns)
    rng = np.random.default_rng(0)
    arrays = []
    for f in schema:
        t = f.type
        if pa.types.is_fixed_size_list(t):
            vt = t.value_type
            flat = rng.integers(0, 2, n * t.list_size).astype(vt.to_pandas_dtype())
            arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(flat, type=vt), t.list_size))
        else:
            arrays.append(pa.array(rng.integers(0, 100, n).astype(t.to_pandas_dtype()), type=t))
    path = tmp_path / "part-00000.parquet"
    pq.write_table(pa.Table.from_arrays(arrays, schema=schema), path, **routings_write_options(schema))
    assert_like_pyarrow(path)
    assert_arrow_like_pyarrow(path)
    got = arrow_schema(read_footer(path))
    experts = got[[a.name for a in got].index("experts")]
    assert repr(experts) == repr(ArrowField("experts", False, ("fixed_size_list", k, ArrowField("element", True, ("int", 32, True)))))


def test_bench_trace_part_if_present():
    path = Path("/tmp/moe-replay-bench-top1-100k/routings/part-00000.parquet")
    if not path.is_file():
        pytest.skip(f"{path} is absent (made by the cache_e2e benchmark)")
    assert_like_pyarrow(path)
    assert_arrow_like_pyarrow(path)


def test_fd_is_used_and_left_open(tmp_path):
    path = _write(tmp_path, pa.table({"a": [1, 2, 3]}), {})
    fd = os.open(path, os.O_RDONLY)
    try:
        f = read_footer("not/a/path", fd=fd)
        assert f.num_rows == 3
        os.fstat(fd)  # still open
    finally:
        os.close(fd)


# -- corruption ---------------------------------------------------------------------------------------------

def _sample_bytes() -> bytes:
    rng = random.Random(1)
    fields, arrays = [], []
    for i, kind in enumerate(["int32", "fixed_size_list", "string", "struct", "list", "dictionary", "float16"]):
        typ, arr = _column(rng, kind, i % 2 == 0, 12)
        fields.append(pa.field(f"c{i}", typ, nullable=i % 2 == 0))
        arrays.append(arr)
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata={"key": "value"})), buf,
                   row_group_size=5, write_page_index=True)
    return buf.getvalue()


SAMPLE = _sample_bytes()
SAMPLE_META_LEN = int.from_bytes(SAMPLE[-8:-4], "little")


def _read_bytes(tmp_path: Path, data: bytes):
    path = tmp_path / "x.parquet"
    path.write_bytes(data)
    return read_footer(path)


def _refused(tmp_path: Path, data: bytes) -> str:
    with pytest.raises(FooterError) as info:
        _read_bytes(tmp_path, data)
    msg = str(info.value)
    assert msg and "\n" not in msg
    return msg


def test_sample_reads(tmp_path):
    f = _read_bytes(tmp_path, SAMPLE)
    assert f.num_rows == 12 and len(f.row_groups) == 3
    assert_like_pyarrow(tmp_path / "x.parquet")


@pytest.mark.parametrize("cut", [0, 3, 4, 11, 12, 100, len(SAMPLE) - SAMPLE_META_LEN - 8, len(SAMPLE) - 9,
                                 len(SAMPLE) - 5, len(SAMPLE) - 4, len(SAMPLE) - 1])
def test_truncated_file(tmp_path, cut):
    _refused(tmp_path, SAMPLE[:cut])


def test_footer_length_outside_the_file(tmp_path):
    for length in (len(SAMPLE), len(SAMPLE) - 11, 2**32 - 1, 0):
        data = SAMPLE[:-8] + length.to_bytes(4, "little") + b"PAR1"
        assert "length" in _refused(tmp_path, data)
    # A length pointing inside the footer: the FileMetaData read from the middle is not one.
    for length in (SAMPLE_META_LEN - 1, SAMPLE_META_LEN + 1, 5):
        _refused(tmp_path, SAMPLE[:-8] + length.to_bytes(4, "little") + b"PAR1")


def test_magics(tmp_path):
    assert "start" in _refused(tmp_path, b"PAR2" + SAMPLE[4:])
    assert _refused(tmp_path, SAMPLE[:-4] + b"PARE") == "encrypted footer"
    assert "end" in _refused(tmp_path, SAMPLE[:-4] + b"PAR0")


def _routings_bytes() -> bytes:
    """A routings part as the trace writer writes it (every field of a supported kind)."""
    from traces.schema import routings_schema
    from traces.writer import routings_write_options

    schema = routings_schema({"model": {"top_k": 2, "n_expert": 8, "n_embd": 4}}, ("residency", "request"))
    rng = np.random.default_rng(3)
    n, arrays = 20, []
    for f in schema:
        t = f.type
        if pa.types.is_fixed_size_list(t):
            flat = pa.array(rng.integers(0, 8, n * t.list_size).astype(t.value_type.to_pandas_dtype()))
            arrays.append(pa.FixedSizeListArray.from_arrays(flat, t.list_size))
        else:
            arrays.append(pa.array(rng.integers(0, 8, n).astype(t.to_pandas_dtype()), type=t))
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_arrays(arrays, schema=schema), buf, **routings_write_options(schema))
    return buf.getvalue()


ROUTINGS = _routings_bytes()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
@pytest.mark.parametrize("which", ["sample", "routings"])
def test_flipped_footer_bytes(tmp_path, which, data):
    """A corrupt footer raises FooterError or, where it still parses, reads as pyarrow reads it; where
    arrow_schema reads it too, pyarrow opens it and presents the same schema."""
    good = SAMPLE if which == "sample" else ROUTINGS
    meta_len = int.from_bytes(good[-8:-4], "little")
    buf = bytearray(good)
    for _ in range(data.draw(st.integers(1, 4))):
        buf[len(good) - 8 - meta_len + data.draw(st.integers(0, meta_len - 1))] ^= data.draw(st.integers(1, 255))
    try:
        f = _read_bytes(tmp_path, bytes(buf))
    except FooterError as e:
        assert str(e) and "\n" not in str(e)
        return
    try:
        fields = arrow_schema(f)
        schema_read = True
    except FooterError:
        schema_read = False
    try:
        pq.ParquetFile(tmp_path / "x.parquet").schema_arrow  # noqa: B018
    except Exception:
        # pyarrow refuses a file whose ARROW:schema it cannot read (read_footer does not look into
        # it): arrow_schema must refuse it too, or hold a field the caller never accepts (the
        # parameters of "other" types and of dictionaries are checked less than pyarrow checks them).
        assert not schema_read or _has_other(fields) or any(a.dictionary for a in fields)
        return
    assert_like_pyarrow(tmp_path / "x.parquet", printed=False)
    if schema_read:
        assert_arrow_like_pyarrow(tmp_path / "x.parquet")


def _blob_footer(tmp_path: Path, data: bytes = SAMPLE):
    path = tmp_path / "x.parquet"
    path.write_bytes(data)
    return read_footer(path)


def _has_other(fields: list[ArrowField]) -> bool:
    return any(a.type[0] == "other" or (a.type[0] in ("list", "large_list", "fixed_size_list")
                                        and _has_other([a.type[-1]])) for a in fields)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
@pytest.mark.parametrize("which", ["sample", "routings"])
def test_flipped_schema_blob(tmp_path, which, data):
    """Random bytes flipped in the decoded IPC message (re-encoded), or random characters of the base64
    text changed: FooterError, or the fields pyarrow's IPC reader decodes (where no field is of an
    "other" kind, which the caller never accepts)."""
    from traces.footer import _stored_schema

    f = _blob_footer(tmp_path, SAMPLE if which == "sample" else ROUTINGS)
    blob = f.kv["ARROW:schema"]
    if data.draw(st.booleans()):
        raw = bytearray(base64.b64decode(blob))
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
        f.kv["ARROW:schema"] = base64.b64encode(bytes(raw)).decode()
    else:
        chars = list(blob)
        for _ in range(data.draw(st.integers(1, 3))):
            chars[data.draw(st.integers(0, len(chars) - 1))] = data.draw(st.sampled_from(
                "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=!"))
        f.kv["ARROW:schema"] = "".join(chars)
    try:
        stored = _stored_schema(f.kv["ARROW:schema"])
    except FooterError as e:
        assert str(e) and "\n" not in str(e)
        with pytest.raises(FooterError):
            arrow_schema(f)
        return
    try:
        arrow_schema(f)
    except FooterError as e:
        assert str(e) and "\n" not in str(e)
    if not _has_other(stored):
        assert repr(stored) == repr(stored_twin(f))


def test_schema_blob_edges(tmp_path):
    f = _blob_footer(tmp_path)
    good = base64.b64decode(f.kv["ARROW:schema"])
    for raw in (b"", b"\xff\xff\xff\xff", good[:8], good[:40], good[:-200], b"\xff\xff\xff\xff" + b"\x00" * 12,
                b"\x10\x00\x00\x00" + b"\x00" * 16, good[:4] + (1 << 30).to_bytes(4, "little") + good[8:]):
        f.kv["ARROW:schema"] = base64.b64encode(raw).decode()
        with pytest.raises(FooterError):
            arrow_schema(f)
    f.kv["ARROW:schema"] = "not base64!"
    with pytest.raises(FooterError, match="base64"):
        arrow_schema(f)


def _with_extra_field(meta: bytes, extra: bytes) -> bytes:
    """FileMetaData bytes with ``extra`` (field headers and values) inserted before its stop byte."""
    assert meta[-1] == 0
    return meta[:-1] + extra + b"\x00"


def _file_with_meta(meta: bytes) -> bytes:
    body = SAMPLE[:len(SAMPLE) - 8 - SAMPLE_META_LEN]
    return body + meta + len(meta).to_bytes(4, "little") + b"PAR1"


def test_handmade_footers(tmp_path):
    meta = SAMPLE[len(SAMPLE) - 8 - SAMPLE_META_LEN:-8]
    assert _read_bytes(tmp_path, _file_with_meta(meta)).num_rows == 12
    # Field 8, encryption_algorithm (a union: AES_GCM_V1, an empty struct), in a plaintext footer;
    # pyarrow's last field is 7 (column_orders), so the id delta is 1.
    assert "encrypted" in _refused(tmp_path, _file_with_meta(_with_extra_field(meta, b"\x1c\x1c\x00\x00")))
    # An unknown field (id 100, long form) holding a struct nested 2000 deep: refused, not a RecursionError.
    deep = b"\x0c\xc8\x01" + b"\x1c" * 2000 + b"\x00" * 2001
    assert "deep" in _refused(tmp_path, _file_with_meta(_with_extra_field(meta, deep)))
    # An unknown field holding a list that claims 2^40 elements: refused at once, not looped on.
    huge = b"\x09\xc8\x01" + b"\xf5" + (b"\xff" * 5 + b"\x1f")
    assert "list" in _refused(tmp_path, _file_with_meta(_with_extra_field(meta, huge)))
    # An unknown field the reader skips: read as before (as Thrift readers do).
    assert _read_bytes(tmp_path, _file_with_meta(_with_extra_field(meta, b"\x05\xc8\x01\x02"))).num_rows == 12
    # A varint of 11 bytes.
    assert "varint" in _refused(tmp_path, _file_with_meta(_with_extra_field(meta, b"\x06\xc8\x01" + b"\xff" * 10 + b"\x01")))
    # Bytes after the FileMetaData.
    assert "after" in _refused(tmp_path, _file_with_meta(meta + b"\x00"))


def test_chunk_in_another_file(tmp_path):
    """A _metadata-style file whose chunks name their data file: refused."""
    pq.write_table(pa.table({"a": [1, 2, 3]}), tmp_path / "data.parquet")
    md = pq.ParquetFile(tmp_path / "data.parquet").metadata
    md.set_file_path("data.parquet")
    md.write_metadata_file(tmp_path / "_metadata")
    assert "another file" in _refused(tmp_path, (tmp_path / "_metadata").read_bytes())


def test_imports_only_the_standard_library():
    code = ("import traces.footer, sys; "
            "bad = [m for m in ('numpy', 'pyarrow', 'polars', 'dataclasses') if m in sys.modules]; "
            "assert not bad, bad")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env)


# -- handmade footers: a naive Thrift compact encoder -------------------------------------------------------

def _uv(n: int) -> bytes:
    out = bytearray()
    while True:
        if n < 0x80:
            out.append(n)
            return bytes(out)
        out.append((n & 0x7F) | 0x80)
        n >>= 7


def _zz(n: int) -> bytes:
    return _uv((n << 1) ^ (n >> 63))


def _s(text: str) -> bytes:
    return _uv(len(text.encode())) + text.encode()


def _st(*fields: tuple[int, int, bytes]) -> bytes:
    """A struct of (field id, wire type, encoded value) fields, in the order given."""
    out, last = bytearray(), 0
    for fid, t, value in fields:
        out += bytes([((fid - last) << 4) | t]) if 0 < fid - last <= 15 else bytes([t]) + _zz(fid)
        out += value
        last = fid
    return bytes(out + b"\x00")


def _ls(et: int, elems: list[bytes]) -> bytes:
    n = len(elems)
    return (bytes([(n << 4) | et]) if n < 15 else bytes([0xF0 | et]) + _uv(n)) + b"".join(elems)


DATA = b"\x00" * 12  # stands for the column chunk's pages; only the footer is read


def _handmade(tmp_path: Path, column_extra=(), file_extra=(), leaf_extra=()) -> Path:
    """A file of one REQUIRED INT32 column "a", 3 rows in one row group, with extra Thrift fields."""
    schema = [_st((4, 8, _s("schema")), (5, 5, _zz(1))), _st((1, 5, _zz(1)), (3, 5, _zz(0)), (4, 8, _s("a")),
                                                              *leaf_extra)]
    meta = _st((1, 5, _zz(1)), (2, 9, _ls(5, [_zz(0)])), (3, 9, _ls(8, [_s("a")])), (4, 5, _zz(0)), (5, 6, _zz(3)),
               (6, 6, _zz(len(DATA))), (7, 6, _zz(len(DATA))), (9, 6, _zz(4)), *column_extra)
    chunk = _st((2, 6, _zz(4)), (3, 12, meta))
    group = _st((1, 9, _ls(12, [chunk])), (2, 6, _zz(len(DATA))), (3, 6, _zz(3)))
    footer = _st((1, 5, _zz(2)), (2, 9, _ls(12, schema)), (3, 6, _zz(3)), (4, 9, _ls(12, [group])), *file_extra)
    path = tmp_path / "h.parquet"
    path.write_bytes(b"PAR1" + DATA + footer + len(footer).to_bytes(4, "little") + b"PAR1")
    return path


def _pyarrow_refuses(path: Path) -> bool:
    try:
        md = pq.ParquetFile(path).metadata
        md.row_group(0).column(0).encodings  # noqa: B018
    except Exception:
        return True
    return False


def test_handmade_footer_reads_like_pyarrow(tmp_path):
    path = _handmade(tmp_path)
    f = read_footer(path)
    assert (f.num_rows, [leaf.path for leaf in f.leaves], f.row_groups[0].chunks[0].data_page_offset) == \
        (3, [("a",)], 4)
    assert_like_pyarrow(path)
    # Size statistics whose histograms fit the column's levels (0 and 0: one bucket each) read.
    fits = _st((2, 9, _ls(6, [_zz(3)])), (3, 9, _ls(6, [_zz(3)])))
    path = _handmade(tmp_path, column_extra=[(16, 12, fits)])
    read_footer(path)
    assert not _pyarrow_refuses(path)


@pytest.mark.parametrize("case", ["rep histogram", "def histogram", "byte array bytes"])
def test_size_statistics_that_do_not_fit(tmp_path, case):
    """parquet-cpp throws from a constructor on these, which aborts the whole process (pyarrow 26):
    refused, and pyarrow is not asked."""
    stats = {"rep histogram": _st((2, 9, _ls(6, [_zz(1), _zz(2)]))),
             "def histogram": _st((3, 9, _ls(6, [_zz(1), _zz(2)]))),
             "byte array bytes": _st((1, 6, _zz(5)))}[case]
    with pytest.raises(FooterError, match="size statistics"):
        read_footer(_handmade(tmp_path, column_extra=[(16, 12, stats)]))


def _refused_by_both(path: Path, match: str) -> None:
    with pytest.raises(FooterError, match=match):
        read_footer(path)
    assert _pyarrow_refuses(path)


def test_handmade_footers_pyarrow_refuses(tmp_path):
    type_order = _st((1, 12, _st()))
    _refused_by_both(_handmade(tmp_path, file_extra=[(7, 9, _ls(12, [type_order, type_order]))]), "column orders")
    # A PageEncodingStats without its required count.
    stats = _st((1, 5, _zz(0)), (2, 5, _zz(0)))
    _refused_by_both(_handmade(tmp_path, column_extra=[(13, 9, _ls(12, [stats]))]), "requires")


def test_handmade_footers_not_understood(tmp_path):
    """Annotations pyarrow 26 reads as "Undefined" (a LogicalType member parquet.thrift does not have
    yet, or one its physical type cannot carry): not understood here, refused."""
    with pytest.raises(FooterError, match="unknown logical type"):
        read_footer(_handmade(tmp_path, leaf_extra=[(10, 12, _st((30, 12, _st())))]))
    # An INT32 leaf annotated INTEGER(64, signed), which pyarrow 26 reads as an unannotated int32.
    int64 = _st((10, 12, _st((1, 3, bytes([64])), (2, 1, b""))))
    with pytest.raises(FooterError, match="annotation"):
        read_footer(_handmade(tmp_path, leaf_extra=[(10, 12, int64)]))


def test_handmade_footers_pyarrow_misreads(tmp_path):
    """What Thrift's generated reader would read otherwise than a skip by wire types: refused."""
    # encoding_stats declared list<PageEncodingStats>, written as a list of i32.
    with pytest.raises(FooterError, match="element type"):
        read_footer(_handmade(tmp_path, column_extra=[(13, 9, _ls(5, [_zz(1)]))]))
    # A field id beyond i16, which Thrift truncates to 5 (num_values, already read).
    with pytest.raises(FooterError, match="i16"):
        read_footer(_handmade(tmp_path, column_extra=[(65536 + 5, 6, _zz(99))]))


def test_handmade_field_met_twice(tmp_path):
    """A field met twice in one struct: the last is kept, as Thrift's reader (pyarrow's) keeps it, and
    each is checked as it is read, so a bad one is refused even where a good one follows."""
    value_twice = _st((1, 8, _s("k")), (2, 8, _s("v1")), (2, 8, _s("v2")))
    path = _handmade(tmp_path, file_extra=[(5, 9, _ls(12, [value_twice]))])
    assert read_footer(path).kv == {"k": "v2"}
    assert_like_pyarrow(path)
    path = _handmade(tmp_path, leaf_extra=[(1, 5, _zz(2)), (1, 5, _zz(1))])  # INT64, then INT32
    assert read_footer(path).leaves[0].element.type == 1
    assert_like_pyarrow(path)
    with pytest.raises(FooterError, match="physical type 9"):
        read_footer(_handmade(tmp_path, leaf_extra=[(1, 5, _zz(9)), (1, 5, _zz(1))]))
    # A TIMESTAMP whose unit is an empty union, then MICROS.
    timestamp = _st((1, 1, b""), (2, 12, _st()), (2, 12, _st((2, 12, _st()))))
    with pytest.raises(FooterError, match="unit"):
        read_footer(_handmade(tmp_path, leaf_extra=[(10, 12, _st((8, 12, timestamp)))]))
    # The key-value metadata twice: pyarrow keeps the second list only, so a reader merging both
    # could take an ARROW:schema pyarrow never sees. Refused.
    first, second = _st((1, 8, _s("a")), (2, 8, _s("1"))), _st((1, 8, _s("b")), (2, 8, _s("2")))
    with pytest.raises(FooterError, match="key-value metadata twice"):
        read_footer(_handmade(tmp_path, file_extra=[(5, 9, _ls(12, [first])), (5, 9, _ls(12, [second]))]))
