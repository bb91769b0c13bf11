"""SIGINT and SIGTERM handled for the length of a block: one installer for every command that
must clean up or stop between steps (the CLI's verbs raise, the capture loop sets a flag)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

# Set by the CLI's SIGINT/SIGTERM handler (replay.runner): a thread that waits on work a signal
# cannot stop (a plugin's compiled kernel on its own thread, replay.core.simulate.run_kernel) gives
# up waiting when it is set, so the main thread's unwinding (a thread pool's shutdown joins its
# workers) is not held up by a kernel that never returns. Cleared when a command starts.
stop_requested = threading.Event()


class Abandoned(BaseException):
    """A wait given up because a stop was requested (the main thread says what was interrupted)."""


@contextlib.contextmanager
def on_signals(handler: Callable[[int, Any], Any], signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[None]:
    """While the block runs, ``signals`` call ``handler(signum, frame)``; the previous handlers are
    restored after. Outside the main thread Python allows no handler: nothing is installed (the
    block runs, uninterruptible by these signals, as before)."""
    old = {}
    for s in signals:
        try:
            old[s] = signal.signal(s, handler)
        except ValueError:  # not the main thread
            pass
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def ignore_interrupts() -> None:
    """SIGINT ignored from now on in this process (a pool worker's initializer: Ctrl-C is the
    driver's to handle; it stops the pool). A no-op outside the main thread."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass
