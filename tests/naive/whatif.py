"""Naive twin of the what-ifs that change reads: closed-loop drop-cold (and the closed top-k cut),
speculative prefetch (cap, eviction guard), retention. Written from docs/design.md ("Replay semantics",
"Lossy and speculative what-ifs") and the what-if issue text; dictionaries and loops.

rows: list of (batch, phase, layer, [expert ids]) in file order (batch, layer, step).
drop: None, or per row a list of k codes: 0 keep, 1 drop-cold (skip the slot if the expert is not
      cached at that moment), 2 skip always (top-k cut). A skipped slot is not looked up, not read,
      not admitted, not promoted.
preds: None, or per row the list of expert ids (of that row's layer) the predictor names for it,
      best first (None entries = nothing named).

Rules as the issue states them:
- after the eviction step of load i (batch b, layer position p), the predictions for the load of
  batch b at layer position p + ahead are read speculatively, in row then rank order, each expert
  once; one already cached costs nothing and does not count toward the cap; at most ``cap``
  predicted misses per step are attempted; a fill evicts the policy's victims until it fits and is
  refused when nothing can be evicted (no overflow for a guess);
- the guard: demand accesses raise heat (one per load that looks the expert up, over the whole run),
  a fill never does; if the victim's heat >= 2 the fill is refused unless
  score(v) + score(v) // 4 + 4 * 256 <= score(candidate), score = heat << 8 | recency byte,
  recency = max(0, 255 - (loads since the last load that demanded it or after which it was
  filled)), 0 if never either (LFRU's own recency byte);
- frequency: ``lfu`` / ``layerlfu`` rank by the whole-run demand count, which is ``heat`` (a fill
  neither raises nor erases it); the in-cache policies (``lfu-incache``, ``layerlfu-incache``,
  ``lfru``) by the count since admission;
- the peak resident bytes (all groups) are taken after each load's eviction step and after its fills;
- a filled expert has in-cache frequency 0 and is most recent (its tick and its load are the fill's), so
  the rest of the same step cannot evict it;
  a demand hit on it is a speculative hit (code 2) and makes it an ordinary entry;
- retention: before load i's eviction step, the predictions for the loads of batch b at layer
  positions p+1 .. p+ahead are not evictable (at that step and at the fills after it).
"""

from __future__ import annotations

from collections import defaultdict

from tests.naive.cache import (
    PARTITIONED,
    STATEFUL,
    NaiveColibri,
    naive_colibri_setup,
    naive_layer_opt_shares,
    naive_pin_list,
    naive_victim,
    stateful_policy,
)


def naive_whatif(rows, moe_layers, n_expert, expert_bytes, policy, budget_bytes, seed=0, drop=None, preds=None,
                 ahead=1, cap=None, guard=False, retain=False, fill=False, colibri_options=None):
    loads = []
    for i, (batch, phase, layer, _experts) in enumerate(rows):
        if loads and loads[-1]["batch"] == batch and loads[-1]["layer"] == layer:
            loads[-1]["rows"].append(i)
        else:
            loads.append({"batch": batch, "phase": phase, "layer": layer, "rows": [i]})
    pos = {layer: p for p, layer in enumerate(moe_layers)}
    touched_by = defaultdict(list)  # Belady: next load that routes the expert (dropped or not)
    for i, ld in enumerate(loads):
        for ex in sorted({x for r in ld["rows"] for x in rows[r][3]}):
            touched_by[(ld["layer"], ex)].append(i)

    def next_use(key, i):
        later = [j for j in touched_by[key] if j > i]
        return later[0] if later else float("inf")

    def load_at(i, m):
        """The load of the same batch m layer positions after load i, or None."""
        j = i + m
        if j >= len(loads):
            return None
        a, b = loads[i], loads[j]
        if b["batch"] != a["batch"] or pos[b["layer"]] != pos[a["layer"]] + m:
            return None
        return j

    def predicted(j):
        out = []
        for r in loads[j]["rows"]:
            for ex in preds[r]:
                if ex is not None and (loads[j]["layer"], ex) not in out:
                    out.append((loads[j]["layer"], ex))
        return out

    cache = {}  # (layer, expert) -> dict(tick, load, freq, next, spec)
    heat = defaultdict(int)
    last_touch = {}  # the last load that demanded the expert or after which it was filled
    out = {"lookups": defaultdict(int), "hits": defaultdict(int), "read": defaultdict(int), "skipped": defaultdict(int),
           "spec_hits": defaultdict(int), "spec_fills": defaultdict(int), "spec_read": defaultdict(int)}
    per_batch = defaultdict(lambda: defaultdict(int))
    filled = {}  # load index -> the (layer, expert) keys its speculative step read, in order
    st = defaultdict(int)
    codes = []
    tick = 0
    share = budget_bytes // len(moe_layers)
    partitioned = policy in PARTITIONED
    # layer-opt's shares and pin's list come from the plain rows (a what-if does not change them).
    shares = naive_layer_opt_shares(rows, moe_layers, n_expert, expert_bytes, budget_bytes) if policy == "layer-opt" else None
    pinned = naive_pin_list(rows, moe_layers, n_expert, expert_bytes, budget_bytes) if policy == "pin" else set()
    if policy == "colibri":
        # colibri's pins, shares and pass schedule from the plain rows (one row = one token's routing at a layer).
        plain = [{**ld, "rows": [rows[r][3] for r in ld["rows"]]} for ld in loads]
        pins, shares, passes = naive_colibri_setup(plain, moe_layers, n_expert, expert_bytes, budget_bytes, **(colibri_options or {}))
        pinned = {(l, x) for l, p in pins.items() for x in p}
    for key in pinned:
        cache[key] = {"freq": 0, "spec": False, "tick": -1, "load": -1, "next": float("inf")}
    st["peak_bytes"] = sum(expert_bytes[x[0]] for x in cache)

    def group_of(key):
        return key[0] if partitioned else None

    def limit(g):
        if not partitioned:
            return budget_bytes
        return shares[g] if shares is not None else share

    def used(g):
        return sum(expert_bytes[x[0]] for x in cache if group_of(x) == g)

    pol = stateful_policy(policy, budget_bytes, lambda x: expert_bytes[x[0]], lambda x: cache[x]["load"]) \
        if policy in STATEFUL else None
    if policy == "colibri":
        pol = NaiveColibri(pins, n_expert, passes, cache)

    def victim(g, i, shielded):
        if pol:  # s3fifo, sieve, least-stale: the policy's own queues (a search may move entries)
            return pol.victim(lambda x: cache[x]["load"] != i and x not in shielded and group_of(x) == g)
        cands = [x for x in cache if group_of(x) == g and cache[x]["load"] != i and x not in shielded and x not in pinned]
        if not cands:
            return None
        # heat: demand lookups since the run began (the whole-run count of lfu / layerlfu)
        return naive_victim(policy, cands, cache, i, heat, seed, st["evictions"], moe_layers, n_expert)

    def evict(x):
        if pol:
            pol.evict(x)
        if cache[x]["spec"]:
            st["spec_evicted_unused"] += 1
        del cache[x]
        st["evictions"] += 1

    def score(x, i):
        rec = max(0, 255 - (i - last_touch[x])) if x in last_touch else 0
        return (heat[x] << 8) | rec

    batch_first = {}
    for i, ld in enumerate(loads):
        layer, phase, batch = ld["layer"], ld["phase"], ld["batch"]
        batch_first.setdefault(batch, i)
        if pol:
            pol.begin_load(i, batch_first[batch])
        outcome = {}
        for r in ld["rows"]:
            row_codes = []
            for s, ex in enumerate(rows[r][3]):
                key = (layer, ex)
                d = drop[r][s] if drop is not None else 0
                if d == 2 or (d == 1 and key not in cache):
                    out["skipped"][(phase, layer)] += 1
                    per_batch[batch]["skipped"] += 1
                    row_codes.append(3)
                    continue
                tick += 1
                if key in outcome:
                    cache[key]["tick"] = tick
                    row_codes.append(outcome[key])
                    continue
                out["lookups"][(phase, layer)] += 1
                per_batch[batch]["lookups"] += 1
                heat[key] += 1
                last_touch[key] = i
                if key in cache:
                    out["hits"][(phase, layer)] += 1
                    per_batch[batch]["hits"] += 1
                    cache[key]["freq"] += 1
                    if pol:
                        pol.touch(key, i)
                    if cache[key]["spec"]:
                        cache[key]["spec"] = False
                        out["spec_hits"][(phase, layer)] += 1
                        per_batch[batch]["spec_hits"] += 1
                        outcome[key] = 2
                    else:
                        outcome[key] = 1
                else:
                    out["read"][(phase, layer)] += expert_bytes[layer]
                    per_batch[batch]["read"] += expert_bytes[layer]
                    cache[key] = {"freq": 1, "spec": False}
                    outcome[key] = 0
                    if pol:
                        pol.admit(key, i)
                cache[key]["tick"] = tick
                cache[key]["load"] = i
                cache[key]["next"] = next_use(key, i)
                row_codes.append(outcome[key])
            codes.append(row_codes)
        if not ld["rows"]:
            continue
        shielded = set()
        if retain and preds is not None:
            for m in range(1, ahead + 1):
                j = load_at(i, m)
                if j is None:
                    break
                shielded.update(predicted(j))
        if policy != "infinite":
            g = group_of((layer, 0))
            while used(g) > limit(g):
                v = victim(g, i, shielded)
                if v is None:
                    st["overflow"] += 1
                    break
                evict(v)
        st["peak_bytes"] = max(st["peak_bytes"], sum(expert_bytes[x[0]] for x in cache))
        if not (fill and preds is not None):
            continue
        j = load_at(i, ahead)
        if j is None:
            continue
        tl = loads[j]["layer"]
        attempts = 0
        for key in predicted(j):
            if key in cache:
                st["spec_resident"] += 1
                continue
            if cap is not None and attempts >= cap:
                st["spec_capped"] += 1
                continue
            attempts += 1
            ok = True
            if policy != "infinite":
                g = group_of(key)
                while used(g) + expert_bytes[key[0]] > limit(g):
                    v = victim(g, i, shielded)
                    if v is None:
                        st["spec_no_room"] += 1
                        ok = False
                        break
                    if guard and heat[v] >= 2:
                        sv = score(v, i)
                        if not (sv + sv // 4 + 4 * 256 <= score(key, i)):
                            st["spec_refused"] += 1
                            ok = False
                            break
                    evict(v)
            if not ok:
                continue
            tick += 1
            # A fill is most recent (tick and load both now), frequency 0, heat unchanged.
            cache[key] = {"freq": 0, "spec": True, "tick": tick, "load": i, "next": next_use(key, i)}
            if pol:
                (pol.fill if hasattr(pol, "fill") else pol.admit)(key, i)
            last_touch[key] = i
            st["spec_fills"] += 1
            filled.setdefault(j, []).append(key)
            out["spec_fills"][(phase, tl)] += 1
            out["spec_read"][(phase, tl)] += expert_bytes[tl]
            per_batch[batch]["spec_fills"] += 1
            per_batch[batch]["spec_read"] += expert_bytes[tl]
        st["peak_bytes"] = max(st["peak_bytes"], sum(expert_bytes[x[0]] for x in cache))
    st["spec_unused_end"] = sum(1 for c in cache.values() if c["spec"])
    st["spec_hits"] = sum(out["spec_hits"].values())
    return {**{k: dict(v) for k, v in out.items()}, "per_batch": {b: dict(v) for b, v in per_batch.items()},
            "codes": codes, "stats": dict(st), "filled": filled}


def naive_closed_drop(rows, weights, moe_layers, n_expert, expert_bytes, policy, budget_bytes, k, frac, phases, seed=0):
    """Closed-loop drop-cold F on the routings whose phase is in ``phases`` (docs/design.md, "drop" keys):
    a slot is flagged when its weight < F / k and it is not the routing's top-weighted slot (the
    first of equal maxima); the replay skips a flagged slot iff its expert is not cached then.

    rows: (batch, phase, layer, [expert ids]); weights: per row, k floats. Returns counts over the
    phase's routings (``routings``, ``routings_dropped``: with at least one slot skipped,
    ``experts_routed`` = k per routing, ``experts_dropped``: skipped slots) and all-phase
    ``lookups``/``hits`` per phase (0 prefill, 1 decode) with and without dropping."""
    drop = []
    for (_batch, phase, _layer, _ex), w in zip(rows, weights):
        top = 0
        for s in range(k):
            if w[s] > w[top]:
                top = s
        drop.append([1 if phase in phases and w[s] < frac / k and s != top else 0 for s in range(k)])
    got = naive_whatif(rows, moe_layers, n_expert, expert_bytes, policy, budget_bytes, seed, drop=drop)
    base = naive_whatif(rows, moe_layers, n_expert, expert_bytes, policy, budget_bytes, seed)
    out = {"routings": 0, "routings_dropped": 0, "experts_routed": 0, "experts_dropped": 0}
    for (_batch, phase, _layer, _ex), codes in zip(rows, got["codes"]):
        if phase not in phases:
            continue
        out["routings"] += 1
        out["experts_routed"] += len(codes)
        skipped = sum(1 for c in codes if c == 3)
        out["experts_dropped"] += skipped
        out["routings_dropped"] += skipped > 0
    for name, res in (("", got), ("_baseline", base)):
        for ph in (0, 1):
            out[f"lookups_{ph}{name}"] = sum(v for (p, _l), v in res["lookups"].items() if p == ph)
            out[f"hits_{ph}{name}"] = sum(v for (p, _l), v in res["hits"].items() if p == ph)
    return out
