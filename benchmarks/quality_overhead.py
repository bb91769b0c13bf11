"""Cost of one quality run (drop-cold inside the forward pass) against a plain teacher-forced pass.

    python -m benchmarks.quality_overhead [--engine transformers|llama.cpp] [--family qwen3_moe --layers 8 --hidden 512
                                          --experts 64 --top-k 8] [--tokens 128] [--repeats 3] [--threads 1]

Builds a random-weight model (engine_bridge.hf_tiny, float32) and times, interleaved ``--repeats``
times (median and best reported), over the same text of ``--tokens`` tokens:

- ``loop``: the plain teacher-forced pass a quality run makes, one forward per token with the KV
  cache, no hooks, no trace (the baseline of the 1.5x target);
- ``prefill``: the whole text in one forward (what a perplexity tool would do; shown for scale:
  a quality run cannot batch the text, the cache is stepped token by token);
- ``quality F=0.75``: one setting of ``moe-replay quality`` (capture_hf with the drop-cold
  override at a budget of a quarter of the experts: router hooks, rank order, the stepped LRU,
  weights rewritten, trace rows) timed as its forwards (capture_hf's ``prefill_s``) and as the
  whole call (trace files and the self-checks included).

``--engine llama.cpp``: a random-weight qwen3moe GGUF of the same sizes (f16 matrices); ``loop`` is
one ``llama_decode`` per token with no eval callback (KV f32, flash attention off, as quality runs
it), ``quality`` the capture at ubatch 1 with the drop-cold override writing the weights node.

The figures measure this machine's CPU, thread count and load, not an engine in general.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks._common import add_tiny_model_args, machine, start_tiny_model_run, write_tiny_model

TEXT = ("Benchmark the quality run: the quick brown fox jumps over the lazy dog, and the router picks the top experts "
        "by their scores while the cache keeps the hot ones. ") * 40


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_tiny_model_args(ap, tokens=128)
    ap.add_argument("--engine", default="transformers", choices=["transformers", "llama.cpp"])
    a = ap.parse_args(argv)
    if a.engine == "llama.cpp":
        return _llama(a)

    import numpy as np
    import torch

    from engine_bridge import hf
    from engine_bridge.quality import Setting, _DropCold, _router_logit_hooks, new_cache
    from replay.core.simulate import budget_bytes

    start_tiny_model_run(a, "tokens teacher-forced")
    tmp = Path(tempfile.mkdtemp(prefix="quality-bench-"))
    try:
        mdir = write_tiny_model(tmp / "model", a)
        model, tok = hf.load_model(str(mdir))
        ids = tok(TEXT)["input_ids"][:a.tokens]
        text = tok.decode(ids)
        ids = tok(text)["input_ids"]
        fam = hf._family_of(model.config, "bench")
        blocks = hf.find_blocks(model, fam, "bench")
        gating, k = hf.gating_of(blocks, fam)
        layers = [b.layer for b in blocks]
        eb = hf.sizes_of(model, blocks, a.experts, None, "bench")[0]
        leb = np.array([eb[l] for l in layers], np.int64)
        budget_mib = float(leb.sum()) * a.experts / 4 / 2**20

        import inspect

        cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

        def loop_s() -> float:
            with torch.inference_mode():
                t0 = time.perf_counter()
                cache = None
                for i, t in enumerate(ids):
                    out = model(input_ids=torch.tensor([[t]]), use_cache=True, **({cache_kw: cache} if i else {}))
                    cache = hf._cache_of(out)
                    out.logits[0].float().cpu().numpy()
                return time.perf_counter() - t0

        def prefill_s() -> float:
            with torch.inference_mode():
                t0 = time.perf_counter()
                model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float().cpu().numpy()
                return time.perf_counter() - t0

        def quality_s(n: int) -> tuple[float, float, float]:
            store: dict[int, np.ndarray] = {}
            handles = _router_logit_hooks(blocks, store)
            cache = new_cache("lru", leb, a.experts, budget_bytes(budget_mib))
            ov = _DropCold(Setting(frac=0.75), k, layers, gating, {l: np.zeros(a.experts, np.float32) for l in layers}, store,
                           cache, False)
            try:
                t0 = time.perf_counter()
                res = hf.capture_hf(model, text, tokenizer=tok, n_predict=0, out=tmp / f"q{n}", override=ov,
                                    keep_output_logits=True, ubatch=1, gate_input=False)
                wall = time.perf_counter() - t0
            finally:
                for h in handles:
                    h.remove()
            shutil.rmtree(tmp / f"q{n}")
            return res.prefill_s, wall

        loop, pre, qf, qw = [], [], [], []
        for r in range(a.repeats):
            loop.append(loop_s())
            pre.append(prefill_s())
            f, w = quality_s(r)
            qf.append(f)
            qw.append(w)
        base = statistics.median(loop)
        print(f"{'mode':<34} {'median s':>9} {'best s':>8} {'x loop (median)':>16}")
        for name, xs in (("loop (plain teacher-forced pass)", loop), ("prefill (whole text, one forward)", pre),
                         ("quality F=0.75, forwards", qf), ("quality F=0.75, whole call", qw)):
            print(f"{name:<34} {statistics.median(xs):>9.3f} {min(xs):>8.3f} {statistics.median(xs) / base:>16.2f}")
        print(f"{len(ids)} tokens; budget {budget_mib:.1f} MiB (a quarter of the experts)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _llama(a: argparse.Namespace) -> None:
    import numpy as np

    from engine_bridge.capture import CaptureOptions, capture, validate
    from engine_bridge.engine import Engine, EngineOptions
    from engine_bridge.gguf_static import read_static
    from engine_bridge.quality import Setting, _DropColdGgml, new_cache
    from engine_bridge.tinymodel import TinyModelConfig, write_tiny_model
    from replay.core.simulate import budget_bytes

    print(machine())
    cfg = TinyModelConfig(arch="qwen3moe", layers=a.layers, experts=a.experts, top_k=a.top_k, embd=a.hidden,
                          expert_ff=a.expert_ff, heads=8, kv_heads=4, seed=0)
    tmp = Path(tempfile.mkdtemp(prefix="quality-bench-"))
    try:
        model = write_tiny_model(tmp / "m.gguf", cfg)
        static = read_static(model)
        print(f"llama.cpp, {a.threads} thread(s); qwen3moe GGUF: {a.layers} layers, embd {a.hidden}, {a.experts} experts, "
              f"top-{a.top_k}, expert ff {cfg.ff}, f16; {a.tokens} tokens teacher-forced")
        text = TEXT[:4 * a.tokens]  # the tiny GGUF's vocabulary makes short tokens: enough, within its context
        probe = validate(CaptureOptions(model=str(model), prompt=text, out=str(tmp / "probe"), n_decode=0, ubatch=1))
        tokens = probe.tokens[:a.tokens]
        leb = np.array([static.expert_bytes[l] for l in static.moe_layers], np.int64)
        budget_mib = float(leb.sum()) * a.experts / 4 / 2**20

        def loop_s() -> tuple[float, float]:
            eng = Engine(str(model), EngineOptions(n_ctx=len(tokens), ubatch=1, threads=a.threads, arch=static.arch,
                                                   kv_type="f32", flash_attn="off"), None)
            try:
                t0, c0 = time.perf_counter(), time.process_time()
                for pos, t in enumerate(tokens):
                    eng.decode([t], pos)
                return time.perf_counter() - t0, time.process_time() - c0
            finally:
                eng.close()

        def quality_s(n: int) -> tuple[float, float, float]:
            opts = CaptureOptions(model=str(model), prompt=text, out=str(tmp / f"q{n}"), n_decode=0, ubatch=1, logits=False,
                                  gate_input=False, kv_type="f32", flash_attn="off", threads=a.threads)
            plan = validate(opts, static)
            plan.tokens[:] = tokens
            plan.n_ctx = len(tokens)
            ov = _DropColdGgml(Setting(frac=0.75), list(static.moe_layers), new_cache("lru", leb, a.experts, budget_bytes(budget_mib)),
                               False)
            t0, c0 = time.perf_counter(), time.process_time()
            res = capture(opts, plan, override=ov, output_logits=[])
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            shutil.rmtree(tmp / f"q{n}")
            return res.prefill_s, wall, cpu

        loop, loop_cpu, qf, qw, qc = [], [], [], [], []
        for r in range(a.repeats):
            w, c = loop_s()
            loop.append(w)
            loop_cpu.append(c)
            f, w, c = quality_s(r)
            qf.append(f)
            qw.append(w)
            qc.append(c)
        base = statistics.median(loop)
        print(f"{'mode':<34} {'median s':>9} {'best s':>8} {'x loop (median)':>16}")
        for name, xs in (("loop (plain teacher-forced pass)", loop), ("quality F=0.75, decodes", qf),
                         ("quality F=0.75, whole call", qw)):
            print(f"{name:<34} {statistics.median(xs):>9.3f} {min(xs):>8.3f} {statistics.median(xs) / base:>16.2f}")
        # CPU seconds of this process (all its threads): on a loaded machine wall time includes
        # waiting for a core, which CPU time does not; the ratio of medians is then the steadier figure.
        cb = statistics.median(loop_cpu)
        print(f"{'CPU s: loop / quality whole call':<34} {cb:>9.3f} {statistics.median(qc):>8.3f} "
              f"{statistics.median(qc) / cb:>16.2f}")
        print(f"{len(tokens)} tokens; budget {budget_mib:.1f} MiB (a quarter of the experts)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
