"""Engine warm-up rows found (issue 30 item 4): a log whose head is an engine's profiling / dummy
pass (vLLM's profile run: the same ids on every token and layer, every weight exactly 1/k) is
detected and reported with its row range, kept and marked by default, dropped only with
--drop-warmup; with it the figures equal those of the log without the warm-up rows. ``info`` runs
the same check on a trace already imported.

The fixture is a patched-vLLM JSONL dump as such scripts write it: one row per (token, layer),
the dummy pass first."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers import run_cli
from traces import open_trace

L, E, K, W = 4, 16, 4, 12  # W warm-up tokens at the head


def real_rows(start: int):
    rng = np.random.default_rng(5)
    out = []
    for tok in range(24):
        for lay in range(L):
            ids = [int(x) for x in rng.choice(E, K, replace=False)]
            w = [float(np.float32(x)) for x in np.sort(rng.random(K))[::-1]]
            out.append({"position": start + tok, "layer_id": lay, "topk_ids": ids, "topk_weights": w})
    return out


def warm_rows():
    return [{"position": tok, "layer_id": lay, "topk_ids": list(range(K)), "topk_weights": [1.0 / K] * K}
            for tok in range(W) for lay in range(L)]


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    d = tmp_path_factory.mktemp("warm")
    with_warm = d / "dump.jsonl"
    with_warm.write_text("".join(json.dumps(r) + "\n" for r in warm_rows() + real_rows(W)))
    without = d / "clean.jsonl"
    without.write_text("".join(json.dumps(r) + "\n" for r in real_rows(W)))
    return d, with_warm, without


def _figures(t):
    cache = run_cli("cache", t, "--policies", "lru,belady", "--budgets", "0.02,0.04", "--json").json()["rows"]
    pred = run_cli("predict", t, "--predictors", "prev-token", "--json").json()["rows"]
    return cache, pred


def test_warmup_at_the_head_found_kept_and_marked(logs):
    d, with_warm, _ = logs
    res = run_cli("import", "table", with_warm, d / "kept", "--expert-bytes", "4096")
    assert res.code == 0, res.err
    said = (f"steps 0-{W - 1} ({W} tokens, rows 1-{W * L}; {W} routed alike at every layer, {W} with exactly "
            "uniform weights)")
    assert f"kept and replayed as routing: {said}" in res.out
    prov = open_trace(d / "kept").meta["provenance"]
    assert prov["warmup"] == {"tokens": W, "at": said, "dropped": False}
    row = run_cli("info", d / "kept", "--json").json()["rows"][0]
    assert row["warmup_tokens"] == W and row["warmup_at"].startswith(f"steps 0-{W - 1} ({W} tokens, trace rows ")
    assert "warm-up    12 token(s) look like an engine's warm-up" in run_cli("info", d / "kept").out


def test_drop_warmup_gives_the_figures_of_the_log_without_it(logs):
    d, with_warm, without = logs
    res = run_cli("import", "table", with_warm, d / "dropped", "--expert-bytes", "4096", "--drop-warmup")
    assert res.code == 0, res.err
    assert "engine warm-up rows dropped (--drop-warmup)" in res.out
    assert run_cli("import", "table", without, d / "clean", "--expert-bytes", "4096").code == 0
    row = run_cli("info", d / "dropped", "--json").json()["rows"][0]
    assert row["warmup_tokens"] == 0 and row["tokens_decode"] == 24
    assert _figures(d / "dropped") == _figures(d / "clean")
    kept = d / "kept2"
    assert run_cli("import", "table", with_warm, kept, "--expert-bytes", "4096").code == 0
    assert _figures(kept) != _figures(d / "clean")  # the warm-up rows, kept, do move the figures


def test_real_routing_is_not_taken_for_warmup(tmp_path):
    src = tmp_path / "clean.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in real_rows(0)))
    res = run_cli("import", "table", src, tmp_path / "t", "--expert-bytes", "4096")
    assert res.code == 0 and "warm-up" not in res.out
    assert "warmup" not in open_trace(tmp_path / "t").meta["provenance"]
    assert run_cli("info", tmp_path / "t", "--json").json()["rows"][0]["warmup_at"] is None


def test_drop_warmup_in_every_format_that_takes_a_log(tmp_path):
    """--drop-warmup is not the table importer's alone: a vLLM log whose first request is a dummy
    pass (the same ids at every layer of every position) gives, with it, the figures of the log
    without that request; `import auto --drop-warmup` the same."""
    from tests.server_logs import VReq, random_vreqs, write_vllm_jsonl

    real = random_vreqs(np.random.default_rng(3), 3, L, 2, E, prompt=6, gen=6)
    dummy = VReq(list(range(12)), np.tile(np.array([0, 1], np.int16), (12, L, 1)), [7], np.zeros((0, L, 2), np.int16))
    with_warm = write_vllm_jsonl(tmp_path / "with.jsonl", [dummy, *real])
    clean = write_vllm_jsonl(tmp_path / "clean.jsonl", real)
    for fmt in ("vllm", "auto"):
        res = run_cli("import", fmt, with_warm, tmp_path / f"d-{fmt}", "--expert-bytes", "4096", "--drop-warmup")
        assert res.code == 0, res.err
        assert "engine warm-up rows dropped (--drop-warmup): request 0, steps 0-11 (12 tokens" in res.out
    res = run_cli("import", "vllm", with_warm, tmp_path / "kept", "--expert-bytes", "4096")
    assert res.code == 0 and "kept and replayed as routing" in res.out, res.err
    assert run_cli("import", "vllm", clean, tmp_path / "clean", "--expert-bytes", "4096").code == 0
    assert _figures(tmp_path / "d-vllm") == _figures(tmp_path / "clean") == _figures(tmp_path / "d-auto")
    assert _figures(tmp_path / "kept") != _figures(tmp_path / "clean")
