"""Shared helpers: the machine line, best-of timing, the synthetic benchmark traces, and the
top-1 traces and libCacheSim files of the data-path comparisons (format_v2, data_path, curve)."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


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


def timed(fn) -> tuple[float, float, Any]:
    """Run ``fn`` once: (wall-clock seconds, CPU seconds of this process, all its threads, ``fn``'s result)."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


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


# The top-1 traces of the data-path comparisons: synthetic, top-1, decode only, routing only,
# LAYERS MoE layers x EXPERTS experts of 1 MiB (object = layer x EXPERTS + expert).
LAYERS, EXPERTS = 48, 128
TOKENS = {"20k": 20_000, "100k": 100_000}


def synth(path: Path, tokens: int) -> Path:
    """The top-1 trace of ``tokens`` decode tokens at ``path`` (``moe-replay synth --top-k 1
    --prompt-tokens 0 --routing-only --expert-bytes 1048576 --rank 16``); reused when already written."""
    if not (path / "trace.json").is_file():
        subprocess.run([sys.executable, "-m", "replay.cli", "synth", str(path), "--layers", str(LAYERS), "--experts",
                        str(EXPERTS), "--top-k", "1", "--tokens", str(tokens), "--prompt-tokens", "0", "--routing-only",
                        "--expert-bytes", str(1 << 20), "--rank", "16", "--force"], check=True, stdout=subprocess.DEVNULL)
    return path


def data_path(trace_dir: Path, policy: str, entries: int) -> int:
    """The replay's data path on ``trace_dir``: open, read and check every part, cut the loads, replay
    ``policy`` at ``entries`` 1 MiB entries; returns the hits."""
    from replay.core.simulate import loads_of, replay
    from traces import open_trace

    loads = loads_of(open_trace(trace_dir, defer_rows=True))
    return int(replay(loads, policy, float(entries)).hits)


def write_oracle_general(out: Path, obj, next_access: bool = True) -> int:
    """Requests to objects ``obj`` (ids from 0, 1 MiB each) as libCacheSim's oracleGeneral binary file
    (the record of :data:`traces.io.exports.ORACLE_GENERAL`; ids written from 1, clock = request
    index from 1; ``next_access``: each request's next use, else -1 throughout); returns the count."""
    import numpy as np

    from traces.io.exports import ORACLE_GENERAL, next_access_vtime

    obj = np.asarray(obj, dtype=np.int64)
    rec = np.empty(obj.shape[0], dtype=ORACLE_GENERAL)
    rec["clock_time"], rec["obj_id"], rec["obj_size"] = np.arange(1, obj.shape[0] + 1), obj + 1, 1 << 20
    rec["next_access_vtime"] = next_access_vtime(obj) if next_access else -1
    out.write_bytes(rec.tobytes())
    return obj.shape[0]


def oracle_file(trace_dir: Path, out: Path) -> int:
    """The top-1 trace's requests as libCacheSim's oracleGeneral binary file, next uses written in
    (not timed); reused when already written; returns the count."""
    import numpy as np

    from traces import open_trace

    if out.is_file():
        return out.stat().st_size // 24
    a = open_trace(trace_dir).arrays(recorded=False)
    lidx = np.searchsorted(np.arange(LAYERS), a.layer.astype(np.int64))
    return write_oracle_general(out, lidx * EXPERTS + a.experts[:, 0].astype(np.int64))


def add_data_path_args(ap, rounds: int) -> None:
    """``--dir`` (where the top-1 traces and libCacheSim files live), ``--rounds``, ``--entries``."""
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "moe-replay-bench-format")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--entries", default="512,2048")


def data_path_sides(lcs, work: Path) -> tuple[dict[str, Path], dict[str, int], dict]:
    """The top-1 traces of :data:`TOKENS` in ``work`` (version 2, the writer's layout), their request
    counts and a libCacheSim reader of each one's oracleGeneral file, all written once (not timed)."""
    work.mkdir(parents=True, exist_ok=True)
    v2 = {s: synth(work / f"top1-{s}-v2", n) for s, n in TOKENS.items()}
    n_req = {s: oracle_file(v2[s], work / f"top1-{s}.oracleGeneral.bin") for s in TOKENS}
    readers = {s: lcs.TraceReader(str(work / f"top1-{s}.oracleGeneral.bin"), lcs.TraceType.ORACLE_GENERAL_TRACE)
               for s in TOKENS}
    return v2, n_req, readers


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


def add_top1_trace_arg(ap) -> None:
    """``--trace``: the synthetic trace whose top-1 decode requests the libCacheSim comparisons replay."""
    ap.add_argument("--trace", type=Path, default=Path(tempfile.gettempdir()) / "moe-replay-bench-synth20k")


@contextlib.contextmanager
def top1_requests(lcs, trace_dir: Path, next_access: bool):
    """(trace, loads, object ids, libCacheSim reader): :func:`top1_decode_loads` of ``trace_dir`` and
    a reader of the same requests, from an oracleGeneral file in a temporary directory that lives
    as long as the ``with`` block (``next_access``: each request's next use written in, for Belady)."""
    t, loads, obj = top1_decode_loads(trace_dir)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "top1.oracleGeneral.bin"
        write_oracle_general(path, obj, next_access=next_access)
        yield t, loads, obj, lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)


def top1_line(t, obj, lcs) -> str:
    """The trace line of a libCacheSim comparison: the trace, its requests and objects, libCacheSim's version."""
    return (f"trace: top-1 of {t.path} decode tokens: {obj.shape[0]:,} requests over {len(set(obj.tolist()))} objects, "
            f"1 MiB each; libcachesim {getattr(lcs, '__version__', '?')}")


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
