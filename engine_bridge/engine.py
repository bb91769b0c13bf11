"""A llama.cpp model and context driven through llama-cpp-python's low-level API.

The high-level ``Llama`` class hides ``cb_eval``; here the context is created with the eval
callback of a :class:`engine_bridge.hook.MoeHook`, one ``llama_decode`` per compute batch
(n_batch = n_ubatch, so one call is one ubatch and one graph), logits requested for every token
(otherwise the last layer computes only the rows whose output is requested and its routing would
be missing for the others).

:class:`Vocab` loads the vocabulary and hyperparameters alone (``vocab_only``, no weights), so the
prompt is tokenized and every size checked before a context exists: llama.cpp aborts the whole
process (``GGML_ASSERT``) on a batch larger than its ``n_batch`` or a vocabulary it cannot tokenize
with, where a Python caller would want an error.
"""

from __future__ import annotations

import ctypes
import os
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from traces.format.errors import UserError

PINNED_VERSION = "0.3.36"


PINNED_GGUF = "0.19.0"
LLAMA_VOCAB_TYPE_NONE = 0
MAX_THREADS = 512  # GGML_MAX_N_THREADS
_EXTRA = "pip install 'moe-replay[capture]'"


def _missing_extra(command: str, module: str) -> UserError:
    return UserError(f"{command} needs the capture extra, which is not installed (no module {module!r}): run {_EXTRA} "
                     "(it builds llama.cpp from source, about 8 minutes on 2 cores).")


def import_llama_cpp(command: str = "capture") -> Any:
    try:
        import llama_cpp
    except ImportError:
        raise _missing_extra(command, "llama_cpp") from None
    except (OSError, RuntimeError) as e:  # the package is there but its shared library does not load
        raise UserError(f"{command}: llama-cpp-python is installed but its llama.cpp library does not load "
                        f"({str(e)[:160]}); reinstall it with {_EXTRA}.") from None
    return llama_cpp


def import_gguf(command: str = "capture") -> Any:
    try:
        import gguf
    except ImportError:
        raise _missing_extra(command, "gguf") from None
    return gguf


def require_capture_extra(command: str, llama: bool = True) -> None:
    """Refuse at once, before any file is looked at, when the capture extra is missing: the
    command names the extra to install instead of failing later on an import deep inside."""
    import_gguf(command)
    if llama:
        import_llama_cpp(command)


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


# KV cache types a capture may ask for (llama.cpp's -ctk/-ctv; f16 is its default) and flash
# attention modes (-fa). On CPU, llama.cpp's default (f16 cache, flash attention on where it can)
# rounds attention through f16: float32 weights then differ from a float32 engine by ~1e-3
# relative; f32 + off computes attention in float32 (what a cross-engine check of float32 weights wants).
KV_TYPES = ("f16", "f32", "bf16", "q8_0")
FLASH_ATTN = ("auto", "on", "off")


@dataclass
class EngineOptions:
    n_ctx: int
    ubatch: int
    threads: int | None = None
    n_expert_used: int | None = None
    arch: str = ""
    verbose: bool = False
    kv_type: str = "f16"
    flash_attn: str = "auto"


def _log_sink(lc: Any, verbose: bool) -> _LogSink:
    global _SINK
    if _SINK is None:
        _SINK = _LogSink(lc, verbose)
    _SINK.echo = verbose
    return _SINK


def _tokenize(lc: Any, vocab: Any, text: str) -> list[int]:
    raw = text.encode("utf-8")
    cap = len(raw) + 16
    buf = (lc.llama_token * cap)()
    n = lc.llama_tokenize(vocab, raw, len(raw), buf, cap, True, False)
    if n < 0:
        cap = -n
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(vocab, raw, len(raw), buf, cap, True, False)
    return list(buf[:n])


MAX_PROMPT_BYTES = 2**31 - 64  # llama_tokenize takes the text length as int32


class Vocab:
    """The model's vocabulary, loaded without weights (``vocab_only``): enough to tokenize the
    prompt before any context or output exists. An architecture llama.cpp does not know fails here,
    with its own last log line. (A vocab-only model reports no hyperparameters: its
    ``llama_model_n_ctx_train`` is 0, so the training context comes from the GGUF key.)"""

    def __init__(self, model_path: str, verbose: bool = False) -> None:
        lc = import_llama_cpp()
        self.lc = lc
        self.sink = _log_sink(lc, verbose)
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        mp.vocab_only = True
        self.model = lc.llama_model_load_from_file(str(model_path).encode(), mp)
        if not self.model:
            raise UserError(f"{model_path}: llama.cpp could not load the model ({self.sink.last_error()}).")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.type = int(lc.llama_vocab_type(self.vocab))
        self.n_vocab = int(lc.llama_vocab_n_tokens(self.vocab))

    @property
    def has_tokenizer(self) -> bool:
        """False for a GGUF whose tokenizer.ggml.model is "none": llama.cpp asserts on tokenizing."""
        return self.type != LLAMA_VOCAB_TYPE_NONE and self.n_vocab > 0

    def tokenize(self, text: str) -> list[int]:
        if not self.has_tokenizer:
            raise RuntimeError("the model has no tokenizer")
        return _tokenize(self.lc, self.vocab, text)

    def close(self) -> None:
        if getattr(self, "model", None):
            self.lc.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> Vocab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Engine:
    """A loaded model and a context whose eval callback is ``callback`` (kept referenced here).

    ``opts.n_ctx`` must cover every position the run will decode and ``opts.ubatch`` the largest
    batch it will pass to :meth:`decode` (the capture plans both from the tokenized prompt); the
    context's own n_batch / n_ubatch are read back and :meth:`decode` refuses, as a Python error,
    any batch llama.cpp would abort on."""

    def __init__(self, model_path: str, opts: EngineOptions, callback: Any | None, callback_user_data: int | None = None) -> None:
        lc = import_llama_cpp()
        self.lc = lc
        self.sink = _log_sink(lc, opts.verbose)
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
        kv = getattr(lc, f"GGML_TYPE_{opts.kv_type.upper()}")
        cp.type_k = cp.type_v = kv
        cp.flash_attn_type = {"auto": lc.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                              "off": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED}[opts.flash_attn]
        self.callback = callback
        if callback is not None:
            cp.cb_eval = callback
            # the native ask phase's state (MoeHook.user_data, which its callback also carries)
            cp.cb_eval_user_data = callback_user_data if callback_user_data is not None else getattr(callback, "user_data", None)
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise UserError(f"{model_path}: llama.cpp could not create a context ({self.sink.last_error()}).")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = int(lc.llama_model_n_ctx_train(self.model))
        self.ubatch = opts.ubatch
        self._batch = lc.llama_batch_init(opts.ubatch, 0, 1)
        self.threads = int(cp.n_threads)
        # What the context really took (llama.cpp clamps n_batch to n_ctx and n_ubatch to n_batch).
        self.n_ctx = int(lc.llama_n_ctx(self.ctx))
        self.n_batch = int(lc.llama_n_batch(self.ctx))
        self.n_ubatch = int(lc.llama_n_ubatch(self.ctx))

    def tokenize(self, text: str) -> list[int]:
        if int(self.lc.llama_vocab_type(self.vocab)) == LLAMA_VOCAB_TYPE_NONE:
            raise RuntimeError("the model has no tokenizer")
        return _tokenize(self.lc, self.vocab, text)

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
        # Each of these would be a GGML_ASSERT (process abort) or a silent misuse inside llama.cpp.
        if not 1 <= n <= min(self.ubatch, self.n_batch, self.n_ubatch):
            raise RuntimeError(f"a batch of {n} tokens does not fit the context (ubatch {self.ubatch}, n_batch "
                               f"{self.n_batch}, n_ubatch {self.n_ubatch})")
        if pos0 < 0 or pos0 + n > self.n_ctx:
            raise RuntimeError(f"positions {pos0}..{pos0 + n - 1} lie outside the context of {self.n_ctx}")
        bad = [t for t in tokens if not 0 <= t < self.n_vocab]
        if bad:
            raise RuntimeError(f"token id {bad[0]} is outside the vocabulary of {self.n_vocab}")
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
