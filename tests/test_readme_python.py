"""The README's "Use from Python" section runs as written, and the quickstart notebook uses only
the public API (issue 15 item 1)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(heading: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end > 0 else None]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_readme_use_from_python_runs(tmp_path):
    blocks = python_blocks("Use from Python")
    assert len(blocks) >= 4
    script = tmp_path / "readme.py"
    script.write_text("\n".join(blocks))
    r = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "unknown policy 'nope'" in r.stdout and "--" not in r.stdout.split("unknown policy")[0].splitlines()[-1]


def test_quickstart_uses_only_the_public_api():
    nb = json.loads((ROOT / "notebooks" / "quickstart.ipynb").read_text())
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    imports = re.findall(r"^\s*(?:from\s+(\S+)\s+import|import\s+(\S+))", code, flags=re.M)
    mods = {a or b for a, b in imports}
    assert "replay" in mods
    assert not [m for m in mods if m.startswith(("replay.", "traces", "engine_bridge"))], mods


def test_help_lists_the_api():
    r = subprocess.run([sys.executable, "-c", "import replay; help(replay)"], cwd=ROOT, capture_output=True, text=True,
                       env={"PAGER": "cat", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 0, r.stderr
    import replay

    for name in replay.__all__:
        assert name in r.stdout, name
    for fn in ("cache", "predict", "drop", "prefetch", "retain", "fit_cost_model", "load_cost_model", "with_time",
               "write_report", "open_trace"):
        assert callable(getattr(replay, fn)), fn
