"""Loading policy and predictor modules: built-ins, files on disk and entry points, one path.

Every module — a built-in named in a registry, a file given with ``policy_file=`` /
``predictor_file=`` (``--policy-file`` / ``--predictor-file``), or an entry point of the groups
``moe_replay.policies`` / ``moe_replay.predictors`` — is imported by :func:`load` and checked by
the registry's own validator before use. A problem (the file is missing, it fails to import, a
hook or constant is missing) is one :class:`~traces.format.errors.UserError` naming the file.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from replay.plugin_spec import SPECS
from replay.plugin_spec import check as check_contract
from traces.format.errors import UserError


def where(mod: ModuleType) -> str:
    """The file a module came from (or its dotted name), for messages."""
    return getattr(mod, "__file__", None) or mod.__name__


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_HEADER = re.compile(r"^(Failed in \w+ mode pipeline|During:|Internal error at|There are \d+ candidate|Enable logging)")
_NAME = re.compile(r"(?:NameError: name|Untyped global name) '([^']+)'")


def numba_error(e: BaseException, path: str) -> tuple[int | None, str]:
    """What a Numba compile error says, for a plugin at ``path``, reduced to (line, what): the
    underlying error (NameError, a typing failure with its signature), not Numba's "Failed in
    nopython mode pipeline" header; the line from the location Numba names in ``path``, else (a
    name that is not defined: Numba gives no location) the first line of ``path`` that uses it."""
    lines = [ln.strip() for ln in _ANSI.sub("", str(e)).splitlines()]
    body = [ln for ln in lines if ln and not _HEADER.match(ln)]
    what = body[0] if body else type(e).__name__
    if what.endswith(":"):  # "No implementation of function ... found for signature:" then ">>> setitem(...)"
        nxt = next((ln for ln in body[1:] if ln.startswith(">>>")), None)
        what = what + " " + nxt.removeprefix(">>>").strip() if nxt else what.rstrip(":")
    name = Path(path).name
    line = None
    for m in re.finditer(r'File "([^"]+)", line (\d+)|typing of .* at (\S+) \((\d+)\)', "\n".join(lines)):
        f, n = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        if Path(f).name == name:
            line = int(n)
            break
    m = _NAME.search(what)
    if line is None and m is not None and Path(path).is_file():
        word = re.compile(rf"(?<![\w.]){re.escape(m.group(1))}(?!\w)")
        for i, src in enumerate(Path(path).read_text(errors="replace").splitlines(), 1):
            if word.search(src.split("#")[0]):
                line = i
                break
    what = what if len(what) <= 240 else what[:237] + "..."
    return line, what.rstrip(".")


def load_file(path: str | Path, kind: str) -> ModuleType:
    """Import the Python file ``path`` as a module (its name derived from the file's resolved path
    and bytes, so two files never collide and an edited file is re-imported)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{p}: no such {kind} file.")
    if p.suffix != ".py":
        raise UserError(f"{p}: a {kind} file must be a Python module ending in .py.")
    p = p.resolve()
    data = p.read_bytes()
    name = f"moe_replay_plugin_{kind}_{p.stem}_{hashlib.sha1(str(p).encode() + data).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise UserError(f"{p}: cannot be imported as a Python module.")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except UserError:
        del sys.modules[name]
        raise
    except Exception as e:  # a plugin's own bug: one sentence naming the file
        del sys.modules[name]
        raise UserError(f"{p}: importing the {kind} module failed: {type(e).__name__}: {e}.") from e
    except (SystemExit, KeyboardInterrupt) as e:  # a plugin never ends the process nor sets its exit status
        del sys.modules[name]
        raise UserError(f"{p}: importing the {kind} module {_exit_words(e)}; a plugin may not end the process.") from None
    return mod


def _exit_words(e: BaseException) -> str:
    if isinstance(e, SystemExit):
        return f"called sys.exit({e.code!r})"
    return "raised KeyboardInterrupt"


def guard_exits(mod: ModuleType, kind: str) -> None:
    """Wrap every plain-Python function of the ``kind`` contract that ``mod`` defines so that a
    ``SystemExit`` or ``KeyboardInterrupt`` it raises becomes one sentence naming the file and the
    function: a plugin calling ``sys.exit(0)`` would otherwise end the run with exit 0 and no output,
    ``sys.exit(5)`` with the tool's exit status 5. (A real Ctrl-C or SIGTERM under the CLI arrives
    as :class:`replay.runner.Interrupted`, which passes through.) Compiled hooks cannot raise either."""
    import functools

    for name, s in SPECS[kind].items():
        fn = getattr(mod, name, None)
        if s.kind != "function" or not callable(fn) or getattr(fn, "_exits_guarded", False):
            continue

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            try:
                return _fn(*args, **kwargs)
            except (SystemExit, KeyboardInterrupt) as e:
                raise UserError(f"{where(mod)}: the {kind}'s {_name} {_exit_words(e)}; a plugin may not end the process.") from None

        functools.update_wrapper(wrapped, fn)
        wrapped._exits_guarded = True
        setattr(mod, name, wrapped)


def load(spec: str, kind: str) -> ModuleType:
    """A module by dotted name (built-ins, entry points) or by file path (ends in .py)."""
    if spec.endswith(".py") or "/" in spec:
        return load_file(spec, kind)
    try:
        return importlib.import_module(spec)
    except ImportError as e:
        raise UserError(f"{kind} module {spec}: cannot be imported ({e}).") from e


def entry_points(group: str) -> list[tuple[str, str]]:
    """(entry point name, module spec) of an entry-point group, sorted by name (deterministic)."""
    return sorted((ep.name, ep.value.split(":")[0]) for ep in importlib.metadata.entry_points(group=group))


class Registry:
    """One kind of plugin (policies, predictors): built-ins by name, then entry points, then files,
    each module checked by ``validate(module, name or None) -> name`` before it is usable.

    Built-ins and entry points are loaded on first use, not at import (``moe-replay --help`` lists
    the built-in names from ``builtins`` without compiling anything). A name taken twice by
    different modules is one sentence naming both files."""

    def __init__(self, kind: str, builtins: dict[str, str], group: str,
                 validate: Callable[[ModuleType, str | None], str]) -> None:
        self.kind = kind
        self.builtins = builtins  # name -> dotted module (the registry's own, typed once)
        self.group = group
        self.validate = validate
        self._modules: dict[str, ModuleType] = {}
        self._entry_points_of: dict | None = None  # the _modules its entry points were loaded into
        self.from_files: set[str] = set()  # names registered from a file (not a built-in or an entry point)

    def add(self, mod: ModuleType, name: str | None = None) -> str:
        n = self.validate(mod, name)
        check_contract(mod, self.kind, where(mod))  # the plugin contract: replay/plugin_spec.py
        old = self._modules.get(n)
        if old is not None and old is not mod:
            raise UserError(f"{where(mod)}: {self.kind} name {n!r} is already taken by {where(old)}.")
        if not mod.__name__.startswith("replay."):
            guard_exits(mod, self.kind)
        self._modules[n] = mod
        return n

    def ensure(self) -> None:
        """Load (once) every built-in, then every entry point of the group."""
        if all(n in self._modules for n in self.builtins):
            return
        for n, spec in self.builtins.items():
            if n not in self._modules:
                self.add(load(spec, self.kind), n)
        for _, spec in entry_points(self.group):
            self.add(load(spec, self.kind))

    def add_file(self, path: str | Path) -> str:
        """Register the module in file ``path`` (any directory); returns its name."""
        from traces.io.atomic import note_input

        note_input(path)  # an input of the command: no output of it may replace the plugin
        self.ensure()
        n = self.add(load(str(path), self.kind))
        if not self._modules[n].__name__.startswith("replay."):
            self.from_files.add(n)
        return n

    def names(self) -> tuple[str, ...]:
        """Every registered name: built-ins in registry order, then entry points and files."""
        self.ensure()
        return tuple(self.builtins) + tuple(n for n in self._modules if n not in self.builtins)

    def known(self, name: str) -> bool:
        """Whether ``name`` is registered, loading only what that needs: a built-in name loads
        its own module and the group's entry points (one of them may claim the same name), not
        every built-in (``cache --policies lru`` imports one policy module, not 16)."""
        if name in self.builtins:
            self.module(name)
            return True
        return name in self.names()

    def module(self, name: str) -> ModuleType:
        if name not in self._modules:
            if name in self.builtins:
                self._ensure_entry_points()  # an entry point naming a built-in is refused, as ensure() does
                if name not in self._modules:
                    self.add(load(self.builtins[name], self.kind), name)
            else:
                self.ensure()
        return self._modules[name]

    def _ensure_entry_points(self) -> None:
        """Load (once per set of modules) every entry point of the group; a name an entry point
        shares with a built-in loads that built-in first, so the clash is the same sentence."""
        if self._entry_points_of is self._modules:
            return
        for _, spec in entry_points(self.group):
            mod = load(spec, self.kind)
            n = getattr(mod, "NAME", None)
            if n in self.builtins and n not in self._modules:
                self.add(load(self.builtins[n], self.kind), n)
            self.add(mod)
        self._entry_points_of = self._modules

    def is_plugin(self, name: str) -> bool:
        """Whether ``name`` comes from outside this package (a file or an entry point)."""
        return not self.module(name).__name__.startswith("replay.")

    def reset(self) -> None:
        """Forget every loaded module (tests: a fresh registry, as a new process sees it)."""
        self._modules.clear()
        self.from_files.clear()
        self._entry_points_of = None


