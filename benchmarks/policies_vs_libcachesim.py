"""``s3fifo`` and ``sieve`` side by side with libCacheSim's S3FIFO and Sieve (pip: libcachesim==0.3.5).

The same top-1, equal-size, decode-only trace as :mod:`benchmarks.vs_libcachesim` (the top-ranked
expert of each decode routing of the 20,000-token 48 x 128 synthetic trace, 1 MiB per expert, so a
budget is a whole number of entries and every load is one lookup). libCacheSim runs with its
defaults (S3FIFO: small-size-ratio 0.10, ghost-size-ratio 0.90 of the cache's bytes,
move-to-main-threshold 2), reading the requests from an oracleGeneral file; its hits are its miss
ratio x requests.

Why the counts can be equal at all: libCacheSim evicts before inserting the requested object and
ours admits first and evicts after the load; both policies here keep the load's admissions out of
their queues until the eviction step is over (the module docstrings), so on one request per load
the queues hold the same objects in the same order. Where they still differ, the table says why.

    python -m benchmarks.policies_vs_libcachesim [--trace DIR]
"""

from __future__ import annotations

import argparse

from benchmarks._common import add_top1_trace_arg, machine, top1_line, top1_requests
from traces.util.units import MIB

ENTRIES = (8, 16, 19, 20, 64, 512, 2048)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_top1_trace_arg(ap)
    args = ap.parse_args()
    import libcachesim as lcs

    from replay.core.simulate import replay

    # s3fifo and sieve look no request ahead: no next uses in the file
    with top1_requests(lcs, args.trace, next_access=False) as (t, loads, obj, reader):
        n = obj.shape[0]
        print(f"machine: {machine()}")
        print(top1_line(t, obj, lcs))
        print(f"{'policy':7s} {'entries':>7s} {'hits ours':>10s} {'hits lcs':>10s} {'diff':>7s}  note")
        for policy, cls in (("s3fifo", lcs.S3FIFO), ("sieve", lcs.Sieve)):
            for entries in ENTRIES:
                ours = replay(loads, policy, float(entries)).hits
                miss_ratio, _ = cls(cache_size=entries * MIB).process_trace(reader)
                theirs = int(round(n * (1.0 - miss_ratio)))
                note = ""
                if policy == "s3fifo" and entries < 10:
                    note = ("small queue = 0 bytes: libCacheSim's S3FIFO_can_insert refuses every object "
                            "(size > small capacity), so it never hits; ours admits every miss")
                print(f"{policy:7s} {entries:7d} {ours:10d} {theirs:10d} {ours - theirs:7d}  {note}")


if __name__ == "__main__":
    main()
