"""Streaming replay (replay.core.streaming): a trace cut into many small parts, replayed part by part
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

from replay.core.simulate import loads_of, prepare_loads, replay, result_rows
from replay.core.streaming import replay_stream, stream_memory_bytes, streamable
from replay.policies import names
from traces import open_trace
from traces.format.errors import UserError

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
        with pytest.raises(UserError, match="cannot stream"):
            replay_stream(split, [(p, 9.0)])


def test_memory_estimate_covers_the_loads(traces):
    whole, _ = traces
    est = stream_memory_bytes(whole)
    loads = loads_of(whole)
    held = sum(getattr(loads, f.name).nbytes for f in dataclasses.fields(loads) if isinstance(getattr(loads, f.name), np.ndarray))
    assert est["in_memory"] >= held
    assert est["streamed"] < est["in_memory"]


def test_info_says_what_a_replay_holds(traces):
    from replay.analyses.info import info_rows
    from replay.present.info import info_text
    from traces.util.units import MIB

    whole, _ = traces
    row = info_rows(whole)[0]
    est = stream_memory_bytes(whole)
    assert row["cache_memory_mib_in_memory"] == est["in_memory"] / MIB
    assert row["cache_memory_mib_streamed"] == est["streamed"] / MIB
    text = info_text(whole, row)
    assert "streamed part by part" in text
    assert "cache --stream auto" in text  # the figure says which path it is about and when the verb streams


def test_sweep_stream_frame_equals_sweep(traces):
    from replay.core.simulate import sweep
    from replay.core.streaming import sweep_stream

    whole, split = traces
    pols = ["lru", "belady", "layer", "s3fifo"]
    ref = sweep(loads_of(whole), pols, BUDGETS, per_layer=True, show_progress=False)
    got = sweep_stream(split, pols, BUDGETS, per_layer=True, chunk_rows=5)
    assert ref.write_csv() == got.write_csv()


def prepare_loads_reference(a, moe_layers, n_expert):
    """The previous prepare_loads (int64 throughout, batches numbered by np.unique): the twin of
    the narrow one, for the fields it computes (per load and per batch: each load's batch and
    phase are the Loads' derived ones, its batches' starts found here by search)."""
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
    load_batch = binv.reshape(-1)[starts].astype(np.int32)
    n_batch = int(load_batch.max()) + 1 if R else 0
    return {"entries": entries, "load_start": np.append(starts, R).astype(np.int64), "load_lidx": lidx[starts].astype(np.int16),
            "load_batch": load_batch, "load_phase": a.phase[starts].astype(np.int8),
            "batch_start": np.searchsorted(load_batch, np.arange(n_batch + 1)).astype(np.int64),
            "batch_turn": a.turn[bfirst].astype(np.int32), "batch_step": a.step[bfirst].astype(np.int32)}


def test_prepare_loads_equals_reference_and_refuses_what_it_cannot_hold():
    """Rows in batch order, one phase per batch: the reference's arrays. Batches out of order, or a
    batch of both phases (no valid trace has them): refused in words."""
    from traces.io.reader import RoutingArrays

    rng = np.random.default_rng(7)
    for i in range(300):
        R, k = int(rng.integers(0, 40)), int(rng.integers(1, 4))
        batch = rng.integers(0, 6, R).astype(np.int32)
        if i % 3:
            batch = np.sort(batch)
        phase = rng.integers(0, 2, 6).astype(np.int8)[batch]
        if i % 5 == 0 and R:
            phase[rng.integers(0, R)] ^= 1
        a = RoutingArrays(turn=rng.integers(0, 3, R).astype(np.int32), batch=batch, phase=phase,
                          step=rng.integers(0, 50, R).astype(np.int32), layer=rng.choice([1, 3, 4], R).astype(np.int16),
                          experts=rng.integers(0, 7, (R, k)).astype(np.int32), weights=np.zeros((R, k), np.float32))
        same = np.r_[False, batch[1:] == batch[:-1]] if R else np.zeros(0, bool)
        if R and (batch[1:] < batch[:-1]).any():
            with pytest.raises(UserError, match="go back to an earlier batch"):
                prepare_loads(a, [1, 3, 4], 7, np.array([0, 5, 0, 7, 9], np.int64))
            continue
        if R and (same[1:] & (phase[1:] != phase[:-1])).any():
            with pytest.raises(UserError, match="mixes prefill and decode"):
                prepare_loads(a, [1, 3, 4], 7, np.array([0, 5, 0, 7, 9], np.int64))
            continue
        got = prepare_loads(a, [1, 3, 4], 7, np.array([0, 5, 0, 7, 9], np.int64))
        for name, want in prepare_loads_reference(a, [1, 3, 4], 7).items():
            have = getattr(got, name)
            assert have.dtype == want.dtype and np.array_equal(have, want), (i, name)


# -- the cache verb: --stream on / off give the same bytes; what cannot stream is refused --------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.helpers import assert_one_sentence_error, rewrite_part, run_cli  # noqa: E402

# Small synthetic traces: one request or several batched (request column: the checker's Python
# path), top-1 to top-3, a prompt or none.
SMALL = [
    dict(layers=3, experts=8, top_k=1, embd=8, tokens=40, prompt_tokens=0, routing_only=True, seed=11),
    dict(layers=2, experts=6, top_k=2, embd=8, tokens=30, prompt_tokens=5, routing_only=True, seed=12),
    dict(layers=3, experts=9, top_k=3, embd=8, tokens=12, prompt_tokens=4, routing_only=True, seed=13, requests=3,
         max_batch=2, prefill_chunk=3),
]


def _split(src: Path, rows: int, tmp: Path) -> Path:
    dst = tmp / f"split-{src.parent.name}-{rows}"
    return dst if dst.exists() else split_parts(src, dst, rows)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=st.integers(0, len(SMALL) - 1), rows=st.integers(1, 13), per_layer=st.booleans(), default_budgets=st.booleans())
def test_cache_cli_stream_on_equals_off_byte_for_byte(synth_trace_dir, tmp_path_factory, cfg, rows, per_layer, default_budgets):
    """Property: over small traces cut into tiny parts, `cache --json` prints the same bytes
    streamed and in memory, for every streamable policy (belady included), with the default
    budgets (the working set computed part by part) or given ones, overall and per layer."""
    path = _split(synth_trace_dir(**SMALL[cfg]), rows, tmp_path_factory.getbasetemp())
    args = ["cache", path, "--json", "--policies", ",".join(POLICIES)] + ([] if default_budgets else ["--budgets", "3,9,30"])
    args += ["--per-layer"] if per_layer else []
    off, on = run_cli(*args, "--stream", "off"), run_cli(*args, "--stream", "on")
    assert off.code == 0, off.err
    assert on.code == 0, on.err
    assert on.out == off.out
    assert json.loads(on.out)["rows"]


def test_cache_cli_table_and_compact_streamed_equal_in_memory(traces):
    _, split = traces
    for fmt in ("table", "compact"):
        args = ["cache", split.path, "--format", fmt, "--policies", "lru,belady,infinite,s3fifo", "--flash-mib-s", "1000",
                "--compute-ms", "5"]
        off, on = run_cli(*args, "--stream", "off"), run_cli(*args, "--stream", "on")
        assert off.code == 0 and on.code == 0, (off.err, on.err)
        assert on.out == off.out, fmt


def test_cache_cli_stream_refusals(traces):
    _, split = traces
    assert_one_sentence_error(run_cli("cache", split.path, "--stream", "maybe"), "--stream 'maybe' is not one of auto, on, off")
    assert_one_sentence_error(run_cli("cache", split.path, "--stream", "on", "--policies", "lru,pin"),
                              "--stream on: policy pin plans from the whole trace", "--stream off")
    assert_one_sentence_error(run_cli("cache", split.path, "--stream", "on", "--retain"), "--stream on: --retain replays in memory only")
    assert_one_sentence_error(run_cli("cache", split.path, "--stream", "on", "--validate", "--budget-mib", "9"),
                              "--stream on: --validate")
    # auto replays what cannot stream in memory, with the same figures as off
    auto = run_cli("cache", split.path, "--json", "--policies", "lru,pin", "--budgets", "9", "--stream", "auto")
    off = run_cli("cache", split.path, "--json", "--policies", "lru,pin", "--budgets", "9", "--stream", "off")
    assert auto.code == 0 and auto.out == off.out


def test_auto_streams_by_the_memory_estimate(traces, monkeypatch):
    import replay.core.streaming as cs

    _, split = traces
    calls = []
    real = cs.stream_sweep
    monkeypatch.setattr(cs, "stream_sweep", lambda *a, **k: calls.append(1) or real(*a, **k))
    args = ("cache", split.path, "--json", "--policies", "lru", "--budgets", "9")
    small = run_cli(*args)
    assert small.code == 0 and not calls  # a small trace: in memory
    assert not cs.auto_streams(split)
    monkeypatch.setattr(cs, "AUTO_STREAM_MIB", 0)
    assert cs.auto_streams(split)
    big = run_cli(*args)
    assert big.code == 0 and calls == [1] and big.out == small.out
    assert run_cli(*args, "--stream", "off").out == small.out and calls == [1]


def test_api_cache_stream_equals_in_memory(traces):
    import replay

    _, split = traces
    kw = dict(policies=["lru", "belady", "sieve"], per_layer=True)
    assert replay.cache(split, stream="on", **kw).write_csv() == replay.cache(split, stream="off", **kw).write_csv()
    with pytest.raises(replay.ReplayError, match="policy colibri plans from the whole trace"):
        replay.cache(split, policies=["colibri"], stream="on")


# -- bad rows: checked as the replay reads them, refused in the same sentence --------------------

CORRUPTIONS = ("expert_range", "expert_dup", "layer_range", "layer_not_moe", "phase", "order", "duplicate", "batch_back",
               "phase_mix", "weight_neg", "weight_inf", "weight_partial_nan", "weight_rank", "weight_ok")


def _corrupt(path: Path, kind: str, part: int, row: int, n_layer: int, n_expert: int) -> None:
    rewrite_part(path / "routings" / f"part-{part:05d}.parquet", lambda t: _mutated(t, kind, row, n_layer, n_expert))


def _mutated(t: pa.Table, kind: str, row: int, n_layer: int, n_expert: int) -> pa.Table:
    cols = {c: (t.column(c).to_numpy(zero_copy_only=False).copy() if not pa.types.is_fixed_size_list(t.schema.field(c).type)
                else np.stack(t.column(c).to_numpy(zero_copy_only=False)).copy()) for c in t.column_names}
    r = row % t.num_rows
    ex, w = cols["experts"], cols["weights"]
    k = ex.shape[1]
    prev = max(r - 1, 0)
    if kind == "expert_range":
        ex[r, k - 1] = n_expert
    elif kind == "expert_dup" and k > 1:
        ex[r, 1] = ex[r, 0]
    elif kind == "layer_range":
        cols["layer"][r] = n_layer
    elif kind == "layer_not_moe":
        cols["layer"][r] = -1
    elif kind == "phase":
        cols["phase"][r] = 2
    elif kind == "order":
        cols["step"][r] = cols["step"][prev] - 1
    elif kind == "duplicate":
        for c in cols:
            cols[c][r] = cols[c][prev]
    elif kind == "batch_back":
        cols["batch"][r] = cols["batch"][prev] - 1
    elif kind == "phase_mix":
        cols["phase"][r] = 1 - cols["phase"][r]
    elif kind == "weight_neg":
        w[r, 0] = -0.25
    elif kind == "weight_inf":
        w[r, 0] = np.inf
    elif kind == "weight_partial_nan" and k > 1:
        w[r, :] = 0.5
        w[r, 1] = np.nan
    elif kind == "weight_rank" and k > 1:
        w[r, :] = np.linspace(0.1, 0.5, k)
    elif kind == "weight_ok":
        w[r, :] = np.linspace(0.5, 0.1, k)
    arrays = []
    for c in t.column_names:
        fld = t.schema.field(c)
        if pa.types.is_fixed_size_list(fld.type):
            arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(cols[c].reshape(-1), type=fld.type.value_type),
                                                            fld.type.list_size))
        else:
            arrays.append(pa.array(cols[c], type=fld.type))
    return pa.Table.from_arrays(arrays, schema=t.schema)


def _outcome(fn):
    from traces.format.errors import TraceError

    try:
        fn()
    except TraceError as e:
        return str(e)
    return None


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=st.integers(0, len(SMALL) - 1), kind=st.sampled_from(CORRUPTIONS), part=st.integers(0, 50), row=st.integers(0, 50))
def test_bad_rows_refused_alike_when_checked_as_read(synth_trace_dir, tmp_path_factory, cfg, kind, part, row):
    """Property: a corrupted part is refused with the same sentence by open_trace (the full check
    up front) and by a replay that checks the rows as it reads them (in memory and streamed); a
    part that passes one passes all and replays to the same figures."""
    import tempfile

    src = _split(synth_trace_dir(**SMALL[cfg]), 9, tmp_path_factory.getbasetemp())
    with tempfile.TemporaryDirectory(dir=tmp_path_factory.getbasetemp()) as d:
        path = Path(d) / "t"
        shutil.copytree(src, path)
        t0 = open_trace(path)
        _corrupt(path, kind, part % len(t0.parts), row, t0.n_layer, t0.n_expert)
        ref = _outcome(lambda: open_trace(path))
        got_mem = _outcome(lambda: loads_of(open_trace(path, defer_rows=True)))
        got_stream = _outcome(lambda: replay_stream(open_trace(path, defer_rows=True), [("lru", 9.0)]))
        assert got_mem == ref and got_stream == ref, (kind, ref, got_mem, got_stream)
        if ref is None:
            whole = loads_of(open_trace(path))
            s_loads, (res,) = replay_stream(open_trace(path, defer_rows=True), [("lru", 9.0)])
            assert _rows(whole, replay(whole, "lru", 9.0)) == _rows(s_loads, res)
        else:
            res = run_cli("cache", path, "--json", "--budgets", "9", "--policies", "lru")
            assert_one_sentence_error(res, ref)


def test_deferred_rows_are_checked_before_any_other_read(tmp_path, synth_trace_dir):
    """A trace opened with defer_rows is checked by whatever reads its rows first (arrays, token counts)."""
    from traces.format.errors import TraceError

    src = synth_trace_dir(**SMALL[0])
    path = tmp_path / "t"
    shutil.copytree(src, path)
    t0 = open_trace(path)
    _corrupt(path, "expert_range", 0, 3, t0.n_layer, t0.n_expert)
    tr = open_trace(path, defer_rows=True)
    assert tr.rows_pending
    with pytest.raises(TraceError, match="expert id outside"):
        tr.arrays()
    with pytest.raises(TraceError, match="expert id outside"):
        open_trace(path, defer_rows=True).token_counts()
    good = open_trace(src, defer_rows=True)
    loads_of(good)
    assert not good.rows_pending  # a whole pass checked every part


def test_valid_simple_trace_passes_the_fast_gate(monkeypatch, synth_trace_dir, tmp_path):
    """The Numba gate lets every valid part of a trace without request/recorded columns through
    (the Python checker is then never run: one fast pass); a trace with a request column goes
    through the checker."""
    from traces.io.reader import RowChecker

    paths = [_split(synth_trace_dir(**cfg), 5, tmp_path) for cfg in SMALL[:2]]
    calls = []
    real = RowChecker.check
    monkeypatch.setattr(RowChecker, "check", lambda self, part, t: calls.append(part) or real(self, part, t))
    for p in paths:
        loads_of(open_trace(p, defer_rows=True))
    assert calls == []
    loads_of(open_trace(synth_trace_dir(**SMALL[2]), defer_rows=True))
    assert calls
