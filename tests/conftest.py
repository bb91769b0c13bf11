"""Shared fixtures: real traces from ../shared/data (skipped with a reason when absent) and small
synthetic traces."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("MOE_REPLAY_SHARED", ROOT.parent / "shared")) / "data" / "bigmoeonedge-2026-07-15"
REAL = {"qwen": "qwen", "gemma": "gemma", "gptoss": "gptoss"}


def real_files(name: str) -> tuple[Path, Path]:
    csv, metrics = SHARED_DATA / f"{name}.route.csv", SHARED_DATA / f"{name}.metrics"
    if not csv.is_file():
        pytest.skip(f"real trace {csv} is absent (../shared/data is not beside this checkout)")
    return csv, metrics


@pytest.fixture(scope="session")
def real_trace_dir(tmp_path_factory):
    """Import a real trace once per session: real_trace_dir('qwen') -> Path."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            from traces.importers.bigmoe import import_bigmoe

            csv, metrics = real_files(name)
            out = tmp_path_factory.mktemp(f"real-{name}") / "trace"
            import_bigmoe(csv, out, metrics=metrics)
            cache[name] = out
        return cache[name]

    return get


@pytest.fixture(scope="session")
def synth_trace_dir(tmp_path_factory):
    """Write a synthetic trace once per distinct config: synth_trace_dir(**SynthConfig fields) -> Path."""
    cache: dict[tuple, Path] = {}

    def get(**kw) -> Path:
        from traces.synth.generator import SynthConfig, write_synthetic

        key = tuple(sorted(kw.items()))
        if key not in cache:
            out = tmp_path_factory.mktemp("synth") / "trace"
            write_synthetic(out, SynthConfig(**kw))
            cache[key] = out
        return cache[key]

    return get


# CI (CI=true, as .ci/run is run) draws the same hypothesis examples every time, so a landing is
# judged on a fixed sample; a local run draws new ones and keeps looking for bugs.
if os.environ.get("CI"):
    from hypothesis import settings as _hsettings

    _hsettings.register_profile("ci", derandomize=True, print_blob=True)
    _hsettings.load_profile("ci")
