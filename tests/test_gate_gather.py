"""The stale-gate read path: rows gathered from a mapped wide-column file (``_MappedGate``) against the
obvious twin (the whole column in memory, numpy indexing), and predictions that do not depend on
how many threads computed them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from threadpoolctl import threadpool_info

import replay.predictors.gate as gate
from replay.analyses.accuracy import evaluate
from tests.predict_traces import gating_meta, write_trace
from traces import open_trace
from traces.io.reader import read_wide
from traces.io.writer import write_wide


def _mapped(path: Path, values: np.ndarray) -> np.ndarray:
    """``values`` [rows, width] float32 written as a version 2 wide-column file and mapped back, as
    the stale-gate predictor reads a part's gate inputs."""
    typ = pa.list_(pa.float32(), values.shape[1])
    field = pa.field("gate_input", typ, nullable=False)
    write_wide(pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), type=typ), field, path)
    return gate.mapped_values(read_wide(path, field))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_gather_equals_numpy_indexing(tmp_path_factory, data):
    rows, width = data.draw(st.integers(1, 40), label="rows"), data.draw(st.integers(1, 9), label="width")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
    values = rng.standard_normal((rows, width)).astype(np.float32)
    values[rng.random(values.shape) < 0.05] = np.nan  # NaN travels like any other value
    mapped = _mapped(tmp_path_factory.mktemp("gather") / "part-00000.gate_input.arrow", values)
    assert not mapped.flags.writeable and not mapped.flags.owndata  # a view of the mapped file, not a copy
    pick = data.draw(st.lists(st.integers(0, rows - 1), max_size=3 * rows), label="pick")
    if data.draw(st.booleans(), label="sorted"):
        pick = sorted(pick)
    pick = np.array(pick, dtype=np.int64)
    src = gate._MappedGate(mapped)
    try:
        got = src.take(pick).copy()
        again = src.take(pick[::-1]).copy()  # the scratch is reused: a second take overwrites it
        fresh = src.take_copy(pick)
    finally:
        src.close()
    want = values[pick].astype(np.float64)
    assert got.dtype == np.float64 and got.shape == (pick.size, width)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(again, want[::-1])
    np.testing.assert_array_equal(fresh, want)


def test_gather_refuses_rows_outside_the_part(tmp_path):
    rng = np.random.default_rng(0)
    src = gate._MappedGate(_mapped(tmp_path / "p.arrow", rng.standard_normal((5, 3)).astype(np.float32)))
    try:
        for bad in ([5], [-1], [0, 7]):
            with pytest.raises(IndexError):
                src.take(np.array(bad))
    finally:
        src.close()


def test_predictions_do_not_depend_on_the_number_of_threads(tmp_path, monkeypatch):
    path = write_trace(tmp_path / "t", n_layer=6, moe_layers=[0, 1, 2, 4, 5], n_expert=12, top_k=3, n_embd=16,
                       gating=gating_meta("softmax"), turns=[(5, 30), (3, 20)], seed=3, tokens_per_part=4)
    t = open_trace(path)
    blas_before = [(i["internal_api"], i["num_threads"]) for i in threadpool_info()]
    frames = {}
    for workers in (1, 2, 5):
        monkeypatch.setattr(gate, "_workers", lambda w=workers: w)
        frames[workers] = evaluate(t, ["stale-gate", "ctrl"], horizons=[1, 2], width=5).frame
    assert frames[1].equals(frames[2]) and frames[1].equals(frames[5])
    assert frames[1].height > 0
    # the BLAS thread limit is lifted again afterwards
    assert [(i["internal_api"], i["num_threads"]) for i in threadpool_info()] == blas_before


def test_a_failing_worker_raises_in_the_caller(tmp_path, monkeypatch):
    path = write_trace(tmp_path / "t", n_layer=3, moe_layers=[0, 1, 2], n_expert=8, top_k=2, n_embd=8,
                       gating=gating_meta("softmax"), turns=[(2, 6)], seed=1)
    monkeypatch.setattr(gate, "_workers", lambda: 2)

    def broken(*a, **k):
        raise RuntimeError("rank failed in a worker")

    monkeypatch.setattr(gate, "rank", broken)
    with pytest.raises(RuntimeError, match="rank failed in a worker"):
        evaluate(open_trace(path), ["stale-gate"], horizons=[1])
