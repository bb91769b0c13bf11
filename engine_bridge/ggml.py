"""ggml's ``struct ggml_tensor`` read through ctypes, and copying a tensor's data out.

llama-cpp-python exposes no ggml functions, so the few we need are bound here from the
``libggml-base`` that ships inside the installed ``llama_cpp`` package. The struct layout is the
one of the pinned version (llama-cpp-python 0.3.36, vendored llama.cpp 0c1e570); :func:`probe_layout`
checks it against ggml's own functions before any capture, so an upstream layout change fails with
a clear message instead of producing garbage.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import numpy as np

GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_MAX_NAME = 64
GGML_MAX_OP_PARAMS = 64  # bytes


class GGMLTensor(ctypes.Structure):
    """``struct ggml_tensor`` of the pinned ggml (see the module docstring)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


NAME_OFFSET = GGMLTensor.name.offset
OP_OFFSET = GGMLTensor.op.offset
SRC_OFFSET = GGMLTensor.src.offset

# enum ggml_type values of the element types a router node can hold.
GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_I32, GGML_TYPE_BF16 = 0, 1, 26, 30
_NUMPY_TYPES = {GGML_TYPE_F32: np.float32, GGML_TYPE_F16: np.float16, GGML_TYPE_I32: np.int32}


class LayoutError(RuntimeError):
    """The ggml struct layout does not match the one this module was written for."""


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def lib_dir() -> Path:
    """The directory of the shared libraries inside the installed llama_cpp package."""
    import llama_cpp

    return Path(llama_cpp.__file__).resolve().parent / "lib"


@cache
def lib() -> ctypes.CDLL:
    """libggml-base, with the handful of functions the capture needs given their signatures."""
    path = lib_dir() / "libggml-base.so"
    if not path.is_file():
        raise LayoutError(f"{path} is missing: the installed llama_cpp package ships no libggml-base")
    g = ctypes.CDLL(str(path))
    sig = {
        "ggml_nbytes": ([ctypes.c_void_p], ctypes.c_size_t),
        "ggml_get_name": ([ctypes.c_void_p], ctypes.c_char_p),
        "ggml_set_name": ([ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p),
        "ggml_backend_tensor_get": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t], None),
        "ggml_backend_tensor_set": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t], None),
        "ggml_op_name": ([ctypes.c_int], ctypes.c_char_p),
        "ggml_type_name": ([ctypes.c_int], ctypes.c_char_p),
        "ggml_type_size": ([ctypes.c_int], ctypes.c_size_t),
        "ggml_init": ([_InitParams], ctypes.c_void_p),
        "ggml_free": ([ctypes.c_void_p], None),
        "ggml_new_tensor_2d": ([ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64], ctypes.c_void_p),
        "ggml_new_tensor_3d": ([ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64], ctypes.c_void_p),
        "ggml_mul_mat_id": ([ctypes.c_void_p] * 4, ctypes.c_void_p),
        "ggml_unary_op_name": ([ctypes.c_int], ctypes.c_char_p),
        "ggml_mul_mat": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p], ctypes.c_void_p),
        "ggml_transpose": ([ctypes.c_void_p, ctypes.c_void_p], ctypes.c_void_p),
        "ggml_scale": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float], ctypes.c_void_p),
    }
    for name, (args, res) in sig.items():
        fn = getattr(g, name)
        fn.argtypes = args
        fn.restype = res
    return g


def tensor(ptr: int) -> GGMLTensor:
    """A view of the ggml tensor at address ``ptr`` (no copy; valid while ggml keeps it)."""
    return GGMLTensor.from_address(ptr)


def tensor_name(ptr: int) -> bytes:
    """The tensor's name, read straight from the struct (fast path for the eval callback)."""
    return ctypes.string_at(ptr + NAME_OFFSET)


def op_name(op: int) -> str:
    return lib().ggml_op_name(op).decode()


def unary_op_name(op: int) -> str:
    return lib().ggml_unary_op_name(op).decode()


def type_name(typ: int) -> str:
    return lib().ggml_type_name(typ).decode()


def span_bytes(t: GGMLTensor) -> int:
    """Bytes from the first to one past the last element, from ne/nb (what ggml_nbytes returns
    for a non-quantized tensor, strided views included)."""
    if any(t.ne[i] <= 0 for i in range(GGML_MAX_DIMS)):
        return 0
    return int(lib().ggml_type_size(t.type)) + sum((t.ne[i] - 1) * t.nb[i] for i in range(GGML_MAX_DIMS))


def check_tensor(ptr: int) -> None:
    """Assert the struct read at ``ptr`` agrees with ggml's own accessors (size and name)."""
    t = tensor(ptr)
    g = lib()
    want = g.ggml_nbytes(ptr)
    got = span_bytes(t)
    name = g.ggml_get_name(ptr)
    if got != want or t.name != name:
        raise LayoutError(
            f"struct ggml_tensor layout mismatch on {name!r}: ne/nb give {got} bytes but ggml_nbytes says {want}, "
            f"name field reads {t.name!r}; this llama_cpp build is not the pinned llama-cpp-python 0.3.36"
        )


@cache
def probe_layout() -> dict[str, int]:
    """Build a tiny graph in a no-alloc ggml context and check every field the capture reads
    (type, ne, nb, op, op_params, src, view_src, name) against what ggml put there.

    Returns the enum values of the ops the hook tests for (``MUL_MAT``, ``MUL_MAT_ID``), read
    from nodes ggml built rather than hard-coded."""
    g = lib()
    ctx = g.ggml_init(_InitParams(1 << 20, None, True))
    if not ctx:
        raise LayoutError("ggml_init failed while probing the struct layout")
    try:
        a = g.ggml_new_tensor_2d(ctx, GGML_TYPE_F16, 3, 5)
        b = g.ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 3, 7)
        g.ggml_set_name(a, b"probe_a-3")
        mm = g.ggml_mul_mat(ctx, a, b)
        tr = g.ggml_transpose(ctx, b)
        sc = g.ggml_scale(ctx, b, ctypes.c_float(2.5))
        experts = g.ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 3, 4, 6)
        rows = g.ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 3, 2, 5)
        ids = g.ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 2, 5)
        mmid = g.ggml_mul_mat_id(ctx, experts, rows, ids)
        ta, tm, tt, ts = tensor(a), tensor(mm), tensor(tr), tensor(sc)
        tid = tensor(mmid)
        problems = []
        if ta.type != GGML_TYPE_F16 or list(ta.ne) != [3, 5, 1, 1] or list(ta.nb) != [2, 6, 30, 30]:
            problems.append(f"type/ne/nb read as {ta.type}/{list(ta.ne)}/{list(ta.nb)}")
        if ta.name != b"probe_a-3" or tensor_name(a) != b"probe_a-3":
            problems.append(f"name read as {ta.name!r}")
        if tm.src[0] != a or tm.src[1] != b or op_name(tm.op) != "MUL_MAT" or list(tm.ne) != [5, 7, 1, 1]:
            problems.append(f"mul_mat node reads op {tm.op} src {tm.src[0]:#x},{tm.src[1]:#x}")
        if tt.view_src != b or list(tt.nb[:2]) != [12, 4] or op_name(tt.op) != "TRANSPOSE":
            problems.append("transpose view reads a wrong view_src or strides")
        if ctypes.c_float.from_buffer_copy(ctypes.c_int32(ts.op_params[0])).value != 2.5:
            problems.append("scale op_params[0] does not read 2.5")
        if op_name(tid.op) != "MUL_MAT_ID" or tid.src[2] != ids or list(tid.ne[:3]) != [4, 2, 5]:
            problems.append("mul_mat_id node reads a wrong op, ids source or shape")
        for p in (a, b, mm, tr):
            if g.ggml_nbytes(p) != span_bytes(tensor(p)):
                problems.append(f"ggml_nbytes disagrees with ne/nb on {g.ggml_get_name(p)!r}")
        if problems:
            raise LayoutError("struct ggml_tensor layout does not match the pinned llama-cpp-python 0.3.36: " + "; ".join(problems))
        return {"MUL_MAT": int(tm.op), "MUL_MAT_ID": int(tid.op)}
    finally:
        g.ggml_free(ctx)


_NE = ctypes.c_int64 * GGML_MAX_DIMS
_NB = ctypes.c_size_t * GGML_MAX_DIMS
_NE_OFFSET = GGMLTensor.ne.offset
_NB_OFFSET = GGMLTensor.nb.offset
_TYPE_SIZE = {GGML_TYPE_F32: 4, GGML_TYPE_F16: 2, GGML_TYPE_I32: 4}


def read_array(ptr: int) -> np.ndarray:
    """Copy a (possibly strided) tensor's data into a contiguous numpy array, shape = ne reversed.

    The bytes are fetched with ``ggml_backend_tensor_get`` (works for device buffers too), from
    the tensor's first to its last element; the strides nb are then honoured on the host. This
    runs inside the eval callback for every observed node, so it reads the struct fields with
    plain ctypes arrays rather than through :class:`GGMLTensor`.
    """
    typ = ctypes.c_int.from_address(ptr).value
    dtype = _NUMPY_TYPES.get(typ)
    if dtype is None:
        raise LayoutError(f"tensor {tensor_name(ptr)!r} has ggml type {type_name(typ)}, which the capture does not read")
    n0, n1, n2, n3 = _NE.from_address(ptr + _NE_OFFSET)
    b0, b1, b2, b3 = _NB.from_address(ptr + _NB_OFFSET)
    shape = (n3, n2, n1, n0)
    if n0 <= 0 or n1 <= 0 or n2 <= 0 or n3 <= 0:
        return np.empty(shape, dtype=dtype)
    nbytes = _TYPE_SIZE[typ] + (n0 - 1) * b0 + (n1 - 1) * b1 + (n2 - 1) * b2 + (n3 - 1) * b3
    if b0 == _TYPE_SIZE[typ] and b1 == b0 * n0 and b2 == b1 * n1 and b3 == b2 * n2:  # contiguous: no strided copy
        out = np.empty(shape, dtype=dtype)
        _tensor_get()(ptr, out.ctypes.data, 0, nbytes)
        return out
    nb = (b0, b1, b2, b3)
    raw = np.empty(nbytes, dtype=np.uint8)
    _tensor_get()(ptr, raw.ctypes.data, 0, nbytes)
    view = np.ndarray(shape=shape, dtype=dtype, buffer=raw, offset=0, strides=tuple(reversed(nb)))
    return np.ascontiguousarray(view)


def write_array(ptr: int, values: np.ndarray) -> None:
    """Overwrite a contiguous float32 tensor's data with ``values`` (same element count), through
    ``ggml_backend_tensor_set`` (host or device buffer). Used inside the eval callback to change a
    node's output before its consumers run (a routing intervention on the final MoE weights)."""
    typ = ctypes.c_int.from_address(ptr).value
    n0, n1, n2, n3 = _NE.from_address(ptr + _NE_OFFSET)
    b0, b1, b2, b3 = _NB.from_address(ptr + _NB_OFFSET)
    if typ != GGML_TYPE_F32:
        raise LayoutError(f"tensor {tensor_name(ptr)!r} has ggml type {type_name(typ)}; an override writes float32 only")
    if not (b0 == 4 and b1 == 4 * n0 and b2 == b1 * n1 and b3 == b2 * n2):
        raise LayoutError(f"tensor {tensor_name(ptr)!r} is not contiguous (nb {[b0, b1, b2, b3]}); an override cannot write it")
    data = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    if data.size != n0 * n1 * n2 * n3:
        raise LayoutError(f"tensor {tensor_name(ptr)!r} holds {n0 * n1 * n2 * n3} values; the override gave {data.size}")
    _tensor_set()(ptr, data.ctypes.data, 0, data.nbytes)


@cache
def _tensor_set():  # noqa: ANN202 - the bound C function
    return lib().ggml_backend_tensor_set


@cache
def _tensor_get():  # noqa: ANN202 - the bound C function
    return lib().ggml_backend_tensor_get
