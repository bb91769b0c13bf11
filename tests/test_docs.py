"""The README is a front door and docs/ holds the rest (issue 27 item 5): the README starts with the
two commands and stays short, every verb of the CLI is documented somewhere in README.md + docs/,
every relative link in the docs resolves (anchors included), and the docs describe no retired
execution path. The README's Python blocks run in tests/test_readme_python.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
# Every Markdown file a user is sent to from the README (links are checked in each).
PAGES = [README, *DOCS, ROOT / "benchmarks" / "RESULTS.md", ROOT / "notebooks" / "README.md"]
MAX_README_LINES = 380


def _documented_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in [README, *DOCS])


def test_readme_starts_with_the_two_commands_and_stays_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "# moe-replay"
    head = "\n".join(lines[:15])
    block = re.search(r"```sh\n(.*?)```", head, flags=re.S)
    assert block, "the README's first lines hold the two commands a newcomer runs"
    cmds = [ln.split("#")[0].strip() for ln in block.group(1).splitlines()]
    assert cmds[:2] == ["make demo", "make test"], cmds
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; the front door stays under {MAX_README_LINES}"


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    for page in DOCS:
        if page.name != "README.md":
            assert f"({page.name})" in index, f"docs/README.md does not link {page.name}"


def _help(*args: str) -> str:
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT), "NO_COLOR": "1", "TERM": "dumb"}
    r = subprocess.run([sys.executable, "-m", "replay.cli", *args, "--help"], cwd=ROOT, capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def _commands(help_text: str) -> list[str]:
    """The command names of a --help's "Commands" box (typer/rich: one '│ name  description' row each)."""
    if "Commands" not in help_text:
        return []
    box = help_text[help_text.index("Commands"):]
    return re.findall(r"^│ ([a-z][a-z0-9.-]*)\s{2,}", box, flags=re.M)


def test_every_verb_is_documented():
    text = _documented_text()
    verbs = _commands(_help())
    assert {"cache", "predict", "report", "sweep", "import", "export", "cost"} <= set(verbs), verbs
    missing = [v for v in verbs if f"moe-replay {v}" not in text]
    for group in ("import", "export", "cost"):
        subs = _commands(_help(group))
        assert subs, group
        missing += [f"{group} {s}" for s in subs if f"{group} {s}" not in text]
    assert not missing, f"verbs not documented in README.md or docs/: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target} (no such heading)")
    assert not bad, f"{page.relative_to(ROOT)}: broken links: {bad}"


def test_docs_describe_no_retired_path():
    """The C reader, the compiled C twins and the switches that chose between them are gone (issue 27
    item 1); a user's page that still offered them would send people to code that does not exist."""
    retired = ("MOE_REPLAY_FAST", "MOE_REPLAY_AOT", "MOE_REPLAY_NATIVE", "native path", "replay._aot", "_aot.c", "_pq.c",
               "fastcli", "pq_native", "traces/footer")
    for page in [README, *DOCS]:
        text = page.read_text(encoding="utf-8")
        found = [w for w in retired if w in text]
        assert not found, f"{page.relative_to(ROOT)} mentions {found}"


def test_design_has_the_sections_modules_cite():
    """Modules and tests cite the contract by section ("Replay semantics", "Trace format, version 1", ...)."""
    anchors = _anchors(ROOT / "docs" / "design.md")
    for section in ("Layout", "Trace format", "Version 1", "Requests and server batching", "Importers and exports",
                    "Replay semantics (engine-faithful)", "Plugins", "Predictors and accuracy",
                    "Lossy and speculative what-ifs", "Cost model", "Report and verdict", "Sweeps",
                    "Machine-readable output", "Conventions"):
        assert _slug(section) in anchors, section
