"""The engine's rounding of the router input, so recomputed router logits match the engine's.

llama.cpp's CPU matmul converts the activation to the weight's dot-product type before the dot
product: F16 router weights round the input to f16, quantized ones to Q8_0 / Q8_K blocks.
Recomputing in f32 without that gives ~1e-3 logit error and flips near-ties, so anything that
recomputes routings from ``gate_input`` and ``router.parquet`` (the capture self-checks, the
``ctrl`` and ``stale-gate`` predictors) applies the trace's ``router_input_rounding``.
"""

from __future__ import annotations

import numpy as np

from traces.format.errors import UserError

# ggml's vec_dot_type of the router weight's type: what the activation is rounded to.
_LEGACY_QUANTS = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4"}
_K_QUANTS = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_XS"}


def input_rounding(stored_type: str) -> str:
    """The rounding the engine applies to the router input for weights stored as ``stored_type``."""
    t = stored_type.upper()
    if t == "F32":
        return "none"
    if t == "F16":
        return "f16"
    if t == "BF16":
        return "bf16"
    if t in _LEGACY_QUANTS:
        return "q8_0"
    if t in _K_QUANTS:
        return "q8_k"
    return "unknown"


def round_input(x: np.ndarray, rounding: str) -> np.ndarray:
    """Apply the engine's input rounding to gate inputs ``[T, D]`` (float32 out)."""
    x = np.asarray(x, dtype=np.float32)
    if rounding in ("none", "unknown"):
        return x
    if rounding == "f16":
        return x.astype(np.float16).astype(np.float32)
    if rounding == "bf16":
        u = x.view(np.uint32).astype(np.uint64)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16  # round to nearest even
        return u.astype(np.uint32).view(np.float32)
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize, quantize
    except ImportError:
        raise UserError(f"router input rounding {rounding!r} needs gguf-py (pip install 'moe-replay[capture]').") from None

    qt = GGMLQuantizationType.Q8_0 if rounding == "q8_0" else GGMLQuantizationType.Q8_K
    try:
        return dequantize(quantize(x, qt), qt).reshape(x.shape).astype(np.float32)
    except NotImplementedError:
        return x
