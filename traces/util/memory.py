"""Refuse work whose arrays cannot fit in memory, before allocating any of them.

A size read from a file or an option (``n_expert`` 1e9 from an import, ``synth --layers
1000000``) must not reach ``np.zeros``: the allocation either fails with a MemoryError (called a
bug) or, under overcommit, succeeds and the machine swaps for minutes. Callers estimate the bytes
their arrays will take and call :func:`check_fits` first; the refusal names what is at fault and
the GiB it would need.
"""

from __future__ import annotations

from traces.format.errors import UserError

GIB = 1 << 30


def available_bytes() -> int:
    """Memory the system can hand out now without swapping (psutil's ``available``)."""
    import psutil

    return int(psutil.virtual_memory().available)


def check_fits(nbytes: int | float, what: str) -> None:
    """Raise :class:`UserError` when ``nbytes`` exceed the memory available now.

    ``what`` is the start of the sentence: the file or option at fault and what it would allocate,
    e.g. ``"TRACE/trace.json: n_expert 1000000000 x 48 MoE layers (the replay's cache state)"``.
    """
    avail = available_bytes()
    if nbytes > avail:
        raise UserError(f"{what} would need {nbytes / GIB:,.1f} GiB of memory, more than the "
                        f"{avail / GIB:,.1f} GiB available.")
