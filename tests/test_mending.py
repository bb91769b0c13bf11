"""Issue 15 item 5: one version, one units module, documented shapes that match, dead code gone."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def test_version_has_one_source():
    import replay
    from traces.format.version import __version__

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in meta["project"] and "version" in meta["project"]["dynamic"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "traces.format.version.__version__"}
    assert replay.__version__ == __version__


def test_mib_and_phases_defined_once():
    from traces.format import schema
    from traces.util import units

    assert units.MIB == 1 << 20 and (schema.PHASE_PREFILL, schema.PHASE_DECODE) == (units.PHASE_PREFILL, units.PHASE_DECODE)
    defining = [str(p.relative_to(ROOT)) for d in ("replay", "traces", "engine_bridge", "benchmarks")
                for p in (ROOT / d).rglob("*.py")
                if re.search(r"^(MIB|PHASE_PREFILL|PHASE_DECODE)\s*=", p.read_text(), flags=re.M)]
    assert defining == ["traces/util/units.py"]


def test_replay_result_acc_shape_matches_its_docstring():
    from replay.core.driver import N_ACC
    from replay.core.simulate import ReplayResult, prepare_loads, replay
    from traces.io.reader import RoutingArrays

    ra = RoutingArrays(turn=np.zeros(3, np.int32), batch=np.arange(3, dtype=np.int32), phase=np.ones(3, np.int8),
                       step=np.arange(3, dtype=np.int32), layer=np.zeros(3, np.int16),
                       experts=np.array([[0], [1], [0]], np.int32), weights=np.ones((3, 1), np.float32))
    res = replay(prepare_loads(ra, [0], 2, np.array([1 << 20])), "lru", 1.0)
    assert res.acc.shape == (2, 1, N_ACC) and res.bacc.shape == (3, N_ACC)
    assert f"[2, L, N_ACC = {N_ACC}]" in ReplayResult.__doc__ and "[B, N_ACC]" in ReplayResult.__doc__


def test_dead_code_is_gone():
    import replay.cli as cli
    from replay.policies import lfru

    assert not hasattr(lfru, "score")
    assert "saved_bytes(" not in (ROOT / "replay" / "analyses" / "drop_cold.py").read_text().replace("saved_bytes_and_misses(", "")
    assert "n_expert" not in (ROOT / "replay" / "predictors" / "metrics.py").read_text().split("def row_scores(")[1].split(")")[0]
    assert "ModuleNotFoundError" not in Path(cli.__file__).read_text()
