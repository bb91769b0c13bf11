"""Single-thread LRU replay throughput: routed-slot lookups per second, after compilation.

Trace: the project's synthetic generator, 20,000 decode tokens (+32 prefill), 48 MoE layers x 128
experts, top-8, routing only. Target (issue 3): >= 100 million routed slots per second.

``M slots/s`` is :func:`replay.core.simulate.replay` as the tool runs it: the Numba driver with the
policy's hooks inlined, best of 5, compile time excluded by a warm-up.

    python -m benchmarks.lru_throughput [--trace DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks._common import best_of, machine, synthetic_trace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", type=Path, default=Path(tempfile.gettempdir()) / "moe-replay-bench-synth20k")
    args = ap.parse_args()
    from replay.core.simulate import loads_of, replay, warm_up
    from traces import open_trace

    t = open_trace(synthetic_trace(args.trace))
    loads = loads_of(t)
    slots = loads.entries.size
    warm_up(["lru", "layer", "infinite"])
    T = loads.token_cycle_bytes / (1 << 20)
    print(f"machine: {machine()}")
    print(f"trace: {t.path}, {loads.entries.shape[0]:,} routings x top-{loads.entries.shape[1]} = {slots:,} routed slots; "
          f"T = {T:.0f} MiB")
    print(f"{'policy':8s} {'budget_mib':>10s} {'hit_pct_cum':>11s} {'best_s':>8s} {'M slots/s':>10s} {'vs 100M target':>14s}")
    for policy in ("lru", "layer", "infinite"):
        for budget in (round(T / 2), 4000, 8000):
            res = replay(loads, policy, budget)
            sec = best_of(lambda p=policy, b=budget: replay(loads, p, b), 5)
            rate = slots / sec / 1e6
            print(f"{policy:8s} {budget:10d} {res.hit_pct_cum:11.2f} {sec:8.4f} {rate:10.1f} {rate / 100:13.2f}x")
    print("(best of 5 single-thread replays through replay.core.simulate.replay, compile time excluded by a warm-up: the Numba "
          "driver with the policy's hooks inlined)")


if __name__ == "__main__":
    main()
