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
    from traces.synth import SynthConfig, write_synthetic

    if not (out / "trace.json").is_file():
        write_synthetic(out, SynthConfig(layers=layers, experts=experts, top_k=top_k, tokens=tokens, prompt_tokens=32,
                                         routing_only=True), force=True)
    t = open_trace(out, check_rows=False)
    return t.path
