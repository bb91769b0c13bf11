"""The capture verbs through the real CLI (subprocess): interruption and bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'moe-replay[capture]')")
pytest.importorskip("gguf", reason="gguf-py is not installed (pip install 'moe-replay[capture]')")

from traces import open_trace  # noqa: E402

pytestmark = pytest.mark.capture

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "replay.cli", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("m") / "tiny.gguf"
    r = cli("make-model", path, "--arch", "qwen3moe", "--layers", "3", "--experts", "8", "--top-k", "2", "--embd", "32", "--seed", "3",
            "--context", "131072")  # room for the interrupt test's -n 100000
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout
    return path


@pytest.fixture(scope="module")
def dense_gguf(tmp_path_factory) -> Path:
    """A GGUF with no MoE layer (a llama-style dense block)."""
    import gguf

    path = tmp_path_factory.mktemp("d") / "dense.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(16)
    w.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((32, 16), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_leaves_a_valid_incomplete_trace(model, tmp_path, sig):
    out = tmp_path / "trace"
    proc = subprocess.Popen(
        [sys.executable, "-m", "replay.cli", "capture", str(model), "--prompt", "interrupt me", "-n", "100000",
         "--ignore-eos", "--threads", "1", "--part-tokens", "4", "--out", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            parts = list((out / "routings").glob("part-*.parquet")) if (out / "routings").is_dir() else []
            if len(parts) >= 3:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        else:
            pytest.fail("no part files appeared within 90 s")
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + int(sig), stderr
    assert "Traceback" not in stderr
    assert "INCOMPLETE" in stdout and sig.name in stdout
    t = open_trace(out)
    assert not t.complete
    a = t.arrays()
    steps = np.unique(a.step)
    assert steps.size > 4 and np.array_equal(steps, np.arange(steps.size))  # no hole
    # whole tokens only: every captured token has all MoE layers
    per_step = np.bincount(a.step)
    assert np.all(per_step == len(t.moe_layers))
    assert (a.phase == 1).sum() > 0
    assert t.meta["checks"]["passed"] is True


def _bad(args: list, out: Path | None) -> str:
    r = cli(*args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moe-replay: error: "), r.stderr
    assert "Traceback" not in r.stderr
    if out is not None:
        assert not out.exists(), f"{out} was left behind"
    return lines[0]


def test_bad_inputs(model, dense_gguf, tmp_path):
    out = tmp_path / "out"
    base = ["--prompt", "hello", "--out", out]
    assert "no such file" in _bad(["capture", tmp_path / "missing.gguf", *base], out)
    text = tmp_path / "notes.txt"
    text.write_text("not a model\n")
    assert "is not a GGUF file" in _bad(["capture", text, *base], out)
    assert "dense model" in _bad(["capture", dense_gguf, *base], out)
    assert "out of range" in _bad(["capture", model, *base, "--n-expert-used", "0"], out)
    assert "out of range" in _bad(["capture", model, *base, "--n-expert-used", "9"], out)
    assert "prompt is empty" in _bad(["capture", model, "--prompt", "  ", "--out", out], out)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert "prompt is empty" in _bad(["capture", model, "--prompt-file", empty, "--out", out], out)
    assert "no such prompt file" in _bad(["capture", model, "--prompt-file", tmp_path / "nope.txt", "--out", out], out)
    assert "exactly one" in _bad(["capture", model, "--out", out], out)
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    assert "not empty" in _bad(["capture", model, "--prompt", "hi", "--out", full], None)
    assert (full / "keep.txt").read_text() == "x"


def test_unwritable_output_directory(model, tmp_path):
    if os.geteuid() == 0:
        out = Path("/proc/moe-replay-capture-test")  # root passes permission checks; /proc refuses mkdir
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        out = ro / "out"
    msg = _bad(["capture", model, "--prompt", "hi", "--out", out], out)
    assert "cannot write" in msg or "not writable" in msg


def test_make_model_bad_options(tmp_path):
    out = tmp_path / "m.gguf"
    assert "--top-k" in _bad(["make-model", out, "--experts", "4", "--top-k", "5"], out)
    assert "--arch" in _bad(["make-model", out, "--arch", "llama"], out)
    assert "--embd" in _bad(["make-model", out, "--embd", "30"], out)


def test_capture_json_output(model, tmp_path):
    import json

    out = tmp_path / "j"
    r = cli("capture", model, "--prompt", "json please", "-n", "3", "--ignore-eos", "--ubatch", "4", "--out", out, "--json")
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    row = obj["rows"][0]
    assert obj["command"] == "capture" and row["complete"] and row["tokens_decode"] == 3 and row["checks_passed"]
    assert row["prefill_batches"] == -(-row["tokens_prefill"] // 4)


# -- prompts of any length: tokenized first, the context sized from tokens, split into ubatches --------------

WORDS = "Mixture of Experts routers pick a few experts for every token and the capture records what they chose".split()


def prompt_of(n_chars: int) -> str:
    """Deterministic English-like text of exactly n_chars characters (never ending in a space)."""
    text = ""
    i = 0
    while len(text) < n_chars:
        text += WORDS[i % len(WORDS)] + " "
        i += 1
    text = text[:n_chars]
    return text[:-1] + "x" if text.endswith(" ") else text


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("archs")
    out = {}
    for arch in ("qwen3moe", "gpt-oss"):
        path = d / f"{arch}.gguf"
        r = cli("make-model", path, "--arch", arch, "--layers", "4", "--experts", "16", "--top-k", "4", "--embd", "64")
        assert r.returncode == 0, r.stderr
        out[arch] = path
    return out


def _check_complete_trace(out: Path, row: dict, ubatch: int, n_decode: int) -> None:
    """Complete, self-checks pass (re-derived here from the columns), one trace batch per engine
    compute batch: prefill positions split every `ubatch` tokens, then one batch per decoded token."""
    from traces.format.gating import select
    from traces.io.reader import fixed_list_to_numpy
    from traces.util.rounding import round_input

    t = open_trace(out)
    assert t.complete and row["complete"] and row["checks_passed"] and t.meta["checks"]["passed"] is True
    n_prompt = row["tokens_prefill"]
    assert row["tokens_decode"] == n_decode
    eff = min(ubatch, n_prompt)
    assert row["prefill_batches"] == -(-n_prompt // eff)
    a = t.arrays()
    L = len(t.moe_layers)
    assert t.n_rows == (n_prompt + n_decode) * L
    assert set(zip(a.step.tolist(), a.layer.tolist())) == {(s, l) for s in range(n_prompt + n_decode) for l in t.moe_layers}
    assert np.all(np.diff(a.batch) >= 0)  # file order is batch order
    pre = a.phase == 0
    assert np.array_equal(a.batch[pre], a.step[pre] // eff)
    assert np.unique(a.batch[pre]).size == row["prefill_batches"]
    assert np.array_equal(np.unique(a.batch[~pre]), row["prefill_batches"] + np.arange(n_decode))
    assert np.array_equal(a.step[~pre] - n_prompt, a.batch[~pre] - row["prefill_batches"])
    # top-k of the captured logits = the captured ids; router x gate input reproduces every routing
    logits = np.concatenate([fixed_list_to_numpy(x.column("logits")) for x in t.iter_tables(["logits"])])
    gate = np.concatenate([fixed_list_to_numpy(x.column("gate_input")) for x in t.iter_tables(["gate_input"])])
    routers = t.router_matrices()
    lbias = t.router_logit_bias()
    for l in t.moe_layers:
        idx = a.layer == l
        W, sel_bias = routers[l]
        ids, _ = select(logits[idx], t.gating, t.top_k, sel_bias)
        assert np.array_equal(ids, a.experts[idx]), f"layer {l}: top-k(logits) != ids"
        fresh = round_input(gate[idx], t.meta["router_input_rounding"]).astype(np.float64) @ W.astype(np.float64).T
        if l in lbias:
            fresh = fresh + lbias[l][None, :]
        ids, _ = select(fresh, t.gating, t.top_k, sel_bias)
        assert np.array_equal(ids, a.experts[idx]), f"layer {l}: router x gate_input != ids"
    c = t.meta["checks"]
    assert c["topk_of_logits"]["agree"] == c["topk_of_logits"]["rows"] == t.n_rows
    assert c["fresh_gate"]["agree"] == c["fresh_gate"]["rows"] == t.n_rows


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
@pytest.mark.parametrize("n_chars,ubatch", [(1, None), (100, None), (600, 64), (1500, 64)])
def test_prompts_of_any_length(arch_models, tmp_path, arch, n_chars, ubatch):
    """A 100-character prompt on a 4-layer qwen3moe used to abort the process (exit 134,
    GGML_ASSERT(n_tokens_all <= cparams.n_batch)): the context was sized from the prompt's bytes,
    and this tokenizer makes more tokens than bytes (a space is the 3-byte U+2581, byte tokens)."""
    import json

    prompt = prompt_of(n_chars)
    assert len(prompt) == n_chars
    out = tmp_path / "trace"
    n_decode = 4
    args = ["capture", arch_models[arch], "--prompt", prompt, "-n", n_decode, "--ignore-eos", "--threads", "2",
            "--out", out, "--json"] + (["--ubatch", ubatch] if ubatch else [])
    r = cli(*args, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    row = json.loads(r.stdout)["rows"][0]
    assert row["tokens_prefill"] > len(prompt.encode())  # more tokens than bytes: what broke the old sizing
    _check_complete_trace(out, row, ubatch or 512, n_decode)
    if ubatch:
        assert row["prefill_batches"] >= 2 if n_chars == 600 else row["prefill_batches"] >= 20


def test_prefill_only_capture(model, tmp_path):
    import json

    out = tmp_path / "t"
    r = cli("capture", model, "--prompt", prompt_of(100), "-n", "0", "--ubatch", "32", "--out", out, "--json")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)["rows"][0]
    _check_complete_trace(out, row, 32, 0)


@pytest.fixture(scope="module")
def short_context_model(tmp_path_factory) -> Path:
    from engine_bridge.tinymodel import TinyModelConfig, write_tiny_model

    path = tmp_path_factory.mktemp("ctx") / "ctx256.gguf"
    return write_tiny_model(path, TinyModelConfig(layers=2, experts=8, top_k=2, embd=32, context=256, seed=5))


def test_beyond_the_training_context_is_refused(short_context_model, tmp_path):
    """Prompt + -n beyond the model's training context: one sentence, exit 2, nothing written
    (llama.cpp itself only warns and then computes positions the model was never trained on)."""
    out = tmp_path / "out"
    msg = _bad(["capture", short_context_model, "--prompt", prompt_of(100), "-n", "200", "--out", out], out)
    assert "training context of 256" in msg and "-n 200" in msg
    msg = _bad(["capture", short_context_model, "--prompt", prompt_of(600), "-n", "0", "--out", out], out)
    assert "training context of 256" in msg
    # the boundary: prompt tokens + -n = 256 runs, 257 is refused
    import json

    probe = tmp_path / "probe"
    r = cli("capture", short_context_model, "--prompt", "a b", "-n", "0", "--json", "--out", probe)
    assert r.returncode == 0, r.stderr
    n_prompt = json.loads(r.stdout)["rows"][0]["tokens_prefill"]
    assert "training context of 256" in _bad(["capture", short_context_model, "--prompt", "a b", "-n", 257 - n_prompt,
                                              "--out", out], out)
    r = cli("capture", short_context_model, "--prompt", "a b", "-n", 256 - n_prompt, "--ignore-eos", "--json", "--out", out)
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)["rows"][0]
    assert row["complete"] and row["checks_passed"] and row["tokens_prefill"] + row["tokens_decode"] == 256


def test_a_model_without_tokenizer_is_refused(tmp_path):
    """tokenizer.ggml.model = none: llama.cpp would abort on GGML_ASSERT(tokenizer) in llama_tokenize."""
    from engine_bridge.tinymodel import TinyModelConfig, write_tiny_model

    path = write_tiny_model(tmp_path / "notok.gguf", TinyModelConfig(layers=2, experts=8, top_k=2, embd=32, tokenizer="none"))
    out = tmp_path / "out"
    assert "has no tokenizer" in _bad(["capture", path, "--prompt", "hello", "--out", out], out)


@pytest.mark.parametrize("opt,value,needle", [
    ("--ubatch", "0", "--ubatch"), ("-n", "-1", "-n"), ("--threads", "0", "--threads"), ("--threads", "100000", "--threads"),
    ("--temp", "nan", "--temp"), ("--temp", "inf", "--temp"), ("--seed", "-1", "--seed"), ("--part-tokens", "0", "--part-tokens"),
])
def test_bad_numeric_options(model, tmp_path, opt, value, needle):
    out = tmp_path / "out"
    msg = _bad(["capture", model, "--prompt", "hello", "--temp", "0.5", opt, value, "--out", out] if opt == "--seed"
               else ["capture", model, "--prompt", "hello", opt, value, "--out", out], out)
    assert needle in msg
