"""Every verb's ``--json`` output, written files, and the reports of the synthetic and real traces,
byte for byte against tests/golden/expected/ (recorded by the code before the one-body change,
issue 27). Only the tool's version string and sweep cache keys are masked (tests/golden/cases.py).

A difference here is a changed figure: if it is meant, say why in the commit and rerun
``python -m tests.golden.regen``.
"""

from __future__ import annotations

import difflib
import json
import subprocess
import sys

import pytest

from tests.golden.cases import EXPECTED, ROOT, SHARED_DATA

pytestmark = pytest.mark.slow


# The cases run in a fresh interpreter of their own: in this one, an earlier test may have registered
# a plugin policy, which the report's "every registered online policy" would then rank too.
_RUN = "import json, sys; from pathlib import Path; from tests.golden.cases import everything; " \
       "Path(sys.argv[2]).write_text(json.dumps(everything(Path(sys.argv[1]))))"


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    base = tmp_path_factory.mktemp("golden")
    res = subprocess.run([sys.executable, "-c", _RUN, str(base / "work"), str(base / "out.json")], cwd=ROOT,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads((base / "out.json").read_text())


def test_every_expected_output_is_produced(outputs):
    expected = {p.stem for p in EXPECTED.glob("*.txt")}
    if not (SHARED_DATA / "qwen.route.csv").is_file():
        expected = {n for n in expected if not any(r in n for r in ("qwen", "gemma", "gptoss"))}
    assert expected <= set(outputs), sorted(expected - set(outputs))


@pytest.mark.parametrize("name", sorted(p.stem for p in EXPECTED.glob("*.txt")))
def test_output_is_byte_identical(outputs, name):
    if name not in outputs:
        pytest.skip(f"{name}: needs the real traces in {SHARED_DATA}, which is absent")
    want = (EXPECTED / f"{name}.txt").read_text()
    got = outputs[name]
    if got != want:
        diff = "".join(list(difflib.unified_diff(want.splitlines(True), got.splitlines(True), "expected", "now"))[:80])
        pytest.fail(f"{name} changed:\n{diff}")
