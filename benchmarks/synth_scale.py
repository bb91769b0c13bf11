"""Synthetic trace generation at scale: peak memory and time.

Generates a 100,000-token trace (48 MoE layers x 128 experts, top-8, routing only) in a child
process and reports its peak resident memory (ru_maxrss of the child), wall time, CPU time (user +
sys of the child: on a shared machine the steadier figure) and tokens per second by each. The whole
command is timed: Python's start-up, the generation, the Parquet writes and the checks before the
rename (rows in memory, the staged trace's metadata, schema and row counts read back). The trace
is streamed to disk part by part, so peak memory should not grow with the number of tokens.
``--rank R`` times the low-rank model (``synth --rank``).

    python -m benchmarks.synth_scale [--tokens 100000] [--rank 16] [--out /tmp/moe-replay-bench-synth]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import time

from benchmarks._common import machine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rank", type=int, default=None, help="synth --rank (default: the full-width model)")
    ap.add_argument("--out", default="/tmp/moe-replay-bench-synth")
    args = ap.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    cmd = [sys.executable, "-m", "replay.cli", "synth", args.out, "--layers", str(args.layers), "--experts",
           str(args.experts), "--top-k", str(args.top_k), "--tokens", str(args.tokens), "--prompt-tokens", "0",
           "--routing-only", "--force"] + ([] if args.rank is None else ["--rank", str(args.rank)])
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak_mib, cpu = ru.ru_maxrss / 1024, ru.ru_utime + ru.ru_stime
    size = sum(p.stat().st_size for p in __import__("pathlib").Path(args.out).rglob("*") if p.is_file())
    print(f"machine: {machine()}")
    model = "full-width model" if args.rank is None else f"--rank {args.rank}"
    print(f"synth {args.tokens:,} tokens x {args.layers} layers x {args.experts} experts top-{args.top_k} (routing only, {model}): "
          f"wall {wall:.1f} s ({args.tokens / wall:,.0f} tokens/s), CPU {cpu:.1f} s ({args.tokens / cpu:,.0f} tokens/s), "
          f"peak RSS {peak_mib:.0f} MiB, trace {size / 2**20:.0f} MiB on disk")


if __name__ == "__main__":
    main()
