"""Issue 16: the vLLM importer on logs written as vLLM writes them (tests/server_logs.py), its bad
inputs, a hypothesis round trip, and the batch-size sweep on one multi-request log."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import assert_one_sentence_error, run_cli
from tests.server_logs import VReq, npy_b64, random_vreqs, vllm_completion, vllm_request_output, write_vllm_jsonl
from traces.io.digest import sha256_file
from traces.io.reader import open_trace

L, K, E = 4, 2, 16


def routed_rows(trace_dir) -> dict[tuple[int, int, int], tuple[int, ...]]:
    """(request, step, layer) -> experts, from a trace."""
    t = open_trace(trace_dir)
    tab = t.table(["request", "step", "layer", "experts"])
    req, step, layer = (tab.column(c).to_numpy() for c in ("request", "step", "layer"))
    ex = np.asarray(tab.column("experts").combine_chunks().flatten()).reshape(-1, t.top_k)
    return {(int(r), int(s), int(lay)): tuple(int(x) for x in e) for r, s, lay, e in zip(req, step, layer, ex)}


def expected_rows(reqs: list[VReq]) -> dict[tuple[int, int, int], tuple[int, ...]]:
    out = {}
    for i, r in enumerate(reqs):
        full = np.concatenate([r.prompt, r.generated])
        for p in range(full.shape[0]):
            if (full[p] < 0).all():
                continue  # prefix-cached: not routed in this run
            for lay in range(full.shape[1]):
                out[(i, p, lay)] = tuple(int(x) for x in full[p, lay])
    return out


@pytest.fixture(scope="module")
def reqs():
    return random_vreqs(np.random.default_rng(1), 4, L, K, E, cached_prompt=0) + \
        random_vreqs(np.random.default_rng(2), 1, L, K, E, cached_prompt=3)


def test_openai_responses_with_base64_npy(tmp_path, reqs):
    src = write_vllm_jsonl(tmp_path / "responses.jsonl", reqs)
    res = run_cli("import", "vllm", src, tmp_path / "t", "--expert-bytes", "1000000")
    assert res.code == 0, res.err
    assert routed_rows(tmp_path / "t") == expected_rows(reqs)
    t = open_trace(tmp_path / "t")
    prov = t.meta["provenance"]
    assert prov["engine"] == "vLLM" and prov["engine_version"] == "0.21.0" and prov["importer"] == "vllm"
    assert prov["sources"][0]["sha256"] == sha256_file(src)
    assert t.meta["model"]["name"] == "Qwen/Qwen3-30B-A3B"
    # The 3 prefix-cached positions (-1) are absent, and said so; later positions keep their step.
    assert "3 position(s) not routed" in res.out
    assert min(s for (r, s, _) in routed_rows(tmp_path / "t") if r == 4) == 3
    # Token ids: prompt ids, then the generated ids fed back.
    tab = t.table(["request", "step", "token"])
    tok = {(int(r), int(s)): int(x) for r, s, x in zip(*(tab.column(c).to_numpy() for c in ("request", "step", "token")))}
    assert tok[(0, 0)] == reqs[0].prompt_ids[0] and tok[(0, 6)] == reqs[0].output_ids[0]
    # sequential: the prompt is one batch, each generated position its own.
    tab = t.table(["batch", "request", "phase"])
    b, r, ph = (tab.column(c).to_numpy() for c in ("batch", "request", "phase"))
    assert len(np.unique(b[(r == 0) & (ph == 0)])) == 1 and len(np.unique(b[(r == 0) & (ph == 1)])) == 4


def test_every_container_gives_the_same_routings(tmp_path, reqs):
    """Nested lists, RequestOutput dicts, a JSON list, .npz and paired .npy files: one content."""
    want = expected_rows(reqs)
    jl = write_vllm_jsonl(tmp_path / "lists.jsonl", reqs, encoding="list")
    js = tmp_path / "outputs.json"
    js.write_text(json.dumps([vllm_request_output(r, i) for i, r in enumerate(reqs)]))
    npzs, npys = [], []
    for i, r in enumerate(reqs):
        z = tmp_path / f"req{i}.npz"
        np.savez(z, prompt_routed_experts=r.prompt, routed_experts=r.generated,
                 prompt_token_ids=np.array(r.prompt_ids), token_ids=np.array(r.output_ids))
        npzs.append(z)
        np.save(tmp_path / f"req{i}.prompt_routed_experts.npy", r.prompt)
        np.save(tmp_path / f"req{i}.routed_experts.npy", r.generated)
        npys += [tmp_path / f"req{i}.prompt_routed_experts.npy", tmp_path / f"req{i}.routed_experts.npy"]
    for n, srcs in enumerate([[jl], [js], npzs, npys]):
        out = tmp_path / f"t{n}"
        res = run_cli("import", "vllm", *srcs, out, "--expert-bytes", "1000")
        assert res.code == 0, (srcs, res.err)
        assert routed_rows(out) == want, srcs
    auto = run_cli("import", "auto", *npys, tmp_path / "auto", "--expert-bytes", "1000")
    assert auto.code == 0 and auto.out.startswith("format: vllm"), auto.err


def test_older_vllm_one_array_over_the_whole_sequence(tmp_path, reqs):
    lines = []
    for i, r in enumerate(reqs):
        body = vllm_completion(r, i)
        body.pop("prompt_routed_experts")
        body["choices"][0]["routed_experts"] = npy_b64(np.concatenate([r.prompt, r.generated]))
        lines.append(json.dumps(body))
    src = tmp_path / "old.jsonl"
    src.write_text("\n".join(lines) + "\n")
    res = run_cli("import", "vllm", src, tmp_path / "t", "--expert-bytes", "1000")
    assert res.code == 0, res.err
    assert routed_rows(tmp_path / "t") == expected_rows(reqs)
    assert "split at len(prompt_token_ids)" in res.out


def test_dense_layers_left_at_zero_are_left_out(tmp_path, reqs):
    """vLLM's buffer spans num_hidden_layers; a dense layer stays 0 (never captured)."""
    padded = [VReq(r.prompt_ids, np.concatenate([np.where((r.prompt < 0).all(axis=(1, 2), keepdims=True)[:, :, :1], -1, 0)
                                                  .repeat(K, axis=2).astype(np.int16), r.prompt], axis=1),
                   r.output_ids, np.concatenate([np.zeros((r.generated.shape[0], 1, K), np.int16), r.generated], axis=1))
              for r in reqs]
    src = write_vllm_jsonl(tmp_path / "dense.jsonl", padded)
    res = run_cli("import", "vllm", src, tmp_path / "t", "--expert-bytes", "1000")
    assert res.code == 0, res.err
    t = open_trace(tmp_path / "t")
    assert t.moe_layers == [1, 2, 3, 4] and t.n_layer == 5
    assert "dense layers" in res.out
    shifted = {(r, s, lay + 1): e for (r, s, lay), e in expected_rows(reqs).items()}
    assert routed_rows(tmp_path / "t") == shifted


def _bad(tmp_path, name: str, text: str | bytes, *needles: str, sizes=("--expert-bytes", "1000")):
    src = tmp_path / name
    (src.write_bytes if isinstance(text, bytes) else src.write_text)(text)
    res = run_cli("import", "vllm", src, tmp_path / "out", *sizes)
    assert_one_sentence_error(res, *needles)
    assert not (tmp_path / "out").exists()


def test_all_zero_is_refused_as_the_known_engine_bug(tmp_path, reqs):
    zeros = [VReq(r.prompt_ids, np.zeros_like(r.prompt), r.output_ids, np.zeros_like(r.generated)) for r in reqs]
    src = write_vllm_jsonl(tmp_path / "zeros.jsonl", zeros)
    res = run_cli("import", "vllm", src, tmp_path / "out", "--expert-bytes", "1000")
    assert_one_sentence_error(res, "every routed expert id is 0", "known vLLM bug")
    assert not (tmp_path / "out").exists()


def test_bad_inputs_one_sentence_nothing_written(tmp_path, reqs):
    good = json.dumps(vllm_completion(reqs[0], 0))
    _bad(tmp_path, "trunc.jsonl", good[: len(good) // 2], "line 1", "not valid JSON")
    body = vllm_completion(reqs[0], 0)
    body["prompt_routed_experts"] = body["prompt_routed_experts"][:40]
    _bad(tmp_path, "trunc_npy.jsonl", json.dumps(body), "prompt_routed_experts")
    body = vllm_completion(reqs[0], 0)
    body["prompt_routed_experts"] = npy_b64(reqs[0].prompt[:, 0, :])
    _bad(tmp_path, "shape.jsonl", json.dumps(body), "shape [6, 2]", "[positions, layers, top_k]")
    body = vllm_completion(reqs[0], 0)
    p = reqs[0].prompt.copy()
    p[2, 1, 0] = -1
    body["prompt_routed_experts"] = npy_b64(p)
    _bad(tmp_path, "partial.jsonl", json.dumps(body), "position 2", "some layers or slots only")
    body = vllm_completion(reqs[0], 0)
    body["choices"][0]["routed_experts"] = npy_b64(np.concatenate([reqs[0].generated] * 3))
    _bad(tmp_path, "long.jsonl", json.dumps(body), "12 routed positions but only 5 generated tokens")
    buf = __import__("io").BytesIO()
    np.save(buf, np.array([object()], dtype=object), allow_pickle=True)
    body = vllm_completion(reqs[0], 0)
    body["prompt_routed_experts"] = __import__("base64").b64encode(buf.getvalue()).decode()
    _bad(tmp_path, "pickle.jsonl", json.dumps(body), "pickled", "not unpickled")
    _bad(tmp_path, "other.npy", np.arange(3).tobytes(), "*routed_experts.npy")
    # Ids out of range of the model named by --sizes-from.
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": L, "num_experts": 8, "moe_intermediate_size": 32,
                               "num_experts_per_tok": K, "num_attention_heads": 4, "num_key_value_heads": 4}))
    _bad(tmp_path, "range.jsonl", good + "\n", "routes expert", "8 experts", sizes=("--sizes-from", cfg, "--dtype", "bf16"))
    # No sizes: refused, naming the options.
    res = run_cli("import", "vllm", write_vllm_jsonl(tmp_path / "ok.jsonl", reqs), tmp_path / "out")
    assert_one_sentence_error(res, "--expert-bytes")
    assert not (tmp_path / "out").exists()


def test_sizes_from_config_give_layers_and_experts(tmp_path, reqs):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": L, "num_experts": E, "moe_intermediate_size": 32,
                               "num_experts_per_tok": K, "num_attention_heads": 4, "num_key_value_heads": 4}))
    src = write_vllm_jsonl(tmp_path / "r.jsonl", reqs)
    res = run_cli("import", "vllm", src, tmp_path / "t", "--sizes-from", cfg, "--dtype", "bf16")
    assert res.code == 0, res.err
    t = open_trace(tmp_path / "t")
    assert t.n_expert == E and t.meta["expert_bytes"][0] == 3 * 64 * 32 * 2
    assert "largest expert id" not in res.out


# -- hypothesis round trip: routings -> vLLM responses -> import -> the same routings ---------------

@st.composite
def vllm_logs(draw):
    n = draw(st.integers(1, 4))
    L_, k_ = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    E_ = draw(st.integers(k_ + 1, 12))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    reqs = []
    for _ in range(n):
        P, G = draw(st.integers(1, 5)), draw(st.integers(1, 5))
        cached = draw(st.integers(0, P - 1))
        r = random_vreqs(rng, 1, L_, k_, E_, prompt=P, gen=G, cached_prompt=cached)[0]
        if k_ == 1:  # top-1: keep id 0 out, so no request is all zeros (refused as the engine bug, tested apart)
            r.prompt[r.prompt >= 0] += 1
            r.generated += 1
        reqs.append(r)
    return reqs, draw(st.sampled_from(["b64", "list"])), draw(st.sampled_from([("sequential", 1), ("continuous", 2),
                                                                               ("continuous", 64)]))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(vllm_logs())
def test_round_trip(tmp_path_factory, log):
    reqs, encoding, (mode, b) = log
    d = tmp_path_factory.mktemp("rt")
    src = write_vllm_jsonl(d / "r.jsonl", reqs, encoding=encoding)
    res = run_cli("import", "vllm", src, d / "t", "--expert-bytes", "4096", "--schedule", mode, "--max-batch", str(b))
    assert res.code == 0, res.err
    assert routed_rows(d / "t") == expected_rows(reqs)


# -- the batch-size sweep on one multi-request log -----------------------------------------------

@pytest.fixture(scope="module")
def sweep_log(tmp_path_factory):
    """64 requests of 8 prompt + 17 generated tokens, each routing among 4 experts of its own (of 32 per
    layer), 8 MoE layers, top-2: the log behind the README's batch-size figures."""
    d = tmp_path_factory.mktemp("sweep")
    reqs = random_vreqs(np.random.default_rng(7), 64, 8, 2, 32, hot=4, prompt=8, gen=17)
    return write_vllm_jsonl(d / "requests.jsonl", reqs), d


def _cache(trace, budget: str) -> dict[str, dict]:
    res = run_cli("cache", trace, "--policies", "lru,belady,infinite", "--budgets", budget, "--json")
    assert res.code == 0, res.err
    return {r["policy"]: r for r in res.json()["rows"] if r["layer"] is None}


def test_hit_rate_moves_with_batch_size(sweep_log):
    """One log imported at --max-batch 1, 8, 64: a request's tokens reuse its own few experts, so at a
    128 MiB budget (half the 256 MiB working set; 1 MiB experts) batching many requests into one load costs
    hits, under LRU and under the Belady bound alike (README, "Import your engine's log")."""
    src, d = sweep_log
    rows = {}
    for b in (1, 8, 64):
        out = d / f"b{b}"
        res = run_cli("import", "vllm", src, out, "--expert-bytes", str(1 << 20), "--schedule", "continuous",
                      "--max-batch", str(b), "--force")
        assert res.code == 0, res.err
        t = open_trace(out)
        tab = t.table(["batch", "phase", "layer"])
        bt, ph, ly = (tab.column(c).to_numpy() for c in ("batch", "phase", "layer"))
        dec = (ph == 1) & (ly == 0)
        assert np.bincount(bt[dec]).max() == b  # decode batches fill up to max_batch
        rows[b] = _cache(out, "128")
    seq = d / "seq"
    assert run_cli("import", "vllm", src, seq, "--expert-bytes", str(1 << 20), "--force").code == 0
    assert _cache(seq, "128") == rows[1]  # continuous at max_batch 1 is the sequential schedule
    for policy in ("lru", "belady"):
        hit = {b: rows[b][policy]["hit_pct_decode"] for b in rows}
        assert hit[1] > hit[8] > hit[64], (policy, hit)
    # Only compulsory misses with an unbounded cache: the same for every batching of the same log.
    assert len({rows[b]["infinite"]["read_mib"] for b in rows}) == 1


def test_parallel_sampling_routes_the_shared_prompt_once(tmp_path, reqs):
    """n > 1: vLLM computes the prompt once; each completion is its own request after it."""
    body = vllm_completion(reqs[0], 0, encoding="list")
    second = reqs[1].generated
    body["choices"].append(dict(body["choices"][0], index=1, routed_experts=second.tolist(), token_ids=reqs[1].output_ids))
    src = tmp_path / "n2.json"
    src.write_text(json.dumps(body))
    res = run_cli("import", "vllm", src, tmp_path / "t", "--expert-bytes", "1000")
    assert res.code == 0, res.err
    rows = routed_rows(tmp_path / "t")
    P = len(reqs[0].prompt_ids)
    assert {s for (r, s, _) in rows if r == 1} == set(range(P, P + second.shape[0]))  # no prompt rows twice
    assert rows[(1, P, 0)] == tuple(int(x) for x in second[0, 0])
    assert "shared prompt is routed once" in res.out and "prefix cache" not in res.out


def test_a_layer_axis_of_moe_layers_only_maps_onto_the_models_moe_layers(tmp_path, reqs):
    """A log whose layer axis holds the MoE layers only (L entries) of a model with more layers."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": L + 1, "n_routed_experts": E, "first_k_dense_replace": 1,
                               "moe_intermediate_size": 32, "intermediate_size": 128, "num_experts_per_tok": K,
                               "num_attention_heads": 4, "num_key_value_heads": 4}))
    src = write_vllm_jsonl(tmp_path / "r.jsonl", reqs)
    res = run_cli("import", "vllm", src, tmp_path / "t", "--sizes-from", cfg, "--dtype", "bf16")
    assert res.code == 0, res.err
    assert open_trace(tmp_path / "t").moe_layers == [1, 2, 3, 4]
    assert routed_rows(tmp_path / "t") == {(r, s, lay + 1): e for (r, s, lay), e in expected_rows(reqs).items()}
    assert "axis i is MoE layer moe_layers[i]" in res.out
