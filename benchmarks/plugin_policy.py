"""A policy plugin replays at the speed of a built-in: the FIFO example (examples/fifo_policy.py,
loaded from its file) against the built-in ``lru`` (the same O(1) linked list, plus moving an
entry on every hit), on the same trace, budgets and run, interleaved best-of-5.

Trace: the project's synthetic generator, 5,000 decode tokens (+32 prefill), 48 MoE layers x 128
experts, top-8, routing only (``--tokens`` to change). Figure: routed-slot lookups per second for
each, and fifo / lru. The plugin is compiled into the same driver (its hooks inlined), so the
ratio should be about 1 (FIFO does less work on a hit than LRU).

    python -m benchmarks.plugin_policy [--trace DIR] [--tokens N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchmarks._common import machine, synthetic_trace

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=5000)
    ap.add_argument("--trace", type=Path, default=None)
    args = ap.parse_args()
    from replay.core.simulate import loads_of, replay, warm_up
    from replay.policies import add_policy_file
    from traces import open_trace

    path = args.trace or Path(tempfile.gettempdir()) / f"moe-replay-bench-synth{args.tokens}"
    t = open_trace(synthetic_trace(path, tokens=args.tokens))
    fifo = add_policy_file(ROOT / "examples" / "fifo_policy.py")
    loads = loads_of(t)
    slots = loads.entries.size
    warm_up(["lru", fifo])
    T = loads.token_cycle_bytes / (1 << 20)
    print(f"machine: {machine()}")
    print(f"trace: {t.path}, {slots:,} routed slots; T = {T:.0f} MiB")
    print(f"{'budget_mib':>10s} {'lru M slots/s':>14s} {'fifo M slots/s':>15s} {'fifo/lru':>9s} {'hit% lru':>9s} {'hit% fifo':>9s}")
    for budget in (round(T / 2), round(2 * T), round(8 * T)):
        best = {"lru": float("inf"), fifo: float("inf")}
        for _ in range(5):  # interleaved, so machine load hits both alike
            for p in best:
                t0 = time.perf_counter()
                replay(loads, p, budget)
                best[p] = min(best[p], time.perf_counter() - t0)
        hit = {p: replay(loads, p, budget).hit_pct_cum for p in best}
        r = {p: slots / s / 1e6 for p, s in best.items()}
        print(f"{budget:10d} {r['lru']:14.1f} {r[fifo]:15.1f} {r[fifo] / r['lru']:9.2f} {hit['lru']:9.2f} {hit[fifo]:9.2f}")
    print("(best of 5 interleaved single-thread replays each; compile time excluded by a warm-up)")


if __name__ == "__main__":
    main()
