"""Bit counting for the Numba kernels that keep recency as occupancy bitmasks (one bit per visit
position): :func:`popcount64` counts a 64-bit word's set bits.

Numba has no popcount of its own; this is the classic SWAR sum (pairs, nibbles, bytes, then one
multiply), which LLVM recognises and emits as the CPU's single ``popcnt`` instruction where the
host has one (checked with ``inspect_asm`` on the 2-core AMD EPYC of benchmarks/RESULTS.md), and
which stays exact where it does not.
"""

from __future__ import annotations

import numpy as np

from traces.util.jit import njit


@njit(cache=True, inline="always")
def popcount64(x):
    """The number of set bits of ``x`` (uint64), as int64."""
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return np.int64((x * np.uint64(0x0101010101010101)) >> np.uint64(56))
