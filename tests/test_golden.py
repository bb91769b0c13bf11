"""Every verb's ``--json`` output, written files, and the reports of the synthetic and real traces,
byte for byte against tests/golden/expected/ (recorded by the code before the one-body change,
issue 27). Only the tool's version string and sweep cache keys are masked (tests/golden/cases.py).

A difference here is a changed figure: if it is meant, say why in the commit and rerun
``python -m tests.golden.regen``.
"""

from __future__ import annotations

import difflib

import pytest

from tests.golden.cases import EXPECTED, SHARED_DATA, everything

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    return everything(tmp_path_factory.mktemp("golden") / "work")


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
