"""Reading a trace's routing columns: the compiled chunk reader (traces._pq) against pyarrow, per column.

For each column of ``routings/``, the time to read it from every part file (one thread): ``pyarrow``
is ``pq.ParquetFile(part).read(columns=[c], use_threads=False)`` (footer included); ``native`` is
``traces._pq.read_chunk`` on every row group's chunk, into a ``memoryview(bytearray)`` per chunk
allocated beforehand (its allocation is not the reader's: a fresh ~1 MiB bytearray costs page
faults that depend on malloc's state, 0.1-1 ms a part), with the file opened and closed per part and
the chunk offsets known beforehand (the footer, parsed once here with pyarrow, is not timed: the
native path parses it in Python). Best of 5 each, alternating; the two must give the same bytes, or
the benchmark stops.

    python -m benchmarks.pq_read [TRACE]   (default: /tmp/moe-replay-bench-top1-100k)
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from benchmarks._common import best_of, machine

CODECS = {"UNCOMPRESSED": 0, "ZSTD": 6}
PHYSICAL = {"INT32": 1, "INT64": 2, "FLOAT": 4, "DOUBLE": 5}


def main() -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from traces import pq_native

    trace = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.gettempdir()) / "moe-replay-bench-top1-100k"
    mod = pq_native.load()
    if mod is None:
        raise SystemExit(f"traces._pq is not available: {pq_native.why_unavailable()}")
    parts = sorted((trace / "routings").glob("part-*.parquet"))
    print(f"machine: {machine()}")
    print(f"trace: {trace}, {len(parts)} parts; libzstd {mod.zstd_version()}")
    schema = pq.ParquetFile(parts[0]).schema_arrow
    plans: dict[str, list] = {}
    for f in schema:
        typ, width = (f.type.value_type, f.type.list_size) if pa.types.is_fixed_size_list(f.type) else (f.type, 0)
        fmt = np.dtype(typ.to_pandas_dtype()).char
        plan = []
        for p in parts:
            pf = pq.ParquetFile(p)
            j = pf.schema_arrow.get_field_index(f.name)
            for i in range(pf.metadata.num_row_groups):
                c = pf.metadata.row_group(i).column(j)
                leaf = pf.schema.column(j)
                start = c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset
                rows = pf.metadata.row_group(i).num_rows
                plan.append((str(p), i, (start, c.total_compressed_size, CODECS.get(c.compression, -1),
                                         PHYSICAL.get(c.physical_type, -1), leaf.max_repetition_level,
                                         leaf.max_definition_level, width, rows),
                             rows * max(width, 1) * np.dtype(fmt).itemsize, fmt))
        plans[f.name] = plan

    bufs = {name: [memoryview(bytearray(nbytes)).cast(fmt) for *_, nbytes, fmt in plan] for name, plan in plans.items()}

    def native(name: str) -> list[memoryview]:
        fd, cur = -1, None
        for (path, _, args, _, _), buf in zip(plans[name], bufs[name]):
            if path != cur:
                if fd >= 0:
                    os.close(fd)
                fd, cur = os.open(path, os.O_RDONLY), path
            st = mod.read_chunk(fd, *args, buf)
            if st:
                raise SystemExit(f"{path} {name}: refused: {mod.STATUS[st]}")
        os.close(fd)
        return bufs[name]

    def arrow(name: str) -> list:
        return [pq.ParquetFile(p).read(columns=[name], use_threads=False) for p in parts]

    print(f"{'column':<10} {'pyarrow ms':>11} {'native ms':>10} {'ratio':>6}")
    for name in plans:
        ref = b"".join(_flat_bytes(t) for t in arrow(name))
        if b"".join(bytes(b) for b in native(name)) != ref:
            raise SystemExit(f"{name}: the native reader's bytes differ from pyarrow's")
        ta = tn = float("inf")
        for _ in range(5):
            ta = min(ta, best_of(lambda n=name: arrow(n), 1))
            tn = min(tn, best_of(lambda n=name: native(n), 1))
        print(f"{name:<10} {ta * 1e3:11.1f} {tn * 1e3:10.1f} {ta / tn:6.1f}")


def _flat_bytes(table) -> bytes:
    import pyarrow as pa

    col = table.column(0).combine_chunks()
    if pa.types.is_fixed_size_list(col.type):
        col = col.flatten()
    return col.to_numpy().tobytes()


if __name__ == "__main__":
    main()
