"""The full default sweep of the real Qwen trace (9 budgets x 6 policies): replay time after
compilation (target < 1 s), and the whole ``moe-replay cache`` command with a warm JIT cache.

    python -m benchmarks.qwen_sweep [--csv ../shared/data/bigmoeonedge-2026-07-15/qwen.route.csv]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import best_of, machine

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "bigmoeonedge-2026-07-15"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("MOE_REPLAY_SHARED", ROOT.parent / "shared")) / "data"
                    / "bigmoeonedge-2026-07-15")
    args = ap.parse_args()
    from replay.core.simulate import default_budgets_mib, loads_of, sweep, warm_up
    from replay.policies import DEFAULT_POLICIES
    from traces import open_trace
    from traces.importers.bigmoe import import_bigmoe

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "qwen"
        import_bigmoe(args.data / "qwen.route.csv", out, metrics=args.data / "qwen.metrics")
        t = open_trace(out)
        loads = loads_of(t)
        budgets = default_budgets_mib(loads, t.recorded.get("budget_mib"))
        pols = list(DEFAULT_POLICIES)
        warm_up(pols)
        _ = loads.next_load
        print(f"machine: {machine()}")
        print(f"trace: {t.path.name}: {loads.entries.size:,} routed slots; budgets {budgets}; policies {pols}")
        for threads in (1, os.cpu_count() or 1):
            s = best_of(lambda th=threads: sweep(loads, pols, budgets, threads=th, show_progress=False), 3)
            print(f"sweep replay time, {threads} thread(s): {s:.3f} s for {len(budgets) * len(pols)} cells (target < 1 s)")
        cmd = [sys.executable, "-m", "replay.cli", "cache", str(out), "--json"]
        subprocess.run(cmd, cwd=ROOT, capture_output=True, check=True)  # fills the JIT cache if cold
        walls = []
        for _ in range(3):
            t0 = time.perf_counter()
            subprocess.run(cmd, cwd=ROOT, capture_output=True, check=True)
            walls.append(time.perf_counter() - t0)
        print(f"whole CLI command (`moe-replay cache TRACE --json`, warm JIT cache): best {min(walls):.2f} s, "
              f"worst {max(walls):.2f} s of 3 (process start, imports, reading the trace, replay, output)")


if __name__ == "__main__":
    main()
