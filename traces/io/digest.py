"""File and trace digests: the hashes recorded in provenance (importers, expert sizes), a sweep
cell's key and a cost model's origin."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def trace_content_id(path: str | Path) -> str:
    """sha256 over every file of a trace directory (relative path, size and bytes, in sorted order):
    two copies of one trace share an id; any change to routings, metadata or metrics changes it."""
    root = Path(path)
    h = hashlib.sha256(b"moe-route-trace\0")
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    for p in files:
        rel = p.relative_to(root).as_posix()
        h.update(f"{rel}\0{p.stat().st_size}\0".encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()
