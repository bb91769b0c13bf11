"""Hypothesis strategies that build small valid traces (with recorded engine columns)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
from hypothesis import strategies as st

from traces import TraceWriter
from traces.format.schema import default_gating
from traces.synth.schedule import RequestRoutes, schedule

_counter = itertools.count()


def small_shape(draw, unit: int) -> tuple:
    """(moe_layers, n_layer, n_expert, k, expert bytes per MoE layer): 1-4 MoE layers among up to 2
    more, 1-8 experts, top-1..4, each layer's experts 1-5 ``unit``s."""
    n_moe = draw(st.integers(1, 4))
    n_layer = n_moe + draw(st.integers(0, 2))
    moe_layers = sorted(draw(st.permutations(range(n_layer)))[:n_moe])
    n_expert = draw(st.integers(1, 8))
    k = draw(st.integers(1, 4))
    eb = {l: draw(st.integers(1, 5)) * unit for l in moe_layers}
    return moe_layers, n_layer, n_expert, k, eb


def turn_rows(plan, moe_layers, experts) -> list[tuple]:
    """Rows (turn, batch, phase, step, layer, experts) of one request's turns in file order: per
    turn (n_prefill, n_decode) of ``plan``, one prefill batch of n_prefill steps (none if 0), then
    one batch per decoded step; ``experts()`` gives each routing's ids."""
    rows = []
    batch = step = 0
    for turn, (n_prefill, n_decode) in enumerate(plan):
        batches = ([(0, list(range(step, step + n_prefill)))] if n_prefill else [])
        batches += [(1, [step + n_prefill + i]) for i in range(n_decode)]
        step += n_prefill + n_decode
        for phase, steps in batches:
            for layer in moe_layers:
                for s in steps:
                    rows.append((turn, batch, phase, s, layer, experts()))
            batch += 1
    return rows


def _request_batches(draw, max_requests: int, max_tokens: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """Batches [(phase, [(request, step), ...])] of several requests, laid out by the continuous
    schedule (traces.synth.schedule) at a drawn max_batch / prefill chunk; request ids drawn, not 0..n-1."""
    n = draw(st.integers(1, max_requests))
    ids = draw(st.lists(st.integers(0, 2**40), min_size=n, max_size=n, unique=True))
    reqs = []
    for rid in ids:
        prompt, gen = draw(st.integers(0, 3)), draw(st.integers(0, max_tokens))
        reqs.append(RequestRoutes(rid, prompt, np.zeros((prompt + gen, 1, 1), np.int32)))
    if not any(r.experts.shape[0] for r in reqs):
        reqs[0] = RequestRoutes(ids[0], 0, np.zeros((1, 1, 1), np.int32))
    out = schedule(reqs, mode="continuous", max_batch=draw(st.integers(1, 3)),
                   prefill_chunk=draw(st.one_of(st.none(), st.integers(1, 3))))
    batches: list[tuple[int, list[tuple[int, int]]]] = []
    for b, ph, rid, step in zip(out["batch"].tolist(), out["phase"].tolist(), out["request"].tolist(), out["step"].tolist()):
        if b == len(batches):
            batches.append((ph, []))
        batches[b][1].append((rid, step))
    return batches


@st.composite
def recorded_traces(draw, max_layers=4, max_experts=8, max_k=4, max_tokens=6, max_requests=0):
    """A dict describing a trace: prefill (one batch of P tokens) then decode tokens, with
    recorded residency and read_bytes (first miss of an expert in a load reads, repeats read 0).

    With ``max_requests`` > 0, some drawn traces hold several requests (a ``request`` column):
    their batches mix the requests' tokens as a server engine's continuous batching does, and
    ``step`` is the position inside each request."""
    n_layer = draw(st.integers(1, max_layers))
    n_expert = draw(st.integers(2, max_experts))
    k = draw(st.integers(1, min(max_k, n_expert)))
    prefill = draw(st.integers(0, 4))
    decode = draw(st.integers(1 if prefill == 0 else 0, max_tokens))
    seed = draw(st.integers(0, 2**31 - 1))
    sizes = draw(st.lists(st.integers(1, 5000), min_size=n_layer, max_size=n_layer))
    rng = np.random.default_rng(seed)
    rows = []
    has_request = max_requests > 0 and draw(st.booleans())
    if has_request:
        batches = _request_batches(draw, max_requests, max_tokens)
    else:
        batches = ([(0, [(0, s) for s in range(prefill)])] if prefill else []) + [
            (1, [(0, prefill + t)]) for t in range(decode)]
    for b, (phase, tokens) in enumerate(batches):
        for layer in range(n_layer):
            seen = set()
            for request, step in tokens:
                ex = rng.choice(n_expert, size=k, replace=False)
                # coarse weights so ties and threshold edges happen
                w = np.sort(rng.integers(0, 5, size=k).astype(np.float32) / 4.0)[::-1]  # router rank order
                res = rng.integers(0, 2, size=k)
                rb = []
                for s in range(k):
                    e = int(ex[s])
                    if res[s] == 0 and e not in seen:
                        rb.append(sizes[layer])
                        seen.add(e)
                    else:
                        rb.append(0)
                row = {"turn": 0, "batch": b, "phase": phase, "step": step, "layer": layer,
                       "experts": ex.tolist(), "weights": w.tolist(), "residency": res.tolist(), "read_bytes": rb}
                if has_request:
                    row["request"] = request
                rows.append(row)
    return {"n_layer": n_layer, "n_expert": n_expert, "k": k, "sizes": sizes, "rows": rows, "request": has_request}


def write_trace(spec, root: Path) -> Path:
    """Write a spec from :func:`recorded_traces` as a v1 trace directory under ``root``."""
    out = root / f"t{next(_counter)}"
    out.mkdir(parents=True)
    n_layer, k = spec["n_layer"], spec["k"]
    meta = {
        "model": {"name": "h", "arch": "test", "n_layer": n_layer, "moe_layers": list(range(n_layer)),
                  "n_expert": spec["n_expert"], "top_k": k, "top_k_native": k, "n_embd": None},
        "expert_bytes": list(spec["sizes"]), "dense_bytes": [None] * n_layer,
        "gating": default_gating("softmax", True), "provenance": {"engine": "hypothesis"},
    }
    req = ("request",) if spec.get("request") else ()
    w = TraceWriter(out, meta, columns=("residency", "read_bytes", *req), tokens_per_part=3)
    for r in spec["rows"]:
        w.append(turn=r["turn"], batch=r["batch"], phase=r["phase"], step=r["step"], layer=r["layer"],
                 experts=[r["experts"]], weights=[r["weights"]], residency=[r["residency"]], read_bytes=[r["read_bytes"]],
                 **({"request": [r["request"]]} if req else {}))
    w.close()
    return out
