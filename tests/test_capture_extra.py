"""Without the capture extra (llama-cpp-python, gguf-py) the capture verbs still exist and say which
extra to install, in one sentence with exit 2; a plugin that fails to load is reported, not hidden.

The missing modules are simulated in a subprocess (``sys.modules[name] = None`` makes ``import
name`` fail as if it were not installed), so these tests run with or without the extra.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXTRA = "pip install 'moe-replay[capture]'"


def cli_without(modules: tuple[str, ...], *args: str) -> subprocess.CompletedProcess:
    hide = "".join(f"sys.modules[{m!r}] = None; " for m in modules)
    code = f"import sys; {hide}from replay.cli import main; main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def one_sentence(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moe-replay: error: "), r.stderr
    assert "Traceback" not in r.stderr and "this is a bug" not in r.stderr
    return lines[0]


@pytest.fixture
def files(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(60))  # exists; never read when the extra is missing
    return {"existing": model, "missing": tmp_path / "missing.gguf"}


@pytest.mark.parametrize("which", ["existing", "missing"])
@pytest.mark.parametrize("hidden", [("gguf", "llama_cpp"), ("gguf",), ("llama_cpp",)])
def test_capture_names_the_extra(files, tmp_path, which, hidden):
    out = tmp_path / "trace"
    msg = one_sentence(cli_without(hidden, "capture", files[which], "--prompt", "hi", "--out", out))
    assert EXTRA in msg and "capture" in msg
    assert any(repr(m) in msg for m in hidden)  # names the module that is missing
    assert not out.exists()


@pytest.mark.parametrize("which", ["existing", "missing"])
def test_make_model_names_the_extra(files, which):
    target = files[which] if which == "missing" else files["existing"].with_name("new.gguf")
    msg = one_sentence(cli_without(("gguf", "llama_cpp"), "make-model", target))
    assert EXTRA in msg and "make-model" in msg
    assert not target.exists()


def test_a_plugin_that_fails_to_load_is_reported_not_hidden():
    """A broken engine_bridge.cli import used to make `capture` vanish as "No such command"."""
    r = cli_without(("engine_bridge.cli",), "capture", "--help")
    assert r.returncode != 0
    assert "warning: the commands of plugin 'capture' (engine_bridge.cli:register) could not be loaded" in r.stderr
    assert "ImportError" in r.stderr or "ModuleNotFoundError" in r.stderr
    ok = cli_without(("engine_bridge.cli",), "info", "--help")  # every other verb still works
    assert ok.returncode == 0 and "Usage" in ok.stdout
