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
from engine_bridge.router_nodes import _STRUCT_NAMES, LOGITS, PROBS, TOPK, WEIGHT_CHAIN, WEIGHTS


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

    def __init__(self, n_layer: int, observe_logits: bool, want_logits: bool = True, want_gate_input: bool = True,
                 native: bool = True) -> None:
        from engine_bridge import native_ask as na

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
        # What the ask phase remembers (the top-k node and its layer, each layer's last weights-chain
        # node), in an array the native ask phase (engine_bridge.native_ask) shares as its user data.
        self.state = np.zeros(na.S_WEIGHTS + n_layer, np.int64)
        self.state[na.S_TOPK_LAYER] = -1
        self.state[na.S_PY_ASK] = 1  # the first graph's asks run in Python (_note_shape)
        self.state[na.S_OBS_LOGITS] = int(observe_logits)
        self.state[na.S_N_LAYER] = n_layer
        self.state[na.S_NAME_OFF], self.state[na.S_OP_OFF], self.state[na.S_SRC_OFF] = ggml.NAME_OFFSET, ggml.OP_OFFSET, ggml.SRC_OFFSET
        self._checked = False
        self.error: BaseException | None = None
        self.observed = 0  # nodes observed (graph splits forced), for the overhead report
        # A routing intervention: (layer, ids [T, k] rank order, weights [T, k] float32) -> new
        # weights or None; written into the final weights node before the expert outputs are mixed.
        self.override: Any = None
        self._asked_py = 0
        ops = ggml.probe_layout()
        self._mul_mat_id = ops["MUL_MAT_ID"]
        self._mul_mat = ops["MUL_MAT"]
        self.state[na.S_MUL_MAT_ID], self.state[na.S_MUL_MAT] = self._mul_mat_id, self._mul_mat
        self.py_callback = ggml_eval_callback_type()(self._callback)
        self.state[na.S_PYCB] = ctypes.cast(self.py_callback, ctypes.c_void_p).value
        self.native = native
        # The callback the context gets: the native ask phase (user data: the state array), which
        # calls py_callback to observe; or py_callback itself (native=False: every node in Python).
        self.callback = ggml_eval_callback_type()(na.callback.address) if native else self.py_callback
        self.user_data = self.state.ctypes.data if native else None
        if native:  # engine_bridge.engine.Engine passes it as the context's callback user data
            self.callback.user_data = self.user_data
        self._na = na

    @property
    def asked(self) -> int:
        """Nodes the ask phase was asked about (Python and native together)."""
        return self._asked_py + int(self.state[self._na.S_ASKED])

    @asked.setter
    def asked(self, value: int) -> None:
        self._asked_py = value
        self.state[self._na.S_ASKED] = 0

    # -- the callback -------------------------------------------------------------------------
    def _callback(self, t: int, ask: bool, _user: Any) -> bool:
        try:
            return self._ask(t) if ask else self._observe(t)
        except BaseException as e:  # never let an exception unwind through C
            if self.error is None:
                self.error = e
            return False  # on ask: do not observe; after compute: abort the graph

    def _ask(self, t: int) -> bool:
        na, st = self._na, self.state
        self._asked_py += 1
        info = self.names.get(ctypes.string_at(t + ggml.NAME_OFFSET))
        if info is None:
            if st[na.S_TOPK_LAYER] >= 0 and ctypes.c_int.from_address(t + ggml.OP_OFFSET).value == self._mul_mat_id:
                if ctypes.c_void_p.from_address(t + ggml.SRC_OFFSET + 2 * ctypes.sizeof(ctypes.c_void_p)).value == st[na.S_TOPK_PTR]:
                    return True
            return False
        kind, il, rank = info
        if self._first_graph:
            self._note_shape(t, kind, rank)
        if kind == TOPK:
            st[na.S_TOPK_PTR], st[na.S_TOPK_LAYER] = t, il
            return False
        if kind == WEIGHTS:
            st[na.S_WEIGHTS + il] = t  # later chain nodes overwrite earlier ones
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
        # The first expert matmul of the remembered top-k layer: ids and final weights are computed.
        na, st = self._na, self.state
        il = int(st[na.S_TOPK_LAYER])
        topk = ggml.read_array(int(st[na.S_TOPK_PTR]))
        n_tok, k = topk.shape[-2], topk.shape[-1]
        wptr = int(st[na.S_WEIGHTS + il])
        if wptr == 0:
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
        st[na.S_TOPK_LAYER] = -1
        st[na.S_TOPK_PTR] = 0
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
        na = self._na
        self.state[na.S_WEIGHTS:] = 0
        self.state[na.S_TOPK_LAYER] = -1
        self._first_graph = False
        self.state[na.S_PY_ASK] = 0  # the graph's shape is noted: the native ask phase takes over
        return out


def ggml_eval_callback_type() -> Any:
    import llama_cpp

    return llama_cpp.ggml_backend_sched_eval_callback
