"""The eval callback's ``ask`` phase in native code: no Python per graph node.

ggml's scheduler asks the eval callback about every node of every graph (about 550 per token on
an 8-layer qwen3moe); a Python callback pays a ctypes trampoline, a name copy and a dict lookup
for each, which cost a quality run on llama.cpp about a fifth of a plain decode. :func:`callback`
is a Numba ``cfunc`` that answers the ask phase itself, from the state array
:class:`engine_bridge.hook.MoeHook` keeps (passed as the callback's user data), and calls the
hook's Python callback only where Python is needed: the observe phase (after a node the ask
phase asked for, a few per token) and every call while ``state[S_PY_ASK]`` is set (the first
graph, whose node ops the hook reads to learn how the engine gates).

The decision is the hook's ``_ask`` exactly (tests/test_capture_extra.py runs both on one model
and compares every routing): a node name is ``<base>-<layer>`` with ``base`` one of
:data:`BASES` (kind and weights-chain rank per base, as the hook's name table) and ``layer`` below
``n_layer``; the ids of the top-k node and the last weights-chain node of each layer are
remembered; the first ``MUL_MAT_ID`` node reading the remembered top-k ids is asked for; router
logits nodes are asked for when logits or gate inputs are wanted.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import cfunc, njit, types
from numba.extending import intrinsic

from engine_bridge.router_nodes import _STRUCT_NAMES, LOGITS, PROBS, TOPK, WEIGHT_CHAIN, WEIGHTS
from traces.util.jit import resolve

resolve()  # this module compiles with Numba itself: the lazy stand-ins (traces.util.jit) become dispatchers, the compile notice listens

# state[]: asks answered; 1 = ask in Python; the remembered top-k node and its layer (-1 none);
# whether to observe the router logits; the ops MUL_MAT_ID and MUL_MAT; the Python callback's
# address; n_layer; the struct offsets of name, op and src; then one weights-chain node per layer
S_ASKED, S_PY_ASK, S_TOPK_PTR, S_TOPK_LAYER, S_OBS_LOGITS, S_MUL_MAT_ID, S_MUL_MAT, S_PYCB, S_N_LAYER = range(9)
S_NAME_OFF, S_OP_OFF, S_SRC_OFF = 9, 10, 11
S_WEIGHTS = 12
MAX_BASE = 32



def base_table(bases: list[tuple[str, int, int]]) -> np.ndarray:
    """[n, MAX_BASE + 3] int64: the base name's bytes (0-padded), its length, kind and rank."""
    out = np.zeros((len(bases), MAX_BASE + 3), np.int64)
    for i, (name, kind, rank) in enumerate(bases):
        b = name.encode()
        assert len(b) < MAX_BASE
        out[i, :len(b)] = np.frombuffer(b, np.uint8)
        out[i, MAX_BASE:] = (len(b), kind, rank)
    return out


# The hook's name table, by base (a frozen constant of the compiled callback).
BASES = base_table([(b, kind, 0) for b, kind in _STRUCT_NAMES.items()]
                   + [(b, WEIGHTS, rank) for rank, b in enumerate(WEIGHT_CHAIN)])


@intrinsic
def _load_u8(typingctx, addr):  # noqa: ANN001, ANN202 - a Numba intrinsic
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        return builder.load(builder.inttoptr(args[0], ir.IntType(8).as_pointer()))
    return types.uint8(types.int64), codegen


@intrinsic
def _load_i32(typingctx, addr):  # noqa: ANN001, ANN202
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        return builder.load(builder.inttoptr(args[0], ir.IntType(32).as_pointer()))
    return types.int32(types.int64), codegen


@intrinsic
def _load_i64(typingctx, addr):  # noqa: ANN001, ANN202
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        return builder.load(builder.inttoptr(args[0], ir.IntType(64).as_pointer()))
    return types.int64(types.int64), codegen


@intrinsic
def _call(typingctx, fn, t, ask, user):  # noqa: ANN001, ANN202
    """Call the C function at address ``fn`` as ``bool (*)(void *, bool, void *)``."""
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        fnty = ir.FunctionType(ir.IntType(8), [ir.IntType(64), ir.IntType(8), ir.IntType(64)])
        f = builder.inttoptr(args[0], fnty.as_pointer())
        r = builder.call(f, [args[1], builder.zext(args[2], ir.IntType(8)), args[3]])
        return builder.icmp_unsigned("!=", r, ir.Constant(ir.IntType(8), 0))
    return types.boolean(types.int64, types.int64, types.boolean, types.int64), codegen


@njit(cache=True, inline="always")
def _lookup(addr, bases):
    """(kind, layer, rank) of the node name at ``addr`` (C string, < 64 bytes), kind -1 if it is
    not ``<base>-<digits>`` with a known base."""
    n = 0
    dash = -1
    while n < 64:
        c = _load_u8(addr + n)
        if c == 0:
            break
        if c == 45:  # '-'
            dash = n
        n += 1
    if dash <= 0 or dash >= MAX_BASE or dash == n - 1:
        return -1, 0, 0
    if n - dash > 2 and _load_u8(addr + dash + 1) == 48:
        return -1, 0, 0  # a leading zero: not a name ggml writes, nor one in the hook's table
    il = 0
    for i in range(dash + 1, n):
        c = _load_u8(addr + i)
        if c < 48 or c > 57:
            return -1, 0, 0
        il = il * 10 + (c - 48)
    for b in range(bases.shape[0]):
        if bases[b, MAX_BASE] != dash:
            continue
        same = True
        for i in range(dash):
            if bases[b, i] != _load_u8(addr + i):
                same = False
                break
        if same:
            return bases[b, MAX_BASE + 1], il, bases[b, MAX_BASE + 2]
    return -1, 0, 0


@intrinsic
def _store_i64(typingctx, addr, val):  # noqa: ANN001, ANN202
    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        builder.store(args[1], builder.inttoptr(args[0], ir.IntType(64).as_pointer()))
        return context.get_dummy_value()
    return types.void(types.int64, types.int64), codegen


@njit(cache=True, inline="always")
def _set(user, field, value):  # noqa: ANN001, ANN202
    _store_i64(user + 8 * field, value)


@njit(cache=True, inline="always")
def _get(user, field):  # noqa: ANN001, ANN202
    return _load_i64(user + 8 * field)


@cfunc(types.boolean(types.int64, types.boolean, types.int64), nopython=True, cache=True)
def callback(t, ask, user):  # noqa: ANN001, ANN201 - a C callback: bool (*)(ggml_tensor *, bool ask, void * state)
    if not ask or _get(user, S_PY_ASK) != 0:
        return _call(_get(user, S_PYCB), t, ask, user)
    _set(user, S_ASKED, _get(user, S_ASKED) + 1)
    kind, il, _rank = _lookup(t + _get(user, S_NAME_OFF), BASES)
    if kind >= 0 and il < _get(user, S_N_LAYER):
        if kind == TOPK:
            _set(user, S_TOPK_PTR, t)
            _set(user, S_TOPK_LAYER, il)
            return False
        if kind == WEIGHTS:
            _set(user, S_WEIGHTS + il, t)  # later chain nodes overwrite earlier ones
            return False
        if kind == LOGITS:
            return _get(user, S_OBS_LOGITS) != 0
        if kind == PROBS and _load_i32(t + _get(user, S_OP_OFF)) == _get(user, S_MUL_MAT):
            # softmax_weight without a logit bias: the matmul itself was renamed ffn_moe_probs.
            return _get(user, S_OBS_LOGITS) != 0
        return False
    if _get(user, S_TOPK_LAYER) >= 0 and _load_i32(t + _get(user, S_OP_OFF)) == _get(user, S_MUL_MAT_ID):
        return _load_i64(t + _get(user, S_SRC_OFF) + 16) == _get(user, S_TOPK_PTR)  # src[2]: the ids
    return False
