"""Helpers for tests: run the CLI in-process and capture what a user would see."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass

from replay.cli import main


@dataclass
class CliResult:
    code: int
    out: str
    err: str

    def json(self) -> dict:
        return json.loads(self.out)


def run_cli(*args: str) -> CliResult:
    """Run ``moe-replay ARGS`` in this process; return exit code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return CliResult(code, out.getvalue(), err.getvalue())


def assert_one_sentence_error(res: CliResult, *needles: str) -> None:
    """Bad input: non-zero exit, one line on stderr naming the problem, no traceback."""
    assert res.code != 0, f"expected failure, got exit 0 with {res.out!r}"
    from replay.core.progress import COMPILE_NOTICE

    # the first-run compile notice (a kernel compiled before the input was refused) is not part of the error
    lines = [ln for ln in res.err.splitlines() if ln.strip() and ln != COMPILE_NOTICE]
    assert "Traceback" not in res.err, res.err
    assert len(lines) == 1, f"expected one line on stderr, got: {res.err!r}"
    assert lines[0].startswith("moe-replay: error: "), lines[0]
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"


def assert_import_refused(fmt: str, src, text: str, out, options: tuple, *needles: str) -> None:
    """``src`` rewritten as ``text`` (a good input, corrupted), ``moe-replay import FMT SRC OUT
    OPTIONS`` is refused with one sentence naming each of ``needles``, and writes nothing."""
    src.write_text(text)
    assert_one_sentence_error(run_cli("import", fmt, src, out, *options), *needles)
    assert not out.exists()


def rewrite_part(part, fn) -> None:
    """Rewrite one part file of a trace through ``fn`` (a tests' corruption): ``fn`` gets the part's
    *logical* columns (``experts`` as ``[rows, k]`` lists, as the reader hands them out, wide
    columns left out) and returns a table that is written back in the trace's own format version:
    version 1 as it is, version 2 with each list split into its slot columns (``experts`` ->
    ``expert_0..``) whatever their types, so a wrong type or a missing column reaches the file."""
    import json
    from pathlib import Path

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from traces.format.schema import SLOT_STEMS, WIDE_COLUMNS
    from traces.io.writer import write_part

    part = Path(part)
    meta = json.loads((part.parent.parent / "trace.json").read_text())
    if meta["version"] == 1:
        pq.write_table(fn(pq.read_table(part)), part)
        return
    from traces.io.reader import Trace

    cols = [c for c in ("turn", "batch", "phase", "step", "layer", "experts", "weights", *meta.get("columns", []))
            if c not in WIDE_COLUMNS]
    n = pq.ParquetFile(part).metadata.num_rows
    tr = Trace(part.parent.parent, meta, [part], [n])
    t = fn(tr.read_part(0, cols))
    fields, arrays = [], []
    for f in t.schema:
        col = t.column(f.name).combine_chunks()
        if pa.types.is_fixed_size_list(f.type):
            v = col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), f.type.list_size)
            for j in range(f.type.list_size):
                fields.append(pa.field(f"{SLOT_STEMS[f.name]}_{j}", f.type.value_type, nullable=False))
                arrays.append(pa.array(np.ascontiguousarray(v[:, j]), type=f.type.value_type))
        else:
            fields.append(f)
            arrays.append(col)
    write_part(pa.Table.from_arrays(arrays, schema=pa.schema(fields)), part)


def rewrite_wide(part, column: str, fn) -> None:
    """Rewrite wide ``column`` (logits, gate_input) of one version 2 part: ``fn`` edits its values, a
    writable ``[rows, width]`` NumPy copy, in place."""
    from pathlib import Path

    import numpy as np
    import pyarrow as pa

    from traces.format.schema import wide_file
    from traces.io.writer import write_wide

    path = wide_file(Path(part), column)
    with pa.memory_map(str(path)) as src:
        t = pa.ipc.open_file(src).read_all()
    field = t.schema.field(0)
    col = t.column(0).combine_chunks()
    width = field.type.list_size
    values = np.array(col.values.to_numpy(zero_copy_only=False)).reshape(-1, width)
    fn(values)
    write_wide(pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), type=field.type.value_type), type=field.type),
               field, path)
