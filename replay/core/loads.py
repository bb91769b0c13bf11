"""Numba passes over one part's routing columns, as read from the file: check the row invariants
and cut the rows into loads, each in one pass with no temporaries (:func:`replay.core.simulate.iter_load_parts`).

- :func:`rows_ok` is a gate, not a judge: True means every invariant of
  :class:`traces.io.reader.RowChecker` holds for a trace without request, token or recorded columns
  (the checker's ``simple`` case); on False the caller runs the checker itself, which names the
  first bad row in its own words. So the sentence a user reads never comes from here, and a row
  this pass lets through is one the checker lets through (``tests/test_cache_stream.py`` corrupts
  parts and compares).
- :func:`cut_loads` is :func:`replay.core.simulate.prepare_loads` for rows whose batches come in order
  (every valid trace); on anything else (a layer that is not a MoE layer, an expert id out of
  range, batches out of order) it returns a nonzero status and the caller falls back to
  ``prepare_loads``, which refuses or handles it. ``tests/test_cache_stream.py`` checks that both
  give the same arrays.
"""

from __future__ import annotations

import numpy as np

from traces.util.jit import njit

CUT_OK, CUT_LAYER, CUT_EXPERT, CUT_UNSORTED = 0, 1, 2, 3


@njit(cache=True, nogil=True)
def rows_ok(batch, layer, step, phase, experts, weights, moe, n_expert, by_rank, has_last, last):
    """Whether the part's rows satisfy the row invariants, ``last`` = (batch, layer, step, phase)
    of the previous part's last row when ``has_last``."""
    R, k = experts.shape
    n_layer = moe.shape[0]
    pb, pl, ps, pp = last[0], last[1], last[2], last[3]
    for r in range(R):
        b, lay, s, p = np.int64(batch[r]), np.int64(layer[r]), np.int64(step[r]), np.int64(phase[r])
        if lay < 0 or lay >= n_layer or not moe[lay]:
            return False
        if p != 0 and p != 1:
            return False
        if r > 0 or has_last:
            if b < pb:
                return False
            if b == pb:
                if lay < pl or (lay == pl and s <= ps) or p != pp:
                    return False
        pb, pl, ps, pp = b, lay, s, p
        n_nan = 0
        for j in range(k):
            e = experts[r, j]
            if e < 0 or e >= n_expert:
                return False
            for i in range(j):
                if experts[r, i] == e:
                    return False
            w = weights[r, j]
            if np.isnan(w):
                n_nan += 1
            elif np.isinf(w) or w < 0:
                return False
            if by_rank and j > 0 and w > weights[r, j - 1]:
                return False
        if n_nan != 0 and n_nan != k:
            return False
    return True


@njit(cache=True, nogil=True)
def cut_loads(turn, batch, phase, step, layer, experts, lidx_of, n_expert, entries, load_start, load_lidx, load_phase,
              load_batch, batch_turn, batch_step, batch_phase, batch_tokens):
    """Write :func:`replay.core.simulate.prepare_loads`'s arrays into the given ones (each with room for
    one load and one batch per row, ``load_start`` one more; reused from part to part, so their
    pages are touched once per run, not once per part). Returns (status, loads, batches)."""
    R, k = experts.shape
    G = 0
    B = 0
    n_lay = lidx_of.shape[0]
    for r in range(R):
        lay = np.int64(layer[r])
        if lay < 0 or lay >= n_lay or lidx_of[lay] < 0:
            return 1, 0, 0
        li = np.int64(lidx_of[lay])
        new_batch = r == 0 or batch[r] != batch[r - 1]
        if r > 0 and batch[r] < batch[r - 1]:
            return 3, 0, 0
        if new_batch:
            batch_turn[B] = turn[r]
            batch_step[B] = step[r]
            batch_phase[B] = phase[r]
            batch_tokens[B] = 0
            B += 1
        if new_batch or layer[r] != layer[r - 1]:
            if G > 0:
                rows = r - load_start[G - 1]
                if rows > batch_tokens[load_batch[G - 1]]:
                    batch_tokens[load_batch[G - 1]] = rows
            load_start[G] = r
            load_lidx[G] = li
            load_phase[G] = phase[r]
            load_batch[G] = B - 1
            G += 1
        for j in range(k):
            e = np.int64(experts[r, j])
            if e < 0 or e >= n_expert:
                return 2, 0, 0
            entries[r, j] = np.int32(li * n_expert + e)
    if G > 0:
        rows = R - load_start[G - 1]
        if rows > batch_tokens[load_batch[G - 1]]:
            batch_tokens[load_batch[G - 1]] = rows
    load_start[G] = R
    return 0, G, B

