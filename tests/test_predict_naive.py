"""The fast predictors agree exactly with the naive twin (tests/naive/predict.py) on
hypothesis-drawn traces: every key of every row, unscored counts and the '-' rule included."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.analyses.accuracy import evaluate, expand
from tests.naive.predict import naive_evaluate
from tests.predict_traces import GATINGS, gating_meta, write_trace
from traces import open_trace

ALL = ["prev-token", "stale-gate", "ctrl", "static-hot", "static-hot-prompt", "pair-table", "mix"]


@st.composite
def trace_specs(draw):
    n_layer = draw(st.integers(1, 5))
    moe = sorted(draw(st.sets(st.integers(0, n_layer - 1), min_size=1)))
    kind = draw(st.sampled_from(GATINGS))
    if kind == "grouped":
        n_group = draw(st.sampled_from([2, 3, 4]))
        per = draw(st.integers(2, 3))
        n_expert = n_group * per
        topk_group = draw(st.integers(1, n_group))
        top_k = draw(st.integers(1, min(4, topk_group * per)))
        gating = gating_meta(kind, n_group, topk_group)
    else:
        n_expert = draw(st.integers(2, 8))
        top_k = draw(st.integers(1, min(4, n_expert)))
        gating = gating_meta(kind)
    turns = draw(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4)), min_size=1, max_size=3))
    if sum(a + b for a, b in turns) == 0:
        turns[0] = (0, 1)
    return dict(
        n_layer=n_layer, moe_layers=moe, n_expert=n_expert, top_k=top_k, n_embd=draw(st.integers(1, 5)),
        gating=gating, turns=turns, seed=draw(st.integers(0, 2**31)),
        drop=draw(st.sampled_from([0.0, 0.0, 0.2])), nan_frac=draw(st.sampled_from([0.0, 0.3, 1.0])),
        consistent=draw(st.sampled_from([0.0, 0.5, 1.0])), tokens_per_part=draw(st.integers(1, 3)),
        gate_dtype=draw(st.sampled_from(["float32", "float32", "float16"])),
        logit_bias=draw(st.booleans()),
    )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=trace_specs(), phase=st.sampled_from(["decode", "prefill", "all"]), data=st.data())
def test_fast_equals_naive(spec, phase, data):
    width = data.draw(st.integers(1, spec["n_expert"]))
    horizons = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3, unique=True))
    train = data.draw(st.sampled_from([None, "in-sample", "30%", "75%"]))
    with tempfile.TemporaryDirectory() as tmp:
        path = write_trace(Path(tmp) / "t", **spec)
        trace = open_trace(path)
        res = evaluate(trace, ALL, horizons=horizons, width=width, phase=phase, train=train)
        names = expand(ALL, horizons)
        want = naive_evaluate(path, names, width=width, phase=phase, train=train)
        got = res.frame.to_dicts()
        assert res.predictors == names and not res.unavailable
        assert len(got) == len(want)
        for g, w in zip(got, want):  # every key the twin computes (the bootstrap intervals are test_paired's)
            assert {c: g[c] for c in w} == w, (g, w)
        # The '-' rule: nothing scored -> every percentage is None, never 0.0.
        for r in got:
            pcts = [r[c] for c in ("slot_acc_pct", "whole_acc_pct", "recall_pct", "precision_pct")]
            assert all(p is None for p in pcts) if r["scored"] == 0 else all(p is not None for p in pcts)
            if r["mass_scored"] == 0:
                assert r["mass_pct"] is None
        # ctrl's failing layers are the ones the twin sees below 100% whole-routing accuracy.
        bad = [w["layer"] for w in want if w["predictor"] == "ctrl" and w["layer"] is not None
               and w["scored"] and w["whole_acc_pct"] < 100.0]
        assert res.ctrl_failing_layers == bad
        assert bool(res.warnings) == bool(bad)
