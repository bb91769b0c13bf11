"""Rewrite a format version 1 trace as version 2 (``moe-replay upgrade``; ``docs/format.md``).

The old trace is opened and checked by the reader like any other, its rows handed part by part to
:class:`traces.io.writer.TraceWriter` (one new part per old part, so memory is one part), its
``trace.json`` kept key for key (only ``version`` changes), ``router.parquet`` and
``metrics.parquet`` copied byte for byte (their layout is the same in both versions). The new trace
is written into a staging directory, opened and checked again, and only then renamed into place:
the input is never modified and nothing half-written is left behind.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from traces.format.errors import TraceError, UserError
from traces.format.schema import METRICS_FILE, ROUTER_FILE, SLOT_STEMS, VERSION, WIDE_COLUMNS

# Keys of trace.json the writer sets itself.
_WRITER_KEYS = ("format", "version", "complete", "columns", "rows", "gate_input_dtype")


def upgrade_trace(src: str | Path, out_dir: str | Path, force: bool = False) -> dict[str, Any]:
    """Write the version 1 trace ``src`` as a version 2 trace ``out_dir`` (atomically; ``force``
    replaces an existing ``out_dir``, never an input). Returns {"from_version", "version", "rows",
    "parts"}."""
    from traces.io.atomic import staged_dir
    from traces.io.reader import fixed_list_to_numpy, open_trace
    from traces.io.writer import TraceWriter

    tr = open_trace(src)
    if tr.version == VERSION:
        raise UserError(f"{tr.path}: is already format version {VERSION}; there is nothing to upgrade.")
    meta = {k: copy.deepcopy(v) for k, v in tr.meta.items() if k not in _WRITER_KEYS}
    columns = tuple(tr.columns)
    logical = ["turn", "batch", "phase", "step", "layer", "experts", "weights", *columns]
    with staged_dir(out_dir, force=force, inputs=[tr.path]) as stage:
        w = TraceWriter(stage, meta, columns=columns, gate_input_dtype=tr.meta.get("gate_input_dtype", "float32"),
                        tokens_per_part=1 << 40)  # parts are cut where the old ones were (flush below)
        for t in tr.iter_tables(logical):
            cols = {c: (fixed_list_to_numpy(t.column(c)) if c in SLOT_STEMS or c in WIDE_COLUMNS else t.column(c).to_numpy())
                    for c in logical}
            w.append(**cols)
            w.flush()
            del t, cols
        w.close(complete=tr.complete)
        for name in (ROUTER_FILE, METRICS_FILE):
            if (tr.path / name).is_file():
                shutil.copyfile(tr.path / name, stage / name)
        try:
            new = open_trace(stage)
        except TraceError as e:  # a bug, not the user's: the old trace passed the same checks
            raise UserError(f"{out_dir}: the upgraded trace would be invalid ({e.problem}); nothing was written.") from None
        if new.n_rows != tr.n_rows or len(new.parts) != len(tr.parts):
            raise UserError(f"{out_dir}: the upgraded trace holds {new.n_rows} rows in {len(new.parts)} parts, the old one "
                            f"{tr.n_rows} in {len(tr.parts)}; nothing was written.")
    return {"from_version": int(tr.version), "version": VERSION, "rows": int(np.int64(tr.n_rows)), "parts": len(tr.parts)}
