"""The synthetic generator's fast paths give exactly what the slow, obvious code gave: the gate
inputs drawn for a whole chunk at once equal the per-token loop's, and the partition-based top-k
equals the first k of a stable argsort (ties to the lower index)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from traces.format.gating import top_indices
from traces.synth.generator import SynthConfig, _Model


def tokens_per_token_loop(model: _Model, n: int) -> np.ndarray:
    """The generator's original per-token loop (the twin of _Model.tokens)."""
    cfg = model.cfg
    L, D = cfg.layers, cfg.embd
    rho = cfg.reuse
    keep = np.sqrt(1.0 - rho * rho)
    g = np.empty((L, n, D), dtype=np.float32)
    for t in range(n):
        model.topic = rho * model.topic + keep * model.rng.standard_normal(D)
        model.u = rho * model.u + keep * model.rng.standard_normal((L, D))
        h = 0.8 * model.topic + 0.6 * model.rng.standard_normal(D)
        stream = h + cfg.drift * np.cumsum(model.u, axis=0)
        norm = stream / np.sqrt(np.mean(stream * stream, axis=1, keepdims=True))
        norm[:, 0] = 1.0
        g[:, t, :] = norm
    return g


@settings(max_examples=15, deadline=None)
@given(layers=st.integers(1, 7), embd=st.integers(2, 300), seed=st.integers(0, 2**63 - 1),
       chunks=st.lists(st.integers(0, 9), min_size=1, max_size=4), reuse=st.floats(0, 0.99))
def test_chunk_draw_equals_per_token_loop(layers, embd, seed, chunks, reuse):
    cfg = SynthConfig(layers=layers, experts=4, top_k=1, embd=embd, seed=seed, reuse=reuse)
    fast, slow = _Model(cfg), _Model(cfg)
    for n in chunks:
        a, b = fast.tokens(n), tokens_per_token_loop(slow, n)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    assert fast.topic.tobytes() == slow.topic.tobytes() and fast.u.tobytes() == slow.u.tobytes()


values = st.sampled_from([0.0, -0.0, 1.0, 1.0, 2.0, -1.0, np.inf, -np.inf, 0.5, 3.25])


@settings(max_examples=200, deadline=None)
@given(scores=st.integers(1, 12).flatmap(lambda e: arrays(np.float64, st.tuples(st.integers(0, 6), st.just(e)),
                                                            elements=values | st.floats(-4, 4, width=32))),
       data=st.data())
def test_top_indices_equals_stable_argsort(scores, data):
    k = data.draw(st.integers(1, scores.shape[1]))
    want = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    assert np.array_equal(top_indices(scores, k), want)
    s32 = scores.astype(np.float32)
    assert np.array_equal(top_indices(s32, k), np.argsort(-s32, axis=1, kind="stable")[:, :k])


def test_top_indices_nan_falls_back_to_the_sort():
    s = np.array([[1.0, np.nan, 2.0, 2.0]])
    assert top_indices(s, 2).tolist() == [[2, 3]]
