"""Data flows one way: engine_bridge -> traces -> replay. traces imports neither replay nor
engine_bridge; replay never imports engine_bridge (DESIGN.md, "Layout")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {"traces": {"replay", "engine_bridge"}, "replay": {"engine_bridge"}}


def imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upstream_imports(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    bad = {str(f.relative_to(ROOT)): sorted(imported_top_levels(f) & FORBIDDEN[package]) for f in files}
    assert {f: v for f, v in bad.items() if v} == {}


# -- computation apart from presentation (issue 15 item 2) ---------------------------------------
# The library modules take frames/arrays in and give frames out; what people read (text tables,
# the report's Markdown/HTML, plots, the --json object) is built in replay/present/ from what they
# return. Only the layers above both (replay/cli/, replay/api.py, replay/report.py) import both.
COMPUTATION = sorted([*(ROOT / "replay").glob("*.py"), *(ROOT / "replay" / "policies").rglob("*.py"),
                      *(ROOT / "replay" / "predictors").rglob("*.py")])
ABOVE = {"__init__.py", "api.py", "report.py", "output.py", "plots.py"}  # the public face, the report's composition, compatibility shims
# sweep.py runs each grid cell through the public API (replay.api.cache, .drop, ...: a cell's rows are
# exactly the verb's rows), so like report.py it sits above the API; it formats nothing itself
ABOVE |= {"sweep.py"}
PRESENTATION = ("replay.present", "replay.output", "replay.report", "replay.plots", "replay.cli", "replay.api", "matplotlib",
                "typer")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, dotted (``from replay import plots`` -> replay.plots; relative
    imports resolved against the file's package), at any depth (function-level imports included)."""
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join([*parent, *([base] if base else [])])
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def presentation_imports(path: Path) -> list[str]:
    return sorted(m for m in imported_modules(path) if any(m == p or m.startswith(p + ".") for p in PRESENTATION))


def test_computation_modules_import_no_presentation():
    files = [f for f in COMPUTATION if f.parent != ROOT / "replay" or f.name not in ABOVE]
    assert len(files) > 20
    bad = {str(f.relative_to(ROOT)): presentation_imports(f) for f in files}
    assert {f: v for f, v in bad.items() if v} == {}


def test_presentation_is_pure():
    # present/ formats what it is given: no typer, no CLI, no API entry points (which would run analyses)
    files = sorted((ROOT / "replay" / "present").rglob("*.py"))
    assert len(files) >= 8
    bad = {str(f.relative_to(ROOT)): sorted(m for m in imported_modules(f)
                                            if m.split(".")[0] == "typer" or m.startswith(("replay.cli", "replay.api")))
           for f in files}
    assert {f: v for f, v in bad.items() if v} == {}


def test_the_layering_check_sees_a_violation(tmp_path, monkeypatch):
    # the checker itself: a computation module importing a table helper (at function level) is caught
    fake = ROOT / "replay" / "_layering_probe.py"
    monkeypatch.setattr(Path, "read_text", lambda self, **kw: "def f():\n    from replay.present.format import text_table\n"
                        "    from .present import plots\n")
    assert presentation_imports(fake) == ["replay.present", "replay.present.format", "replay.present.format.text_table",
                                          "replay.present.plots"]
