"""Cross-engine agreement: the same tiny float32 weights through llama.cpp and through transformers
route alike.

A random transformers checkpoint (with a tiny byte-level BPE tokenizer) is saved, converted to GGUF
by llama.cpp's own ``convert_hf_to_gguf.py`` from the llama-cpp-python sdist (tests/llama_convert.py),
captured on the same prompt by ``moe-replay capture`` (llama.cpp) and ``moe-replay capture-hf``
(transformers), and ``moe-replay compare`` must show >= 99% of routings choosing the same expert set,
every disagreement a near-tie below ``TOL`` logits. Both engines must have seen the same token ids:
checked here (prompt and greedy continuation), not assumed.

Two architectures that both the converter and the vendored llama.cpp support: Qwen3-MoE and OLMoE.
(Mixtral's converter path needs sentencepiece; Qwen2-MoE's fails on a dense layer between MoE ones,
which the tiny Qwen2-MoE builder makes.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'moe-replay[capture]')")
pytest.importorskip("gguf", reason="gguf-py is not installed (pip install 'moe-replay[capture]')")
pytest.importorskip("torch", reason="torch is not installed (pip install 'moe-replay[hf]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'moe-replay[hf]')")

from engine_bridge import hf_tiny  # noqa: E402
from engine_bridge.hf_tiny import TinyHfConfig, write_tiny_hf_model  # noqa: E402
from tests.helpers import run_cli  # noqa: E402
from tests.llama_convert import convert, extract_converter, llama_version, obtain_sdist  # noqa: E402
from traces import open_trace  # noqa: E402

pytestmark = [pytest.mark.capture, pytest.mark.hf]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = "the quick brown fox jumps over the lazy dog, and a mixture of experts routes every token"
N_DECODE = 16
# llama.cpp's default attention on CPU goes through f16 (KV cache f16, flash attention): float32
# router logits then differ from transformers' by ~1e-3 relative (up to ~1e-2 here, README). The
# capture computes attention in float32 instead, so the two float32 engines differ by rounding only
# (~3e-6 logits measured, README).
LLAMA_EXACT = ("--kv-type", "f32", "--flash-attn", "off")
# The stated tolerance: a disagreement whose router margin (k-th minus (k+1)-th logit, on the
# experts the two engines disagree on) is below this is a near-tie, ~30x the engines' logit difference.
TOL = 1e-4
MIN_AGREE_PCT = 99.0

# family -> (TinyHfConfig fields, config attributes set after the builder's own)
ARCHS: dict[str, tuple[dict, dict]] = {
    "qwen3_moe": ({"layers": 3, "experts": 16, "top_k": 4, "seed": 7}, {}),
    # llama.cpp's OLMoE normalises K over all heads (its k_norm has n_embd entries): no grouped-query attention
    "olmoe": ({"layers": 3, "experts": 16, "top_k": 4, "seed": 8}, {"num_key_value_heads": 4}),
}


def _checkpoint(family: str, out: Path) -> Path:
    fields, extra = ARCHS[family]
    original = hf_tiny.tiny_config

    def tiny_config(*a, **kw):
        conf = original(*a, **kw)
        for k, v in extra.items():
            setattr(conf, k, v)
        return conf

    with mock.patch.object(hf_tiny, "tiny_config", tiny_config):
        return write_tiny_hf_model(out, TinyHfConfig(family=family, **fields))


@pytest.fixture(scope="session")
def converter(tmp_path_factory) -> Path:
    ver = llama_version()
    if ver is None:
        pytest.skip("llama-cpp-python is not installed, so there is no sdist version to take convert_hf_to_gguf.py from")
    sdist, why = obtain_sdist(ver)
    if sdist is None:
        pytest.skip(f"llama.cpp's convert_hf_to_gguf.py is not available: {why}")
    return extract_converter(sdist, tmp_path_factory.mktemp("llama-convert"))


@pytest.fixture(scope="session")
def engines(converter, tmp_path_factory) -> dict[str, dict]:
    """{family: {ckpt, gguf, llama, hf, compare (the --json object)}}: every engine run once."""
    base = tmp_path_factory.mktemp("engines")
    runs = {f: {"ckpt": _checkpoint(f, base / f), "gguf": base / f"{f}.gguf"} for f in ARCHS}
    convert(converter, [(r["ckpt"], r["gguf"]) for r in runs.values()])
    for f, r in runs.items():
        r["llama"], r["hf"] = base / f"{f}-llama", base / f"{f}-hf"
        res = run_cli("capture", r["gguf"], "--prompt", PROMPT, "-n", N_DECODE, "--out", r["llama"], "--ignore-eos",
                      "--threads", "2", *LLAMA_EXACT)
        assert res.code == 0, res.err
        res = run_cli("capture-hf", r["ckpt"], "--prompt", PROMPT, "-n", N_DECODE, "--out", r["hf"], "--ignore-eos")
        assert res.code == 0, res.err
        res = run_cli("compare", r["llama"], r["hf"], "--tol", TOL, "--json")
        assert res.code == 0, res.err
        r["compare"] = res.json()
    return runs


@pytest.mark.parametrize("family", list(ARCHS))
def test_both_engines_saw_the_same_tokens(engines, family):
    """The prompt tokenizes identically (llama.cpp's BPE on the converted vocabulary and merges vs
    the tokenizers library) and the greedy continuations are the same token ids."""
    from transformers import AutoTokenizer

    r = engines[family]
    llama, hf = open_trace(r["llama"]), open_trace(r["hf"])
    per_step = {s: t for s, t in llama.routings(["step", "token"]).unique().iter_rows()}
    seq = [per_step[s] for s in sorted(per_step)]
    prompt = AutoTokenizer.from_pretrained(r["ckpt"])(PROMPT)["input_ids"]
    generated = hf.meta["capture_summary"]["generated_tokens"][0]
    assert len(generated) == N_DECODE
    assert seq == list(prompt) + list(generated)
    assert hf.has("token") and r["compare"]["tokens_checked"]  # compare checked them too


@pytest.mark.parametrize("family", list(ARCHS))
def test_engines_route_alike(engines, family):
    js = engines[family]["compare"]
    overall = js["rows"][-1]
    assert overall["layer"] is None and js["tol"] == TOL and js["align"] == "none"
    llama = open_trace(engines[family]["llama"])
    assert overall["routings"] == llama.n_rows  # every routing compared, none left out
    assert overall["set_agree_pct"] >= MIN_AGREE_PCT, json.dumps(js["rows"])
    assert overall["unexplained"] == 0, json.dumps(js["disagreements"])
    assert all(d["margin"] is not None and d["margin"] < TOL for d in js["disagreements"])
    # float32 weights, float32 attention: the engines differ by rounding only
    assert overall["logit_max_abs_diff"] < TOL and overall["weight_max_abs_diff"] < TOL


def test_compare_text_names_both_engines(engines):
    r = engines["qwen3_moe"]
    res = run_cli("compare", r["llama"], r["hf"], "--tol", TOL)
    assert res.code == 0 and "llama.cpp" in res.out and "transformers" in res.out and "set agree %" in res.out


def test_another_prompt_is_refused_and_aligned_on_request(engines, tmp_path):
    """A run on another prompt is not compared: the refusal names the first differing position;
    --align step compares the shared beginning (same tokens, same engine: 100%)."""
    r = engines["qwen3_moe"]
    other = tmp_path / "other"
    res = run_cli("capture", r["gguf"], "--prompt", PROMPT.replace("lazy dog", "lazy cat"), "-n", 2, "--out", other,
                  "--threads", "2", "--ignore-eos", *LLAMA_EXACT)
    assert res.code == 0, res.err
    res = run_cli("compare", r["llama"], other)
    assert res.code == 2 and "token ids differ from turn 0 step" in res.err and "--align step" in res.err
    js = run_cli("compare", r["llama"], other, "--align", "step", "--json").json()
    assert js["rows"][-1]["set_agree_pct"] == 100.0 and js["rows"][-1]["logit_max_abs_diff"] == 0.0
    assert 0 < js["positions"] < len(PROMPT)
