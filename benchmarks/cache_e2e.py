"""`moe-replay cache` end to end (whole process, one run) against libCacheSim's `process_trace`.

The trace: synthetic, 100,000 tokens x 48 MoE layers x 128 experts, top-1, decode only, routing
only (4.8 M routing rows; written first if absent). One budget, LRU. Each side is a fresh process,
timed from outside (wall clock; user + system CPU and peak RSS of that process, from /usr/bin/time):

- ``ours``: ``python -m replay.cli cache TRACE --budgets B --policies lru --json --stream off|on``
  (import, open, check every row, cut loads, replay, print);
- ``lcs``: ``python -c "import libcachesim; LRU(B).process_trace(oracleGeneral file)"`` on the
  same requests (``moe-replay export libcachesim``, written once, not timed); the script also
  reports ``process_trace``'s own seconds, which the issue's target adds to Python's start-up
  (``python -c pass``, timed here too);
- ``program``: the same ``cache`` command on a 100-token trace of the same shape: the peak RSS
  of the program itself (Python, NumPy, Arrow, Numba, Polars, the kernels), which
  ``bytes per routing`` subtracts.

Both report the same hits (checked). Rounds are interleaved (one run of each per round) and the
best of each is printed, with the load average at the start.

    python -m benchmarks.cache_e2e [--trace DIR] [--budget-mib 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import machine

LCS = r"""
import sys, time
t0 = time.perf_counter()
import libcachesim as lcs
r = lcs.TraceReader(sys.argv[1], lcs.TraceType.ORACLE_GENERAL_TRACE)
c = lcs.LRU(cache_size=int(float(sys.argv[2]) * 2**20))
t1 = time.perf_counter()
miss_ratio, _ = c.process_trace(r)
t2 = time.perf_counter()
print(miss_ratio, t1 - t0, t2 - t1)
"""


def run(cmd: list[str]) -> dict:
    """Run ``cmd`` under /usr/bin/time (a small parent, so the peak RSS is the command's own, not a
    forked copy of this process); its wall seconds, CPU seconds (user + system), peak RSS (MiB), stdout."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as tf:
        t0 = time.perf_counter()
        p = subprocess.run(["/usr/bin/time", "-f", "%U %S %M", "-o", tf.name, *cmd], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed: {p.stderr[-500:]}")
        user, sys_, rss_kib = tf.read().split()[-3:]
    return {"wall_s": wall, "cpu_s": float(user) + float(sys_), "rss_mib": int(rss_kib) / 1024, "out": p.stdout}


def synth(path: Path, tokens: int) -> Path:
    if not (path / "trace.json").is_file():
        subprocess.run([sys.executable, "-m", "replay.cli", "synth", str(path), "--layers", "48", "--experts", "128",
                        "--top-k", "1", "--tokens", str(tokens), "--prompt-tokens", "0", "--routing-only", "--force"],
                       check=True, stdout=subprocess.DEVNULL)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", type=Path, default=Path("/tmp/moe-replay-bench-top1-100k"))
    ap.add_argument("--budget-mib", type=float, default=1000.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    trace = synth(args.trace, 100_000)
    tiny = synth(Path("/tmp/moe-replay-bench-top1-100"), 100)
    oracle = trace.with_name(trace.name + ".oracleGeneral.bin")
    if not oracle.is_file():
        subprocess.run([sys.executable, "-m", "replay.cli", "export", "libcachesim", str(trace), str(oracle)], check=True,
                       stdout=subprocess.DEVNULL)
    b = f"{args.budget_mib:g}"
    ours = {m: [sys.executable, "-m", "replay.cli", "cache", str(trace), "--budgets", b, "--policies", "lru", "--json",
                "--stream", m] for m in ("off", "on")}
    program = [sys.executable, "-m", "replay.cli", "cache", str(tiny), "--budgets", b, "--policies", "lru", "--json"]
    lcs = [sys.executable, "-c", LCS, str(oracle), b]
    bare = [sys.executable, "-c", "pass"]
    print(f"machine: {machine()}")
    for cmd in (*ours.values(), lcs, program):  # warm: kernels in the Numba cache, files in the page cache
        run(cmd)
    res: dict[str, list[dict]] = {k: [] for k in ("off", "on", "lcs", "program", "python")}
    for _ in range(args.rounds):
        for m, cmd in ours.items():
            res[m].append(run(cmd))
        res["lcs"].append(run(lcs))
        res["program"].append(run(program))
        res["python"].append(run(bare))
    rows = json.loads(res["off"][0]["out"])["rows"][0]
    n, hits = rows["lookups"], rows["hits"]
    for m in ("off", "on"):
        got = json.loads(res[m][0]["out"])["rows"][0]
        assert (got["lookups"], got["hits"]) == (n, hits), m
    miss_ratio, lcs_setup, _ = (float(x) for x in res["lcs"][0]["out"].split())
    lcs_hits = round(n * (1 - miss_ratio))
    assert lcs_hits == hits, f"libCacheSim {lcs_hits} hits, ours {hits}"
    best = {k: {f: min(r[f] for r in v) for f in ("wall_s", "cpu_s", "rss_mib")} for k, v in res.items()}
    pt = min(float(r["out"].split()[2]) for r in res["lcs"])
    base = best["program"]["rss_mib"]
    print(f"trace: {trace} ({n:,} routings = requests, top-1, decode only), LRU at {b} MiB: {hits:,} hits on both sides")
    print(f"{'run':44s} {'wall s':>7s} {'CPU s':>6s} {'peak RSS MiB':>12s} {'B/routing beyond program':>25s}")
    for k, label in (("off", "ours: cache --stream off (auto's choice here)"), ("on", "ours: cache --stream on"),
                     ("lcs", "libCacheSim: python + import + process_trace"), ("program", "ours on a 100-token trace"),
                     ("python", "python -c pass")):
        r = best[k]
        extra = (f"{(r['rss_mib'] - base) * 2**20 / n:25.1f}" if k in ("off", "on") else f"{'':25s}")
        print(f"{label:44s} {r['wall_s']:7.2f} {r['cpu_s']:6.2f} {r['rss_mib']:12.0f} {extra}")
    target = pt + best["python"]["wall_s"]
    print(f"libCacheSim process_trace alone {pt:.3f} s ({n / pt / 1e6:.1f} M requests/s; its import and reader "
          f"{lcs_setup:.3f} s apart); the target, process_trace + Python's start-up: {target:.2f} s; "
          f"ours / target: off {best['off']['wall_s'] / target:.1f}x, on {best['on']['wall_s'] / target:.1f}x "
          f"(best of {args.rounds} interleaved rounds)")


if __name__ == "__main__":
    main()
