"""Units and phase codes, defined once for the whole distribution.

- :data:`MIB`: bytes in one MiB (2^20), an int: multiply MiB by it for bytes, divide bytes by it
  for MiB (Python's ``/`` gives a float either way, exactly rounded).
- :data:`PHASE_PREFILL` / :data:`PHASE_DECODE`: the ``phase`` column's codes (0 prompt, 1 decode).

Budgets are parsed here on purpose, not by a units library: those read "4GB" as a decimal unit,
and a budget refuses decimal units (:func:`parse_budget_mib`) rather than guess.
"""

import math
import re

MIB = 1 << 20
PHASE_PREFILL = 0
PHASE_DECODE = 1

#: The largest budget any trace could need: 2^40 MiB (1 EiB); larger is a typo, not a cache.
MAX_BUDGET_MIB = float(1 << 40)
# Binary units a budget may carry, in MiB. Decimal ones (MB, GB) are refused, not guessed: a
# "4GB" budget read as 4000 MiB or as 4096 MiB would move every hit rate.
_BUDGET_UNITS = {"": 1.0, "kib": 1.0 / 1024, "mib": 1.0, "gib": 1024.0, "tib": 1024.0 * 1024.0}
_BUDGET = re.compile(r"\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*")


def exact(v: object) -> str:
    """A parameter as given: shortest round-trip form, integers without '.0' (0.25 -> '0.25', 4000.0 -> '4000')."""
    if isinstance(v, float) and math.isfinite(v):
        return str(int(v)) if v.is_integer() and abs(v) < 1e15 else repr(v)
    return str(v)


def check_budget_mib(value: object, what: str = "budget") -> float:
    """``value`` (MiB) as a float if it is a positive, finite number of MiB up to :data:`MAX_BUDGET_MIB`;
    else one sentence naming ``what`` (the option or keyword it came from)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _budget_error(what, f"{value!r} is not a number of MiB")
    v = float(value)
    if not math.isfinite(v) or v <= 0:
        raise _budget_error(what, f"{exact(v)!r} is not a positive number of MiB")
    if v > MAX_BUDGET_MIB:
        raise _budget_error(what, f"{exact(v)} MiB is beyond any trace (a budget is at most 2^40 MiB, 1 EiB)")
    if v * MIB < 1:  # floors to 0 bytes: the budget 0, which is refused, under another spelling
        raise _budget_error(what, f"{exact(v)} MiB is less than one byte (a budget holds at least 1 byte)")
    return v


def budget_bytes(budget_mib: float) -> int:
    """A budget in MiB as bytes (floor), checked as every budget is (:func:`check_budget_mib`)."""
    return int(math.floor(check_budget_mib(budget_mib, "budget") * MIB))


def parse_budget_mib(text: str | float | int, what: str = "budget") -> float:
    """One budget in MiB from ``4000``, ``4000MiB``, ``4GiB``, ``1.5GiB``, ``512KiB`` or ``1TiB``
    (binary units, case-insensitive; a bare number is MiB); a number is checked as is. Exact: 1.5GiB
    is 1536.0 MiB. Anything else is one sentence naming ``what``."""
    if not isinstance(text, str):
        return check_budget_mib(text, what)
    m = _BUDGET.fullmatch(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _BUDGET_UNITS:
        if unit in ("kb", "mb", "gb", "tb", "k", "m", "g", "t"):
            raise _budget_error(what, f"{text.strip()!r}: decimal units are ambiguous; give MiB or GiB (4000MiB, 4GiB, 1.5GiB)")
        raise _budget_error(what, f"{text.strip()!r} is not a number of MiB, nor a size with a binary unit "
                                  "(4000, 4000MiB, 4GiB, 1.5GiB)")
    v = float(m.group(1)) * _BUDGET_UNITS[unit]
    if not v > 0:
        raise _budget_error(what, f"{text.strip()!r} is not a positive number of MiB")
    return check_budget_mib(v, what)


def parse_budgets_mib(text: str, what: str = "--budgets") -> list[float]:
    """Comma-separated budgets (each as :func:`parse_budget_mib` reads it), distinct, in the order given."""
    out: list[float] = []
    for tok in text.split(","):
        if tok.strip():
            v = parse_budget_mib(tok, what)
            if v not in out:
                out.append(v)
    if not out:
        raise _budget_error(what, "no budget given")
    return out


def _budget_error(what: str, problem: str) -> Exception:
    from traces.format.errors import UserError

    return UserError(f"{what}: {problem}.")
