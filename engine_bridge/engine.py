"""A llama.cpp model and context driven through llama-cpp-python's low-level API.

The high-level ``Llama`` class hides ``cb_eval``; here the context is created with the eval
callback of a :class:`engine_bridge.hook.MoeHook`, one ``llama_decode`` per compute batch
(n_batch = n_ubatch, so one call is one ubatch and one graph), logits requested for every token
(otherwise the last layer computes only the rows whose output is requested and its routing would
be missing for the others).
"""

from __future__ import annotations

import ctypes
import os
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from traces.errors import UserError

PINNED_VERSION = "0.3.36"


def import_llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError:
        raise UserError(
            "capture needs llama-cpp-python (pip install 'moe-replay[capture]', which builds llama.cpp from source, "
            "about 8 minutes on 2 cores)."
        ) from None
    return llama_cpp


def engine_version() -> dict[str, str]:
    """llama-cpp-python's version and the ggml version/commit the bundled library reports."""
    lc = import_llama_cpp()
    from engine_bridge import ggml

    out = {"llama_cpp_python": str(lc.__version__)}
    g = ggml.lib()
    for sym in ("ggml_version", "ggml_commit"):
        fn = getattr(g, sym, None)
        if fn is not None:
            fn.argtypes, fn.restype = [], ctypes.c_char_p
            out[sym] = (fn() or b"").decode(errors="replace")
    try:
        out["system_info"] = lc.llama_print_system_info().decode(errors="replace").strip()
    except Exception:  # noqa: BLE001 - informational only
        pass
    return out


class _LogSink:
    """Keeps llama.cpp's log lines (the last ones explain a failed load) instead of printing them."""

    def __init__(self, lc: Any, echo: bool) -> None:
        self.lines: deque[str] = deque(maxlen=200)
        self.echo = echo
        self._partial = ""
        self.callback = lc.llama_log_callback(self._cb)  # referenced for the process's life
        lc.llama_log_set(self.callback, ctypes.c_void_p(0))

    def _cb(self, level: int, text: bytes, _user: Any) -> None:
        s = text.decode("utf-8", errors="replace")
        if self.echo:
            os.write(2, text)
        self._partial += s
        while "\n" in self._partial:
            line, self._partial = self._partial.split("\n", 1)
            self.lines.append(line)

    def last_error(self) -> str:
        for line in reversed(self.lines):
            low = line.lower()
            if "error" in low or "failed" in low or "unknown" in low or "missing" in low:
                return line.strip()
        return self.lines[-1].strip() if self.lines else "no message"


_SINK: _LogSink | None = None


@dataclass
class EngineOptions:
    n_ctx: int
    ubatch: int
    threads: int | None = None
    n_expert_used: int | None = None
    arch: str = ""
    verbose: bool = False


class Engine:
    """A loaded model and a context whose eval callback is ``callback`` (kept referenced here)."""

    def __init__(self, model_path: str, opts: EngineOptions, callback: Any | None) -> None:
        global _SINK
        lc = import_llama_cpp()
        self.lc = lc
        if _SINK is None:
            _SINK = _LogSink(lc, opts.verbose)
        self.sink = _SINK
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        self._overrides = None
        if opts.n_expert_used is not None:
            ov = (lc.llama_model_kv_override * 2)()
            ov[0].tag = lc.LLAMA_KV_OVERRIDE_TYPE_INT
            ov[0].key = f"{opts.arch}.expert_used_count".encode()
            ov[0].value.val_i64 = int(opts.n_expert_used)
            self._overrides = ov  # referenced: the loader reads it during the call below
            mp.kv_overrides = ctypes.cast(ov, ctypes.POINTER(lc.llama_model_kv_override))
        self.model = lc.llama_model_load_from_file(str(model_path).encode(), mp)
        if not self.model:
            raise UserError(f"{model_path}: llama.cpp could not load the model ({self.sink.last_error()}).")
        cp = lc.llama_context_default_params()
        cp.n_ctx = opts.n_ctx
        cp.n_batch = opts.ubatch
        cp.n_ubatch = opts.ubatch
        cp.n_seq_max = 1
        if opts.threads:
            cp.n_threads = opts.threads
            cp.n_threads_batch = opts.threads
        cp.no_perf = True
        self.callback = callback
        if callback is not None:
            cp.cb_eval = callback
            cp.cb_eval_user_data = None
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise UserError(f"{model_path}: llama.cpp could not create a context ({self.sink.last_error()}).")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.ubatch = opts.ubatch
        self._batch = lc.llama_batch_init(opts.ubatch, 0, 1)
        self.threads = int(cp.n_threads)

    def tokenize(self, text: str) -> list[int]:
        raw = text.encode("utf-8")
        cap = len(raw) + 16
        buf = (self.lc.llama_token * cap)()
        n = self.lc.llama_tokenize(self.vocab, raw, len(raw), buf, cap, True, False)
        if n < 0:
            cap = -n
            buf = (self.lc.llama_token * cap)()
            n = self.lc.llama_tokenize(self.vocab, raw, len(raw), buf, cap, True, False)
        return list(buf[:n])

    def is_eog(self, token: int) -> bool:
        return bool(self.lc.llama_vocab_is_eog(self.vocab, token))

    def piece(self, token: int) -> str:
        buf = ctypes.create_string_buffer(64)
        n = self.lc.llama_token_to_piece(self.vocab, token, buf, 64, 0, False)
        return buf.raw[: max(n, 0)].decode("utf-8", errors="replace")

    def decode(self, tokens: list[int], pos0: int) -> np.ndarray:
        """Run one compute batch (``len(tokens)`` <= ubatch) at positions pos0.. with output for
        every token; return the vocabulary logits of the last token (float32 copy)."""
        n = len(tokens)
        b = self._batch
        b.n_tokens = n
        for i, tok in enumerate(tokens):
            b.token[i] = tok
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1  # every row: else the last layer skips the rows with no output
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        ptr = self.lc.llama_get_logits_ith(self.ctx, n - 1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def close(self) -> None:
        lc = self.lc
        if getattr(self, "_batch", None) is not None:
            lc.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "ctx", None):
            lc.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            lc.llama_model_free(self.model)
            self.model = None
