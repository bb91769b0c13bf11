"""The eval callback's native ask phase (engine_bridge.native_ask) decides exactly as the hook's
Python one: on each tiny architecture, one decode per token with both, the same nodes are asked
about and observed, the same routing (ids, weights, router logits) is read, and with a routing
override the same weights are written (the model's output logits are bit-identical)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'moe-replay[capture]')")

from engine_bridge.engine import Engine, EngineOptions  # noqa: E402
from engine_bridge.gguf_static import read_static  # noqa: E402
from engine_bridge.hook import MoeHook  # noqa: E402
from engine_bridge.tinymodel import ARCHS, TinyModelConfig, write_tiny_model  # noqa: E402

pytestmark = pytest.mark.capture
TOKENS = [1, 5, 9, 2, 7, 7, 3, 11, 4, 6]


def _run(path, static, native: bool, override):
    hook = MoeHook(static.n_layer, observe_logits=True, want_logits=True, want_gate_input=True, native=native)
    hook.override = override
    eng = Engine(str(path), EngineOptions(n_ctx=len(TOKENS), ubatch=1, threads=1, arch=static.arch, kv_type="f32",
                                          flash_attn="off"), hook.callback)  # the callback carries its user data
    caps, outs = [], []
    try:
        for pos, t in enumerate(TOKENS):
            outs.append(eng.decode([t], pos))
            caps.append(hook.take())
    finally:
        eng.close()
    return hook, caps, np.stack(outs)


def _drop_second(_layer: int, _ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
    new = weights.copy()
    new[:, 1] = 0
    return new


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("override", [None, _drop_second], ids=["observe", "override"])
def test_native_ask_equals_the_python_ask(tmp_path, arch, override):
    path = write_tiny_model(tmp_path / "m.gguf", TinyModelConfig(arch=arch, layers=3, experts=8, top_k=2, embd=64, seed=2))
    static = read_static(str(path))
    py, py_caps, py_out = _run(path, static, False, override)
    nat, nat_caps, nat_out = _run(path, static, True, override)
    assert nat.native and not py.native
    assert nat.asked == py.asked > 0 and nat.observed == py.observed > 0
    assert np.array_equal(py_out, nat_out)
    for a, b in zip(py_caps, nat_caps):
        assert sorted(a) == sorted(b) == list(static.moe_layers)
        for layer in a:
            for field in ("experts", "weights", "logits", "gate_input", "dropped"):
                x, y = getattr(a[layer], field), getattr(b[layer], field)
                assert (x is None and y is None) or np.array_equal(x, y), (layer, field)
