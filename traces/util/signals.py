"""SIGINT and SIGTERM handled for the length of a block: one installer for every command that
must clean up or stop between steps (the CLI's verbs raise, the capture loop sets a flag)."""

from __future__ import annotations

import contextlib
import os
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


def install(handler: Callable[[int, Any], Any], signals: tuple[int, ...] = STOP_SIGNALS) -> None:
    """``signals`` call ``handler(signum, frame)`` from now on (not restored: the ``moe-replay``
    process's own handler from its first import to its end, replay.runner.exit_on_signals). A no-op
    outside the main thread."""
    for s in signals:
        with contextlib.suppress(ValueError, OSError):  # not the main thread
            signal.signal(s, handler)


def hold(signals: tuple[int, ...] = STOP_SIGNALS) -> None:
    """Ignore ``signals`` from now on, process-wide (a signal sent to the process may be delivered
    to any of its threads, so a per-thread mask would not do). For the end of a command: Python's
    finalization puts the default action back for every signal that has a Python handler (not for
    an ignored one), so a signal then would kill the process with no message and no status of the
    tool's."""
    install(signal.SIG_IGN, signals)


def ignore_interrupts() -> None:
    """SIGINT ignored from now on in this process (a pool worker's initializer: Ctrl-C is the
    driver's to handle; it stops the pool). A no-op outside the main thread."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass


def exit_with_parent(conn: Any) -> None:
    """End this process (a pool worker) as soon as its parent dies, however it dies (SIGKILL too).

    ``conn`` is the read end of a pipe whose write end only the parent holds (a
    ``multiprocessing`` Connection passed to the worker at its start). A daemon thread blocks
    reading it; the kernel closes the write end when the parent exits, the read returns end of
    file and the worker exits at once. Chosen over ``prctl(PR_SET_PDEATHSIG)``: a forkserver's
    workers are children of the forkserver, not of the sweep, and the forkserver itself lives as
    long as any worker does (each holds its liveness pipe), so a parent-death signal would never
    fire; the pipe names the process that matters, needs no polling and works on every POSIX
    system. A worker stuck in compiled code that holds the GIL exits when that code returns."""
    def watch() -> None:
        try:
            while True:
                conn.recv_bytes()  # the parent never sends: this returns only at end of file
        except (EOFError, OSError):
            pass
        os._exit(1)

    threading.Thread(target=watch, name="moe-replay parent watch", daemon=True).start()
