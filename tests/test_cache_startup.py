"""`moe-replay cache` start-up (issue 18, end to end): what a one-policy `cache --json` imports.

Start-up is most of a small replay's time, so the cache path loads only what it uses: the policy
modules it replays (not all 16, which also makes ``replay.cost.BOUNDS`` lazy), no tqdm when no
bar is shown, no importer module, no psutil (``--stream auto`` reads /proc/meminfo). Each check
below failed before the change that removed the import; the output is the same bytes as the
in-process CLI's (which has imported everything)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from replay.policies import REGISTRY
from tests.helpers import modules_after, run_cli

ROOT = Path(__file__).resolve().parent.parent
FIFO = ROOT / "examples" / "fifo_policy.py"

@pytest.fixture(scope="module")
def tiny(synth_trace_dir):
    return synth_trace_dir(layers=4, experts=16, top_k=2, tokens=24, prompt_tokens=8, seed=3, routing_only=True)


def _modules_after(*args: str) -> tuple[str, set[str]]:
    return modules_after("replay.cli", *args)  # the typer application (the console script's fast path: test_fastcli)


@pytest.mark.parametrize("stream", ["off", "on"])
def test_cache_json_imports_only_what_it_uses(tiny, stream):
    args = ("cache", str(tiny), "--budgets", "1", "--policies", "lru", "--json", "--stream", stream)
    out, mods = _modules_after(*args)
    policies = {m for m in mods if m.startswith("replay.policies.") and not m.startswith("replay.policies._")}
    assert policies == {"replay.policies.lru"}  # was every built-in: replay.cost.BOUNDS and check_policies loaded all
    assert "tqdm" not in mods  # no bar is shown in a pipe: was imported to make a disabled bar
    assert "traces.importers" not in mods  # was imported by replay.info for info's compact_ranges
    assert "psutil" not in mods  # --stream auto's memory figure: /proc/meminfo's MemAvailable on Linux
    assert out == run_cli(*args).out  # the same bytes as a process that imported everything


def test_lazy_registry_keeps_names_order_and_refuses_a_clash(monkeypatch, tmp_path):
    import replay.plugins as plugins
    import replay.policies as pol

    monkeypatch.setattr(pol.REG, "_modules", {})
    monkeypatch.setattr(pol.REG, "_entry_points_of", None)
    monkeypatch.setattr(plugins, "entry_points", lambda group: [("fifo", str(FIFO))])
    assert pol.REG.known("lru") and "replay.policies.belady" not in {m.__name__ for m in pol.REG._modules.values()}
    assert pol.names() == (*REGISTRY, "fifo")  # built-ins in registry order, then entry points, as before
    from replay.cost import BOUNDS

    assert set(BOUNDS) == {"belady", "infinite", "layer-opt"}
    # an entry point claiming a built-in's name is refused even when only that built-in is asked for
    clash = tmp_path / "lru_clash.py"
    clash.write_text(FIFO.read_text().replace('NAME = "fifo"', 'NAME = "lru"'))
    assert 'NAME = "lru"' in clash.read_text()
    monkeypatch.setattr(pol.REG, "_modules", {})
    monkeypatch.setattr(plugins, "entry_points", lambda group: [("clash", str(clash))])
    with pytest.raises(Exception, match="already taken"):
        pol.REG.known("lru")


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="Linux only: elsewhere available_bytes is psutil's")
def test_available_bytes_is_psutils_figure():
    import psutil

    from traces.memory import available_bytes

    # the same kernel figure read twice: allow what another process may allocate in between
    assert abs(available_bytes() - psutil.virtual_memory().available) < 256 << 20


def test_silent_progress_answers_what_the_callers_call(monkeypatch):
    # a piped run gets a silent stand-in, not tqdm: it must take every call the verbs make on a bar
    import io

    from replay.progress import progress

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with progress(10, "x", unit="row") as bar:
        bar.set_postfix_str("decode", refresh=False)
        bar.set_description("y")
        bar.update(3)
        bar.update()
        assert (bar.n, bar.total, bar.disable) == (4, 10, True)
        bar.reset(total=5)
        assert (bar.n, bar.total) == (0, 5)
    bar.close()
    assert sys.stderr.getvalue() == "" and "tqdm" not in type(bar).__module__
