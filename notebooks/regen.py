"""Execute the notebooks and write them back with their outputs, normalised so that a rerun on any
machine writes the same bytes (tests/test_notebooks.py reruns them and compares).

    python -m notebooks.regen                  # every notebook in notebooks/
    python -m notebooks.regen quickstart       # one (name with or without .ipynb)
    make notebooks-regen                       # the same, through the Makefile

Normalised: execution counts numbered 1, 2, ... in cell order; no per-cell ``execution`` metadata
(timestamps); the kernel and language metadata fixed (no Python version); consecutive stream
outputs merged (the kernel splits them by timing); the first-run Numba compile notice dropped; PNG
text chunks (matplotlib's version stamp) removed. Each file is written atomically (a temporary file
beside it, then one rename) and only when its bytes change.
"""

from __future__ import annotations

import base64
import os
import struct
import sys
import tempfile
from pathlib import Path

import nbformat

from replay.core.progress import COMPILE_NOTICE

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
REGEN_COMMAND = "make notebooks-regen (or: python -m notebooks.regen)"
# Stream lines that depend on what ran before on this machine, not on the notebook.
MACHINE_LINES = (COMPILE_NOTICE,)
KERNEL_ENV = {"POLARS_TABLE_WIDTH": "100"}
KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}
LANGUAGE_INFO = {"codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py", "mimetype": "text/x-python",
                 "name": "python", "nbconvert_exporter": "python", "pygments_lexer": "ipython3"}


def notebook_paths(names: list[str] | None = None) -> list[Path]:
    """The notebooks to run: all of notebooks/*.ipynb, or the ones named."""
    if not names:
        return sorted(HERE.glob("*.ipynb"))
    paths = [HERE / (n if n.endswith(".ipynb") else f"{n}.ipynb") for n in names]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise SystemExit(f"notebooks/: no notebook named {', '.join(missing)}")
    return paths


def _strip_png_text(b64: str) -> str:
    """A PNG without its text chunks (matplotlib writes its version as 'Software')."""
    data = base64.b64decode(b64)
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return b64
    out, pos = [data[:8]], 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        end = pos + 12 + length
        if kind not in (b"tEXt", b"iTXt", b"zTXt"):
            out.append(data[pos:end])
        pos = end
    return base64.b64encode(b"".join(out)).decode()


def _normalise_outputs(outputs: list, count: int) -> list:
    merged: list = []
    for out in outputs:
        out = nbformat.from_dict(dict(out))
        if out.output_type == "stream":
            text = "".join(line for line in out.text.splitlines(keepends=True) if not line.startswith(MACHINE_LINES))
            if not text:
                continue
            if merged and merged[-1].output_type == "stream" and merged[-1].name == out.name:
                merged[-1].text += text
                continue
            out.text = text
        elif out.output_type in ("display_data", "execute_result"):
            out.metadata = {}
            if "image/png" in out.data:
                out.data["image/png"] = _strip_png_text(out.data["image/png"])
            if out.output_type == "execute_result":
                out.execution_count = count
            out.pop("transient", None)
        merged.append(out)
    return merged


def normalise(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The notebook with everything that varies between runs and machines removed (in place)."""
    nb.metadata = nbformat.from_dict({"kernelspec": KERNELSPEC, "language_info": LANGUAGE_INFO})
    nb.nbformat, nb.nbformat_minor = 4, 5
    count = 0
    for i, cell in enumerate(nb.cells):
        cell.setdefault("id", f"cell-{i:02d}")
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        count += 1
        cell.execution_count = count
        cell.outputs = _normalise_outputs(cell.outputs, count)
    return nb


def dumps(nb: nbformat.NotebookNode) -> str:
    """The notebook's bytes as committed (nbformat's own layout, one trailing newline)."""
    return nbformat.writes(nb).rstrip("\n") + "\n"


def execute(path: Path, timeout_s: int = 600) -> nbformat.NotebookNode:
    """Run a notebook top to bottom in a fresh kernel (working directory notebooks/), normalised."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    # Polars sizes its text tables to the terminal when the kernel's stdout is one (a kernel started
    # from a shell inherits it): a fixed width makes the text the same from a shell, pytest or CI.
    env = {**os.environ, **KERNEL_ENV}
    client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    client.execute(env=env)
    return normalise(nb)


def write_atomic(path: Path, text: str) -> bool:
    """Write text to path through a temporary file and one rename; False when nothing changed."""
    if path.is_file() and path.read_text() == text:
        return False
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def main(argv: list[str] | None = None) -> int:
    from nbclient.exceptions import CellExecutionError

    status = 0
    for path in notebook_paths(sys.argv[1:] if argv is None else argv):
        name = path.relative_to(ROOT)
        try:
            nb = execute(path)
        except CellExecutionError as e:  # the notebook's own sentence (e.g. the real trace is absent)
            print(f"{name}: not written: {e.ename}: {e.evalue}", file=sys.stderr)
            status = 1
            continue
        print(f"{name}: {'rewritten' if write_atomic(path, dumps(nb)) else 'unchanged'}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
