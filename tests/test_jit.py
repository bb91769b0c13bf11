"""traces.util.jit: kernels defined without importing Numba, resolved into dispatchers on first need."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import json, sys
import replay.core.simulate, replay.core.streaming, replay.core.loads, replay.policies
from replay.policies import policy_module
for p in ("lru", "lfu", "layer", "lfru", "belady", "infinite", "s3fifo", "sieve", "least-stale", "pin", "colibri", "layer-opt"):
    policy_module(p)  # loaded and validated (its hooks are stand-ins, which count as kernels)
before = "numba" in sys.modules
from replay.core.state import evictable
from traces.util.jit import LazyJit
lazy = isinstance(evictable, LazyJit)
import numpy as np
from replay.core.simulate import prepare_loads, replay
from traces.io.reader import RoutingArrays
ra = RoutingArrays(turn=np.zeros(3, np.int32), batch=np.array([0, 1, 2], np.int32), phase=np.array([0, 1, 1], np.int8),
                   step=np.array([0, 1, 2], np.int32), layer=np.zeros(3, np.int16), experts=np.array([[0], [1], [0]], np.int32),
                   weights=np.zeros((3, 1), np.float32))
r = replay(prepare_loads(ra, [0], 2, np.array([1 << 20])), "lfu", 2.0)
import replay.core.state as cs
from numba.core.dispatcher import Dispatcher
print(json.dumps({"before": before, "lazy": lazy, "after": "numba" in sys.modules, "hits": int(r.acc[:, :, 1].sum()),
                  "swapped": isinstance(cs.evictable, Dispatcher)}))
"""


def test_replay_modules_import_without_numba_and_resolve_on_first_kernel():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=ROOT, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    # lfu ran through the Numba driver: Numba came in then, and every module's stand-in became a dispatcher
    assert got == {"before": False, "lazy": True, "after": True, "hits": 1, "swapped": True}


STAND_IN = """
import json
import numba
from numba.core.dispatcher import Dispatcher
from traces.util import jit

assert not jit.is_resolved()  # a fresh interpreter: Numba imported, but no stand-in resolved yet


@jit.njit(cache=False)
def add(x, y):
    return x + y


held = {"f": add}  # a reference the module sweep cannot see


@numba.njit
def uses(x):
    return held_f(x, 2)


held_f = held["f"]
out = {"lazy_before": isinstance(add, jit.LazyJit), "jitted": jit.is_jitted(add), "call": add(1, 2),
       "dispatcher": isinstance(jit.dispatcher_of(add), Dispatcher)}
held_f = held["f"]  # still the stand-in object, which Numba types as its dispatcher
out["held_is_stand_in"] = isinstance(held_f, jit.LazyJit)
out["typed"] = uses(5)
later = jit.njit(cache=False)(lambda x: x * 3)
out["later"] = isinstance(later, Dispatcher) and later(2) == 6
out["plain"] = jit.is_jitted(lambda x: x)
print(json.dumps(out))
"""


def test_stand_in_called_typed_and_njit_after_resolve():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", STAND_IN], capture_output=True, text=True, env=env, cwd=ROOT, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == {
        "lazy_before": True, "jitted": True, "call": 3, "dispatcher": True, "held_is_stand_in": True, "typed": 7,
        "later": True, "plain": False}


def test_positional_signatures_are_refused():
    import pytest

    from traces.util import jit

    with pytest.raises(TypeError, match="keyword options only"):
        jit.njit("int64(int64)")
