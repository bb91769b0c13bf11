"""The eval-callback hook: what llama.cpp's router saw and chose, per MoE layer and compute batch.

ggml's scheduler calls the callback twice per node of interest: with ``ask=True`` while it scans
the graph (returning True splits the graph there and computes up to that node), then with
``ask=False`` once the node is computed, to read it. Every observed node costs a graph split, so
the hook observes as few as possible:

- ``ffn_moe_logits-<il>`` (only when logits or gate inputs are wanted): the router matmul; its
  ``src[1]`` is the router input (the gate input) on every architecture, so no table of input
  names is needed;
- the first ``MUL_MAT_ID`` node whose ids are ``ffn_moe_topk-<il>`` (the first expert matmul): at
  that point the selected ids and the final weights are computed and still alive (their consumers
  come later), so both are read from the pointers remembered while scanning, without observing them.

The final weights are the last node of the chain ``ffn_moe_weights`` -> ``_softmax`` -> ``_norm``
-> ``_scaled`` that the architecture builds (the graph order guarantees the later ones come later).
``ffn_moe_topk`` is a strided view of the argsort: :func:`engine_bridge.ggml.read_array` honours nb.

The first graph also tells how the engine gates (softmax or sigmoid probs, selection bias,
groups, top-k normalization, weight scale): read from the node ops rather than from a table of
architectures, so the metadata is what the engine did, not what we believe it does.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine_bridge import ggml

LOGITS, LOGITS_BIASED, PROBS, PROBS_BIASED, GROUP_TOPK, TOPK, WEIGHTS = range(7)
WEIGHT_CHAIN = ("ffn_moe_weights", "ffn_moe_weights_softmax", "ffn_moe_weights_norm", "ffn_moe_weights_scaled")
_STRUCT_NAMES = {
    "ffn_moe_logits": LOGITS,
    "ffn_moe_logits_biased": LOGITS_BIASED,
    "ffn_moe_probs": PROBS,
    "ffn_moe_probs_biased": PROBS_BIASED,
    "ffn_moe_group_topk": GROUP_TOPK,
    "ffn_moe_topk": TOPK,
}


@dataclass
class LayerCapture:
    """One MoE layer of one compute batch (T tokens)."""

    experts: np.ndarray | None = None  # int32 [T, k], rank order
    weights: np.ndarray | None = None  # float32 [T, k]
    logits: np.ndarray | None = None  # float32 [T, n_expert]
    gate_input: np.ndarray | None = None  # float32 [T, n_embd]
    dropped: np.ndarray | None = None  # bool [T, k]: slots an override zeroed (None: no override)


@dataclass
class GraphShape:
    """What the first computed graph showed about the router (per node name, layer stripped)."""

    names: set[str] = field(default_factory=set)
    probs_op: str | None = None
    weight_scale: float | None = None
    router_type: str | None = None  # ggml type name of ffn_gate_inp


class MoeHook:
    """Holds the ctypes eval callback and the data it read for the current batch.

    ``observe_logits``: observe the router matmul (for the logits and/or gate-input columns).
    Keep the object alive as long as the llama context: the context holds a raw pointer to
    :attr:`callback`.
    """

    def __init__(self, n_layer: int, observe_logits: bool, want_logits: bool = True, want_gate_input: bool = True) -> None:
        self.observe_logits = observe_logits
        self.want_logits = want_logits
        self.want_gate_input = want_gate_input
        self.names: dict[bytes, tuple[int, int, int]] = {}
        for il in range(n_layer):
            for base, kind in _STRUCT_NAMES.items():
                self.names[f"{base}-{il}".encode()] = (kind, il, 0)
            for rank, base in enumerate(WEIGHT_CHAIN):
                self.names[f"{base}-{il}".encode()] = (WEIGHTS, il, rank)
        self.layers: dict[int, LayerCapture] = {}
        self.shape = GraphShape()
        self._first_graph = True
        self._topk_ptr = 0
        self._topk_layer = -1
        self._weights_ptr: dict[int, int] = {}
        self._checked = False
        self.error: BaseException | None = None
        self.observed = 0  # nodes observed (graph splits forced), for the overhead report
        # A routing intervention: (layer, ids [T, k] rank order, weights [T, k] float32) -> new
        # weights or None; written into the final weights node before the expert outputs are mixed.
        self.override: Any = None
        self.asked = 0
        ops = ggml.probe_layout()
        self._mul_mat_id = ops["MUL_MAT_ID"]
        self._mul_mat = ops["MUL_MAT"]
        self.callback = ggml_eval_callback_type()(self._callback)

    # -- the callback -------------------------------------------------------------------------
    def _callback(self, t: int, ask: bool, _user: Any) -> bool:
        try:
            return self._ask(t) if ask else self._observe(t)
        except BaseException as e:  # never let an exception unwind through C
            if self.error is None:
                self.error = e
            return False  # on ask: do not observe; after compute: abort the graph

    def _ask(self, t: int) -> bool:
        self.asked += 1
        info = self.names.get(ctypes.string_at(t + ggml.NAME_OFFSET))
        if info is None:
            if self._topk_layer >= 0 and ctypes.c_int.from_address(t + ggml.OP_OFFSET).value == self._mul_mat_id:
                if ctypes.c_void_p.from_address(t + ggml.SRC_OFFSET + 2 * ctypes.sizeof(ctypes.c_void_p)).value == self._topk_ptr:
                    return True
            return False
        kind, il, rank = info
        if self._first_graph:
            self._note_shape(t, kind, rank)
        if kind == TOPK:
            self._topk_ptr, self._topk_layer = t, il
            return False
        if kind == WEIGHTS:
            self._weights_ptr[il] = t  # later chain nodes overwrite earlier ones
            return False
        if kind == LOGITS:
            return self.observe_logits
        if kind == PROBS and ctypes.c_int.from_address(t + ggml.OP_OFFSET).value == self._mul_mat:
            # softmax_weight without a logit bias: the matmul itself was renamed ffn_moe_probs.
            return self.observe_logits
        return False

    def _observe(self, t: int) -> bool:
        self.observed += 1
        if not self._checked:
            ggml.check_tensor(t)
            self._checked = True
        name = ctypes.string_at(t + ggml.NAME_OFFSET)
        info = self.names.get(name)
        if info is not None and info[0] in (LOGITS, PROBS):
            il = info[1]
            node = ggml.tensor(t)
            cap = self.layers.setdefault(il, LayerCapture())
            n_tok = int(node.ne[1])
            if self.want_logits:
                cap.logits = ggml.read_array(t).reshape(n_tok, -1)
            if self.want_gate_input:
                cap.gate_input = ggml.read_array(node.src[1]).reshape(n_tok, -1).astype(np.float32, copy=False)
            if self.shape.router_type is None:
                self.shape.router_type = ggml.type_name(ggml.tensor(node.src[0]).type)
            return True
        # The first expert matmul of layer _topk_layer: ids and final weights are computed.
        il = self._topk_layer
        topk = ggml.read_array(self._topk_ptr)
        n_tok, k = topk.shape[-2], topk.shape[-1]
        wptr = self._weights_ptr.get(il)
        if wptr is None:
            raise RuntimeError(f"layer {il}: no ffn_moe_weights node precedes the first expert matmul")
        cap = self.layers.setdefault(il, LayerCapture())
        cap.experts = topk.reshape(n_tok, k)
        cap.weights = ggml.read_array(wptr).reshape(n_tok, k).astype(np.float32, copy=False)
        if self.override is not None:
            new = self.override(il, cap.experts, cap.weights)
            if new is None:
                cap.dropped = np.zeros((n_tok, k), dtype=bool)
            else:
                new = np.asarray(new, dtype=np.float32).reshape(n_tok, k)
                ggml.write_array(wptr, new)  # consumed only after the expert matmuls (ggml_mul with the outputs)
                cap.dropped = (new == 0) & (cap.weights != 0)
        self._topk_layer = -1
        self._topk_ptr = 0
        return True

    def _note_shape(self, t: int, kind: int, rank: int) -> None:
        name = ctypes.string_at(t + ggml.NAME_OFFSET).decode()
        base = name.rsplit("-", 1)[0]
        self.shape.names.add(base)
        node = ggml.tensor(t)
        if kind == PROBS and self.shape.probs_op is None:
            op = ggml.op_name(node.op)
            if op == "UNARY":
                op = "UNARY:" + ggml.unary_op_name(node.op_params[0])
            self.shape.probs_op = op
        if kind == WEIGHTS and WEIGHT_CHAIN[rank] == "ffn_moe_weights_scaled" and self.shape.weight_scale is None:
            self.shape.weight_scale = float(ctypes.c_float.from_buffer_copy(ctypes.c_int32(node.op_params[0])).value)

    # -- per batch ----------------------------------------------------------------------------
    def take(self) -> dict[int, LayerCapture]:
        """The layers captured since the last call (one llama_decode = one compute batch)."""
        if self.error is not None:
            err, self.error = self.error, None
            raise err
        out, self.layers = self.layers, {}
        self._weights_ptr = {}
        self._topk_layer = -1
        self._first_graph = False
        return out


def ggml_eval_callback_type() -> Any:
    import llama_cpp

    return llama_cpp.ggml_backend_sched_eval_callback
