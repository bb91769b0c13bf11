"""Benchmark: the timeline (replay.analyses.timeline) against the linear cost model on the three phone
runs, held out, and the timeline kernel's speed.

    python -m benchmarks.timeline [--data DIR]

For each of the BigMoeOnEdge traces (Qwen3-30B-A3B, Gemma-4-26B-A4B, gpt-oss-120b; imported once
into /tmp with ``moe-replay import bigmoe ... --metrics``, never into the repository): the timeline
fitted on the even 8-token blocks of decoded tokens (``replay.timeline_fit``), scored on the odd
blocks against the recorded ``wall_ms``, ``io_ms`` and ``stall_ms``, beside the linear model
``wall_ms = a + b x MiB`` fitted on the same tokens: mean error, per-token MAPE, correlation, and
whether the held-out tok/s is reproduced within the held-out error. Then the kernel: one timeline
of the Qwen LRU replay (6,144 decode loads), best of 20 runs, in loads per second, beside the
replay that produced its input.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def shared_data() -> Path:
    """``$MOE_REPLAY_SHARED/data``, else ``../shared/data`` beside the checkout (as tests/conftest.py)."""
    return Path(os.environ.get("MOE_REPLAY_SHARED", ROOT.parent / "shared")) / "data"


def _import(name: str, data: Path, out: Path) -> Path:
    from traces.importers.bigmoe import import_bigmoe

    t = out / name
    if not (t / "meta.json").exists():
        import_bigmoe(data / f"{name}.route.csv", t, metrics=data / f"{name}.metrics")
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=None, help="the folder holding {qwen,gemma,gptoss}.route.csv/.metrics")
    ap.add_argument("--out", type=Path, default=Path("/tmp/moe-replay-bench-timeline"))
    a = ap.parse_args()
    data = a.data or shared_data() / "bigmoeonedge-2026-07-15"
    a.out.mkdir(parents=True, exist_ok=True)
    from replay.analyses.timeline_fit import fit_profile
    from traces import open_trace

    print(f"load average {os.getloadavg()[0]:.1f}")
    print("| trace | timeline profile | held-out wall_ms: timeline mean err / MAPE / corr | linear mean err / MAPE / corr "
          "| timeline io_ms MAPE / corr | stall_ms mean err / corr | recorded tok/s | timeline tok/s (reproduced?) "
          "| linear tok/s (reproduced?) | per-token MAE timeline / linear |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in ("qwen", "gemma", "gptoss"):
        tr = open_trace(_import(name, data, a.out))
        p, r = fit_profile(tr)
        tw, lw, io, st = r["timeline_wall_ms"], r["linear_wall_ms"], r["timeline_io_ms"], r["timeline_stall_ms"]

        def c(v):
            return "-" if v is None else f"{v:.2f}"

        print(f"| {name} | {p.lanes} lanes x {p.lane_mib_s:.0f} MiB/s, {p.read_latency_ms:.3f} ms/read, "
              f"{p.compute_ms_per_layer:.2f} ms/layer (expert share {p.expert_share:.2f}), overlap {'on' if p.overlap else 'off'} "
              f"| {tw['mean_err_ms']:+.1f} ms / {tw['mape_pct']:.1f}% / {c(tw['corr'])} "
              f"| {lw['mean_err_ms']:+.1f} ms / {lw['mape_pct']:.1f}% / {c(lw['corr'])} "
              f"| {io['mape_pct']:.1f}% / {c(io['corr'])} | {st['mean_err_ms']:+.1f} ms / {c(st['corr'])} "
              f"| {r['recorded_heldout_tok_s']:.2f} | {r['timeline_heldout_tok_s']:.2f} "
              f"({'yes' if r['timeline_reproduces_tok_s'] else 'no'}, "
              f"±{r['timeline_mean_err_ci95_ms']:.1f} ms) | {r['linear_heldout_tok_s']:.2f} "
              f"({'yes' if r['linear_reproduces_tok_s'] else 'no'}, ±{r['linear_mean_err_ci95_ms']:.1f} ms) "
              f"| {r['timeline_wall_mae_ms']:.1f} / {r['linear_wall_mae_ms']:.1f} ms ({r['better']} better) |")
        if name == "qwen":
            qwen_speed = _speed(tr, p)
    n, bt, br = qwen_speed
    print(f"\ntimeline kernel on Qwen's LRU replay: {n:,} loads in {bt * 1000:.2f} ms ({n / bt / 1e6:.2f} M loads/s); "
          f"the replay with per-slot codes that feeds it: {br * 1000:.2f} ms")


def _speed(tr, p) -> tuple[int, float, float]:
    """Loads, the best of 20 timelines of Qwen's LRU replay, the best of 5 replays with slots (s)."""
    from replay.analyses.timeline import time_replay
    from replay.analyses.timeline_fit import _baseline
    from replay.core.simulate import replay

    loads, res = _baseline(tr)
    time_replay(loads, res, p)  # compiled or loaded from cache
    best_t = min(_timed(lambda: time_replay(loads, res, p)) for _ in range(20))
    best_r = min(_timed(lambda: replay(loads, "lru", float(tr.recorded["budget_mib"]), slots=True)) for _ in range(5))
    return int(loads.load_start.shape[0] - 1), best_t, best_r


def _timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
