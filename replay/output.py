"""Formatting shared by the CLI verbs: JSON objects, plain-text tables, progress bars, the
first-run compile notice."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TextIO

import polars as pl
from tqdm import tqdm


def _clean(v: Any) -> Any:
    """JSON-safe scalar: NaN/inf become null (JSON has no NaN), numpy scalars become Python."""
    if hasattr(v, "item") and not isinstance(v, (list, dict, str)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def rows_of(frame: pl.DataFrame) -> list[dict[str, Any]]:
    return [_clean(r) for r in frame.to_dicts()]


def json_object(command: str, trace: str | None, rows: Iterable[dict[str, Any]], **extra: Any) -> str:
    """The one JSON object every ``--json`` verb prints (DESIGN.md, "Machine-readable output")."""
    obj = {"command": command, "trace": trace, "rows": [_clean(r) for r in rows]}
    obj.update({k: _clean(v) for k, v in extra.items()})
    return json.dumps(obj, indent=1, allow_nan=False)


def fmt(v: Any, digits: int = 1) -> str:
    """A table cell: None/NaN print as '-', never 0.0 (a layer with nothing scored is not 0%)."""
    if v is None:
        return "-"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "-"
        return f"{v:.{digits}f}"
    return str(v)


def text_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], headers: Sequence[str] | None = None,
               digits: int | dict[str, int] = 1) -> str:
    """A plain, right-aligned table an engine author can paste into an issue."""
    headers = list(headers or columns)
    dig = (lambda c: digits.get(c, 1)) if isinstance(digits, dict) else (lambda c: digits)
    cells = [[fmt(r.get(c), dig(c)) for c in columns] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def progress(total: int | None, desc: str, unit: str = "it") -> tqdm:
    """A progress bar on a terminal; silent when stderr is piped or redirected."""
    return tqdm(total=total, desc=desc, unit=unit, disable=not sys.stderr.isatty(), leave=False, dynamic_ncols=True)


COMPILE_NOTICE = "compiling replay kernels (once per installation; later runs load them from the cache) ..."


@contextmanager
def compile_notice(stream: TextIO | None = None) -> Iterator[None]:
    """While active, the first time Numba actually *compiles* a function (its ``numba:compile``
    event, which fires only on a cache miss: a kernel loaded from Numba's on-disk cache raises no
    event), print :data:`COMPILE_NOTICE` once to ``stream`` (default stderr), and only when that
    stream is a terminal: nothing in pipes, files or notebooks. The CLI wraps every command in it
    (``--json`` commands excepted), so every kernel getter (the cache drivers of
    :func:`replay.cache.kernel_for`, the predictor and scoring kernels) is covered in one place."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if not (isatty and isatty()):
        yield
        return
    from numba.core import event

    class _Notice(event.Listener):
        said = False

        def on_start(self, ev: event.Event) -> None:
            if not self.said:
                self.said = True
                print(COMPILE_NOTICE, file=stream, flush=True)

        def on_end(self, ev: event.Event) -> None:
            pass

    with event.install_listener("numba:compile", _Notice()):
        yield
