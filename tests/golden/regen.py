"""Rewrite tests/golden/expected/ from the current code (only when a figure is meant to change)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tests.golden.cases import EXPECTED, everything


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        got = everything(Path(d) / "work")
    EXPECTED.mkdir(exist_ok=True)
    for name, text in got.items():
        (EXPECTED / f"{name}.txt").write_text(text)
    print(f"wrote {len(got)} expected outputs to {EXPECTED}", file=sys.stderr)


if __name__ == "__main__":
    main()
