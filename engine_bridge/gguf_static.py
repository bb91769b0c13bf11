"""What a GGUF file says about its MoE layers, read with gguf-py (no engine needed).

Router matrices (dequantized to float32), the per-expert selection bias where the architecture
has one, the bytes one expert of each layer costs to read *as stored* (gate + up + down, or the
fused gate_up, divided by the expert count), the bytes of each layer's other tensors, and the
gating keys. A file that is not a GGUF, or a dense model, is refused with one sentence.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from traces.format.errors import UserError

GGUF_MAGIC = b"GGUF"
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
# Stacked expert tensors: one slice per expert. Shared experts (``_shexp``) are dense: every
# token reads them, so they count in dense_bytes, not in expert_bytes.
EXPERT_TENSORS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_gate_up_exps.weight",
                  "ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias", "ffn_gate_up_exps.bias",
                  "ffn_gate_exps.scale", "ffn_up_exps.scale", "ffn_down_exps.scale")
ROUTER_TENSOR = "ffn_gate_inp.weight"
ROUTER_BIAS_TENSOR = "ffn_gate_inp.bias"  # added to the logits (gpt-oss); not a selection bias
SELECTION_BIAS_TENSORS = ("exp_probs_b.bias", "exp_probs_b")


@dataclass
class GgufStatic:
    path: Path
    arch: str
    name: str
    n_layer: int
    n_embd: int
    n_expert: int
    top_k_native: int
    moe_layers: list[int]
    router: dict[int, np.ndarray]  # layer -> W [n_expert, n_embd] float32
    router_type: dict[int, str]  # layer -> ggml type name as stored (F32, F16, BF16, Q8_0, ...)
    selection_bias: dict[int, np.ndarray]  # layer -> [n_expert] float32 (absent: no bias)
    logit_bias: dict[int, np.ndarray]  # layer -> [n_expert] float32 added to the router logits
    expert_bytes: list[int | None]  # per layer; None for dense layers
    dense_bytes: list[int]  # per layer: every tensor of blk.N that is not a routed expert
    nonlayer_bytes: int  # embeddings, output head, final norm
    keys: dict[str, Any] = field(default_factory=dict)  # gating-related GGUF keys, as found
    file_bytes: int = 0
    n_ctx_train: int = 0  # <arch>.context_length (0: absent); llama.cpp reports it only once weights load


def check_gguf_file(path: str | os.PathLike[str]) -> Path:
    """Refuse a missing file, a directory or a file without the GGUF magic, in one sentence."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p}: no such file.")
    if not p.is_file():
        raise UserError(f"{p}: is not a file (expected a .gguf model file).")
    try:
        with open(p, "rb") as fh:
            magic = fh.read(4)
    except OSError as e:
        raise UserError(f"{p}: cannot be read ({e.strerror}).") from None
    if magic != GGUF_MAGIC:
        raise UserError(f"{p}: is not a GGUF file (it does not start with the GGUF magic bytes).")
    return p


def _key(reader: Any, name: str) -> Any:
    f = reader.fields.get(name)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:  # noqa: BLE001 - a key gguf-py cannot decode is treated as absent
        return None


def read_static(path: str | os.PathLike[str], with_router: bool = True) -> GgufStatic:
    """Parse ``path`` (already known to start with the GGUF magic) and describe its MoE layers."""
    from engine_bridge.engine import import_gguf

    gguf = import_gguf()
    from gguf.quants import dequantize

    p = check_gguf_file(path)
    try:
        reader = gguf.GGUFReader(str(p), "r")
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt file
        raise UserError(f"{p}: is not a readable GGUF file ({e.__class__.__name__}: {str(e)[:120]}).") from None
    arch = _key(reader, "general.architecture")
    if not isinstance(arch, str):
        raise UserError(f"{p}: the GGUF has no general.architecture key.")
    name = _key(reader, "general.name") or p.stem
    n_layer = _key(reader, f"{arch}.block_count")
    n_embd = _key(reader, f"{arch}.embedding_length")
    if not isinstance(n_layer, int) or not isinstance(n_embd, int):
        raise UserError(f"{p}: the GGUF lacks {arch}.block_count or {arch}.embedding_length.")
    n_expert = _key(reader, f"{arch}.expert_count") or 0
    n_ctx_train = _key(reader, f"{arch}.context_length")
    top_k = _key(reader, f"{arch}.expert_used_count") or 0

    per_layer: dict[int, dict[str, Any]] = {}
    nonlayer = 0
    for t in reader.tensors:
        m = _BLK.match(t.name)
        if m is None:
            nonlayer += int(t.n_bytes)
            continue
        per_layer.setdefault(int(m.group(1)), {})[m.group(2)] = t
    moe_layers = sorted(il for il, ts in per_layer.items() if ROUTER_TENSOR in ts and il < n_layer)
    if not moe_layers or n_expert <= 1 or top_k <= 0:
        raise UserError(f"{p}: is a dense model (no MoE layers: no blk.N.{ROUTER_TENSOR} router tensors"
                        f" or no {arch}.expert_count); capture needs a Mixture-of-Experts model.")

    router: dict[int, np.ndarray] = {}
    router_type: dict[int, str] = {}
    sel_bias: dict[int, np.ndarray] = {}
    logit_bias: dict[int, np.ndarray] = {}
    expert_bytes: list[int | None] = [None] * n_layer
    dense_bytes = [0] * n_layer
    for il, ts in per_layer.items():
        if il >= n_layer:
            continue
        eb = 0
        for tname, t in ts.items():
            if tname in EXPERT_TENSORS:
                eb += int(t.n_bytes)
            else:
                dense_bytes[il] += int(t.n_bytes)
        if il in moe_layers:
            if eb % n_expert:
                raise UserError(f"{p}: layer {il}'s expert tensors ({eb} bytes) do not split evenly into {n_expert} experts.")
            # Never default a missing size to 0: a free expert is admitted and never evicted,
            # and replay would report ~100% hit for the layer.
            if eb == 0:
                raise UserError(f"{p}: MoE layer {il} has a router but no stacked expert tensors (ffn_*_exps).")
            expert_bytes[il] = eb // n_expert
            r = ts[ROUTER_TENSOR]
            router_type[il] = r.tensor_type.name
            if with_router:
                w = dequantize(r.data, r.tensor_type).astype(np.float32, copy=False).reshape(n_expert, n_embd)
                router[il] = np.ascontiguousarray(w)
            for bname in SELECTION_BIAS_TENSORS:
                if bname in ts:
                    b = ts[bname]
                    sel_bias[il] = dequantize(b.data, b.tensor_type).astype(np.float32).reshape(n_expert)
            if ROUTER_BIAS_TENSOR in ts:
                b = ts[ROUTER_BIAS_TENSOR]
                logit_bias[il] = dequantize(b.data, b.tensor_type).astype(np.float32).reshape(n_expert)

    keys = {}
    for k in ("expert_gating_func", "expert_weights_norm", "expert_weights_scale", "expert_group_count",
              "expert_group_used_count", "expert_shared_count", "leading_dense_block_count"):
        v = _key(reader, f"{arch}.{k}")
        if v is not None:
            keys[k] = v.item() if hasattr(v, "item") else v
    return GgufStatic(
        path=p, arch=arch, name=str(name), n_layer=n_layer, n_embd=n_embd, n_expert=int(n_expert),
        top_k_native=int(top_k), moe_layers=moe_layers, router=router, router_type=router_type,
        selection_bias=sel_bias, logit_bias=logit_bias, expert_bytes=expert_bytes, dense_bytes=dense_bytes,
        nonlayer_bytes=nonlayer, keys=keys, file_bytes=p.stat().st_size,
        n_ctx_train=int(n_ctx_train) if isinstance(n_ctx_train, int) and n_ctx_train > 0 else 0,
    )
