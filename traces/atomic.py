"""Atomic writes: a reader (or a crash) never sees a half-written file or output directory."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from traces.errors import UserError


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary sibling and a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def check_output_dir(out_dir: str | os.PathLike[str], force: bool) -> Path:
    """Refuse an output directory that exists and is not empty (unless ``force``), or that
    cannot be created. Called before any work so a bad option costs nothing."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: output path exists and is not a directory.")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"{out}: output directory exists and is not empty (pass --force to replace it).")
    parent = out.resolve().parent
    if not parent.is_dir():
        raise UserError(f"{out}: the parent directory {parent} does not exist.")
    if not os.access(parent, os.W_OK):
        raise UserError(f"{out}: the parent directory {parent} is not writable.")
    return out


@contextlib.contextmanager
def staged_dir(out_dir: str | os.PathLike[str], force: bool = False) -> Iterator[Path]:
    """Yield a hidden staging directory beside ``out_dir``; on success it replaces ``out_dir``
    in one rename, on any exception it is removed, so no half-written output is left behind."""
    out = check_output_dir(out_dir, force)
    stage = out.resolve().parent / f".{out.name}.partial-{os.getpid()}"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir()
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    if out.exists():
        old = out.resolve().parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(stage, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(stage, out)
