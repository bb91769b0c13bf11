"""The strict Parquet column-chunk reader compiled ahead of time (``traces/_pq.c``), so a plain
replay can read a trace's routing columns without importing NumPy or pyarrow (their import costs
about 0.3 s a process, half of a fast ``cache --json`` run).

``traces._pq`` exports:

- ``read_chunk(fd, offset, size, codec, physical, max_rep, max_def, width, rows, out) -> int``:
  reads the column chunk at bytes ``[offset, offset + size)`` of the open descriptor ``fd`` (pread:
  the file position is untouched) and writes its ``rows * max(width, 1)`` values into ``out``, a
  writable C-contiguous buffer of exactly that many elements whose struct format names the output
  type (``b h i l q f d``; an INT32 column may be narrowed to int8 / int16, every value must fit).
  ``codec`` / ``physical`` are Parquet's CompressionCodec / Type enums (0 or 6 = zstd; 1 INT32,
  2 INT64, 4 FLOAT, 5 DOUBLE); ``max_rep, max_def, width`` are ``0, 0, 0`` for a required scalar,
  ``1, 2, k`` for a non-null ``fixed_size_list<T>[k]`` as pyarrow writes it. Returns 0 when every
  value was written, else a positive status: the chunk is not one it understands (a dictionary, a
  codec other than zstd, a null, a ragged list, a corrupt page...): read it with pyarrow, which
  reads it or names the problem. The GIL is released while it reads and decodes.
- ``STATUS``: one short reason per status (``STATUS[0] == "ok"``).
- ``zstd_version() -> str | None``: the libzstd it loaded at run time (None: zstd chunks refused).

Through this module:

- :data:`AVAILABLE`: whether the compiled reader can be used now;
- :func:`load`: the module, or None (not built, built elsewhere, older than its source, or turned
  off by ``MOE_REPLAY_AOT=0`` in the environment, read at each call);
- :func:`why_unavailable`: one sentence saying why not, or None.

Standard library only (no NumPy, no pyarrow): importing it costs about a millisecond.
"""

from __future__ import annotations

from traces.compiled import Extension

__all__ = ["load", "why_unavailable"]  # and AVAILABLE (module __getattr__)

_EXT = Extension("traces._pq", "traces/_pq.c", purpose="to read routing columns without pyarrow",
                 what="the compiled Parquet reader is")


load = _EXT.load  # the module, or None when it is not built, stale, or turned off by MOE_REPLAY_AOT=0
why_unavailable = _EXT.why_unavailable  # why load() returns None, in one sentence; None when it returns the module
__getattr__ = _EXT.module_getattr(__name__)  # AVAILABLE
