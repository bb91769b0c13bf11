"""Single-thread LRU replay throughput: routed-slot lookups per second, after compilation.

Trace: the project's synthetic generator, 20,000 decode tokens (+32 prefill), 48 MoE layers x 128
experts, top-8, routing only. Target (issue 3): >= 100 million routed slots per second.

``M slots/s`` is :func:`replay.cache.replay` as the tool runs it. For ``lru`` and ``layer``, two more
columns put the Numba driver and its ahead-of-time compiled twin (``replay._aot``, :mod:`replay.aot`)
side by side on the same loads, from the same fresh state, best of 5 each, alternating (so both see
the same machine load); the two must leave identical state and totals, or the benchmark stops.

    python -m benchmarks.lru_throughput [--trace DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchmarks._common import best_of, machine, synthetic_trace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", type=Path, default=Path(tempfile.gettempdir()) / "moe-replay-bench-synth20k")
    args = ap.parse_args()
    from replay import aot
    from replay.cache import loads_of, replay, warm_up
    from traces import open_trace

    t = open_trace(synthetic_trace(args.trace))
    loads = loads_of(t)
    slots = loads.entries.size
    warm_up(["lru", "layer", "infinite"])
    T = loads.token_cycle_bytes / (1 << 20)
    compiled = aot.load()
    print(f"machine: {machine()}")
    print(f"trace: {t.path}, {loads.entries.shape[0]:,} routings x top-{loads.entries.shape[1]} = {slots:,} routed slots; "
          f"T = {T:.0f} MiB")
    print(f"{'policy':8s} {'budget_mib':>10s} {'hit_pct_cum':>11s} {'best_s':>8s} {'M slots/s':>10s} {'vs 100M target':>14s}"
          f" {'Numba M/s':>9s} {'C M/s':>7s} {'C / Numba':>9s}")
    for policy in ("lru", "layer", "infinite"):
        for budget in (round(T / 2), 4000, 8000):
            res = replay(loads, policy, budget)
            sec = best_of(lambda p=policy, b=budget: replay(loads, p, b), 5)
            rate = slots / sec / 1e6
            side = ""
            if compiled is not None and policy in ("lru", "layer"):
                numba_s, c_s = _side_by_side(compiled, loads, policy, budget)
                side = f" {slots / numba_s / 1e6:9.1f} {slots / c_s / 1e6:7.1f} {numba_s / c_s:8.2f}x"
            print(f"{policy:8s} {budget:10d} {res.hit_pct_cum:11.2f} {sec:8.4f} {rate:10.1f} {rate / 100:13.2f}x{side}")
    print("(best of 5 single-thread replays through replay.cache.replay, compile time excluded by a warm-up: the Numba "
          "driver with the policy's hooks inlined, or for lru and layer its compiled twin when replay._aot is built)")
    if compiled is None:
        print(f"(no Numba / C columns: {aot.why_unavailable()})")
    else:
        print("(Numba / C: the Numba driver and replay._aot.replay_lru on the same driver arguments, best of 5 each, "
              "alternating; the ratio is Numba's best time over C's)")


def _side_by_side(compiled, loads, policy: str, budget: float) -> tuple[float, float]:
    """Best-of-5 seconds of the Numba driver and of its C twin on fresh copies of the same state,
    alternating; raises if the two leave different state or totals."""
    from replay.cache import _driver_args, budget_bytes
    from replay.cache_kernel import make_kernel, no_options
    from replay.policies import policy_module

    pm = policy_module(policy)
    kern = make_kernel(policy, pm, whatif=False, slots=False)  # Numba's, whichever replay() runs
    best_n = best_c = float("inf")
    for i in range(6):  # the first Numba call loads (or compiles) the kernel: not timed
        a, _, _ = _driver_args(loads, pm, budget_bytes(budget), 0, False, None, None, no_options())
        t0 = time.perf_counter()
        kern(*a)
        if i:
            best_n = min(best_n, time.perf_counter() - t0)
        c, _, _ = _driver_args(loads, pm, budget_bytes(budget), 0, False, None, None, no_options())
        t0 = time.perf_counter()
        compiled.replay_lru(*c[:6], *c[7:13], c[16])  # the driver's arguments less next_load, slot_out, drop, pred
        if i:
            best_c = min(best_c, time.perf_counter() - t0)
        # ent, grp, ps, acc, bacc, stats
        if any(x.tobytes() != y.tobytes() for x, y in zip(a[7:13], c[7:13])):
            raise AssertionError(f"{policy} at {budget} MiB: the C replay and the Numba replay differ")
    return best_n, best_c


if __name__ == "__main__":
    main()
