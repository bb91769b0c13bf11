"""The notebooks are committed with their outputs, and those outputs are what a fresh run gives:
each test executes a notebook (notebooks/regen.py, the same code `make notebooks-regen` runs) and
compares, cell by cell, with the committed file (issue 20 item 5)."""

from __future__ import annotations

import base64
import re
import struct
import tempfile
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from notebooks import regen
from tests.conftest import SHARED_DATA

ROOT = Path(__file__).resolve().parent.parent
NB = ROOT / "notebooks"
NAMES = ["quickstart.ipynb", "study_real_trace.ipynb"]
# What must not be in a committed output: absolute paths (temporary directories, home, this
# checkout) and wall-clock timings (an output that prints seconds is stale on the next run).
ABSOLUTE = re.compile(r"(?<![\w.])(/tmp/|/var/folders/|/home/|/Users/|/work/|[A-Z]:\\)")
TIMING = re.compile(r"\b\d+(\.\d+)?\s?(s|ms|sec|secs|seconds|it/s)(?![/\w])|\belapsed\b", re.I)


def _texts(nb) -> list[tuple[int, str]]:
    """(code cell index, text) for every textual output: streams, text/plain, text/html."""
    out = []
    for i, cell in enumerate(nb.cells):
        for o in cell.get("outputs", []):
            if o.output_type == "stream":
                out.append((i, o.text))
            elif o.output_type in ("display_data", "execute_result"):
                out += [(i, o.data[k]) for k in ("text/plain", "text/html") if k in o.data]
            elif o.output_type == "error":
                out.append((i, f"{o.ename}: {o.evalue}"))
    return out


def _where(name: str, i: int, cell) -> str:
    """The cell as a reader finds it: its In [n] number (else its position) and first line."""
    first = cell.source.strip().splitlines()[0] if cell.source.strip() else ""
    where = f"cell [{cell.execution_count}]" if cell.get("execution_count") else f"cell #{i + 1}"
    return f"notebooks/{name} {where} (`{first[:60]}`)"


@pytest.mark.parametrize("name", NAMES)
def test_committed_with_normalised_outputs(name):
    """Every code cell ran (its count and outputs are in the file), and the file is in the form the
    regeneration writes: no per-run metadata, no PNG version stamps, nothing on stderr, no machine
    paths or timings in any output."""
    text = (NB / name).read_text()
    nb = nbformat.reads(text, as_version=4)
    assert nb.cells[0].cell_type == "markdown", f"notebooks/{name} should open with what it answers (a markdown cell)"
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    assert [c.execution_count for _, c in code] == list(range(1, len(code) + 1)), \
        f"notebooks/{name} is committed without its outputs; regenerate with {regen.REGEN_COMMAND}"
    assert sum(bool(c.outputs) for _, c in code) >= len(code) - 1, f"notebooks/{name}: cells without outputs"
    assert regen.dumps(regen.normalise(nbformat.reads(text, as_version=4))) == text, \
        f"notebooks/{name} is not in normalised form; regenerate with {regen.REGEN_COMMAND}"
    for i, cell in code:
        for o in cell.outputs:
            assert o.output_type != "error", f"{_where(name, i, cell)} ends in {o.ename}: {o.evalue}"
            assert not (o.output_type == "stream" and o.name == "stderr"), f"{_where(name, i, cell)} writes to stderr: {o.text[:200]!r}"
    for i, t in _texts(nb):
        assert not ABSOLUTE.search(t), f"{_where(name, i, nb.cells[i])} prints a machine path: {ABSOLUTE.search(t).group(0)!r}"
        assert not TIMING.search(t), f"{_where(name, i, nb.cells[i])} prints a timing: {TIMING.search(t).group(0)!r}"


@pytest.mark.parametrize("name", NAMES)
def test_outputs_are_not_stale(name, monkeypatch):
    """A fresh run (the committed sources, a new kernel) gives the committed outputs, byte for byte
    after normalisation; the first differing cell is named with the command that regenerates."""
    if name.startswith("study") and not (SHARED_DATA / "qwen.route.csv").is_file():
        pytest.skip(f"real trace {SHARED_DATA} is absent (../shared/data is not beside this checkout, MOE_REPLAY_SHARED unset)")
    monkeypatch.setenv("MOE_REPLAY_SHARED", str(SHARED_DATA.parent.parent))
    committed = nbformat.read(NB / name, as_version=4)
    fresh = regen.execute(NB / name)
    assert len(fresh.cells) == len(committed.cells)
    for i, (old, new) in enumerate(zip(committed.cells, fresh.cells, strict=True)):
        if old.cell_type == "code" and old.outputs != new.outputs:
            pytest.fail(f"{_where(name, i, old)} is stale: a fresh run prints something else; regenerate with {regen.REGEN_COMMAND}",
                        pytrace=False)
    assert regen.dumps(fresh) == (NB / name).read_text(), \
        f"notebooks/{name}: metadata is stale; regenerate with {regen.REGEN_COMMAND}"


def test_study_without_the_real_trace_says_so_in_one_sentence(monkeypatch, tmp_path):
    """Without the data the notebook's first code cell stops the run with one sentence (no
    traceback) naming where it looked and the variable that moves it."""
    monkeypatch.setenv("MOE_REPLAY_SHARED", str(tmp_path))
    nb = nbformat.read(NB / "study_real_trace.ipynb", as_version=4)
    first = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    nb.cells = nb.cells[: first + 2]  # the loader and the markdown after it: a run that stopped shows nothing more
    nb.cells.append(nbformat.v4.new_code_cell("print('ran on')"))
    with pytest.raises(CellExecutionError) as err:
        NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(NB)}}).execute()
    assert err.value.ename == "TraceAbsent"
    outs = nb.cells[first].outputs
    assert [o.output_type for o in outs] == ["stream"], outs
    line = outs[0].text.strip()
    assert "\n" not in line and line.endswith(".") and str(tmp_path) in line and "MOE_REPLAY_SHARED" in line, line
    assert not nb.cells[-1].get("outputs")


def test_data_location_documented():
    """The study notebook and notebooks/README.md say where the real trace is looked for, the way
    tests/conftest.py does (MOE_REPLAY_SHARED, else ../shared beside the checkout)."""
    nb = nbformat.read(NB / "study_real_trace.ipynb", as_version=4)
    for text in (nb.cells[0].source, (NB / "README.md").read_text()):
        assert "MOE_REPLAY_SHARED" in text and "../shared/data/bigmoeonedge-2026-07-15/" in text
    assert SHARED_DATA.name == "bigmoeonedge-2026-07-15" and SHARED_DATA.parent.name == "data"


def _png(chunks: list[tuple[bytes, bytes]]) -> str:
    import zlib

    body = b"".join(struct.pack(">I", len(d)) + k + d + struct.pack(">I", zlib.crc32(k + d)) for k, d in chunks)
    return base64.b64encode(b"\x89PNG\r\n\x1a\n" + body).decode()


def test_normalise_removes_what_varies_between_runs():
    """Execution timestamps, split streams, the first-run compile notice, PNG version stamps, the
    Python version and unnumbered cells are what differ between two runs of the same notebook."""
    from replay.core.progress import COMPILE_NOTICE

    ihdr = (b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))
    nb = nbformat.v4.new_notebook(metadata={"language_info": {"name": "python", "version": "3.11.9"}})
    cell = nbformat.v4.new_code_cell("x", execution_count=7, metadata={"execution": {"iopub.status.busy": "2026-11-30T22:00:00Z"}})
    cell.outputs = [
        nbformat.v4.new_output("stream", name="stdout", text="a\n"),
        nbformat.v4.new_output("stream", name="stderr", text=COMPILE_NOTICE + "\n"),
        nbformat.v4.new_output("stream", name="stdout", text="b\n"),
        nbformat.v4.new_output("display_data", data={"image/png": _png([ihdr, (b"tEXt", b"Software\x00Matplotlib 3"), (b"IEND", b"")])}),
        nbformat.v4.new_output("execute_result", data={"text/plain": "1"}, execution_count=7),
    ]
    nb.cells = [nbformat.v4.new_markdown_cell("# t"), cell]
    out = regen.normalise(nb)
    c = out.cells[1]
    assert c.execution_count == 1 and "execution" not in c.metadata
    assert [(o.output_type, o.get("text")) for o in c.outputs[:1]] == [("stream", "a\nb\n")]
    assert c.outputs[1].data["image/png"] == _png([ihdr, (b"IEND", b"")])
    assert c.outputs[2].execution_count == 1
    assert "version" not in out.metadata.language_info and out.metadata.kernelspec.name == "python3"
    assert regen.dumps(out) == regen.dumps(regen.normalise(nbformat.reads(regen.dumps(out), as_version=4)))


def test_write_atomic_only_when_changed():
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "n.ipynb"
        assert regen.write_atomic(p, "one\n") and p.read_text() == "one\n"
        assert not regen.write_atomic(p, "one\n")
        assert regen.write_atomic(p, "two\n") and p.read_text() == "two\n"
        assert [q.name for q in Path(d).iterdir()] == ["n.ipynb"]


def test_make_notebooks_installs_pinned_jupyterlab_and_opens_them():
    """`make notebooks` installs the `notebooks` extra (JupyterLab at the version constraints.txt
    pins) into .venv and starts it on notebooks/; `make notebooks-regen` runs notebooks/regen.py."""
    import tomllib

    make = (ROOT / "Makefile").read_text()
    rule = lambda target: re.search(rf"^{re.escape(target)}:(.*)\n((?:\t.*\n)+)", make, flags=re.M)  # noqa: E731
    stamp = rule("$(VENV)/.notebooks")
    assert stamp and "-e '.[notebooks]'" in stamp.group(2) and "$(PIP)" in stamp.group(2)
    nbs, regen_rule = rule("notebooks"), rule("notebooks-regen")
    assert nbs and "$(VENV)/.notebooks" in nbs.group(1) and "$(VENV)/bin/jupyter lab notebooks/" in nbs.group(2)
    assert regen_rule and "$(VENV)/.notebooks" in regen_rule.group(1) and "$(PY) -m notebooks.regen" in regen_rule.group(2)
    assert re.search(r"^\.PHONY:.*\bnotebooks\b.*\bnotebooks-regen\b", make, flags=re.M)
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["notebooks"]
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().split() if "==" in line)
    lab = next(r for r in extra if r.startswith("jupyterlab=="))
    assert lab == f"jupyterlab=={pins['jupyterlab']}"
    assert {"nbclient", "nbformat", "ipykernel"} <= {re.split(r"[<>=]", r)[0] for r in extra}
