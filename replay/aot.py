"""The plain LRU replay's kernels compiled ahead of time (``replay/_aot.c``), so a replay can run
without importing Numba (its import and cached machine code cost about 0.4 s a process).

``replay._aot`` holds C twins of :func:`replay.load_kernel.rows_ok`, :func:`replay.load_kernel.cut_loads`
and the driver :func:`replay.cache_kernel.make_kernel` compiles for ``lru`` (and ``layer``: the same
hooks) without what-ifs or per-slot codes; same arguments, same results, same bytes written
(``tests/test_aot_kernels.py`` demands exact agreement with the Numba kernels on random inputs).
It is an optional part of the install: where it was not built (no C compiler), is older than its
source, or is turned off, callers use the Numba kernels and get the same figures, later.

- :data:`AVAILABLE`: whether the compiled module can be used now;
- :func:`load`: the module, or None;
- :func:`why_unavailable`: one sentence saying why not, or None.

``MOE_REPLAY_AOT=0`` in the environment turns it off (read at each call, so a test can set it).
This module imports nothing heavy (no Numba, no NumPy): importing it costs about a millisecond.
"""

from __future__ import annotations

import os
from types import ModuleType

ENV = "MOE_REPLAY_AOT"

_mod: ModuleType | None = None
_why: str | None = None
_tried = False


def _import() -> None:
    global _mod, _why, _tried
    _tried = True
    try:
        from replay import _aot
    except ImportError as e:
        _why = (f"replay._aot is not built ({e}); reinstall moe-replay with a C compiler present "
                "(`pip install -e .` or `make`) to replay without Numba")
        return
    here = os.path.dirname(os.path.realpath(__file__))
    if os.path.dirname(os.path.realpath(_aot.__file__)) != here:
        # A tree with no build of its own, run with another checkout's editable install (PYTHONPATH
        # over a shared venv): its finder supplies that checkout's build, of that checkout's source.
        _why = (f"replay._aot was found at {_aot.__file__}, outside this replay package ({here}); build it here "
                "(`pip install -e .`) to replay without Numba")
        return
    if stale(os.path.join(here, "_aot.c"), _aot.__file__):
        _why = (f"{_aot.__file__} is older than replay/_aot.c; rebuild it (`make`, or `pip install -e .`) "
                "to replay without Numba")
        return
    _mod = _aot


def stale(source: str, built: str) -> bool:
    """Whether the build ``built`` is older than its ``source``. In a source tree (an editable
    install) a build that failed leaves the previous one in place: it would answer for code that
    changed, so it is refused. A wheel ships no source: nothing to compare, never stale."""
    try:
        return os.stat(source).st_mtime > os.stat(built).st_mtime
    except OSError:
        return False


def _off() -> bool:
    return os.environ.get(ENV, "").strip() == "0"


def load() -> ModuleType | None:
    """``replay._aot``, or None when it is not built, stale, or turned off by ``MOE_REPLAY_AOT=0``."""
    if _off():
        return None
    if not _tried:
        _import()
    return _mod


def why_unavailable() -> str | None:
    """Why :func:`load` returns None, in one sentence; None when it returns the module."""
    if _off():
        return f"the compiled kernels are turned off ({ENV}=0 in the environment)"
    if not _tried:
        _import()
    return _why


def __getattr__(name: str) -> bool:
    if name == "AVAILABLE":  # computed at each access: MOE_REPLAY_AOT may change after import
        return load() is not None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
