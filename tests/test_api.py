"""The public Python API (issue 15 item 1): keyword-only, one DataFrame per analysis, the same rows
as the CLI's --json, errors that name the parameter and never a CLI flag."""

from __future__ import annotations

import sys

import polars as pl
import pytest

import replay
from tests.helpers import run_cli

SMALL = dict(layers=4, experts=16, top_k=2, embd=16, tokens=48, prompt_tokens=8, expert_bytes=1 << 16)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return replay.synth(tmp_path_factory.mktemp("api") / "trace", **SMALL)


def test_every_analysis_returns_one_frame(small):
    frames = [
        replay.cache(small, policies=["lru", "belady"], budgets_mib=[1, 2]),
        replay.predict(small, predictors=["prev-token", "stale-gate[1]"]),
        replay.drop(small, mode="closed", fracs=[0.5], budget_mib=1),
        replay.prefetch(small, predictor="prev-token", budget_mib=1),
        replay.retain(small, predictor="prev-token", budgets_mib=[1]),
    ]
    assert all(isinstance(f, pl.DataFrame) and f.height for f in frames)
    assert {"policy", "budget_mib", "layer", "hit_pct_decode", "hit_pct_cum"} <= set(frames[0].columns)
    assert {"predictor", "layer", "slot_acc_pct", "whole_acc_pct", "scored", "unscored"} <= set(frames[1].columns)
    assert "retain_gain_pp_decode" in frames[4].columns


def test_keyword_only(small):
    with pytest.raises(TypeError):
        replay.cache(small, ["lru"])  # the options are keyword-only


def test_cli_is_the_same_function(small):
    api = replay.cache(small, policies=["lru", "lfu"], budgets_mib=[1, 2])
    cli = run_cli("cache", small.path, "--policies", "lru,lfu", "--budgets", "1,2", "--json")
    assert cli.code == 0, cli.err
    assert cli.json()["rows"] == [{k: v for k, v in r.items()} for r in api.to_dicts()]
    api_p = replay.predict(small, predictors=["prev-token", "static-hot"])
    cli_p = run_cli("predict", small.path, "--predictors", "prev-token,static-hot", "--json")
    assert cli_p.json()["rows"] == api_p.to_dicts()


@pytest.mark.parametrize("call, keyword", [
    (lambda t: replay.cache(t, policies=["nope"]), "policies"),
    (lambda t: replay.cache(t, policies=["lru"], budgets_mib=[-1]), "budget"),
    (lambda t: replay.cache(t, policies=["lru"], seed=-1), "seed"),
    (lambda t: replay.cache(t, phase="both"), "phase"),
    (lambda t: replay.predict(t, predictors=["stale-gate[0]"]), "predictors"),
    (lambda t: replay.predict(t, width=0), "width"),
    (lambda t: replay.predict(t, predictors=["nope"]), "predictors"),
    (lambda t: replay.prefetch(t, predictor="ctrl", budget_mib=1), "predictor"),
    (lambda t: replay.prefetch(t, predictor="prev-token", budget_mib=1, drop_frac=-1.0), "drop_frac"),
    (lambda t: replay.prefetch(t, predictor="prev-token", budget_mib=1, cap=-1), "cap"),
    (lambda t: replay.drop(t, mode="nope"), "mode"),
    (lambda t: replay.drop(t, mode="closed", fracs=[-1.0], budget_mib=1), "fracs"),
])
def test_errors_name_the_keyword_not_a_flag(small, call, keyword):
    with pytest.raises(replay.ReplayError) as e:
        call(small)
    msg = str(e.value)
    assert keyword in msg, msg
    assert "--" not in msg, msg


def test_the_cli_keeps_its_flags(small):
    r = run_cli("cache", small.path, "--policies", "nope")
    assert "--policies" in r.err and r.code == 2


def test_functions_keep_their_names_when_the_modules_are_imported():
    import replay.core.simulate  # noqa: F401 (the library module that was named replay.cache)
    from replay.analyses.prefetching import guesses  # noqa: F401

    assert callable(replay.cache) and callable(replay.prefetch) and callable(replay.predict) and callable(replay.drop)
    assert "replay.cache" not in sys.modules  # no module takes a public function's name


def test_sweep_show_progress_is_honoured(small, monkeypatch, capsys):
    # item 5: sweep(show_progress=False) printed a bar on a terminal all the same
    from replay.core.simulate import loads_of, sweep

    loads = loads_of(small)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    sweep(loads, ["lru", "lfu"], [1, 2], show_progress=False)
    assert capsys.readouterr().err == ""
    sweep(loads, ["lru", "lfu"], [1, 2], show_progress=True)
    assert "cache replay" in capsys.readouterr().err


def test_plugins_from_the_api(small):
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    f = replay.cache(small, policies=["lru", "fifo"], budgets_mib=[1], policy_file=root / "examples" / "fifo_policy.py")
    assert set(f["policy"]) == {"lru", "fifo"}
    p = replay.predict(small, predictors=["two-tokens-ago"],
                       predictor_file=root / "examples" / "two_tokens_ago_predictor.py")
    assert set(p["predictor"]) == {"two-tokens-ago"}
    assert "fifo" in replay.policy_names() and "two-tokens-ago" in replay.predictor_names()
