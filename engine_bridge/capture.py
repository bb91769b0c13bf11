"""Capture driver: run a prompt and a greedy decode through llama.cpp and stream a v1 trace.

Row order is (batch, layer, step): the prompt is split into compute batches of ``ubatch`` tokens
(each one ``llama_decode`` call, one graph), then every decoded token is its own batch. Part
files are closed every ``tokens_per_part`` tokens, so an interrupted capture keeps every token
up to the last closed part -- and Ctrl-C / SIGTERM are caught between ``llama_decode`` calls, so
the rows still buffered are flushed too and the trace is closed with ``complete: false``.

Everything that can be wrong with the input is checked before the output directory exists and
before llama.cpp sees it (:func:`validate`): llama.cpp aborts the process (``GGML_ASSERT``) on
inputs a Python caller would want refused. The prompt is tokenized first, with the vocabulary alone
(no weights, no context), and the context sized from tokens: prompt tokens + decoded tokens.
"""

from __future__ import annotations

import math
import os
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine_bridge.checks import checks_passed, run_checks
from engine_bridge.engine import (
    FLASH_ATTN,
    KV_TYPES,
    MAX_PROMPT_BYTES,
    MAX_THREADS,
    Engine,
    EngineOptions,
    Vocab,
    engine_version,
    require_capture_extra,
)
from engine_bridge.gguf_static import GgufStatic, read_static
from engine_bridge.hook import GraphShape, LayerCapture, MoeHook
from traces.format.errors import UserError
from traces.io.atomic import check_output_dir
from traces.io.writer import TraceWriter
from traces.util.rounding import input_rounding
from traces.util.signals import on_signals


@dataclass
class CaptureOptions:
    model: str
    prompt: str
    out: str
    n_decode: int = 64
    logits: bool = True
    gate_input: bool = True
    n_expert_used: int | None = None
    ubatch: int = 512
    threads: int | None = None
    seed: int = 0
    temp: float = 0.0  # 0 = greedy
    ignore_eos: bool = False
    tokens_per_part: int = 64
    verbose: bool = False
    prompt_source: str | None = None  # the --prompt-file path, for provenance
    kv_type: str = "f16"  # KV cache type (llama.cpp's default f16)
    flash_attn: str = "auto"  # flash attention: auto | on | off


class TokenRates:
    """decode_tok_s and prefill_tok_s of a capture result (None where no tokens or no time were
    measured), from its prompt_tokens, decode_tokens, prefill_s and decode_s."""

    prompt_tokens: int
    decode_tokens: int
    prefill_s: float
    decode_s: float

    @property
    def decode_tok_s(self) -> float | None:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 and self.decode_tokens else None

    @property
    def prefill_tok_s(self) -> float | None:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 and self.prompt_tokens else None


@dataclass
class CaptureResult(TokenRates):
    out: Path
    complete: bool
    prompt_tokens: int
    decode_tokens: int
    prefill_batches: int
    prefill_s: float
    decode_s: float
    checks: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    stop_reason: str = ""


@dataclass
class CapturePlan:
    """What :func:`validate` established: the model's static data, the prompt's tokens and the sizes
    the context is created with (every one checked against what llama.cpp accepts)."""

    static: GgufStatic
    tokens: list[int]
    n_ctx: int  # positions the run reaches: prompt tokens + decoded tokens
    n_ctx_train: int  # the model's training context (0: the GGUF does not say)
    ubatch: int  # the compute batch the prompt is split into: min(--ubatch, prompt tokens)
    n_vocab: int

    @property
    def prefill_batches(self) -> int:
        return -(-len(self.tokens) // self.ubatch)


def _check_options(opts: CaptureOptions) -> None:
    if not opts.prompt or not opts.prompt.strip():
        raise UserError("the prompt is empty (give --prompt TEXT or a non-empty --prompt-file).")
    if len(opts.prompt.encode("utf-8")) > MAX_PROMPT_BYTES:
        raise UserError(f"the prompt is longer than llama.cpp can tokenize ({MAX_PROMPT_BYTES} bytes).")
    if opts.n_decode < 0:
        raise UserError("-n must be 0 or more (the number of tokens to decode after the prompt).")
    if opts.ubatch < 1:
        raise UserError("--ubatch must be at least 1.")
    if opts.threads is not None and not 1 <= opts.threads <= MAX_THREADS:
        raise UserError(f"--threads must be between 1 and {MAX_THREADS} (ggml's limit).")
    if opts.tokens_per_part < 1:
        raise UserError("--part-tokens must be at least 1.")
    if not math.isfinite(opts.temp) or opts.temp < 0:
        raise UserError("--temp must be 0 (greedy) or a finite positive number.")
    if opts.seed < 0:
        raise UserError("--seed must be 0 or more.")
    if opts.kv_type not in KV_TYPES:
        raise UserError(f"--kv-type {opts.kv_type!r} is not one of {', '.join(KV_TYPES)}.")
    if opts.flash_attn not in FLASH_ATTN:
        raise UserError(f"--flash-attn {opts.flash_attn!r} is not one of {', '.join(FLASH_ATTN)}.")


def validate(opts: CaptureOptions, static: GgufStatic | None = None) -> CapturePlan:
    """Every check that needs no context: options, the GGUF, the output directory, then the prompt
    tokenized with the model's vocabulary and the sizes planned from its tokens. Raises UserError;
    writes nothing."""
    require_capture_extra("capture")
    _check_options(opts)
    static = static or read_static(opts.model)
    if opts.n_expert_used is not None and not 1 <= opts.n_expert_used <= static.n_expert:
        raise UserError(f"--n-expert-used {opts.n_expert_used} is out of range: {static.name} has {static.n_expert} experts "
                        f"(native top-k {static.top_k_native}); give 1..{static.n_expert}.")
    out = Path(opts.out)
    if out.is_dir() and any(out.iterdir()):
        # A capture streams into its directory; it never replaces an existing trace.
        raise UserError(f"{out}: output directory exists and is not empty (choose a new --out).")
    out = check_output_dir(out, force=False, inputs=[opts.model, opts.prompt_source])
    _probe_writable(out)
    return _plan(opts, static)


def _plan(opts: CaptureOptions, static: GgufStatic) -> CapturePlan:
    """Tokenize with the vocabulary alone and size the run from tokens."""
    model = opts.model
    with Vocab(model, verbose=opts.verbose) as vocab:
        if not vocab.has_tokenizer:
            raise UserError(f"{model}: the model has no tokenizer (tokenizer.ggml.model is none), so a text prompt "
                            "cannot be turned into tokens.")
        tokens = vocab.tokenize(opts.prompt)
        n_vocab = vocab.n_vocab
    if not tokens:
        raise UserError(f"the prompt tokenizes to no tokens with {model}'s tokenizer.")
    bad = [t for t in tokens if not 0 <= t < n_vocab]
    if bad:
        raise UserError(f"{model}: its tokenizer produced token id {bad[0]}, outside its vocabulary of {n_vocab} tokens.")
    n_ctx = len(tokens) + opts.n_decode
    n_ctx_train = static.n_ctx_train
    _check_context(opts, len(tokens), n_ctx_train)
    return CapturePlan(static=static, tokens=tokens, n_ctx=n_ctx, n_ctx_train=n_ctx_train,
                       ubatch=min(opts.ubatch, len(tokens)), n_vocab=n_vocab)


def _probe_writable(out: Path) -> None:
    """Create and remove a scratch entry where the trace will go: os.access says yes to root on
    read-only or pseudo file systems, and a capture must not fail after minutes of decoding."""
    where = out if out.is_dir() else out.resolve().parent
    try:
        scratch = tempfile.mkdtemp(prefix=".moe-replay-probe-", dir=where)
        os.rmdir(scratch)
    except OSError as e:
        raise UserError(f"{out}: cannot write the output directory there ({e.strerror}).") from None


def gating_from_graph(shape: GraphShape, static: GgufStatic) -> dict[str, Any]:
    """The selection rule as the engine built it (node ops), not as a table says it should be."""
    names = shape.names
    if "ffn_moe_weights_softmax" in names:
        act = "softmax_weight"
    elif shape.probs_op == "SOFT_MAX":
        act = "softmax"
    elif shape.probs_op == "UNARY:SIGMOID":
        act = "sigmoid"
    else:
        act = None  # e.g. sqrt(softplus): the trace's gating vocabulary has no name for it
    grouped = "ffn_moe_group_topk" in names
    return {
        "activation": act,
        "norm_topk": "ffn_moe_weights_norm" in names,
        "selection_bias": "ffn_moe_probs_biased" in names,
        "n_group": int(static.keys.get("expert_group_count", 1)) if grouped else 1,
        "topk_group": int(static.keys.get("expert_group_used_count", 1)) if grouped else 1,
        "scale": float(shape.weight_scale) if shape.weight_scale is not None else 1.0,
    }


def _check_context(opts: CaptureOptions, n_prompt: int, n_ctx_train: int) -> None:
    n_ctx = n_prompt + opts.n_decode
    limit = n_ctx_train if n_ctx_train > 0 else 2**31 - 1
    if n_ctx > limit:
        raise UserError(f"the prompt ({n_prompt} tokens) plus -n {opts.n_decode} needs a context of {n_ctx} tokens, more "
                        f"than {opts.model}'s training context of {limit}; shorten the prompt or lower -n.")


def build_meta(static: GgufStatic, shape: GraphShape, top_k: int, opts: CaptureOptions, plan: CapturePlan) -> dict[str, Any]:
    from replay import __version__ as tool_version

    stored = sorted(set(static.router_type.values()))
    ver = engine_version()
    gating = gating_from_graph(shape, static)
    return {
        "model": {
            "name": static.name, "arch": static.arch, "n_layer": static.n_layer, "moe_layers": static.moe_layers,
            "n_expert": static.n_expert, "top_k": int(top_k), "top_k_native": static.top_k_native, "n_embd": static.n_embd,
        },
        "expert_bytes": static.expert_bytes,
        "dense_bytes": static.dense_bytes,
        "nonlayer_bytes": static.nonlayer_bytes,
        "gating": gating,
        # What to round the gate input to before multiplying by router.parquet's (dequantized)
        # matrix, to reproduce the engine's logits (see engine_bridge.checks).
        "router_input_rounding": input_rounding(stored[0]) if len(stored) == 1 else "mixed",
        "router_stored_type": stored[0] if len(stored) == 1 else stored,
        "router_logit_bias": bool(static.logit_bias) or "ffn_moe_logits_biased" in shape.names,
        "provenance": {
            "engine": "llama.cpp (llama-cpp-python, eval callback)",
            "engine_version": f"llama-cpp-python {ver['llama_cpp_python']}, ggml {ver.get('ggml_version', '?')} "
                              f"({ver.get('ggml_commit', '?')})",
            "engine_build": ver,
            "tool": "moe-replay", "tool_version": tool_version, "importer": None,
            "source_file": str(static.path), "source_file_bytes": static.file_bytes,
            "prompts": [opts.prompt], "prompt_file": opts.prompt_source,
            "gguf_gating_keys": static.keys,
            "graph_nodes_seen": sorted(shape.names),
            "capture": {
                "prompt_tokens": len(plan.tokens), "decode_tokens_requested": opts.n_decode, "ubatch": plan.ubatch,
                "ubatch_requested": opts.ubatch, "n_ctx": plan.n_ctx, "n_ctx_train": plan.n_ctx_train,
                "threads": opts.threads, "seed": opts.seed, "temp": opts.temp, "ignore_eos": opts.ignore_eos,
                "n_expert_used": opts.n_expert_used, "columns_logits": opts.logits, "columns_gate_input": opts.gate_input,
                "kv_type": opts.kv_type, "flash_attn": opts.flash_attn,
            },
        },
    }


class _Stop:
    """Set by SIGINT/SIGTERM; the loop looks at it between llama_decode calls."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def __call__(self, signum: int, _frame: Any) -> None:
        self.signal = signum


class _Rows:
    """Rows of whole batches not yet handed to the writer (appended in one call per flush).

    ``logit_bias``: {layer: [n_expert] float32} the router adds to its matmul (gpt-oss's
    ``ffn_gate_inp.bias``). The logits column holds what the router ranks, so the bias is added
    here to the observed matmul (``ffn_moe_logits``): the same float32 addition the engine's ADD
    node does, so the values are the engine's, without observing (and splitting the graph at) one
    more node per layer."""

    def __init__(self, columns: tuple[str, ...], logit_bias: dict[int, np.ndarray] | None = None) -> None:
        self.columns = columns
        self.logit_bias = logit_bias or {}
        self.chunks: list[dict[str, np.ndarray]] = []
        self.tokens = 0

    def add(self, batch: int, phase: int, pos0: int, layers: list[int], caps: dict[int, LayerCapture],
            tokens: list[int]) -> None:
        n_tok = caps[layers[0]].experts.shape[0]
        steps = pos0 + np.arange(n_tok, dtype=np.int32)
        d = {
            "batch": np.full(n_tok * len(layers), batch, dtype=np.int32),
            "phase": np.full(n_tok * len(layers), phase, dtype=np.int8),
            "step": np.tile(steps, len(layers)),
            "layer": np.repeat(np.asarray(layers, dtype=np.int16), n_tok),
            "experts": np.concatenate([caps[l].experts for l in layers]),
            "weights": np.concatenate([caps[l].weights for l in layers]),
        }
        if "logits" in self.columns:
            d["logits"] = np.concatenate([caps[l].logits + self.logit_bias[l] if l in self.logit_bias else caps[l].logits
                                          for l in layers])
        if "gate_input" in self.columns:
            d["gate_input"] = np.concatenate([caps[l].gate_input for l in layers])
        if "token" in self.columns:  # the token id each row's position holds (compare checks two runs saw the same)
            d["token"] = np.tile(np.asarray(tokens, dtype=np.int32), len(layers))
        if "dropped" in self.columns:  # the slots a routing override zeroed
            d["dropped"] = np.concatenate([caps[l].dropped for l in layers])
        self.chunks.append(d)
        self.tokens += n_tok

    def flush(self, writer: TraceWriter) -> None:
        if not self.chunks:
            return
        cat = {k: np.concatenate([c[k] for c in self.chunks]) for k in self.chunks[0]}
        opt = {c: cat[c] for c in self.columns}
        writer.append(turn=0, batch=cat["batch"], phase=cat["phase"], step=cat["step"], layer=cat["layer"],
                      experts=cat["experts"], weights=cat["weights"], **opt)
        self.chunks, self.tokens = [], 0


def _check_batch(caps: dict[int, LayerCapture], layers: list[int], n_tok: int, opts: CaptureOptions) -> None:
    missing = [l for l in layers if l not in caps or caps[l].experts is None]
    if missing:
        raise RuntimeError(f"the eval callback saw no routing for MoE layer(s) {missing} in this batch "
                           "(the graph of this architecture does not build its MoE through build_moe_ffn)")
    for l in layers:
        c = caps[l]
        if c.experts.shape[0] != n_tok:
            raise RuntimeError(f"layer {l}: captured {c.experts.shape[0]} token rows for a batch of {n_tok}")
        if opts.logits and c.logits is None or opts.gate_input and c.gate_input is None:
            raise RuntimeError(f"layer {l}: the router logits node (ffn_moe_logits) was not observed")


def capture(opts: CaptureOptions, plan: CapturePlan | None = None,
            progress: Callable[[int, str], None] | None = None, *, static: GgufStatic | None = None,
            override: Callable[[int, np.ndarray, np.ndarray], np.ndarray | None] | None = None,
            output_logits: list[np.ndarray] | None = None) -> CaptureResult:
    """Run the capture described by ``opts`` into the new directory ``opts.out``.

    ``plan``: what :func:`validate` returned (validated here when not given; ``static`` saves
    re-reading the GGUF). ``override``: a routing intervention (layer, ids [T, k] in rank order,
    final weights [T, k]) -> new weights or None, written into the weights node inside the forward
    pass (the trace gains a ``dropped`` column: the slots it zeroed). ``output_logits``: a list the
    vocabulary logits of each batch's last token are appended to (with ``ubatch`` 1: every position)."""
    plan = plan or validate(opts, static)
    static = plan.static
    wide = tuple(c for c, on in (("logits", opts.logits), ("gate_input", opts.gate_input)) if on)
    columns = (*wide, "token") + (("dropped",) if override is not None else ())
    hook = MoeHook(static.n_layer, observe_logits=bool(wide), want_logits=opts.logits, want_gate_input=opts.gate_input)
    hook.override = override
    # The context holds exactly the positions the run reaches; one llama_decode = one ubatch.
    eopts = EngineOptions(n_ctx=plan.n_ctx, ubatch=plan.ubatch, threads=opts.threads, n_expert_used=opts.n_expert_used,
                          arch=static.arch, verbose=opts.verbose, kv_type=opts.kv_type, flash_attn=opts.flash_attn)
    engine = Engine(opts.model, eopts, hook.callback, hook.user_data)
    try:
        # The training context as llama.cpp itself read it, once more before anything is written.
        _check_context(opts, len(plan.tokens), engine.n_ctx_train)
        return _run(opts, plan, hook, engine, columns, progress, output_logits)
    finally:
        engine.close()


def _run(opts: CaptureOptions, plan: CapturePlan, hook: MoeHook, engine: Engine,
         columns: tuple[str, ...], progress: Callable[[int, str], None] | None,
         output_logits: list[np.ndarray] | None = None) -> CaptureResult:
    static, tokens, ubatch = plan.static, plan.tokens, plan.ubatch
    out = Path(opts.out)
    layers = static.moe_layers
    rng = np.random.default_rng(opts.seed)
    stop = _Stop()
    writer: TraceWriter | None = None
    rows = _Rows(columns, {l: b.astype(np.float32) for l, b in static.logit_bias.items()})
    batch = 0
    pos = 0
    n_dec = 0
    prefill_s = decode_s = 0.0
    stop_reason = "done"
    generated: list[int] = []

    def open_writer(top_k: int) -> TraceWriter:
        meta = build_meta(static, hook.shape, top_k, opts, plan)
        out.mkdir(parents=False, exist_ok=True)
        w = TraceWriter(out, meta, columns=columns, tokens_per_part=opts.tokens_per_part)
        lay = np.repeat(np.asarray(layers), static.n_expert)
        ex = np.tile(np.arange(static.n_expert), len(layers))
        W = np.concatenate([static.router[l] for l in layers])
        bias = np.concatenate([static.selection_bias.get(l, np.zeros(static.n_expert, np.float32)) for l in layers])
        lbias = (np.concatenate([static.logit_bias.get(l, np.zeros(static.n_expert, np.float32)) for l in layers])
                 if static.logit_bias else None)  # gpt-oss: ffn_gate_inp.bias, added to the logits
        w.write_router(lay, ex, W, bias, lbias)
        return w

    complete = False
    try:
        with on_signals(stop):
            logits_vocab = None
            for start in range(0, len(tokens), ubatch):
                if stop.signal is not None:
                    break
                chunk = tokens[start:start + ubatch]
                t0 = time.perf_counter()
                logits_vocab = engine.decode(chunk, pos)
                if output_logits is not None:
                    output_logits.append(logits_vocab)
                caps = hook.take()
                _check_batch(caps, layers, len(chunk), opts)
                if writer is None:
                    writer = open_writer(caps[layers[0]].experts.shape[1])
                rows.add(batch, 0, pos, layers, caps, chunk)
                if rows.tokens >= opts.tokens_per_part:
                    rows.flush(writer)  # one append per part (small --ubatch: not one per batch)
                prefill_s += time.perf_counter() - t0
                batch += 1
                pos += len(chunk)
                if progress:
                    progress(len(chunk), "prefill")
            while n_dec < opts.n_decode and stop.signal is None and logits_vocab is not None:
                tok = _next_token(logits_vocab, opts.temp, rng)
                if engine.is_eog(tok) and not opts.ignore_eos:
                    stop_reason = "end of generation token"
                    break
                generated.append(tok)
                t0 = time.perf_counter()
                logits_vocab = engine.decode([tok], pos)
                if output_logits is not None:
                    output_logits.append(logits_vocab)
                caps = hook.take()
                _check_batch(caps, layers, 1, opts)
                rows.add(batch, 1, pos, layers, caps, [tok])
                if rows.tokens >= opts.tokens_per_part:
                    rows.flush(writer)  # one append per part file: the writer closes it at once
                decode_s += time.perf_counter() - t0
                batch += 1
                pos += 1
                n_dec += 1
                if progress:
                    progress(1, "decode")
            if stop.signal is not None:
                stop_reason = f"interrupted by {signal.Signals(stop.signal).name}"
            complete = stop.signal is None
    finally:
        if writer is not None:
            # Whatever happened, the rows of every finished batch reach disk and trace.json says
            # whether the run finished; a reader then opens a valid (maybe incomplete) trace.
            try:
                rows.flush(writer)
            finally:
                writer.close(complete=complete)
    if writer is None:
        raise UserError("nothing was captured: the run was interrupted before the first batch finished.")
    n_prompt_done = min(pos, len(tokens))
    writer.update_meta(
        capture_summary={
            "prompt_tokens": n_prompt_done, "decode_tokens": n_dec, "prefill_batches": -(-n_prompt_done // ubatch),
            "stop_reason": stop_reason, "generated_text": "".join(engine.piece(t) for t in generated),
            "observed_nodes": hook.observed,
        }
    )
    checks = run_checks(out, logit_bias=static.logit_bias)
    checks["passed"] = checks_passed(checks)
    writer.update_meta(checks=checks)
    return CaptureResult(
        out=out, complete=complete, prompt_tokens=n_prompt_done, decode_tokens=n_dec,
        prefill_batches=-(-n_prompt_done // ubatch), prefill_s=prefill_s, decode_s=decode_s, checks=checks,
        meta=writer.meta, stop_reason=stop_reason,
    )


def _next_token(logits: np.ndarray, temp: float, rng: np.random.Generator) -> int:
    if temp <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temp
    p = np.exp(z - z.max())
    p /= p.sum()
    return int(rng.choice(p.size, p=p))


def options_dict(opts: CaptureOptions) -> dict[str, Any]:
    return asdict(opts)
