"""A strict, pure-Python reader of a Parquet file's footer and of the Arrow schema stored in it.

The native path of ``moe-replay cache`` opens each part file of a trace without importing pyarrow
(which costs ~0.3 s with numpy). It needs, per part file, the row count, the schema leaves with
their levels, each column chunk's byte range, codec and encodings, and the Arrow schema pyarrow
would present (only the stored ``ARROW:schema`` says that ``experts`` is ``fixed_size_list<int32>[k]``
rather than ``list<int32>``). This module reads exactly that and imports only the standard library.

It is STRICT: whatever it does not fully understand (an encrypted footer, a wrong Thrift type on a
known field, a schema tree that does not add up, a column chunk outside the file, a stored Arrow
schema in big-endian order...) raises :class:`FooterError`, and the caller falls back to pyarrow.
A corrupt footer raises :class:`FooterError`, never IndexError or struct.error, and never hangs:
every count read from the file is checked against the bytes left before a loop runs on it.

Parquet's footer is a Thrift compact-protocol ``FileMetaData`` (parquet-format's parquet.thrift);
the Arrow schema is base64 of an Arrow IPC message whose flatbuffer header is a ``Schema``
(Arrow's format/Message.fbs and Schema.fbs). Both decoders are written here from those specs.
"""

from __future__ import annotations

import binascii
import os
import struct

__all__ = ["ArrowField", "Chunk", "Footer", "FooterError", "Leaf", "RowGroup", "SchemaElement", "arrow_schema",
           "read_footer"]

MAGIC = b"PAR1"
MAGIC_ENCRYPTED = b"PARE"
# The first read takes this many bytes from the end of the file: a pyarrow footer of a few columns
# is 1-5 KiB, so one pread usually holds it all.
_TAIL_GUESS = 16 << 10
# Nesting deeper than this in a skipped Thrift value is not a Parquet footer but a corrupt one
# (it also keeps the recursive skip far from Python's recursion limit).
_MAX_DEPTH = 32
# parquet-cpp's Thrift limits (ReaderProperties' defaults): a longer string or list is refused there.
_STRING_LIMIT = 100_000_000
_CONTAINER_LIMIT = 1_000_000


class FooterError(ValueError):
    """The footer (or its stored Arrow schema) is not one this reader fully understands."""


# -- the model ---------------------------------------------------------------------------------------

class SchemaElement:
    """One element of ``FileMetaData.schema`` (a group or a leaf), as stored.

    ``type`` is Parquet's physical Type (0 BOOLEAN, 1 INT32, 2 INT64, 3 INT96, 4 FLOAT, 5 DOUBLE,
    6 BYTE_ARRAY, 7 FIXED_LEN_BYTE_ARRAY), None on a group; ``repetition`` 0 REQUIRED, 1 OPTIONAL,
    2 REPEATED (None when absent, allowed only on the root); ``converted_type`` Parquet's legacy
    ConvertedType number; ``logical`` the LogicalType as a tuple: ("STRING",), ("MAP",), ("LIST",),
    ("ENUM",), ("DECIMAL", scale, precision), ("DATE",), ("TIME", is_adjusted_to_utc, unit),
    ("TIMESTAMP", is_adjusted_to_utc, unit) with unit "MILLIS" | "MICROS" | "NANOS",
    ("INTEGER", bit_width, is_signed), ("JSON",), ("BSON",), ("UUID",), ("FLOAT16",), or
    ("UNKNOWN", field_id) for 11 UNKNOWN (the null type), 16 VARIANT, 17 GEOMETRY, 18 GEOGRAPHY (not
    decoded); any other member is refused (FooterError): not understood here (pyarrow 26 reads one as
    an "Undefined" annotation).
    """

    __slots__ = ("name", "type", "type_length", "repetition", "num_children", "converted_type", "logical",
                 "field_id")

    def __init__(self, name: str, type: int | None, type_length: int | None, repetition: int | None,
                 num_children: int | None, converted_type: int | None, logical: tuple | None,
                 field_id: int | None) -> None:
        self.name = name
        self.type = type
        self.type_length = type_length
        self.repetition = repetition
        self.num_children = num_children
        self.converted_type = converted_type
        self.logical = logical
        self.field_id = field_id

    def __repr__(self) -> str:
        return (f"SchemaElement(name={self.name!r}, type={self.type}, type_length={self.type_length}, "
                f"repetition={self.repetition}, num_children={self.num_children}, "
                f"converted_type={self.converted_type}, logical={self.logical}, field_id={self.field_id})")


class Leaf:
    """A leaf column (column index j): its path from the root's children down, its schema element
    and its maximum repetition and definition levels, computed as parquet-cpp's ColumnDescriptor does
    (each OPTIONAL or REPEATED ancestor-or-self adds one definition level, each REPEATED one
    repetition level; the root counts for nothing)."""

    __slots__ = ("path", "element", "max_rep", "max_def")

    def __init__(self, path: tuple[str, ...], element: SchemaElement, max_rep: int, max_def: int) -> None:
        self.path = path
        self.element = element
        self.max_rep = max_rep
        self.max_def = max_def

    def __repr__(self) -> str:
        return f"Leaf(path={self.path!r}, max_rep={self.max_rep}, max_def={self.max_def}, element={self.element!r})"


class Chunk:
    """One column chunk of a row group (ColumnChunk + its ColumnMetaData).

    Its bytes are ``[dictionary_page_offset if not None else data_page_offset,
    + total_compressed_size)`` of the same file; :func:`read_footer` has checked that this range lies
    between the leading magic and the footer. ``codec``: 0 UNCOMPRESSED, 1 SNAPPY, 2 GZIP, 3 LZO,
    4 BROTLI, 5 LZ4, 6 ZSTD, 7 LZ4_RAW. ``encodings``: Parquet Encoding numbers in file order.
    ``file_path`` is always None here (a chunk stored in another file is refused)."""

    __slots__ = ("file_path", "physical", "encodings", "path", "codec", "num_values", "total_uncompressed_size",
                 "total_compressed_size", "data_page_offset", "index_page_offset", "dictionary_page_offset",
                 "_size_stats")

    def __init__(self, physical: int, encodings: tuple[int, ...], path: tuple[str, ...], codec: int,
                 num_values: int, total_uncompressed_size: int, total_compressed_size: int,
                 data_page_offset: int, index_page_offset: int | None, dictionary_page_offset: int | None) -> None:
        self.file_path = None
        self.physical = physical
        self.encodings = encodings
        self.path = path
        self.codec = codec
        self.num_values = num_values
        self.total_uncompressed_size = total_uncompressed_size
        self.total_compressed_size = total_compressed_size
        self.data_page_offset = data_page_offset
        self.index_page_offset = index_page_offset
        self.dictionary_page_offset = dictionary_page_offset
        # SizeStatistics as (has unencoded byte array bytes, repetition and definition histogram
        # lengths), checked against the leaf by read_footer (pyarrow aborts on a mismatch); or None.
        self._size_stats: tuple[bool, int, int] | None = None

    def __repr__(self) -> str:
        return (f"Chunk(path={self.path!r}, physical={self.physical}, codec={self.codec}, "
                f"encodings={self.encodings}, num_values={self.num_values}, "
                f"total_compressed_size={self.total_compressed_size}, "
                f"total_uncompressed_size={self.total_uncompressed_size}, "
                f"data_page_offset={self.data_page_offset}, dictionary_page_offset={self.dictionary_page_offset}, "
                f"index_page_offset={self.index_page_offset})")


class RowGroup:
    """One row group: its row count, its total uncompressed byte size, one chunk per leaf (same order)."""

    __slots__ = ("num_rows", "total_byte_size", "chunks")

    def __init__(self, num_rows: int, total_byte_size: int, chunks: list[Chunk]) -> None:
        self.num_rows = num_rows
        self.total_byte_size = total_byte_size
        self.chunks = chunks

    def __repr__(self) -> str:
        return f"RowGroup(num_rows={self.num_rows}, total_byte_size={self.total_byte_size}, chunks={self.chunks!r})"


class Footer:
    """A Parquet file's FileMetaData, checked: the schema tree adds up, every row group has one chunk
    per leaf whose path and physical type are the leaf's, the row groups' rows add up to ``num_rows``,
    and every chunk's bytes lie inside the file. ``kv``: key_value_metadata (a missing value is "")."""

    __slots__ = ("num_rows", "schema", "leaves", "row_groups", "kv", "created_by")

    def __init__(self, num_rows: int, schema: list[SchemaElement], leaves: list[Leaf], row_groups: list[RowGroup],
                 kv: dict[str, str], created_by: str | None) -> None:
        self.num_rows = num_rows
        self.schema = schema
        self.leaves = leaves
        self.row_groups = row_groups
        self.kv = kv
        self.created_by = created_by

    def __repr__(self) -> str:
        return (f"Footer(num_rows={self.num_rows}, leaves={[leaf.path for leaf in self.leaves]}, "
                f"row_groups={len(self.row_groups)}, kv keys={sorted(self.kv)}, created_by={self.created_by!r})")


# -- Thrift compact protocol ----------------------------------------------------------------------------
# Wire types: 1/2 bool true/false (in a field header; one byte 1/2 inside a list), 3 i8, 4 i16,
# 5 i32, 6 i64 (zigzag varints), 7 double, 8 binary, 9 list, 10 set, 11 map, 12 struct; 0 ends a
# struct. A field header byte is (id delta << 4) | type, or type alone followed by the id as a
# zigzag varint. A list header is (size << 4) | element type, size 15 meaning a varint follows.

_T_I8, _T_I32, _T_I64, _T_BINARY, _T_LIST, _T_STRUCT = 3, 5, 6, 8, 9, 12
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1


def _uvarint(buf: bytes, pos: int) -> tuple[int, int]:
    """An unsigned LEB128 varint of at most 10 bytes and 64 bits: (value, next position)."""
    b = buf[pos]
    if b < 0x80:
        return b, pos + 1
    value = b & 0x7F
    shift = 7
    pos += 1
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            if value >> 64:
                raise FooterError("corrupt footer: a varint above 64 bits")
            return value, pos
        shift += 7
        if shift > 63:
            raise FooterError("corrupt footer: a varint longer than 10 bytes")


def _zigzag(buf: bytes, pos: int) -> tuple[int, int]:
    """A signed zigzag varint (i16, i32 or i64): (value, next position)."""
    b = buf[pos]
    if b < 0x80:
        return (b >> 1) ^ -(b & 1), pos + 1
    v, pos = _uvarint(buf, pos)
    return (v >> 1) ^ -(v & 1), pos


def _i32(buf: bytes, pos: int) -> tuple[int, int]:
    v, pos = _zigzag(buf, pos)
    if v < _I32_MIN or v > _I32_MAX:
        raise FooterError("corrupt footer: an i32 field out of range")
    return v, pos


def _string_span(buf: bytes, pos: int) -> tuple[int, int]:
    """A binary value's bytes: (start, end), checked to lie in the buffer and within parquet-cpp's limit."""
    n = buf[pos]
    if n < 0x80:
        pos += 1
    else:
        n, pos = _uvarint(buf, pos)
    end = pos + n
    if end > len(buf) or n > _STRING_LIMIT:
        raise FooterError("truncated footer: a string runs past its end")
    return pos, end


def _string(buf: bytes, pos: int) -> tuple[str, int]:
    start, end = _string_span(buf, pos)
    try:
        return buf[start:end].decode(), end
    except UnicodeDecodeError:
        raise FooterError("footer holds a string that is not UTF-8") from None


def _list_head(buf: bytes, pos: int) -> tuple[int, int, int]:
    """A list (or set) header: (element type, size, next position). Every element takes at least one
    byte, so a size above the bytes left is corrupt (and refusing it bounds every loop on it)."""
    b = buf[pos]
    pos += 1
    n = b >> 4
    if n == 15:
        n, pos = _uvarint(buf, pos)
    if n > len(buf) - pos or n > _CONTAINER_LIMIT:
        raise FooterError("corrupt footer: a list longer than the bytes left")
    return b & 15, n, pos


def _wrong(what: str, fid: int, t: int) -> FooterError:
    return FooterError(f"footer field {fid} of {what} has Thrift type {t}, not the one parquet.thrift gives it")


# -- structs: one loop, driven by a table per struct ------------------------------------------------------
# A struct's table maps a field id to what is done with the field:
#   _keep(wire type, read, (lo, hi, message))   the field is kept: read(buf, pos) -> (value, next position)
#                               (no read for a bool, wire type 1: its value is its header's type), a value
#                               outside [lo, hi] refused (message, "{}" the value); another wire type refused;
#   _keep_if(wire type, read)   likewise, but a field of another wire type is skipped (as Thrift's reader
#                               skips it); without read (not a bool), the field is only noted (None) and skipped;
#   _keep_each(wire type, read) like _keep, but the values of every occurrence are kept, in a list;
#   _refuse(message)            the field is refused whatever its type ("{fid}" names it in the message);
#   _shape(shape)               the field is skipped by its IDL shape (_skip_as; see _struct below).
# A field of any other id is skipped by its wire type. A field met twice keeps its last value.
_KEEP, _KEEP_IF, _KEEP_EACH, _REFUSE, _SHAPE = 0, 1, 2, 3, 4  # (_REFUSE and _SHAPE last: one test for both)
_INF = float("inf")
_NO_FIELDS: dict = {}


def _keep(wire: int, read=None, bounds: tuple | None = None) -> tuple:
    return (_KEEP, wire, read, bounds)


def _i32_field(lo: int = _I32_MIN, hi: int = _I32_MAX, message: str = "corrupt footer: an i32 field out of range") -> tuple:
    """An i32 field kept, a value outside [lo, hi] (within i32) refused."""
    return _keep(_T_I32, _zigzag, (lo, hi, message))


def _keep_if(wire: int, read=None) -> tuple:
    return (_KEEP_IF, wire, read, None)


def _keep_each(wire: int, read) -> tuple:
    return (_KEEP_EACH, wire, read, None)


def _refuse(message: str) -> tuple:
    return (_REFUSE, message, None, None)


def _shape(shape: tuple) -> tuple:
    return (_SHAPE, shape, None, None)


def _read_struct(buf: bytes, pos: int, what: str, table: dict, depth: int = 1, other: tuple | None = None,
                 union: bool = False) -> tuple[dict, int]:
    """The fields of struct ``what`` up to its stop byte, as ``table`` says: ({field id: value} of the
    fields kept, next position). ``depth``: the nesting of the fields, for those skipped; ``other``: the
    entry for an id not in the table (None: skipped by its wire type); ``union``: a second field is
    refused. A field id in its long form (a zigzag varint after the header byte) is read by Thrift as
    an i16, so a wider one would alias another field there: refused."""
    got = {}
    fid = 0
    while True:
        b = buf[pos]
        pos += 1
        t = b & 15
        if not t:
            if b:
                raise FooterError("corrupt footer: a bad field header")
            return got, pos
        if b >> 4:
            fid += b >> 4
        else:
            fid, pos = _zigzag(buf, pos)
            if not -32768 <= fid <= 32767:
                raise FooterError("corrupt footer: a field id outside i16")
        entry = table.get(fid, other)
        if entry is None:
            pos = _skip_field(buf, pos, t, depth)
            continue
        kind, want, read, bounds = entry
        if kind >= _REFUSE:
            if kind == _REFUSE:
                raise FooterError(want.format(fid=fid))
            pos = _skip_as(buf, pos, t, want, depth)
            continue
        if t != want and not (want == 1 and t == 2):
            if kind == _KEEP_IF:
                pos = _skip_field(buf, pos, t, depth)
                continue
            raise _wrong(what, fid, t)
        if union and got:
            raise FooterError(f"footer has a {what} union with two members")
        if read is None:  # a bool (its value is its type), or a required field of a skipped struct (noted)
            if want == 1:
                got[fid] = t == 1
            else:
                got[fid] = None
                pos = _skip_field(buf, pos, t, depth)
            continue
        v, pos = read(buf, pos)
        if bounds is not None and not bounds[0] <= v <= bounds[1]:
            raise FooterError(bounds[2].format(v))
        if kind == _KEEP_EACH:
            got.setdefault(fid, []).append(v)
        else:
            got[fid] = v


def _list_of(et: int, read, refusal: str):
    """A reader of a list declared of wire type ``et`` (another element type refused with ``refusal``),
    each element read by ``read``: a list of the values."""
    def read_list(buf: bytes, pos: int) -> tuple[list, int]:
        elem_t, n, pos = _list_head(buf, pos)
        if elem_t != et:
            raise FooterError(refusal)
        out = []
        for _ in range(n):
            v, pos = read(buf, pos)
            out.append(v)
        return out, pos
    return read_list


# -- skipping: the fields not read ----------------------------------------------------------------------

def _skip_field(buf: bytes, pos: int, t: int, depth: int) -> int:
    """Skip a struct field's value of wire type ``t`` at nesting ``depth``: a bool (no payload), an
    integer or a string at once, whatever the depth (the statistics and encoding stats skipped on
    every column chunk are made of them); any other by :func:`_skip`."""
    if t == 8:
        return _string_span(buf, pos)[1]
    if t == 4 or t == 5 or t == 6:
        return pos + 1 if buf[pos] < 0x80 else _skip_varint(buf, pos)
    if t == 1 or t == 2:
        return pos
    return _skip(buf, pos, t, depth)


def _skip_varint(buf: bytes, pos: int) -> int:
    start = pos
    while buf[pos] & 0x80:
        pos += 1
    pos += 1
    if pos - start > 10:
        raise FooterError("corrupt footer: a varint longer than 10 bytes")
    return pos


def _skip(buf: bytes, pos: int, t: int, depth: int) -> int:
    """Skip one value of wire type ``t`` (as a struct field: a bool has no payload) at nesting ``depth``,
    refused beyond _MAX_DEPTH (which also keeps it far from Python's recursion limit)."""
    if depth > _MAX_DEPTH:
        raise FooterError("corrupt footer: nested too deep")
    if t == 12:
        return _skip_as(buf, pos, t, _EMPTY, depth)
    if t == 1 or t == 2 or t == 4 or t == 5 or t == 6 or t == 8:
        return _skip_field(buf, pos, t, depth)
    if t == 3:
        return pos + 1
    if t == 7:
        return pos + 8
    if t == 9 or t == 10:
        et, n, pos = _list_head(buf, pos)
        if not 1 <= et <= 12:
            raise FooterError(f"corrupt footer: unknown Thrift type {et}")
        if et == 1 or et == 2 or et == 3:
            return pos + n
        if et == 7:
            return pos + 8 * n
        for _ in range(n):
            pos = _skip(buf, pos, et, depth + 1)
        return pos
    if t == 11:
        n, pos = _uvarint(buf, pos)
        if n == 0:
            return pos
        if 2 * n > len(buf) - pos or n > _CONTAINER_LIMIT:
            raise FooterError("corrupt footer: a map longer than the bytes left")
        kv = buf[pos]
        pos += 1
        kt, vt = kv >> 4, kv & 15
        for _ in range(n):
            pos = pos + 1 if kt == 1 or kt == 2 else _skip(buf, pos, kt, depth + 1)
            pos = pos + 1 if vt == 1 or vt == 2 else _skip(buf, pos, vt, depth + 1)
        return pos
    raise FooterError(f"corrupt footer: unknown Thrift type {t}")


def _skip_as(buf: bytes, pos: int, t: int, shape: int | tuple, depth: int) -> int:
    """Skip a value of wire type ``t`` in a field of IDL shape ``shape``, refusing a list whose element
    type is not the declared one (Thrift's reader would read it as the declared one) and a struct
    without a required field (Thrift's reader refuses it)."""
    if shape.__class__ is int or t != (12 if shape[0] == "struct" else 9):
        return _skip(buf, pos, t, depth)
    if depth > _MAX_DEPTH:
        raise FooterError("corrupt footer: nested too deep")
    if shape[0] == "struct":
        got, pos = _read_struct(buf, pos, "", shape[1], depth + 1)
        for fid in shape[2]:
            if fid not in got:
                raise FooterError("footer has a struct without a field parquet.thrift requires")
        return pos
    et, n, pos = _list_head(buf, pos)
    elem, want = shape[1], shape[2]
    if et != want and not (want == 1 and et == 2):
        raise FooterError("footer has a list whose element type is not the one parquet.thrift declares")
    for _ in range(n):
        pos = _skip(buf, pos, et, depth + 1) if elem.__class__ is int else _skip_as(buf, pos, et, elem, depth + 1)
    return pos


# The IDL shapes (parquet.thrift) of the fields skipped inside the structs read here. Thrift's
# generated reader (pyarrow's) reads a field whose wire type is its declared one by the declared
# shape, trusting a list's element type to be the declared one, and skips any other by its wire
# type: a skip by wire types alone would accept what it misreads. A shape is a wire type (a scalar,
# 1 standing for either bool), ("struct", table, required ids) or ("list", element shape, its wire type).
def _struct(fields: dict, required: tuple[int, ...] = ()) -> tuple:
    """The shape of a struct of fields {id: shape}: a table for _read_struct in which a required field
    (a scalar in parquet.thrift) is kept when of its declared type, one of a nested shape skipped by
    it, and any other scalar skipped by its wire type."""
    table = {}
    for fid, shape in fields.items():
        if fid in required:
            if shape not in (1, 5, 8):  # the only required fields met in skipped structs
                raise AssertionError(f"no skip for a required field of shape {shape}")
            table[fid] = _keep_if(shape)
        elif shape.__class__ is not int:
            table[fid] = _shape(shape)
    return ("struct", table, required)


def _list(elem: int | tuple) -> tuple:
    return ("list", elem, elem if isinstance(elem, int) else 12 if elem[0] == "struct" else 9)


_EMPTY = _struct({})
_STATISTICS = _struct({1: 8, 2: 8, 3: 6, 4: 6, 5: 8, 6: 8, 7: 1, 8: 1})
_KEY_VALUE_SHAPE = _struct({1: 8, 2: 8}, (1,))
_PAGE_ENCODING_STATS = _struct({1: 5, 2: 5, 3: 5}, (1, 2, 3))
_SORTING_COLUMN = _struct({1: 5, 2: 1, 3: 1}, (1, 2, 3))
_COLUMN_ORDER = _struct({1: _EMPTY})  # a union: TYPE_ORDER


# -- the structs read -------------------------------------------------------------------------------------
# Each struct of parquet.thrift read here: its table (the fields read, checked, refused or skipped by
# shape), then its function: what is checked on the whole, and the value built.

# IntType {1: i8 bitWidth, 2: bool isSigned}.
_INT_TYPE = {1: _keep(_T_I8, lambda buf, pos: (buf[pos], pos + 1)), 2: _keep(1)}


def _int_logical(buf: bytes, pos: int) -> tuple[tuple, int]:
    got, pos = _read_struct(buf, pos, "IntType", _INT_TYPE)
    if 1 not in got or 2 not in got:
        raise FooterError("footer has an IntType without its bit width or signedness")
    bw = got[1]
    return ("INTEGER", bw - 256 if bw > 127 else bw, got[2]), pos


# TimeUnit: a union of empty structs {1: MILLIS, 2: MICROS, 3: NANOS}; any member kept, then checked.
_TIME_UNITS = {1: "MILLIS", 2: "MICROS", 3: "NANOS"}
_TIME_UNIT_MEMBER = _keep(_T_STRUCT, lambda buf, pos: (None, _skip_as(buf, pos, _T_STRUCT, _EMPTY, 2)))


def _time_logical(name: str):
    """A reader of TimeType / TimestampType {1: bool isAdjustedToUTC, 2: TimeUnit unit}, ``name`` its kind."""
    def read_unit(buf: bytes, pos: int) -> tuple[str, int]:
        got, pos = _read_struct(buf, pos, "TimeUnit", _NO_FIELDS, other=_TIME_UNIT_MEMBER, union=True)
        if len(got) != 1 or next(iter(got)) not in _TIME_UNITS:
            raise FooterError(f"footer has a {name} whose unit is not one of millis, micros, nanos")
        return _TIME_UNITS[next(iter(got))], pos

    table = {1: _keep(1), 2: _keep(_T_STRUCT, read_unit)}

    def read(buf: bytes, pos: int) -> tuple[tuple, int]:
        got, pos = _read_struct(buf, pos, name, table)
        if 1 not in got or 2 not in got:
            raise FooterError(f"footer has a {name} without its UTC flag or unit")
        return (name, got[1], got[2]), pos
    return read


# DecimalType {1: i32 scale, 2: i32 precision}.
_DECIMAL_TYPE = {1: _i32_field(), 2: _i32_field()}


def _decimal_logical(buf: bytes, pos: int) -> tuple[tuple, int]:
    got, pos = _read_struct(buf, pos, "DecimalType", _DECIMAL_TYPE)
    if 1 not in got or 2 not in got:
        raise FooterError("footer has a DecimalType without its scale or precision")
    return ("DECIMAL", got[1], got[2]), pos


def _member(value: tuple, shape: tuple = _EMPTY):
    """A LogicalType member read as ``value``, skipped by its struct shape."""
    return _keep(_T_STRUCT, lambda buf, pos: (value, _skip_as(buf, pos, _T_STRUCT, shape, 1)))


# LogicalType, a union: exactly one struct-valued member. Members read as ("UNKNOWN", field id): 11 UNKNOWN
# (the null type), 16 VARIANT, 17 GEOMETRY, 18 GEOGRAPHY (parquet.thrift, 2025); any other member is
# newer than this reader (pyarrow reads it as "Undefined"): not understood, refused.
_LOGICAL_TYPE = {
    1: _member(("STRING",)), 2: _member(("MAP",)), 3: _member(("LIST",)), 4: _member(("ENUM",)),
    5: _keep(_T_STRUCT, _decimal_logical), 6: _member(("DATE",)), 7: _keep(_T_STRUCT, _time_logical("TIME")),
    8: _keep(_T_STRUCT, _time_logical("TIMESTAMP")), 10: _keep(_T_STRUCT, _int_logical),
    11: _member(("UNKNOWN", 11)), 12: _member(("JSON",)), 13: _member(("BSON",)), 14: _member(("UUID",)),
    15: _member(("FLOAT16",)), 16: _member(("UNKNOWN", 16), _struct({1: 3})),
    17: _member(("UNKNOWN", 17), _struct({1: 8})), 18: _member(("UNKNOWN", 18), _struct({1: 8, 2: 5})),
}
_UNKNOWN_LOGICAL = _refuse("footer has an unknown logical type (LogicalType field {fid})")


def _logical(buf: bytes, pos: int) -> tuple[tuple, int]:
    got, pos = _read_struct(buf, pos, "LogicalType", _LOGICAL_TYPE, other=_UNKNOWN_LOGICAL, union=True)
    if not got:
        raise FooterError("footer has an empty LogicalType union")
    return next(iter(got.values())), pos


# SchemaElement {1: Type type, 2: i32 type_length, 3: FieldRepetitionType repetition_type, 4: string name,
# 5: i32 num_children, 6: ConvertedType converted_type, 7: i32 scale, 8: i32 precision, 9: i32 field_id,
# 10: LogicalType logicalType}. 7 and 8 are legacy decimal annotations (the LogicalType carries them too).
_PHYSICAL_TYPE = _i32_field(0, 7, "footer has an unknown physical type {}")
_SCHEMA_ELEMENT = {
    1: _PHYSICAL_TYPE,
    2: _i32_field(),
    3: _i32_field(0, 2, "footer has an unknown repetition type {}"),
    4: _keep(_T_BINARY, _string),
    5: _i32_field(0, _I32_MAX, "footer has a schema element with {} children"),
    6: _i32_field(0, 21, "footer has an unknown converted type {}"),
    7: _i32_field(), 8: _i32_field(), 9: _i32_field(),
    10: _keep(_T_STRUCT, _logical),
}


def _schema_element(buf: bytes, pos: int) -> tuple[SchemaElement, int]:
    got, pos = _read_struct(buf, pos, "SchemaElement", _SCHEMA_ELEMENT)
    if 4 not in got:
        raise FooterError("footer has a schema element without a name")
    g = got.get
    return SchemaElement(got[4], g(1), g(2), g(3), g(5), g(6), g(10), g(9)), pos


# Parquet Encoding numbers a reader may meet (1 is unused by the format; GROUP_VAR_INT was never used).
_ENCODINGS = frozenset((0, 2, 3, 4, 5, 6, 7, 8, 9))


def _encoding(buf: bytes, pos: int) -> tuple[int, int]:
    v, pos = _i32(buf, pos)
    if v not in _ENCODINGS:
        raise FooterError(f"footer has an unknown encoding {v}")
    return v, pos


def _histogram_length(buf: bytes, pos: int) -> tuple[int, int]:
    et, n, pos = _list_head(buf, pos)
    if et != _T_I64:
        raise FooterError("footer has a level histogram that is not a list of i64")
    for _ in range(n):
        pos = _skip_varint(buf, pos)
    return n, pos


# SizeStatistics {1: i64 unencoded_byte_array_data_bytes, 2: list<i64> repetition_level_histogram,
# 3: list<i64> definition_level_histogram}; a field of another type skipped.
_SIZE_STATISTICS = {1: _keep_if(_T_I64, lambda buf, pos: (True, _skip_varint(buf, pos))),
                    2: _keep_if(_T_LIST, _histogram_length), 3: _keep_if(_T_LIST, _histogram_length)}


def _size_statistics(buf: bytes, pos: int) -> tuple[tuple[bool, int, int], int]:
    """Whether unencoded_byte_array_data_bytes is there, and the level histograms' lengths."""
    got, pos = _read_struct(buf, pos, "SizeStatistics", _SIZE_STATISTICS, 2)
    return (1 in got, got.get(2, 0), got.get(3, 0)), pos


_OFFSET = (0, _INF, "footer has a negative size or offset ({}) in a column chunk")
# ColumnMetaData {1: Type type, 2: list<Encoding> encodings, 3: list<string> path_in_schema,
# 4: CompressionCodec codec, 5: i64 num_values, 6: i64 total_uncompressed_size, 7: i64 total_compressed_size,
# 8: list<KeyValue> key_value_metadata, 9: i64 data_page_offset, 10: i64 index_page_offset,
# 11: i64 dictionary_page_offset, 12: Statistics, 13: list<PageEncodingStats>, 14: i64 bloom_filter_offset,
# 15: i32 bloom_filter_length, 16: SizeStatistics, 17: GeospatialStatistics (refused)}.
_COLUMN_META = {
    1: _PHYSICAL_TYPE,
    2: _keep(_T_LIST, _list_of(_T_I32, _encoding,
                               "footer has a column's encodings list of a type other than i32")),
    3: _keep(_T_LIST, _list_of(_T_BINARY, _string, "footer has a column path that is not a list of strings")),
    4: _i32_field(0, 7, "footer has an unknown compression codec {}"),
    5: _keep(_T_I64, _zigzag, _OFFSET), 6: _keep(_T_I64, _zigzag, _OFFSET), 7: _keep(_T_I64, _zigzag, _OFFSET),
    8: _shape(_list(_KEY_VALUE_SHAPE)),
    9: _keep(_T_I64, _zigzag, _OFFSET), 10: _keep(_T_I64, _zigzag, _OFFSET), 11: _keep(_T_I64, _zigzag, _OFFSET),
    12: _shape(_STATISTICS), 13: _shape(_list(_PAGE_ENCODING_STATS)),
    16: _keep_if(_T_STRUCT, _size_statistics),
    17: _refuse("footer has geospatial statistics"),
}


def _column_meta(buf: bytes, pos: int) -> tuple[Chunk, int]:
    got, pos = _read_struct(buf, pos, "ColumnMetaData", _COLUMN_META)
    if not got.keys() >= {1, 2, 3, 4, 5, 6, 7, 9}:
        raise FooterError("footer has a column chunk's metadata without a required field")
    chunk = Chunk(got[1], tuple(got[2]), tuple(got[3]), got[4], got[5], got[6], got[7], got[9], got.get(10),
                  got.get(11))
    chunk._size_stats = got.get(16)
    return chunk, pos


# ColumnChunk {1: string file_path (refused), 2: i64 file_offset (deprecated, yet required), 3: ColumnMetaData,
# 4-7: offset and column index locations (skipped), 8-9: encryption (refused)}.
_COLUMN_CHUNK = {
    1: _refuse("footer has a column chunk stored in another file (file_path)"),
    2: _keep_if(_T_I64),
    3: _keep(_T_STRUCT, _column_meta),
    8: _refuse("footer has an encrypted column chunk"), 9: _refuse("footer has an encrypted column chunk"),
}


def _column_chunk(buf: bytes, pos: int) -> tuple[Chunk, int]:
    got, pos = _read_struct(buf, pos, "ColumnChunk", _COLUMN_CHUNK)
    if 3 not in got or 2 not in got:
        raise FooterError("footer has a column chunk without its metadata or file offset")
    return got[3], pos


_ROW_GROUP_SIZE = (0, _INF, "footer has a row group with a negative size or row count ({})")
# RowGroup {1: list<ColumnChunk> columns, 2: i64 total_byte_size, 3: i64 num_rows, 4: list<SortingColumn>
# sorting_columns, 5: i64 file_offset, 6: i64 total_compressed_size, 7: i16 ordinal}.
_ROW_GROUP = {
    1: _keep(_T_LIST, _list_of(_T_STRUCT, _column_chunk, "footer has a row group whose columns are not structs")),
    2: _keep(_T_I64, _zigzag, _ROW_GROUP_SIZE), 3: _keep(_T_I64, _zigzag, _ROW_GROUP_SIZE),
    4: _shape(_list(_SORTING_COLUMN)),
}


def _row_group(buf: bytes, pos: int) -> tuple[RowGroup, int]:
    got, pos = _read_struct(buf, pos, "RowGroup", _ROW_GROUP)
    if not got.keys() >= {1, 2, 3}:
        raise FooterError("footer has a row group without its columns, byte size or row count")
    return RowGroup(got[3], got[2], got[1]), pos


# KeyValue {1: string key, 2: string value} (a missing value is "").
_KEY_VALUE = {1: _keep(_T_BINARY, _string), 2: _keep(_T_BINARY, _string)}


def _key_value(buf: bytes, pos: int) -> tuple[tuple[str, str], int]:
    got, pos = _read_struct(buf, pos, "KeyValue", _KEY_VALUE)
    if 1 not in got:
        raise FooterError("footer has key-value metadata without a key")
    return (got[1], got.get(2, "")), pos


def _column_orders(buf: bytes, pos: int) -> tuple[int, int]:
    """column_orders (min/max sort orders: statistics only): how many."""
    et, n, pos = _list_head(buf, pos)
    if et != _T_STRUCT:
        raise FooterError("footer's column orders are not a list of structs")
    for _ in range(n):
        pos = _skip_as(buf, pos, et, _COLUMN_ORDER, 2)
    return n, pos


# FileMetaData {1: i32 version, 2: list<SchemaElement> schema, 3: i64 num_rows, 4: list<RowGroup> row_groups,
# 5: list<KeyValue> key_value_metadata, 6: string created_by, 7: list<ColumnOrder> column_orders,
# 8-9: encryption (refused)}.
_FILE_METADATA = {
    1: _i32_field(),
    2: _keep(_T_LIST, _list_of(_T_STRUCT, _schema_element, "footer's schema is not a list of structs")),
    3: _keep(_T_I64, _zigzag),
    4: _keep(_T_LIST, _list_of(_T_STRUCT, _row_group, "footer's row groups is not a list of structs")),
    5: _keep_each(_T_LIST, _list_of(_T_STRUCT, _key_value, "footer's key-value metadata is not a list of structs")),
    6: _keep(_T_BINARY, _string),
    7: _keep_if(_T_LIST, _column_orders),
    8: _refuse("encrypted footer (plaintext footer of an encrypted file)"),
    9: _refuse("encrypted footer (plaintext footer of an encrypted file)"),
}


def _file_metadata(buf: bytes) -> tuple[int, list[SchemaElement], list[RowGroup], dict[str, str], str | None,
                                        int | None]:
    """FileMetaData: (num_rows, schema, row groups, key-value metadata, created_by, number of column
    orders or None)."""
    got, pos = _read_struct(buf, 0, "FileMetaData", _FILE_METADATA)
    if pos != len(buf):
        raise FooterError(f"footer has {len(buf) - pos} bytes after its FileMetaData")
    if not got.keys() >= {1, 2, 3, 4}:
        raise FooterError("footer without its version, schema, row count or row groups")
    version, num_rows = got[1], got[3]
    if version not in (1, 2):
        raise FooterError(f"footer of an unknown Parquet format version {version}")
    if num_rows < 0:
        raise FooterError(f"footer has a negative row count ({num_rows})")
    kv: dict[str, str] = {}
    if len(got.get(5, ())) > 1:  # pyarrow keeps the last one only: a stored schema it never sees could hide in another
        raise FooterError("footer holds its key-value metadata twice")
    for pairs in got.get(5, ()):
        for k, v in pairs:
            if k in kv:
                raise FooterError(f"footer has the key-value metadata key {k!r} twice")
            kv[k] = v
    return num_rows, got[2], got[4], kv, got.get(6), got.get(7)


# Physical types each annotation may annotate. An annotation on another is refused here (pyarrow 26
# reads an inapplicable LogicalType as "Undefined", and so as a plain column: not understood here).
_LOGICAL_PHYSICAL = {"STRING": (6,), "ENUM": (6,), "JSON": (6,), "BSON": (6,), "DATE": (1,), "TIMESTAMP": (2,)}
_CONVERTED_PHYSICAL = {0: (6,), 4: (6,), 19: (6,), 20: (6,), 6: (1,), 7: (1,), 8: (2,), 9: (2,), 10: (2,),
                       11: (1,), 12: (1,), 13: (1,), 14: (2,), 15: (1,), 16: (1,), 17: (1,), 18: (2,)}


def _leaf_annotation_ok(e: SchemaElement) -> bool:
    """Whether a leaf's physical type can carry its logical (or, without one, converted) type. A
    converted DECIMAL or INTERVAL without a logical type is not understood here."""
    t, logical = e.type, e.logical
    if t == 7 and (e.type_length is None or e.type_length <= 0):
        return False
    if logical is None:
        return e.converted_type is None or t in _CONVERTED_PHYSICAL.get(e.converted_type, ())
    kind = logical[0]
    if kind in _LOGICAL_PHYSICAL:
        return t in _LOGICAL_PHYSICAL[kind]
    if kind == "INTEGER":
        return logical[1] in (8, 16, 32, 64) and t == (2 if logical[1] == 64 else 1)
    if kind == "TIME":
        return t == (1 if logical[2] == "MILLIS" else 2)
    if kind == "FLOAT16":
        return t == 7 and e.type_length == 2
    if kind == "UUID":
        return t == 7 and e.type_length == 16
    if kind == "DECIMAL":
        scale, precision = logical[1], logical[2]
        if not 0 <= scale <= precision or precision < 1:
            return False
        if t == 1 or t == 2:
            return precision <= (9 if t == 1 else 18)
        if t == 7:  # the digits of the largest signed value of type_length bytes, less one
            return e.type_length > 128 or precision <= len(str((1 << (8 * e.type_length - 1)) - 1)) - 1
        return t == 6
    if kind == "UNKNOWN":
        return logical[1] == 11 or (logical[1] in (17, 18) and t == 6)
    return False  # LIST, MAP on a leaf


def _leaves(schema: list[SchemaElement]) -> list[Leaf]:
    """Walk the flattened schema tree (pre-order, each group followed by its num_children subtrees)."""
    if not schema:
        raise FooterError("footer has an empty schema")
    root = schema[0]
    if root.type is not None or not root.num_children:
        raise FooterError("footer's schema root is not a group with children")
    leaves = []
    n = len(schema)
    i = 1
    # [children left, path, max_rep, max_def] per open group; each step consumes one element, so the
    # walk ends within len(schema) steps whatever num_children say.
    stack = [[root.num_children, (), 0, 0]]
    while stack:
        top = stack[-1]
        if not top[0]:
            stack.pop()
            continue
        top[0] -= 1
        if i >= n:
            raise FooterError("footer's schema tree has more children than elements")
        e = schema[i]
        i += 1
        rep, dfn = top[2], top[3]
        r = e.repetition
        if r == 1:
            dfn += 1
        elif r == 2:
            dfn += 1
            rep += 1
        elif r != 0:
            raise FooterError(f"footer's schema element {e.name!r} has no repetition type")
        path = top[1] + (e.name,)
        if e.num_children:
            if e.type is not None:
                raise FooterError(f"footer's schema element {e.name!r} has both children and a physical type")
            if not (e.logical in (None, ("LIST",), ("MAP",))
                    and (e.logical is not None or e.converted_type in (None, 1, 2, 3))):
                raise FooterError(f"footer's group {e.name!r} has an annotation pyarrow refuses on a group")
            if r == 2 and (e.logical is not None or e.converted_type in (1, 3)):
                raise FooterError(f"footer's group {e.name!r} is a repeated LIST or MAP")
            stack.append([e.num_children, path, rep, dfn])
        else:
            if e.type is None:
                raise FooterError(f"footer's schema element {e.name!r} is neither a group with children nor a leaf")
            if not _leaf_annotation_ok(e):
                raise FooterError(f"footer's column {e.name!r} has a type annotation its physical type cannot carry")
            leaves.append(Leaf(path, e, rep, dfn))
    if i != n:
        raise FooterError(f"footer's schema has {n - i} elements outside its tree")
    return leaves


def _check(footer: Footer, data_end: int) -> None:
    """The cross-checks a reader relies on: chunks match leaves, rows add up, bytes lie in the file."""
    leaves = footer.leaves
    total_rows = 0
    for g in footer.row_groups:
        if len(g.chunks) != len(leaves):
            raise FooterError(f"footer has a row group of {len(g.chunks)} column chunks for {len(leaves)} leaves")
        total_rows += g.num_rows
        for c, leaf in zip(g.chunks, leaves):
            stats = c._size_stats
            if stats is not None and ((stats[0] and leaf.element.type != 6)
                                      or (stats[1] and stats[1] != leaf.max_rep + 1)
                                      or (stats[2] and stats[2] != leaf.max_def + 1)):
                raise FooterError(f"footer has size statistics of {'.'.join(c.path)!r} that do not fit its levels "
                                  "or type")
            if c.path != leaf.path:
                raise FooterError(f"footer has a column chunk for {'.'.join(c.path)!r} where "
                                  f"{'.'.join(leaf.path)!r} is expected")
            if c.physical != leaf.element.type:
                raise FooterError(f"footer has a column chunk of {'.'.join(c.path)!r} whose physical type is not "
                                  "its schema's")
            start = c.data_page_offset
            if c.dictionary_page_offset is not None:
                if not c.dictionary_page_offset < start:
                    raise FooterError(f"footer has a dictionary page of {'.'.join(c.path)!r} that is not before "
                                      "its data pages")
                start = c.dictionary_page_offset
            if start < len(MAGIC) or start + c.total_compressed_size > data_end:
                raise FooterError(f"footer has a column chunk of {'.'.join(c.path)!r} outside the file's data")
    if total_rows != footer.num_rows:
        raise FooterError(f"footer says {footer.num_rows} rows but its row groups hold {total_rows}")


def read_footer(path: str | os.PathLike, fd: int | None = None) -> Footer:
    """Read and check the footer of the Parquet file at ``path`` (or open file descriptor ``fd``,
    which is used as is and left open; ``path`` then only names the file in messages).

    Raises FooterError for anything not fully understood (OSError when the file cannot be read).
    """
    own = fd is None
    if own:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        size = os.fstat(fd).st_size
        if size < 12:
            raise FooterError("not a Parquet file: shorter than its two magics and footer length")
        tail_len = min(size, _TAIL_GUESS)
        tail = os.pread(fd, tail_len, size - tail_len)
        if len(tail) != tail_len:
            raise FooterError("truncated footer: the file shrank while read")
        magic = tail[-4:]
        if magic != MAGIC:
            if magic == MAGIC_ENCRYPTED:
                raise FooterError("encrypted footer")
            raise FooterError("not a Parquet file: no PAR1 at its end")
        head = tail[:4] if tail_len == size else os.pread(fd, 4, 0)
        if head != MAGIC:
            raise FooterError("not a Parquet file: no PAR1 at its start")
        meta_len = int.from_bytes(tail[-8:-4], "little")
        if meta_len == 0 or meta_len > size - 12:
            raise FooterError(f"truncated footer: its length {meta_len} does not fit a file of {size} bytes")
        if meta_len + 8 <= tail_len:
            meta = tail[tail_len - 8 - meta_len:tail_len - 8]
        else:
            meta = os.pread(fd, meta_len, size - 8 - meta_len)
            if len(meta) != meta_len:
                raise FooterError("truncated footer: the file shrank while read")
    finally:
        if own:
            os.close(fd)
    try:
        num_rows, schema, row_groups, kv, created_by, column_orders = _file_metadata(meta)
    except IndexError:
        raise FooterError("truncated footer: its FileMetaData runs past its end") from None
    footer = Footer(num_rows, schema, _leaves(schema), row_groups, kv, created_by)
    if column_orders is not None and column_orders != len(footer.leaves):
        raise FooterError(f"footer has {column_orders} column orders for {len(footer.leaves)} columns")
    _check(footer, size - 8 - meta_len)
    return footer


# -- the stored Arrow schema (ARROW:schema) --------------------------------------------------------------

class ArrowField:
    """One field of the stored Arrow schema: ``name``, ``nullable``, ``type`` and ``dictionary`` (True for
    a dictionary-encoded field, whose ``type`` is then the dictionary's value type).

    ``type`` is ("int", bit_width, is_signed) | ("float", 16 | 32 | 64) | ("bool",) | ("utf8",) |
    ("binary",) | ("fixed_size_list", list_size, ArrowField) | ("list", ArrowField) |
    ("large_list", ArrowField) | ("other", type_id) for any other Arrow type (type_id: Schema.fbs's
    Type union number; an extension type is "other" whatever its storage) -- "other" never equals a
    supported type. Fields compare equal when all four attributes do, children included, except that
    a list's child is compared without its name, as Arrow's own type equality does: pyarrow stores a
    list's child as "item" and presents it under its Parquet name, "element"."""

    __slots__ = ("name", "nullable", "type", "dictionary")

    def __init__(self, name: str, nullable: bool, type: tuple, dictionary: bool = False) -> None:
        self.name = name
        self.nullable = nullable
        self.type = type
        self.dictionary = dictionary

    def _key(self) -> tuple:
        t = self.type
        kind = t[0]
        if kind == "fixed_size_list":
            t = (kind, t[1], t[2]._key()[1:])
        elif kind == "list" or kind == "large_list":
            t = (kind, t[1]._key()[1:])
        return (self.name, self.nullable, t, self.dictionary)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ArrowField):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        extra = ", dictionary=True" if self.dictionary else ""
        return f"ArrowField({self.name!r}, nullable={self.nullable}, type={self.type!r}{extra})"


_FB_U8 = struct.Struct("<B").unpack_from
_FB_U16 = struct.Struct("<H").unpack_from
_FB_I16 = struct.Struct("<h").unpack_from
_FB_I32 = struct.Struct("<i").unpack_from
_FB_U32 = struct.Struct("<I").unpack_from
_FB_I64 = struct.Struct("<q").unpack_from
# Nesting deeper than this in a stored schema is refused (it also bounds the recursion).
_FB_MAX_DEPTH = 64
# Arrow's Type union (Schema.fbs) members this reader decodes.
_ARROW_INT, _ARROW_FLOAT, _ARROW_BINARY, _ARROW_UTF8, _ARROW_BOOL = 2, 3, 4, 5, 6
_ARROW_LIST, _ARROW_FIXED_SIZE_LIST, _ARROW_LARGE_LIST = 12, 16, 21
_FLOAT_BITS = (16, 32, 64)  # Precision: HALF, SINGLE, DOUBLE
_SCHEMA_CACHE: dict[str, list[ArrowField]] = {}
_SCHEMA_CACHE_MAX = 64


def _fb_get(unpack, size: int, b: bytes, p: int) -> int:
    """One scalar at p, bounds- and alignment-checked as flatbuffers' verifier (which pyarrow runs)
    checks it; struct's unpack_from would count a negative p from the end."""
    if p < 0 or p + size > len(b):
        raise FooterError("corrupt ARROW:schema: an offset outside its buffer")
    if p & (size - 1):
        raise FooterError("corrupt ARROW:schema: a misaligned value")
    return unpack(b, p)[0]


def _fb_table(b: bytes, t: int) -> tuple[int, int, int]:
    """The table at t: (t, its vtable's position, the vtable's length in bytes)."""
    vt = t - _fb_get(_FB_I32, 4, b, t)
    vtlen = _fb_get(_FB_U16, 2, b, vt)
    if vtlen < 4 or vtlen & 1 or vt + vtlen > len(b) or t + _FB_U16(b, vt + 2)[0] > len(b):
        raise FooterError("corrupt ARROW:schema: a bad vtable")
    return t, vt, vtlen


def _fb_slot(b: bytes, tab: tuple[int, int, int], i: int) -> int | None:
    """The position of field i of a table, or None when the field is absent (its default applies)."""
    t, vt, vtlen = tab
    o = 4 + 2 * i
    if o + 2 > vtlen:
        return None
    off = _FB_U16(b, vt + o)[0]
    return t + off if off else None


def _fb_ref(b: bytes, p: int | None) -> int | None:
    """Follow the forward offset stored at p (a table, string or vector field)."""
    if p is None:
        return None
    off = _fb_get(_FB_U32, 4, b, p)
    if off == 0 or off >= 1 << 31:  # the verifier refuses a null or negative offset
        raise FooterError("corrupt ARROW:schema: a null or negative offset")
    return p + off


def _fb_scalar(b: bytes, tab: tuple[int, int, int], i: int, unpack, size: int, default: int) -> int:
    p = _fb_slot(b, tab, i)
    return default if p is None else _fb_get(unpack, size, b, p)


def _fb_string(b: bytes, p: int | None) -> str | None:
    p = _fb_ref(b, p)
    if p is None:
        return None
    n = _fb_get(_FB_U32, 4, b, p)
    if p + 4 + n >= len(b) or b[p + 4 + n]:
        raise FooterError("corrupt ARROW:schema: a string outside its buffer or not NUL-terminated")
    try:
        return b[p + 4:p + 4 + n].decode()
    except UnicodeDecodeError:
        raise FooterError("corrupt ARROW:schema: a name that is not UTF-8") from None


def _fb_tables(b: bytes, p: int | None) -> list[int]:
    """The positions of the tables of a vector-of-tables field (empty when absent)."""
    p = _fb_ref(b, p)
    if p is None:
        return []
    n = _fb_get(_FB_U32, 4, b, p)
    if p + 4 + 4 * n > len(b):
        raise FooterError("corrupt ARROW:schema: a vector outside its buffer")
    return [_fb_ref(b, q) for q in range(p + 4, p + 4 + 4 * n, 4)]


def _fb_key_values(b: bytes, p: int | None) -> list[tuple[str | None, str | None]]:
    """A custom_metadata vector of KeyValue tables {0 key, 1 value}, every string checked."""
    out = []
    for kv in _fb_tables(b, p):
        tab = _fb_table(b, kv)
        out.append((_fb_string(b, _fb_slot(b, tab, 0)), _fb_string(b, _fb_slot(b, tab, 1))))
    return out


def _fb_check_longs(b: bytes, p: int | None) -> None:
    """A vector of 8-byte scalars (Schema.features) lies in the buffer."""
    p = _fb_ref(b, p)
    if p is not None and p + 4 + 8 * _fb_get(_FB_U32, 4, b, p) > len(b):
        raise FooterError("corrupt ARROW:schema: a vector outside its buffer")


def _fb_is_extension(b: bytes, tab: tuple[int, int, int]) -> bool:
    """Whether a Field's custom_metadata names an extension type (its type is then only the storage)."""
    return any(k == "ARROW:extension:name" for k, _ in _fb_key_values(b, _fb_slot(b, tab, 6)))


def _fb_check_dictionary(b: bytes, p: int | None) -> None:
    """DictionaryEncoding {0 id: long, 1 indexType: Int, 2 isOrdered: bool, 3 dictionaryKind: short}."""
    tab = _fb_table(b, p)
    _fb_scalar(b, tab, 0, _FB_I64, 8, 0)
    _fb_scalar(b, tab, 2, _FB_U8, 1, 0)
    _fb_scalar(b, tab, 3, _FB_I16, 2, 0)
    index = _fb_ref(b, _fb_slot(b, tab, 1))
    if index is None:
        raise FooterError("ARROW:schema has a dictionary without its index type")
    itab = _fb_table(b, index)
    if _fb_scalar(b, itab, 0, _FB_I32, 4, 0) not in (8, 16, 32, 64) or _fb_scalar(b, itab, 1, _FB_U8, 1, 0) > 1:
        raise FooterError("ARROW:schema has a dictionary of an index type pyarrow refuses")


# The parameters of each member of Schema.fbs's Type union (slot: kind), all checked on every field as
# flatbuffers' verifier checks them, though only some are decoded.
_TYPE_TABLES: dict[int, tuple[tuple[int, str], ...]] = {
    1: (), 2: ((0, "i32"), (1, "u8")), 3: ((0, "i16"),), 4: (), 5: (), 6: (),
    7: ((0, "i32"), (1, "i32"), (2, "i32")),  # Decimal: precision, scale, bitWidth
    8: ((0, "i16"),), 9: ((0, "i16"), (1, "i32")), 10: ((0, "i16"), (1, "str")), 11: ((0, "i16"),),
    12: (), 13: (), 14: ((0, "i16"), (1, "vec4")), 15: ((0, "i32"),), 16: ((0, "i32"),), 17: ((0, "u8"),),
    18: ((0, "i16"),), 19: (), 20: (), 21: (), 22: (), 23: (), 24: (), 25: (), 26: (),
}


def _fb_check_type_table(b: bytes, p: int, type_id: int) -> tuple[int, int, int]:
    tab = _fb_table(b, p)
    for slot, kind in _TYPE_TABLES.get(type_id, ()):
        if kind == "i32":
            _fb_scalar(b, tab, slot, _FB_I32, 4, 0)
        elif kind == "i16":
            _fb_scalar(b, tab, slot, _FB_I16, 2, 0)
        elif kind == "u8":
            _fb_scalar(b, tab, slot, _FB_U8, 1, 0)
        elif kind == "str":
            _fb_string(b, _fb_slot(b, tab, slot))
        else:  # a vector of 4-byte scalars
            q = _fb_ref(b, _fb_slot(b, tab, slot))
            if q is not None and q + 4 + 4 * _fb_get(_FB_U32, 4, b, q) > len(b):
                raise FooterError("corrupt ARROW:schema: a vector outside its buffer")
    return tab


def _fb_field(b: bytes, t: int, depth: int) -> ArrowField:
    """A Field table: {0 name, 1 nullable, 2 type_type, 3 type, 4 dictionary, 5 children, 6 custom_metadata},
    every part checked (children of every type included) before the supported kinds are decoded."""
    if depth > _FB_MAX_DEPTH:
        raise FooterError("ARROW:schema nested too deep")
    tab = _fb_table(b, t)
    name = _fb_string(b, _fb_slot(b, tab, 0)) or ""
    nullable = _fb_scalar(b, tab, 1, _FB_U8, 1, 0)
    if nullable > 1:
        raise FooterError("corrupt ARROW:schema: a nullable flag that is not a bool")
    type_id = _fb_scalar(b, tab, 2, _FB_U8, 1, 0)
    type_pos = _fb_ref(b, _fb_slot(b, tab, 3))
    if type_id == 0 or type_pos is None:
        raise FooterError(f"ARROW:schema field {name!r} has no type")
    if type_id not in _TYPE_TABLES:  # a type newer than Schema.fbs as read here (and pyarrow 26)
        raise FooterError(f"ARROW:schema field {name!r} has an unknown type {type_id}")
    ttab = _fb_check_type_table(b, type_pos, type_id)
    dict_pos = _fb_ref(b, _fb_slot(b, tab, 4))
    dictionary = dict_pos is not None
    if dictionary:
        _fb_check_dictionary(b, dict_pos)
    children_pos = _fb_slot(b, tab, 5)
    if children_pos is None:  # pyarrow refuses a field without its (possibly empty) children vector
        raise FooterError(f"ARROW:schema field {name!r} has no children vector")
    children = [_fb_field(b, c, depth + 1) for c in _fb_tables(b, children_pos)]
    extension = _fb_is_extension(b, tab)
    if extension:
        typ: tuple = ("other", type_id)
    elif type_id == _ARROW_INT:
        bits = _fb_scalar(b, ttab, 0, _FB_I32, 4, 0)
        if bits not in (8, 16, 32, 64):
            raise FooterError(f"ARROW:schema field {name!r} is an int of {bits} bits")
        signed = _fb_scalar(b, ttab, 1, _FB_U8, 1, 0)
        if signed > 1:
            raise FooterError("corrupt ARROW:schema: a signedness flag that is not a bool")
        typ = ("int", bits, bool(signed))
    elif type_id == _ARROW_FLOAT:
        precision = _fb_scalar(b, ttab, 0, _FB_I16, 2, 0)
        if not 0 <= precision <= 2:
            raise FooterError(f"ARROW:schema field {name!r} has an unknown float precision {precision}")
        typ = ("float", _FLOAT_BITS[precision])
    elif type_id in (_ARROW_BOOL, _ARROW_UTF8, _ARROW_BINARY):
        typ = ("bool",) if type_id == _ARROW_BOOL else ("utf8",) if type_id == _ARROW_UTF8 else ("binary",)
    elif type_id in (_ARROW_LIST, _ARROW_LARGE_LIST, _ARROW_FIXED_SIZE_LIST):
        if len(children) != 1:
            raise FooterError(f"ARROW:schema list field {name!r} has {len(children)} children, not 1")
        if type_id == _ARROW_FIXED_SIZE_LIST:
            size = _fb_scalar(b, ttab, 0, _FB_I32, 4, 0)
            if size < 0:
                raise FooterError(f"ARROW:schema field {name!r} is a list of negative size {size}")
            typ = ("fixed_size_list", size, children[0])
        else:
            typ = ("list" if type_id == _ARROW_LIST else "large_list", children[0])
    else:
        typ = ("other", type_id)
    if children and typ[0] not in _LIST_KINDS and not extension and type_id not in (13, 14, 17, 22):
        # Children on a type that has none (struct, union, map, run-end encoded have them).
        raise FooterError(f"ARROW:schema field {name!r} of a childless type has children")
    return ArrowField(name, bool(nullable), typ, dictionary)


def _decode_schema(blob: str) -> list[ArrowField]:
    try:
        data = binascii.a2b_base64(blob, strict_mode=True)
    except (binascii.Error, ValueError):
        raise FooterError("ARROW:schema is not base64") from None
    # An IPC message: 0xFFFFFFFF then an int32 length (or, before Arrow 0.15, the length alone), then
    # the flatbuffer Message of that many bytes (padding included).
    start = 8 if data[:4] == b"\xff\xff\xff\xff" else 4
    if len(data) < start:
        raise FooterError("ARROW:schema is truncated")
    length = int.from_bytes(data[start - 4:start], "little", signed=True)
    if length <= 0 or length & 7 or start + length > len(data):
        raise FooterError("ARROW:schema's message length does not fit it")
    b = data[start:start + length]
    # Message: {0 version: short, 1 header_type: ubyte, 2 header, 3 bodyLength: long, 4 custom_metadata}.
    msg = _fb_table(b, _fb_get(_FB_U32, 4, b, 0))
    version = _fb_scalar(b, msg, 0, _FB_I16, 2, 0)
    if version not in (3, 4):  # MetadataVersion V4, V5: what pyarrow writes and reads
        raise FooterError(f"ARROW:schema of an unknown metadata version {version}")
    if _fb_scalar(b, msg, 1, _FB_U8, 1, 0) != 1:
        raise FooterError("ARROW:schema's message is not a Schema")
    if _fb_scalar(b, msg, 3, _FB_I64, 8, 0):
        raise FooterError("ARROW:schema's message claims a body")
    _fb_key_values(b, _fb_slot(b, msg, 4))
    header = _fb_ref(b, _fb_slot(b, msg, 2))
    if header is None:
        raise FooterError("ARROW:schema's message has no Schema")
    # Schema: {0 endianness: short (0 little), 1 fields, 2 custom_metadata, 3 features}.
    schema = _fb_table(b, header)
    if _fb_scalar(b, schema, 0, _FB_I16, 2, 0) != 0:
        raise FooterError("ARROW:schema is big-endian")
    _fb_key_values(b, _fb_slot(b, schema, 2))
    _fb_check_longs(b, _fb_slot(b, schema, 3))
    fields_pos = _fb_slot(b, schema, 1)
    if fields_pos is None:
        raise FooterError("ARROW:schema has no fields vector")
    return [_fb_field(b, t, 0) for t in _fb_tables(b, fields_pos)]


# Leaf checks: the Parquet leaf from which pyarrow infers exactly the stored Arrow type (pyarrow presents
# the inferred type and restores only some stored ones: lists, sizes, large lists, dictionaries,
# time zones... never an integer width, so a uint32 stored over a plain INT64 reads as int64).
_INT_CONVERTED = {(8, True): 15, (16, True): 16, (32, True): 17, (64, True): 18,
                  (8, False): 11, (16, False): 12, (32, False): 13, (64, False): 14}
_LIST_KINDS = ("fixed_size_list", "list", "large_list")


def _leaf_matches(t: tuple, e: SchemaElement) -> bool:
    """Whether pyarrow infers the Arrow type ``t`` (a supported, non-list kind) from leaf ``e``."""
    kind, logical, converted = t[0], e.logical, e.converted_type
    if kind == "int":
        if e.type != (2 if t[1] == 64 else 1):
            return False
        if logical is not None:
            return logical == ("INTEGER", t[1], t[2])
        if converted is not None:
            return converted == _INT_CONVERTED[(t[1], t[2])]
        return t[2] and t[1] >= 32
    if kind == "utf8":
        return e.type == 6 and (logical == ("STRING",) or (logical is None and converted == 0))
    if logical is not None or converted is not None:
        return kind == "float" and t[1] == 16 and e.type == 7 and e.type_length == 2 and logical == ("FLOAT16",)
    if kind == "float":
        return (t[1] == 32 and e.type == 4) or (t[1] == 64 and e.type == 5)
    if kind == "bool":
        return e.type == 0
    return kind == "binary" and e.type == 6


def _subtree_end(schema: list[SchemaElement], i: int) -> int:
    """The index after the subtree rooted at schema[i] (the tree was checked by read_footer)."""
    todo = 1
    while todo:
        todo += (schema[i].num_children or 0) - 1
        i += 1
    return i


def _present(f: ArrowField, schema: list[SchemaElement], i: int, list_child: bool) -> tuple[ArrowField, int]:
    """The field pyarrow presents for stored field ``f`` over the Parquet subtree at schema[i], or
    FooterError where it would present anything else; and the index after the subtree."""
    e = schema[i]
    if not list_child and e.name != f.name:
        raise FooterError(f"ARROW:schema field {f.name!r} stands where the Parquet schema has {e.name!r}")
    if e.repetition == 2 or (e.repetition == 1) != f.nullable:
        raise FooterError(f"ARROW:schema field {f.name!r} has another nullability than its Parquet column")
    name = e.name  # a list's child is presented under its Parquet name ("element"), not the stored "item"
    kind = f.type[0]
    if kind == "other":
        return ArrowField(name, f.nullable, f.type, f.dictionary), _subtree_end(schema, i)
    if kind in _LIST_KINDS:
        # The three-level list only: a LIST group, one repeated group (not named as a two-level
        # list's struct element would be), one element.
        n = len(schema)
        if (f.dictionary or e.type is not None or e.num_children != 1
                or not (e.logical == ("LIST",) or (e.logical is None and e.converted_type == 3)) or i + 2 >= n):
            raise FooterError(f"ARROW:schema list field {f.name!r} is not stored as a three-level Parquet list")
        r = schema[i + 1]
        if (r.repetition != 2 or r.type is not None or r.num_children != 1 or r.logical is not None
                or r.converted_type is not None or r.name == "array" or r.name.endswith("_tuple")):
            raise FooterError(f"ARROW:schema list field {f.name!r} is not stored as a three-level Parquet list")
        child, end = _present(f.type[-1], schema, i + 2, True)
        typ = (kind, f.type[1], child) if kind == "fixed_size_list" else (kind, child)
        return ArrowField(name, f.nullable, typ, False), end
    if e.type is None:
        raise FooterError(f"ARROW:schema field {f.name!r} is stored as a Parquet group")
    if f.dictionary and kind not in ("utf8", "binary"):
        raise FooterError(f"ARROW:schema field {f.name!r} is a dictionary pyarrow reads as plain values")
    if not _leaf_matches(f.type, e):
        raise FooterError(f"ARROW:schema field {f.name!r} is stored in a Parquet column pyarrow reads as "
                          "another type")
    return ArrowField(name, f.nullable, f.type, f.dictionary), i + 1


def arrow_schema(footer: Footer) -> list[ArrowField]:
    """The Arrow schema pyarrow presents for the file (``pf.schema_arrow``), one :class:`ArrowField` per
    top-level field: the one stored in the footer's ``ARROW:schema`` key, checked against the Parquet
    schema. Every field of a supported kind must be one pyarrow restores as stored: same name and
    nullability, its Parquet leaf the one pyarrow infers that very type from (a stored uint32 over a
    plain INT64, as format version 1.0 writes it, is read as int64: refused), lists as three-level
    Parquet lists (whose children are then named as Parquet names them, "element").

    Raises FooterError when the key is absent (a file written with ``store_schema=False``), its
    content is not fully understood, or pyarrow would present anything else. A fixed_size_list's
    size is the stored one: that each row holds exactly that many values is the data's to check.
    """
    blob = footer.kv.get("ARROW:schema")
    if blob is None:
        raise FooterError("footer stores no Arrow schema (ARROW:schema)")
    stored = _stored_schema(blob)
    schema = footer.schema
    if len(stored) != schema[0].num_children:
        raise FooterError(f"ARROW:schema has {len(stored)} fields where the Parquet schema has "
                          f"{schema[0].num_children}")
    out = []
    i = 1
    for f in stored:
        g, i = _present(f, schema, i, False)
        out.append(g)
    return out


def _stored_schema(blob: str) -> list[ArrowField]:
    """The fields stored in an ARROW:schema value (decoded once per distinct value: the part files of
    one trace store the same; the fields are shared, read-only)."""
    fields = _SCHEMA_CACHE.get(blob)
    if fields is None:
        try:
            fields = _decode_schema(blob)
        except RecursionError:  # pragma: no cover (the depth limit comes first)
            raise FooterError("ARROW:schema nested too deep") from None
        if len(_SCHEMA_CACHE) >= _SCHEMA_CACHE_MAX:
            _SCHEMA_CACHE.clear()
        _SCHEMA_CACHE[blob] = fields
    return fields
