"""One multi-request synthetic log batched at max-batch 1, 8 and 64: the same routings, fewer and
larger loads as batches merge, and the expert cache's hit rate moving with batch size (README,
"Many requests in one batch")."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

import replay
from replay.core.simulate import loads_of
from traces import open_trace

SHAPE = dict(layers=4, experts=32, top_k=4, embd=16, tokens=24, prompt_tokens=6, routing_only=True,
             expert_bytes=1 << 20, requests=16, seed=3)
BATCHES = (1, 8, 64)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    return {b: replay.synth(root / f"b{b}", max_batch=b, **SHAPE) for b in BATCHES}


def _routings(tr):
    df = tr.routings(["request", "step", "layer", "phase", "experts"])
    return df.sort("request", "step", "layer")


def test_same_log_fewer_larger_loads(traces):
    # The requests' routings do not depend on the batching: only the batches do.
    base = _routings(traces[1])
    for b in BATCHES[1:]:
        assert _routings(traces[b]).equals(base)
    loads = {b: loads_of(traces[b]) for b in BATCHES}
    n_loads = {b: int(loads[b].load_lidx.size) for b in BATCHES}
    dec_tokens = {b: loads[b].decode_tokens for b in BATCHES}
    assert dec_tokens[1] == dec_tokens[8] == dec_tokens[64] == 16 * 24
    assert n_loads[1] > n_loads[8] > n_loads[64]
    # Decode batch sizes: 1 token at max-batch 1; up to 8 / all 16 requests together.
    sizes = {b: loads[b].batch_tokens[loads[b].batch_phase == 1] for b in BATCHES}
    assert sizes[1].max() == 1 and sizes[8].max() == 8 and sizes[64].max() == 16
    assert (sizes[8] <= 8).all()


def test_cache_hit_rate_moves_with_batch_size(traces):
    rows = {}
    for b in BATCHES:
        f = replay.cache(traces[b], policies=["lru", "infinite"], budgets_mib=[64.0])
        rows[b] = {r["policy"]: r for r in f.filter(pl.col("layer").is_null()).to_dicts()}
    lookups = {b: rows[b]["lru"]["lookups"] for b in BATCHES}
    # One lookup per unique expert per load: tokens of one batch that share an expert share its
    # lookup, so merging requests into larger batches strictly shrinks the lookups.
    assert lookups[1] > lookups[8] > lookups[64]
    # The compulsory misses (infinite cache) are the same log's working set whatever the batching.
    assert rows[1]["infinite"]["read_mib"] == rows[8]["infinite"]["read_mib"] == rows[64]["infinite"]["read_mib"]
    for b in BATCHES:
        r = rows[b]["lru"]
        assert 0 <= r["hit_pct_decode"] <= 100 and r["hits"] <= r["lookups"]
        print(f"max-batch {b:>2}: lookups {r['lookups']:>6,}  lru hit_pct_decode {r['hit_pct_decode']:.1f}  "
              f"read_mib {r['read_mib']:.0f}")


def test_prev_token_and_ctrl_per_request_on_synth_requests(tmp_path):
    # Gate inputs and routers: ctrl must read 100% although several requests share a batch and a
    # step (a token is (batch, request, step)); prev-token's unscored = one first decoded token
    # per request and MoE layer.
    tr = replay.synth(tmp_path / "g", layers=3, experts=16, top_k=2, embd=8, tokens=6, prompt_tokens=3,
                      requests=5, max_batch=4, prefill_chunk=4, seed=1)
    assert open_trace(tmp_path / "g").has("request")
    f = replay.predict(tr, predictors=["prev-token", "ctrl"]).filter(pl.col("layer").is_null())
    got = {r["predictor"]: r for r in f.to_dicts()}
    assert got["ctrl"]["slot_acc_pct"] == 100.0 and got["ctrl"]["unscored"] == 0
    assert got["prev-token"]["unscored"] == 5 * 3 and got["prev-token"]["scored"] == 5 * 3 * 5
    assert np.isfinite(got["prev-token"]["slot_acc_pct"])
