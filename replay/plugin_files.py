"""A call's ``policy_file=`` / ``predictor_file=`` registered with both registries (above them; the loader
in :mod:`replay.plugins` stays below them)."""

from __future__ import annotations

from pathlib import Path


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
