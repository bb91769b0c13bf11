"""``export libcachesim`` checked by libCacheSim itself (pip: libcachesim==0.3.5, the ``bench`` extra).

Each trace is exported with ``moe-replay export libcachesim`` (oracleGeneral: one request per unique
(layer, expert) per load, obj id = layer x n_expert + expert, size = expert bytes, next access
filled in) and replayed by libCacheSim's LRU and Belady through its C++ reader; the hit counts are
set beside ``replay.cache``'s (all phases: libCacheSim has no phases).

- top-1, decode only, 1 MiB per expert: every load is one lookup, so "admit, then evict after the
  load" (ours) and "evict, then insert" (libCacheSim) hold the same contents: the counts must be
  equal at every budget (the acceptance check of issue 16).
- top-8, the same trace shape: a load holds up to 8 requests; libCacheSim may evict an expert the
  same load requested a moment before (ours never evicts the current load's experts), and its
  Belady looks ahead per request where ours looks ahead per load. The counts differ; the table
  shows by how much (README "Export to libCacheSim").

    python -m benchmarks.export_libcachesim [--tokens N]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks._common import machine
from traces.util.units import MIB

ENTRIES = (8, 48, 96, 256, 1024)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    args = ap.parse_args()
    import libcachesim as lcs

    import replay
    from traces.io.exports import export
    from traces.synth.generator import SynthConfig, write_synthetic

    print(f"machine: {machine()}")
    print(f"libcachesim {getattr(lcs, '__version__', '0.3.5')}; synthetic 48 x 128, {args.tokens} decode tokens, "
          "no prompt batch, 1 MiB per expert")
    with tempfile.TemporaryDirectory() as d:
        for k in (1, 8):
            tdir = Path(d) / f"top{k}"
            write_synthetic(tdir, SynthConfig(layers=48, experts=128, top_k=k, tokens=args.tokens, prompt_tokens=0,
                                              routing_only=True, expert_bytes=MIB), force=True)
            out = export("libcachesim", tdir, Path(d) / f"top{k}.oracleGeneral")
            n = out.stat().st_size // 24
            reader = lcs.TraceReader(str(out), lcs.TraceType.ORACLE_GENERAL_TRACE)
            ours = replay.cache(tdir, policies=("lru", "belady"), budgets_mib=[float(e) for e in ENTRIES], phase="all")
            print(f"\ntop-{k}: {n:,} requests")
            print(f"{'policy':7s} {'entries':>7s} {'hits ours':>10s} {'hits lcs':>10s} {'diff':>7s}")
            for row in ours.filter(ours["layer"].is_null()).iter_rows(named=True):
                cls = {"lru": lcs.LRU, "belady": lcs.Belady}[row["policy"]]
                miss_ratio, _ = cls(cache_size=int(row["budget_mib"]) * MIB).process_trace(reader)
                theirs = int(round(n * (1.0 - miss_ratio)))
                print(f"{row['policy']:7s} {int(row['budget_mib']):7d} {row['hits']:10d} {theirs:10d} "
                      f"{row['hits'] - theirs:7d}")


if __name__ == "__main__":
    main()
