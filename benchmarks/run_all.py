"""Run every benchmark in turn (``make bench``); each prints its own machine line and figures.

    python -m benchmarks.run_all [--skip synth_scale,stale_gate]

Benchmarks are not tests: they report figures and ratios against targets, they do not fail a build.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

ALL = ["lru_throughput", "vs_libcachesim", "qwen_sweep", "stale_gate", "capture_overhead", "synth_scale", "export_libcachesim"]
ALL += ["sweep_scale"]
ALL += ["capture_hf_overhead"]
ALL += ["quality_overhead"]
ALL += ["cache_e2e"]
ALL += ["format_v2"]
ALL += ["data_path"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip", default="", help="comma-separated benchmark names to skip")
    args = ap.parse_args()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    failed = []
    for name in ALL:
        if name in skip:
            continue
        print(f"\n=== benchmarks.{name}", flush=True)
        rc = subprocess.call([sys.executable, "-m", f"benchmarks.{name}"])
        if rc != 0:
            failed.append(name)
    if failed:
        print(f"\nthese benchmarks did not run to the end: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
