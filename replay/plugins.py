"""Loading policy and predictor modules: built-ins, files on disk and entry points, one path.

Every module — a built-in named in a registry, a file given with ``policy_file=`` /
``predictor_file=`` (``--policy-file`` / ``--predictor-file``), or an entry point of the groups
``moe_replay.policies`` / ``moe_replay.predictors`` — is imported by :func:`load` and checked by
the registry's own validator before use. A problem (the file is missing, it fails to import, a
hook or constant is missing) is one :class:`~traces.errors.UserError` naming the file.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from traces.errors import UserError


def where(mod: ModuleType) -> str:
    """The file a module came from (or its dotted name), for messages."""
    return getattr(mod, "__file__", None) or mod.__name__


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
    return mod


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
    eps = importlib.metadata.entry_points(group=group)
    return sorted((ep.name, ep.value.split(":")[0]) for ep in eps)


def _paths(files: str | Path | list | tuple | None) -> list[str]:
    if files is None:
        return []
    if isinstance(files, (str, Path)):
        return [str(files)]
    return [str(f) for f in files]


def register_files(policy_file: str | Path | list | tuple | None = None,
                   predictor_file: str | Path | list | tuple | None = None) -> tuple[list[str], list[str]]:
    """Register user policy and predictor modules (a path or a list of paths each); returns the
    (policy names, predictor names) they define."""
    from replay.policies import add_policy_file
    from replay.predictors import add_predictor_file

    return ([add_policy_file(p) for p in _paths(policy_file)], [add_predictor_file(p) for p in _paths(predictor_file)])
