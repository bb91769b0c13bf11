"""The notebooks run end to end (they are committed without outputs)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import SHARED_DATA

NB = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.mark.parametrize("name", ["quickstart.ipynb", "study_real_trace.ipynb"])
def test_notebook_runs(name, monkeypatch):
    if name.startswith("study") and not (SHARED_DATA / "qwen.route.csv").is_file():
        pytest.skip(f"real trace {SHARED_DATA} is absent (../shared/data is not beside this checkout)")
    monkeypatch.setenv("MOE_REPLAY_SHARED", str(SHARED_DATA.parent.parent))
    nb = nbformat.read(NB / name, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit notebooks without outputs"
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NB)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
