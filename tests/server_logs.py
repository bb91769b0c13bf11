"""Write routing logs exactly as the server engines write them (for the importer tests).

Each writer follows its engine's own source (the importer modules' docstrings name the file and
commit read): vLLM ``vllm/outputs.py`` (003d3ee2) and its OpenAI responses; SGLang
``python/sglang/srt/eplb/expert_distribution.py`` (02295fe5: ``_DetailSinglePassGatherer.collect``,
``_DetailAccumulator.dump``) and the ``/generate`` response's ``meta_info``; Megatron-LM
``megatron/core/transformer/moe/router_trace.py`` (c1560d94: ``_make_index_record``, ``_record``,
``_flush_records_to_disk``).
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# -- vLLM ----------------------------------------------------------------------------------------


def npy_b64(arr: np.ndarray) -> str:
    """What vLLM's OpenAI server puts on the wire for an array: base64 of ``np.save`` bytes."""
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


@dataclass
class VReq:
    """One vLLM request: prompt rows [P, L, k] (-1 rows = prefix-cached), generated rows [G-1, L, k]."""

    prompt_ids: list[int]
    prompt: np.ndarray
    output_ids: list[int]
    generated: np.ndarray


def vllm_completion(r: VReq, i: int, *, encoding: str = "b64", version: str = "0.21.0") -> dict:
    """A ``/v1/completions`` response body with ``--enable-return-routed-experts``."""
    enc = npy_b64 if encoding == "b64" else (lambda a: a.tolist())
    cached = int((r.prompt < 0).all(axis=(1, 2)).sum())
    return {
        "id": f"cmpl-{i:04x}", "object": "text_completion", "created": 1780000000 + i, "model": "Qwen/Qwen3-30B-A3B",
        "choices": [{"index": 0, "text": "...", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                     "token_ids": r.output_ids, "routed_experts": enc(r.generated), "prompt_logprobs": None}],
        "service_tier": None, "system_fingerprint": f"vllm-{version}-2c744646",
        "usage": {"prompt_tokens": len(r.prompt_ids), "total_tokens": len(r.prompt_ids) + len(r.output_ids),
                  "completion_tokens": len(r.output_ids),
                  "prompt_tokens_details": {"cached_tokens": cached} if cached else None},
        "prompt_routed_experts": enc(r.prompt), "prompt_logprobs": None, "prompt_token_ids": r.prompt_ids,
        "kv_transfer_params": None,
    }


def vllm_request_output(r: VReq, i: int) -> dict:
    """``RequestOutput`` / ``CompletionOutput`` attributes dumped as JSON (nested lists)."""
    return {"request_id": str(i), "prompt_token_ids": r.prompt_ids, "prompt_routed_experts": r.prompt.tolist(),
            "num_cached_tokens": int((r.prompt < 0).all(axis=(1, 2)).sum()), "finished": True,
            "outputs": [{"index": 0, "text": "...", "token_ids": r.output_ids, "routed_experts": r.generated.tolist(),
                         "finish_reason": "length"}]}


def write_vllm_jsonl(path: Path, reqs: list[VReq], encoding: str = "b64") -> Path:
    path.write_text("".join(json.dumps(vllm_completion(r, i, encoding=encoding)) + "\n" for i, r in enumerate(reqs)))
    return path


def random_vreqs(rng: np.random.Generator, n: int, L: int, k: int, E: int, *, hot: int | None = None,
                 prompt: int = 6, gen: int = 5, cached_prompt: int = 0) -> list[VReq]:
    """Requests whose tokens route among ``hot`` experts of their own (None: all experts), int16 as vLLM returns."""
    out = []
    for i in range(n):
        pool = rng.choice(E, size=hot, replace=False) if hot else np.arange(E)

        def rows(m: int, pool: np.ndarray = pool) -> np.ndarray:
            if m == 0:
                return np.zeros((0, L, k), np.int16)
            return np.stack([np.stack([rng.choice(pool, k, replace=False) for _ in range(L)]) for _ in range(m)]
                            ).astype(np.int16).reshape(m, L, k)

        p = rows(prompt)
        p[:cached_prompt] = -1
        out.append(VReq(list(range(1000 + i, 1000 + i + prompt)), p, list(range(5000 + i, 5000 + i + gen)), rows(gen - 1)))
    return out


# -- SGLang --------------------------------------------------------------------------------------

EXTEND, DECODE, MIXED, IDLE = 1, 2, 3, 4
TOP_K_NUM = 8  # _DetailSinglePassGatherer._TOP_K_NUM: the buffer's slot count, padded with -1


def sglang_record(fid: int, mode: int, input_ids: list[int], positions: list[int], extend_seq_lens: list[int] | None,
                  topk_phys: np.ndarray, n_physical: int) -> dict:
    """One ``_DetailAccumulator`` record: ``topk_phys`` [layers, tokens, k] physical ids (-1 = not routed)."""
    import torch

    L, T, k = topk_phys.shape
    buf = np.full((L, T, TOP_K_NUM), -1, np.int32)
    buf[:, :, :k] = topk_phys
    t = torch.from_numpy(buf)
    ids = t.reshape(L, -1)
    mask = ids != -1
    count = torch.zeros((L, n_physical), dtype=torch.int32)
    count.scatter_add_(1, ids.masked_fill(~mask, 0).long(), mask.int())
    return dict(forward_pass_id=fid, rank=0, gatherer_key="primary", input_ids=list(input_ids), positions=list(positions),
                extend_seq_lens=extend_seq_lens, forward_mode=mode, topk_ids_of_layer=t, misc_objects=[],
                global_physical_count=count)


def write_sglang_dump(folder: Path, records: list[dict], p2l: np.ndarray, stamp: float = 1780000000.5, rank: int = 0) -> Path:
    import torch

    path = folder / f"expert_distribution_recorder_{stamp}_{rank}.pt"
    torch.save(dict(records=records, last_physical_to_logical_map=torch.from_numpy(p2l.astype(np.int64))), str(path))
    return path


def sglang_response(prompt_len: int, output_ids: list[int], rows: np.ndarray, cached: int = 0) -> dict:
    """A ``/generate`` response with ``return_routed_experts``: base64 little-endian int32, C order."""
    return {"text": "...", "output_ids": output_ids,
            "meta_info": {"id": "abc", "finish_reason": {"type": "length", "length": len(output_ids)},
                          "prompt_tokens": prompt_len, "completion_tokens": len(output_ids), "cached_tokens": cached,
                          "e2e_latency": 0.1,
                          "routed_experts": base64.b64encode(rows.astype("<i4").tobytes()).decode("utf-8")}}


# -- Megatron-LM ---------------------------------------------------------------------------------


def bf16_bytes(x: np.ndarray) -> bytes:
    """bfloat16 bytes of float32 values that are exactly bfloat16 (the top half of each float32)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    assert ((u & 0xFFFF) == 0).all(), "values must be exact bfloat16"
    return (u >> 16).astype("<u2").tobytes()


def bf16_values(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    x = rng.standard_normal(shape).astype(np.float32)
    return (x.view(np.uint32) & 0xFFFF0000).view(np.float32)


def write_megatron(folder: Path, steps: list[dict[int, np.ndarray]], *, rank: int = 0, hidden: dict | None = None,
                   logits: dict | None = None, mtp: dict[int, np.ndarray] | None = None) -> Path:
    """``steps[s][layer]`` = top_indices [num_tokens, topk]; ``hidden``/``logits`` map (s, layer) to float32
    arrays written to the bf16 sidecars; ``mtp[s]`` adds an MTP-head record (mtp_idx 0) after step s's layers."""
    folder.mkdir(parents=True, exist_ok=True)
    jl = folder / f"router_trace_rank{rank}.jsonl"
    hs_off = lg_off = 0
    hs = open(folder / f"hidden_states_rank{rank}.bin", "wb") if hidden is not None else None
    lg = open(folder / f"logits_rank{rank}.bin", "wb") if logits is not None else None
    lines = []
    for s, layers in enumerate(steps):
        items = [(layer, idx, None) for layer, idx in layers.items()]
        if mtp and s in mtp:
            items.append((0, mtp[s], 0))
        for layer, idx, mtp_idx in items:
            rec: dict = {"step": s, "stage": "pre_dispatch", "block": "decoder" if mtp_idx is None else "mtp",
                         "layer": int(layer), "rank": rank, "num_tokens": int(idx.shape[0]), "topk": int(idx.shape[1])}
            if mtp_idx is not None:
                rec["mtp_idx"] = mtp_idx
            if hs is not None and mtp_idx is None:
                b = bf16_bytes(hidden[(s, layer)])
                hs.write(b)
                rec.update(hs_offset=hs_off, hs_bytes=len(b), hs_shape=list(hidden[(s, layer)].shape))
                hs_off += len(b)
            if lg is not None and mtp_idx is None:
                b = bf16_bytes(logits[(s, layer)])
                lg.write(b)
                rec.update(logit_offset=lg_off, logit_bytes=len(b), logit_shape=list(logits[(s, layer)].shape))
                lg_off += len(b)
            rec["top_indices"] = idx.astype(np.int32).tolist()
            lines.append(json.dumps(rec) + "\n")
    for fh in (hs, lg):
        if fh is not None:
            fh.close()
    jl.write_text("".join(lines))
    return jl
