"""Sweep throughput: cells per second of a 200-cell [cache] grid on the real Qwen trace with 1 and
2 local workers and with Ray on this machine (ratio to 1 worker; Ray's overhead per cell).

    python -m benchmarks.sweep_scale [--policies 8] [--budgets 25] [--ray-cpus 2]
    python -m benchmarks.sweep_scale --trace T --policy-list lru,lfu-incache,layer,lfru,s3fifo,sieve \
        --budgets 4 --workers 1 --ray-cpus 0     # seconds per cell on another trace (the README's cost example)

Each run is the whole ``replay.sweep`` call into a fresh results directory: pool (or Ray task)
start, each worker loading the kernels from the Numba cache and preparing the trace's loads once,
the replays, the chunk writes and the tables. Ray is started once before its run (its start time
is printed apart, not counted per cell). The JIT cache is filled first by a small sweep.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import machine

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ["lru", "lfu", "lfu-incache", "layer", "lfru", "random", "s3fifo", "sieve"]


def _grid(path: Path, trace: Path, policies: list[str], budgets: list[float]) -> Path:
    path.write_text(f'traces = ["{trace}"]\n[cache]\npolicies = {policies!r}\nbudgets_mib = {budgets!r}\n'.replace("'", '"'))
    return path


def _timed(grid: Path, out: Path, **kw) -> float:
    import replay

    t0 = time.perf_counter()
    s = replay.sweep(grid, out, **kw)
    wall = time.perf_counter() - t0
    assert int(s["computed"].sum()) == int(s["cells"].sum()), "every cell is computed in a fresh directory"
    return wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("MOE_REPLAY_SHARED", ROOT.parent / "shared")) / "data"
                    / "bigmoeonedge-2026-07-15")
    ap.add_argument("--policies", type=int, default=8, help="policies of the grid (of: " + ", ".join(POLICIES) + ")")
    ap.add_argument("--budgets", type=int, default=25, help="budgets of the grid (geometric from T/2 to W)")
    ap.add_argument("--policy-list", default=None, help="comma-separated policies (instead of --policies)")
    ap.add_argument("--trace", type=Path, default=None, help="an existing trace directory (default: the Qwen trace, imported)")
    ap.add_argument("--workers", default="1,2", help="local pool sizes to time, comma-separated")
    ap.add_argument("--ray-cpus", type=int, default=2, help="CPUs of the local Ray instance (0 = skip Ray)")
    args = ap.parse_args()
    sizes = [int(w) for w in args.workers.split(",")]
    from replay.core.simulate import loads_of
    from traces import open_trace
    from traces.util.units import MIB

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        trace = args.trace.resolve() if args.trace else d / "qwen"
        if not args.trace:
            subprocess.run([sys.executable, "-m", "replay.cli", "import", "bigmoe", str(args.data / "qwen.route.csv"), str(trace),
                            "--metrics", str(args.data / "qwen.metrics")], cwd=ROOT, check=True, capture_output=True)
        loads = loads_of(open_trace(trace))
        T, W = loads.token_cycle_bytes / MIB, loads.working_set_bytes / MIB
        n = args.budgets
        budgets = [float(f"{T / 2 * (2 * W / T) ** (i / max(1, n - 1)):.3g}") for i in range(n)]
        budgets = list(dict.fromkeys(budgets))
        pols = args.policy_list.split(",") if args.policy_list else POLICIES[:args.policies]
        cells = len(pols) * len(budgets)
        grid = _grid(d / "grid.toml", trace, pols, budgets)
        print(f"machine: {machine()}")
        print(f"trace: {args.trace or 'Qwen'} ({loads.entries.size:,} routed slots, T = {T:.0f} MiB, W = {W:.0f} MiB); grid: {len(pols)} "
              f"policies x {len(budgets)} budgets = {cells} [cache] cells")
        _timed(_grid(d / "warm.toml", trace, pols, budgets[:1]), d / "warm", workers=1)  # fills the JIT cache if cold

        walls = {}
        for w in sizes:
            walls[f"local, {w} worker{'s' if w > 1 else ''}"] = _timed(grid, d / f"local{w}", workers=w)
        if args.ray_cpus:
            import ray

            t0 = time.perf_counter()
            ray.init(num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False)
            ray_start = time.perf_counter() - t0
            walls[f"ray, {args.ray_cpus} CPUs"] = _timed(grid, d / "ray", engine="ray")
            ray.shutdown()
            same = all((d / "ray" / "cache.parquet").read_bytes() == (d / f"local{w}" / "cache.parquet").read_bytes()
                       for w in sizes)
        base = next(iter(walls.values()))
        for name, wall in walls.items():
            print(f"{name:>18}: {wall:6.2f} s, {cells / wall:6.1f} cells/s, {wall / cells * 1000:6.1f} ms per cell, "
                  f"{base / wall:4.2f}x {next(iter(walls))}")
        if args.ray_cpus and "local, 2 workers" in walls:
            extra = walls[f"ray, {args.ray_cpus} CPUs"] - walls["local, 2 workers"]
            print(f"ray start (ray.init, local instance): {ray_start:.1f} s, not counted above; ray overhead against the "
                  f"local pool at equal parallelism: {extra / cells * 1000:+.1f} ms per cell; tables byte-identical to the "
                  f"local pool's: {same}")
        print(f"cpu cores: {os.cpu_count()}; load average now {os.getloadavg()[0]:.2f} (other work on this machine skews "
              "the ratios)" if not math.isnan(os.getloadavg()[0]) else "")


if __name__ == "__main__":
    main()
