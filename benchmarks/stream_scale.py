"""Streamed vs in-memory cache replay: peak memory and lookups per second, whole process.

Replays LRU at one budget over a synthetic trace (default 1,000,000 tokens, 48 MoE layers x 128
experts, top-8, routing only; written first if absent, which takes long: see synth_scale) twice,
each in a fresh child process that opens the trace and replays it as ``cache --stream off|on``
does (the rows checked as they are read: ``open_trace(defer_rows=True)``):

- ``in-memory``: :func:`replay.core.simulate.loads_of` (the whole trace's loads, ~17 bytes per load + 4 x
  top_k per routing row) then :func:`replay.core.simulate.replay`;
- ``streamed``: :func:`replay.core.streaming.replay_stream` (one part at a time, the cache state
  carried across parts).

Each child prints its peak RSS (ru_maxrss, the whole process: Python, Numba, Arrow included),
its end-to-end seconds (open to result) and the lookups per second of the replay kernel alone and
end to end; both must report the same hits.

    python -m benchmarks.stream_scale [--tokens 1000000] [--top-k 8] [--budget-mib 4096] [--trace DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks._common import machine

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from traces import open_trace
import importlib
cache = importlib.import_module("replay.core.simulate")
from replay.core.streaming import replay_stream
mode, path, budget = sys.argv[1], sys.argv[2], float(sys.argv[3])
cache.warm_up(["lru"])
t1 = time.perf_counter()
tr = open_trace(path, defer_rows=True)
if mode == "in-memory":
    res = cache.replay(cache.loads_of(tr), "lru", budget)
else:
    res = replay_stream(tr, [("lru", budget)])[1][0]
t2 = time.perf_counter()
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"mode": mode, "rows": tr.n_rows, "lookups": res.lookups, "hits": res.hits, "kernel_s": res.seconds,
                  "open_to_result_s": t2 - t1, "startup_s": t1 - t0, "cpu_s": ru.ru_utime + ru.ru_stime,
                  "peak_rss_mib": ru.ru_maxrss / 1024}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--budget-mib", type=float, default=4096.0)
    ap.add_argument("--trace", type=Path, default=None, help="an existing trace (default: synthesize one under /tmp)")
    args = ap.parse_args()
    trace = args.trace
    if trace is None:
        trace = Path(f"/tmp/moe-replay-bench-stream-{args.tokens}-{args.layers}x{args.experts}-k{args.top_k}")
        if not (trace / "trace.json").is_file():
            subprocess.run([sys.executable, "-m", "replay.cli", "synth", str(trace), "--layers", str(args.layers), "--experts",
                            str(args.experts), "--top-k", str(args.top_k), "--tokens", str(args.tokens), "--prompt-tokens", "0",
                            "--routing-only", "--force"], check=True, stdout=subprocess.DEVNULL)
    print(f"machine: {machine()}")
    out = {}
    for mode in ("in-memory", "streamed"):
        p = subprocess.run([sys.executable, "-c", CHILD, mode, str(trace), str(args.budget_mib)], check=True,
                           capture_output=True, text=True)
        r = json.loads(p.stdout.strip().splitlines()[-1])
        out[mode] = r
        print(f"{mode:9s}  {r['rows']:,} routing rows, {r['lookups']:,} lookups: peak RSS {r['peak_rss_mib']:,.0f} MiB "
              f"({r['peak_rss_mib'] * 2**20 / max(r['rows'], 1):.0f} B per row, whole process), open+replay "
              f"{r['open_to_result_s']:.2f} s = {r['lookups'] / r['open_to_result_s'] / 1e6:.2f} M lookups/s end to end "
              f"(start-up and kernel load {r['startup_s']:.2f} s apart; process CPU {r['cpu_s']:.2f} s), "
              f"kernel {r['lookups'] / max(r['kernel_s'], 1e-9) / 1e6:.1f} M lookups/s")
    a, b = out["in-memory"], out["streamed"]
    assert (a["lookups"], a["hits"]) == (b["lookups"], b["hits"]), "streamed and in-memory replays disagree"
    print(f"streamed / in-memory: peak RSS {b['peak_rss_mib'] / a['peak_rss_mib']:.2f}x, end-to-end lookups/s "
          f"{a['open_to_result_s'] / b['open_to_result_s']:.2f}x, kernel lookups/s {a['kernel_s'] / max(b['kernel_s'], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
