"""Fast path for the wide columns: uncompressed PLAIN fixed-size-list pages copied straight out of
the Parquet file, without Arrow's level decoding.

Why: a ``gate_input`` row is ``n_embd`` floats stored as one Parquet list, so Arrow's reader
decodes a repetition and a definition level for every float (0.4-0.8 GiB/s here, slower than the
matrix products the stale-gate predictor does with them). The writer stores the wide columns
uncompressed and PLAIN-encoded, so the floats already lie in the file exactly as numpy wants
them, page by page; only the page headers (Thrift compact protocol) stand between them.

:func:`read_fixed_list` reads one column of one part file that way when every page proves it
holds nothing but values: the column chunk is uncompressed, every page is a data page (v1 or v2)
with PLAIN values and RLE levels, and each page's value bytes are exactly ``num_values x
width`` (so no level entry stands for a null or an empty list), and the pages of each row group
hold exactly ``rows x list_size`` values. Otherwise (a compressed or dictionary-encoded column,
nulls, an unknown page type) it returns None and the caller reads through Arrow: the fast path
never guesses. ``tests/test_pages.py`` checks it bit for bit against Arrow.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

# Thrift compact protocol type ids
_BOOL_TRUE, _BOOL_FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)
# parquet.thrift enums
DATA_PAGE, INDEX_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = 0, 1, 2, 3
PLAIN, RLE = 0, 3
_NUMPY = {"FLOAT": np.dtype("<f4"), "DOUBLE": np.dtype("<f8"), "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8")}


class PageFormatError(Exception):
    """The bytes are not the page layout this fast path reads (the caller falls back to Arrow)."""


class _Short(PageFormatError):
    """The buffer ends before the header (or a level length) does: read more and parse again."""


class _Compact:
    """Minimal Thrift compact-protocol reader over a bytes-like buffer: enough for PageHeader."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: memoryview, pos: int) -> None:
        self.buf = buf
        self.pos = pos

    def byte(self) -> int:
        if self.pos >= len(self.buf):
            raise _Short("page header runs past the buffer")
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        shift = result = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7
            if shift > 63:
                raise PageFormatError("varint longer than 10 bytes")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def skip(self, typ: int) -> None:
        if typ in (_BOOL_TRUE, _BOOL_FALSE):
            return
        if typ == _BYTE:
            self.pos += 1
        elif typ in (_I16, _I32, _I64):
            self.varint()
        elif typ == _DOUBLE:
            self.pos += 8
        elif typ == _BINARY:
            n = self.varint()  # read first: ``self.pos += self.varint()`` would add to the old pos
            self.pos += n
        elif typ in (_LIST, _SET):
            head = self.byte()
            size, elem = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            for _ in range(size):
                if elem in (_BOOL_TRUE, _BOOL_FALSE):
                    self.pos += 1  # booleans inside containers take a byte each
                else:
                    self.skip(elem)
        elif typ == _MAP:
            size = self.varint()
            if size:
                kv = self.byte()
                for _ in range(size):
                    self.skip(kv >> 4)
                    self.skip(kv & 0x0F)
        elif typ == _STRUCT:
            self.struct(lambda fid, t: False)
        else:
            raise PageFormatError(f"unknown Thrift compact type {typ}")
        if self.pos > len(self.buf):
            raise _Short("page header runs past the buffer")

    def struct(self, field) -> None:
        """Walk one struct; ``field(id, type)`` reads a field it wants and returns True, else it is skipped."""
        last = 0
        while True:
            head = self.byte()
            if head == 0:
                return
            delta, typ = head >> 4, head & 0x0F
            fid = last + delta if delta else self.zigzag()
            last = fid
            if not field(fid, typ):
                self.skip(typ)


def _page_header(c: _Compact) -> dict[str, int]:
    """PageHeader fields this path needs: type, compressed size, and the data page's counts."""
    out: dict[str, int] = {}

    def page_field(fid: int, typ: int) -> bool:
        if fid in (1, 2, 3) and typ == _I32:
            out[("type", "usize", "size")[fid - 1]] = c.zigzag()
            return True
        if fid in (5, 8) and typ == _STRUCT:
            out["v"] = 1 if fid == 5 else 2
            c.struct(v1_field if fid == 5 else v2_field)
            return True
        return False

    def v1_field(fid: int, typ: int) -> bool:
        names = {1: "num_values", 2: "encoding", 3: "def_encoding", 4: "rep_encoding"}
        if fid in names and typ == _I32:
            out[names[fid]] = c.zigzag()
            return True
        return False

    def v2_field(fid: int, typ: int) -> bool:
        names = {1: "num_values", 2: "num_nulls", 3: "num_rows", 4: "encoding", 5: "def_bytes", 6: "rep_bytes"}
        if fid in names and typ == _I32:
            out[names[fid]] = c.zigzag()
            return True
        if fid == 7 and typ in (_BOOL_TRUE, _BOOL_FALSE):
            out["is_compressed"] = int(typ == _BOOL_TRUE)
            return True
        return False

    c.struct(page_field)
    if "type" not in out or "size" not in out:
        raise PageFormatError("page header without type or size")
    return out


def _values_span(buf: memoryview, start: int, size: int, h: dict[str, int], max_rep: int, max_def: int) -> tuple[int, int]:
    """(offset, number of level entries) of a data page's PLAIN values inside ``buf``."""
    if h.get("encoding") != PLAIN:
        raise PageFormatError("values are not PLAIN-encoded")
    n = h.get("num_values", -1)
    if n < 0:
        raise PageFormatError("data page without num_values")
    if h["v"] == 2:
        if h.get("num_nulls", 0):
            raise PageFormatError("page holds nulls")
        return start + h.get("rep_bytes", 0) + h.get("def_bytes", 0), n
    pos = start
    for level_max, enc in ((max_rep, "rep_encoding"), (max_def, "def_encoding")):
        if level_max:
            if h.get(enc) != RLE:
                raise PageFormatError("levels are not RLE-encoded")
            if pos + 4 > start + size:
                raise PageFormatError("level length runs past the page")
            if pos + 4 > len(buf):
                raise _Short("level length runs past the buffer")
            pos += 4 + int.from_bytes(buf[pos:pos + 4], "little")
    return pos, n


@dataclass(frozen=True)
class ValuePages:
    """Where a fixed-size-list column's values lie in its file: ``spans`` are (file offset, bytes)
    of each data page's PLAIN values, in row order; together exactly ``rows x width`` values."""

    path: Path
    dtype: np.dtype
    rows: int
    width: int
    spans: tuple[tuple[int, int], ...]


def _leaf(path: Path, column: str, pf: pq.ParquetFile | None):
    """(file, the column's Arrow type, its list width, the leaf's column index, its descriptor) for a
    fixed-size-list ``column``, or None when it is not one."""
    pf = pq.ParquetFile(path) if pf is None else pf
    arrow_type = pf.schema_arrow.field(column).type
    width = getattr(arrow_type, "list_size", None)
    leaf = f"{column}.list.element"
    names = [pf.schema.column(i).path for i in range(pf.metadata.num_columns)]
    if width is None or leaf not in names:
        return None
    ci = names.index(leaf)
    return pf, arrow_type, width, ci, pf.schema.column(ci)


def plan_fixed_list(path: Path, column: str, pf: pq.ParquetFile | None = None) -> ValuePages | None:
    """The value pages of ``column`` (a fixed_size_list of a plain numeric type) in Parquet file
    ``path``, or None when its pages are not the uncompressed all-values PLAIN layout this reads
    (then read it through Arrow). Reads only the page headers. ``pf``: the file already opened."""
    found = _leaf(path, column, pf)
    if found is None:
        return None
    pf, arrow_type, width, ci, desc = found
    value_type = arrow_type.value_type
    if str(value_type) == "halffloat" and desc.physical_type == "FIXED_LEN_BYTE_ARRAY" and desc.length == 2:
        dtype = np.dtype("<f2")
    elif desc.physical_type in _NUMPY and np.dtype(value_type.to_pandas_dtype()) == _NUMPY[desc.physical_type]:
        dtype = _NUMPY[desc.physical_type]
    else:
        return None
    meta = pf.metadata
    chunks = []
    for g in range(meta.num_row_groups):
        cc = meta.row_group(g).column(ci)
        if cc.compression != "UNCOMPRESSED" or cc.has_dictionary_page:
            return None
        chunks.append((cc.data_page_offset, cc.total_compressed_size, meta.row_group(g).num_rows))
    spans: list[tuple[int, int]] = []
    with open(path, "rb", buffering=0) as fh:
        for offset, size, g_rows in chunks:
            try:
                got = _chunk_spans(fh.fileno(), offset, size, dtype.itemsize, desc.max_repetition_level,
                                   desc.max_definition_level)
            except PageFormatError:
                return None
            if sum(n for _, n in got) != g_rows * width * dtype.itemsize:
                return None  # the pages do not hold rows x list size values
            spans.extend(got)
    return ValuePages(Path(path), dtype, meta.num_rows, width, tuple(spans))


def read_fixed_list(path: Path, column: str, out: np.ndarray | None = None,
                    pf: pq.ParquetFile | None = None, zstd: bool = False) -> np.ndarray | None:
    """Column ``column`` of Parquet file ``path`` as a ``[rows, list_size]`` array by the page
    path, or None when :func:`plan_fixed_list` refuses the layout. ``out``: an array of that
    shape and dtype to fill instead of a new one. ``zstd``: also read zstd-compressed data pages
    (v1: levels and values compressed together; :func:`read_fixed_list_zstd`)."""
    plan = plan_fixed_list(path, column, pf)
    if plan is None:
        return read_fixed_list_zstd(path, column, out, pf) if zstd else None
    shape = (plan.rows, plan.width)
    if out is None:
        out = np.empty(shape, dtype=plan.dtype)
    elif out.shape != shape or out.dtype != plan.dtype or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous {plan.dtype} array of shape {shape}")
    flat = out.reshape(-1).view(np.uint8)
    filled = 0
    with open(path, "rb", buffering=0) as fh:
        for offset, nbytes in plan.spans:
            if os.preadv(fh.fileno(), [flat[filled:filled + nbytes]], offset) != nbytes:
                return None  # the file shrank since it was planned
            filled += nbytes
    return out


_HEAD = 4096  # bytes read to parse one page header and its level lengths (re-read when longer)


def _chunk_spans(fd: int, offset: int, size: int, itemsize: int, max_rep: int, max_def: int) -> list[tuple[int, int]]:
    """(file offset, bytes) of the values of each data page of one column chunk.

    Per page, only the header and the level-length prefixes are read into a small buffer."""
    spans = []
    pos = 0
    while pos < size:
        want = min(_HEAD, size - pos)
        while True:
            head = os.pread(fd, want, offset + pos)
            if len(head) != want:
                raise PageFormatError("column chunk truncated")
            view = memoryview(head)
            try:
                c = _Compact(view, 0)
                h = _page_header(c)
                body = c.pos
                if h["type"] in (DATA_PAGE, DATA_PAGE_V2) and "v" in h:
                    vpos, n = _values_span(view, body, h["size"], h, max_rep, max_def)
                break
            except _Short:
                if want >= size - pos:
                    raise PageFormatError("page header runs past the column chunk") from None
                want = min(want * 4, size - pos)  # a long header or level run: read more and parse again
        body_size = h["size"]
        if body_size < 0 or body + body_size > size - pos:
            raise PageFormatError("page runs past the column chunk")
        if h["type"] in (DATA_PAGE, DATA_PAGE_V2) and "v" in h:
            nbytes = body + body_size - vpos
            if nbytes != n * itemsize:
                raise PageFormatError("page holds fewer values than level entries (nulls)")
            spans.append((offset + pos + vpos, nbytes))
        elif h["type"] != INDEX_PAGE:
            raise PageFormatError(f"page type {h['type']} (dictionary or unknown)")
        pos += body + body_size
    return spans


def read_fixed_list_zstd(path: Path, column: str, out: np.ndarray | None = None,
                         pf: pq.ParquetFile | None = None) -> np.ndarray | None:
    """:func:`read_fixed_list` for a column whose data pages are zstd-compressed (v1 pages, PLAIN
    values, RLE levels, no nulls, no dictionary; uncompressed chunks too): each column chunk is
    read whole, each page decompressed (Arrow's zstd) and its values copied out, without Arrow's
    per-value level decoding (the narrow routing columns, experts and weights: 2-3x faster).
    None for anything else, or for a page that does not decompress (the caller reads through
    Arrow, which names the damage)."""
    import pyarrow as pa

    found = _leaf(path, column, pf)
    if found is None:
        return None
    pf, arrow_type, width, ci, desc = found
    if desc.physical_type not in _NUMPY or np.dtype(arrow_type.value_type.to_pandas_dtype()) != _NUMPY[desc.physical_type]:
        return None
    dtype = _NUMPY[desc.physical_type]
    meta = pf.metadata
    shape = (meta.num_rows, width)
    if out is None:
        out = np.empty(shape, dtype=dtype)
    elif out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous {dtype} array of shape {shape}")
    flat = out.reshape(-1).view(np.uint8)
    filled = 0
    with open(path, "rb", buffering=0) as fh:
        for g in range(meta.num_row_groups):
            cc = meta.row_group(g).column(ci)
            if cc.compression not in ("ZSTD", "UNCOMPRESSED") or cc.has_dictionary_page:
                return None
            size = cc.total_compressed_size
            raw = os.pread(fh.fileno(), size, cc.data_page_offset)
            if len(raw) != size:
                return None
            view = memoryview(raw)
            pos = 0
            g_start = filled
            try:
                while pos < size:
                    c = _Compact(view, pos)
                    h = _page_header(c)
                    body, body_size = c.pos, h["size"]
                    if body_size < 0 or body + body_size > size:
                        return None
                    if h["type"] in (DATA_PAGE, DATA_PAGE_V2) and "v" in h:
                        if h["v"] != 1:
                            return None
                        page: Any = view[body:body + body_size]
                        if cc.compression == "ZSTD":
                            page = memoryview(pa.decompress(page, decompressed_size=h.get("usize", -1), codec="zstd"))
                        vpos, n = _values_span(page, 0, len(page), h, desc.max_repetition_level, desc.max_definition_level)
                        nbytes = len(page) - vpos
                        if nbytes != n * dtype.itemsize or filled + nbytes > flat.size:
                            return None
                        flat[filled:filled + nbytes] = np.frombuffer(page, np.uint8, nbytes, vpos)
                        filled += nbytes
                    elif h["type"] != INDEX_PAGE:
                        return None
                    pos = body + body_size
            except (PageFormatError, pa.ArrowException, OSError, ValueError):
                return None
            if filled - g_start != meta.row_group(g).num_rows * width * dtype.itemsize:
                return None  # the pages do not hold rows x list size values
    return out if filled == flat.size else None
