"""``njit`` that imports Numba only when a kernel is first needed.

Importing Numba and loading its cached machine code costs about 0.4 s of a process's start-up,
which a verb that runs no kernel (``info``, ``--help``) need not pay. The modules on the replay's
path (the cache state, the driver, the built-in policies, the load cutter) decorate their kernels with this ``njit`` instead of
Numba's: defining them costs nothing, and Numba is imported the first time any of them is called,
compiled into another kernel (:func:`replay.core.driver.make_kernel`), or asked for an attribute
only a dispatcher has.

On that first need, :func:`resolve` imports Numba, wraps every function decorated so far with
``numba.njit(**options)`` in definition order (the same options, so the on-disk cache is the one
a plain ``@numba.njit(cache=True)`` would use), and replaces each stand-in in the globals of every
loaded module with its dispatcher, so a kernel Numba compiles later sees
dispatchers, not stand-ins, wherever it looks them up. A stand-in held somewhere else (a dict, a
user's plugin module loaded from a file) still works: Numba is taught to type one as its dispatcher.
After :func:`resolve`, ``njit`` returns real dispatchers at once.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

_pending: list[LazyJit] = []
_resolved = False
_lock = threading.RLock()
_on_resolve: list[Callable[[], None]] = []


class LazyJit:
    """A function decorated with :func:`njit` before Numba was imported: callable like the
    dispatcher it becomes (the first call imports Numba, see :func:`resolve`)."""

    def __init__(self, func: Callable[..., Any], options: dict[str, Any]) -> None:
        self.py_func = func
        self.options = options
        self.dispatcher: Any = None
        self.__name__ = func.__name__
        self.__qualname__ = func.__qualname__
        self.__module__ = func.__module__
        self.__doc__ = func.__doc__
        self.__wrapped__ = func

    def resolved(self) -> Any:
        """The Numba dispatcher (importing Numba and resolving every stand-in on first use)."""
        if self.dispatcher is None:
            resolve()
        return self.dispatcher

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return (self.dispatcher or self.resolved())(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # signatures, py_func's relatives, compile(), ...
        return getattr(self.resolved(), name)

    def __repr__(self) -> str:
        state = "compiled on first use" if self.dispatcher is None else "resolved"
        return f"<njit {self.__module__}.{self.__qualname__} ({state})>"


def njit(*args: Any, **options: Any) -> Any:
    """``numba.njit`` (same options), deferred until a kernel is first needed: ``@njit``,
    ``@njit(cache=True, ...)``. Positional signatures are not supported (none is used here)."""
    if args and callable(args[0]) and len(args) == 1 and not options:
        return _wrap(args[0], {})
    if args:
        raise TypeError("traces.util.jit.njit takes keyword options only (no explicit signatures)")
    return lambda func: _wrap(func, options)


def _wrap(func: Callable[..., Any], options: dict[str, Any]) -> Any:
    with _lock:
        if _resolved:
            import numba

            return numba.njit(**options)(func)
        lz = LazyJit(func, options)
        _pending.append(lz)
        return lz


def is_resolved() -> bool:
    """Whether Numba has been imported through :func:`resolve` (tests: a path that must not need it)."""
    return _resolved


def on_resolve(callback: Callable[[], None]) -> None:
    """Run ``callback`` right after Numba is first imported here (at once if it already was):
    e.g. :func:`replay.core.progress.compile_notice` installs its listener only when Numba is in use."""
    with _lock:
        if _resolved:
            callback()
        else:
            _on_resolve.append(callback)


def remove_on_resolve(callback: Callable[[], None]) -> None:
    with _lock:
        if callback in _on_resolve:
            _on_resolve.remove(callback)


def resolve() -> None:
    """Import Numba, turn every stand-in into its dispatcher and replace it in our modules' globals."""
    global _resolved
    with _lock:
        if _resolved:
            return
        import numba
        from numba.core import types
        from numba.extending import typeof_impl

        @typeof_impl.register(LazyJit)
        def _typeof_lazy(val: LazyJit, c: Any) -> Any:
            return types.Dispatcher(val.resolved())

        for lz in _pending:
            lz.dispatcher = numba.njit(**lz.options)(lz.py_func)
        _resolved = True
        _replace_in_modules()
        _pending.clear()
        callbacks = list(_on_resolve)
        _on_resolve.clear()
    for cb in callbacks:
        cb()


def _replace_in_modules() -> None:
    # Every loaded module, not only ours: a user's policy file imports our helpers (``evictable``)
    # into its own globals, and Numba inlines a hook only when the global it reads is a dispatcher.
    for mod in list(sys.modules.values()):
        try:
            d = vars(mod)
        except TypeError:
            continue
        for k, v in list(d.items()):
            if isinstance(v, LazyJit):
                d[k] = v.dispatcher


def dispatcher_of(func: Any) -> Any:
    """``func`` itself, or its dispatcher when it is a stand-in (resolving it)."""
    return func.resolved() if isinstance(func, LazyJit) else func


def is_jitted(func: Any) -> bool:
    """Whether ``func`` is a Numba kernel: a stand-in, or a dispatcher (checked without importing Numba)."""
    if isinstance(func, LazyJit):
        return True
    numba = sys.modules.get("numba")
    if numba is None:
        return False
    from numba.core.dispatcher import Dispatcher

    return isinstance(func, Dispatcher)
