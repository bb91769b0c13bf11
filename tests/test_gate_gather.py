"""The stale-gate read path: rows gathered from a mapped part file (``_MappedGate``) against the
obvious twin (the whole column in memory, numpy indexing), and predictions that do not depend on
how many threads computed them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from threadpoolctl import threadpool_info

import replay.predictors.gate as gate
from replay.predict import evaluate
from tests.predict_traces import gating_meta, write_trace
from traces import open_trace
from traces.pages import ValuePages, plan_fixed_list


def _raw_file(path: Path, values: np.ndarray, cuts: list[int], gaps: list[int], rng) -> ValuePages:
    """``values`` [rows, width] float32 written as pages: the flat values cut at ``cuts`` (any
    value, so rows straddle pages), each page preceded by ``gaps[p]`` junk bytes (so its values
    start at every alignment), like page headers and levels."""
    flat = values.reshape(-1)
    bounds = [0, *cuts, flat.size]
    blob, spans = bytearray(), []
    for p in range(len(bounds) - 1):
        blob += rng.integers(0, 256, gaps[p], dtype=np.uint8).tobytes()
        chunk = flat[bounds[p]:bounds[p + 1]].tobytes()
        spans.append((len(blob), len(chunk)))
        blob += chunk
    blob += b"\x00" * 3
    path.write_bytes(bytes(blob))
    return ValuePages(path, np.dtype("<f4"), values.shape[0], values.shape[1], tuple(spans))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_gather_equals_numpy_indexing(tmp_path_factory, data):
    rows, width = data.draw(st.integers(1, 40), label="rows"), data.draw(st.integers(1, 9), label="width")
    n = rows * width
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, n - 1)), max_size=8), label="cuts"))) if n > 1 else []
    gaps = data.draw(st.lists(st.integers(0, 7), min_size=len(cuts) + 1, max_size=len(cuts) + 1), label="gaps")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31), label="seed"))
    values = rng.standard_normal((rows, width)).astype(np.float32)
    values[rng.random(values.shape) < 0.05] = np.nan  # NaN travels like any other value
    plan = _raw_file(tmp_path_factory.mktemp("gather") / "part.bin", values, cuts, gaps, rng)
    pick = data.draw(st.lists(st.integers(0, rows - 1), max_size=3 * rows), label="pick")
    if data.draw(st.booleans(), label="sorted"):
        pick = sorted(pick)
    pick = np.array(pick, dtype=np.int64)
    src = gate._MappedGate(plan)
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
    plan = _raw_file(tmp_path / "p.bin", rng.standard_normal((5, 3)).astype(np.float32), [4], [1, 2], rng)
    src = gate._MappedGate(plan)
    try:
        for bad in ([5], [-1], [0, 7]):
            with pytest.raises(IndexError):
                src.take(np.array(bad))
    finally:
        src.close()


def test_gather_from_a_parquet_file_with_many_unaligned_pages(tmp_path):
    rng = np.random.default_rng(7)
    width, rows = 13, 300
    values = rng.standard_normal((rows, width)).astype(np.float32)
    arr = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), width)
    path = tmp_path / "part.parquet"
    pq.write_table(pa.table({"gate_input": arr}), path, compression="none", use_dictionary=False,
                   write_statistics=False, data_page_size=256, write_batch_size=7, row_group_size=111)
    plan = plan_fixed_list(path, "gate_input")
    assert plan is not None and len(plan.spans) > 10
    assert {o % 4 for o, _ in plan.spans} != {0}, "no unaligned page: the unaligned loads are not exercised"
    src = gate._MappedGate(plan)
    try:
        pick = np.arange(rows)[::-1].copy()
        np.testing.assert_array_equal(src.take(pick), values[pick].astype(np.float64))
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
