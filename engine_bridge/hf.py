"""Capture from Hugging Face transformers: greedy generation with the KV cache, every MoE layer's
router input, raw router logits, selected experts and applied weights recorded as a v1 trace.

How the routing is observed (transformers 5.x; every family below shares this block shape)::

    block.forward(h):  logits, weights, ids = block.<router>(h)     # router module, F.linear inside
                       out = block.experts(h, ids, weights)          # what the model applies

- a forward hook on the router module records its input (the router input, ``gate_input``) and
  output 0, the raw linear output (the logits before any activation; with gpt-oss's bias). This is
  not what ``output_router_logits`` returns under that name (softmax probabilities for some
  classes); the fresh-gate self-check proves the column is ``router.parquet`` x ``gate_input``.
- a forward pre-hook on ``block.experts`` records the ids and weights exactly as the experts
  receive them (the routing the model applied), and is where an intervention (a routing override)
  changes the weights, inside the forward pass.

The selection rule (trace.json's gating) is read from the router module's own attributes (top_k,
norm_topk_prob, routed_scaling_factor, groups, e_score_correction_bias) per family; every capture
then checks that the rule applied to the captured logits picks exactly the captured ids with the
captured weights, so a family whose forward changed upstream fails loudly instead of writing a
wrong trace. Ids are written in rank order (descending selection score, ties to the lower id):
DeepSeek-V3 / GLM-4.5 select with ``topk(sorted=False)``.

Python entry point: :func:`capture_hf`. CLI: ``moe-replay capture-hf`` (engine_bridge.cli).
"""

from __future__ import annotations

import inspect
import math
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine_bridge.capture import TokenRates, _Stop
from engine_bridge.checks import checks_passed, run_checks
from traces.format.errors import UserError
from traces.format.gating import selection_scores
from traces.io.atomic import check_output_dir
from traces.io.writer import TraceWriter
from traces.util.signals import on_signals

_EXTRA = "pip install 'moe-replay[hf]'"


def require_hf_extra(command: str = "capture-hf") -> None:
    """Refuse at once, naming the extra, when torch or transformers is missing."""
    for module in ("torch", "transformers"):
        try:
            __import__(module)
        except ImportError:
            raise UserError(f"{command} needs the hf extra, which is not installed (no module {module!r}): run {_EXTRA}.") from None


# -- families -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    """How one transformers MoE family routes: the block's router child, the router class the rule
    was read from, the rule's kind, and where its tensors live (dotted paths; ``block.`` = on the MoE
    block instead of the router)."""

    router_attr: str  # the block's child that routes ("gate" | "router")
    router_class: str  # the class whose forward the rule below describes
    activation: str  # softmax | sigmoid | softmax_weight (traces.format.gating vocabulary)
    always_norm: bool = False  # the router normalises the top-k whatever the config says
    weight: str = "weight"  # the router matrix [n_expert, hidden]
    selection_bias: str | None = None  # added to the scores for selection only (not to the weights)
    logit_bias: str | None = None  # added to the logits by the router's linear (gpt-oss)


FAMILIES: dict[str, Family] = {
    "mixtral": Family("gate", "MixtralTopKRouter", "softmax", always_norm=True),
    "minimax": Family("gate", "MiniMaxTopKRouter", "softmax", always_norm=True),
    "qwen2_moe": Family("gate", "Qwen2MoeTopKRouter", "softmax"),
    "qwen3_moe": Family("gate", "Qwen3MoeTopKRouter", "softmax"),
    "olmoe": Family("gate", "OlmoeTopKRouter", "softmax"),
    "flex_olmo": Family("gate", "FlexOlmoTopKRouter", "softmax"),
    "hunyuan_v1_moe": Family("gate", "HunYuanMoEV1Gate", "softmax", always_norm=True, weight="wg.weight"),
    "ernie4_5_moe": Family("gate", "Ernie4_5_MoeTopKRouter", "softmax", always_norm=True,
                           selection_bias="moe_statics.e_score_correction_bias"),
    "deepseek_v2": Family("gate", "DeepseekV2TopkRouter", "softmax"),  # topk_method greedy only (gating_of)
    "deepseek_v3": Family("gate", "DeepseekV3TopkRouter", "sigmoid", selection_bias="e_score_correction_bias"),
    "glm4_moe": Family("gate", "Glm4MoeTopkRouter", "sigmoid", selection_bias="e_score_correction_bias"),
    "glm4_moe_lite": Family("gate", "Glm4MoeLiteTopkRouter", "sigmoid", selection_bias="e_score_correction_bias"),
    "dots1": Family("gate", "Dots1TopkRouter", "sigmoid", selection_bias="e_score_correction_bias"),
    "minimax_m2": Family("gate", "MiniMaxM2TopKRouter", "sigmoid", always_norm=True,
                         selection_bias="block.e_score_correction_bias"),
    "lfm2_moe": Family("gate", "Lfm2MoeTopKRouter", "sigmoid", selection_bias="block.expert_bias"),
    "gpt_oss": Family("router", "GptOssTopKRouter", "softmax_weight", logit_bias="bias"),
}


def _tensor_at(block: Any, router: Any, path: str | None) -> Any:
    """The tensor at ``path`` (on the router, or on the block with a ``block.`` prefix), or None."""
    if path is None:
        return None
    obj = block if path.startswith("block.") else router
    for part in path.removeprefix("block.").split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


# Routers that cast their input and matrix to float32 before the linear.
_FLOAT32_ROUTERS = {"DeepseekV2TopkRouter", "DeepseekV3TopkRouter", "Glm4MoeTopkRouter", "Glm4MoeLiteTopkRouter", "Dots1TopkRouter",
                    "Ernie4_5_MoeTopKRouter"}


def layers_of(blocks: list[Any]) -> list[int]:
    return [b.layer for b in blocks]


# Config keys that say a model has routed experts (to tell "not MoE" from "MoE we do not know").
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok")

# What an offloading engine would store one expert matrix as: (values per block, bytes per block).
EXPERT_DTYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "fp8": (1, 1), "q8_0": (32, 34), "q6_k": (256, 210),
    "q5_k": (256, 176), "q5_0": (32, 22), "q4_k": (256, 144), "q4_0": (32, 18), "iq4_xs": (256, 136),
    "q3_k": (256, 110), "q2_k": (256, 84), "mxfp4": (32, 17),
}
_DTYPES = {"float32": "float32", "f32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
           "f16": "float16", "auto": "auto"}
# Relative logit tolerance of the fresh-gate check by the router's compute dtype: float32 logits
# recomputed in float64 agree to ~1e-6; bf16 / f16 outputs are rounded to 8 / 11 mantissa bits.
_REL_TOL = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 2e-3}
# Absolute tolerance of the applied weights against the rule's (float64) by the dtype the router
# returns them in: float32 ~1e-7; bf16 rounds a weight <= 1 by up to 2^-9.
_WEIGHTS_TOL = {"float32": 1e-5, "bfloat16": 4e-3, "float16": 1e-3}
_OUTPUT_ROUNDING = {"bfloat16": "bf16", "float16": "f16"}
_INPUT_ROUNDING = {"float32": "none", "bfloat16": "bf16", "float16": "f16"}


# -- interventions ------------------------------------------------------------------------------
# An override is called inside each MoE block's forward, after the router chose and before the
# experts run: (layer, positions [T] int64, ids [T, k] tensor, weights [T, k] tensor) -> new
# weights [T, k] (same shape) or None to leave them. ids are in the block's own slot order.
Override = Callable[[int, np.ndarray, Any, Any], Any]


@dataclass(frozen=True)
class DropRule:
    """Built-in override: zero chosen experts' weights by a rule, then (``renormalise``) rescale the
    survivors as the model normalises its top-k, so they keep the sum the router gave the whole set
    (families that do not normalise the top-k, e.g. Qwen2-MoE and OLMoe by default, are left
    unscaled: the model would not rescale either).

    - ``min_weight``: drop slots whose applied weight is below it;
    - ``keep_top``: keep only the ``keep_top`` largest weights (ties: the earlier slot);
    - ``experts``: drop these expert ids wherever chosen;
    - ``layers``: apply only at these layers (None: all).
    The largest weight of a routing is never dropped by ``min_weight`` (a token always keeps one expert).
    """

    min_weight: float | None = None
    keep_top: int | None = None
    experts: tuple[int, ...] = ()
    layers: tuple[int, ...] | None = None
    renormalise: bool = True

    def describe(self) -> str:
        parts = []
        if self.min_weight is not None:
            parts.append(f"weight<{self.min_weight:g}")
        if self.keep_top is not None:
            parts.append(f"rank>={self.keep_top}")
        if self.experts:
            parts.append("expert=" + ",".join(map(str, self.experts)))
        s = "drop " + " or ".join(parts) if parts else "no-op"
        if self.layers is not None:
            s += " at layers " + ",".join(map(str, self.layers))
        return s + (", renormalised as the model does" if self.renormalise else ", not renormalised")

    def mask(self, ids: Any, weights: Any) -> Any:
        """Bool tensor [T, k]: the slots this rule drops."""
        import torch

        drop = torch.zeros_like(weights, dtype=torch.bool)
        if self.min_weight is not None:
            top = weights.argmax(dim=1, keepdim=True)
            low = weights < self.min_weight
            low.scatter_(1, top, False)
            drop |= low
        if self.keep_top is not None:
            order = torch.sort(-weights, dim=1, stable=True).indices
            rank = torch.empty_like(order)
            rank.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order).contiguous())
            drop |= rank >= self.keep_top
        for e in self.experts:
            drop |= ids == e
        return drop


def parse_drop_rule(text: str, renormalise: bool = True) -> DropRule:
    """``--drop`` syntax: comma-free clauses joined by ``;``: ``weight<0.1``, ``rank>=2``,
    ``expert=3|5``, ``layers=1|2`` (``|`` separates values)."""
    kw: dict[str, Any] = {"renormalise": renormalise}
    for clause in filter(None, (c.strip() for c in text.split(";"))):
        try:
            if clause.startswith("weight<"):
                kw["min_weight"] = float(clause[7:])
                if not math.isfinite(kw["min_weight"]) or kw["min_weight"] < 0:
                    raise ValueError
            elif clause.startswith("rank>="):
                kw["keep_top"] = int(clause[6:])
                if kw["keep_top"] < 1:
                    raise ValueError
            elif clause.startswith("expert="):
                kw["experts"] = tuple(int(x) for x in clause[7:].split("|"))
            elif clause.startswith("layers="):
                kw["layers"] = tuple(int(x) for x in clause[7:].split("|"))
            else:
                raise ValueError
        except ValueError:
            raise UserError(f"--drop: cannot read {clause!r} (give weight<W, rank>=R with R >= 1, expert=I|J or "
                            "layers=L|M, joined by ';').") from None
    if len(kw) == 1:
        raise UserError("--drop: the rule is empty (give weight<W, rank>=R, expert=I|J, joined by ';').")
    return DropRule(**kw)


# -- options and result -------------------------------------------------------------------------
@dataclass
class HfCaptureOptions:
    model: str
    out: str
    prompts: list[str] = field(default_factory=list)
    n_decode: int = 64
    device: str = "cpu"
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto (the checkpoint's)
    expert_dtype: str | None = None  # what an offloading engine would store (EXPERT_DTYPES); None: as loaded
    logits: bool = True
    gate_input: bool = True
    ubatch: int = 512
    ignore_eos: bool = False
    tokens_per_part: int = 64
    prompt_source: str | None = None
    drop: DropRule | None = None  # built-in override (CLI --drop)


@dataclass
class HfCaptureResult(TokenRates):
    out: Path
    complete: bool
    prompt_tokens: int
    decode_tokens: int
    prefill_s: float
    decode_s: float
    checks: dict[str, Any]
    meta: dict[str, Any]
    generated: list[list[int]]  # per prompt: the decoded token ids
    output_logits: list[np.ndarray] | None = None  # per prompt: [positions, vocab] float32 (keep_output_logits)
    stop_reasons: list[str] = field(default_factory=list)  # per prompt
    stop_reason: str = "done"  # the run's: done | interrupted by SIGINT / SIGTERM


# -- model inspection ---------------------------------------------------------------------------
def _family_of(config: Any, where: str) -> Family:
    mt = getattr(config, "model_type", None) or "?"
    arch = ", ".join(getattr(config, "architectures", None) or []) or mt
    fam = FAMILIES.get(mt)
    if fam is not None:
        return fam
    d = config.to_dict() if hasattr(config, "to_dict") else {}
    moe = any(isinstance(d.get(k), int) and d.get(k, 0) > 0 for k in _EXPERT_KEYS)
    if moe:
        raise UserError(f"{where}: {arch} (model_type {mt!r}) has routed experts, but capture-hf does not know its routing "
                        f"rule (known: {', '.join(sorted(FAMILIES))}).")
    raise UserError(f"{where}: {arch} (model_type {mt!r}) has no MoE layer (no routed experts in its config), so there is "
                    "no routing to capture.")


def _decoder_layers(model: Any) -> Any:
    import torch

    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise UserError(f"{type(model).__name__}: no decoder layer list (model.layers) to find MoE blocks in.")
    return layers


@dataclass
class _Block:
    layer: int
    block: Any
    router: Any
    experts: Any


def find_blocks(model: Any, fam: Family, where: str) -> list[_Block]:
    """The MoE blocks, one per MoE layer, each with its router and experts modules (asserted to be
    the classes the family's rule was read from)."""
    out = []
    for i, layer in enumerate(_decoder_layers(model)):
        for _name, mod in layer.named_children():
            router = getattr(mod, fam.router_attr, None)
            experts = getattr(mod, "experts", None)
            if router is None or experts is None:
                continue
            if type(router).__name__ != fam.router_class:
                raise UserError(f"{where}: layer {i}'s router is {type(router).__name__}, not the {fam.router_class} whose "
                                "routing rule capture-hf knows (a different transformers version?).")
            out.append(_Block(i, mod, router, experts))
    if not out:
        raise UserError(f"{where}: {type(model).__name__} has no MoE block (no layer with a {fam.router_attr} and experts), "
                        "so there is no routing to capture.")
    return out


def gating_of(blocks: list[_Block], fam: Family) -> tuple[dict[str, Any], int]:
    """(gating section, top_k) read from the router modules: every MoE layer must agree."""
    seen = set()
    for b in blocks:
        r = b.router
        method = getattr(r, "topk_method", None)  # DeepSeek-V2
        if method is not None and method != "greedy":
            raise UserError(f"layer {b.layer}'s router selects with topk_method {method!r} (the best expert of each "
                            "group ranks the groups), a rule the trace format's gating cannot state; capture-hf knows "
                            "'greedy' only for this family.")
        n_group = 1 if method == "greedy" else int(getattr(r, "num_group", 1) or 1)
        g = {
            "activation": fam.activation,
            "norm_topk": bool(fam.always_norm or getattr(r, "norm_topk_prob", False)) if fam.activation != "softmax_weight"
            else False,
            "selection_bias": _tensor_at(b.block, r, fam.selection_bias) is not None,
            "n_group": n_group,
            "topk_group": int(getattr(r, "topk_group", 1) or 1) if n_group > 1 else 1,
            "scale": float(getattr(r, "routed_scaling_factor", 1.0) or 1.0),
        }
        seen.add((tuple(sorted(g.items())), int(r.top_k)))
    if len(seen) != 1:
        raise UserError("the MoE layers of this model route by different rules (top-k, normalisation or groups differ "
                        "between layers); one trace holds one rule.")
    items, k = seen.pop()
    return dict(items), k


def _nbytes(tensors: Sequence[Any]) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors))


def expert_bytes_of(experts: Any, n_expert: int, expert_dtype: str | None, where: str) -> int:
    """Bytes of one routed expert: every parameter of the experts module carries the expert index
    first. ``expert_dtype``: matrices as that storage type (vectors, i.e. biases, as f32)."""
    total = 0
    for name, p in experts.named_parameters():
        if p.shape[0] != n_expert:
            raise UserError(f"{where}: experts parameter {name} has shape {list(p.shape)}, not [n_expert={n_expert}, ...].")
        per = p.numel() // n_expert
        if expert_dtype is None:
            total += per * p.element_size()
        elif p.ndim <= 2:
            total += per * 4
        else:
            block, size = EXPERT_DTYPES[expert_dtype]
            if not any(d % block == 0 for d in p.shape[1:]):
                raise UserError(f"--expert-dtype {expert_dtype} stores rows in blocks of {block} values, but the experts "
                                f"matrix {name} is {list(p.shape[1:])} per expert (neither dimension is a multiple of {block}).")
            total += per // block * size
    return total


def sizes_of(model: Any, blocks: list[_Block], n_expert: int, expert_dtype: str | None,
             where: str) -> tuple[list[int | None], list[int], int]:
    """(expert_bytes per layer, dense_bytes per layer, nonlayer bytes) from the loaded parameters:
    dense = everything of the layer that is not a routed expert (attention, norms, router, shared
    experts: read for every token); nonlayer = embeddings, final norm, output head."""
    layers = _decoder_layers(model)
    by_layer = {b.layer: b for b in blocks}
    expert_bytes: list[int | None] = [None] * len(layers)
    dense: list[int] = []
    counted: set[int] = set()
    for i, layer in enumerate(layers):
        routed = {id(p) for p in by_layer[i].experts.parameters()} if i in by_layer else set()
        own = [t for t in list(layer.parameters()) + list(layer.buffers()) if id(t) not in routed and id(t) not in counted]
        counted |= {id(t) for t in layer.parameters()} | {id(t) for t in layer.buffers()}
        dense.append(_nbytes(own))
        if i in by_layer:
            expert_bytes[i] = expert_bytes_of(by_layer[i].experts, n_expert, expert_dtype, where)
    rest = [p for p in model.parameters() if id(p) not in counted]
    seen: set[int] = set()
    uniq = [p for p in rest if not (id(p) in seen or seen.add(id(p)))]
    return expert_bytes, dense, _nbytes(uniq)


# -- hooks --------------------------------------------------------------------------------------
class _Recorder:
    """Forward hooks on every router and pre-hooks on every experts module; :meth:`take` returns
    {layer: (gate_input, logits, ids, weights, dropped)} for the forward just run."""

    def __init__(self, blocks: list[_Block], hidden: int, override: Override | None, want_gate: bool, want_logits: bool) -> None:
        self.blocks = blocks
        self.hidden = hidden
        self.override = override
        self.want_gate, self.want_logits = want_gate, want_logits
        self.positions = np.zeros(0, dtype=np.int64)
        self.cur: dict[int, dict[str, Any]] = {}
        self.handles: list[Any] = []

    def __enter__(self) -> _Recorder:
        for b in self.blocks:
            self.handles.append(b.router.register_forward_hook(self._router_hook(b.layer)))
            sig = inspect.signature(type(b.experts).forward)
            self.handles.append(b.experts.register_forward_pre_hook(self._experts_hook(b.layer, sig), with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _router_hook(self, layer: int) -> Callable:
        def hook(_mod: Any, args: tuple, output: Any) -> None:
            x = args[0]
            logits = output[0] if isinstance(output, tuple) else output
            d = self.cur.setdefault(layer, {})
            if "logits" in d:
                raise RuntimeError(f"layer {layer}: the router ran twice in one forward")
            d["logits"] = logits.detach().float().reshape(-1, logits.shape[-1]).cpu().numpy()
            if self.want_gate:
                d["gate_input"] = x.detach().float().reshape(-1, self.hidden).cpu().numpy()
        return hook

    def _experts_hook(self, layer: int, sig: inspect.Signature) -> Callable:
        names = list(sig.parameters)[1:4]  # self, hidden_states, ids, weights

        def hook(mod: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if len(args) >= 3:  # the blocks call experts(hidden, ids, weights): no binding needed
                ids, weights = args[1], args[2]
                bound = None
            else:
                bound = sig.bind(mod, *args, **kwargs)
                ids, weights = bound.arguments[names[1]], bound.arguments[names[2]]
            d = self.cur.setdefault(layer, {})
            if "ids" in d:
                raise RuntimeError(f"layer {layer}: the experts ran twice in one forward")
            d["ids"] = ids.detach().cpu().numpy().astype(np.int32)
            d["weights"] = weights.detach().float().cpu().numpy()
            if self.override is None:
                return None
            new = self.override(layer, self.positions, ids, weights)
            if new is None:
                return None
            if tuple(new.shape) != tuple(weights.shape):
                raise UserError(f"the routing override returned weights of shape {list(new.shape)} at layer {layer}; "
                                f"expected {list(weights.shape)}.")
            new = new.to(weights.dtype)
            d["dropped"] = ((new == 0) & (weights != 0)).cpu().numpy()
            if bound is None:
                return (args[0], args[1], new, *args[3:]), kwargs
            bound.arguments[names[2]] = new
            return tuple(bound.args[1:]), dict(bound.kwargs)
        return hook

    def take(self, n_tok: int, layers: list[int]) -> dict[int, dict[str, Any]]:
        cur, self.cur = self.cur, {}
        for l in layers:
            d = cur.get(l)
            if d is None or "ids" not in d or "logits" not in d:
                raise RuntimeError(f"layer {l}: the hooks saw no routing in this forward")
            if d["ids"].shape[0] != n_tok or d["logits"].shape[0] != n_tok:
                raise RuntimeError(f"layer {l}: captured {d['ids'].shape[0]} routings for {n_tok} tokens")
        return cur


def drop_override(rule: DropRule, gating: dict[str, Any]) -> Override:
    """The :class:`DropRule` as an override callable (renormalising as the model does)."""
    renorm = rule.renormalise and (gating.get("norm_topk") or gating.get("activation") == "softmax_weight")

    def override(layer: int, _positions: np.ndarray, ids: Any, weights: Any) -> Any:
        if rule.layers is not None and layer not in rule.layers:
            return None
        drop = rule.mask(ids, weights)
        if not bool(drop.any()):
            return None
        new = weights.masked_fill(drop, 0.0)
        if renorm:
            new = new * (weights.sum(dim=1, keepdim=True) / new.sum(dim=1, keepdim=True))
        return new
    return override


# -- driver -------------------------------------------------------------------------------------
def _torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, "auto")


def _check_options(opts: HfCaptureOptions) -> None:
    if not opts.prompts or any(not p or not p.strip() for p in opts.prompts):
        raise UserError("a prompt is empty (give --prompt TEXT or a --prompts file of non-empty lines).")
    if opts.n_decode < 0:
        raise UserError("-n must be 0 or more (the number of tokens to decode after each prompt).")
    if opts.ubatch < 1:
        raise UserError("--ubatch must be at least 1.")
    if opts.tokens_per_part < 1:
        raise UserError("--part-tokens must be at least 1.")
    if opts.dtype not in _DTYPES:
        raise UserError(f"--dtype {opts.dtype!r} is not one of float32, bfloat16, float16, auto.")
    if opts.expert_dtype is not None and opts.expert_dtype not in EXPERT_DTYPES:
        raise UserError(f"--expert-dtype {opts.expert_dtype!r} is not one of {', '.join(EXPERT_DTYPES)}.")
    if opts.device != "cpu" and not opts.device.startswith("cuda"):
        raise UserError(f"--device {opts.device!r} is not cpu or cuda[:N].")


def _check_device(device: str) -> None:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: torch sees no CUDA device here (torch {torch.__version__}).")


def quiet_transformers() -> None:
    """No progress bars or advisory warnings from transformers on a CLI's stderr."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_model(path: str, dtype: str = "float32", device: str = "cpu") -> tuple[Any, Any]:
    """(model in eval mode on ``device``, tokenizer) from a local directory (no download)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    p = Path(path)
    if not p.is_dir() or not (p / "config.json").is_file():
        raise UserError(f"{path}: not a model directory (no config.json); capture-hf loads a local transformers checkpoint.")
    try:
        config = AutoConfig.from_pretrained(p, local_files_only=True)
    except (ValueError, OSError, KeyError) as e:
        raise UserError(f"{path}/config.json: transformers cannot read it ({str(e).splitlines()[0][:200]}).") from None
    _family_of(config, path)  # refuse a dense or unknown architecture before loading weights
    try:
        tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except (ValueError, OSError) as e:
        raise UserError(f"{path}: no tokenizer transformers can load there ({str(e).splitlines()[0][:200]}).") from None
    model = AutoModelForCausalLM.from_pretrained(p, dtype=_torch_dtype(_DTYPES[dtype]), local_files_only=True)
    model.to(device)
    model.eval()
    return model, tok


def capture_hf(model: str | Any, prompt: str | Sequence[str] | None = None, *, n_predict: int = 64, out: str | Path,
               device: str = "cpu", dtype: str = "float32", expert_dtype: str | None = None, tokenizer: Any = None,
               override: Override | DropRule | None = None, forced_tokens: Sequence[Sequence[int]] | None = None,
               keep_output_logits: bool = False, ignore_eos: bool = False, ubatch: int = 512, logits: bool = True,
               gate_input: bool = True, tokens_per_part: int = 64, prompt_source: str | None = None) -> HfCaptureResult:
    """Capture ``model`` (a local checkpoint directory, or a loaded transformers model with
    ``tokenizer``) on ``prompt`` (one string, or several: each its own request, run one after the other with a fresh KV cache;
    the trace then has a ``request`` column)
    into the new trace directory ``out``; ``n_predict`` tokens decoded greedily after each prompt.

    ``override``: a routing intervention applied inside every MoE block's forward (a
    :class:`DropRule` or a callable, see :data:`Override`); the trace then records the router's own
    routing (ids, weights) with a ``dropped`` column marking the slots the override zeroed, and the
    generation (and ``output_logits``) is the model's under the override. ``forced_tokens``: per
    prompt, the tokens to feed instead of the greedy choice (to compare two runs on one sequence).
    ``keep_output_logits``: return the model's next-token logits for every position."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt or [])
    opts = HfCaptureOptions(model=str(model) if isinstance(model, (str, Path)) else type(model).__name__, out=str(out),
                            prompts=prompts, n_decode=n_predict, device=device, dtype=dtype, expert_dtype=expert_dtype,
                            logits=logits, gate_input=gate_input, ubatch=ubatch, ignore_eos=ignore_eos,
                            tokens_per_part=tokens_per_part, prompt_source=prompt_source,
                            drop=override if isinstance(override, DropRule) else None)
    require_hf_extra()
    _check_options(opts)
    _check_device(device)
    if forced_tokens is not None and len(forced_tokens) != len(prompts):
        raise UserError(f"forced_tokens gives {len(forced_tokens)} sequences for {len(prompts)} prompts.")
    outp = Path(out)
    if outp.is_dir() and any(outp.iterdir()):
        raise UserError(f"{outp}: output directory exists and is not empty (choose a new --out).")
    check_output_dir(outp, force=False, inputs=[opts.model if isinstance(model, (str, Path)) else None, prompt_source])
    if isinstance(model, (str, Path)):
        model, tokenizer = load_model(str(model), dtype, device)
    elif tokenizer is None:
        raise UserError("capture_hf: a loaded model needs its tokenizer (tokenizer=...).")
    else:
        model = model.to(device).eval()
    return _capture(model, tokenizer, opts, override, forced_tokens, keep_output_logits)


def _capture(model: Any, tok: Any, opts: HfCaptureOptions, override: Override | DropRule | None,
             forced: Sequence[Sequence[int]] | None, keep_logits: bool) -> HfCaptureResult:
    import torch

    where = opts.model
    config = model.config
    fam = _family_of(config, where)
    blocks = find_blocks(model, fam, where)
    gating, top_k = gating_of(blocks, fam)
    weights = {b.layer: _tensor_at(b.block, b.router, fam.weight) for b in blocks}
    n_expert, hidden = (int(x) for x in weights[layers_of(blocks)[0]].shape)
    layers = [b.layer for b in blocks]
    n_layer = len(_decoder_layers(model))
    router_dtype = str(weights[layers[0]].dtype).replace("torch.", "")
    if fam.router_class in _FLOAT32_ROUTERS:
        router_dtype = "float32"  # these routers compute in float32 whatever the model's dtype
    rounding = _INPUT_ROUNDING.get(router_dtype, "unknown")
    # the weights the experts receive: Mixtral / MiniMax keep them in float32, others cast to the model's dtype
    weights_dtype = str(next(iter(model.parameters())).dtype).replace("torch.", "")
    rel_tol = _REL_TOL.get(router_dtype, 1e-2)
    expert_bytes, dense_bytes, nonlayer = sizes_of(model, blocks, n_expert, opts.expert_dtype, where)
    token_lists = []
    for i, p in enumerate(opts.prompts):
        ids = tok(p)["input_ids"]
        if not ids:
            raise UserError(f"prompt {i + 1} tokenizes to no tokens with {where}'s tokenizer.")
        token_lists.append(list(ids))
    max_pos = int(getattr(config, "max_position_embeddings", 0) or 0)
    longest = max(len(t) for t in token_lists) + opts.n_decode
    if max_pos and longest > max_pos:
        raise UserError(f"a prompt plus -n {opts.n_decode} needs {longest} positions, more than {where}'s "
                        f"max_position_embeddings of {max_pos}; shorten the prompt or lower -n.")
    if isinstance(override, DropRule):
        ov_desc = override.describe()
        override = drop_override(override, gating)
    elif override is not None:
        ov_desc = getattr(override, "__name__", type(override).__name__)
    else:
        ov_desc = None
    columns = tuple(c for c, on in (("logits", opts.logits), ("gate_input", opts.gate_input)) if on)
    if override is not None:
        columns = ("dropped",) + columns
    # token ids always; the request column where there are several prompts (each its own sequence)
    columns += ("request", "token") if len(token_lists) > 1 else ("token",)
    out = Path(opts.out)
    meta = _meta(model, fam, gating, top_k, n_expert, hidden, layers, n_layer, expert_bytes, dense_bytes, nonlayer,
                 opts, rounding, token_lists, ov_desc)
    out.mkdir(parents=False, exist_ok=True)
    writer = TraceWriter(out, meta, columns=columns, tokens_per_part=opts.tokens_per_part)
    lay = np.repeat(np.asarray(layers), n_expert)
    ex = np.tile(np.arange(n_expert), len(layers))
    W = np.concatenate([weights[l].detach().float().cpu().numpy() for l in layers])
    sel_bias = {b.layer: (_tensor_at(b.block, b.router, fam.selection_bias).detach().float().cpu().numpy().reshape(n_expert)
                          if gating["selection_bias"] else np.zeros(n_expert, np.float32)) for b in blocks}
    logit_bias = {b.layer: _tensor_at(b.block, b.router, fam.logit_bias).detach().float().cpu().numpy() for b in blocks
                  if _tensor_at(b.block, b.router, fam.logit_bias) is not None}
    writer.write_router(lay, ex, W, np.concatenate([sel_bias[l] for l in layers]),
                        np.concatenate([logit_bias[l] for l in layers]) if logit_bias else None)
    rec = _Recorder(blocks, hidden, override, opts.gate_input, opts.logits)
    rows = _Rows(layers, gating, sel_bias, columns)
    dev = next(model.parameters()).device
    eos = set(_as_list(getattr(model.generation_config, "eos_token_id", None) or config.eos_token_id))
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    batch = 0
    prefill_s = decode_s = 0.0
    n_prompt = n_dec = 0
    generated: list[list[int]] = []
    out_logits: list[np.ndarray] | None = [] if keep_logits else None
    reasons: list[str] = []
    complete = False
    stop = _Stop()
    try:
        with rec, torch.inference_mode(), on_signals(stop):
            for turn, tokens in enumerate(token_lists):
                if stop.signal is not None:
                    break
                cache = _new_cache(model)
                pos = 0
                gen: list[int] = []
                kept: list[np.ndarray] = []
                last = None
                for start in range(0, len(tokens), opts.ubatch):
                    if stop.signal is not None:
                        break
                    chunk = tokens[start:start + opts.ubatch]
                    t0 = time.perf_counter()
                    last = _step(model, rec, rows, chunk, pos, batch, turn, 0, layers, dev, cache, cache_kw,
                                 kept if keep_logits else None)
                    if rows.tokens >= opts.tokens_per_part:
                        rows.flush(writer)
                    prefill_s += time.perf_counter() - t0
                    batch += 1
                    pos += len(chunk)
                    n_prompt += len(chunk)
                reason = "done"
                fseq = list(forced[turn]) if forced is not None else None
                while len(gen) < opts.n_decode and stop.signal is None and last is not None:
                    if fseq is not None:
                        if len(gen) >= len(fseq):
                            reason = "forced tokens exhausted"
                            break
                        nxt = int(fseq[len(gen)])
                    else:
                        nxt = int(torch.argmax(last).item())
                        if nxt in eos and not opts.ignore_eos:
                            reason = "end of generation token"
                            break
                    gen.append(nxt)
                    t0 = time.perf_counter()
                    last = _step(model, rec, rows, [nxt], pos, batch, turn, 1, layers, dev, cache, cache_kw,
                                 kept if keep_logits else None)
                    if rows.tokens >= opts.tokens_per_part:
                        rows.flush(writer)
                    decode_s += time.perf_counter() - t0
                    batch += 1
                    pos += 1
                    n_dec += 1
                if stop.signal is not None:
                    reason = f"interrupted by {signal.Signals(stop.signal).name}"
                generated.append(gen)
                reasons.append(reason)
                if out_logits is not None and kept:
                    out_logits.append(np.concatenate(kept))
        complete = stop.signal is None
        stop_reason = "done" if complete else f"interrupted by {signal.Signals(stop.signal).name}"
    finally:
        try:
            rows.flush(writer)
        finally:
            writer.close(complete=complete)
    if writer.rows_written == 0:
        raise UserError("nothing was captured: the run was interrupted before the first forward finished.")
    writer.update_meta(capture_summary={
        "prompt_tokens": n_prompt, "decode_tokens": n_dec, "stop_reason": stop_reason, "stop_reasons": reasons,
        "generated_tokens": generated, "generated_text": [tok.decode(g) for g in generated],
    })
    checks = run_checks(out, logit_bias=logit_bias, rel_tol=rel_tol, output_rounding=_OUTPUT_ROUNDING.get(router_dtype))
    a = checks.get("topk_of_logits", {})
    if "skipped" not in a:
        if override is None:
            a["weights_tol"] = _WEIGHTS_TOL.get(weights_dtype, 4e-3) * max(1.0, gating["scale"])
            a["weights_within_tol"] = bool(a["weights_max_abs_err"] <= a["weights_tol"])
        else:
            a["weights_note"] = "the override changes the applied weights; the weights column holds the router's"
    checks["passed"] = checks_passed(checks)
    writer.update_meta(checks=checks)
    return HfCaptureResult(out=out, complete=complete, prompt_tokens=n_prompt, decode_tokens=n_dec, prefill_s=prefill_s,
                           decode_s=decode_s, checks=checks, meta=writer.meta, generated=generated,
                           output_logits=out_logits, stop_reasons=reasons, stop_reason=stop_reason)


def _as_list(x: Any) -> list[int]:
    if x is None:
        return []
    return [int(v) for v in x] if isinstance(x, (list, tuple)) else [int(x)]


def _new_cache(_model: Any) -> list[Any]:
    """A holder for the KV cache of one sequence: the first forward lets the model create its own
    kind (MiniMax, LFM2 and other hybrids keep a cache of their own), later ones pass it back."""
    return [None]


def _cache_of(out: Any) -> Any:
    for name in ("past_key_values", "cache"):
        c = getattr(out, name, None)
        if c is not None:
            return c
    raise RuntimeError("the model's forward returned no cache (use_cache=True)")


def rank_order(ids: np.ndarray, weights: np.ndarray, logits: np.ndarray, gating: dict[str, Any],
               bias: np.ndarray | None, extra: list[np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Put each routing's slots in rank order: descending selection score of the captured logits
    (the rule :func:`traces.format.gating.select` ranks by), ties to the lower id."""
    sel = selection_scores(logits, gating, bias)
    score = np.take_along_axis(sel, ids.astype(np.int64), axis=1)
    order = np.lexsort((ids, -score), axis=1) if ids.shape[1] > 1 else np.zeros_like(ids, dtype=np.int64)
    take = [np.take_along_axis(a, order, axis=1) for a in (extra or [])]
    return np.take_along_axis(ids, order, axis=1), np.take_along_axis(weights, order, axis=1), take


class _Rows:
    """Rows of whole forwards not yet handed to the writer: put in rank order and appended in one
    call per part (a writer call per token cost more than the hooks)."""

    def __init__(self, layers: list[int], gating: dict[str, Any], sel_bias: dict[int, np.ndarray],
                 columns: tuple[str, ...]) -> None:
        self.layers, self.gating, self.sel_bias, self.columns = layers, gating, sel_bias, columns
        self.chunks: list[dict[str, Any]] = []
        self.tokens = 0

    def add(self, caps: dict[int, dict[str, Any]], pos: int, tokens: list[int], batch: int, request: int, phase: int) -> None:
        n = len(tokens)
        self.chunks.append({"caps": caps, "pos": pos, "n": n, "batch": batch, "request": request, "phase": phase,
                            "token": np.asarray(tokens, dtype=np.int32)})
        self.tokens += n

    def flush(self, writer: TraceWriter) -> None:
        if not self.chunks:
            return
        layers = self.layers
        cols: dict[str, list[np.ndarray]] = {c: [] for c in ("request", "token", "batch", "phase", "step", "layer", "experts",
                                                                "weights", "logits", "dropped", "gate_input")}
        for c in self.chunks:
            n, caps = c["n"], c["caps"]
            m = n * len(layers)
            cols["request"].append(np.full(m, c["request"], np.int64))
            cols["token"].append(np.tile(c["token"], len(layers)))
            cols["batch"].append(np.full(m, c["batch"], np.int32))
            cols["phase"].append(np.full(m, c["phase"], np.int8))
            cols["step"].append(np.tile(c["pos"] + np.arange(n, dtype=np.int32), len(layers)))
            cols["layer"].append(np.repeat(np.asarray(layers, dtype=np.int16), n))
            for l in layers:
                d = caps[l]
                cols["experts"].append(d["ids"])
                cols["weights"].append(d["weights"])
                cols["logits"].append(d["logits"])
                cols["dropped"].append(d["dropped"] if "dropped" in d else np.zeros(d["ids"].shape, dtype=bool))
                if "gate_input" in self.columns:
                    cols["gate_input"].append(d["gate_input"])
        cat = {k: np.concatenate(v) for k, v in cols.items() if v}
        ids, w, dropped = cat["experts"], cat["weights"], cat["dropped"]
        for l in layers:  # rank order, one vectorised pass per layer over the whole part
            sel = np.flatnonzero(cat["layer"] == l)
            ids[sel], w[sel], (dropped[sel],) = rank_order(ids[sel], w[sel], cat["logits"][sel], self.gating,
                                                           self.sel_bias[l], [dropped[sel]])
        writer.append(turn=0, batch=cat["batch"], phase=cat["phase"], step=cat["step"], layer=cat["layer"],
                      experts=ids, weights=w, **{c: cat[c] for c in self.columns})
        self.chunks, self.tokens = [], 0


def _step(model: Any, rec: _Recorder, rows: _Rows, chunk: list[int], pos: int, batch: int, turn: int, phase: int,
          layers: list[int], dev: Any, cache: Any, cache_kw: str, kept: list[np.ndarray] | None) -> Any:
    """One forward of ``chunk`` at positions pos.., its rows buffered; returns the last position's
    next-token logits."""
    import torch

    n = len(chunk)
    rec.positions = pos + np.arange(n, dtype=np.int64)
    ids_t = torch.tensor([chunk], dtype=torch.long, device=dev)
    out = model(input_ids=ids_t, use_cache=True, **({cache_kw: cache[0]} if cache[0] is not None else {}))
    cache[0] = _cache_of(out)
    rows.add(rec.take(n, layers), pos, chunk, batch, turn, phase)
    if kept is not None:
        kept.append(out.logits[0].float().cpu().numpy())
    return out.logits[0, -1]


def _meta(model: Any, fam: Family, gating: dict[str, Any], top_k: int, n_expert: int, hidden: int, layers: list[int],
          n_layer: int, expert_bytes: list[int | None], dense_bytes: list[int], nonlayer: int, opts: HfCaptureOptions,
          rounding: str, token_lists: list[list[int]], override: str | None) -> dict[str, Any]:
    import torch
    import transformers

    from replay import __version__ as tool_version

    config = model.config
    name = Path(str(getattr(config, "_name_or_path", "") or opts.model)).name or config.model_type
    return {
        "model": {"name": name, "arch": config.model_type, "n_layer": n_layer, "moe_layers": layers, "n_expert": n_expert,
                  "top_k": top_k, "top_k_native": top_k, "n_embd": hidden},
        "expert_bytes": expert_bytes,
        "dense_bytes": dense_bytes,
        "nonlayer_bytes": nonlayer,
        "expert_dtype": opts.expert_dtype or "as loaded",
        "gating": gating,
        "router_input_rounding": rounding,
        "router_stored_type": str(next(iter(model.parameters())).dtype).replace("torch.", ""),
        "router_logit_bias": fam.logit_bias is not None,
        "intervention": override,
        "provenance": {
            "engine": "transformers (forward hooks on the router and experts modules)",
            "engine_version": f"transformers {transformers.__version__}, torch {torch.__version__}",
            "engine_build": {"transformers": transformers.__version__, "torch": torch.__version__, "device": opts.device,
                             "dtype": opts.dtype, "router_class": fam.router_class,
                             "experts_implementation": getattr(config, "_experts_implementation", None)},
            "tool": "moe-replay", "tool_version": tool_version, "importer": None,
            "source_file": opts.model, "prompts": list(opts.prompts), "prompt_file": opts.prompt_source,
            "capture": {"prompt_tokens": [len(t) for t in token_lists], "decode_tokens_requested": opts.n_decode,
                        "ubatch": opts.ubatch, "ignore_eos": opts.ignore_eos, "columns_logits": opts.logits,
                        "columns_gate_input": opts.gate_input, "requests": "one per prompt, run in turn, each with a fresh KV cache"},
        },
    }
