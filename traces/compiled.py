"""Loading the project's optional C extensions (``replay._aot``, ``traces._pq``): import, location,
staleness and the environment switch, in one place.

An extension is used only when it was built *here*, from the source beside it, and is not turned
off: a build found in another checkout (a shared venv's editable install) or older than its source
(a rebuild that failed left the previous one) would answer for code that is not the code in this
tree, so it is refused, with one sentence saying so.

``MOE_REPLAY_AOT=0`` in the environment turns every compiled extension off (read at each call, so
a test can set it). Standard library only: importing this costs well under a millisecond.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import ModuleType

ENV = "MOE_REPLAY_AOT"


def off() -> bool:
    """Whether ``MOE_REPLAY_AOT=0`` turns the compiled extensions off."""
    return os.environ.get(ENV, "").strip() == "0"


def stale(source: str, built: str) -> bool:
    """Whether the build ``built`` is older than its ``source``. In a source tree (an editable
    install) a build that failed leaves the previous one in place: it would answer for code that
    changed, so it is refused. A wheel ships no source: nothing to compare, never stale."""
    try:
        return os.stat(source).st_mtime > os.stat(built).st_mtime
    except OSError:
        return False


class Extension:
    """One optional extension module, imported on first use.

    ``name``: its dotted name (``"traces._pq"``); ``source``: its C file relative to the project
    root (``"traces/_pq.c"``); ``purpose``: what it makes possible, ending the sentences that say
    why it is unavailable (``"to replay without Numba"``); ``what``: the subject, with its verb, of
    the sentence saying ``MOE_REPLAY_AOT=0`` turned it off (``"the compiled kernels are"``).
    """

    def __init__(self, name: str, source: str, purpose: str, what: str) -> None:
        self.name, self.source, self.purpose, self.what = name, source, purpose, what
        self._mod: ModuleType | None = None
        self._why: str | None = None
        self._tried = False

    def _import(self) -> None:
        self._tried = True
        package, _, leaf = self.name.rpartition(".")
        try:
            mod = importlib.import_module(self.name)
        except ImportError as e:
            self._why = (f"{self.name} is not built ({e}); reinstall moe-replay with a C compiler present "
                         f"(`pip install -e .` or `make`) {self.purpose}")
            return
        here = os.path.dirname(os.path.realpath(importlib.import_module(package).__file__))
        built = os.path.realpath(mod.__file__)
        if os.path.dirname(built) != here:
            # A tree with no build of its own, run with another checkout's editable install (PYTHONPATH
            # over a shared venv): its finder supplies that checkout's build, of that checkout's source.
            self._why = (f"{self.name} was found at {mod.__file__}, outside this {package} package ({here}); "
                         f"build it here (`pip install -e .`) {self.purpose}")
            return
        if stale(os.path.join(here, os.path.basename(self.source)), built):
            self._why = (f"{mod.__file__} is older than {self.source}; rebuild it (`make`, or `pip install -e .`) "
                         f"{self.purpose}")
            return
        self._mod = mod

    def load(self) -> ModuleType | None:
        """The module, or None when it is not built, found elsewhere, stale, or turned off."""
        if off():
            return None
        if not self._tried:
            self._import()
        return self._mod

    def why_unavailable(self) -> str | None:
        """Why :meth:`load` returns None, in one sentence; None when it returns the module."""
        if off():
            return f"{self.what} turned off ({ENV}=0 in the environment)"
        if not self._tried:
            self._import()
        return self._why

    def module_getattr(self, loader: str) -> Callable[[str], bool]:
        """The ``__getattr__`` of the loader module named ``loader``: its ``AVAILABLE`` is whether
        :meth:`load` returns the module, computed at each access (``MOE_REPLAY_AOT`` may change
        after import)."""
        def __getattr__(name: str) -> bool:
            if name == "AVAILABLE":
                return self.load() is not None
            raise AttributeError(f"module {loader!r} has no attribute {name!r}")

        return __getattr__
