"""Atomic writes: a reader (or a crash) never sees a half-written file or output directory.

The guarantees every writing command inherits from here (README "Guarantees"):

- A destination is replaced in one rename (a directory by ``renameat2(RENAME_EXCHANGE)`` where the
  file system has it): it holds the old content or the new, never a mix and never nothing.
- The one output guard (:func:`check_not_input`, called by :func:`check_output_file`,
  :func:`check_output_dir`, :func:`write_output_bytes` and :func:`staged_dir`, before anything is
  written and again at the rename): a destination that is, contains or lies inside any path the
  command reads is refused, with or without ``--force`` (paths resolved, symlinks followed). The
  paths are those the caller passes plus those the readers noted while the command ran
  (:func:`note_input`: traces, plugin files, cost models, sizes, quality results, grids), so an
  input a caller forgot to list, or one read only during the work, is still protected.
- A destination that exists and is not a regular file or a directory (a device, a FIFO, a socket,
  or a symbolic link to one) is refused: replacing ``/dev/null`` or a pipe a reader waits on with a
  regular file is never what was meant.
- Two writers to one destination: the check "is it as it was?" is repeated at the rename under a
  lock on the parent directory, so the second refuses (a directory: unless ``--force``; a single
  file: always, since it was changed by someone else since this command looked) instead of
  silently replacing the first.
- On any exception (including an interrupt) the staging directory is removed; one left by a killed
  process (its PID is no longer alive) is removed by the next write to the same destination.
- An OS error while writing names the destination and the OS's reason (a :class:`UserError`).

Written here on purpose: the atomic-write libraries replace one file; none swaps a whole directory
in one rename or refuses a destination that overlaps an input.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import shutil
import signal
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from traces.format.errors import UserError

#: Destinations this process finished writing, and those whose staging was removed by an
#: exception; the CLI reads them to say truthfully what an interrupted run left behind.
written: list[Path] = []
abandoned: list[Path] = []

#: The paths the running command reads, noted by the readers while ``main()`` runs one command
#: (:func:`command_scope`); None outside a command, so library calls note nothing and a notebook
#: may rewrite a trace it opened earlier.
_noted: list[Path] | None = None
#: Each single-file output's state when this command first checked it (:func:`_identity`, None if
#: absent): at the rename it must still be so, or another writer got there first.
_claims: dict[Path, tuple[int, ...] | None] = {}

_RENAME_NOREPLACE, _RENAME_EXCHANGE, _AT_FDCWD = 1, 2, -100


@contextlib.contextmanager
def command_scope() -> Iterator[None]:
    """One command's bookkeeping: what it wrote or abandoned, the inputs its readers note, the
    single-file outputs it claimed. Inputs are noted only inside this scope."""
    global _noted
    written.clear()
    abandoned.clear()
    _claims.clear()
    _noted = []
    try:
        yield
    finally:
        _noted = None
        _claims.clear()


def note_input(*paths: str | os.PathLike[str] | None) -> None:
    """Record paths the running command reads (a reader calls this as it opens one), so that no
    output of the same command may replace, delete or write into them. A no-op outside a command."""
    if _noted is None:
        return
    for p in paths:
        if p is not None:
            a = Path(os.path.abspath(p))
            if a not in _noted:
                _noted.append(a)


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """``renameat2(src, dst, flags)``; False where the C library or the file system lacks it."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def _absolute(path: str | os.PathLike[str]) -> Path:
    """``path`` made absolute with its parent resolved (symlinks followed) but its own name kept,
    so a symlink destination is replaced as a link, as ``os.replace`` does."""
    p = Path(os.path.abspath(path))
    return p.parent.resolve() / p.name if p.name else p


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def sweep_stale(dest: Path) -> None:
    """Remove staging leftovers of ``dest`` (``.NAME.partial-PID``, ``.NAME.old-PID``,
    ``.NAME.tmp-PID``) whose process is gone: a writer killed with SIGKILL cannot clean up."""
    pattern = re.compile(rf"\.{re.escape(dest.name)}\.(?:partial|old|tmp)-(\d+)")
    try:
        entries = list(dest.parent.iterdir())
    except OSError:
        return
    for e in entries:
        m = pattern.fullmatch(e.name)
        if m is None or int(m.group(1)) == os.getpid() or _pid_alive(int(m.group(1))):
            continue
        if e.is_dir() and not e.is_symlink():
            shutil.rmtree(e, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                e.unlink()


def check_not_input(dest: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str] | None] = ()) -> None:
    """The one output guard: refuse a destination that is, contains or lies inside an input --
    replacing it (or writing into it) would change or delete what the command reads. The inputs are
    ``inputs`` and every path noted by a reader during this command (:func:`note_input`). Paths are
    resolved, symlinks followed."""
    d = Path(dest).resolve()
    for inp in [*inputs, *(_noted or ())]:
        if inp is None:
            continue
        i = Path(inp).resolve()
        same = d == i or (d.exists() and i.exists() and os.path.samefile(d, i))
        if same or i in d.parents or d in i.parents:
            how = "is" if same else ("lies inside" if i in d.parents else "contains")
            raise UserError(f"{dest}: the destination {how} the input {inp}; choose another destination "
                            "(--force never replaces or writes into an input).")


_SPECIAL = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
            (stat.S_ISSOCK, "a socket"))


def check_not_special(dest: str | os.PathLike[str]) -> None:
    """Refuse a destination that exists and is neither a regular file nor a directory (a device, a
    FIFO, a socket, or a symbolic link to one): an atomic write would replace it with a regular file
    (as root, ``--csv /dev/null`` would replace /dev/null). A dangling symbolic link is replaced as
    a link, like a regular file."""
    out = Path(dest)
    try:
        st = os.stat(out)  # follows symbolic links: a link to a device is refused like the device
    except FileNotFoundError:
        return
    except OSError as e:
        raise UserError(f"{out}: cannot examine it ({e.strerror}); choose another destination.") from None
    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
        return
    kind = next((name for test, name in _SPECIAL if test(st.st_mode)), "a special file")
    via = " through a symbolic link" if out.is_symlink() else ""
    raise UserError(f"{out}: is {kind}{via}, not a regular file or directory; moe-replay writes only regular files "
                    "and directories, choose another destination.")


def _identity(p: Path) -> tuple[int, ...] | None:
    """What is at ``p`` now (the name itself, a link not followed): None if nothing; a rename
    always brings a new inode, so any commit by another writer changes it."""
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns, st.st_mtime_ns, st.st_size)


def _probe_writable(where: Path, what: Path) -> None:
    """Create and remove a scratch entry in ``where``: ``os.access`` says yes to root on a
    read-only mount or a pseudo file system, and a command must not fail after its work."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".moe-replay-probe-", dir=where))
    except OSError as e:
        raise UserError(f"{what}: cannot write in {where} ({e.strerror}).") from None


def check_output_file(path: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str] | None] = ()) -> Path:
    """Refuse an output file (``--csv FILE``, an export) that cannot be written, is an input, or is
    not a regular file (:func:`check_not_special`). Called before any work so a bad option costs
    nothing; the destination's state is remembered, so a concurrent writer is detected at the write."""
    out = Path(path)
    check_not_input(out, inputs)
    check_not_special(out)
    if out.is_dir():
        raise UserError(f"{out}: is a directory, not a file.")
    dest = _absolute(out)
    if not dest.parent.is_dir():
        raise UserError(f"{out}: the folder {dest.parent} does not exist.")
    _probe_writable(dest.parent, out)
    # The first check of this command claims the destination as it is now; the write refuses if
    # another writer changed it in between (:func:`write_output_bytes`).
    _claims.setdefault(dest, _identity(dest))
    return out


def check_output_dir(out_dir: str | os.PathLike[str], force: bool,
                     inputs: Iterable[str | os.PathLike[str] | None] = ()) -> Path:
    """Refuse an output directory that exists and is not empty (unless ``force``), that is, holds
    or lies inside an input, or that cannot be created. Called before any work."""
    out = Path(out_dir)
    check_not_input(out, inputs)
    check_not_special(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: output path exists and is not a directory.")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"{out}: output directory exists and is not empty (pass --force to replace it).")
    parent = _absolute(out).parent
    if not parent.is_dir():
        raise UserError(f"{out}: the parent directory {parent} does not exist.")
    _probe_writable(parent, out)
    return out


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary sibling and a rename. An OS error is
    re-raised naming ``path`` (not the temporary file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from e
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def staged_file(path: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str] | None] = ()) -> Iterator[Path]:
    """Yield a hidden temporary sibling of the user-named output file ``path`` (``--csv``, an
    export, a GGUF) to write; on success it replaces ``path`` in one rename, on any exception it is
    removed. Refused before the block if ``path`` is an input or a special file
    (:func:`check_output_file`), and at the rename (under the parent directory's lock) if it has
    become one or if another writer changed ``path`` since this command first checked it. An OS
    error writing it becomes one sentence naming ``path``."""
    inputs = list(inputs)
    out = check_output_file(path, inputs)
    dest = _absolute(out)
    claimed = _claims.get(dest)
    sweep_stale(dest)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    try:
        yield tmp
        with _signals_blocked(), _dir_lock(dest.parent):
            check_not_input(out, inputs)  # again: with the inputs the readers noted during the work
            check_not_special(out)
            if _identity(dest) != claimed:
                raise UserError(f"{out}: another writer {'created' if claimed is None else 'changed'} it while this "
                                "command ran; nothing was written (its content is the other writer's).")
            os.replace(tmp, dest)
            written.append(out)
    except OSError as e:
        where = None if e.filename is None else _absolute(os.fsdecode(e.filename))
        if where is None or where in (tmp, dest, dest.parent):
            raise UserError(f"{out}: cannot write it ({e.strerror}); it was left unchanged.") from None
        raise
    finally:
        _claims.pop(dest, None)
        with contextlib.suppress(OSError):
            tmp.unlink()


def write_output_bytes(path: str | os.PathLike[str], data: bytes,
                       inputs: Iterable[str | os.PathLike[str] | None] = ()) -> Path:
    """Write ``data`` to the user-named output file ``path`` through :func:`staged_file` (the guard,
    the temporary sibling, the checked rename); returns ``path``."""
    with staged_file(path, inputs) as tmp, open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return Path(path)


def write_output_file(path: str | os.PathLike[str], text: str,
                      inputs: Iterable[str | os.PathLike[str] | None] = ()) -> Path:
    """:func:`write_output_bytes` of ``text`` in UTF-8."""
    return write_output_bytes(path, text.encode("utf-8"), inputs)


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP during a commit, so "written" and "nothing was written" stay true."""
    sigs = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    except (ValueError, OSError, AttributeError):
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def _dir_lock(parent: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the destination's parent directory: writers of this tool commit
    one at a time, so the existence check and the rename cannot interleave. No lock file is left."""
    fd = os.open(parent, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:  # a file system without locks (some network mounts): the re-check still runs
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _remove(p: Path) -> None:
    if p.is_symlink() or not p.is_dir():
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    else:
        shutil.rmtree(p, ignore_errors=True)


def _commit(stage: Path, dest: Path, out: Path, force: bool) -> None:
    """Put ``stage`` at ``dest``, checking again (under the lock) what is there now."""
    if not os.path.lexists(dest):
        if not _renameat2(stage, dest, _RENAME_NOREPLACE):
            os.rename(stage, dest)
        return
    if not dest.is_dir():
        raise UserError(f"{out}: a file appeared there while this command ran; nothing was written.")
    if any(dest.iterdir()) and not force:
        raise UserError(f"{out}: another writer created it while this command ran; nothing was written "
                        "(pass --force to replace it).")
    if _renameat2(stage, dest, _RENAME_EXCHANGE):  # one atomic swap; stage now holds the old content
        _remove(stage)
        return
    old = dest.parent / f".{dest.name}.old-{os.getpid()}"
    os.replace(dest, old)
    try:
        os.replace(stage, dest)
    except BaseException:
        os.replace(old, dest)  # put the old content back: a failed replace changes nothing
        raise
    _remove(old)


@contextlib.contextmanager
def staged_dir(out_dir: str | os.PathLike[str], force: bool = False,
               inputs: Iterable[str | os.PathLike[str] | None] = ()) -> Iterator[Path]:
    """Yield a hidden staging directory beside ``out_dir``; on success it replaces ``out_dir``
    in one rename, on any exception (an interrupt too) it is removed, so no half-written output
    is left behind. ``inputs``: the paths the command reads, which ``out_dir`` must not touch."""
    inputs = list(inputs)
    out = check_output_dir(out_dir, force, inputs)
    dest = _absolute(out)
    sweep_stale(dest)
    stage = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    # Counted as abandoned from before the stage exists until the commit: an interrupt that lands
    # anywhere in between (as mkdir returns, or after the yield but before the caller's block
    # starts, where only the generator's finalisation removes the stage) still names the output.
    abandoned.append(out)
    try:
        if stage.exists():
            shutil.rmtree(stage)
        stage.mkdir()
    except OSError as e:
        abandoned.remove(out)
        raise UserError(f"{out}: cannot create the staging directory {stage} ({e.strerror}).") from None
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    try:
        yield stage
        with _signals_blocked(), _dir_lock(dest.parent):
            check_not_input(out, inputs)  # again: with the inputs the readers noted during the work
            check_not_special(out)
            _commit(stage, dest, out, force)
            abandoned.remove(out)
            written.append(out)
    except BaseException as e:
        shutil.rmtree(stage, ignore_errors=True)
        if isinstance(e, OSError) and e.filename is not None:
            where = _absolute(os.fsdecode(e.filename))
            if where == stage or stage in where.parents or where == dest:
                rel = "" if where in (stage, dest) else f" {where.relative_to(stage)}"
                raise UserError(f"{out}: cannot write{rel} ({e.strerror}); nothing was written.") from None
        raise
