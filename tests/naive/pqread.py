"""The twin of traces/_pq.c's read_chunk: one column of one row group, read by pyarrow.

Obviously correct by construction: pyarrow reads the file (whatever its pages, encodings and
codecs), and the column comes back as one flat NumPy array of its values in row order, a fixed-size
list column's lists concatenated (rows * width values), as read_chunk writes them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def read_column(path: str | Path, row_group: int, name: str) -> np.ndarray | None:
    """The values of column ``name`` in row group ``row_group`` of the Parquet file ``path``, flat;
    None when pyarrow finds a null there (no flat array of values exists: read_chunk must refuse).
    Raises whatever pyarrow raises on a file it cannot read."""
    table = pq.ParquetFile(path).read_row_group(row_group, columns=[name], use_threads=False)
    arr = table.column(0).combine_chunks()
    if pa.types.is_fixed_size_list(arr.type) or pa.types.is_list(arr.type):
        if arr.null_count:
            return None
        arr = arr.flatten()
    if arr.null_count:
        return None
    return arr.to_numpy(zero_copy_only=False)
