"""Terminal feedback while a command works: progress bars and the first-run compile notice (on
stderr, only on a terminal; never part of a command's output)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from tqdm import tqdm

class _Silent:
    """What :func:`progress` returns when no bar is shown: counts, prints nothing, and spares the
    run importing tqdm (piped and ``--json`` runs never show a bar)."""

    disable = True

    def __init__(self, total: int | None) -> None:
        self.total = total
        self.n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        pass

    def reset(self, total: int | None = None) -> None:
        self.n = 0
        self.total = total

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        pass

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def progress(total: int | None, desc: str, unit: str = "it", enabled: bool = True) -> tqdm | _Silent:
    """A progress bar on a terminal; silent when stderr is piped or redirected, or not ``enabled``."""
    if not (enabled and sys.stderr.isatty()):
        return _Silent(total)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=False, leave=False, dynamic_ncols=True)


COMPILE_NOTICE = "compiling replay kernels (once per installation; later runs load them from the cache) ..."


@contextmanager
def compile_notice(stream: TextIO | None = None) -> Iterator[None]:
    """While active, the first time Numba actually *compiles* a function (its ``numba:compile``
    event, which fires only on a cache miss: a kernel loaded from Numba's on-disk cache raises no
    event), print :data:`COMPILE_NOTICE` once to ``stream`` (default stderr), and only when that
    stream is a terminal: nothing in pipes, files or notebooks. The CLI wraps every command in it
    (``--json`` commands excepted), so every kernel getter (the cache drivers of
    :func:`replay.cache.kernel_for`, the predictor and scoring kernels) is covered in one place."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if not (isatty and isatty()):
        yield
        return
    from traces.jit import on_resolve, remove_on_resolve

    class _Notice:
        said = False
        listener = None

        def install(self) -> None:  # once Numba is in use (traces.jit): a compiled-extension run never imports it
            from numba.core import event

            class _Listener(event.Listener):
                def on_start(inner, ev: event.Event) -> None:  # noqa: N805
                    if not self.said:
                        self.said = True
                        print(COMPILE_NOTICE, file=stream, flush=True)

                def on_end(inner, ev: event.Event) -> None:  # noqa: N805
                    pass

            self.listener = _Listener()
            event.register("numba:compile", self.listener)

    notice = _Notice()
    if "numba" in sys.modules:  # already in use (imported here or directly): listen now
        notice.install()
    else:
        on_resolve(notice.install)  # when traces.jit first imports it (never, if the compiled extension runs everything)
    try:
        yield
    finally:
        remove_on_resolve(notice.install)
        if notice.listener is not None:
            from numba.core import event

            event.unregister("numba:compile", notice.listener)
