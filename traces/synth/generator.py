"""Synthetic traces from a small residual-stream model (numpy, deterministic per seed).

The model is built so routings look like a real MoE's, not noise, and so that everything it
writes is mutually consistent (the fresh-gate control reproduces every routing exactly):

- each token's embedding mixes a slowly drifting *topic* vector (AR(1) with persistence
  ``reuse``) with fresh noise, so consecutive tokens reuse experts;
- the residual stream grows layer by layer, ``h_l = h_{l-1} + drift * u_l`` with ``u_l`` itself
  persistent across tokens; a layer's router applied one layer early therefore agrees with the
  real routing on a large but imperfect share of slots (set by ``drift``);
- the gate input is the RMS-normalized stream with one constant coordinate (a "massive
  activation" dimension); each router's weight on it is a per-expert popularity profile whose
  strength rises linearly with depth up to ``skew``, so popularity skew rises with depth;
- logits are computed in float64 from the float32 values stored in the trace, so any reader that
  recomputes them in float64 ranks experts identically.

It streams: tokens are generated and written in chunks; memory is bounded by the chunk size,
not the trace length.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from traces.format.errors import TraceError, UserError
from traces.format.gating import select
from traces.format.schema import MAX_INT32, MAX_LAYERS, default_gating
from traces.format.version import __version__ as tool_version
from traces.io.atomic import staged_dir
from traces.io.reader import open_trace
from traces.io.writer import TraceWriter
from traces.synth.schedule import RequestRoutes, schedule, schedule_index
from traces.util.memory import check_fits

GATINGS = ("softmax", "sigmoid-bias", "grouped")
# Qwen3-30B-A3B Q4_K_M: one expert's gate+up+down bytes, by whether llama.cpp's Q4_K_M mix gives
# the layer's ffn_down more bits (Q6_K) or not (Q4_K).
EXPERT_BYTES_MORE_BITS = 3_059_712
EXPERT_BYTES_BASE = 2_654_208
# Largest --drift / --skew / logit scale: the logits stay far inside float32, and a popularity
# weight this strong already fixes every routing.
MAX_SCALE = 1000.0
# Largest --rank: with the latent clipped to +-8 in steps of 2^-12 (traces.synth.kernels), a gate
# input coordinate (a sum of rank +-latents) stays a multiple of 2^-12 below 2^11: exact in float32.
MAX_RANK = 256


@dataclass(frozen=True)
class SynthConfig:
    layers: int = 16
    experts: int = 64
    top_k: int = 8
    embd: int = 128
    tokens: int = 256
    prompt_tokens: int = 32
    seed: int = 0
    gating: str = "softmax"
    routing_only: bool = False
    expert_bytes: int | None = None
    drift: float = 0.35
    reuse: float = 0.8
    skew: float = 3.0
    logit_scale: float = 2.0
    chunk_tokens: int = 256
    # Many requests (None = one request, no request column: the trace of before). Each request has
    # its own prompt (prompt_tokens) and decode (tokens), drawn from its own seeded stream through
    # the same routers, batched by traces.synth.schedule's continuous schedule at max_batch.
    requests: int | None = None
    max_batch: int = 1
    prefill_chunk: int | None = None
    # Low-rank residual stream (None = the full-width model of before, byte-identical): the stream
    # lives in a rank-dimensional latent space, so a token costs layers x experts x rank, not
    # x embd (traces.synth.kernels). A different model: other routings for the same seed.
    rank: int | None = None

    def check(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise UserError(msg)

        need(self.layers >= 1, f"--layers {self.layers}: need at least 1 MoE layer.")
        need(self.layers <= MAX_LAYERS, f"--layers {self.layers}: a trace holds at most {MAX_LAYERS} layers (int16 layer ids).")
        need(self.experts <= MAX_INT32 and self.embd <= MAX_INT32,
             f"--experts {self.experts} / --embd {self.embd}: at most {MAX_INT32} each.")
        need(self.tokens <= MAX_INT32 and self.prompt_tokens <= MAX_INT32 - self.tokens,
             f"--tokens {self.tokens} + --prompt-tokens {self.prompt_tokens}: at most {MAX_INT32} tokens in all (int32 steps).")
        need(0 <= self.seed < 1 << 63, f"--seed {self.seed} must lie in 0..2^63-1.")
        need(1 <= self.chunk_tokens <= MAX_INT32, f"chunk_tokens {self.chunk_tokens} must lie in 1..{MAX_INT32}.")
        for name, v in (("--drift", self.drift), ("--reuse", self.reuse), ("--skew", self.skew),
                        ("logit_scale", self.logit_scale)):
            # Beyond these the router logits overflow float32/float64 (NaN routings) or are one-hot anyway.
            need(math.isfinite(v), f"{name} {v} must be a finite number.")
            need(v <= MAX_SCALE, f"{name} {v} exceeds {MAX_SCALE:g} (logits would overflow; {MAX_SCALE:g} is already one-hot).")
        need(self.experts >= 2, f"--experts {self.experts}: a MoE layer needs at least 2 experts.")
        need(1 <= self.top_k <= self.experts, f"--top-k {self.top_k} must lie in 1..{self.experts} (--experts).")
        need(self.embd >= 2, f"--embd {self.embd}: need at least 2 (one coordinate is the constant one).")
        need(self.tokens >= 0 and self.prompt_tokens >= 0, "--tokens and --prompt-tokens must be >= 0.")
        need(self.tokens + self.prompt_tokens > 0, "--tokens and --prompt-tokens are both 0: nothing to generate.")
        need(self.requests is None or 1 <= self.requests <= 1 << 20,
             f"--requests {self.requests} must lie in 1..{1 << 20}.")
        need(self.max_batch >= 1, f"--max-batch {self.max_batch} must be >= 1 (requests decoding together).")
        need(self.requests is not None or (self.max_batch == 1 and self.prefill_chunk is None),
             "--max-batch and --prefill-chunk batch many requests: give --requests N too.")
        need(self.prefill_chunk is None or self.prefill_chunk >= 1,
             f"--prefill-chunk {self.prefill_chunk} must be >= 1 (prompt tokens per prefill batch).")
        need(self.rank is None or 1 <= self.rank <= min(MAX_RANK, self.embd - 1),
             f"--rank {self.rank} must lie in 1..{min(MAX_RANK, max(1, self.embd - 1))} (at most --embd - 1 and {MAX_RANK}).")
        need(self.gating in GATINGS, f"--gating {self.gating!r} is not one of {', '.join(GATINGS)}.")
        need(0.0 <= self.reuse < 1.0, f"--reuse {self.reuse} must lie in [0, 1).")
        need(self.drift >= 0.0 and self.skew >= 0.0, "--drift and --skew must be >= 0.")
        need(self.logit_scale > 0.0, f"logit_scale {self.logit_scale} must be > 0.")
        need(self.expert_bytes is None or 0 < self.expert_bytes < 1 << 40,
             f"--expert-bytes {self.expert_bytes} must be a positive byte count.")
        # Sizes are options: refuse what cannot fit before numpy tries to allocate it.
        check_fits(self.memory_bytes(), f"--layers {self.layers} x --experts {self.experts} x --embd {self.embd} "
                                        "(the synthetic model's router matrices and per-chunk arrays)")
        if self.gating == "grouped":
            need(self.experts % 8 == 0 and self.experts >= 16,
                 f"--gating grouped uses 8 expert groups: --experts {self.experts} must be a multiple of 8 and >= 16.")
            need(self.top_k <= self.experts // 2,
                 f"--gating grouped keeps 4 of 8 groups: --top-k {self.top_k} must be <= {self.experts // 2}.")

    def memory_bytes(self) -> int:
        """Peak bytes :func:`write_synthetic` allocates, roughly: the router matrices [L, E, D]
        (drawn in float64, kept in float32, copied once more to write router.parquet) and one
        chunk's gate inputs, logits and routings (float64 logits, float32 copies, stacked); the
        prompt is one chunk (one prefill batch); plus up to one part's rows generated ahead of the
        writer (at most 128 MiB)."""
        L, E, D, K = self.layers, self.experts, self.embd, self.top_k
        chunk = max(16, min(self.chunk_tokens, self.tokens), self.prompt_tokens)
        if self.requests is not None:  # every request's arrays are held, then scheduled and gathered
            chunk = max(chunk, 3 * self.requests * (self.tokens + self.prompt_tokens))
        row_bytes = 64 + K * 8 + (0 if self.routing_only else 4 * (E + D))
        ahead = min(128 << 20, min(4096, self.tokens) * L * row_bytes)
        return L * E * D * 24 + chunk * L * (E * 24 + D * 16 + K * 16) + ahead


def realistic_expert_bytes(n_layers: int) -> list[int]:
    """Per-layer expert sizes patterned on Qwen3-30B-A3B Q4_K_M (llama.cpp's ``use_more_bits``:
    the first and last eighth of the layers and every third one between get Q6_K ffn_down)."""
    eighth = n_layers // 8
    out = []
    for i in range(n_layers):
        more = i < eighth or i >= n_layers - eighth or (i - eighth) % 3 == 2
        out.append(EXPERT_BYTES_MORE_BITS if more else EXPERT_BYTES_BASE)
    return out


def gating_meta(kind: str) -> dict[str, Any]:
    if kind == "softmax":
        return default_gating("softmax", True)
    g = default_gating("sigmoid", True)
    g["selection_bias"] = True
    if kind == "grouped":
        g.update(n_group=8, topk_group=4, scale=2.5)
    return g


class _Model:
    """Router matrices and the residual-stream state of the synthetic model."""

    def __init__(self, cfg: SynthConfig) -> None:
        self.cfg = cfg
        rng = np.random.default_rng([cfg.seed, 0x5EED])
        L, E, D = cfg.layers, cfg.experts, cfg.embd
        self.W = (rng.standard_normal((L, E, D)) * (cfg.logit_scale / np.sqrt(D))).astype(np.float32)
        popularity = rng.standard_normal((L, E))
        depth = (np.arange(L) + 1) / L
        self.W[:, :, 0] = (cfg.skew * depth[:, None] * popularity).astype(np.float32)
        if cfg.gating == "softmax":
            self.bias = np.zeros((L, E), dtype=np.float32)
        else:
            self.bias = (rng.standard_normal((L, E)) * 0.05).astype(np.float32)
        self.gating = gating_meta(cfg.gating)
        self.start(np.random.default_rng([cfg.seed, 0x70CE]))

    def start(self, rng: np.random.Generator) -> None:
        """Start a stream (the trace's, or one request's) from ``rng``: its first draws are the state."""
        self.rng = rng
        self.topic = rng.standard_normal(self.cfg.embd)
        self.u = rng.standard_normal((self.cfg.layers, self.cfg.embd))

    def tokens(self, n: int) -> np.ndarray:
        """Gate inputs ``[L, n, D]`` (float32) for the next ``n`` tokens."""
        cfg = self.cfg
        L, D = cfg.layers, cfg.embd
        rho = cfg.reuse
        keep = np.sqrt(1.0 - rho * rho)
        # One draw for the n tokens: the generator yields the same numbers as n draws of
        # (topic D, u L x D, noise D) in turn, so the trace is the one the per-token loop wrote.
        z = self.rng.standard_normal((n, 2 * D + L * D))
        topic = np.empty((n, D))
        u = np.empty((n, L, D))
        for t in range(n):  # the AR(1) recurrences, in the loop's order of operations
            self.topic = rho * self.topic + keep * z[t, :D]
            self.u = rho * self.u + keep * z[t, D:D + L * D].reshape(L, D)
            topic[t] = self.topic
            u[t] = self.u
        h = 0.8 * topic + 0.6 * z[:, D + L * D:]
        stream = h[:, None, :] + cfg.drift * np.cumsum(u, axis=1)  # h_l = h_{l-1} + drift * u_l
        norm = stream / np.sqrt(np.mean(stream * stream, axis=2, keepdims=True))
        norm[:, :, 0] = 1.0  # the constant coordinate that carries expert popularity
        return np.ascontiguousarray(norm.transpose(1, 0, 2), dtype=np.float32)

    def route(self, layer: int, g: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, weights, logits) for gate inputs ``g`` ``[n, D]`` at ``layer``; logits in f64 from f32."""
        logits = g.astype(np.float64) @ self.W[layer].astype(np.float64).T
        ids, w = select(logits, self.gating, self.cfg.top_k, self.bias[layer])
        return ids, w, logits.astype(np.float32)

    def routes_later(self, n: int, pool: ThreadPoolExecutor | None) -> Callable[[], dict[str, np.ndarray]]:
        """:meth:`routes` now (the full-width model's chunk is one piece of numpy work)."""
        out = self.routes(n)
        return lambda: out

    def routes(self, n: int) -> dict[str, np.ndarray]:
        """The next ``n`` tokens token-major: ``experts`` / ``weights`` ``[n, L, k]``, and unless
        routing-only ``logits`` ``[n, L, E]`` and ``gate_input`` ``[n, L, D]`` (float32)."""
        g = self.tokens(n)
        per_layer = [self.route(l, g[l]) for l in range(self.cfg.layers)]
        out = {"experts": np.stack([p[0] for p in per_layer], axis=1), "weights": np.stack([p[1] for p in per_layer], axis=1)}
        if not self.cfg.routing_only:
            out["logits"] = np.stack([p[2] for p in per_layer], axis=1)
            out["gate_input"] = np.ascontiguousarray(g.transpose(1, 0, 2))
        return out


class _LowRankModel(_Model):
    """``--rank R``: the same routers, the residual stream in an R-dimensional latent space
    (traces.synth.kernels): per token, L x R state updates and L x E x R multiply-adds."""

    def __init__(self, cfg: SynthConfig) -> None:
        from traces.synth.kernels import project_routers

        super().__init__(cfg)
        R = int(cfg.rank or 0)
        prng = np.random.default_rng([cfg.seed, 0x5EED, 0x4A4B])
        self.P = prng.integers(0, 2, size=(cfg.embd, R)).astype(np.float64) * 2.0 - 1.0
        self.G = self.P.T @ self.P  # integers: exact in any order
        self.MT = project_routers(self.W, self.P)
        self.W0 = np.ascontiguousarray(self.W[:, :, 0], dtype=np.float64)

    def start(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.topic = rng.standard_normal(int(self.cfg.rank or 0))
        self.u = rng.standard_normal((self.cfg.layers, int(self.cfg.rank or 0)))

    def latents(self, n: int) -> np.ndarray:
        """Normalized, rounded latents ``[n, L, R]`` of the next ``n`` tokens (one bulk draw:
        the generator yields the same numbers as n draws of (topic R, u L x R, noise R) in turn)."""
        from traces.synth.kernels import latents

        cfg = self.cfg
        L, R = cfg.layers, int(cfg.rank or 0)
        z = self.rng.standard_normal((n, (L + 2) * R))
        out = np.empty((n, L, R))
        latents(z, self.topic, self.u, self.G, float(cfg.reuse), float(np.sqrt(1.0 - cfg.reuse * cfg.reuse)),
                float(cfg.drift), float(cfg.embd), out)
        return out

    def _route_jobs(self, sn: np.ndarray, ids: np.ndarray, wts: np.ndarray) -> list[Callable[[], None]]:
        """Softmax routing of the latents ``sn`` into ``ids`` / ``wts``, as jobs over disjoint token
        ranges (tokens route independently: the same bits however they are split); two halves when
        the chunk is large enough to be worth a second thread."""
        from traces.synth.kernels import softmax_route

        n, K = sn.shape[0], self.cfg.top_k
        scale = float(self.gating.get("scale", 1.0) or 1.0)
        cuts = [0, n // 2, n] if n >= 64 else [0, n]
        return [partial(softmax_route, sn[a:b], self.MT, self.W0, K, scale, ids[a:b], wts[a:b]) for a, b in zip(cuts, cuts[1:])]

    def routes_later(self, n: int, pool: ThreadPoolExecutor | None) -> Callable[[], dict[str, np.ndarray]]:
        """:meth:`routes` of the next ``n`` tokens, the softmax routing (routing only) submitted to
        ``pool`` so the caller can draw the next chunk's latents meanwhile; call the result for them."""
        if pool is None or self.cfg.gating != "softmax" or not self.cfg.routing_only:
            out = self.routes(n)
            return lambda: out
        L, K = self.cfg.layers, self.cfg.top_k
        sn = self.latents(n)
        ids = np.empty((n, L, K), np.int32)
        wts = np.empty((n, L, K), np.float32)
        futures = [pool.submit(job) for job in self._route_jobs(sn, ids, wts)]

        def done() -> dict[str, np.ndarray]:
            for f in futures:
                f.result()
            return {"experts": ids, "weights": wts}
        return done

    def routes(self, n: int) -> dict[str, np.ndarray]:
        from traces.synth.kernels import logits_of

        cfg = self.cfg
        L, E, K = cfg.layers, cfg.experts, cfg.top_k
        sn = self.latents(n)
        out: dict[str, np.ndarray] = {}
        logits = None
        if cfg.gating == "softmax":
            ids = np.empty((n, L, K), np.int32)
            wts = np.empty((n, L, K), np.float32)
            for job in self._route_jobs(sn, ids, wts):
                job()
            out = {"experts": ids, "weights": wts}
        if cfg.gating != "softmax" or not cfg.routing_only:
            logits = np.empty((n, L, E))
            logits_of(sn, self.MT, self.W0, logits)
        if cfg.gating != "softmax":
            sel = [select(logits[:, l], self.gating, K, self.bias[l]) for l in range(L)]
            out = {"experts": np.stack([x[0] for x in sel], axis=1), "weights": np.stack([x[1] for x in sel], axis=1)}
        if not cfg.routing_only:
            assert logits is not None
            g = sn @ self.P.T  # [n, L, D]: multiples of 2^-12 below 2^11, exact in any order
            g[:, :, 0] = 1.0
            out["logits"] = logits.astype(np.float32)
            out["gate_input"] = g.astype(np.float32)
        return out


def _model(cfg: SynthConfig) -> _Model:
    return _Model(cfg) if cfg.rank is None else _LowRankModel(cfg)


def _provenance(cfg: SynthConfig) -> dict[str, Any]:
    """The config as trace.json records it; the request options only when used (a one-request
    trace's trace.json stays byte-identical to the one written before they existed); ``rank`` the same."""
    out = asdict(cfg)
    if cfg.requests is None:
        for key in ("requests", "max_batch", "prefill_chunk"):
            out.pop(key)
    if cfg.rank is None:
        out.pop("rank")
    return out


def _write_requests(w: TraceWriter, model: _Model, cfg: SynthConfig, on_tokens: Callable[[int], None] | None) -> None:
    """``cfg.requests`` requests, each ``prompt_tokens`` + ``tokens`` positions drawn from its own
    stream (topic and residual state seeded by (seed, request)) through the shared routers, then
    batched by the continuous schedule (traces.synth.schedule) and written in its row order."""
    D = cfg.embd
    reqs, gates = [], []
    for r in range(int(cfg.requests or 0)):
        model.start(np.random.default_rng([cfg.seed, 0x70CE, 0x2E9, r]))
        P = cfg.prompt_tokens + cfg.tokens
        routed = model.routes(P)  # [P, L, ...]
        reqs.append(RequestRoutes(
            r, cfg.prompt_tokens, routed["experts"].astype(np.int32), weights=routed["weights"], logits=routed.get("logits")))
        gates.append(None if cfg.routing_only else routed["gate_input"].transpose(1, 0, 2))  # [L, P, D]
        if on_tokens:
            on_tokens(P)
    out = schedule(reqs, mode="continuous", max_batch=cfg.max_batch, prefill_chunk=cfg.prefill_chunk)
    opt: dict[str, np.ndarray] = {}
    if not cfg.routing_only:
        _, ri, rp, rl = schedule_index(reqs, mode="continuous", max_batch=cfg.max_batch, prefill_chunk=cfg.prefill_chunk)
        gate = np.empty((ri.size, D), np.float32)
        for i, g in enumerate(gates):
            sel = np.flatnonzero(ri == i)
            gate[sel] = g[rl[sel], rp[sel]]
        opt = {"logits": out["logits"], "gate_input": gate}
    cols = {c: out[c] for c in ("turn", "batch", "phase", "step", "layer", "experts", "weights", "request")}
    step = max(1, w.rows_per_part)
    for a in range(0, out["batch"].size, step):
        w.append(**{c: v[a:a + step] for c, v in cols.items()}, **{c: v[a:a + step] for c, v in opt.items()})


def _decode_chunks(model: _Model, tokens: int, chunk: int, pool: ThreadPoolExecutor | None
                   ) -> Iterator[tuple[int, Callable[[], dict[str, np.ndarray]]]]:
    """The decode tokens in chunks of ``chunk``: (n, a call that returns its routes ``[n, L, ...]``)."""
    done = 0
    while done < tokens:
        n = min(chunk, tokens - done)
        yield n, model.routes_later(n, pool)
        done += n


def _ahead(items: Iterator[Any], depth: int = 2) -> Iterator[Any]:
    """``items`` computed in a background thread up to ``depth`` ahead of the consumer, in order:
    the next chunk is generated (kernels, numpy and the random generator release the GIL) while
    this thread writes the last. An exception in the producer is raised here; a consumer that
    stops early stops the producer. Plain threads, no OpenMP: a later fork is safe."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(entry: tuple[Any, BaseException | None]) -> bool:
        while not stop.is_set():
            try:
                q.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
            put((done, None))
        except BaseException as e:  # handed to the consumer, raised there
            put((done, e))

    th = threading.Thread(target=produce, name="synth-ahead", daemon=True)
    th.start()
    try:
        while True:
            item, err = q.get()
            if err is not None:
                raise err
            if item is done:
                return
            yield item
    finally:
        stop.set()
        while th.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                pass
            th.join(timeout=0.05)


# first_bad_routing's codes, as the refusal names them
_BAD_ROUTING = {1: "an expert id outside 0..{e}", 2: "a routing selects the same expert twice",
                3: "a routing weight that is negative or not finite", 4: "routing weights not in router rank order"}


def _check_routes(out_dir: Path, experts: np.ndarray, weights: np.ndarray, n_expert: int, by_rank: bool) -> None:
    """The reader's row checks on routings (traces.io.reader._check_rows), on the arrays before they
    are written (traces.synth.kernels.first_bad_routing, one pass): expert ids in 0..n_expert-1
    and distinct in a row, weights finite and >= 0 and, ranked by the router (no selection bias),
    descending. Refuses with nothing written."""
    from traces.synth.kernels import first_bad_routing

    k = experts.shape[-1]
    ex = experts.reshape(-1, k)  # int32 from the kernels; anything else checked in int64 (no wrap-around)
    ex = np.ascontiguousarray(ex, dtype=np.int32 if ex.dtype == np.int32 else np.int64)
    w = np.ascontiguousarray(weights.reshape(-1, k), dtype=np.float32)
    code, row = first_bad_routing(ex, w, n_expert, by_rank)
    if code:
        raise UserError(f"{out_dir}: the generated trace would be invalid (row {row} of a chunk: "
                        f"{_BAD_ROUTING[code].format(e=n_expert - 1)}); nothing was written.")


def write_synthetic(out_dir: str | Path, cfg: SynthConfig, force: bool = False,
                    on_tokens: Callable[[int], None] | None = None) -> Path:
    """Generate a synthetic trace into a new directory ``out_dir`` (atomically).

    ``on_tokens(n)`` is called after each chunk of ``n`` tokens (for a progress bar). The router
    products are small (chunk x embd x experts): one BLAS thread computes them faster than a pool
    (measured 2.5x on 2 busy cores) and, splitting no dot product, bit-identically.
    """
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        return _write_synthetic(out_dir, cfg, force, on_tokens)


def _write_synthetic(out_dir: str | Path, cfg: SynthConfig, force: bool, on_tokens: Callable[[int], None] | None) -> Path:
    cfg.check()
    out_dir = Path(out_dir)
    L, E, D, K = cfg.layers, cfg.experts, cfg.embd, cfg.top_k
    model = _model(cfg)
    eb = [cfg.expert_bytes] * L if cfg.expert_bytes else realistic_expert_bytes(L)
    meta: dict[str, Any] = {
        "model": {
            "name": f"synthetic-L{L}-E{E}-k{K}-d{D}-seed{cfg.seed}", "arch": "synthetic", "n_layer": L,
            "moe_layers": list(range(L)), "n_expert": E, "top_k": K, "top_k_native": K, "n_embd": D,
        },
        "expert_bytes": eb,
        "dense_bytes": [None] * L,
        "gating": model.gating,
        "provenance": {
            "engine": "moe-replay synth", "engine_version": tool_version, "tool": "moe-replay",
            "tool_version": tool_version, "importer": None, "source_file": None, "prompts": None,
            "synth": _provenance(cfg),
        },
    }
    by_rank = not model.gating.get("selection_bias")
    # Two routing threads (a chunk's halves) while a third draws the next chunk's latents and this
    # one writes; plain threads, no OpenMP: a later fork is safe. None on a one-CPU machine.
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="synth") if len(os.sched_getaffinity(0)) > 1 else None
    try:
        return _write_staged(out_dir, cfg, force, on_tokens, model, meta, by_rank, pool)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _write_staged(out_dir: Path, cfg: SynthConfig, force: bool, on_tokens: Callable[[int], None] | None, model: _Model,
                  meta: dict[str, Any], by_rank: bool, pool: ThreadPoolExecutor | None) -> Path:
    L, E, D, K = cfg.layers, cfg.experts, cfg.embd, cfg.top_k
    columns: tuple[str, ...] = () if cfg.routing_only else ("logits", "gate_input")
    row_bytes = 64 + K * 8 + (0 if cfg.routing_only else 4 * (E + D))
    tokens_per_part = int(max(16, min(4096, (128 << 20) // (row_bytes * L))))
    chunk = int(max(1, min(cfg.chunk_tokens, tokens_per_part)))
    if cfg.requests is not None:
        columns = (*columns, "request")
    with staged_dir(out_dir, force=force) as stage:
        w = TraceWriter(stage, meta, columns=columns, tokens_per_part=tokens_per_part,
                        weights_checked=cfg.requests is None)  # by _check_routes, before every append
        if not cfg.routing_only:
            lay = np.repeat(np.arange(L), E)
            w.write_router(lay, np.tile(np.arange(E), L), model.W.reshape(L * E, D), model.bias.reshape(-1))
        requests_given = cfg.requests is not None
        if requests_given:
            _write_requests(w, model, cfg, on_tokens)
            cfg = replace(cfg, tokens=0, prompt_tokens=0)  # nothing more below
        batch = 0
        if cfg.prompt_tokens:
            # Prefill: one batch, rows layer-major then step (the (batch, layer, step) order).
            pre = model.routes(cfg.prompt_tokens)
            _check_routes(out_dir, pre["experts"], pre["weights"], E, by_rank)
            steps = np.arange(cfg.prompt_tokens)
            for l in range(L):
                opt = {c: pre[c][:, l] for c in ("logits", "gate_input") if c in pre}
                w.append(turn=0, batch=batch, phase=0, step=steps, layer=l, experts=pre["experts"][:, l],
                         weights=pre["weights"][:, l], **opt)
            batch += 1
            if on_tokens:
                on_tokens(cfg.prompt_tokens)
        done = 0
        # Up to one part's chunks ahead: while a part is encoded and written (one core, ~55 ms at
        # 4096 x 48 rows) the other core keeps generating instead of stalling on a full queue
        # (depth 2 left the two cores ~80% busy; one part's worth of routes is ~13 MB at that shape).
        depth = max(2, tokens_per_part // chunk)
        with contextlib.closing(_ahead(_decode_chunks(model, cfg.tokens, chunk, pool), depth=depth)) as chunks:
            # closed on an error too: the producer stops before the pool does
            for n, later in chunks:
                # Decode: one batch per token, rows token-major then layer.
                r = {c: v.reshape(n * L, -1) for c, v in later().items()}
                _check_routes(out_dir, r["experts"], r["weights"], E, by_rank)
                steps = cfg.prompt_tokens + done + np.arange(n)
                w.append(turn=0, batch=np.repeat(batch + np.arange(n), L), phase=1, step=np.repeat(steps, L),
                         layer=np.tile(np.arange(L), n), **r)
                batch += n
                done += n
                if on_tokens:
                    on_tokens(n)
        w.close(complete=True)
        try:  # the reader's checks before the rename: never a destination that every verb refuses
            # Without requests every routing was checked in memory before it was written
            # (_check_routes; keys and order by the writer): the files' metadata, schema and row
            # counts are checked here, not every row decoded again.
            open_trace(stage, check_rows=requests_given)
        except TraceError as e:
            raise UserError(f"{out_dir}: the generated trace would be invalid ({e.problem}); nothing was written.") from None
    return out_dir
