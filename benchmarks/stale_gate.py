"""Benchmark: stale-gate[1] evaluation on a long synthetic trace against the floor set by the
matrix products alone.

    python -m benchmarks.stale_gate [--tokens 5000 --layers 48 --embd 2048 --experts 128] [--trace DIR]

The trace (5,000 decode tokens x 48 MoE layers, n_embd 2048, 128 experts: ~2 GB of float32 gate
inputs) is generated once into /tmp (never into the repository) by ``moe-replay synth`` in a
child process, so its memory does not count here. Then, in this one process:

- floor: numpy float64 matmuls of exactly the shapes stale-gate[1] multiplies, per part file
  [tokens in the part, n_embd] @ [n_embd, n_expert] for each of the (layers - 1) layer pairs, on
  data already in memory (no reading, no ranking, no scoring);
- read only: the read path stale-gate uses, on one thread, no compute: each part file mapped,
  each layer's gate rows gathered from it as float64 (reported so the ratio can be read);
- stale-gate: ``replay.analyses.accuracy.evaluate(trace, ["stale-gate"])`` end to end: reading the narrow
  columns, streaming every part's gate inputs from Parquet, the same matmuls, the selection rule,
  top-k, scoring per layer. It shares the source layers out among the cores, each thread running
  single-threaded BLAS, so the floor is timed both ways (one product at a time on numpy's
  multi-threaded BLAS, and side by side on single-threaded BLAS, as stale-gate runs them) and the
  faster of the two is the floor.

The four timings (two floors, read, stale-gate) are interleaved, three rounds, and each one's
fastest run is reported (the machine is shared: a busy round slows all of them alike, and the
spread of runs is printed); the target is stale-gate within 2x of the floor. Peak RSS shows the
2 GB of gate inputs were streamed (it includes the one part file mapped at a time).
Numba kernels are compiled (or loaded from cache) before timing.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks._common import machine

GIB = 1 << 30


def ensure_trace(path: Path, tokens: int, layers: int, embd: int, experts: int) -> None:
    meta = path / "trace.json"
    if meta.is_file():
        synth = json.loads(meta.read_text()).get("provenance", {}).get("synth", {})
        if (synth.get("tokens"), synth.get("layers"), synth.get("embd"), synth.get("experts")) == (tokens, layers, embd, experts):
            if current_layout(path):
                return
            print(f"{path} was written by an older writer (trace format version 1: gate inputs decoded, not mapped); regenerating")
    print(f"generating {path} (one-off; minutes) ...", flush=True)
    subprocess.run([sys.executable, "-m", "replay.cli", "synth", str(path), "--layers", str(layers), "--experts",
                    str(experts), "--top-k", "8", "--embd", str(embd), "--tokens", str(tokens), "--prompt-tokens", "0",
                    "--force"], check=True)


def current_layout(path: Path) -> bool:
    """Whether the trace is stored as the current writer stores it (format version 2: the gate
    inputs in Arrow IPC files that stale-gate maps)."""
    import json

    return json.loads((path / "trace.json").read_text()).get("version") == 2


def floor_seconds(part_tokens: list[int], embd: int, experts: int, layers: int, threaded: bool = False) -> float:
    """The products alone. ``threaded``: scheduled as stale-gate schedules them (one thread per
    core, each running single-threaded BLAS); otherwise one product at a time on numpy's default
    multi-threaded BLAS."""
    from concurrent.futures import ThreadPoolExecutor

    from replay.predictors.gate import _blas_threads, _workers

    rng = np.random.default_rng(0)
    a = rng.standard_normal((max(part_tokens), embd))  # float64, like the recomputed logits
    w = np.ascontiguousarray(rng.standard_normal((experts, embd)).T)
    shapes = [m for m in part_tokens for _ in range(layers - 1)]
    if not threaded:
        t0 = time.perf_counter()
        for m in shapes:
            a[:m] @ w
        return time.perf_counter() - t0
    workers = _workers()
    with ThreadPoolExecutor(workers) as pool, _blas_threads(workers):
        t0 = time.perf_counter()
        list(pool.map(lambda m: a[:m] @ w, shapes))
        return time.perf_counter() - t0


def read_seconds(trace) -> float:
    """The stale-gate read path alone, on one thread: every part mapped (or decoded, where its
    trace is version 1), every layer's gate rows gathered as float64, no compute."""
    from replay.predictors.gate import _chunks  # the path predict_gate reads through

    t0 = time.perf_counter()
    for _, cur in _chunks(trace, ["batch", "step", "layer", "gate_input"]):
        layer = cur["layer"]
        for l in np.unique(layer):
            cur["gate_input"].take(cur["gate_row"][np.flatnonzero(layer == l)])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=5000)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--embd", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--trace", type=Path, default=None)
    a = ap.parse_args()
    path = a.trace or Path("/tmp/moe-replay-bench") / f"stale-gate-L{a.layers}-E{a.experts}-d{a.embd}-T{a.tokens}"
    ensure_trace(path, a.tokens, a.layers, a.embd, a.experts)

    from replay.analyses.accuracy import evaluate
    from replay.predictors.gate import _workers, warm_up
    from traces import open_trace

    warm_up()
    t = open_trace(path, check_rows=False)
    n_moe = len(t.moe_layers)
    part_tokens = [r // n_moe for r in t.part_rows]
    gate_bytes = t.n_rows * int(t.model["n_embd"]) * 4
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)

    floors, floors_t, evals, reads, res = [], [], [], [], None
    for _ in range(3):
        floors.append(floor_seconds(part_tokens, int(t.model["n_embd"]), t.n_expert, n_moe))
        floors_t.append(floor_seconds(part_tokens, int(t.model["n_embd"]), t.n_expert, n_moe, threaded=True))
        reads.append(read_seconds(t))
        t0 = time.perf_counter()
        res = evaluate(t, ["stale-gate"], horizons=[1])
        evals.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)
    ov = res.overall().row(0, named=True)
    assert ov["scored"] == (n_moe - 1) * a.tokens, ov
    floor, ev = min(floors + floors_t), min(evals)  # the faster schedule sets the floor
    flops = 2.0 * sum(part_tokens) * (n_moe - 1) * t.model["n_embd"] * t.n_expert
    print(f"machine       {machine()}")
    print(f"trace         {path}: {a.tokens} decode tokens x {n_moe} MoE layers, n_embd {t.model['n_embd']}, "
          f"{t.n_expert} experts, top-{t.top_k}; {len(t.parts)} part files; gate inputs {gate_bytes / GIB:.2f} GiB")
    print(f"work          {n_moe - 1} layer pairs, {sum(part_tokens) * (n_moe - 1):,} routings ranked, "
          f"{flops / 1e9:.0f} GFLOP float64")
    print(f"floor         numpy matmul of the same shapes, data in memory, the faster of two schedules: {floor:.2f} s "
          f"({flops / floor / 1e9:.1f} GFLOP/s)")
    print(f"  one by one, multi-threaded BLAS:              runs {', '.join(f'{x:.2f}' for x in floors)} s")
    print(f"  {_workers()} threads side by side, 1-thread BLAS each: runs {', '.join(f'{x:.2f}' for x in floors_t)} s")
    print(f"read only     gathering the gate inputs, 1 thread, no compute: {min(reads):.2f} s "
          f"(runs {', '.join(f'{x:.2f}' for x in reads)}; {gate_bytes / GIB / min(reads):.2f} GiB/s)")
    print(f"stale-gate    evaluate(trace, ['stale-gate']) end to end: {ev:.2f} s "
          f"(runs {', '.join(f'{x:.2f}' for x in evals)})")
    print(f"ratio         stale-gate / floor = {ev / floor:.2f}x  (target <= 2x: {'met' if ev <= 2 * floor else 'NOT met'})")
    print(f"peak RSS      {rss:.2f} GiB (after warm-up, before timing: {rss0:.2f} GiB) vs {gate_bytes / GIB:.2f} GiB "
          "of gate inputs: streamed")
    print(f"result        stale-gate[1] slot acc {ov['slot_acc_pct']:.2f}%, whole {ov['whole_acc_pct']:.2f}%, "
          f"scored {ov['scored']:,}, unscored {ov['unscored']:,}")


if __name__ == "__main__":
    main()
