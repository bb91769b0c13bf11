"""Decode speed of capture-hf against plain transformers decoding of the same model, side by side.

    python -m benchmarks.capture_hf_overhead [--family qwen3_moe --layers 8 --hidden 512 --experts 64 --top-k 8]
                                             [--tokens 64] [--repeats 3] [--threads 1]

Builds a random-weight model (engine_bridge.hf_tiny, float32), then decodes the same greedy
continuation in four modes, interleaved ``--repeats`` times (median reported):

- ``generate``: ``model.generate(do_sample=False)`` with the KV cache; decode rate from the time of
  N tokens minus the time of 1 (the prompt's forward and generate's set-up cancel out);
- ``loop``: the forward loop capture-hf drives (one forward per token, DynamicCache), no hooks;
- ``capture routing-only``: capture_hf with ``--no-logits --no-gate-input`` (ids + weights written);
- ``capture full``: routing + raw logits + gate inputs, trace written.

Only decode is timed (capture_hf's ``decode_s``: the forward, the hooks and the trace rows);
prefill, model loading and the self-checks are not. The figures measure this machine's CPU,
thread count and load, not an engine in general; on a loaded machine read the best-of column.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks._common import add_tiny_model_args, start_tiny_model_run, write_tiny_model

PROMPT = "Benchmark the capture hook: the quick brown fox jumps over the lazy dog."


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_tiny_model_args(ap, tokens=64)
    a = ap.parse_args(argv)

    import torch

    from engine_bridge.hf import _cache_of, capture_hf

    start_tiny_model_run(a, "decoded tokens")
    tmp = Path(tempfile.mkdtemp(prefix="capture-hf-bench-"))
    try:
        mdir = write_tiny_model(tmp / "model", a)
        from engine_bridge.hf import load_model

        model, tok = load_model(str(mdir))
        ids = torch.tensor([tok(PROMPT)["input_ids"]])
        n = a.tokens

        def gen_rate() -> float:
            kw = dict(do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
            with torch.inference_mode():
                t0 = time.perf_counter()
                model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
                t1 = time.perf_counter()
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
                t2 = time.perf_counter()
            return (n - 1) / ((t2 - t1) - (t1 - t0))

        def loop_rate() -> float:
            with torch.inference_mode():
                out = model(input_ids=ids, use_cache=True)
                cache = _cache_of(out)
                nxt = int(out.logits[0, -1].argmax())
                t0 = time.perf_counter()
                for _ in range(n):
                    out = model(input_ids=torch.tensor([[nxt]]), use_cache=True, cache=cache)
                    nxt = int(out.logits[0, -1].argmax())
                return n / (time.perf_counter() - t0)

        def cap_rate(full: bool) -> float:
            out = tmp / f"trace-{time.monotonic_ns()}"
            r = capture_hf(model, PROMPT, tokenizer=tok, n_predict=n, out=out, ignore_eos=True, logits=full, gate_input=full)
            assert r.checks["passed"], r.checks
            shutil.rmtree(out)
            return r.decode_tok_s

        modes = {"generate": gen_rate, "loop": loop_rate, "capture routing-only": lambda: cap_rate(False),
                 "capture full": lambda: cap_rate(True)}
        loop_rate()  # warm-up
        rates: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(a.repeats):
            for m, fn in modes.items():
                rates[m].append(fn())
        print(f"{'mode':<22} {'tok/s median':>12} {'vs generate':>12} {'vs loop':>8} {'tok/s best':>11} "
              f"{'vs generate':>12} {'vs loop':>8}   all runs")
        for m, rs in rates.items():
            cells = []
            for f in (statistics.median, max):
                v = f(rs)
                cells.append(f"{v:>{12 if f is max else 12}.1f} {100 * (v / f(rates['generate']) - 1):>+11.1f}% "
                             f"{100 * (v / f(rates['loop']) - 1):>+7.1f}%")
            print(f"{m:<22} " + " ".join(cells) + "   " + ", ".join(f"{r:.1f}" for r in rs))
        loop_ms = 1000 / statistics.median(rates["loop"])
        for m in ("capture routing-only", "capture full"):
            extra = 1000 / statistics.median(rates[m]) - loop_ms
            print(f"{m}: {extra:+.2f} ms per decoded token over the bare loop's {loop_ms:.2f} ms (medians)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
