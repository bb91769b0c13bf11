"""``random`` (seeded): evict a pseudo-random evictable entry.

Each eviction draws, for every candidate, key = splitmix64(seed * 2^32 + n * 2^20 + entry) >> 1 with
n = evictions done so far in this replay (all groups), and evicts the smallest key (ties, which
need a hash collision, to the least recently used). Defined this way the choice does not depend
on any data-structure order, so a replay is reproducible from the seed alone.
"""

from __future__ import annotations

import numpy as np
from numba import njit, uint64

from replay.policies._scan import make_pick_victim, no_op
from traces.util.jit import resolve

resolve()  # this module compiles with Numba itself: the lazy stand-ins (traces.util.jit) become dispatchers, the compile notice listens

PARTITION = "global"
UNBOUNDED = False
NEEDS_NEXT_USE = False
NEEDS_LAST_LOAD = False
NEEDS_RESIDENT_LIST = True
NEEDS_FREQ = False

MASK64 = (1 << 64) - 1


def init(ent: np.ndarray, grp: np.ndarray, seed: int) -> np.ndarray:
    """ps[0] = [seed, evictions so far]."""
    return np.array([[seed, 0]], dtype=np.int64)


@njit(cache=True, inline="always")
def splitmix64(x):
    z = uint64(x) + uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> uint64(30))) * uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> uint64(27))) * uint64(0x94D049BB133111EB)
    return z ^ (z >> uint64(31))


@njit(cache=True, inline="always")
def key(ps, ent, e, load):
    x = (uint64(ps[0, 0]) << uint64(32)) + (uint64(ps[0, 1]) << uint64(20)) + uint64(e)
    return np.int64(splitmix64(x) >> uint64(1))


on_admit = no_op
on_touch = no_op
pick_victim = make_pick_victim(key)


@njit(cache=True, inline="always")
def on_evict(ps, ent, grp, g, e):
    ps[0, 1] += 1
