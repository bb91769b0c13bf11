"""How the candidate layouts of trace format v2 read with pyarrow (the measurement behind the choice).

From a trace's routing columns (turn, batch, phase, step, layer, experts, weights), written as one
primitive column per slot (``expert_0 ..``) under several compressions and encodings, one row group
per part, the part boundaries of the trace: the time to read all seven, the experts alone, the
weights alone and the five scalars with ``pq.ParquetFile(part).read(columns, use_threads=False)``
and each column to NumPy, one thread, best of 5; and, for reference, version 1's layout
(``fixed_size_list`` columns, zstd, as its writer wrote them).

    python -m benchmarks.format_layouts [TRACE] [--out DIR]   (default: the format_v2 benchmark's 100k trace)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from benchmarks._common import best_of, machine

SCALARS = ["turn", "batch", "phase", "step", "layer"]


def main() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from traces import open_trace

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", type=Path, default=Path(tempfile.gettempdir()) / "moe-replay-bench-format" / "top1-100k-v2")
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "moe-replay-bench-layouts")
    args = ap.parse_args()
    t = open_trace(args.trace, check_rows=False)
    k = t.top_k
    logical = [t.read_part(i, [*SCALARS, "experts", "weights"]) for i in range(len(t.parts))]
    ex = [f"expert_{j}" for j in range(k)]
    wt = [f"weight_{j}" for j in range(k)]

    def slots(tab: pa.Table) -> pa.Table:
        cols = {c: tab.column(c) for c in SCALARS}
        for name, stem in (("experts", ex), ("weights", wt)):
            v = tab.column(name).combine_chunks().flatten().to_numpy().reshape(-1, k)
            cols.update({s: pa.array(np.ascontiguousarray(v[:, j])) for j, s in enumerate(stem)})
        return pa.table(cols)

    flat = [slots(tab) for tab in logical]
    base = {"use_dictionary": False, "write_statistics": False, "row_group_size": 1 << 40}
    delta = {c: "DELTA_BINARY_PACKED" for c in SCALARS}
    layouts = {
        "v1: lists, zstd (v1 writer)": (logical, {"compression": "zstd", "use_dictionary": False, "write_statistics": True,
                                                  "data_page_size": 8 << 20, "row_group_size": (32 << 20) // (15 + 8 * k)}),
        "slots, zstd": (flat, {**base, "compression": "zstd"}),
        "slots, none": (flat, {**base, "compression": "none"}),
        "slots, snappy": (flat, {**base, "compression": "snappy"}),
        "slots, lz4 (v2)": (flat, {**base, "compression": "lz4"}),
        "slots, lz4, scalars dictionary": (flat, {**base, "compression": "lz4", "use_dictionary": SCALARS}),
        "slots, lz4, scalars delta": (flat, {**base, "compression": "lz4", "column_encoding": delta}),
        "slots, none, scalars dictionary": (flat, {**base, "compression": "none", "use_dictionary": SCALARS}),
        "slots, lz4, 64k-row groups": (flat, {**base, "compression": "lz4", "row_group_size": 1 << 16}),
    }

    def read(paths: list[Path], columns: list[str]) -> None:
        for p in paths:
            tab = pq.ParquetFile(p).read(columns=columns, use_threads=False)
            for c in tab.columns:
                for ch in c.chunks:
                    (ch.values if pa.types.is_fixed_size_list(ch.type) else ch).to_numpy(zero_copy_only=False)

    print(f"machine: {machine()}")
    print(f"trace: {t.path}, {t.n_rows:,} routings, top-{k}, {len(t.parts)} parts")
    print(f"{'layout':34s} {'MiB':>6s} {'all 7 s':>8s} {'experts s':>9s} {'weights s':>9s} {'scalars s':>9s}")
    for n, (name, (tables, opts)) in enumerate(layouts.items()):
        d = args.out / f"layout-{n}"
        d.mkdir(parents=True, exist_ok=True)
        paths = [d / f"part-{i:05d}.parquet" for i in range(len(tables))]
        for tab, p in zip(tables, paths):
            pq.write_table(tab, p, **opts)
        v1 = name.startswith("v1")
        e, w = (["experts"], ["weights"]) if v1 else (ex, wt)
        mib = sum(p.stat().st_size for p in paths) / 2**20
        secs = [best_of(lambda cols=cols, paths=paths: read(paths, cols)) for cols in (SCALARS + e + w, e, w, SCALARS)]
        print(f"{name:34s} {mib:6.1f} {secs[0]:8.3f} {secs[1]:9.3f} {secs[2]:9.3f} {secs[3]:9.3f}")


if __name__ == "__main__":
    main()
