"""Shared helpers: the machine line, best-of timing, the synthetic benchmark trace."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path


def machine() -> str:
    import numba
    import numpy as np

    cpu = platform.processor() or "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    blas = "?"
    try:
        b = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        blas = f"{b.get('name')} {b.get('version')}"
    except Exception:  # show_config's layout varies across numpy versions
        pass
    return (f"{cpu}, {os.cpu_count()} logical cores, {mem:.0f} GiB RAM, load average {load:.2f} at start; "
            f"{platform.system()} {platform.release()}; Python {platform.python_version()}, "
            f"numpy {np.__version__} ({blas}), numba {numba.__version__}")


def best_of(fn, n: int = 5) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def synthetic_trace(out: Path, tokens: int = 20000, layers: int = 48, experts: int = 128, top_k: int = 8) -> Path:
    """The project's synthetic generator, routing only; reused when already written."""
    from traces import open_trace
    from traces.synth.generator import SynthConfig, write_synthetic

    if not (out / "trace.json").is_file():
        write_synthetic(out, SynthConfig(layers=layers, experts=experts, top_k=top_k, tokens=tokens, prompt_tokens=32,
                                         routing_only=True), force=True)
    t = open_trace(out, check_rows=False)
    return t.path


def top1_decode_loads(trace_dir: Path):
    """The top-1, decode-only, equal-size (1 MiB) view of the synthetic benchmark trace that both
    libCacheSim comparisons replay (where our semantics and libCacheSim's coincide): (trace, loads,
    object id per request = layer index x n_expert + expert)."""
    import numpy as np

    from replay.core.simulate import prepare_loads
    from traces import open_trace
    from traces.io.reader import RoutingArrays
    from traces.util.units import MIB

    t = open_trace(synthetic_trace(trace_dir))
    a = t.arrays(recorded=False)
    dec = a.phase == 1
    ra = RoutingArrays(turn=a.turn[dec], batch=a.batch[dec], phase=a.phase[dec], step=a.step[dec], layer=a.layer[dec],
                       experts=np.ascontiguousarray(a.experts[dec, :1]), weights=np.ascontiguousarray(a.weights[dec, :1]))
    loads = prepare_loads(ra, t.moe_layers, t.n_expert, np.where(t.expert_bytes > 0, MIB, 0))
    return t, loads, loads.entries[:, 0].astype(np.int64)


def add_tiny_model_args(ap, tokens: int) -> None:
    """The options of a benchmark on a tiny random-weight transformers MoE model (engine_bridge.hf_tiny):
    its shape, the tokens to run (default ``tokens``), repeats and torch threads."""
    ap.add_argument("--family", default="qwen3_moe")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-ff", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=tokens)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)


def write_tiny_model(out: Path, a) -> Path:
    """Write the tiny transformers MoE model that :func:`add_tiny_model_args`' options ``a`` describe."""
    from engine_bridge.hf_tiny import TinyHfConfig, write_tiny_hf_model

    return write_tiny_hf_model(out, TinyHfConfig(family=a.family, layers=a.layers, experts=a.experts, top_k=a.top_k,
                                                 hidden=a.hidden, expert_ff=a.expert_ff))


def start_tiny_model_run(a, tokens_are: str) -> None:
    """Quiet transformers, set torch's threads and print the machine and the tiny model's shape
    (:func:`add_tiny_model_args`' options ``a``), ending "{a.tokens} <tokens_are>"."""
    import torch

    from engine_bridge.hf import quiet_transformers

    quiet_transformers()
    torch.set_num_threads(a.threads)
    print(machine())
    print(f"torch {torch.__version__}, {a.threads} thread(s); {a.family}: {a.layers} layers, hidden {a.hidden}, "
          f"{a.experts} experts, top-{a.top_k}, expert ff {a.expert_ff}, float32; {a.tokens} {tokens_are}")
