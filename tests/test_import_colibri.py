"""Issue 16: the colibri ROUTE_TRACE importer, from files written as route_trace.h's rt_trace writes them.

rt_trace: ``fprintf("%d %d %d", rt_call, row, layer)`` then ``" %d:%.4f"`` per selected expert, one
line per batch row of a MoE call; rt_trace_end advances ``rt_call`` once per call.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import assert_import_refused, assert_one_sentence_error, run_cli
from traces import open_trace
from traces.importers._sizes import load_sizes
from traces.importers.colibri import import_


def engine_write(path, passes, layers, route):
    """``passes``: rows per forward pass; ``route(pos, layer) -> (ids, gates)``. Returns {(pos, layer): (ids, gates)}."""
    call, pos0, want = 0, 0, {}
    with open(path, "w") as fh:
        for nrows in passes:
            for il in layers:
                for row in range(nrows):
                    ids, gates = route(pos0 + row, il)
                    fh.write(f"{call} {row} {il}" + "".join(f" {e}:{g:.4f}" for e, g in zip(ids, gates)) + "\n")
                    want[(pos0 + row, il)] = (list(ids), [float(np.float32(float(f"{g:.4f}"))) for g in gates])
                call += 1  # rt_trace_end: once per moe() invocation
            pos0 += nrows
    return want


def make_route(seed, n_expert, k, sorted_gates=True):
    rng = np.random.default_rng(seed)
    table = {}

    def route(pos, il):
        if (pos, il) not in table:
            ids = rng.choice(n_expert, size=k, replace=False)
            g = np.sort(rng.dirichlet(np.ones(k)))[::-1] if sorted_gates else rng.dirichlet(np.ones(k))
            table[(pos, il)] = ([int(x) for x in ids], [float(x) for x in g])
        return table[(pos, il)]
    return route


def imported(out):
    t = open_trace(out)
    a = t.arrays()
    return t, a, {(int(a.step[i]), int(a.layer[i])): ([int(x) for x in a.experts[i]], [float(x) for x in a.weights[i]])
                  for i in range(a.n_rows)}


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    from engine_bridge.tinymodel import TinyModelConfig, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny.gguf", TinyModelConfig(layers=4, experts=16, top_k=4, embd=64))


def test_engine_file_imports_exactly(tmp_path, gguf):
    src = tmp_path / "route.trace"
    want = engine_write(src, [6, 1, 1, 1], [0, 1, 2, 3], make_route(0, 16, 4))
    res = run_cli("import", "colibri", src, tmp_path / "t", "--sizes-from", gguf)
    assert res.code == 0, res.err
    t, a, got = imported(tmp_path / "t")
    assert got == want
    assert (a.phase[a.step < 6] == 0).all() and (a.phase[a.step >= 6] == 1).all()
    assert len(np.unique(a.batch)) == 4
    assert "phase inferred" in res.out and "logs no positions" in res.out
    assert t.meta["provenance"]["importer"] == "colibri" and t.meta["provenance"]["sources"][0]["file"] == "route.trace"
    res2 = run_cli("import", "auto", src, tmp_path / "t2", "--sizes-from", gguf, "--json")
    assert res2.code == 0 and res2.json()["format"] == "colibri"


def test_unsorted_gates_are_put_in_rank_order(tmp_path):
    src = tmp_path / "r.trace"
    want = engine_write(src, [3, 1], [0, 2], make_route(3, 8, 3, sorted_gates=False))
    res = run_cli("import", "colibri", src, tmp_path / "t", "--expert-bytes", "4096")
    assert res.code == 0, res.err
    _, _, got = imported(tmp_path / "t")
    for key, (ids, gates) in want.items():
        order = np.argsort(-np.array(gates), kind="stable")
        assert got[key] == ([ids[i] for i in order], [gates[i] for i in order])
    assert "descending-gate order" in res.out


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_round_trip_hypothesis(tmp_path_factory, data):
    k = data.draw(st.integers(1, 4))
    n_expert = data.draw(st.integers(k, 12))
    layers = sorted(data.draw(st.sets(st.integers(0, 6), min_size=1, max_size=4)))
    prompt = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    n_decode = data.draw(st.integers(0, 4))
    seed = data.draw(st.integers(0, 10_000))
    d = tmp_path_factory.mktemp("c")
    want = engine_write(d / "r.trace", prompt + [1] * n_decode, layers, make_route(seed, n_expert, k))
    if len(layers) == 1 and len(prompt) + n_decode > 1:
        # one layer: consecutive passes cannot be told apart by the layer index; the file reads as one pass
        return
    import_([d / "r.trace"], d / "t", sizes=load_sizes(expert_bytes=512), prompt_tokens=sum(prompt))
    t, a, got = imported(d / "t")
    assert got == want
    assert int((a.phase == 0).sum()) == sum(prompt) * len(layers)


def _good(tmp_path):
    src = tmp_path / "good.trace"
    engine_write(src, [3, 1, 1], [0, 1], make_route(1, 8, 2))
    return src


BAD = {
    "truncated": (lambda t: t[:-5], "truncated"),
    "wrong shape": (lambda t: t.replace("\n", " 1:0.5\n", 1), "the first line 3"),
    "not a pair": (lambda t: t.replace(":", "=", 1), "'<expert id>:<gate>'"),
    "negative id": (lambda t: t.replace("0 0 0 ", "0 0 0 -", 1), "negative"),
    "rows out of order": (lambda t: t.replace("0 1 0 ", "0 2 0 ", 1), "expected row 1"),
    "calls go back": (lambda t: t + "0 0 0 1:0.5000 2:0.5000\n", "does not follow"),
    "bad gate": (lambda t: t.replace(":0.", ":-0.", 1), "finite weight"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_one_sentence_nothing_written(tmp_path, case):
    src = _good(tmp_path)
    mutate, needle = BAD[case]
    assert_import_refused("colibri", src, mutate(src.read_text()), tmp_path / "out", ("--expert-bytes", "100"), str(src), needle)


def test_ids_out_of_range_and_no_sizes(tmp_path, gguf):
    src = tmp_path / "r.trace"
    src.write_text("0 0 0 3:0.6000 17:0.4000\n1 0 1 3:0.6000 1:0.4000\n")
    assert_one_sentence_error(run_cli("import", "colibri", src, tmp_path / "o", "--sizes-from", gguf), "expert 17")
    assert_one_sentence_error(run_cli("import", "colibri", src, tmp_path / "o"), "--expert-bytes")
    assert not (tmp_path / "o").exists()
