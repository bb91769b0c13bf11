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
This module imports nothing heavy (no Numba, no NumPy): importing it costs about a millisecond. The
import, location and staleness checks are :class:`traces.compiled.Extension`'s (shared with
:mod:`traces.pq_native`).
"""

from __future__ import annotations

from traces.compiled import ENV, Extension, stale

__all__ = ["ENV", "load", "stale", "why_unavailable"]  # and AVAILABLE (module __getattr__)

_EXT = Extension("replay._aot", "replay/_aot.c", purpose="to replay without Numba", what="the compiled kernels are")


load = _EXT.load  # the module, or None when it is not built, stale, or turned off by MOE_REPLAY_AOT=0
why_unavailable = _EXT.why_unavailable  # why load() returns None, in one sentence; None when it returns the module
__getattr__ = _EXT.module_getattr(__name__)  # AVAILABLE
