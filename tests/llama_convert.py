"""llama.cpp's own ``convert_hf_to_gguf.py``, taken from the llama-cpp-python source distribution the
project builds (the same llama.cpp the capture runs), for the cross-engine tests.

Where the sdist comes from, first found wins: ``$MOE_REPLAY_LLAMA_SDIST``; ``.venv/work/`` (``make
test`` downloads it there); ``~/.cache/moe-replay/``; else ``pip download`` into that cache (PyPI,
once; the test skips, with pip's reason, when it cannot). Only the converter, its ``conversion``
package and the vendored ``gguf-py`` are extracted. The converter runs offline in a subprocess with
the vendored gguf-py first on the path (as the script itself arranges), torch, transformers and
numpy from the environment; the byte-level BPE vocabularies it reads need no sentencepiece.

One thing is told to the converter rather than found by it: the pre-tokenizer name. It recognises
a BPE tokenizer by hashing the ids it gives a fixed text and looking the hash up in a table of
published models; a tiny tokenizer trained for a test is in no such table, so the converter would
refuse it. Our tokenizer splits text with the GPT-2 pattern (``ByteLevel(use_regex=True)``), which
is llama.cpp's ``gpt-2`` pre-tokenizer, so that is what the runner answers. Everything else (tensor
mapping, hyper-parameters, the vocabulary and merges) is the converter's own code, unchanged.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "moe-replay"

# argv: script, pre-tokenizer, outtype, then (checkpoint, out.gguf) pairs: one process for all
# (torch and transformers imported once).
_RUNNER = """
import runpy, sys
from pathlib import Path
script, pre, outtype, rest = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
sys.path.insert(0, str(script.parent)); sys.path.insert(1, str(script.parent / "gguf-py"))
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre  # see tests/llama_convert.py
for src, out in zip(rest[::2], rest[1::2]):
    sys.argv = [str(script), src, "--outfile", out, "--outtype", outtype]
    runpy.run_path(str(script), run_name="__main__")
"""


def llama_version() -> str | None:
    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return None


def find_sdist(ver: str) -> Path | None:
    name = f"llama_cpp_python-{ver}.tar.gz"
    env = os.environ.get("MOE_REPLAY_LLAMA_SDIST")
    for p in ([Path(env)] if env else []) + [REPO / ".venv" / "work" / name, CACHE / name]:
        if p.is_file():
            return p
    return None


def obtain_sdist(ver: str) -> tuple[Path | None, str]:
    """(path, "") or (None, why not): a local copy, else ``pip download`` into the cache."""
    found = find_sdist(ver)
    if found is not None:
        return found, ""
    CACHE.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps",
           "--no-binary", ":all:", "-d", str(CACHE), f"llama-cpp-python=={ver}"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"pip download llama-cpp-python=={ver} (sdist) failed: {e}"
    found = find_sdist(ver)
    if found is None:
        lines = [ln.strip() for ln in (r.stderr or r.stdout).splitlines() if ln.strip()]
        why = next((ln for ln in lines if ln.startswith("ERROR")), lines[-1] if lines else "no output")
        return None, f"pip download llama-cpp-python=={ver} (sdist) did not produce it: {why[:200]}"
    return found, ""


def extract_converter(sdist: Path, dest: Path) -> Path:
    """``dest/convert_hf_to_gguf.py`` with ``conversion/`` and ``gguf-py/`` beside it; returns the script."""
    top = sdist.name[: -len(".tar.gz")] + "/vendor/llama.cpp/"
    wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/")
    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(top) and m.name[len(top):].startswith(wanted) and (m.isfile() or m.isdir()):
                m.name = m.name[len(top):]
                members.append(m)
        tar.extractall(dest, members=members, filter="data")
    script = dest / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise FileNotFoundError(f"{sdist}: holds no vendor/llama.cpp/convert_hf_to_gguf.py")
    return script


def convert(script: Path, pairs: list[tuple[Path, Path]], outtype: str = "f32", pre: str = "gpt-2") -> None:
    """Run the converter on saved checkpoints, (checkpoint dir, out .gguf) each, in one process;
    raise with its last lines of output on failure."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("NO_LOCAL_GGUF", None)
    args = [str(p) for pair in pairs for p in pair]
    r = subprocess.run([sys.executable, "-c", _RUNNER, str(script), pre, outtype, *args], capture_output=True, text=True,
                       env=env, timeout=600)
    missing = [str(out) for _, out in pairs if not out.is_file()]
    if r.returncode != 0 or missing:
        raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {r.returncode}; not written: {', '.join(missing)}):\n"
                           + "\n".join((r.stderr or r.stdout).splitlines()[-15:]))
