"""One Numba pass over one part's routing columns, as read from the file: check the row
invariants and cut the rows into loads, fused (:func:`replay.core.simulate.iter_load_parts`,
:func:`replay.core.simulate.loads_of`): each column is read once, and the loads are written straight into
the arrays the replay reads (the whole trace's, for ``loads_of``), with no temporaries.

- The row check is a gate, not a judge: with ``check`` set, :data:`CUT_ROWS` means some row breaks an
  invariant of :class:`traces.io.reader.RowChecker` for a trace without request, token or recorded
  columns (the checker's ``simple`` case); the caller then runs the checker itself, which names the
  first bad row in its own words (or, where the gate is stricter, finds nothing, and the caller
  cuts again without the gate). The step rules of such a trace (one request: ``step`` >= 0, and at
  each layer a token after the layer's previous one, from batch to batch and part to part) are
  gated too, in ``lay_last`` [n_layer, 2] (each layer's last step and turn, step -1 for none yet),
  which the caller carries from call to call (a call that does not return :data:`CUT_OK` may have
  written part of it: the caller keeps a copy). So the sentence
  a user reads never comes from here, and a row this pass lets through is one the checker lets
  through (``tests/test_cache_stream.py`` corrupts parts and compares; ``tests/test_kernel_parts.py`` draws corruptions).
- The cut is :func:`replay.core.simulate.prepare_loads` for rows whose batches come in order (every valid
  trace), continued across calls: the load (and batch) the previous call ended with goes on
  while the rows keep its (batch, layer). On anything else (a layer that is not a MoE layer, an
  expert id out of range, batches out of order, a batch of both phases) it returns a nonzero status and the caller falls
  back to ``prepare_loads``, which refuses or handles it. ``tests/test_kernel_parts.py`` checks that
  both give the same arrays.
"""

from __future__ import annotations

import numpy as np

from traces.util.jit import njit

CUT_OK, CUT_LAYER, CUT_EXPERT, CUT_UNSORTED, CUT_ROWS, CUT_PHASE = 0, 1, 2, 3, 4, 5
# at[]: where a call starts and, after a call that returned CUT_OK, where the next one starts:
# rows, loads and batches already in the output arrays (a call writes after them; with loads > 0
# the last load and batch may go on), and the key (batch, layer, step, phase) of the row before
# this call's first (read by the check only when AT_HAS_LAST, by the cut only when AT_LOADS > 0).
AT_ROWS, AT_LOADS, AT_BATCHES, AT_HAS_LAST, AT_BATCH, AT_LAYER, AT_STEP, AT_PHASE = range(8)
N_AT = 8


def new_at() -> np.ndarray:
    """``at`` for a first call: nothing written yet, no row before."""
    return np.zeros(N_AT, np.int64)


def new_lay_last(n_layer: int) -> np.ndarray:
    """``lay_last`` for a first call: no layer has a step yet."""
    return np.full((n_layer, 2), -1, np.int64)


@njit(cache=True, nogil=True)
def cut_loads(turn, batch, phase, step, layer, experts, weights, lidx_of, n_expert, check, moe, by_rank, lay_last, at, entries,
              load_start, load_lidx, batch_start, batch_turn, batch_step, batch_phase, batch_tokens):
    """Check (when ``check``) and cut the rows, writing :func:`replay.core.simulate.prepare_loads`'s arrays
    into the given ones after what ``at`` says they already hold (each with room for one load and
    one batch per row more, ``load_start`` and ``batch_start`` one more still). Returns the status;
    on :data:`CUT_OK` ``at`` is advanced (``load_start[at[AT_LOADS]]`` = rows so far closes the
    last load, ``batch_start[at[AT_BATCHES]]`` = loads so far the last batch), on any other status
    ``at`` is left as it was (the caller may call again from the same place). A batch's loads are
    consecutive, so the open load's batch is always the last one (``at[AT_BATCHES] - 1``).

    ``weights`` [R, k] (C-contiguous) and ``lay_last`` [n_layer, 2] int64 are read only when ``check``; ``moe``
    [n_layer] bool: the check's MoE layers;
    ``lidx_of`` [max MoE layer + 1]: each layer's MoE index, -1 for a dense one (the same layers as
    ``moe``: with the gate on, the cut does not test again what the gate tested)."""
    R, k = experts.shape
    n_lay = lidx_of.shape[0]
    n_layer = moe.shape[0]
    r0 = at[AT_ROWS]
    G = at[AT_LOADS]
    B = at[AT_BATCHES]
    has_last = at[AT_HAS_LAST] != 0
    pb, pl, ps, pp = at[AT_BATCH], at[AT_LAYER], at[AT_STEP], at[AT_PHASE]
    # The open load's first row and its batch's token count live in registers, written back once
    # per batch (not read back from the arrays at every load: one load per row at top-1 decode).
    cur_start = load_start[G - 1] if G > 0 else r0
    tokens = batch_tokens[B - 1] if G > 0 else 0
    if check:
        # Each weight's own rule (>= 0 and finite, or NaN) in a pass of its own over the part's weights,
        # with no exit inside (a vectorised loop: ~0.5 ns a weight instead of ~2 in the row loop, where
        # the branches cost); the rules across a row's weights stay in the row loop (top_k > 1 only).
        # Nothing is written before it: a part it stops leaves ``at`` and ``lay_last`` as they were.
        weights_f = weights.reshape(weights.size)  # C-contiguous (the caller's)
        bad_weight = False
        for i in range(weights_f.shape[0]):
            w = weights_f[i]
            bad_weight |= (w == w) & ((w < 0) | (w >= np.inf))  # not NaN, and negative or infinite
        if bad_weight:
            return CUT_ROWS
    for r in range(R):
        b, lay, s, p = np.int64(batch[r]), np.int64(layer[r]), np.int64(step[r]), np.int64(phase[r])
        if check:
            if lay < 0 or lay >= n_layer or not moe[lay] or (p != 0 and p != 1) or s < 0:
                return CUT_ROWS
            # The step rules (RowChecker's, for one request): at each layer, a token after the
            # layer's previous one (a later step in the same turn, or a later turn).
            tu = np.int64(turn[r])
            last_s = lay_last[lay, 0]
            if last_s >= 0:
                last_t = lay_last[lay, 1]
                if not (tu > last_t or (tu == last_t and s > last_s)):
                    return CUT_ROWS
            lay_last[lay, 0] = s
            lay_last[lay, 1] = tu
            if has_last:
                if b < pb:
                    return CUT_ROWS
                if b == pb and (lay < pl or (lay == pl and s <= ps) or p != pp):
                    return CUT_ROWS
            n_nan = 0
            for j in range(k):
                e = experts[r, j]
                if e < 0 or e >= n_expert:
                    return CUT_ROWS
                for i in range(j):
                    if experts[r, i] == e:
                        return CUT_ROWS
                if k > 1:  # at top-1 a row's one weight has no rule beyond its own
                    w = weights[r, j]
                    if w != w:
                        n_nan += 1
                    if by_rank and j > 0 and w > weights[r, j - 1]:
                        return CUT_ROWS
            if n_nan != 0 and n_nan != k:
                return CUT_ROWS
        elif lay < 0 or lay >= n_lay or lidx_of[lay] < 0:  # the gate found these already
            return CUT_LAYER
        li = np.int64(lidx_of[lay])
        go_on = G > 0 and (r > 0 or has_last)  # a load and a batch before this row, in these arrays
        if go_on and b < pb:
            return CUT_UNSORTED
        new_batch = not go_on or b != pb
        if not new_batch and p != pp:  # the gate refuses it first; a load's phase is its batch's
            return CUT_PHASE
        new_load = new_batch or lay != pl
        if new_load and G > 0:
            rows = r0 + r - cur_start
            if rows > tokens:
                tokens = rows
        if new_batch:
            if G > 0:
                batch_tokens[B - 1] = tokens
            batch_start[B] = G
            batch_turn[B] = turn[r]
            batch_step[B] = s
            batch_phase[B] = p
            tokens = 0
            B += 1
        if new_load:
            cur_start = r0 + r
            load_start[G] = cur_start
            load_lidx[G] = li
            G += 1
        for j in range(k):
            e = np.int64(experts[r, j])
            if not check and (e < 0 or e >= n_expert):
                return CUT_EXPERT
            entries[r0 + r, j] = np.int32(li * n_expert + e)
        pb, pl, ps, pp = b, lay, s, p
        has_last = True
    if G > 0:
        rows = r0 + R - cur_start
        if rows > tokens:
            tokens = rows
        batch_tokens[B - 1] = tokens
    load_start[G] = r0 + R
    batch_start[B] = G
    at[AT_ROWS] = r0 + R
    at[AT_LOADS] = G
    at[AT_BATCHES] = B
    at[AT_HAS_LAST] = 1 if has_last else 0
    at[AT_BATCH], at[AT_LAYER], at[AT_STEP], at[AT_PHASE] = pb, pl, ps, pp
    return CUT_OK
