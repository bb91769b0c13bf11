"""Decode speed with and without the llama.cpp capture hook, side by side.

    python -m benchmarks.capture_overhead [--layers 8 --embd 512 --experts 64 --top-k 8] [--tokens 128] [--repeats 3]

Generates a random-weight qwen3moe GGUF (cached under the temp dir), then decodes the same greedy
continuation in five modes, interleaved ``--repeats`` times (median reported):

- ``baseline``: no eval callback at all;
- ``callback, observe none``: the hook's callback is installed but observes nothing -- the cost of
  ggml asking Python about every graph node;
- ``nodes only (routing set)``: the routing-only node set is observed (graph split per node) but
  nothing is read or written;
- ``capture routing-only``: the real capture (ids + weights, trace written);
- ``capture full``: routing + logits + gate inputs (trace written).

Only decode is timed (one token per batch, wall clock per llama_decode including the hook and,
for the capture modes, the trace rows); prefill is excluded. The figures measure this machine's
CPU, thread count and load, not an engine in general.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._common import machine

PROMPT = "Benchmark the capture hook: the quick brown fox jumps over the lazy dog."


def _decode_loop(engine, tokens: list[int], n: int, hook=None) -> float:
    """Greedy decode n tokens after the prompt; return decode tok/s."""
    logits = None
    pos = 0
    for s in range(0, len(tokens), engine.ubatch):
        logits = engine.decode(tokens[s:s + engine.ubatch], pos)
        pos += len(tokens[s:s + engine.ubatch])
        if hook is not None:
            hook.take()
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(np.argmax(logits))
        logits = engine.decode([tok], pos)
        if hook is not None:
            hook.take()
        pos += 1
    return n / (time.perf_counter() - t0)


class _NodesOnly:
    """Observe the routing-only node set (forcing the same graph splits) but read nothing."""

    def __init__(self, n_layer: int) -> None:
        import ctypes

        import llama_cpp

        from engine_bridge import ggml

        self.ggml, self.ctypes = ggml, ctypes
        self.topk = {f"ffn_moe_topk-{i}".encode() for i in range(n_layer)}
        self.mmid = ggml.probe_layout()["MUL_MAT_ID"]
        self.pending = 0
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._cb)

    def _cb(self, t, ask, _u):
        if not ask:
            return True
        ct = self.ctypes
        name = ct.string_at(t + self.ggml.NAME_OFFSET)
        if name in self.topk:
            self.pending = t
            return False
        if self.pending and ct.c_int.from_address(t + self.ggml.OP_OFFSET).value == self.mmid:
            if ct.c_void_p.from_address(t + self.ggml.SRC_OFFSET + 16).value == self.pending:
                self.pending = 0
                return True
        return False

    def take(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=512)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-ff", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=128, help="decoded tokens per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from engine_bridge.capture import CaptureOptions, capture
    from engine_bridge.engine import Engine, EngineOptions
    from engine_bridge.gguf_static import read_static
    from engine_bridge.hook import MoeHook
    from engine_bridge.tinymodel import TinyModelConfig, write_tiny_model

    cfg = TinyModelConfig(arch="qwen3moe", layers=args.layers, experts=args.experts, top_k=args.top_k, embd=args.embd,
                          expert_ff=args.expert_ff, heads=8, kv_heads=4, seed=0)
    cache = Path(tempfile.gettempdir()) / "moe-replay-bench"
    cache.mkdir(exist_ok=True)
    model = cache / f"qwen3moe-L{cfg.layers}-E{cfg.experts}-k{cfg.top_k}-d{cfg.embd}-ff{cfg.ff}.gguf"
    if not model.exists():
        t0 = time.perf_counter()
        write_tiny_model(model, cfg)
        print(f"generated {model.name} ({model.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f} s")
    static = read_static(model)
    n_ctx = 512 + args.tokens
    results: dict[str, list[float]] = {}
    counts: dict[str, tuple[float, float]] = {}

    def engine_run(label: str, hook) -> None:
        eng = Engine(str(model), EngineOptions(n_ctx=n_ctx, ubatch=64, threads=args.threads, arch=static.arch),
                     hook.callback if hook is not None else None)
        try:
            toks = eng.tokenize(PROMPT)
            if hook is not None and hasattr(hook, "asked"):
                hook.asked = hook.observed = 0
            results.setdefault(label, []).append(_decode_loop(eng, toks, args.tokens, hook))
            if hook is not None and hasattr(hook, "asked"):
                counts[label] = (hook.asked, hook.observed)
        finally:
            eng.close()

    def capture_run(label: str, full: bool) -> None:
        out = Path(tempfile.mkdtemp(prefix="moe-bench-")) / "t"
        try:
            res = capture(CaptureOptions(model=str(model), prompt=PROMPT, out=str(out), n_decode=args.tokens, logits=full,
                                         gate_input=full, ubatch=64, threads=args.threads, ignore_eos=True), static=static)
            assert res.checks["passed"], res.checks
            results.setdefault(label, []).append(res.decode_tok_s)
            counts[label] = (float("nan"), res.meta.get("capture_summary", {}).get("observed_nodes", float("nan")))
        finally:
            shutil.rmtree(out.parent, ignore_errors=True)

    class _Silent(MoeHook):  # every ask in Python (native=False): the cost of a Python callback per node
        def __init__(self, n_layer: int, observe_logits: bool) -> None:
            super().__init__(n_layer, observe_logits, native=False)

        def _ask(self, t):  # noqa: ANN001
            self.asked += 1
            return False

    engine_run("warm-up", None)  # page the weights in, warm the threadpool; not reported
    results.pop("warm-up")
    for _ in range(args.repeats):
        engine_run("baseline (no callback)", None)
        engine_run("callback, observe none", _Silent(static.n_layer, observe_logits=False))
        engine_run("nodes only (routing set)", _NodesOnly(static.n_layer))
        capture_run("capture routing-only", full=False)
        capture_run("capture full (+logits, +gate_input)", full=True)

    base = statistics.median(results["baseline (no callback)"])
    print(f"machine: {machine()}; threads {args.threads}")
    print(f"model: {model.name}: {cfg.layers} layers, embd {cfg.embd}, {cfg.experts} experts top-{cfg.top_k}, "
          f"expert ff {cfg.ff}, f16 weights; decode {args.tokens} tokens x {args.repeats} repeats (median)")
    best_base = max(results["baseline (no callback)"])
    print("median = typical run; best = fastest run (least disturbed by other load on the machine)")
    print(f"{'mode':40s} {'median tok/s':>12s} {'vs base':>8s} {'best tok/s':>10s} {'vs base':>8s}  runs")
    for label, vals in results.items():
        med, best = statistics.median(vals), max(vals)
        print(f"{label:40s} {med:12.1f} {100 * (med / base - 1):+7.1f}% {best:10.1f} {100 * (best / best_base - 1):+7.1f}%  "
              + " ".join(f"{v:.0f}" for v in vals))
    n_nodes = counts.get("callback, observe none", (float("nan"), 0))[0]
    graphs = args.tokens
    print(f"graph nodes asked per decode token: {n_nodes / graphs:.0f}" if n_nodes == n_nodes else "")
    for label in list(results)[1:]:
        extra_ms = 1000 / max(results[label]) - 1000 / best_base
        print(f"{label}: {extra_ms:+.3f} ms per token over baseline (best runs)")


if __name__ == "__main__":
    main()
