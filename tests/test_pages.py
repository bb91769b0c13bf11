"""traces.pages: the raw-page fast path for wide fixed-size-list columns must return exactly what
Arrow decodes (bit for bit, NaN payloads and -0.0 included), or None when the file's layout is
not the one it reads; and a trace read through it is the same trace."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traces.pages import read_fixed_list
from traces.reader import fixed_list_to_numpy

DTYPES = {"float32": (np.float32, pa.float32()), "float16": (np.float16, pa.float16()), "int32": (np.int32, pa.int32()),
          "float64": (np.float64, pa.float64())}


def _values(draw, dtype, shape):
    raw = draw(st.binary(min_size=int(np.prod(shape)) * np.dtype(dtype).itemsize,
                         max_size=int(np.prod(shape)) * np.dtype(dtype).itemsize))
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()  # any bit pattern: NaNs, -0.0, inf


@st.composite
def files(draw):
    kind = draw(st.sampled_from(sorted(DTYPES)))
    dtype, typ = DTYPES[kind]
    rows = draw(st.integers(0, 60))
    width = draw(st.integers(1, 40))
    nullable = draw(st.booleans())
    values = _values(draw, dtype, (rows, width))
    opts = {
        "row_group_size": draw(st.integers(1, 64)),
        "data_page_size": draw(st.sampled_from([64, 300, 4096, 1 << 20])),  # small: lists split across pages
        "data_page_version": draw(st.sampled_from(["1.0", "2.0"])),
        "write_statistics": draw(st.booleans()),
        "write_page_index": draw(st.booleans()),
        "write_page_checksum": draw(st.booleans()),
    }
    return values, typ, nullable, opts


def write(path, values, typ, nullable=True, compression="none", use_dictionary=False, **opts):
    elem = pa.field("element", typ, nullable=nullable)
    rows, width = values.shape
    arr = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), type=typ), type=pa.list_(elem, width))
    table = pa.table({"batch": pa.array(np.arange(rows, dtype=np.int32)), "gate_input": arr})
    pq.write_table(table, path, compression={"batch": "zstd", "gate_input.list.element": compression},
                   use_dictionary=use_dictionary, **opts)


def arrow_read(path):
    return fixed_list_to_numpy(pq.read_table(path, columns=["gate_input"]).column(0))


@settings(max_examples=150, deadline=None)
@given(files())
def test_fast_path_is_bit_identical_to_arrow(tmp_path_factory, f):
    values, typ, nullable, opts = f
    path = tmp_path_factory.mktemp("p") / "part.parquet"
    write(path, values, typ, nullable, **opts)
    got = read_fixed_list(path, "gate_input")
    want = arrow_read(path)
    assert got is not None, f"fast path refused a plain uncompressed file written with {opts}"
    assert got.dtype == want.dtype and got.shape == want.shape == values.shape
    assert got.tobytes() == want.tobytes() == values.tobytes()


def test_out_buffer_is_filled_in_place(tmp_path):
    values = np.arange(60, dtype=np.float32).reshape(12, 5)
    write(tmp_path / "p.parquet", values, pa.float32(), row_group_size=5, data_page_size=64)
    out = np.full((12, 5), -1, np.float32)
    assert read_fixed_list(tmp_path / "p.parquet", "gate_input", out=out) is out
    assert np.array_equal(out, values)
    with pytest.raises(ValueError, match="shape"):
        read_fixed_list(tmp_path / "p.parquet", "gate_input", out=np.empty((11, 5), np.float32))


@pytest.mark.parametrize("case", ["zstd", "snappy", "dictionary"])
def test_layouts_it_does_not_read_fall_back(tmp_path, case):
    values = np.tile(np.arange(8, dtype=np.float32), (30, 1))  # repetitive: a dictionary is worth it
    path = tmp_path / "p.parquet"
    if case == "dictionary":
        write(path, values, pa.float32(), use_dictionary=True)
        assert any("DICT" in e for e in pq.ParquetFile(path).metadata.row_group(0).column(1).encodings)
    else:
        write(path, values, pa.float32(), compression=case)
        assert pq.ParquetFile(path).metadata.row_group(0).column(1).compression == case.upper()
    assert read_fixed_list(path, "gate_input") is None
    assert np.array_equal(arrow_read(path), values)


def test_nulls_fall_back(tmp_path):
    # a nullable element with actual nulls: fewer values than level entries in a page
    typ = pa.list_(pa.field("element", pa.float32(), nullable=True), 3)
    arr = pa.FixedSizeListArray.from_arrays(pa.array([1.0, None, 3.0, 4.0, 5.0, None], type=pa.float32()), type=typ)
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"gate_input": arr}), path, compression="none", use_dictionary=False)
    assert read_fixed_list(path, "gate_input") is None


def test_not_a_fixed_list_or_absent(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"gate_input": pa.array([1.0, 2.0])}), path, compression="none")
    assert read_fixed_list(path, "gate_input") is None
    write(tmp_path / "q.parquet", np.ones((2, 2), np.float32), pa.float32())
    with pytest.raises(KeyError):
        read_fixed_list(tmp_path / "q.parquet", "logits")


def test_corrupt_page_header_is_refused(tmp_path):
    """Bytes overwritten inside a page header: the fast path returns None (Arrow then reports the
    file); it never guesses a layout."""
    values = np.random.default_rng(0).standard_normal((40, 16)).astype(np.float32)
    path = tmp_path / "p.parquet"
    write(path, values, pa.float32(), data_page_size=512)
    cc = pq.ParquetFile(path).metadata.row_group(0).column(1)
    data = bytearray(path.read_bytes())
    data[cc.data_page_offset + 1:cc.data_page_offset + 4] = b"\xff\xff\xff"
    path.write_bytes(bytes(data))
    assert read_fixed_list(path, "gate_input") is None


def test_changed_value_bytes_read_as_arrow_reads_them(tmp_path):
    """Bytes overwritten inside a page's values (not its header): the fast path returns exactly
    what Arrow decodes from the same file, the changed value included."""
    from traces.pages import plan_fixed_list

    values = np.random.default_rng(0).standard_normal((40, 16)).astype(np.float32)
    path = tmp_path / "p.parquet"
    write(path, values, pa.float32(), data_page_size=512)
    offset, _ = plan_fixed_list(path, "gate_input").spans[1]
    data = bytearray(path.read_bytes())
    data[offset + 4:offset + 8] = np.float32(1234.5).tobytes()
    path.write_bytes(bytes(data))
    got = read_fixed_list(path, "gate_input")
    assert got is not None and got.tobytes() == arrow_read(path).tobytes()
    assert got.tobytes() != values.tobytes() and 1234.5 in got


def test_trace_tables_are_the_same_through_either_path(tmp_path, monkeypatch):
    """Trace.iter_tables through the page path and through Arrow: equal tables, equal schemas
    (so parts read either way concatenate)."""
    import traces.reader as reader
    from tests.test_trace_format import write_small
    from traces import open_trace

    write_small(tmp_path / "t", columns=("logits", "gate_input"))
    tr = open_trace(tmp_path / "t")
    cols = ["batch", "logits", "layer", "gate_input"]
    assert all(reader.read_fixed_list(p, c) is not None for p in tr.parts for c in ("logits", "gate_input"))
    fast = list(tr.iter_tables(cols))
    monkeypatch.setattr(reader, "read_fixed_list", lambda *a, **k: None)
    slow = list(tr.iter_tables(cols))
    assert len(fast) == len(slow) > 1
    for a, b in zip(fast, slow):
        assert a.schema == b.schema and a.equals(b)
    assert tr.table(cols).num_rows == 15


@settings(max_examples=60, deadline=None)
@given(files())
def test_zstd_pages_read_bit_identical_to_arrow(tmp_path_factory, f):
    """The zstd page path (the narrow routing lists: experts, weights) reads every v1 layout it
    meets bit for bit as Arrow does; it declines v2 pages (Arrow reads them)."""
    from traces.pages import read_fixed_list_zstd

    values, typ, nullable, opts = f
    path = tmp_path_factory.mktemp("z") / "part.parquet"
    write(path, values, typ, nullable, compression="zstd", **opts)
    got = read_fixed_list(path, "gate_input", zstd=True)
    want = arrow_read(path)
    if opts["data_page_version"] == "1.0" and typ != pa.float16():
        assert got is not None, f"zstd path refused a v1 file written with {opts}"
    if got is not None:
        assert got.dtype == want.dtype and got.shape == want.shape == values.shape
        assert got.tobytes() == want.tobytes() == values.tobytes()
    assert read_fixed_list(path, "gate_input") is None  # without zstd=True: the uncompressed-only path, as before
    if got is not None:
        assert read_fixed_list_zstd(path, "gate_input").tobytes() == got.tobytes()


def test_corrupt_zstd_page_falls_back_and_arrow_names_the_file(tmp_path):
    from traces.errors import TraceError
    from traces.reader import read_part

    values = np.random.default_rng(0).integers(0, 100, (500, 8)).astype(np.int32)
    path = tmp_path / "p.parquet"
    write(path, values, pa.int32(), compression="zstd")
    cc = pq.ParquetFile(path).metadata.row_group(0).column(1)
    raw = bytearray(path.read_bytes())
    mid = cc.data_page_offset + cc.total_compressed_size // 2
    raw[mid:mid + 16] = b"\xff" * 16  # inside the compressed page body
    path.write_bytes(bytes(raw))
    assert read_fixed_list(path, "gate_input", zstd=True) is None
    with pytest.raises(TraceError, match="p.parquet"):
        read_part(path, ["gate_input"], fast=("gate_input",))
