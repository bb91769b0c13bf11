"""The layout's rules, checked statically (ast; nothing is imported):

- data flows one way: engine_bridge -> traces -> replay. traces imports neither replay nor
  engine_bridge; replay never imports engine_bridge (docs/design.md, "Layout");
- computation apart from presentation: replay/core, replay/analyses, the policies and predictors
  import nothing of replay/present, replay/cli or the API;
- no import cycle among the modules of replay/, traces/ and engine_bridge/;
- no submodule of replay is named like one of replay's public functions, and the layout has the
  shape of issue 27 (core, analyses, policies, predictors, present, cli; format, io, importers,
  synth, util).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {"traces": {"replay", "engine_bridge"}, "replay": {"engine_bridge"}}
PACKAGES = ("replay", "traces", "engine_bridge")


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
# return. Only the layers above both import both: the public face (replay/__init__.py, api.py),
# the command line (replay/cli/, fastcli.py), the report's composition (analyses/report.py) and
# the sweep engine, which runs each grid cell through the public API (a cell's rows are exactly
# the verb's rows) and formats nothing itself.
ABOVE = {"replay/__init__.py", "replay/api.py", "replay/fastcli.py", "replay/analyses/report.py",
         "replay/analyses/sweeps.py"}
COMPUTATION = sorted(f for f in [*(ROOT / "replay").glob("*.py"), *(ROOT / "replay" / "core").rglob("*.py"),
                                 *(ROOT / "replay" / "analyses").rglob("*.py"), *(ROOT / "replay" / "policies").rglob("*.py"),
                                 *(ROOT / "replay" / "predictors").rglob("*.py")]
                     if str(f.relative_to(ROOT)) not in ABOVE)
PRESENTATION = ("replay.present", "replay.analyses.report", "replay.cli", "replay.api", "matplotlib", "typer")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])


def _absolute(node: ast.ImportFrom, pkg: str) -> str:
    base = node.module or ""
    if node.level:
        parts = pkg.split(".")
        parent = parts[: len(parts) - (node.level - 1)]
        base = ".".join([*parent, *([base] if base else [])])
    return base


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, dotted (``from replay.present import plots`` -> replay.present.plots; relative
    imports resolved against the file's package), at any depth (function-level imports included)."""
    pkg = _package_of(path)
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, pkg)
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def presentation_imports(path: Path) -> list[str]:
    return sorted(m for m in imported_modules(path) if any(m == p or m.startswith(p + ".") for p in PRESENTATION))


def test_computation_modules_import_no_presentation():
    assert len(COMPUTATION) > 40
    bad = {str(f.relative_to(ROOT)): presentation_imports(f) for f in COMPUTATION}
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
    fake = ROOT / "replay" / "core" / "_layering_probe.py"
    monkeypatch.setattr(Path, "read_text", lambda self, **kw: "def f():\n    from replay.present.format import text_table\n"
                        "    from ..present import plots\n")
    assert presentation_imports(fake) == ["replay.present", "replay.present.format", "replay.present.format.text_table",
                                          "replay.present.plots"]


# -- no import cycle (issue 27 item 3) --------------------------------------------------------------
# Every import statement counts, at module level and inside functions alike: a function-level
# import only postpones the dependency, it does not remove it (the five cycles issue 27 names were
# all closed by one). Not counted: imports under ``if TYPE_CHECKING:`` (never run), and the
# implicit import of a module's parent packages (``import replay.core.state`` runs
# replay/__init__.py, whose lazy ``__getattr__`` would otherwise put every module on one cycle).
# ``from P import N`` is an edge to P.N when that is a module of ours, else to P.


def _runtime_imports(tree: ast.Module):
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(c for c in ast.iter_child_nodes(node) if isinstance(c, (ast.stmt, ast.excepthandler)))


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of replay/traces/engine_bridge it imports (see above for what counts)."""
    files = {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f

    def ours(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, f in files.items():
        pkg = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for node in _runtime_imports(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps |= {ours(a.name) for a in node.names}
            else:
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join([*parts[: len(parts) - (node.level - 1)], *([base] if base else [])])
                deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else ours(base) for a in node.names}
        graph[mod] = {d for d in deps if d and d != mod}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) per strongly connected
    component of more than one module, in name order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for comp in sorted(comps):
        members = set(comp)
        # the shortest way back to the component's first module (breadth first)
        start, prev, queue = comp[0], {comp[0]: None}, [comp[0]]
        found = None
        while queue and found is None:
            v = queue.pop(0)
            for w in sorted(graph[v] & members):
                if w == start:
                    found = v
                    break
                if w not in prev:
                    prev[w] = v
                    queue.append(w)
        path = [start]
        while found is not None and found != start:
            path.insert(1, found)
            found = prev[found]
        out.append([*path, start])
    return out


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 100
    cycles = [" -> ".join(c) for c in import_cycles(graph)]
    assert cycles == [], "import cycles: " + "; ".join(cycles)


def test_the_cycle_check_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": set()}
    assert import_cycles(graph) == [["a", "b", "c", "a"]]
    # and a function-level import is an edge, an import under TYPE_CHECKING is not
    tree = ast.parse("import x\nif TYPE_CHECKING:\n    import y\ndef f():\n    from z import w\n")
    assert sorted(ast.unparse(n) for n in _runtime_imports(tree)) == ["from z import w", "import x"]


# -- names and shape --------------------------------------------------------------------------------
def _public_functions() -> list[str]:
    tree = ast.parse((ROOT / "replay" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return [e.value for e in node.value.elts]
    raise AssertionError("replay/__init__.py has no __all__")


def test_no_module_named_like_a_public_function():
    # replay.cache is the function, always: no submodule may take its name (which needed a class
    # swap on the package module before)
    names = _public_functions()
    assert {"cache", "predict", "drop", "prefetch", "sweep", "compare"} <= set(names)
    clash = [n for n in names if (ROOT / "replay" / f"{n}.py").exists() or (ROOT / "replay" / n).is_dir()]
    assert clash == []
    assert "__class__" not in (ROOT / "replay" / "__init__.py").read_text(encoding="utf-8")


# Modules that issue 27 item 1 retires (a second implementation, the typer-free fast path); allowed
# here until they are gone.
# The second implementations issue 27 retired: a native cache command, C twins of the Numba kernels,
# a hand-written Parquet/Thrift reader and their loaders. None may come back.
RETIRED = {"replay/native.py", "replay/aot.py", "replay/fastcli.py", "traces/footer.py", "traces/pages.py",
           "traces/pq_native.py", "traces/compiled.py"}


def test_no_second_implementation_remains():
    back = sorted(f for f in RETIRED if (ROOT / f).exists())
    assert not back, f"retired second implementations are back: {back}"
    c_sources = sorted(str(f.relative_to(ROOT)) for d in ("replay", "traces", "engine_bridge") for f in (ROOT / d).rglob("*.c"))
    assert not c_sources, f"C sources in the package (one implementation per kernel, in Numba): {c_sources}"
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {})
    assert "ext-modules" not in setuptools, "pyproject.toml builds a C extension"


def test_the_layout_has_its_shape():
    for d in ("replay/core", "replay/analyses", "replay/policies", "replay/predictors", "replay/present", "replay/cli",
              "traces/format", "traces/io", "traces/importers", "traces/synth", "traces/util"):
        assert (ROOT / d / "__init__.py").is_file(), d
    top = {str(f.relative_to(ROOT)) for f in [*(ROOT / "replay").glob("*.py"), *(ROOT / "traces").glob("*.py")]}
    assert top == {"replay/__init__.py", "replay/api.py", "replay/runner.py", "replay/plugins.py",
                   "replay/plugin_spec.py", "replay/plugin_files.py", "traces/__init__.py"}
