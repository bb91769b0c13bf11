"""Naive twin of the cache replay, written from docs/design.md ("Replay semantics") and the policy
definitions in replay/policies/*.py docstrings; dictionaries and loops, no cleverness.

rows: list of (batch, phase, layer, [expert ids]) in file order (batch, layer, step).
Returns per-(phase, layer) lookups / hits / read bytes, per-batch totals, one residency code per
routed slot (a repeat inside a load reports its lookup's outcome), the eviction count, the loads
that overflowed (their group still over its budget after the eviction step) and the peak resident
bytes (all groups together, after each load's eviction step).

Two frequencies: ``lfu`` / ``layerlfu`` count the loads that looked an entry up since the start of
the run (``run_freq``, a dict that outlives eviction); ``lfu-incache`` / ``layerlfu-incache`` /
``lfru`` count since the entry's admission (``cache[key]["freq"]``, gone with the entry).

``pin``: the pinned entries (:func:`naive_pin_list`) are in the cache before the first load, are
never eviction candidates (so a lookup of one is a hit from the start), and count in the peak; LRU
over the rest. ``layer-opt``: per-layer LRU with the shares of :func:`naive_layer_opt_shares`
(brute force over every partition of whole entries), or the ``shares`` given.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

M64 = (1 << 64) - 1
PARTITIONED = {"layer", "layerlfu", "layerlfu-incache", "layer-opt", "colibri"}
LRU_ORDER = {"lru", "layer", "pin", "layer-opt"}  # victim = least recent (key 0, ties by tick)
RUN_FREQ = {"lfu", "layerlfu"}  # whole-run counts
INCACHE_FREQ = {"lfu-incache", "layerlfu-incache"}  # counts since admission
ADMISSION_ORDER = {"fifo"}  # examples/fifo_policy.py: victim = admitted longest ago (a hit changes nothing)


class NaiveS3FIFO:
    """S3-FIFO from the ``replay.policies.s3fifo`` docstring: three Python lists (oldest first)."""

    def __init__(self, budget, size):
        self.size = size
        self.budget = budget
        self.cap_small = budget // 10
        self.cap_main = budget - self.cap_small
        self.cap_ghost = budget * 9 // 10
        self.small, self.main, self.ghost = [], [], []
        self.pending = []  # (key, "small" | "main"): this load's admissions, queued after its eviction step
        self.freq = {}
        self.counted = {}  # key -> the load that last raised (or reset) its frequency
        self.has_evicted = False

    def _bytes(self, keys):
        return sum(self.size(k) for k in keys)

    def begin_load(self, i, batch_first):
        for key, q in self.pending:
            (self.small if q == "small" else self.main).append(key)
        self.pending = []

    def admit(self, key, i):
        b = self.size(key)
        pend_small = self._bytes(k for k, q in self.pending if q == "small")
        total = self._bytes(self.small) + self._bytes(self.main) + self._bytes(k for k, _ in self.pending)
        if total + b > self.budget:
            self.has_evicted = True
        if key in self.ghost:
            self.ghost.remove(key)
            q = "main"
        elif not self.has_evicted and self._bytes(self.small) + pend_small >= self.cap_small:
            q = "main"
        else:
            q = "small"
        self.pending.append((key, q))
        self.freq[key] = 0
        self.counted[key] = i

    def touch(self, key, i):
        if self.counted.get(key) != i:
            self.counted[key] = i
            self.freq[key] = min(self.freq[key] + 1, 3)

    def _from_main(self, ok):
        i = 0
        while i < len(self.main):
            k = self.main[i]
            if self.freq[k] >= 1:  # reinserted at the newest end, one lower; the walk goes on from the next
                self.freq[k] -= 1
                self.main.append(self.main.pop(i))
            elif ok(k):
                return k
            else:
                i += 1
        return None

    def _from_small(self, ok):
        i = 0
        while i < len(self.small):
            k = self.small[i]
            if self.freq[k] >= 2:
                self.main.append(self.small.pop(i))
                self.freq[k] = 0
            elif ok(k):
                return k
            else:
                i += 1
        return None

    def victim(self, ok):
        self.has_evicted = True
        if self._bytes(self.main) > self.cap_main or not self.small:
            order = (self._from_main, self._from_small, self._from_main)
        else:
            order = (self._from_small, self._from_main)
        for f in order:
            v = f(ok)
            if v is not None:
                return v
        return None

    def evict(self, key):
        if key in self.main:
            self.main.remove(key)
            return
        self.small.remove(key)
        b = self.size(key)
        if b > self.cap_ghost:
            return
        while self._bytes(self.ghost) + b > self.cap_ghost:
            self.ghost.pop(0)
        self.ghost.append(key)


class NaiveSieve:
    """SIEVE from the ``replay.policies.sieve`` docstring: one list (oldest first), a visited set, a hand."""

    def __init__(self, budget, size):
        self.queue = []
        self.pending = []
        self.visited = set()
        self.hand = None  # the key the next search starts at; None = the oldest

    def begin_load(self, i, batch_first):
        self.queue += self.pending
        self.pending = []

    def admit(self, key, i):
        self.pending.append(key)
        self.visited.discard(key)

    def touch(self, key, i):
        if key in self.queue:
            self.visited.add(key)

    def victim(self, ok):
        if not self.queue:
            return None
        pos = 0 if self.hand is None else self.queue.index(self.hand)
        for _ in range(3 * len(self.queue) + 3):
            if pos >= len(self.queue):
                pos = 0
            k = self.queue[pos]
            if k in self.visited:
                self.visited.discard(k)
            elif ok(k):
                return k
            pos += 1
        return None

    def evict(self, key):
        pos = self.queue.index(key)
        self.hand = self.queue[pos + 1] if pos + 1 < len(self.queue) else None
        self.queue.pop(pos)
        self.visited.discard(key)


class NaiveLeastStale:
    """least-stale from its docstring: stale (not touched in this batch) before fresh, oldest admission first."""

    def __init__(self, budget, size, last_load):
        self.order = []
        self.last_load = last_load  # key -> load of its last demand lookup (or fill)
        self.batch_first = 0

    def begin_load(self, i, batch_first):
        self.batch_first = batch_first

    def admit(self, key, i):
        self.order.append(key)

    def touch(self, key, i):
        pass

    def victim(self, ok):
        cands = [k for k in self.order if ok(k)]
        stale = [k for k in cands if self.last_load(k) < self.batch_first]
        return (stale or cands or [None])[0]

    def evict(self, key):
        self.order.remove(key)


class NaiveColibri:
    """colibri from the ``replay.policies.colibri`` docstring: per layer its pinned experts in slot
    order (never victims), the LRU tier = the other cached experts of the layer by the cache's tick
    (a demoted pin gets a tick below every other: the next victim); heat and last access per
    (layer, expert), one access clock (+1 per demand lookup, all layers); the re-pin passes at the
    batch starts :func:`naive_colibri_passes` lists."""

    def __init__(self, pins, n_expert, passes, cache):
        self.pins = {layer: list(p) for layer, p in pins.items()}
        self.n_expert = n_expert
        self.passes = passes
        self.cache = cache
        self.heat = defaultdict(int)
        self.last = defaultdict(int)
        self.clock = 0
        self.swaps = 0

    def pinned(self, key):
        return key[1] in self.pins[key[0]]

    def begin_load(self, i, batch_first):
        if i in self.passes:
            self.repin_pass()

    def _demand(self, key):
        self.clock += 1
        self.heat[key] += 1
        self.last[key] = self.clock

    def admit(self, key, i):
        self._demand(key)

    def touch(self, key, i):
        self._demand(key)

    def fill(self, key, i):
        pass  # a speculative fill: no heat, no clock

    def score(self, key):
        age = self.clock - self.last[key]
        return (self.heat[key] << 8) | (255 - age if age < 255 else 0)

    def repin_pass(self):
        for layer, pins in self.pins.items():
            free = [x for x in range(self.n_expert) if x not in pins]
            if not pins or not free:
                continue
            cold = min(range(len(pins)), key=lambda z: (self.score((layer, pins[z])), z))
            hot = max(free, key=lambda x: (self.score((layer, x)), -x))
            cs, hs = self.score((layer, pins[cold])), self.score((layer, hot))
            if hs <= cs + cs // 4 + 4 * 256:
                continue
            old = pins[cold]
            pins[cold] = hot
            self.swaps += 1
            if (layer, old) in self.cache:
                self.cache[(layer, old)]["tick"] = min(c["tick"] for c in self.cache.values()) - 1
            for x in range(self.n_expert):
                self.heat[(layer, x)] //= 2

    def victim(self, ok):
        cands = [x for x in self.cache if ok(x) and not self.pinned(x)]
        return min(cands, key=lambda x: self.cache[x]["tick"]) if cands else None

    def evict(self, key):
        pass


def naive_colibri_setup(loads, moe_layers, n_expert, expert_bytes, budget_bytes, per_layer=None, repin=0, profile=None):
    """colibri's (pins {layer: [experts, hottest first]}, shares {layer: bytes}, pass loads) from
    its docstring. ``loads``: the twin's list of {"batch", "phase", "layer", "rows"}."""
    per_token = sum(expert_bytes[l] for l in moe_layers)
    if per_layer is not None:
        n = per_layer
    elif budget_bytes >= n_expert * per_token:
        n = n_expert
    else:
        n = min(n_expert, budget_bytes // 2 // per_token)
    if profile is None:
        profile = defaultdict(int)
        for ld in loads:
            if ld["phase"] == 1:
                break
            for row in ld["rows"]:
                for x in row:
                    profile[(ld["layer"], x)] += 1
    pins = {l: sorted(range(n_expert), key=lambda x, l=l: (-profile.get((l, x), 0), x))[:n] for l in moe_layers}
    lru = {l: 0 for l in moe_layers}
    rest = budget_bytes - n * per_token
    grew = True
    while grew:
        grew = False
        for l in moe_layers:
            if lru[l] < n_expert - n and rest >= expert_bytes[l]:
                lru[l] += 1
                rest -= expert_bytes[l]
                grew = True
    shares = {l: (n + lru[l]) * expert_bytes[l] for l in moe_layers}
    tokens, first = {}, {}
    for i, ld in enumerate(loads):
        tokens[ld["batch"]] = max(tokens.get(ld["batch"], 0), len(ld["rows"]))
        first.setdefault(ld["batch"], i)
    passes, since = set(), 0
    for j, b in enumerate(first):
        if j > 0 and repin > 0 and since >= repin:
            passes.add(first[b])
            since = 0
        since += tokens[b]
    return pins, shares, passes


STATEFUL = {"s3fifo", "sieve", "least-stale"}


def stateful_policy(policy, budget, size, last_load):
    """The naive policy object for a policy whose order is its own state (queues, a hand)."""
    if policy == "s3fifo":
        return NaiveS3FIFO(budget, size)
    if policy == "sieve":
        return NaiveSieve(budget, size)
    return NaiveLeastStale(budget, size, last_load)


def splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def naive_pin_list(rows, moe_layers, n_expert, expert_bytes, budget_bytes, per_layer=None, profile=None):
    """pin's pinned (layer, expert) set: per MoE layer the N experts with the most routed slots in
    the rows before the first decode row (or in ``profile``: {(layer, expert): count}), ties to the
    lower id; N = per_layer, or min(n_expert, budget // 2 // sum of the layers' expert bytes)."""
    if profile is None:
        profile = defaultdict(int)
        for _batch, phase, layer, experts in rows:
            if phase == 1:
                break
            for x in experts:
                profile[(layer, x)] += 1
    n = per_layer if per_layer is not None else min(n_expert, budget_bytes // 2 // sum(expert_bytes[l] for l in moe_layers))
    out = set()
    for layer in moe_layers:
        ranked = sorted(range(n_expert), key=lambda x: (-profile.get((layer, x), 0), x))
        out |= {(layer, x) for x in ranked[:n]}
    return out


def naive_lru_misses(rows, moe_layers, n_expert, expert_bytes, c):
    """{layer: misses over all phases} of per-layer LRU with a share of c entries in every layer."""
    res = naive_replay(rows, moe_layers, n_expert, expert_bytes, "layer-opt", 0, shares={l: c * expert_bytes[l] for l in moe_layers})
    return {l: sum(res["lookups"].get((ph, l), 0) - res["hits"].get((ph, l), 0) for ph in (0, 1)) for l in moe_layers}


def naive_largest_loads(rows, moe_layers):
    """{(phase, layer): most unique experts in one load}."""
    out = defaultdict(int)
    i = 0
    while i < len(rows):
        j = i
        while j < len(rows) and rows[j][0] == rows[i][0] and rows[j][2] == rows[i][2]:
            j += 1
        u = len({x for r in rows[i:j] for x in r[3]})
        key = (rows[i][1], rows[i][2])
        out[key] = max(out[key], u)
        i = j
    return out


def naive_layer_opt_shares(rows, moe_layers, n_expert, expert_bytes, budget_bytes):
    """layer-opt's shares {layer: bytes}, by brute force: every partition of whole entries per layer
    (at least the floor: every layer's largest load, else its largest decode load, else 0, the
    first that fits the budget) within the budget; the one with the fewest misses (all phases),
    then fewest bytes, then the lexicographically smallest entries per layer."""
    curve = [naive_lru_misses(rows, moe_layers, n_expert, expert_bytes, c) for c in range(n_expert + 1)]
    big = naive_largest_loads(rows, moe_layers)
    floors = ([max(big[(0, l)], big[(1, l)]) for l in moe_layers], [big[(1, l)] for l in moe_layers], [0] * len(moe_layers))
    lo = next(f for f in floors if sum(c * expert_bytes[l] for c, l in zip(f, moe_layers)) <= budget_bytes)
    best = None
    for cs in itertools.product(*(range(a, n_expert + 1) for a in lo)):
        b = sum(c * expert_bytes[l] for c, l in zip(cs, moe_layers))
        if b > budget_bytes:
            continue
        key = (sum(curve[c][l] for c, l in zip(cs, moe_layers)), b, cs)
        if best is None or key < best:
            best = key
    return {l: c * expert_bytes[l] for c, l in zip(best[2], moe_layers)}


def naive_victim(policy, candidates, cache, i, run_freq, seed, evictions, moe_layers, n_expert):
    """The victim a keyed policy (every one but the stateful ones and colibri) takes among
    ``candidates`` after load ``i``: the smallest (key, tick of the last lookup), from each entry's
    ``cache`` record (tick, load, freq since admission, next load that touches it, admitted);
    ``run_freq``: demand lookups since the run began; ``evictions``: made so far (random's draw)."""
    keys = {}
    for x in candidates:
        c = cache[x]
        if policy in LRU_ORDER:
            k = 0
        elif policy in ADMISSION_ORDER:
            keys[x] = (0, c["admitted"])
            continue
        elif policy in RUN_FREQ:
            k = run_freq[x]
        elif policy in INCACHE_FREQ:
            k = c["freq"]
        elif policy == "lfru":
            k = (c["freq"] << 8) | max(0, 255 - (i - c["load"]))
        elif policy == "belady":
            k = -c["next"]
        elif policy == "random":
            entry = moe_layers.index(x[0]) * n_expert + x[1]
            k = splitmix64(((seed << 32) + (evictions << 20) + entry) & M64) >> 1
        else:
            raise ValueError(policy)
        keys[x] = (k, c["tick"])
    return min(candidates, key=keys.__getitem__)


def naive_replay(rows, moe_layers, n_expert, expert_bytes, policy, budget_bytes, seed=0, pin_options=None, shares=None,
                 colibri_options=None):
    """expert_bytes: {layer: bytes}; budget_bytes: int. ``pin_options``: pin's per_layer / profile
    (as :func:`naive_pin_list` takes them); ``shares``: layer-opt's {layer: bytes} instead of its optimum;
    ``colibri_options``: colibri's per_layer / repin (as :func:`naive_colibri_setup` takes them)."""
    # Cut into loads: consecutive rows with the same (batch, layer).
    loads = []
    for batch, phase, layer, experts in rows:
        if loads and loads[-1]["batch"] == batch and loads[-1]["layer"] == layer:
            loads[-1]["rows"].append(list(experts))
        else:
            loads.append({"batch": batch, "phase": phase, "layer": layer, "rows": [list(experts)]})
    # For Belady: the loads that touch each (layer, expert), in order.
    touched_by = defaultdict(list)
    for i, ld in enumerate(loads):
        for ex in sorted({x for row in ld["rows"] for x in row}):
            touched_by[(ld["layer"], ex)].append(i)

    def next_use(key, i):
        later = [j for j in touched_by[key] if j > i]
        return later[0] if later else float("inf")

    cache = {}  # (layer, expert) -> dict(tick, load, freq, next)
    run_freq = defaultdict(int)  # (layer, expert) -> loads that looked it up since the run began; never deleted
    lookups = defaultdict(int)
    hits = defaultdict(int)
    read = defaultdict(int)
    per_batch = defaultdict(lambda: [0, 0, 0])
    codes = []
    evictions = 0
    overflow = 0
    peak = 0
    tick = 0
    share = budget_bytes // len(moe_layers)
    if policy == "layer-opt" and shares is None:
        shares = naive_layer_opt_shares(rows, moe_layers, n_expert, expert_bytes, budget_bytes)
    pinned = naive_pin_list(rows, moe_layers, n_expert, expert_bytes, budget_bytes, **(pin_options or {})) if policy == "pin" else set()
    if sum(expert_bytes[x[0]] for x in pinned) > budget_bytes:
        raise ValueError("pinned entries exceed the budget")
    if policy == "colibri":
        pins, shares, passes = naive_colibri_setup(loads, moe_layers, n_expert, expert_bytes, budget_bytes, **(colibri_options or {}))
        pinned = {(l, x) for l, p in pins.items() for x in p}
    for key in pinned:
        cache[key] = {"freq": 0, "tick": -1, "load": -1}
        peak = max(peak, sum(expert_bytes[x[0]] for x in cache))
    pol = stateful_policy(policy, budget_bytes, lambda x: expert_bytes[x[0]], lambda x: cache[x]["load"]) \
        if policy in STATEFUL else None
    if policy == "colibri":
        pol = NaiveColibri(pins, n_expert, passes, cache)
    batch_first = {}
    for i, ld in enumerate(loads):
        layer, phase = ld["layer"], ld["phase"]
        batch_first.setdefault(ld["batch"], i)
        if pol:
            pol.begin_load(i, batch_first[ld["batch"]])
        outcome = {}
        for row in ld["rows"]:
            row_codes = []
            for ex in row:
                key = (layer, ex)
                tick += 1
                if key in outcome:  # repeat inside the load: promote only
                    cache[key]["tick"] = tick
                    row_codes.append(outcome[key])
                    continue
                lookups[(phase, layer)] += 1
                per_batch[ld["batch"]][0] += 1
                run_freq[key] += 1
                if key in cache:
                    hits[(phase, layer)] += 1
                    per_batch[ld["batch"]][1] += 1
                    cache[key]["freq"] += 1
                    outcome[key] = 1
                    if pol:
                        pol.touch(key, i)
                else:
                    read[(phase, layer)] += expert_bytes[layer]
                    per_batch[ld["batch"]][2] += expert_bytes[layer]
                    cache[key] = {"freq": 1, "admitted": tick}
                    outcome[key] = 0
                    if pol:
                        pol.admit(key, i)
                cache[key]["tick"] = tick
                cache[key]["load"] = i
                cache[key]["next"] = next_use(key, i)
                row_codes.append(outcome[key])
            codes.append(row_codes)
        if policy == "infinite":
            peak = max(peak, sum(expert_bytes[x[0]] for x in cache))
            continue
        # Eviction once after the load, never an entry this load touched.
        partitioned = policy in PARTITIONED
        limit = (shares[layer] if shares is not None else share) if partitioned else budget_bytes
        while True:
            members = [x for x in cache if x[0] == layer or not partitioned]
            if sum(expert_bytes[x[0]] for x in members) <= limit:
                break
            candidates = [x for x in members if cache[x]["load"] != i and x not in pinned]
            if pol:
                victim = pol.victim(lambda x, i=i, lay=layer, part=partitioned: cache[x]["load"] != i and (not part or x[0] == lay))
                if victim is None:
                    overflow += 1
                    break
                pol.evict(victim)
                del cache[victim]
                evictions += 1
                continue
            if not candidates:
                overflow += 1
                break
            victim = naive_victim(policy, candidates, cache, i, run_freq, seed, evictions, moe_layers, n_expert)
            del cache[victim]
            evictions += 1
        peak = max(peak, sum(expert_bytes[x[0]] for x in cache))
    return {"lookups": dict(lookups), "hits": dict(hits), "read": dict(read), "per_batch": dict(per_batch),
            "codes": codes, "evictions": evictions, "overflow": overflow, "peak_bytes": peak,
            "colibri_swaps": pol.swaps if policy == "colibri" else 0}

