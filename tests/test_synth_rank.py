"""The low-rank synthetic model (``synth --rank R``): its kernels agree bit for bit with the naive
twin (tests/naive/synth.py), its traces are consistent (routings follow from the stored gate
inputs and routers), look like routing, and do not depend on chunking or on --routing-only."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import assert_one_sentence_error, run_cli
from tests.naive.synth import naive_lowrank_routes
from tests.test_synth import _recompute, assert_looks_like_routing
from traces import open_trace
from traces.io.reader import fixed_list_to_numpy
from traces.synth.generator import SynthConfig, _LowRankModel


@st.composite
def lowrank_configs(draw):
    experts = draw(st.integers(2, 12))
    embd = draw(st.integers(2, 10))
    return SynthConfig(layers=draw(st.integers(1, 4)), experts=experts, top_k=draw(st.integers(1, experts)), embd=embd,
                       rank=draw(st.integers(1, embd - 1)), seed=draw(st.integers(0, 2**63 - 1)),
                       reuse=draw(st.floats(0, 0.99)), drift=draw(st.floats(0, 3)), skew=draw(st.floats(0, 5)),
                       routing_only=draw(st.booleans()))


@settings(max_examples=25, deadline=None)
@given(cfg=lowrank_configs(), chunks=st.lists(st.integers(0, 6), min_size=1, max_size=3))
def test_kernels_equal_naive_twin(cfg, chunks):
    fast, slow = _LowRankModel(cfg), _LowRankModel(cfg)
    for n in chunks:
        a, b = fast.routes(n), naive_lowrank_routes(slow, n)
        assert sorted(a) == sorted(b)
        for c in a:
            assert a[c].dtype == b[c].dtype and a[c].shape == b[c].shape, c
            assert a[c].tobytes() == b[c].tobytes(), c
    assert fast.topic.tobytes() == slow.topic.tobytes() and fast.u.tobytes() == slow.u.tobytes()


def test_chunking_and_routing_only_do_not_change_routings():
    cfg = SynthConfig(layers=5, experts=32, top_k=4, embd=24, rank=6, seed=4)
    whole = _LowRankModel(cfg).routes(40)
    m = _LowRankModel(SynthConfig(**{**cfg.__dict__, "routing_only": True}))
    parts = [m.routes(n) for n in (1, 13, 26)]
    for c in ("experts", "weights"):
        assert np.concatenate([p[c] for p in parts]).tobytes() == whole[c].tobytes()
    assert "logits" not in parts[0]


@pytest.mark.parametrize("gating", ["softmax", "sigmoid-bias", "grouped"])
def test_rank_routings_follow_from_stored_inputs(synth_trace_dir, gating):
    d = synth_trace_dir(layers=4, experts=32, top_k=4, embd=16, tokens=40, prompt_tokens=8, gating=gating, seed=3, rank=5)
    tr = open_trace(d)
    assert tr.meta["provenance"]["synth"]["rank"] == 5
    _recompute(tr)
    # The gate inputs are exact multiples of 2^-12: the f32 values are the model's own numbers.
    g = fixed_list_to_numpy(tr.table(["gate_input"]).column("gate_input")).astype(np.float64)
    assert np.array_equal(g * 4096, np.round(g * 4096)) and (g[:, 0] == 1.0).all()


def test_rank_looks_like_routing_not_noise(synth_trace_dir):
    """As tests/test_synth.py asks of the full-width model: skew rises with depth, consecutive
    tokens reuse experts, a one-layer-stale router mostly agrees."""
    L, E, k = 12, 64, 6
    d = synth_trace_dir(layers=L, experts=E, top_k=k, embd=64, tokens=300, prompt_tokens=0, seed=1, rank=16)
    assert_looks_like_routing(open_trace(d), L, E, k)


def test_rank_trace_deterministic_and_requests(tmp_path):
    args = ["--layers", "3", "--experts", "16", "--top-k", "2", "--embd", "8", "--tokens", "9", "--prompt-tokens", "4",
            "--rank", "3", "--requests", "4", "--max-batch", "2", "--prefill-chunk", "3"]
    for name in ("a", "b"):
        assert run_cli("synth", tmp_path / name, *args, "--seed", "7").code == 0
    assert run_cli("synth", tmp_path / "ro", *args, "--seed", "7", "--routing-only").code == 0
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    full, ro = open_trace(tmp_path / "a").arrays(), open_trace(tmp_path / "ro").arrays()
    assert np.array_equal(full.experts, ro.experts) and np.array_equal(full.batch, ro.batch)
    assert sorted(np.unique(open_trace(tmp_path / "a").table(["request"]).column("request").to_numpy()).tolist()) == [0, 1, 2, 3]


@pytest.mark.parametrize("args, needle", [(["--rank", "0"], "--rank 0"), (["--embd", "8", "--rank", "8"], "--rank 8"),
                                          (["--rank", "300", "--embd", "512"], "--rank 300")])
def test_rank_refused_outside_its_range(tmp_path, args, needle):
    res = run_cli("synth", tmp_path / "o", *args)
    assert_one_sentence_error(res, needle)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("value", ["-1", "nan", "abc", "1.5", str(10**30), ""])
def test_rank_bad_values_one_sentence(tmp_path, value):
    res = run_cli("synth", tmp_path / "o", "--layers", "2", "--experts", "4", "--top-k", "2", "--embd", "4", "--tokens", "2",
                  "--rank", value)
    assert_one_sentence_error(res, "--rank")
    assert not (tmp_path / "o").exists()
