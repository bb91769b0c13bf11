"""Issue 16: the llama.cpp examples/moe-trace importer, from files written as llama-moe-trace writes them.

The writers below follow the example's source (the eval callback on ``ffn_moe_topk-<il>``, called
per layer in increasing order for each llama_decode; the prompt decoded in ``n_ubatch`` chunks,
then one token per decode; llama.cpp computes only the output row in a prompt pass's last layer):

- upstream: ``fprintf("%d,%d\\n", il, ids[i])`` for every element of the [k, n_tokens] tensor, no header;
- extended fork: header ``phase,token,layer,rank,expert``, ``token = token_offset + row``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import assert_import_refused, assert_one_sentence_error, run_cli
from traces import open_trace
from traces.format.errors import UserError
from traces.importers._sizes import load_sizes
from traces.importers.llamacpp_moetrace import import_


def passes(prompt_len: int, ubatch: int, n_decode: int):
    """(phase, first position, n_tokens) of each llama_decode, as the example issues them."""
    out = [("prefill", i, min(ubatch, prompt_len - i)) for i in range(0, prompt_len, ubatch)]
    out += [("decode", prompt_len + i, 1) for i in range(n_decode)]
    return out


def engine_rows(routes: dict, layers: list[int], prompt_len: int, ubatch: int, n_decode: int, last_short: bool):
    """Per pass and layer, the (position list, written-token list) the callback sees."""
    for phase, start, n in passes(prompt_len, ubatch, n_decode):
        for il in layers:
            rows = list(range(start, start + n))
            if last_short and il == layers[-1] and phase == "prefill":
                rows = rows[-1:]  # only the output row reaches the last layer's FFN
            for r, pos in enumerate(rows):
                yield phase, start + r, pos, il, routes[(pos, il)]  # written token = token_offset + row


def write_extended(path, *args) -> None:
    with open(path, "w") as fh:
        fh.write("phase,token,layer,rank,expert\n")
        for phase, tok, _pos, il, ids in engine_rows(*args):
            for rank, e in enumerate(ids):
                fh.write(f"{phase},{tok},{il},{rank},{e}\n")


def write_plain(path, *args) -> None:
    with open(path, "w") as fh:
        for _phase, _tok, _pos, il, ids in engine_rows(*args):
            for e in ids:
                fh.write(f"{il},{e}\n")


def make_routes(rng, layers, n_pos, n_expert, k):
    return {(p, il): [int(x) for x in rng.choice(n_expert, size=k, replace=False)] for p in range(n_pos) for il in layers}


def imported(out):
    t = open_trace(out)
    a = t.arrays()
    got = {(int(a.step[i]), int(a.layer[i])): (int(a.phase[i]), [int(x) for x in a.experts[i]]) for i in range(a.n_rows)}
    return t, a, got


def expected(routes, layers, prompt_len, ubatch, n_decode, last_short):
    want = {}
    for phase, _tok, pos, il, ids in engine_rows(routes, layers, prompt_len, ubatch, n_decode, last_short):
        want[(pos, il)] = (0 if phase == "prefill" else 1, ids)
    return want


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    from engine_bridge.tinymodel import TinyModelConfig, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny.gguf", TinyModelConfig(layers=4, experts=16, top_k=4, embd=64))


@pytest.mark.parametrize("shape", ["extended", "plain"])
def test_engine_file_imports_exactly(tmp_path, gguf, shape):
    rng = np.random.default_rng(1)
    layers, prompt_len, ubatch, n_decode = [0, 1, 2, 3], 7, 4, 5
    routes = make_routes(rng, layers, prompt_len + n_decode, 16, 4)
    args = (routes, layers, prompt_len, ubatch, n_decode, True)
    src = tmp_path / "moe_trace.csv"
    (write_extended if shape == "extended" else write_plain)(src, *args)
    res = run_cli("import", "llamacpp-moetrace", src, tmp_path / "t", "--sizes-from", gguf)
    assert res.code == 0, res.err
    t, a, got = imported(tmp_path / "t")
    assert got == expected(*args)
    # batches: two prompt passes (4 + 3 tokens), then one per decoded token
    assert len(np.unique(a.batch)) == 2 + n_decode
    assert np.isnan(a.weights).all()  # the format has no weights
    assert t.expert_bytes[0] == 12288 and t.meta["provenance"]["sizes"]["kind"] == "gguf"
    assert "placed at" in res.out  # the short last-layer blocks are said
    if shape == "plain":
        assert "phase inferred" in res.out and "no token column" in res.out
    # auto recognises it
    res2 = run_cli("import", "auto", src, tmp_path / "t2", "--sizes-from", gguf)
    assert res2.code == 0 and res2.out.startswith("format: llamacpp-moetrace")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_round_trip_hypothesis(tmp_path_factory, data):
    k = data.draw(st.integers(1, 3))
    n_expert = data.draw(st.integers(k, 9))
    layers = sorted(data.draw(st.sets(st.integers(0, 5), min_size=2, max_size=4)))
    prompt_len = data.draw(st.integers(2, 9))
    ubatch = data.draw(st.integers(2, 5))
    n_decode = data.draw(st.integers(0, 4))
    last_short = data.draw(st.booleans())
    shape = data.draw(st.sampled_from(["extended", "plain"]))
    seed = data.draw(st.integers(0, 1000))
    routes = make_routes(np.random.default_rng(seed), layers, prompt_len + n_decode, n_expert, k)
    args = (routes, layers, prompt_len, ubatch, n_decode, last_short)
    d = tmp_path_factory.mktemp("rt")
    src = d / "trace.csv"
    (write_extended if shape == "extended" else write_plain)(src, *args)
    extra = {} if shape == "extended" else {"top_k": k, "prompt_tokens": prompt_len}
    import_([src], d / "t", sizes=load_sizes(expert_bytes=1000), **extra)
    _, _, got = imported(d / "t")
    assert got == expected(*args)


def _good(tmp_path):
    rng = np.random.default_rng(0)
    routes = make_routes(rng, [0, 1], 6, 8, 2)
    src = tmp_path / "good.csv"
    write_extended(src, routes, [0, 1], 4, 4, 2, True)
    return src


BAD = {
    "truncated mid-row": (lambda t: t[:-3], "truncated"),
    "truncated routing": (lambda t: t[: t.rindex("\n", 0, len(t) - 1) + 1], "ranks"),
    "wrong shape": (lambda t: t.replace("prefill,0,0,0,", "prefill,0,0,", 1), "fields"),
    "bad phase": (lambda t: t.replace("prefill", "warmup", 1), "not prefill or decode"),
    "not a number": (lambda t: t.replace("decode,5,0,0,", "decode,five,0,0,", 1), "not an integer"),
    "negative id": (lambda t: t.replace("prefill,0,0,0,", "prefill,0,0,0,-", 1), "negative"),
    "same expert twice": (lambda t: t.replace("decode,5,1,1,", "decode,5,1,1,X", 1), None),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_one_sentence_nothing_written(tmp_path, case):
    src = _good(tmp_path)
    text = src.read_text()
    mutate, needle = BAD[case]
    if case == "same expert twice":
        lines = text.splitlines(keepends=True)
        i = next(j for j, ln in enumerate(lines) if ln.startswith("decode,5,1,1,"))
        lines[i] = "decode,5,1,1," + lines[i - 1].rsplit(",", 1)[1]
        new, needle = "".join(lines), "same expert twice"
    else:
        new = mutate(text)
    assert_import_refused("llamacpp-moetrace", src, new, tmp_path / "out", ("--expert-bytes", "100"), str(src), needle)


def test_ids_out_of_the_models_range(tmp_path, gguf):
    src = tmp_path / "t.csv"
    src.write_text("phase,token,layer,rank,expert\ndecode,0,0,0,3\ndecode,0,1,0,16\n")
    res = run_cli("import", "llamacpp-moetrace", src, tmp_path / "o", "--sizes-from", gguf)
    assert_one_sentence_error(res, "expert 16", "16 experts")
    src.write_text("phase,token,layer,rank,expert\ndecode,0,0,0,3\ndecode,0,7,0,1\n")
    assert_one_sentence_error(run_cli("import", "llamacpp-moetrace", src, tmp_path / "o", "--sizes-from", gguf), "layer 7")
    assert not (tmp_path / "o").exists()


def test_refuses_without_sizes_and_names_the_options(tmp_path):
    src = _good(tmp_path)
    res = run_cli("import", "llamacpp-moetrace", src, tmp_path / "o")
    assert_one_sentence_error(res, "--expert-bytes", "--sizes-from")
    assert not (tmp_path / "o").exists()


def test_plain_needs_top_k_and_a_pass_aligned_prompt(tmp_path):
    routes = make_routes(np.random.default_rng(0), [0, 1], 6, 8, 2)
    src = tmp_path / "p.csv"
    write_plain(src, routes, [0, 1], 4, 4, 2, False)
    assert_one_sentence_error(run_cli("import", "llamacpp-moetrace", src, tmp_path / "o", "--expert-bytes", "9"), "--top-k")
    res = run_cli("import", "llamacpp-moetrace", src, tmp_path / "o", "--expert-bytes", "9", "--top-k", "3")
    assert_one_sentence_error(res, "not a multiple of top-k 3")
    res = run_cli("import", "llamacpp-moetrace", src, tmp_path / "o", "--expert-bytes", "9", "--top-k", "2",
                  "--prompt-tokens", "3")
    assert_one_sentence_error(res, "--prompt-tokens 3", "must end where a pass ends")
    assert not (tmp_path / "o").exists()
    with pytest.raises(UserError, match="single layer"):
        (tmp_path / "one.csv").write_text("0,1\n0,2\n")
        import_([tmp_path / "one.csv"], tmp_path / "o", sizes=load_sizes(expert_bytes=9), top_k=1)
