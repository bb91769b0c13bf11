"""Issue 16 item 4: ``export bigmoe`` (byte-identical round trip on the real traces, same routings and
replay figures) and ``export libcachesim`` (oracleGeneral records against a dictionary-and-loop twin;
libCacheSim's own LRU and Belady on a top-1 equal-size trace give ``cache``'s hit counts)."""

from __future__ import annotations

import importlib.util
import struct

import numpy as np
import pytest

from tests.conftest import real_files
from tests.helpers import assert_one_sentence_error, run_cli
from traces import open_trace

REAL = ("qwen", "gemma", "gptoss")


@pytest.mark.parametrize("name", REAL)
def test_bigmoe_round_trip_is_byte_identical(tmp_path, real_trace_dir, name):
    csv_path, metrics = real_files(name)
    out = tmp_path / f"{name}.route.csv"
    res = run_cli("export", "bigmoe", real_trace_dir(name), out)
    assert res.code == 0, res.err
    assert out.read_bytes() == csv_path.read_bytes()
    back = tmp_path / "back"
    assert run_cli("import", "bigmoe", out, back, "--metrics", metrics).code == 0
    a, b = open_trace(real_trace_dir(name)).arrays(), open_trace(back).arrays()
    for col in ("turn", "batch", "phase", "step", "layer", "experts", "weights", "residency", "read_bytes"):
        assert np.array_equal(getattr(a, col), getattr(b, col), equal_nan=True), col


def test_bigmoe_round_trip_gives_identical_replay_figures(tmp_path, real_trace_dir):
    out = tmp_path / "q.route.csv"
    assert run_cli("export", "bigmoe", real_trace_dir("qwen"), out).code == 0
    _, metrics = real_files("qwen")
    assert run_cli("import", "bigmoe", out, tmp_path / "back", "--metrics", metrics).code == 0
    args = ("cache", "--policies", "lru,belady", "--budgets", "1000,4000", "--json")
    first = run_cli(*args[:1], real_trace_dir("qwen"), *args[1:]).json()["rows"]
    again = run_cli(*args[:1], tmp_path / "back", *args[1:]).json()["rows"]
    assert first and first == again


def twin_records(trace):
    """oracleGeneral records by dictionaries and loops, from docs/design.md's load definition."""
    a = trace.arrays(recorded=False)
    n_expert = trace.model["n_expert"]
    reqs = []  # (batch, obj, size)
    i = 0
    while i < a.n_rows:
        j = i
        while j < a.n_rows and a.batch[j] == a.batch[i] and a.layer[j] == a.layer[i]:
            j += 1
        seen = []
        for r in range(i, j):  # token-major: step, then slot
            for e in a.experts[r]:
                if int(e) not in seen:
                    seen.append(int(e))
        layer = int(a.layer[i])
        reqs += [(int(a.batch[i]), layer * n_expert + e, int(trace.expert_bytes[layer])) for e in seen]
        i = j
    out = []
    for idx, (b, obj, size) in enumerate(reqs):
        nxt = next((m + 1 for m in range(idx + 1, len(reqs)) if reqs[m][1] == obj), -1)
        out.append(struct.pack("<IQIq", b, obj, size, nxt))
    return b"".join(out)


@pytest.mark.parametrize("cfg", [dict(layers=3, experts=8, top_k=2, tokens=30, prompt_tokens=5, seed=1),
                                 dict(layers=2, experts=6, top_k=3, tokens=20, prompt_tokens=0, seed=2)])
def test_libcachesim_records_match_the_twin(tmp_path, synth_trace_dir, cfg):
    t = synth_trace_dir(routing_only=True, embd=8, **cfg)
    out = tmp_path / "t.oracleGeneral"
    res = run_cli("export", "libcachesim", t, out)
    assert res.code == 0, res.err
    data = out.read_bytes()
    assert len(data) % 24 == 0
    assert data == twin_records(open_trace(t))


def test_libcachesim_export_of_a_real_trace(tmp_path, real_trace_dir):
    t = open_trace(real_trace_dir("gptoss"))
    out = tmp_path / "g.bin"
    assert run_cli("export", "libcachesim", real_trace_dir("gptoss"), out).code == 0
    rec = np.frombuffer(out.read_bytes(), dtype=[("t", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])
    assert rec.size == int(run_cli("cache", real_trace_dir("gptoss"), "--policies", "lru", "--budgets", "3000",
                                   "--json").json()["rows"][0]["lookups"])
    assert set(rec["size"].tolist()) <= {int(x) for x in t.expert_bytes[t.moe_layers]}


@pytest.mark.skipif(importlib.util.find_spec("libcachesim") is None,
                    reason="the libcachesim binding (pip libcachesim==0.3.5) is not installed")
def test_libcachesim_lru_and_belady_agree_on_top1_equal_size(tmp_path, synth_trace_dir):
    import libcachesim as lcs

    # top-1, no prompt batch (every load is one lookup), every expert 1 MiB: where both semantics coincide
    t = synth_trace_dir(layers=6, experts=16, top_k=1, tokens=300, prompt_tokens=0, routing_only=True, embd=8,
                        expert_bytes=1 << 20, seed=4)
    out = tmp_path / "t.oracleGeneral"
    assert run_cli("export", "libcachesim", t, out).code == 0
    n = out.stat().st_size // 24
    reader = lcs.TraceReader(str(out), lcs.TraceType.ORACLE_GENERAL_TRACE)
    rows = run_cli("cache", t, "--policies", "lru,belady", "--budgets", "3,5,8,20,64", "--json").json()["rows"]
    checked = 0
    for r in rows:
        if r["layer"] is not None:
            continue
        cls = {"lru": lcs.LRU, "belady": lcs.Belady}[r["policy"]]
        miss_ratio, _ = cls(cache_size=int(r["budget_mib"]) << 20).process_trace(reader)
        assert r["lookups"] == n
        assert r["hits"] == round(n * (1.0 - miss_ratio)), (r["policy"], r["budget_mib"])
        checked += 1
    assert checked == 10


def test_bad_export_one_sentence_nothing_written(tmp_path, synth_trace_dir):
    t = synth_trace_dir(layers=2, experts=6, top_k=2, tokens=10, prompt_tokens=2, routing_only=True, embd=8, seed=3)
    assert_one_sentence_error(run_cli("export", "bigmoe", t, tmp_path / "x.csv"), "residency")
    assert not (tmp_path / "x.csv").exists()
    assert_one_sentence_error(run_cli("export", "libcachesim", t, tmp_path), "is a directory")
    assert_one_sentence_error(run_cli("export", "libcachesim", tmp_path / "nope", tmp_path / "o.bin"), "nope")
    assert not (tmp_path / "o.bin").exists()
