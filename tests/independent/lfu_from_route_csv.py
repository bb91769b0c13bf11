"""An independent replay of whole-run LFU (and, as checks, in-cache LFU and LRU) straight from a
BigMoeOnEdge route CSV: it shares no code with the project (not its importer, kernels or naive
twin). tests/test_cache_real.py pins figures this script printed; rerun it to re-derive them:

    python tests/independent/lfu_from_route_csv.py ../shared/data/bigmoeonedge-2026-07-15/qwen.route.csv 1000 2000

Semantics (docs/design.md "Replay semantics"): a load is a run of rows with the same (turn, phase,
layer) and, in decode, the same step; each unique (layer, expert) of a load is one lookup (hit if
cached, else a miss admitted at once); after the load, evict until the cache's bytes fit the budget
(floor(MiB x 2^20)), never an entry the load touched. lfu evicts the smallest count of loads that
looked the entry up since the run began (kept across evictions); lfu-incache the count since
admission; ties (and lru) go to the least recent visit (one tick per routed slot, file order).
"""

from __future__ import annotations

import sys


def read(path):
    sizes, rows = {}, []
    with open(path) as f:
        for line in f:
            if line.startswith("# layer="):
                kv = dict(p.split("=") for p in line[2:].split())
                sizes[int(kv["layer"])] = int(kv["expert_bytes"])
            elif line.startswith("#") or line.startswith("turn,"):
                continue
            else:
                turn, phase, step, layer, _slot, expert = (int(x) for x in line.split(",")[:6])
                rows.append((turn, phase, step, layer, expert))
    return sizes, rows


def loads_of(rows):
    out, last = [], None
    for turn, phase, step, layer, expert in rows:
        key = (turn, phase, layer, step if phase == 1 else None)
        if key != last:
            out.append((phase, []))
            last = key
        out[-1][1].append((layer, expert))
    return out


def replay(sizes, loads, policy, budget_mib):
    budget = int(budget_mib * (1 << 20))
    cached, run_count, in_count, last = set(), {}, {}, {}
    used = tick = 0
    look = [0, 0]
    hit = [0, 0]
    for phase, visits in loads:
        seen = set()
        for key in visits:
            tick += 1
            last[key] = tick
            if key in seen:
                continue
            seen.add(key)
            look[phase] += 1
            run_count[key] = run_count.get(key, 0) + 1
            if key in cached:
                hit[phase] += 1
                in_count[key] += 1
            else:
                cached.add(key)
                in_count[key] = 1
                used += sizes[key[0]]
        while used > budget:
            cands = [k for k in cached if k not in seen]
            if not cands:
                break
            if policy == "lfu":
                v = min(cands, key=lambda k: (run_count[k], last[k]))
            elif policy == "lfu-incache":
                v = min(cands, key=lambda k: (in_count[k], last[k]))
            else:
                v = min(cands, key=lambda k: last[k])
            cached.discard(v)
            used -= sizes[v[0]]
    return look, hit


if __name__ == "__main__":
    sizes, rows = read(sys.argv[1])
    loads = loads_of(rows)
    for b in [float(x) for x in sys.argv[2:]]:
        for policy in ("lfu", "lfu-incache", "lru"):
            look, hit = replay(sizes, loads, policy, b)
            print(f"{policy:12s} {b:7g} MiB  decode {hit[1]}/{look[1]} = {100 * hit[1] / look[1]:.3f}%  "
                  f"cumulative {sum(hit)}/{sum(look)} = {100 * sum(hit) / sum(look):.3f}%")
