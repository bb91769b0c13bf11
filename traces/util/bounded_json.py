"""JSON read with bounds checked before and while it is parsed: nesting depth, integer size, file
size. Python's parser recurses once per nesting level (a file of 100,000 ``[`` ends in
RecursionError) and turns any run of digits into an int (a 5,000-digit count ends in ValueError,
one of 400 digits in OverflowError wherever it meets a float); a reader that lets those through
reports a bug where the input is at fault. Here each ends in one :class:`UserError` naming the
file and, for an integer, the field that holds it (docs/design.md, "Cost model")."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from traces.format.errors import UserError

MAX_DEPTH = 64  # no file this tool reads nests deeper than a handful of levels
MAX_INT_DIGITS = 19  # 2^63 - 1 has 19 digits: every count, byte total and id fits in int64
MAX_BYTES = 64 << 20  # a cost model or metadata file is kilobytes; this is far above any real one

_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


class _HugeInt(str):
    """An integer literal longer than MAX_INT_DIGITS, kept as text so that its field can be named."""


def _parse_int(text: str) -> int | _HugeInt:
    return _HugeInt(text) if len(text.lstrip("-")) > MAX_INT_DIGITS else int(text)


def _depth(text: str) -> int:
    depth = deepest = 0
    for m in _TOKENS.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_DEPTH:
                    return deepest
        elif c in "]}":
            depth -= 1
    return deepest


def _find_huge(obj: Any, where: str) -> tuple[str, _HugeInt] | None:
    if isinstance(obj, _HugeInt):
        return where, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            hit = _find_huge(v, f"{where}.{k}" if where else str(k))
            if hit:
                return hit
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            hit = _find_huge(v, f"{where}[{i}]")
            if hit:
                return hit
    return None


class BoundsError(Exception):
    """A bound passed while parsing (:func:`parse_bounded`); the message names the field, not the
    file: the caller, which knows the file and line, says it."""


def parse_bounded(text: str, what: str = "JSON value") -> Any:
    """``json.loads`` with the bounds above: :class:`BoundsError` for nesting deeper than MAX_DEPTH
    (checked before parsing) or an integer longer than MAX_INT_DIGITS (named by its field);
    ``json.JSONDecodeError`` (a ValueError) for text that is not JSON, as ``json.loads`` raises it.
    For readers that keep their own sentences for the file and line (trace.json, JSON lines)."""
    deepest = _depth(text)
    if deepest > MAX_DEPTH:
        raise BoundsError(f"nests more than {MAX_DEPTH} levels deep; not a {what} this tool reads")
    obj = json.loads(text, parse_int=_parse_int)
    hit = _find_huge(obj, "")
    if hit is not None:
        field, digits = hit
        raise BoundsError(f"{field or 'the value'} holds an integer of {len(digits.lstrip('-'))} digits, beyond any "
                          f"count or size (at most {MAX_INT_DIGITS} digits, 2^63-1)")
    return obj


def loads_bounded(text: str, where: str, *, what: str = "JSON", hint: str = "") -> Any:
    """Parse ``text`` (read from ``where``, a file name for messages) with the bounds above; a
    :class:`UserError` naming ``where`` (and the field) when a bound is passed or it is not JSON
    (``hint``: what was expected, added to that sentence)."""
    deepest = _depth(text)
    if deepest > MAX_DEPTH:
        raise UserError(f"{where}: nests more than {MAX_DEPTH} levels deep; not a {what} file this tool writes.")
    try:
        obj = json.loads(text, parse_int=_parse_int)
    except (json.JSONDecodeError, RecursionError, ValueError):
        raise UserError(f"{where}: is not JSON{hint}.") from None
    hit = _find_huge(obj, "")
    if hit is not None:
        field, digits = hit
        raise UserError(f"{where}: {field or 'the value'} holds an integer of {len(digits.lstrip('-'))} digits, beyond any "
                        f"count or size (at most {MAX_INT_DIGITS} digits, 2^63-1).")
    return obj


def read_bounded(path: str | Path, *, what: str = "JSON", hint: str = "") -> Any:
    """:func:`loads_bounded` of a UTF-8 file, refused before reading when larger than MAX_BYTES."""
    p = Path(path)
    size = p.stat().st_size
    if size > MAX_BYTES:
        raise UserError(f"{p}: is {size:,} bytes, far more than any {what} file (at most {MAX_BYTES >> 20} MiB).")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{p}: is not JSON{hint}.") from None
    return loads_bounded(text, str(p), what=what, hint=hint)
