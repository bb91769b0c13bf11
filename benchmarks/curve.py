"""The whole LRU curve in one pass against per-budget replays, side by side in one run
(``benchmarks/RESULTS.md``, "Curve").

Trace: :mod:`benchmarks.format_v2`'s synthetic top-1 trace, 100,000 decode tokens x 48 MoE layers
x 128 experts of 1 MiB (4.8 M routings, each its own load: where our load semantics and
libCacheSim's coincide). Sides, each Numba kernel compiled beforehand, the trace read and cut
into loads once beforehand (not timed):

- curve: ``compute_curve(loads, policies=("lru",))``: every budget where the curve changes (from
  1 entry to the working set), one pass; and ``("lru", "layer")``, what ``moe-replay curve``
  computes by default;
- the whole API call ``replay.curve_run(trace_dir)`` (default policies ``lru`` + ``layer``): opening
  the trace, reading, checking and cutting its loads, then both curves (what ``moe-replay curve
  TRACE`` does before printing, without the process start); its ratio to a replay is not like with
  like (the replay side is given its loads), it says what the user-facing call costs;
- ours x 100: ``replay(loads, "lru", budget)`` at 100 budgets (1 .. 6,144 entries, evenly spaced);
- libCacheSim x 100: ``LRU(cache_size).process_trace(reader)`` at the same 100 budgets, on an
  oracleGeneral file of the same requests (written beforehand, not timed);
- sampled curves (SHARDS, spatial hash of (layer, expert) entries) at rates 1% and 10%, seeds
  0..4: time, and the error of decode hit % against the exact curve at the 100 budgets.

Checks: the curve's hits equal our replay's and libCacheSim's at all 100 budgets.

    python -m benchmarks.curve [--dir /tmp/moe-replay-bench-format] [--rounds 3]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from benchmarks._common import machine, oracle_file, synth, timed
from traces.util.units import MIB


def hits_at(frame, budgets_mib: np.ndarray) -> np.ndarray:
    """The curve's hits in force at each budget (the last change point at or below it)."""
    f = frame.sort("budget_mib")
    b = f["budget_mib"].to_numpy()
    h = f["hits"].to_numpy()
    i = np.searchsorted(b, budgets_mib, side="right") - 1
    return np.where(i >= 0, h[np.maximum(i, 0)], 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "moe-replay-bench-format")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import libcachesim as lcs

    from replay import curve_run
    from replay.analyses.curve import compute_curve
    from replay.core.simulate import loads_of, replay, warm_up
    from traces import open_trace

    args.dir.mkdir(parents=True, exist_ok=True)
    tdir = synth(args.dir / "top1-100k-v2", 100_000)
    n_req = oracle_file(tdir, args.dir / "top1-100k.oracleGeneral.bin")
    reader = lcs.TraceReader(str(args.dir / "top1-100k.oracleGeneral.bin"), lcs.TraceType.ORACLE_GENERAL_TRACE)
    loads = loads_of(open_trace(tdir))
    assert loads.entries.shape == (n_req, 1) and (loads.layer_expert_bytes == MIB).all()
    entries = np.unique(np.linspace(1, loads.n_entries, 100).round().astype(np.int64))
    assert entries.shape[0] == 100
    warm_up(["lru"])
    compute_curve(loads, policies=("lru",), sample_rate=0.5)  # compile the curve's kernels
    curve_run(tdir)  # and the whole call's (the layer pass, the reader's)
    print(f"machine: {machine()}")
    print(f"trace: {tdir}: {n_req:,} routings (top-1, decode only, 48 x 128 entries of 1 MiB); "
          f"libcachesim {getattr(lcs, '__version__', '?')}; 100 budgets {entries[0]}..{entries[-1]} entries")
    best: dict[str, list[float]] = {}

    def keep(name: str, wall: float, cpu: float) -> None:
        b = best.setdefault(name, [float("inf"), float("inf")])
        b[0], b[1] = min(b[0], wall), min(b[1], cpu)

    exact = None
    ours = np.zeros(100, np.int64)
    theirs = np.zeros(100, np.int64)
    for rnd in range(args.rounds):
        w, c, exact = timed(lambda: compute_curve(loads, policies=("lru",)).frame)
        keep("curve (lru, every budget)", w, c)
        w, c, _ = timed(lambda: compute_curve(loads, policies=("lru", "layer")))
        keep("curve (lru + layer, every budget)", w, c)
        w, c, _ = timed(lambda: curve_run(tdir))
        keep("curve_run(trace dir): read + lru + layer", w, c)
        w, c, _ = timed(lambda: [ours.__setitem__(i, replay(loads, "lru", float(e)).hits) for i, e in enumerate(entries)])
        keep("ours: 100 replays", w, c)
        def lcs_all() -> None:
            for i, e in enumerate(entries):
                mr, _ = lcs.LRU(cache_size=int(e) * MIB).process_trace(reader)
                theirs[i] = int(round(n_req * (1.0 - mr)))

        w, c, _ = timed(lcs_all)
        keep("libCacheSim: 100 process_trace", w, c)
        mine = hits_at(exact, entries.astype(np.float64))
        assert (mine == ours).all(), f"curve != replay at {entries[mine != ours][:5]}"
        assert (mine == theirs).all(), f"curve != libCacheSim at {entries[mine != theirs][:5]}"
        print(f"round {rnd + 1}: hits identical at all 100 budgets (curve, our replays, libCacheSim); "
              f"curve rows: {exact.height:,}")
    one_w, one_c = best["ours: 100 replays"][0] / 100, best["ours: 100 replays"][1] / 100
    print()
    print(f"{'side':42s} {'wall s':>8s} {'CPU s':>8s} {'= replays (wall)':>17s} {'= replays (CPU)':>16s}")
    for name, (w, c) in best.items():
        print(f"{name:42s} {w:8.3f} {c:8.3f} {w / one_w:17.1f} {c / one_c:16.1f}")
    # sampled curves: error of decode hit % at the 100 budgets against the exact curve
    lookups = exact["lookups_decode"][0]
    want = 100.0 * hits_at(exact, entries.astype(np.float64)) / lookups
    print()
    print(f"{'sample':10s} {'seeds':>5s} {'CPU s (best)':>12s} {'speed-up (CPU)':>14s} {'mean |err| pp':>13s} "
          f"{'max |err| pp':>12s}")
    for rate in (0.01, 0.1):
        errs, cpus = [], []
        for seed in range(5):
            _, c, res = timed(lambda r=rate, s=seed: compute_curve(loads, policies=("lru",), sample_rate=r, seed=s).frame)
            cpus.append(c)
            f = res.sort("budget_mib")
            b = f["budget_mib"].to_numpy()
            hp = f["hit_pct_decode"].to_numpy()
            i = np.searchsorted(b, entries.astype(np.float64), side="right") - 1
            got = np.where(i >= 0, hp[np.maximum(i, 0)], 0.0)
            errs.append(np.abs(got - want))
        e = np.stack(errs)
        print(f"{rate:<10.0%} {5:5d} {min(cpus):12.3f} {best['curve (lru, every budget)'][1] / min(cpus):14.1f} "
              f"{e.mean():13.2f} {e.max():12.2f}")


if __name__ == "__main__":
    main()
