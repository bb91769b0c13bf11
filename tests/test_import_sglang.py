"""Issue 16: the SGLang importer on per_token dumps and return_routed_experts responses written as
SGLang writes them (tests/server_logs.py), bad inputs (a .pt that tries to run code), and a
hypothesis round trip (routings -> forward passes -> dump -> import -> the same routings)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import assert_one_sentence_error, run_cli
from tests.server_logs import DECODE, EXTEND, MIXED, sglang_record, sglang_response, write_sglang_dump
from traces.io.reader import open_trace

torch = pytest.importorskip("torch")


def phys_map(L: int, E: int, rng: np.random.Generator) -> np.ndarray:
    """[L, E + 2] physical -> logical: a permutation per layer plus two redundant replicas (EPLB)."""
    out = np.empty((L, E + 2), np.int64)
    for lay in range(L):
        perm = rng.permutation(E)
        out[lay, :E] = perm
        out[lay, E:] = perm[:2]
    return out


def to_phys(logical: np.ndarray, layer: int, p2l: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A physical slot for each logical id (a replica where there is one, half the time)."""
    out = np.empty_like(logical)
    for idx, e in np.ndenumerate(logical):
        slots = np.flatnonzero(p2l[layer] == e)
        out[idx] = slots[rng.integers(len(slots))]
    return out


def simulate(requests: list[dict], waves: list[list[int]], decodes: list[int], p2l: np.ndarray, dense: int,
             rng: np.random.Generator, mixed_at: int | None = None):
    """Forward passes as SGLang's scheduler runs them: each wave's prompts in one EXTEND pass (or, at
    ``mixed_at``, one MIXED pass with the running requests' next tokens as one-token extends), then
    ``decodes[w]`` DECODE passes over the running batch (old requests first; a finished one leaves).
    ``requests[i]``: prompt_ids, out_ids, experts [positions, moe layers, k] (logical).
    Returns the records and the expected {(request, position, layer): experts}."""
    L = p2l.shape[0]
    records, want = [], {}
    running: list[int] = []
    nxt: dict[int, int] = {}
    fid = 0

    def rows_for(tokens: list[tuple[int, int]]) -> tuple[np.ndarray, list[int], list[int]]:
        k = requests[0]["experts"].shape[2]
        buf = np.full((L, len(tokens), k), -1, np.int64)
        ids, pos = [], []
        for t, (i, p) in enumerate(tokens):
            r = requests[i]
            full_ids = r["prompt_ids"] + r["out_ids"]
            ids.append(full_ids[p])
            pos.append(p)
            for m in range(r["experts"].shape[1]):
                lay = dense + m
                buf[lay, t] = to_phys(r["experts"][p, m], lay, p2l, rng)
                want[(i, p, lay)] = tuple(int(x) for x in r["experts"][p, m])
        return buf, ids, pos

    for w, wave in enumerate(waves):
        tokens, seg = [], []
        mixed = mixed_at == w and running
        if mixed:
            for i in running:
                tokens.append((i, nxt[i]))
                seg.append(1)
                nxt[i] += 1
        for i in wave:
            P = len(requests[i]["prompt_ids"])
            tokens += [(i, p) for p in range(P)]
            seg.append(P)
            nxt[i] = P
        running += wave
        buf, ids, pos = rows_for(tokens)
        records.append(sglang_record(fid, MIXED if mixed else EXTEND, ids, pos, seg, buf, p2l.shape[1]))
        fid += 1
        running = [i for i in running if nxt[i] < requests[i]["experts"].shape[0]]
        for _ in range(decodes[w]):
            if not running:
                break
            tokens = []
            for i in running:
                tokens.append((i, nxt[i]))
                nxt[i] += 1
            buf, ids, pos = rows_for(tokens)
            records.append(sglang_record(fid, DECODE, ids, pos, None, buf, p2l.shape[1]))
            fid += 1
            running = [i for i in running if nxt[i] < requests[i]["experts"].shape[0]]
    return records, want


def make_requests(rng, n, moe_layers, k, E, prompt=(2, 5), gen=(1, 6), spread=0):
    """Requests with random routings; ``spread`` > 0 gives request i a prompt ``spread * i`` longer, so no
    two running requests ever wait for the same position (their linking is then unambiguous)."""
    out = []
    for i in range(n):
        P, G = int(rng.integers(*prompt)) + spread * i, int(rng.integers(*gen))
        ex = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(moe_layers)]) for _ in range(P + G - 1)])
        out.append({"prompt_ids": [int(x) for x in rng.integers(10, 30000, P)], "out_ids": [int(x) for x in rng.integers(10, 30000, G)],
                    "experts": ex.reshape(P + G - 1, moe_layers, k)})
    return out


def trace_rows(path) -> dict:
    t = open_trace(path)
    tab = t.table(["request", "step", "layer", "experts"])
    req, step, layer = (tab.column(c).to_numpy() for c in ("request", "step", "layer"))
    ex = np.asarray(tab.column("experts").combine_chunks().flatten()).reshape(-1, t.top_k)
    return {(int(r), int(s), int(lay)): tuple(int(x) for x in e) for r, s, lay, e in zip(req, step, layer, ex)}


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    rng = np.random.default_rng(3)
    d = tmp_path_factory.mktemp("sg")
    E, k, moe, dense = 12, 2, 3, 1
    p2l = phys_map(dense + moe, E, rng)
    reqs = make_requests(rng, 4, moe, k, E, prompt=(3, 6), gen=(4, 8), spread=20)
    records, want = simulate(reqs, [[0, 1], [2], [3]], [2, 2, 8], p2l, dense, rng, mixed_at=1)
    return write_sglang_dump(d, records, p2l), want, records, reqs, p2l


def test_per_token_dump_written_as_sglang(tmp_path, scenario):
    src, want, records, reqs, p2l = scenario
    res = run_cli("import", "sglang", src, tmp_path / "t", "--expert-bytes", "1000000")
    assert res.code == 0, res.err
    assert trace_rows(tmp_path / "t") == want  # physical slots mapped back to the logical ids routed
    t = open_trace(tmp_path / "t")
    assert t.moe_layers == [1, 2, 3] and t.n_layer == 4 and t.top_k == 2 and t.n_expert == 12
    tab = t.table(["batch", "phase", "request", "step", "token", "layer"])
    b, ph, rq, st_, tok, ly = (tab.column(c).to_numpy() for c in ("batch", "phase", "request", "step", "token", "layer"))
    # One forward pass = one batch; the MIXED pass (record 3: the running requests' next tokens ride as
    # one-token extends beside request 2's prompt) becomes a prefill batch then a decode batch.
    assert records[3]["forward_mode"] == MIXED
    assert b.max() + 1 == len(records) + 1
    assert set(ph[b == 3]) == {0} and set(rq[b == 3]) == {2} and set(ph[b == 4]) == {1} and 2 not in set(rq[b == 4])
    assert "1 MIXED forward pass(es)" in res.out
    full = reqs[0]["prompt_ids"] + reqs[0]["out_ids"]
    assert all(int(x) == full[int(s)] for x, s in zip(tok[rq == 0], st_[rq == 0]))
    prov = t.meta["provenance"]
    assert prov["engine"] == "SGLang" and prov["rank"] == 0 and any("linked across passes" in n for n in prov["notes"])
    assert "layer(s) [0] hold no expert ids" in res.out
    auto = run_cli("import", "auto", src, tmp_path / "a", "--expert-bytes", "1000000")
    assert auto.code == 0 and auto.out.startswith("format: sglang"), auto.err


class RunsCode:
    """A pickle that would run a shell command when unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pt_that_tries_to_run_code_is_refused_not_run(tmp_path):
    marker = tmp_path / "ran"
    src = tmp_path / "expert_distribution_recorder_1780000000.5_0.pt"
    torch.save({"records": [RunsCode(str(marker))], "last_physical_to_logical_map": torch.zeros((1, 4), dtype=torch.int64)},
               str(src))
    res = run_cli("import", "sglang", src, tmp_path / "t", "--expert-bytes", "1000")
    assert_one_sentence_error(res, "refused without loading it", "run code")
    assert not marker.exists()
    assert not (tmp_path / "t").exists()


def test_bad_dumps_one_sentence_nothing_written(tmp_path, scenario):
    src, want, records, reqs, p2l = scenario

    def bad(name, data: bytes | None, *needles, recs=None, pmap=None, extra=()):
        d = tmp_path / name
        d.mkdir()
        if data is not None:
            path = d / "expert_distribution_recorder_1780000000.5_0.pt"
            path.write_bytes(data)
        else:
            path = write_sglang_dump(d, recs, p2l if pmap is None else pmap)
        res = run_cli("import", "sglang", path, *extra, d / "t", "--expert-bytes", "1000")
        assert_one_sentence_error(res, *needles)
        assert not (d / "t").exists()

    raw = src.read_bytes()
    bad("trunc", raw[: len(raw) // 2], "not a readable torch .pt file")
    small = p2l[:, : p2l.shape[1] - 4]  # fewer physical slots than the records name
    bad("range", None, "physical expert slot", recs=records, pmap=small)
    wrong = [dict(r) for r in records]
    wrong[1] = dict(wrong[1], topk_ids_of_layer=wrong[1]["topk_ids_of_layer"][:, :1])
    bad("shape", None, "record 1", "topk_ids_of_layer has shape", recs=wrong)
    twice = [dict(r) for r in records]
    tk = twice[0]["topk_ids_of_layer"].clone()
    tk[1, 0, 1] = tk[1, 0, 0]
    twice[0]["topk_ids_of_layer"] = tk
    bad("twice", None, "same expert twice", recs=twice)
    spec = [dict(r) for r in records]
    spec[2] = dict(spec[2], forward_mode=5)
    bad("spec", None, "forward_mode 5", recs=spec)
    bad("sched", None, "apply to return_routed_experts responses only", recs=records, extra=("--max-batch", "8"))
    res = run_cli("import", "sglang", src, tmp_path / "nosize")
    assert_one_sentence_error(res, "--expert-bytes")


@st.composite
def dumps(draw):
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    E, k, moe, dense = draw(st.integers(4, 10)), draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(0, 1))
    n = draw(st.integers(1, 5))
    cut = sorted(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=2, unique=True))) if n > 1 else []
    bounds = [0, *cut, n]
    waves = [list(range(a, b)) for a, b in zip(bounds, bounds[1:]) if b > a]
    decodes = [draw(st.integers(0, 6)) for _ in waves]
    mixed = draw(st.sampled_from([None, 1, 2]))
    reqs = make_requests(rng, n, moe, k, E, spread=draw(st.sampled_from([0, 16])))
    p2l = phys_map(dense + moe, E, rng)
    records, want = simulate(reqs, waves, decodes, p2l, dense, rng, mixed_at=mixed)
    return records, want, p2l


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dumps())
def test_round_trip(tmp_path_factory, case):
    records, want, p2l = case
    d = tmp_path_factory.mktemp("rt")
    src = write_sglang_dump(d, records, p2l)
    res = run_cli("import", "sglang", src, d / "t", "--expert-bytes", "4096")
    assert res.code == 0, res.err
    got = trace_rows(d / "t")
    if " 0 token(s) where two running requests" in res.out:
        assert got == want  # every link unambiguous: the engine's requests, exactly
    else:  # requests waiting for the same position may swap ids; each (position, layer) routing is still there
        assert sorted((s, lay, e) for (_, s, lay), e in got.items()) == sorted((s, lay, e) for (_, s, lay), e in want.items())


# -- return_routed_experts responses -------------------------------------------------------------

def test_responses_with_cached_prefix(tmp_path):
    rng = np.random.default_rng(5)
    L, k, E = 3, 2, 10
    bodies, want = [], {}
    for i, (P, G, cached) in enumerate([(5, 4, 0), (6, 3, 4)]):
        rows = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(L)]) for _ in range(P + G - 1)])
        rows[:, 0, :] = 0  # a dense layer: SGLang's zero-initialised buffer, never captured
        bodies.append(sglang_response(P, list(range(G)), rows, cached=cached))
        for p in range(cached, P + G - 1):
            for lay in (1, 2):
                want[(i, p, lay)] = tuple(int(x) for x in rows[p, lay])
    src = tmp_path / "responses.json"
    src.write_text(json.dumps(bodies))
    res = run_cli("import", "sglang", src, tmp_path / "t", "--expert-bytes", "1000", "--top-k", "2",
                  "--schedule", "continuous", "--max-batch", "2")
    assert res.code == 0, res.err
    assert trace_rows(tmp_path / "t") == want
    assert "4 prompt position(s) in 1 response(s) came from the radix cache" in res.out
    no_k = run_cli("import", "sglang", src, tmp_path / "u", "--expert-bytes", "1000")
    assert_one_sentence_error(no_k, "--top-k")
    body = dict(bodies[0])
    body["meta_info"] = dict(body["meta_info"], routed_experts=body["meta_info"]["routed_experts"][:-8])
    src2 = tmp_path / "trunc.jsonl"
    src2.write_text(json.dumps(body) + "\n")
    assert_one_sentence_error(run_cli("import", "sglang", src2, tmp_path / "v", "--expert-bytes", "1000", "--top-k", "2"),
                              "routed_experts", "truncated")
    assert not (tmp_path / "u").exists() and not (tmp_path / "v").exists()
