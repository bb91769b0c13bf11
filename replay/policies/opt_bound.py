"""``opt-bound``: a true upper bound on the hits of any replay at a byte budget, valid when expert
sizes differ (``belady``'s furthest-next-use rule is then a heuristic, not a bound). It is the
linear-programming relaxation of the offline optimum, solved exactly as a min-cost flow: the
flow-based offline optimum's lower bound on misses (FOO-L) of Berger, Beckmann and Harchol-Balter,
"Practical Bounds on Optimal Caching with Variable Object Sizes" (SIGMETRICS 2018), adapted to
loads whose experts are read together. A bound (``BOUND``), never an online candidate; it runs no
eviction policy, so it is not replayed by the driver: :func:`solve` computes its figures.

What is bounded. The class P of replays this tool runs without a what-if: the cache starts empty;
after load t (docs/design.md, "Replay semantics") the resident set S_t holds the load's unique
entries U_t, every other member was resident after load t - 1 (entries only enter on demand), and
either bytes(S_t) <= budget C or S_t = U_t (the load overflowed: nothing but its own entries is
left, as the driver leaves a global policy that found nothing left to evict). Every global
policy's replay is in P, within budget or not, and so is every cell of any policy that never
overflowed (a per-layer partition's shares sum to at most C). Outside P: ``pin`` and ``colibri``
(their preloaded entries are resident before their first lookup), over-budget cells of the
per-layer policies (one layer's share overflowed while the others still hold theirs), prefetch.

Why it is a bound. A lookup of entry e at load b whose previous lookup was at load a < b hits iff
e stayed resident after loads a, a+1, .., b-1; after load a it is resident anyway (it is in U_a),
so the interval i = (e, a, b) occupies size_e bytes at the states t = a+1 .. b-1 (none when
b = a + 1: such a lookup always hits). A state's other members are U_t, so P is exactly the set of
0/1 choices x_i with, for every load t,

    sum over intervals i with a_i < t < b_i of size_i x_i  <=  cap_t,

cap_t = the most bytes whole entries can fill in max(0, C - bytes(U_t)) (computed exactly when the
MoE layers have one or two expert sizes, as every trace here has; with more, that room itself, a
looser but still valid cap), and a replay's hits are sum x_i plus the always-hits (first lookups
miss). Relaxing x_i to [0, 1] gives a linear program whose optimum is >= the best replay in P
(with one size it is integral: the optimum itself; ``belady`` reaches it when every lookup is of
one phase, see below); its constraint matrix is an
interval matrix, so it is a min-cost flow (FOO): nodes 0..G (G loads), for each load t an idle arc
t -> t+1 (capacity C, cost 0) and a forced arc t -> t+1 (capacity C - cap_t, cost -M per byte),
for each interval an arc a+1 -> b (capacity size_i, cost -w_i / size_i per byte), and C bytes sent
from node 0 to node G; bytes on an interval arc are cached bytes. M = 2 / the smallest size is
more than any interval's value per byte, so an optimal flow fills every forced arc and the
intervals share only cap_t. Solved exactly by successive shortest paths (Dijkstra on reduced
costs, then a blocking flow over every arc of zero reduced cost; integral byte flows), stopped when
no path of negative cost is left. (The paper's PFOO-U is the other side, an upper bound on misses,
i.e. a lower bound on hits; its PFOO-L relaxes the capacity to hold only on average over time, a
much looser upper bound on hits. The exact LP is affordable here because a load, not a request, is
the unit of time: thousands of nodes for the phone traces.)

The figure reported is not the flow's value but the LP dual's, computed from the final node
potentials: lambda_t = max(0, pi_t - pi_{t+1}) and D = sum_t cap_t lambda_t + sum_i size_i
max(0, w_i / size_i - sum of lambda_t over i's states) + always-hits. By weak duality D >= the LP
optimum for ANY lambda >= 0, so the bound does not rest on the solver having converged; the flow's
value P <= LP optimum <= D, and D - P is the method's slack (0 up to float rounding at an optimum;
tests/test_opt_bound.py holds D to an exact rational simplex of the same LP, tests/naive/bound.py,
and both to an exhaustive search over P, on small traces). Hits are then floor(D + 1e-6): an
integer upper bound on every replay in P.

Objectives and figures. Hits are bounded per phase, each by its own LP (weight w_i = 1 on the
intervals that end in a lookup of that phase, 0 on the others, which are left out of the graph):
``hits_decode`` and the prefill hits are each a bound; ``hits`` (all phases) is their sum, a bound
too (a replay's prefill and decode hits are each at most theirs), possibly looser than one LP over
all phases would be. So with one expert size ``belady`` (which maximizes hits over all phases) equals
the bound in every phase only when the lookups are all of one phase: with both it may give up a
prefill hit for a decode hit or the other way round, and each phase's bound counts the best of
each (tests/test_opt_bound.py has such a trace).
The per-layer and per-batch split and the bytes read follow the flow's solution (lookups are
exact; each phase's hits apportioned to layers by largest remainder): ``read_mib`` = the misses so
split times their layer's size is NOT a lower bound on bytes read (a replay may trade hits of a
smaller layer for a larger one's). ``overflow_loads`` counts the loads larger than the budget
(every replay in P overflows there too, as ``belady`` does); ``peak_resident_mib`` is the flow's
most bytes at once (forced plus fractionally cached); ``evictions`` is 0 (nothing is replayed).

Cost: each round is O((G + N) log G) for N intervals (lookups minus first lookups); the number of
rounds grows with the trace and the entries the budget holds (Qwen at 4000 MiB: about 1,250 rounds,
23,494 augmenting paths, 7-30 s on the shared 2-core machine). The three phone traces:
benchmarks/RESULTS.md. Only the report's verdict runs it unasked, at its budgets, and only when the
expert sizes differ (:func:`sizes_differ`).
"""

from __future__ import annotations

import math
import time

import numpy as np

from replay.policies._scan import never_evict, no_op, no_state
from traces.util.jit import njit

PARTITION = "global"
BOUND = True  # an offline bound, not an online policy
UNBOUNDED = False
NEEDS_NEXT_USE = False
NEEDS_LAST_LOAD = False
NEEDS_TICK = False
NEEDS_FREQ = False
OPTIONS: tuple[str, ...] = ()
SLACK_HITS = 1e-6  # hits = floor(D + SLACK_HITS): float rounding of D never costs a whole hit

# The driver's hooks, never run (solve() replaces the replay); present so the module is a policy.
init = no_state
on_admit = no_op
on_touch = no_op
on_evict = no_op
pick_victim = never_evict


@njit(cache=True, nogil=True)
def intervals(entries, load_start, load_lidx, layer_bytes, n_entries):
    """(lo, hi, load_b, forced): for every lookup with an earlier lookup of its entry at load
    a, the interval's first and one-past-last node (a + 1, b) and its lookup's load b, with
    lo == hi for an always-hit (b = a + 1); forced[t] = bytes of load t's unique entries."""
    G = load_start.shape[0] - 1
    k = entries.shape[1]
    last = np.full(n_entries, -1, np.int64)
    n = 0
    for g in range(G):  # count first: one allocation
        for r in range(load_start[g], load_start[g + 1]):
            for j in range(k):
                e = entries[r, j]
                if last[e] != g:
                    if last[e] >= 0:
                        n += 1
                    last[e] = g
    lo = np.empty(n, np.int64)
    hi = np.empty(n, np.int64)
    lb = np.empty(n, np.int64)
    forced = np.zeros(G, np.int64)
    last[:] = -1
    i = 0
    for g in range(G):
        u = 0
        for r in range(load_start[g], load_start[g + 1]):
            for j in range(k):
                e = entries[r, j]
                a = last[e]
                if a == g:
                    continue
                u += 1
                if a >= 0:
                    lo[i] = a + 1
                    hi[i] = g
                    lb[i] = g
                    i += 1
                last[e] = g
        forced[g] = u * layer_bytes[load_lidx[g]]
    return lo, hi, lb, forced


@njit(cache=True, nogil=True)
def _heap_push(hd, hn, size, d, v):
    i = size
    hd[i] = d
    hn[i] = v
    while i > 0:
        p = (i - 1) >> 1
        if hd[p] <= hd[i]:
            break
        hd[p], hd[i] = hd[i], hd[p]
        hn[p], hn[i] = hn[i], hn[p]
        i = p
    return size + 1


@njit(cache=True, nogil=True)
def _heap_pop(hd, hn, size):
    size -= 1
    hd[0] = hd[size]
    hn[0] = hn[size]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and hd[c + 1] < hd[c]:
            c += 1
        if hd[i] <= hd[c]:
            break
        hd[c], hd[i] = hd[i], hd[c]
        hn[c], hn[i] = hn[i], hn[c]
        i = c
    return size


@njit(cache=True, nogil=True)
def room_after(forced, budget, sizes):
    """cap_t per load: the most bytes whole entries of the given distinct ``sizes`` (ascending)
    can fill in max(0, budget - forced[t]); exact for one or two sizes, else that room itself."""
    G = forced.shape[0]
    out = np.empty(G, np.int64)
    for t in range(G):
        room = budget - forced[t] if forced[t] < budget else 0
        best = room
        if sizes.shape[0] == 1:
            best = room // sizes[0] * sizes[0]
        elif sizes.shape[0] == 2:
            if t > 0 and forced[t] == forced[t - 1]:
                best = out[t - 1]
            else:
                a, b = sizes[1], sizes[0]
                best = 0
                for n in range(room // a + 1):
                    v = n * a + (room - n * a) // b * b
                    if v > best:
                        best = v
        out[t] = best
    return out


@njit(cache=True, nogil=True)
def flow_bound(n_load, capt, budget, lo, hi, size, value):
    """The LP of the module docstring for intervals (lo, hi, size bytes, value = w / size per byte),
    the bytes ``capt`` they may share after each load and budget C; lo < hi for every interval.
    Returns (flow bytes per interval, primal P, dual D, paths): P = sum of flow x value, D = the
    dual bound from the final potentials."""
    N = lo.shape[0]
    V = n_load + 1
    C = np.int64(budget)
    vmax = 0.0
    for i in range(N):
        if value[i] > vmax:
            vmax = value[i]
    M = 2.0 * vmax + 1.0  # any value per byte of forced occupation above every interval's
    # arcs: idle t (2 per load), forced t, interval i; each with its reverse at index ^ 1
    A = 2 * (2 * n_load + N)
    head = np.empty(A, np.int64)
    rcap = np.zeros(A, np.int64)
    cost = np.empty(A, np.float64)
    tail = np.empty(A, np.int64)
    a = 0
    for t in range(n_load):
        for kind in range(2):
            c0 = C if kind == 0 else C - capt[t]
            w0 = 0.0 if kind == 0 else -M
            tail[a], head[a], rcap[a], cost[a] = t, t + 1, c0, w0
            tail[a + 1], head[a + 1], rcap[a + 1], cost[a + 1] = t + 1, t, 0, -w0
            a += 2
    for i in range(N):
        tail[a], head[a], rcap[a], cost[a] = lo[i], hi[i], size[i], -value[i]
        tail[a + 1], head[a + 1], rcap[a + 1], cost[a + 1] = hi[i], lo[i], 0, value[i]
        a += 2
    # CSR adjacency by tail
    deg = np.zeros(V + 1, np.int64)
    for x in range(A):
        deg[tail[x] + 1] += 1
    for v in range(V):
        deg[v + 1] += deg[v]
    adj = np.empty(A, np.int64)
    fill = deg[:V].copy()
    for x in range(A):
        adj[fill[tail[x]]] = x
        fill[tail[x]] += 1
    # potentials: shortest distances from node 0 on the initial graph (a DAG: every arc with room goes forward)
    inf = np.inf
    pi = np.full(V, inf)
    pi[0] = 0.0
    for u in range(V):
        if pi[u] == inf:
            continue
        for q in range(deg[u], deg[u + 1]):
            x = adj[q]
            if rcap[x] > 0 and pi[u] + cost[x] < pi[head[x]]:
                pi[head[x]] = pi[u] + cost[x]
    dist = np.empty(V, np.float64)
    prev = np.empty(V, np.int64)
    done = np.zeros(V, np.bool_)
    hd = np.empty(A + V, np.float64)
    hn = np.empty(A + V, np.int64)
    sent = np.int64(0)
    paths = 0
    vmin = np.inf
    for i in range(N):
        if value[i] < vmin:
            vmin = value[i]
    tol = 1e-10 * vmin  # a reduced cost this close to 0 is 0 (float rounding of the potentials)
    level = np.empty(V, np.int64)
    queue = np.empty(V, np.int64)
    cur = np.empty(V, np.int64)
    stack = np.empty(V, np.int64)
    while True:
        dist[:] = inf
        done[:] = False
        prev[:] = -1
        dist[0] = 0.0
        size_h = _heap_push(hd, hn, 0, 0.0, 0)
        while size_h > 0:
            d = hd[0]
            u = hn[0]
            size_h = _heap_pop(hd, hn, size_h)
            if done[u]:
                continue
            done[u] = True
            if u == n_load:
                break  # the sink is settled: nothing further changes its path
            for q in range(deg[u], deg[u + 1]):
                x = adj[q]
                if rcap[x] <= 0:
                    continue
                v = head[x]
                if done[v]:
                    continue
                rc = cost[x] + pi[u] - pi[v]
                if rc < 0.0:
                    rc = 0.0  # rounding: reduced costs are >= 0 at exact potentials
                nd = d + rc
                if nd < dist[v]:
                    dist[v] = nd
                    prev[v] = x
                    size_h = _heap_push(hd, hn, size_h, nd, v)
        # pi += min(dist, dist to the sink) keeps every residual arc's reduced cost >= 0 (the nodes
        # not settled are at least that far); without a path to the sink, pi += dist (the farthest
        # settled distance for the nodes not reached: no arc with room leads to them).
        cap_d = dist[n_load]
        if cap_d == inf:
            cap_d = 0.0
            for v in range(V):
                if dist[v] < inf and dist[v] > cap_d:
                    cap_d = dist[v]
        for v in range(V):
            pi[v] += dist[v] if dist[v] < cap_d else cap_d
        if dist[n_load] == inf or sent >= C:
            break
        path_cost = pi[n_load] - pi[0]  # the shortest path's true cost: reduced costs are 0 along it now
        if path_cost >= -tol:
            break
        # Every shortest path at once: a blocking flow (Dinic) on the arcs of zero reduced cost.
        while sent < C:
            level[:] = -1
            level[0] = 0
            qh = 0
            qt = 1
            queue[0] = 0
            while qh < qt:
                u = queue[qh]
                qh += 1
                for q in range(deg[u], deg[u + 1]):
                    x = adj[q]
                    v = head[x]
                    if rcap[x] > 0 and level[v] < 0 and cost[x] + pi[u] - pi[v] <= tol:
                        level[v] = level[u] + 1
                        queue[qt] = v
                        qt += 1
            if level[n_load] < 0:
                break
            for v in range(V):
                cur[v] = deg[v]
            depth = 0
            u = 0
            while sent < C:
                if u == n_load:
                    push = C - sent
                    for z in range(depth):
                        if rcap[stack[z]] < push:
                            push = rcap[stack[z]]
                    z0 = depth
                    for z in range(depth):
                        rcap[stack[z]] -= push
                        rcap[stack[z] ^ 1] += push
                        if rcap[stack[z]] == 0 and z < z0:
                            z0 = z
                    sent += push
                    paths += 1
                    if z0 == depth:  # nothing saturated: the whole budget is sent
                        break
                    depth = z0  # go on from the tail of the first saturated arc
                    u = tail[stack[z0]]
                    continue
                found = False
                while cur[u] < deg[u + 1]:
                    x = adj[cur[u]]
                    v = head[x]
                    if rcap[x] > 0 and level[v] == level[u] + 1 and cost[x] + pi[u] - pi[v] <= tol:
                        found = True
                        break
                    cur[u] += 1
                if found:
                    stack[depth] = x
                    depth += 1
                    u = v
                else:  # a dead end: never again this phase
                    level[u] = -2
                    if depth == 0:
                        break
                    depth -= 1
                    u = tail[stack[depth]]
                    cur[u] += 1
    flow = np.empty(N, np.int64)
    primal = 0.0
    base = 4 * n_load
    for i in range(N):
        flow[i] = rcap[base + 2 * i + 1]
        primal += flow[i] * value[i]
    # the dual of the LP at lambda_t = max(0, pi_t - pi_{t+1}): an upper bound for any lambda >= 0
    pre = np.zeros(V, np.float64)
    dual = 0.0
    for t in range(n_load):
        lam = pi[t] - pi[t + 1]
        if not lam > 0.0:  # also a NaN from two unreachable nodes
            lam = 0.0
        pre[t + 1] = pre[t] + lam
        dual += capt[t] * lam
    for i in range(N):
        slack = value[i] - (pre[hi[i]] - pre[lo[i]])
        if slack > 0.0:
            dual += size[i] * slack
    return flow, primal, dual, paths


def sizes_differ(layer_expert_bytes) -> bool:
    """Whether the MoE layers' experts differ in size: then ``belady`` (furthest next use) is a
    heuristic, not a bound, and the report compares the best online policy with ``opt-bound``."""
    return len({int(b) for b in layer_expert_bytes}) > 1


def prepare_options(loads, options: dict) -> dict:
    """The intervals and forced bytes, once per sweep (budget-independent)."""
    out = dict(options)
    out["_intervals"] = intervals(loads.entries, loads.load_start, loads.load_lidx, loads.layer_expert_bytes,
                                  loads.n_entries)
    return out


def _apportion(frac: np.ndarray, target: int, room: np.ndarray) -> np.ndarray:
    """Whole numbers, each <= ``room``, summing to min(target, room.sum()): floors of ``frac``
    (clipped to room) plus one for the largest remainders (ties to the lower index), then any
    units left to the first cells with room."""
    base = np.minimum(np.floor(frac + 1e-9).astype(np.int64), room)
    target = min(int(target), int(room.sum()))
    left = target - int(base.sum())
    if left > 0:
        rem = np.where(base < room, frac - base, -1.0)
        for i in np.argsort(-rem, kind="stable"):
            if left == 0 or rem[i] < 0:
                break
            base[i] += 1
            left -= 1
        for i in range(base.shape[0]):
            if left == 0:
                break
            add = min(left, int(room[i] - base[i]))
            base[i] += add
            left -= add
    elif left < 0:  # D below the flow's floors (cannot happen at an optimum): trim from the end
        for i in range(base.shape[0] - 1, -1, -1):
            cut = min(-left, int(base[i]))
            base[i] -= cut
            left += cut
    return base


def phase_bound(loads, ivs, budget: int, phase: int):
    """(x, flow, sel, P, D) for the hits of ``phase`` (0 prefill, 1 decode) at ``budget`` bytes:
    x [N] the fraction of each interval kept (1 for an always-hit of the phase, 0 for the other
    phase's), flow [n] bytes of the flow's intervals ``sel`` [N] (mask), P and D the primal and
    dual values plus the always-hits (P <= LP optimum <= D)."""
    lo, hi, lb, forced = ivs
    G = loads.load_start.shape[0] - 1
    size_all = loads.layer_expert_bytes.astype(np.int64)[loads.load_lidx[lb]] if lb.size else np.zeros(0, np.int64)
    free = lo == hi
    mine = loads.load_phase[lb] == phase
    sel = mine & ~free
    if sel.any():
        capt = room_after(forced, int(budget), np.unique(loads.layer_expert_bytes.astype(np.int64)))
        flow, primal, dual, _ = flow_bound(G, capt, int(budget), lo[sel], hi[sel], size_all[sel],
                                           1.0 / size_all[sel].astype(np.float64))
    else:
        flow, primal, dual = np.zeros(0, np.int64), 0.0, 0.0
    x = np.zeros(lb.shape[0], np.float64)
    x[mine & free] = 1.0
    x[sel] = flow / size_all[sel]
    n_free = int((mine & free).sum())
    return x, flow, sel, primal + n_free, dual + n_free


def solve(loads, policy: str, budget_mib: float, budget: int, options: dict):
    """The bound's :class:`replay.core.simulate.ReplayResult` at ``budget`` bytes (see the module docstring)."""
    from replay.core.driver import ACC_HITS, ACC_LOOKUPS, ACC_READ, N_ACC, N_STATS, STAT_OVERFLOW, STAT_PEAK_BYTES
    from replay.core.simulate import ReplayResult

    t0 = time.perf_counter()
    lo, hi, lb, forced = options["_intervals"] if "_intervals" in options else prepare_options(loads, {})["_intervals"]
    G = loads.load_start.shape[0] - 1
    L = len(loads.moe_layers)
    leb = loads.layer_expert_bytes.astype(np.int64)
    lphase = loads.load_phase.astype(np.int64)
    llayer = loads.load_lidx.astype(np.int64)
    lbatch = loads.load_batch.astype(np.int64)
    B = loads.batch_turn.shape[0]
    # exact lookups per (phase, layer) and per batch: one per unique entry of each load
    u = forced // leb[llayer] if G else np.zeros(0, np.int64)
    acc = np.zeros((2, L, N_ACC), np.int64)
    np.add.at(acc[:, :, ACC_LOOKUPS], (lphase, llayer), u)
    bacc = np.zeros((B, N_ACC), np.int64)
    np.add.at(bacc[:, ACC_LOOKUPS], lbatch, u)
    peak = 0.0  # most bytes after a load, forced + cached, in either phase's flow
    hits_b = np.zeros(B, np.float64)
    for ph in (0, 1):
        x, flow, sel, _, d_phase = phase_bound(loads, (lo, hi, lb, forced), budget, ph)
        frac_l = np.bincount(llayer[lb], weights=x, minlength=L)
        room = acc[ph, :, ACC_LOOKUPS]
        acc[ph, :, ACC_HITS] = _apportion(frac_l, math.floor(d_phase + SLACK_HITS), room)
        hits_b += np.bincount(lbatch[lb], weights=x, minlength=B)
        diff = np.zeros(G + 1, np.float64)
        np.add.at(diff, lo[sel], flow)
        np.subtract.at(diff, hi[sel], flow)
        if G:
            peak = max(peak, float((forced + np.cumsum(diff)[:G]).max()))
    acc[:, :, ACC_READ] = (acc[:, :, ACC_LOOKUPS] - acc[:, :, ACC_HITS]) * leb[None, :]
    # per batch: the flows' hits apportioned to the phases' totals (batches of one phase each)
    bph = loads.batch_phase.astype(np.int64)
    for ph in (0, 1):
        m = bph == ph
        if m.any():
            bacc[m, ACC_HITS] = _apportion(hits_b[m], int(acc[ph, :, ACC_HITS].sum()), bacc[m, ACC_LOOKUPS])
    if B:
        bl = np.zeros(B, np.int64)  # bytes of one lookup's miss per batch: its loads' misses x sizes, apportioned
        np.add.at(bl, lbatch, u * leb[llayer])
        with np.errstate(invalid="ignore", divide="ignore"):
            per = np.where(bacc[:, ACC_LOOKUPS] > 0, bl / np.maximum(bacc[:, ACC_LOOKUPS], 1), 0.0)
        bacc[:, ACC_READ] = np.round((bacc[:, ACC_LOOKUPS] - bacc[:, ACC_HITS]) * per).astype(np.int64)
    stats = np.zeros(N_STATS, np.int64)
    stats[STAT_OVERFLOW] = int((forced > budget).sum())
    stats[STAT_PEAK_BYTES] = int(math.ceil(peak))
    dt = time.perf_counter() - t0
    return ReplayResult(policy, float(budget_mib), int(budget), acc, bacc, 0, int(stats[STAT_OVERFLOW]), None, dt, stats,
                        np.zeros(L, np.int64), None)


def describe(loads, budgets_bytes: list[int], options: dict) -> str:
    return ("opt-bound = an upper bound on the hits of any replay that starts empty and reads on demand, with any expert "
            "sizes: the LP relaxation of the offline optimum (flow-based, FOO-L of Berger et al. 2018, adapted to loads), "
            "solved exactly as a min-cost flow, one per phase; hits are bounds, read_mib follows the flow (not a bound).")
