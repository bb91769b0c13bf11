"""Streaming replay (replay.cache_stream): a trace cut into many small parts, replayed part by part
with the cache state carried across parts, gives exactly the figures of the in-memory replay of
the whole trace, for every streamable policy (belady through its backward next-use pass); and
loads built part by part equal the loads of the whole trace's arrays."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay.cache import loads_of, prepare_loads, replay, result_rows
from replay.cache_stream import replay_stream, stream_memory_bytes, streamable
from replay.policies import names
from traces import open_trace
from traces.errors import UserError

CONFIGS = {
    # one request: a 20-row prefill load per layer, then one row per load
    "one": dict(layers=4, experts=16, top_k=2, embd=8, tokens=160, prompt_tokens=20, routing_only=True, seed=3),
    # many requests batched: loads of several rows, batches of several tokens
    "many": dict(layers=3, experts=12, top_k=3, embd=8, tokens=30, prompt_tokens=6, routing_only=True, seed=5,
                 requests=5, max_batch=3, prefill_chunk=4),
}
POLICIES = [p for p in names() if streamable(p)]
BUDGETS = [9.0, 30.0]  # below and above one token cycle (expert sizes ~2.5-2.9 MiB)


def split_parts(src: Path, dst: Path, rows: int) -> Path:
    """A copy of ``src`` whose routings are rewritten as part files of ``rows`` rows each (cutting
    through loads and batches)."""
    shutil.copytree(src, dst)
    rdir = dst / "routings"
    table = pa.concat_tables([pq.read_table(p) for p in sorted(rdir.glob("part-*.parquet"))])
    for p in rdir.glob("part-*.parquet"):
        p.unlink()
    for i, a in enumerate(range(0, table.num_rows, rows)):
        pq.write_table(table.slice(a, rows), rdir / f"part-{i:05d}.parquet")
    return dst


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def traces(request, synth_trace_dir, tmp_path_factory):
    src = synth_trace_dir(**CONFIGS[request.param])
    split = split_parts(src, tmp_path_factory.mktemp("split") / "t", rows=7)
    return open_trace(src), open_trace(split)


def test_split_really_has_many_parts(traces):
    whole, split = traces
    assert len(split.parts) > 20 and split.n_rows == whole.n_rows


def test_loads_built_part_by_part_equal_whole_arrays(traces):
    whole, split = traces
    ref = prepare_loads(whole.arrays(recorded=False), whole.moe_layers, whole.n_expert, whole.expert_bytes)
    for tr, chunk in ((whole, None), (split, None), (whole, 5), (split, 3)):
        got = loads_of(tr, chunk_rows=chunk)
        for f in dataclasses.fields(ref):
            a, b = getattr(ref, f.name), getattr(got, f.name)
            if isinstance(a, np.ndarray):
                assert a.dtype == b.dtype and np.array_equal(a, b), (f.name, chunk)
            else:
                assert a == b, f.name


def _rows(loads, res):
    return json.dumps(result_rows(loads, res, per_layer=True), sort_keys=True, default=str)


@pytest.mark.parametrize("chunk", [None, 2])
def test_streamed_equals_in_memory(traces, chunk):
    whole, split = traces
    ref_loads = loads_of(whole)
    cells = [(p, b) for p in POLICIES for b in BUDGETS]
    s_loads, results = replay_stream(split, cells, chunk_rows=chunk)
    assert {"belady", "lru", "lfu", "least-stale", "layerlfu"} <= set(POLICIES)
    for (p, b), got in zip(cells, results, strict=True):
        ref = replay(ref_loads, p, b)
        assert np.array_equal(ref.acc, got.acc), (p, b)
        assert np.array_equal(ref.bacc, got.bacc), (p, b)
        assert np.array_equal(ref.stats, got.stats), (p, b)
        assert (ref.evictions, ref.overflow_loads) == (got.evictions, got.overflow_loads)
        assert _rows(ref_loads, ref) == _rows(s_loads, got), (p, b)
    for f in ("batch_turn", "batch_step", "batch_phase", "batch_tokens"):
        assert np.array_equal(getattr(ref_loads, f), getattr(s_loads, f)), f


def test_belady_streamed_misses_fewer_than_lru(traces):
    """The next-use pass is not a no-op: belady's order differs from LRU's and is never worse."""
    _, split = traces
    _, (lru, bel) = replay_stream(split, [("lru", 9.0), ("belady", 9.0)])
    assert bel.hits >= lru.hits and bel.lookups == lru.lookups


def test_policy_planning_from_whole_trace_is_refused(traces):
    _, split = traces
    for p in ("pin", "colibri", "layer-opt"):
        assert not streamable(p)
        with pytest.raises(UserError, match="does not stream"):
            replay_stream(split, [(p, 9.0)])


def test_memory_estimate_covers_the_loads(traces):
    whole, _ = traces
    est = stream_memory_bytes(whole)
    loads = loads_of(whole)
    held = sum(getattr(loads, f.name).nbytes for f in dataclasses.fields(loads) if isinstance(getattr(loads, f.name), np.ndarray))
    assert est["in_memory"] >= held
    assert est["streamed"] < est["in_memory"]


def test_info_says_what_a_replay_holds(traces):
    from replay.info import info_rows
    from replay.present.info import info_text
    from traces.units import MIB

    whole, _ = traces
    row = info_rows(whole)[0]
    est = stream_memory_bytes(whole)
    assert row["cache_memory_mib_in_memory"] == est["in_memory"] / MIB
    assert row["cache_memory_mib_streamed"] == est["streamed"] / MIB
    text = info_text(whole, row)
    assert "streamed part by part" in text
    assert "the verbs do not stream yet" in text  # the figure says which path it is about


def test_sweep_stream_frame_equals_sweep(traces):
    from replay.cache import sweep
    from replay.cache_stream import sweep_stream

    whole, split = traces
    pols = ["lru", "belady", "layer", "s3fifo"]
    ref = sweep(loads_of(whole), pols, BUDGETS, per_layer=True, show_progress=False)
    got = sweep_stream(split, pols, BUDGETS, per_layer=True, chunk_rows=5)
    assert ref.write_csv() == got.write_csv()


def prepare_loads_reference(a, moe_layers, n_expert):
    """The previous prepare_loads (int64 throughout, batches numbered by np.unique): the twin of
    the narrow one, for the fields it computes."""
    lidx_of = np.full(max(moe_layers) + 1, -1, dtype=np.int64)
    lidx_of[list(moe_layers)] = np.arange(len(moe_layers))
    layer = a.layer.astype(np.int64)
    lidx = lidx_of[layer]
    entries = np.ascontiguousarray(lidx[:, None] * n_expert + a.experts.astype(np.int64), dtype=np.int32)
    batch = a.batch.astype(np.int64)
    R = batch.shape[0]
    change = np.ones(R, dtype=bool)
    if R:
        change[1:] = (np.diff(batch) != 0) | (np.diff(layer) != 0)
    starts = np.flatnonzero(change)
    _, binv = np.unique(batch, return_inverse=True)
    bfirst = np.flatnonzero(np.r_[True, np.diff(batch) != 0]) if R else np.zeros(0, np.int64)
    return {"entries": entries, "load_start": np.append(starts, R).astype(np.int64), "load_lidx": lidx[starts].astype(np.int32),
            "load_batch": binv.reshape(-1)[starts].astype(np.int32), "load_phase": a.phase[starts].astype(np.int8),
            "batch_turn": a.turn[bfirst].astype(np.int32), "batch_step": a.step[bfirst].astype(np.int32)}


def test_prepare_loads_equals_reference_in_and_out_of_order():
    from traces.reader import RoutingArrays

    rng = np.random.default_rng(7)
    for i in range(200):
        R, k = int(rng.integers(0, 40)), int(rng.integers(1, 4))
        batch = rng.integers(0, 6, R).astype(np.int32)
        if i % 2:
            batch = np.sort(batch)
        a = RoutingArrays(turn=rng.integers(0, 3, R).astype(np.int32), batch=batch, phase=rng.integers(0, 2, R).astype(np.int8),
                          step=rng.integers(0, 50, R).astype(np.int32), layer=rng.choice([1, 3, 4], R).astype(np.int16),
                          experts=rng.integers(0, 7, (R, k)).astype(np.int32), weights=np.zeros((R, k), np.float32))
        got = prepare_loads(a, [1, 3, 4], 7, np.array([0, 5, 0, 7, 9], np.int64))
        for name, want in prepare_loads_reference(a, [1, 3, 4], 7).items():
            have = getattr(got, name)
            assert have.dtype == want.dtype and np.array_equal(have, want), (i, name)
