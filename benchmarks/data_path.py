"""The replay's data path against libCacheSim's ``process_trace``, side by side in one run, with the
spread round by round (``benchmarks/RESULTS.md``, "Data path after the fused load pass").

Same traces and sides as :mod:`benchmarks.format_v2` (b), version 2 only: synthetic, top-1, decode
only, routing only, 48 MoE layers x 128 experts of 1 MiB, 20,000 and 100,000 tokens (0.96 M and
4.8 M routings). Ours: ``open_trace(defer_rows=True)``, ``loads_of`` (read every part, check and cut
its rows in one pass) and ``replay`` (Belady with each load's next use computed inside the timing),
one thread besides the read-ahead, Numba kernels compiled beforehand. libCacheSim: ``LRU/Belady(
cache_size).process_trace(reader)`` on an oracleGeneral file of the same requests (next-access
times written beforehand, not timed). Hits must be identical.

Throughput = (4.8 M - 0.96 M) requests over the difference of the two traces' seconds, so start-up
costs cancel. Each round runs every side once on both traces (interleaved); the table gives the
ratio of the best times (wall-clock and CPU seconds of this process, all threads) and, round by
round, the ratio of that round's differences (min / median / max), since a shared machine's speed
moves within a run.

    python -m benchmarks.data_path [--dir /tmp/moe-replay-bench-format] [--rounds 7] [--entries 512,2048]
"""

from __future__ import annotations

import argparse
import os
import statistics

from benchmarks._common import TOKENS, add_data_path_args, data_path, data_path_sides, machine, timed


def _rate(t: dict, w: str, i: int, dn: int) -> float:
    """M requests/s of side ``w`` from its best seconds (``i``: 0 wall, 1 CPU) on each trace."""
    return dn / (min(x[i] for x in t[(w, "100k")]) - min(x[i] for x in t[(w, "20k")])) / 1e6


def _per_round(t: dict, rounds: int, i: int) -> list[float]:
    """Ours / libCacheSim, each round from that round's 100k - 20k difference on each side, sorted."""
    out = []
    for r in range(rounds):
        ours = t[("ours", "100k")][r][i] - t[("ours", "20k")][r][i]
        lcs = t[("lcs", "100k")][r][i] - t[("lcs", "20k")][r][i]
        out.append(lcs / ours if ours > 0 else float("nan"))
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_path_args(ap, rounds=7)
    args = ap.parse_args()
    import libcachesim as lcs

    from replay.core.simulate import warm_up

    v2, n_req, readers = data_path_sides(lcs, args.dir)
    tokens = TOKENS
    entries = [int(x) for x in args.entries.split(",")]
    warm_up(["lru", "belady"])
    data_path(v2["20k"], "lru", 64)  # every kernel of the data path compiled / loaded before timing
    data_path(v2["20k"], "belady", 64)
    print(f"machine: {machine()}")
    print(f"libcachesim {getattr(lcs, '__version__', '?')}; rounds {args.rounds} (interleaved); "
          f"requests: {n_req['20k']:,} and {n_req['100k']:,}")
    dn = n_req["100k"] - n_req["20k"]
    print(f"{'policy':7s} {'entries':>7s} {'hits':>9s} {'same':>5s} {'lcs M/s':>8s} {'ours M/s':>8s} {'wall x':>6s} "
          f"{'cpu x':>6s}   round by round, wall x min/median/max; cpu x min/median/max")
    for policy, cls in (("lru", lcs.LRU), ("belady", lcs.Belady)):
        for e in entries:
            t: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
            for _ in range(args.rounds):
                for s in tokens:
                    t.setdefault(("lcs", s), []).append(timed(
                        lambda s=s, c=cls, e=e: int(round(n_req[s] * (1.0 - c(cache_size=e << 20).process_trace(readers[s])[0])))))
                    t.setdefault(("ours", s), []).append(timed(lambda s=s, p=policy, e=e: data_path(v2[s], p, e)))
            hits = {w: {x[2] for x in t[(w, "100k")]} for w in ("lcs", "ours")}
            same = all(len({x[2] for x in t[(w, s)]}) == 1 for w in ("lcs", "ours") for s in tokens) and \
                all(t[("lcs", s)][0][2] == t[("ours", s)][0][2] for s in tokens)

            wall, cpu = _per_round(t, args.rounds, 0), _per_round(t, args.rounds, 1)
            lcs_w, ours_w, lcs_c, ours_c = _rate(t, "lcs", 0, dn), _rate(t, "ours", 0, dn), _rate(t, "lcs", 1, dn), _rate(t, "ours", 1, dn)
            spread = (f"{wall[0]:.2f}/{statistics.median(wall):.2f}/{wall[-1]:.2f}; "
                      f"{cpu[0]:.2f}/{statistics.median(cpu):.2f}/{cpu[-1]:.2f}")
            print(f"{policy:7s} {e:7d} {next(iter(hits['ours'])):9d} {'yes' if same else 'NO':>5s} {lcs_w:8.1f} "
                  f"{ours_w:8.1f} {ours_w / lcs_w:6.2f} {ours_c / lcs_c:6.2f}   {spread}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    print("(x = ours / libCacheSim throughput; wall from the best wall-clock seconds of each side and size, cpu from "
          "the best CPU seconds (this process, all threads: ours reads the next part on one background thread); "
          "round by round: that round's 100k - 20k difference, each side)")


if __name__ == "__main__":
    main()
