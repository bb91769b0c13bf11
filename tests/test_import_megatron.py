"""Issue 16: the Megatron-LM importer on router traces written as ``RouterTracer`` writes them
(tests/server_logs.py), with the bf16 hidden-state and logit sidecars, bad inputs (a missing or
truncated sidecar), and a hypothesis round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import assert_one_sentence_error, run_cli
from tests.server_logs import bf16_values, write_megatron
from traces.io.reader import open_trace


def make_steps(rng, steps: list[int], layers: list[int], k: int, E: int) -> list[dict[int, np.ndarray]]:
    """``steps[s]`` tokens at step s; each layer's top_indices in ascending id (the routing map's order)."""
    return [{lay: np.sort(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]), axis=1) if T else
             np.zeros((0, k), np.int64) for lay in layers} for T in steps]


def trace_arrays(path, cols=("batch", "phase", "step", "layer")):
    t = open_trace(path)
    tab = t.table([*cols, "experts"])
    out = {c: tab.column(c).to_numpy() for c in cols}
    out["experts"] = np.asarray(tab.column("experts").combine_chunks().flatten()).reshape(-1, t.top_k)
    return t, out


def expected(steps: list[dict[int, np.ndarray]]) -> dict[tuple[int, int], tuple[int, ...]]:
    """(token index in the run, layer) -> experts."""
    out, base = {}, 0
    for layers in steps:
        T = next(iter(layers.values())).shape[0]
        for lay, idx in layers.items():
            for t in range(T):
                out[(base + t, lay)] = tuple(int(x) for x in idx[t])
        base += T
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    rng = np.random.default_rng(11)
    d = tmp_path_factory.mktemp("mg")
    E, k, H, layers = 8, 2, 16, [1, 3, 5]
    steps = make_steps(rng, [7, 3, 3, 2], layers, k, E)
    hidden = {(s, lay): bf16_values(rng, (v[lay].shape[0], H)) for s, v in enumerate(steps) for lay in layers}
    logits = {(s, lay): bf16_values(rng, (v[lay].shape[0], E)) for s, v in enumerate(steps) for lay in layers}
    mtp = {0: np.sort(np.stack([rng.choice(E, k, replace=False) for _ in range(7)]), axis=1)}
    jl = write_megatron(d, steps, hidden=hidden, logits=logits, mtp=mtp)
    return jl, steps, hidden, logits, E, H


def test_router_trace_with_sidecars(tmp_path, run):
    jl, steps, hidden, logits, E, H = run
    res = run_cli("import", "megatron", jl, tmp_path / "t", "--expert-bytes", "1000000")
    assert res.code == 0, res.err
    t, a = trace_arrays(tmp_path / "t")
    got = {(int(s), int(lay)): tuple(int(x) for x in e) for s, lay, e in zip(a["step"], a["layer"], a["experts"])}
    assert got == expected(steps)
    assert t.moe_layers == [1, 3, 5] and t.n_expert == E and t.meta["model"]["n_embd"] == H
    assert np.array_equal(np.unique(a["batch"]), np.arange(4))  # one Megatron step = one batch
    assert set(a["phase"][a["batch"] == 0]) == {0} and set(a["phase"][a["batch"] > 0]) == {1}
    assert set(t.columns) >= {"gate_input", "logits"}
    tab = t.table(["step", "layer", "gate_input", "logits"])
    st_, ly = tab.column("step").to_numpy(), tab.column("layer").to_numpy()
    gi = np.asarray(tab.column("gate_input").combine_chunks().flatten()).reshape(-1, H)
    lg = np.asarray(tab.column("logits").combine_chunks().flatten()).reshape(-1, E)
    i = int(np.flatnonzero((st_ == 8) & (ly == 3))[0])  # step 1's second token (7 + 1), layer 3
    assert np.array_equal(gi[i], hidden[(1, 3)][1]) and np.array_equal(lg[i], logits[(1, 3)][1])  # bf16 widened exactly
    prov = t.meta["provenance"]
    assert prov["engine"] == "Megatron-LM" and prov["rank"] == 0
    assert "1 record(s) of multi-token-prediction heads" in res.out and "ascending id" in res.out
    auto = run_cli("import", "auto", jl, tmp_path / "a", "--expert-bytes", "1000000")
    assert auto.code == 0 and auto.out.startswith("format: megatron"), auto.err


def test_training_iterations_split_where_a_layer_repeats(tmp_path):
    """Training: one step holds a firing of the layers per micro-batch; each firing is its own batch."""
    rng = np.random.default_rng(12)
    steps = make_steps(rng, [4, 4], [0, 1], 2, 6)
    jl = write_megatron(tmp_path / "m", steps)
    lines = jl.read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    for r in recs:
        r["step"] = 7  # both firings stamped with the iteration number (advance_step(step_id=7))
    jl.write_text("".join(json.dumps(r) + "\n" for r in recs))
    res = run_cli("import", "megatron", jl, tmp_path / "t", "--expert-bytes", "1000", "--prefill-steps", "1")
    assert res.code == 0, res.err
    _, a = trace_arrays(tmp_path / "t")
    assert np.array_equal(np.unique(a["batch"]), [0, 1]) and set(a["phase"]) == {0}


def test_bad_inputs_one_sentence_nothing_written(tmp_path, run):
    jl, steps, hidden, logits, E, H = run

    def bad(name, mutate, *needles, extra=()):
        d = tmp_path / name
        d.mkdir()
        for f in jl.parent.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        mutate(d)
        res = run_cli("import", "megatron", d / jl.name, d / "t", "--expert-bytes", "1000", *extra)
        assert_one_sentence_error(res, *needles)
        assert not (d / "t").exists()

    bad("nohs", lambda d: (d / "hidden_states_rank0.bin").unlink(), "hidden_states_rank0.bin", "not beside it",
        "--routings-only")
    bad("trunclg", lambda d: (d / "logits_rank0.bin").write_bytes((d / "logits_rank0.bin").read_bytes()[:100]),
        "logits_rank0.bin", "truncated sidecar")

    def truncate_jsonl(d):
        p = d / jl.name
        p.write_text(p.read_text()[:-40])
    bad("truncjl", truncate_jsonl, "not valid JSON")

    def edit(fn):
        def mutate(d):
            p = d / jl.name
            recs = [json.loads(x) for x in p.read_text().splitlines()]
            fn(recs)
            p.write_text("".join(json.dumps(r) + "\n" for r in recs))
        return mutate

    bad("shape", edit(lambda rs: rs[1].update(num_tokens=6)), "line 2", "top_indices has shape")
    bad("range", edit(lambda rs: rs[0]["top_indices"][0].__setitem__(1, E)), "routes expert 8", "8 experts")
    bad("twice", edit(lambda rs: rs[0]["top_indices"][0].__setitem__(1, rs[0]["top_indices"][0][0])), "same expert twice")
    res = run_cli("import", "megatron", jl, tmp_path / "nosize")
    assert_one_sentence_error(res, "--expert-bytes")
    # Without the sidecars, --routings-only still imports the expert ids.
    d = tmp_path / "only"
    d.mkdir()
    (d / jl.name).write_bytes(jl.read_bytes())
    res = run_cli("import", "megatron", d / jl.name, d / "t", "--expert-bytes", "1000", "--routings-only")
    assert res.code == 0, res.err
    t, a = trace_arrays(d / "t")
    assert "gate_input" not in t.columns and len(a["step"]) == len(expected(run[1]))


@st.composite
def traces(draw):
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    k = draw(st.integers(1, 3))
    E = draw(st.integers(k, 9))
    layers = sorted(draw(st.lists(st.integers(0, 6), min_size=1, max_size=3, unique=True)))
    tokens = draw(st.lists(st.integers(1, 5), min_size=1, max_size=5))
    with_logits = draw(st.booleans())
    steps = make_steps(rng, tokens, layers, k, E)
    logits = {(s, lay): bf16_values(rng, (v[lay].shape[0], E)) for s, v in enumerate(steps) for lay in layers} \
        if with_logits else None
    return steps, logits, draw(st.integers(0, 3))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(traces())
def test_round_trip(tmp_path_factory, case):
    steps, logits, prefill_steps = case
    d = tmp_path_factory.mktemp("rt")
    jl = write_megatron(d, steps, logits=logits)
    res = run_cli("import", "megatron", jl, d / "t", "--expert-bytes", "4096", "--prefill-steps", str(prefill_steps))
    assert res.code == 0, res.err
    t, a = trace_arrays(d / "t")
    got = {(int(s), int(lay)): tuple(int(x) for x in e) for s, lay, e in zip(a["step"], a["layer"], a["experts"])}
    assert got == expected(steps)
    assert np.array_equal(a["phase"] == 0, a["batch"] < prefill_steps)
    if logits is not None:
        tab = t.table(["batch", "step", "layer", "logits"])
        lg = np.asarray(tab.column("logits").combine_chunks().flatten()).reshape(tab.num_rows, -1)
        b, s, ly = (tab.column(c).to_numpy() for c in ("batch", "step", "layer"))
        base = np.concatenate([[0], np.cumsum([next(iter(v.values())).shape[0] for v in steps])])
        for i in range(tab.num_rows):
            assert np.array_equal(lg[i], logits[(int(b[i]), int(ly[i]))][int(s[i]) - base[b[i]]])
