"""Expert sizes for imported logs: what one expert of each layer costs to read, from the model, never guessed.

Engines' routing logs carry expert ids, not bytes, and a replay without the true size of an expert
answers a different question (a cache budget in MiB holds a number of experts only through their
size). Three sources, one :class:`ExpertSizes`:

- ``--expert-bytes N``: every routed layer's expert costs N bytes (dense bytes unknown: null).
- ``--sizes-from MODEL.gguf``: each layer's stacked expert tensors (``ffn_{gate,up,down}_exps``,
  the fused ``ffn_gate_up_exps``, and their biases and scales) as stored -- quantisation
  included -- divided by the expert count; the layer's other tensors (attention, norms, router,
  shared experts ``_shexp``) are its dense bytes.
- ``--sizes-from config.json --dtype D``: the Hugging Face config's expert shapes (hidden_size,
  moe_intermediate_size or intermediate_size, the expert count) at the storage type D; which layers
  are MoE follows the config (first_k_dense_replace, moe_layer_freq, decoder_sparse_step,
  mlp_only_layers, interleave_moe_layer_step, ...). Shared experts count as dense bytes.

Sizes are bytes (not MiB). A layer the log routes but the source gives no expert size is refused:
a layer that costs nothing is admitted free and never evicted, and replay would report ~100% hit
for it -- a wrong answer wearing the costume of a good one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from traces.format.errors import UserError
from traces.format.schema import MAX_BYTES, MAX_INT32, MAX_LAYERS
from traces.util.bounded_json import BoundsError, parse_bounded

#: Storage types for ``--dtype``: (elements per block, bytes per block). GGUF block types as
#: ggml stores them (a row must be a whole number of blocks); fp8/int8 count one byte per weight
#: and leave out their per-block scale tensors (under 1% of the bytes; said in provenance).
DTYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "bf16": (1, 2), "f16": (1, 2), "fp8": (1, 1), "int8": (1, 1),
    "q8_0": (32, 34), "q6_k": (256, 210), "q5_k": (256, 176), "q5_0": (32, 22), "q5_1": (32, 24),
    "q4_k": (256, 144), "q4_0": (32, 18), "q4_1": (32, 20), "q3_k": (256, 110), "q2_k": (256, 84),
    "iq4_xs": (256, 136), "iq4_nl": (32, 18), "mxfp4": (32, 17),
}
_GGUF_BLOCK_TYPES = {k for k, (blk, _) in DTYPES.items() if blk > 1}

_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
# Stacked per-expert tensors of a GGUF layer: weights, biases, scales of gate/up/down (or fused gate_up).
_EXPERT_TENSOR = re.compile(r"^ffn_(gate|up|down|gate_up)_exps\.(weight|bias|scale)$")

SIZE_OPTIONS_HINT = "--expert-bytes N, --sizes-from MODEL.gguf, or --sizes-from config.json --dtype D"


@dataclass(frozen=True)
class ExpertSizes:
    """Expert (and dense) bytes per layer and what the model says about its shape.

    ``expert_bytes``/``dense_bytes``: per layer of the model (None where the layer has no experts
    or the source does not say); with ``uniform`` set (``--expert-bytes``), every layer the log
    routes costs ``uniform`` bytes and the model's shape is unknown (None)."""

    source: dict[str, Any]  # provenance: kind, file, sha256, dtype
    uniform: int | None = None
    expert_bytes: list[int | None] | None = None
    dense_bytes: list[int | None] | None = None
    n_layer: int | None = None
    n_expert: int | None = None
    top_k: int | None = None
    n_embd: int | None = None
    arch: str | None = None
    name: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def model_moe_layers(self) -> list[int] | None:
        """The model's MoE layers (None when the source does not know the model)."""
        if self.expert_bytes is None:
            return None
        return [i for i, b in enumerate(self.expert_bytes) if b]

    def for_layers(self, n_layer: int, layers: list[int], what: str | Path) -> tuple[list[int | None], list[int | None]]:
        """(expert_bytes, dense_bytes) lists of ``n_layer`` entries for a log that routes ``layers``;
        refuses a routed layer the source gives no expert size."""
        if self.uniform is not None:
            eb: list[int | None] = [None] * n_layer
            for l in layers:
                eb[l] = self.uniform
            return eb, [None] * n_layer
        assert self.expert_bytes is not None and self.dense_bytes is not None
        if n_layer != len(self.expert_bytes):
            raise UserError(f"{what}: the log has {n_layer} layers but {self.source.get('file')} describes "
                            f"{len(self.expert_bytes)}; not the model of this log.")
        for l in layers:
            if not self.expert_bytes[l]:
                raise UserError(f"{what}: routes layer {l}, which {self.source.get('file')} says has no experts; "
                                "not the model of this log.")
        return list(self.expert_bytes), list(self.dense_bytes)


def load_sizes(expert_bytes: int | None = None, sizes_from: str | Path | None = None,
               dtype: str | None = None) -> ExpertSizes | None:
    """The sizes the options name (None when none is given). One source at a time."""
    if expert_bytes is not None and sizes_from is not None:
        raise UserError("--expert-bytes and --sizes-from both give expert sizes; pass one.")
    if expert_bytes is not None:
        if dtype is not None:
            raise UserError("--dtype applies to --sizes-from config.json, not to --expert-bytes.")
        if not 0 < expert_bytes <= MAX_BYTES:
            raise UserError(f"--expert-bytes {expert_bytes} is not a byte count in 1..2^40.")
        return ExpertSizes(source={"kind": "expert-bytes", "expert_bytes": int(expert_bytes)}, uniform=int(expert_bytes))
    if sizes_from is None:
        if dtype is not None:
            raise UserError("--dtype needs --sizes-from config.json (the dtype the config's weights are stored in).")
        return None
    from traces.io.atomic import note_input

    p = Path(sizes_from)
    note_input(p)  # an input of the import: OUT may not replace or hold it
    if not p.exists():
        raise UserError(f"--sizes-from {p}: no such file.")
    if p.is_dir():
        if (p / "config.json").is_file():
            p = p / "config.json"
        else:
            raise UserError(f"--sizes-from {p}: is a directory without a config.json.")
    with open(p, "rb") as fh:
        magic = fh.read(4)
    if magic == b"GGUF":
        if dtype is not None:
            raise UserError(f"--dtype {dtype}: a GGUF states the storage type of every tensor; drop --dtype.")
        return sizes_from_gguf(p)
    return sizes_from_config(p, dtype)


def require_sizes(sizes: ExpertSizes | None, what: str | Path, fmt: str) -> ExpertSizes:
    """Refuse to import without expert sizes, naming the options that give them."""
    if sizes is None:
        raise UserError(f"{what}: a {fmt} log carries no expert sizes and a replay without them answers a "
                        f"different question; add {SIZE_OPTIONS_HINT}.")
    return sizes


def _sha256(path: Path) -> str:
    from traces.io.digest import sha256_file

    return sha256_file(path)


# -- GGUF -----------------------------------------------------------------------------------------

def sizes_from_gguf(path: Path) -> ExpertSizes:
    """Bytes per expert per layer as stored in the GGUF (quantisation included)."""
    try:
        import gguf  # lazy: only this option needs gguf-py
    except ImportError:
        raise UserError(f"--sizes-from {path}: reading a GGUF needs the 'gguf' package (pip install gguf).") from None
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt file
        raise UserError(f"--sizes-from {path}: is not a readable GGUF file ({e.__class__.__name__}: {str(e)[:120]}).") from None

    def key(name: str) -> Any:
        f = reader.fields.get(name)
        if f is None:
            return None
        try:
            v = f.contents()
        except Exception:  # noqa: BLE001 - a key gguf-py cannot decode is treated as absent
            return None
        return v.item() if hasattr(v, "item") else v

    arch = key("general.architecture")
    if not isinstance(arch, str):
        raise UserError(f"--sizes-from {path}: the GGUF has no general.architecture key.")
    n_layer = key(f"{arch}.block_count")
    n_expert = key(f"{arch}.expert_count")
    if not isinstance(n_layer, int) or n_layer <= 0:
        raise UserError(f"--sizes-from {path}: the GGUF lacks {arch}.block_count.")
    if not isinstance(n_expert, int) or n_expert <= 1:
        raise UserError(f"--sizes-from {path}: the GGUF has no {arch}.expert_count > 1; not a Mixture-of-Experts model.")
    eb = [0] * n_layer
    db = [0] * n_layer
    for t in reader.tensors:
        m = _BLK.match(t.name)
        if m is None or int(m.group(1)) >= n_layer:
            continue
        il = int(m.group(1))
        if _EXPERT_TENSOR.match(m.group(2)):
            eb[il] += int(t.n_bytes)
        else:
            db[il] += int(t.n_bytes)
    if not any(eb):
        raise UserError(f"--sizes-from {path}: the GGUF has no stacked expert tensors (blk.N.ffn_*_exps).")
    per: list[int | None] = []
    for il, b in enumerate(eb):
        if b % n_expert:
            raise UserError(f"--sizes-from {path}: layer {il}'s expert tensors ({b} bytes) do not split evenly "
                            f"into {n_expert} experts.")
        per.append(b // n_expert if b else None)
    top_k = key(f"{arch}.expert_used_count")
    n_embd = key(f"{arch}.embedding_length")
    name = key("general.name")
    return ExpertSizes(
        source={"kind": "gguf", "file": path.name, "sha256": _sha256(path)},
        expert_bytes=per, dense_bytes=list(db), n_layer=n_layer, n_expert=n_expert,
        top_k=top_k if isinstance(top_k, int) else None, n_embd=n_embd if isinstance(n_embd, int) else None,
        arch=arch, name=name if isinstance(name, str) else path.stem,
    )


# -- Hugging Face config.json -----------------------------------------------------------------------

def _first(cfg: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            return v
    return None


def matrix_bytes(rows: int, cols: int, dtype: str, what: str) -> int:
    """Bytes of a [rows, cols] weight matrix stored as ``dtype`` (``cols``: the row length ggml
    quantises in blocks)."""
    blk, size = DTYPES[dtype]
    if cols % blk:
        raise UserError(f"--dtype {dtype} stores rows in blocks of {blk} weights, but {what} rows hold {cols}; "
                        "give the type the model is actually stored in.")
    return rows * (cols // blk) * size


def vector_bytes(n: int, dtype: str) -> int:
    """Bytes of a bias or norm vector: GGUF keeps them float32 next to block-quantised weights."""
    return n * (4 if dtype in _GGUF_BLOCK_TYPES else DTYPES[dtype][1])


def moe_layer_flags(cfg: dict[str, Any], n_layer: int) -> list[bool]:
    """Which layers of a Hugging Face config are MoE layers."""
    flags = [True] * n_layer
    k_dense = cfg.get("first_k_dense_replace")
    if isinstance(k_dense, int):
        flags = [i >= k_dense for i in range(n_layer)]
    freq = cfg.get("moe_layer_freq")
    if isinstance(freq, int) and freq > 1:
        flags = [f and i % freq == 0 for i, f in enumerate(flags)]
    step = cfg.get("decoder_sparse_step")
    if isinstance(step, int) and step > 0:
        flags = [f and (i + 1) % step == 0 for i, f in enumerate(flags)]
    only = cfg.get("mlp_only_layers")
    if isinstance(only, list):
        flags = [f and i not in only for i, f in enumerate(flags)]
    inter = cfg.get("interleave_moe_layer_step")
    if isinstance(inter, int) and inter > 1:
        flags = [f and (i + 1) % inter == 0 for i, f in enumerate(flags)]
    period, offset = cfg.get("expert_layer_period"), cfg.get("expert_layer_offset")
    if isinstance(period, int) and period > 0:
        flags = [f and i % period == (offset or 0) for i, f in enumerate(flags)]
    listed = cfg.get("moe_layers")
    if isinstance(listed, list) and all(isinstance(x, int) for x in listed):
        flags = [i in listed for i in range(n_layer)]
    return flags


def _attention_params(cfg: dict[str, Any], h: int, dtype: str) -> int | None:
    """Bytes of one layer's attention projections (GQA, or DeepSeek's MLA), None when the config is unclear."""
    nh = cfg.get("num_attention_heads")
    if not isinstance(nh, int):
        return None
    if isinstance(cfg.get("kv_lora_rank"), int):  # multi-head latent attention (DeepSeek V2/V3, Kimi)
        kvr, rope = cfg["kv_lora_rank"], cfg.get("qk_rope_head_dim") or 0
        nope, vdim, qr = cfg.get("qk_nope_head_dim") or 0, cfg.get("v_head_dim") or 0, cfg.get("q_lora_rank")
        qk = nope + rope
        q = (matrix_bytes(qr, h, dtype, "q_a") + matrix_bytes(nh * qk, qr, dtype, "q_b")) if isinstance(qr, int) \
            else matrix_bytes(nh * qk, h, dtype, "q_proj")
        return (q + matrix_bytes(kvr + rope, h, dtype, "kv_a") + matrix_bytes(nh * (nope + vdim), kvr, dtype, "kv_b")
                + matrix_bytes(h, nh * vdim, dtype, "o_proj"))
    hd = cfg.get("head_dim") or h // nh
    nkv = cfg.get("num_key_value_heads") or nh
    return (matrix_bytes(nh * hd, h, dtype, "q_proj") + 2 * matrix_bytes(nkv * hd, h, dtype, "k/v_proj")
            + matrix_bytes(h, nh * hd, dtype, "o_proj"))


def sizes_from_config(path: Path, dtype: str | None) -> ExpertSizes:
    """Bytes per expert per layer from a Hugging Face config.json at storage type ``dtype``."""
    if dtype is None:
        raise UserError(f"--sizes-from {path}: a config.json gives shapes, not bytes; add --dtype "
                        f"({', '.join(DTYPES)}), the type the experts are stored in.")
    dt = dtype.lower()
    if dt not in DTYPES:
        raise UserError(f"--dtype {dtype}: unknown storage type; known: {', '.join(DTYPES)}.")
    try:
        cfg = parse_bounded(path.read_text(encoding="utf-8-sig"), "config.json")
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"--sizes-from {path}: is neither a GGUF nor a JSON config.json.") from None
    except BoundsError as e:
        raise UserError(f"--sizes-from {path}: {e}.") from None
    if not isinstance(cfg, dict):
        raise UserError(f"--sizes-from {path}: is not a JSON object (a Hugging Face config.json).")
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers keep the language model here
        cfg = {**cfg, **cfg["text_config"]}
    h = cfg.get("hidden_size")
    n_layer = cfg.get("num_hidden_layers")
    n_expert = _first(cfg, "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    inter = _first(cfg, "moe_intermediate_size", "expert_intermediate_size", "intermediate_size")
    for name, v in (("hidden_size", h), ("num_hidden_layers", n_layer),
                    ("num_experts / num_local_experts / n_routed_experts", n_expert),
                    ("moe_intermediate_size / intermediate_size", inter)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise UserError(f"--sizes-from {path}: the config has no positive integer {name}; "
                            "not a Mixture-of-Experts config this tool can size.")
    # The trace's own limits (docs/design.md, "Trace format"), checked here where the file is read
    # and the field can be named, not later by the trace writer as an internal error.
    for name, v, top in (("hidden_size", h, MAX_INT32), ("num_hidden_layers", n_layer, MAX_LAYERS),
                         ("the expert count", n_expert, MAX_INT32), ("the expert intermediate size", inter, MAX_INT32)):
        if v > top:
            raise UserError(f"--sizes-from {path}: {name} {v} is beyond any model this tool can replay (at most {top}).")
    if n_expert <= 1:
        raise UserError(f"--sizes-from {path}: the config has {n_expert} expert(s); not a Mixture-of-Experts model.")
    flags = moe_layer_flags(cfg, n_layer)
    gpt_oss = cfg.get("model_type") == "gpt_oss"
    # gate + up [inter, hidden] and down [hidden, inter] per expert; gpt-oss adds their biases.
    one = matrix_bytes(2 * inter, h, dt, "gate/up") + matrix_bytes(h, inter, dt, "down")
    if gpt_oss:
        one += vector_bytes(2 * inter + h, dt)
    shared = 0
    n_shared = _first(cfg, "n_shared_experts", "num_shared_experts")
    if isinstance(n_shared, int) and n_shared > 0:
        shared = n_shared * (matrix_bytes(2 * inter, h, dt, "shared gate/up") + matrix_bytes(h, inter, dt, "shared down"))
    sh_inter = cfg.get("shared_expert_intermediate_size")
    if isinstance(sh_inter, int) and sh_inter > 0:  # Qwen2-MoE: one wide shared expert and its sigmoid gate
        shared = (matrix_bytes(2 * sh_inter, h, dt, "shared gate/up") + matrix_bytes(h, sh_inter, dt, "shared down")
                  + vector_bytes(h, dt))
    attn = _attention_params(cfg, h, dt)
    dense_inter = cfg.get("intermediate_size")
    dense_mlp = (matrix_bytes(2 * dense_inter, h, dt, "dense gate/up") + matrix_bytes(h, dense_inter, dt, "dense down")
                 if isinstance(dense_inter, int) and dense_inter > 0 else None)
    norms = vector_bytes(2 * h, dt)
    expert_bytes: list[int | None] = []
    dense_bytes: list[int | None] = []
    for moe in flags:
        if moe:
            expert_bytes.append(one)
            dense_bytes.append(None if attn is None else attn + norms + shared + matrix_bytes(n_expert, h, dt, "router"))
        else:
            expert_bytes.append(None)
            dense_bytes.append(None if attn is None or dense_mlp is None else attn + norms + dense_mlp)
    if not any(flags):
        raise UserError(f"--sizes-from {path}: the config's layer pattern leaves no MoE layer.")
    for what, sizes in (("one expert", expert_bytes), ("a layer's dense weights", dense_bytes)):
        big = max((b for b in sizes if b is not None), default=0)
        if big > MAX_BYTES:
            raise UserError(f"--sizes-from {path}: its shapes give {what} {big:,} bytes at --dtype {dt}, beyond the "
                            f"{MAX_BYTES >> 40} TiB a trace allows; check hidden_size and the intermediate sizes.")
    notes = []
    if dt in ("fp8", "int8"):
        notes.append(f"--dtype {dt}: one byte per weight; per-block scale tensors are not counted")
    top_k = _first(cfg, "num_experts_per_tok", "num_experts_per_token", "experts_per_token", "moe_topk")
    arch = cfg.get("model_type")
    return ExpertSizes(
        source={"kind": "hf-config", "file": path.name, "sha256": _sha256(path), "dtype": dt},
        expert_bytes=expert_bytes, dense_bytes=dense_bytes, n_layer=n_layer, n_expert=n_expert,
        top_k=top_k if isinstance(top_k, int) else None, n_embd=h, arch=arch if isinstance(arch, str) else None,
        name=cfg.get("_name_or_path") if isinstance(cfg.get("_name_or_path"), str) else None, notes=notes,
    )


def describe(sizes: ExpertSizes) -> dict[str, Any]:
    """The sizes' origin for provenance (with the notes about what was not counted)."""
    out = dict(sizes.source)
    if sizes.notes:
        out["notes"] = list(sizes.notes)
    return out

