"""Feedback while a command works: progress bars (on a terminal only) and the first-run compile
notice (one line on stderr, terminal or not; never part of a command's output)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from tqdm import tqdm

def progress(total: int | None, desc: str, unit: str = "it", enabled: bool = True) -> tqdm:
    """A progress bar on a terminal; tqdm's own disabled bar (it counts nothing, prints nothing)
    when stderr is piped or redirected, or not ``enabled``."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not (enabled and sys.stderr.isatty()), leave=False,
                dynamic_ncols=True)


COMPILE_NOTICE = "compiling replay kernels (once per installation; later runs load them from the cache) ..."


@contextmanager
def compile_notice(stream: TextIO | None = None) -> Iterator[None]:
    """While active, the first time Numba actually *compiles* a function (its ``numba:compile``
    event, which fires only on a cache miss: a kernel loaded from Numba's on-disk cache raises no
    event), print :data:`COMPILE_NOTICE` once to ``stream`` (default stderr), terminal or not: a
    first run under ``make`` or a script, its output piped, compiles for minutes too, and says why
    (it is one line on stderr, never in a command's output or its ``--json``). The CLI wraps every
    command in it, so every kernel getter (the cache drivers of
    :func:`replay.core.simulate.kernel_for`, the predictor and scoring kernels) is covered in one place."""
    stream = sys.stderr if stream is None else stream
    from traces.util.jit import on_resolve, remove_on_resolve

    class _Notice:
        said = False
        listener = None

        def install(self) -> None:  # once Numba is in use (traces.util.jit imports it when a kernel is first needed)
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
        on_resolve(notice.install)  # when traces.util.jit first imports it
    try:
        yield
    finally:
        remove_on_resolve(notice.install)
        if notice.listener is not None:
            from numba.core import event

            event.unregister("numba:compile", notice.listener)
