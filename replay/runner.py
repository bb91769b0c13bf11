"""Running one command: exit codes, signals and one-sentence errors, with no typer import.

The command line (:mod:`replay.cli`) runs every command through :func:`guarded`, so a refusal,
an interruption or a bug reads the same in every verb.
Exit codes: 0 done, 1 a check ran and failed, 2 bad input or an OS error, 3 a bug, 128 + N killed
by signal N (130 SIGINT, 143 SIGTERM, 129 SIGHUP).

The ``moe-replay`` process handles these signals from its first import of :mod:`replay.cli` to its
exit (:func:`exit_on_signals`): while a command runs, :func:`guarded`'s handler unwinds it
(staging removed); before it starts (Python still importing) and as it ends (its output written)
the process ends at once with the same one-line message and 128 + N; once :func:`replay.cli.main`
has its status, signals are ignored (:func:`hold_signals`) and the process exits with that status.
Never the signal's default action (no message, no status of ours).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
from collections.abc import Callable

from traces.format.errors import UserError
from traces.util.signals import STOP_SIGNALS, hold, install, on_signals, stop_requested

#: The signals a command turns into its own message and 128 + N: Ctrl-C, kill, a closed terminal.
CLI_SIGNALS = (*STOP_SIGNALS, signal.SIGHUP)


class Interrupted(BaseException):
    """SIGINT or SIGTERM turned into an exception, so every ``finally`` and staging cleanup runs
    (a BaseException: no ``except Exception`` swallows it, and typer does not turn it into a
    returned exit code as it does a KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)

#: The signal the handler last turned into :class:`Interrupted` in this command (0: none). Kept
#: because the exception can be lost: a handler runs between any two bytecodes, and one that runs
#: inside a ctypes callback (llvmlite's object-cache hook, while Numba compiles) has its exception
#: printed and ignored by ctypes, so the command would go on, exit 0, or fail on the half-built
#: kernel; :func:`guarded` checks this once the command returns or fails.
_caught: list[int] = [0]


def _quiet_unraisable(u: object) -> None:
    """``sys.unraisablehook`` while a command runs: an :class:`Interrupted` that ctypes could not
    raise (see :data:`_caught`) is not printed as a traceback (the command ends in the interrupt's
    one line); anything else goes to Python's own hook."""
    if isinstance(getattr(u, "exc_value", None), Interrupted):
        return
    sys.__unraisablehook__(u)


def _raise_interrupted(signum: int, frame: object) -> None:
    stop_requested.set()  # threads waiting on a plugin's kernel stop waiting (traces.util.signals)
    _caught[0] = int(signum)
    raise Interrupted(signum)

def _interrupted(signum: int) -> int:
    """Say in one line what an interrupted run left behind; return 128 + the signal number."""
    # as the module is now, if at all: the handler of exit_on_signals may run while Python is still
    # importing it (never imported: nothing was written)
    atomic = sys.modules.get("traces.io.atomic")
    written, abandoned = getattr(atomic, "written", []), getattr(atomic, "abandoned", [])
    name = signal.Signals(signum).name
    if written:
        done = ", ".join(str(p) for p in written)
        msg = f"interrupted by {name} after writing {done}; nothing else was written"
    elif abandoned:
        msg = f"interrupted by {name}; nothing was written to {', '.join(str(p) for p in abandoned)}"
    else:
        msg = f"interrupted by {name}; nothing was written"
    print(f"moe-replay: {msg}", file=sys.stderr)
    return 128 + signum

def is_command_process() -> bool:
    """This process is the ``moe-replay`` command (the console script or ``python -m replay.cli``),
    not a library user or a test runner that imported :mod:`replay.cli`."""
    if os.path.basename(sys.argv[0] if sys.argv else "") == "moe-replay":
        return True
    orig = getattr(sys, "orig_argv", [])
    return any(a == "-m" and b == "replay.cli" for a, b in zip(orig, orig[1:]))


def _exit_now(signum: int, frame: object) -> None:
    """A signal outside a command's own handling (Python importing, or the command done and the
    process exiting): its output flushed, the one-line message, exit 128 + N at once (nothing is
    staged then: :func:`guarded` has either not started or finished every cleanup)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    code = _interrupted(signum)
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os._exit(code)


def exit_on_signals() -> None:
    """Install :func:`_exit_now` for :data:`CLI_SIGNALS`: the first thing the command does, before
    its imports (``guarded`` installs its own over it for the command and puts it back after)."""
    install(_exit_now, CLI_SIGNALS)


def hold_signals() -> None:
    """The command is over (its output written, its status decided): from here on a signal is
    ignored and the process exits with the command's own status. Python's finalization, which follows,
    puts the default actions back, and a signal then would kill the process with no message."""
    hold(CLI_SIGNALS)


#: OS errors that say something about the machine (disk, permissions, limits), not about the code.
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO,
                       errno.EMFILE, errno.ENFILE, errno.EFBIG, errno.ENAMETOOLONG, errno.ELOOP}

def _os_error_sentence(e: OSError) -> str | None:
    """One sentence for an OS error a user can act on (it names a path, or the disk or permissions
    are at fault); None for anything else, which stays a bug."""
    reason = (e.strerror or e.__class__.__name__).rstrip(".")
    if e.filename is not None:
        other = f" -> {e.filename2}" if e.filename2 is not None else ""
        return f"{e.filename}{other}: {reason[:1].lower()}{reason[1:]}."
    if e.errno in _ENVIRONMENT_ERRNOS:
        return f"{reason} (errno {errno.errorcode.get(e.errno, e.errno)})."
    return None

def _bug(e: Exception, debug: bool) -> int:
    """A genuine bug: say so in one line (``--debug`` re-raises for the traceback)."""
    if debug:
        raise e
    print(f"moe-replay: internal error: {e.__class__.__name__}: {e} (rerun with --debug for the traceback; "
          "this is a bug, please report it)", file=sys.stderr)
    return 3


def guarded(call: Callable[[], int], debug: bool,
            usage_error: Callable[[Exception, bool], int | None] | None = None) -> int:
    """Run ``call`` (which returns an exit code) with SIGINT/SIGTERM turned into :class:`Interrupted`
    and the compile notice on stderr whenever kernels compile (``--json`` included: the notice is
    never in a command's output); return its exit code, or
    the code of what it raised, said in one sentence on stderr (``debug``: re-raised for the
    traceback). ``usage_error`` turns a front end's own exceptions into a code (None: not one of them)."""
    from replay.core.progress import compile_notice

    stop_requested.clear()
    _caught[0] = 0
    hook, sys.unraisablehook = sys.unraisablehook, _quiet_unraisable
    try:
        # The first run after installation compiles the kernels (minutes under load): say so on stderr,
        # terminal or not (under make, piped, --json: a silent run looks hung); later runs load them and print nothing.
        with on_signals(_raise_interrupted, CLI_SIGNALS), compile_notice():
            code = call()
            if _caught[0]:  # the handler's exception was swallowed on the way (see _caught)
                raise Interrupted(_caught[0])
            return code
    except UserError as e:
        if debug:
            raise
        if _caught[0]:  # refused after an interrupt whose exception was swallowed: the interrupt is what happened
            return _interrupted(_caught[0])
        print(f"moe-replay: error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Interrupted) as e:
        if debug:
            import traceback

            traceback.print_exc()
        return _interrupted(e.signum if isinstance(e, Interrupted) else signal.SIGINT)
    except SystemExit:
        raise
    except Exception as e:
        if _caught[0] and not debug:  # failed after an interrupt whose exception was swallowed (a kernel half built)
            return _interrupted(_caught[0])
        code = usage_error(e, debug) if usage_error is not None else None
        if code is not None:
            return code
        if isinstance(e, OSError):  # a full disk, a missing folder, a read-only mount: the machine, not the tool
            sentence = _os_error_sentence(e)
            if debug or sentence is None:
                return _bug(e, debug)
            print(f"moe-replay: error: {sentence}", file=sys.stderr)
            return 2
        return _bug(e, debug)
    finally:
        sys.unraisablehook = hook
