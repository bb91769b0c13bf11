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
    r = cli("make-model", path, "--arch", "qwen3moe", "--layers", "3", "--experts", "8", "--top-k", "2", "--embd", "32", "--seed", "3")
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
