"""A few cases of the hostile run (tests/hostile/run.py, issue 29 "Done when"), one per family that
checks an invariant of its own: a special file offered as a destination, an input offered as a
destination, a full disk, SIGKILL of a sweep with workers, a signal at a random moment, a broken
plugin. Each runs as its own process; none may exit 3, crash, print a traceback, die by a signal's
default action, change an input, replace a special file or leave a process behind. The whole run
(a few hundred cases) is ``python -m tests.hostile.run``; its last summary is in docs/design.md."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("hypothesis")  # the fuzzers' module it draws from imports it
if not Path("/proc/self/stat").exists():
    pytest.skip("the hostile run reads processes from /proc (Linux)", allow_module_level=True)

from tests.hostile.run import World, broken, draw, run_case  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return World(tmp_path_factory.mktemp("hostile") / "world")


@pytest.mark.parametrize("family, seed", [("special-dest", 1), ("input-dest", 2), ("full-disk", 3), ("sigkill", 4),
                                          ("signal", 5), ("plugin", 6)])
def test_a_hostile_case_breaks_nothing(world, tmp_path, family, seed):
    work = tmp_path / "run"
    work.mkdir()
    case = draw(family, random.Random(seed), world, work)
    rec = run_case(0, case, tmp_path)
    assert not broken(rec), rec
