"""Time with overlap: a per-token timeline of expert reads on read lanes, and compute.

The linear cost model (:mod:`replay.analyses.cost_model`) maps bytes to time with no overlap, so a
speculative byte can only add time. An engine overlaps reads with compute on several read lanes;
whether a prefetch pays then depends on whether the lanes sit idle during compute, how early a guess
is made and how many guesses are wrong. This module times one replay (docs/design.md, "Timeline").

Per decoded token (a decode batch; one token in a single-request trace), per MoE layer in order:

- the layer starts when the previous layer's compute ends (the token's first layer: when the
  previous token ended). Its compute, ``compute_ms_per_layer``, is two parts: the work before the
  router (attention, the router itself: a share ``1 - expert_share``), after which the layer's
  experts are known, and the expert work (``expert_share``), which can run while the layer's own
  reads arrive (the resident experts first);
- when the router has run the layer's demand reads are issued (the misses the cache replay
  produced, one read per missed expert, a repeat inside the load read once), each on the read lane
  that frees first (lowest lane on a tie), starting when that lane is free: a read takes
  ``read_latency_ms + MiB x 1000 / lane_mib_s``;
- speculative reads (the fills the prefetch replay made: driver ``FILL_READ``) are issued when
  their predictor could issue them: at the token's start for a predictor that needs nothing of the
  token (``prev-token``, the static lists: module constant ``ISSUE = "token"``, the default), or
  when layer l - d's router has run for a guess for layer l made from layer l - d's gate input
  (``stale-gate[d]``: ``ISSUE = "layer"``), after that layer's own demand reads; they queue on the
  same lanes;
- with ``overlap`` on, the layer ends at the later of (router time + expert work) and the arrival
  of its last demand read or used guess; the difference is its stall. A guess that arrives after
  the router has run is *late*: the layer waits only for the rest of its transfer, less than a miss
  would cost. With ``overlap`` off (serial) a layer's compute starts only when every lane is idle,
  no read runs while it computes, and its expert work starts when its reads are all in;
- the token ends ``token_overhead_ms + serial_ms_per_mib x MiB`` (every byte the token issued,
  demand and speculative: CPU-side management that does not overlap) after its last layer.

Read lanes carry over from token to token: a read still in flight at a token's end delays the
next token's reads. Prefill is not timed: its loads still consume or discard pending guesses, and
a guess read in prefill (none from the built-in predictors, whose guesses are for decode) takes
no lane time and counts as arrived at time 0, when the decode timeline starts.

Speculative bytes are *useful* (the guess was demanded while still cached: a speculative hit of the
replay), *late* (useful but arrived after the router of the layer that used it had run: part of the
useful bytes) or *wasted* (evicted unused, or unused at the end). Lead time of a useful guess: the
time from its arrival to that router time (negative when late).

What the model does not see: compute that varies by token (thermal state, page faults), reads
other than experts', the order an engine really issues reads in, bandwidth that falls with queue
depth. :mod:`replay.analyses.timeline_fit` fits its parameters on a run's recorded metrics and says
how far off it is on held-out tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from replay.core.driver import FILL_READ
from traces.util.jit import njit
from traces.util.units import MIB

# tok[:, c]: per timed decode batch
T_WALL, T_STALL, T_COMPUTE, T_IO, T_DEMAND_BYTES, T_SPEC_BYTES, T_START = 0, 1, 2, 3, 4, 5, 6
N_TOK = 7
# fill status
F_WASTED, F_USEFUL, F_LATE, F_UNTIMED = 0, 1, 2, 3


@dataclass(frozen=True)
class Profile:
    """A device: read lanes, each ``lane_mib_s`` MiB/s after ``read_latency_ms`` per read; compute
    per MoE layer per decode step; serial per-token costs; reads overlapping compute or not."""

    lanes: int
    lane_mib_s: float
    read_latency_ms: float
    compute_ms_per_layer: float
    overlap: bool = True
    expert_share: float = 0.0
    token_overhead_ms: float = 0.0
    serial_ms_per_mib: float = 0.0
    name: str = "profile"
    source: str = "given"  # "preset" | "file" | "fitted" | "given"

    def row(self) -> dict:
        return {"profile": self.name, "profile_source": self.source, "lanes": self.lanes, "lane_mib_s": self.lane_mib_s,
                "read_latency_ms": self.read_latency_ms, "compute_ms_per_layer": self.compute_ms_per_layer,
                "overlap": self.overlap, "expert_share": self.expert_share, "token_overhead_ms": self.token_overhead_ms,
                "serial_ms_per_mib": self.serial_ms_per_mib}


def kernel_params(p: Profile) -> np.ndarray:
    """The kernel's float parameters, computed once (the naive twin uses the same numbers):
    [latency ms, ms per byte on a lane, compute ms per layer, token overhead ms, serial ms per byte,
    compute before the router, expert compute] (ms)."""
    return np.array([p.read_latency_ms, (1000.0 / p.lane_mib_s) / MIB, p.compute_ms_per_layer, p.token_overhead_ms,
                     p.serial_ms_per_mib / MIB, p.compute_ms_per_layer * (1.0 - p.expert_share),
                     p.compute_ms_per_layer * p.expert_share], np.float64)


@njit(cache=True, nogil=True)
def _on_lane(free, start, d):
    """A read of ``d`` ms on the lane free first (the lowest-numbered of equals), not before
    ``start``: books the lane and returns when the read is done."""
    ln = 0
    for x in range(1, free.shape[0]):
        if free[x] < free[ln]:
            ln = x
    st = free[ln] if free[ln] > start else start
    free[ln] = st + d
    return st + d


@njit(cache=True, nogil=True)
def _issue(u, nb, start, load_start, fills, pred, pending, f_bytes, f_arrive, free, lat, per_byte, nf, timed, io):
    """Issue the speculative reads the replay made for load ``u`` (entries of ``nb`` bytes), in row
    and rank order, each on the lane free first, not before ``start``; record each as fill ``nf``,
    ``nf + 1``, ... Returns (the next fill index, ``io`` + the lane ms, bytes) of what was timed:
    each read's ms is added to the token's running ``io`` in turn, as every other read is (a
    partial sum added at once rounds differently: 750.1999999999999 against 750.2)."""
    spec_b = np.int64(0)
    for rp in range(load_start[u], load_start[u + 1]):
        for jp in range(pred.shape[1]):
            if fills[rp, jp] == FILL_READ:
                pending[pred[rp, jp]] = nf
                f_bytes[nf] = nb
                if timed:
                    d = lat + nb * per_byte
                    f_arrive[nf] = _on_lane(free, start, d)
                    io += d
                    spec_b += nb
                nf += 1
    return nf, io, spec_b


@njit(cache=True, nogil=True)
def timeline_kernel(entries, load_start, load_lidx, load_batch, batch_phase, slots, pred, fills, layer_bytes,
                    n_ent, issue_ahead, lanes, overlap, par):
    """Time the decode batches of one replay (module docstring). ``slots`` [R, k] the replay's
    residency codes (0 miss, 1 hit, 2 speculative hit, 3 dropped); ``pred``/``fills`` [R, w] the
    predictions and what the speculative step did with each (0 rows: no prefetch);
    ``issue_ahead``: 0 = speculative reads issued at the token's start, d >= 1 = at the start of
    the layer d before their target. Returns (tok [decode batches, N_TOK], fill_status [F] int8,
    fill_bytes [F] int64, fill_lead_ms [F], read_ms_total)."""
    lat = par[0]
    per_byte = par[1]
    comp = par[2]
    overhead = par[3]
    serial_per_byte = par[4]
    pre = par[5]
    post = par[6]
    n_load = load_start.shape[0] - 1
    n_batch = batch_phase.shape[0]
    k = entries.shape[1]
    w = pred.shape[1]
    has_fills = fills.shape[0] > 0
    n_fill = 0
    if has_fills:
        for r in range(fills.shape[0]):
            for j in range(w):
                if fills[r, j] == FILL_READ:
                    n_fill += 1
    n_dec = 0
    for b in range(n_batch):
        if batch_phase[b] == 1:
            n_dec += 1
    tok = np.zeros((n_dec, 7), np.float64)
    f_status = np.zeros(n_fill, np.int8)
    f_bytes = np.zeros(n_fill, np.int64)
    f_arrive = np.zeros(n_fill, np.float64)
    f_lead = np.full(n_fill, np.nan)
    pending = np.full(n_ent, -1, np.int64)
    seen = np.full(n_ent, -1, np.int64)
    free = np.zeros(lanes, np.float64)
    now = 0.0
    read_total = 0.0
    nf = 0
    ti = -1
    li = 0
    while li < n_load:
        b = load_batch[li]
        hi = li
        while hi < n_load and load_batch[hi] == b:
            hi += 1
        timed = batch_phase[b] == 1
        tok_start = now
        io = 0.0
        dem_b = np.int64(0)
        spec_b = np.int64(0)
        stall = 0.0
        compute = 0.0
        if timed:
            ti += 1
        if has_fills and issue_ahead == 0:
            for t in range(li, hi):
                nf, io, d_b = _issue(t, layer_bytes[load_lidx[t]], tok_start, load_start, fills, pred, pending, f_bytes,
                                     f_arrive, free, lat, per_byte, nf, timed, io)
                spec_b += d_b
        for t in range(li, hi):
            lid = load_lidx[t]
            nb = layer_bytes[lid]
            start = now
            s2 = start
            a = start
            if timed:
                if not overlap:  # serial: the layer's compute starts on idle lanes, and no read runs while it computes
                    for x in range(lanes):
                        if free[x] > s2:
                            s2 = free[x]
                a = s2 + pre  # the router has run: the layer's experts are known and asked for
                if not overlap:
                    for x in range(lanes):
                        if free[x] < a:
                            free[x] = a
            need = a
            for r in range(load_start[t], load_start[t + 1]):
                for j in range(k):
                    e = entries[r, j]
                    code = slots[r, j]
                    if code == 3 or seen[e] == t:
                        continue
                    seen[e] = t
                    f = pending[e]
                    if code == 2 and f >= 0:
                        pending[e] = -1
                        if not timed:
                            f_status[f] = F_UNTIMED
                            continue
                        f_lead[f] = a - f_arrive[f]
                        if f_arrive[f] > a:
                            f_status[f] = F_LATE
                            if f_arrive[f] > need:
                                need = f_arrive[f]
                        else:
                            f_status[f] = F_USEFUL
                        continue
                    if f >= 0:
                        pending[e] = -1  # evicted before this demand: the guess was wasted (status stays F_WASTED)
                    if code == 0 and timed:
                        d = lat + nb * per_byte
                        done = _on_lane(free, a, d)
                        io += d
                        dem_b += nb
                        if done > need:
                            need = done
            if has_fills and issue_ahead > 0:
                u = t + issue_ahead
                if u < hi and load_lidx[u] == lid + issue_ahead:
                    nf, io, d_b = _issue(u, layer_bytes[load_lidx[u]], a, load_start, fills, pred, pending, f_bytes,
                                         f_arrive, free, lat, per_byte, nf, timed, io)
                    spec_b += d_b
            if not timed:
                continue
            if overlap:
                x0 = a + post  # the expert work runs while the layer's reads arrive; it ends no earlier than they do
                end = x0 if x0 >= need else need
                stall += end - x0
            else:
                ready = need
                for x in range(lanes):
                    if free[x] > ready:
                        ready = free[x]
                stall += (s2 - start) + (ready - a)
                end = ready + post
                for x in range(lanes):
                    if free[x] < end:
                        free[x] = end
            now = end
            compute += comp
        if timed:
            now = now + (overhead + (dem_b + spec_b) * serial_per_byte)
            if not overlap:
                for x in range(lanes):
                    if free[x] < now:
                        free[x] = now
            tok[ti, 0] = now - tok_start
            tok[ti, 1] = stall
            tok[ti, 2] = compute
            tok[ti, 3] = io
            tok[ti, 4] = dem_b
            tok[ti, 5] = spec_b
            tok[ti, 6] = tok_start
            read_total += io
        li = hi
    return tok, f_status, f_bytes, f_lead, read_total


def issue_ahead_of(predictor: str, ahead: int) -> int:
    """0 when the predictor's guesses exist at the token's start (module constant ``ISSUE`` =
    "token", the default), else ``ahead`` (``ISSUE`` = "layer": made from layer l - d's gate input)."""
    from replay import predictors as registry

    fam, _ = registry.parse_predictor(predictor)
    return ahead if getattr(registry.module(fam), "ISSUE", "token") == "layer" else 0


@dataclass
class Timeline:
    """One replay timed: per timed decode batch ``tok`` [n, N_TOK], per speculative read its status,
    bytes and lead ms; and run totals (:meth:`summary`)."""

    tok: np.ndarray
    fill_status: np.ndarray
    fill_bytes: np.ndarray
    fill_lead_ms: np.ndarray
    read_ms_total: float
    lanes: int
    tokens: np.ndarray  # tokens of each timed batch (1 for a single request)

    @property
    def ms_per_batch(self) -> np.ndarray:
        return self.tok[:, T_WALL]

    def summary(self) -> dict:
        n_tok = int(self.tokens.sum())
        wall = float(self.tok[:, T_WALL].sum())
        st = self.fill_status
        useful = (st == F_USEFUL) | (st == F_LATE) | (st == F_UNTIMED)
        late = st == F_LATE
        timed_useful = (st == F_USEFUL) | late
        lead = self.fill_lead_ms[timed_useful]
        return {
            "ms_per_token": wall / n_tok if n_tok else None,
            "tok_s": 1000.0 * n_tok / wall if wall > 0 else None,
            "stall_ms_per_token": float(self.tok[:, T_STALL].sum()) / n_tok if n_tok else None,
            "compute_ms_per_token": float(self.tok[:, T_COMPUTE].sum()) / n_tok if n_tok else None,
            "lane_busy_pct": 100.0 * self.read_ms_total / (self.lanes * wall) if wall > 0 else None,
            "demand_mib": float(self.tok[:, T_DEMAND_BYTES].sum()) / MIB,
            "spec_mib": float(self.tok[:, T_SPEC_BYTES].sum()) / MIB,
            "useful_mib": float(self.fill_bytes[useful].sum()) / MIB,
            "late_mib": float(self.fill_bytes[late].sum()) / MIB,
            "wasted_mib": float(self.fill_bytes[st == F_WASTED].sum()) / MIB,
            "useful_lead_ms_mean": float(lead.mean()) if lead.size else None,
            "tokens_decode": n_tok,
        }


def time_replay(loads, res, profile: Profile, pred: np.ndarray | None = None, issue_ahead: int = 0) -> Timeline:
    """Time ``res`` (a replay of ``loads`` with ``slots=True``; for a prefetch replay also
    ``fills=True`` and its ``pred``) on ``profile``."""
    if res.slots is None:
        raise ValueError("time_replay needs a replay with slots=True")
    if res.fills is not None and pred is None:
        raise ValueError("a prefetch replay's fills need their predictions")
    p = np.ascontiguousarray(pred, np.int32) if res.fills is not None else np.zeros((0, 1), np.int32)
    f = res.fills if res.fills is not None else np.zeros((0, 1), np.int8)
    tok, fs, fb, fl, total = timeline_kernel(loads.entries, loads.load_start, loads.load_lidx, loads.load_batch,
                                            loads.batch_phase, res.slots, p, f, loads.layer_expert_bytes.astype(np.int64),
                                            int(loads.n_entries), int(issue_ahead), int(profile.lanes), bool(profile.overlap),
                                            kernel_params(profile))
    bt = loads.batch_tokens[loads.batch_phase == 1] if loads.batch_tokens is not None else np.ones(tok.shape[0], np.int64)
    return Timeline(tok, fs, fb, fl, float(total), int(profile.lanes), np.asarray(bt, np.int64))
