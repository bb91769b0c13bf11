"""Predictors and the predict CLI: ctrl consistency (and its loud failure on broken traces),
unavailable predictors, real traces, option errors, definitions that a twin could share a bug on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.analyses.accuracy import evaluate, horizon_curve
from replay.predictors.gate import _top_w, matrix_problem
from replay.predictors.static_hot import hot_lists
from tests.predict_traces import GATINGS, gating_meta, write_trace
from traces import open_trace
from traces.format.errors import TraceError, UserError
from traces.format.gating import top_indices
from traces.io.reader import RoutingArrays

SMALL = dict(layers=4, experts=16, top_k=4, embd=32, tokens=40, prompt_tokens=12)


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    from replay.cli import main

    code = 0
    try:
        main([*map(str, args)])
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


# -- ctrl ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("gating", ["softmax", "sigmoid-bias", "grouped"])
@pytest.mark.parametrize("phase", ["decode", "prefill", "all"])
def test_ctrl_is_exactly_100_on_consistent_traces(synth_trace_dir, gating, phase):
    t = open_trace(synth_trace_dir(**SMALL, gating=gating))
    res = evaluate(t, ["ctrl", "stale-gate"], horizons=[1, 3], phase=phase, width=6)
    ctrl = res.frame.filter(pl.col("predictor") == "ctrl")
    assert (ctrl["slot_acc_pct"] == 100.0).all() and (ctrl["whole_acc_pct"] == 100.0).all()
    assert (ctrl["recall_pct"] == 100.0).all() and (ctrl["mass_pct"] - 100.0).abs().max() < 1e-9
    assert (ctrl["unscored"] == 0).all() and ctrl.filter(pl.col("layer").is_null())["scored"][0] > 0
    assert res.ctrl_failing_layers == [] and res.warnings == []
    # stale-gate is a real prediction: below ctrl, above nothing; its first d layers are out of reach
    sg = res.overall().filter(pl.col("predictor") == "stale-gate[1]")
    assert 30.0 < sg["slot_acc_pct"][0] < 100.0
    per = res.per_layer().filter(pl.col("predictor") == "stale-gate[3]").sort("layer")
    assert per["slot_acc_pct"].to_list()[:3] == [None, None, None] and per["scored"].to_list()[:3] == [0, 0, 0]
    assert per["slot_acc_pct"][3] is not None


@pytest.mark.parametrize("kind", GATINGS)
@pytest.mark.parametrize("gate_dtype", ["float32", "float16"])
def test_ctrl_is_exactly_100_for_every_gating_kind(tmp_path, kind, gate_dtype):
    # the synthetic generator has three gating kinds; the test writer has all five the selection
    # rule knows (plain sigmoid and gpt-oss's softmax over the chosen logits too), and float16
    # gate inputs go through the Arrow path instead of the mapped one
    n_group = 4 if kind == "grouped" else 1
    path = write_trace(tmp_path / "t", n_layer=4, moe_layers=[0, 1, 3], n_expert=16, top_k=4, n_embd=12,
                       gating=gating_meta(kind, n_group=n_group, topk_group=2 if n_group > 1 else 1),
                       turns=[(6, 12), (3, 9)], seed=11, consistent=1.0, tokens_per_part=5, gate_dtype=gate_dtype)
    res = evaluate(open_trace(path), ["ctrl"], phase="all", width=4)
    ctrl = res.frame.filter(pl.col("predictor") == "ctrl")
    assert (ctrl["whole_acc_pct"] == 100.0).all() and (ctrl["slot_acc_pct"] == 100.0).all()
    assert res.ctrl_failing_layers == [] and ctrl.filter(pl.col("layer").is_null())["scored"][0] == 3 * 30


def _rewrite_router(src: Path, dst: Path, fn) -> Path:
    shutil.copytree(src, dst)
    t = pq.read_table(dst / "router.parquet")
    pq.write_table(fn(t), dst / "router.parquet")
    return dst


def test_ctrl_catches_router_rows_swapped_between_layers(synth_trace_dir, tmp_path, capsys):
    def swap(t: pa.Table) -> pa.Table:
        lay = t.column("layer").to_numpy().copy()
        a, b = lay == 1, lay == 2
        lay[a], lay[b] = 2, 1
        return t.set_column(0, "layer", pa.array(lay, pa.int16()))

    path = _rewrite_router(synth_trace_dir(**SMALL, gating="sigmoid-bias"), tmp_path / "swapped", swap)
    res = evaluate(open_trace(path), ["ctrl"])
    assert res.ctrl_failing_layers == [1, 2]
    (w,) = res.warnings
    assert w.startswith("WARNING: ctrl reads") and "(1, 2)" in w
    assert "layer 1's routings match layer 2's router matrix" in w and "layer 2's routings match layer 1's" in w
    code, out, _ = run_cli(capsys, "predict", path, "--predictors", "ctrl")  # text: said loudly, twice
    assert code == 0 and out.count("WARNING: ctrl reads") == 2
    code, out, _ = run_cli(capsys, "predict", path, "--predictors", "ctrl,prev-token", "--json")
    obj = json.loads(out)
    assert obj["ctrl_ok"] is False and obj["ctrl_failing_layers"] == [1, 2] and "swapped" in obj["warnings"][0]


def test_ctrl_catches_a_transposed_square_router(synth_trace_dir, tmp_path):
    cfg = dict(SMALL, embd=16)  # n_expert == n_embd: a transposed matrix passes every shape check

    def transpose_layer_3(t: pa.Table) -> pa.Table:
        lay = t.column("layer").to_numpy()
        w = np.stack(t.column("weight").to_numpy(zero_copy_only=False)).astype(np.float32)
        sel = np.flatnonzero(lay == 3)
        w[sel] = w[sel].T.copy()
        flat = pa.array(w.reshape(-1), pa.float32())
        return t.set_column(2, "weight", pa.FixedSizeListArray.from_arrays(flat, 16))

    path = _rewrite_router(synth_trace_dir(**cfg), tmp_path / "transposed", transpose_layer_3)
    res = evaluate(open_trace(path), ["ctrl", "stale-gate"])
    assert res.ctrl_failing_layers == [3]
    assert "transpose of its router matrix" in res.warnings[0]


def test_transposed_router_with_other_shape_is_a_clear_defect(synth_trace_dir, tmp_path, capsys):
    src = synth_trace_dir(**SMALL)  # 16 experts, 32 embd
    dst = tmp_path / "t"
    shutil.copytree(src, dst)
    t = pq.read_table(dst / "router.parquet")
    w = np.stack(t.column("weight").to_numpy(zero_copy_only=False)).reshape(4, 16, 32).transpose(0, 2, 1)
    bad = pa.table({
        "layer": pa.array(np.repeat(np.arange(4), 32), pa.int16()), "expert": pa.array(np.tile(np.arange(32), 4), pa.int32()),
        "weight": pa.FixedSizeListArray.from_arrays(pa.array(w.reshape(-1).astype(np.float32)), 16),
        "bias": pa.array(np.zeros(128, np.float32)),
    })
    pq.write_table(bad, dst / "router.parquet")
    with pytest.raises(TraceError, match="router.parquet"):
        open_trace(dst)
    code, out, err = run_cli(capsys, "predict", dst)
    assert code == 2 and out == "" and err.count("\n") == 1 and "router.parquet" in err and "Traceback" not in err
    # the library's own check, should a matrix of the wrong shape ever reach it
    trace = open_trace(src)
    mats = {l: (w_.T.copy(), b) for l, (w_, b) in trace.router_matrices().items()}
    assert "stored transposed?" in matrix_problem(trace, mats)
    mats.pop(2)
    assert "no matrix for MoE layer(s) 2" in matrix_problem(trace, mats)


# -- unavailable predictors ---------------------------------------------------------------------
def test_routing_only_trace_reports_router_predictors_unavailable(synth_trace_dir, capsys):
    path = synth_trace_dir(**SMALL, routing_only=True)
    res = evaluate(open_trace(path), horizons=[1, 2])
    assert res.predictors == ["prev-token", "static-hot", "static-hot-prompt", "pair-table[1]", "pair-table[2]",
                              "request-match", "mix"]
    assert [u["predictor"] for u in res.unavailable] == ["stale-gate[1]", "stale-gate[2]", "ctrl", "learned-gate[1]",
                                                         "learned-gate[2]"]
    assert all("no gate_input column" in u["reason"] for u in res.unavailable)
    assert res.ctrl_failing_layers is None
    code, out, _ = run_cli(capsys, "predict", path)
    assert code == 0 and "unavailable: stale-gate[1], ctrl, learned-gate[1]: the trace has no gate_input column" in out


def test_trace_without_router_parquet(synth_trace_dir, tmp_path):
    dst = tmp_path / "t"
    shutil.copytree(synth_trace_dir(**SMALL), dst)
    (dst / "router.parquet").unlink()
    res = evaluate(open_trace(dst), ["ctrl", "prev-token"])
    assert res.predictors == ["prev-token"] and "no router.parquet" in res.unavailable[0]["reason"]


@pytest.mark.parametrize("kind", ["softmax_weight", "softmax"])
def test_router_logit_bias_is_applied_and_its_absence_reported(tmp_path, kind):
    # gpt-oss adds ffn_gate_inp.bias to the router logits; the routings here depend on it
    path = write_trace(tmp_path / "t", n_layer=3, moe_layers=[0, 1, 2], n_expert=16, top_k=4, n_embd=6,
                       gating=gating_meta(kind), turns=[(4, 10)], seed=5, consistent=1.0, logit_bias=True)
    t = open_trace(path)
    assert t.has_router_logit_bias and set(t.router_logit_bias()) == {0, 1, 2}
    res = evaluate(t, ["ctrl", "stale-gate"], phase="all")
    ctrl = res.frame.filter(pl.col("predictor") == "ctrl")
    assert (ctrl["whole_acc_pct"] == 100.0).all() and res.ctrl_failing_layers == []
    # the stored bias is what makes them agree: zeroed, ctrl fails loudly
    zeroed = _rewrite_router(path, tmp_path / "zeroed", lambda tb: tb.set_column(
        tb.schema.get_field_index("logit_bias"), "logit_bias", pa.array(np.zeros(tb.num_rows, np.float32))))
    assert evaluate(open_trace(zeroed), ["ctrl"], phase="all").ctrl_failing_layers != []
    # the flag without the column: router-based predictors are unavailable, with the reason
    dst = _rewrite_router(path, tmp_path / "no-bias", lambda tb: tb.drop_columns(["logit_bias"]))
    res = evaluate(open_trace(dst), ["ctrl", "stale-gate", "prev-token"])
    assert res.predictors == ["prev-token"]
    assert all("logit_bias" in u["reason"] and "router_logit_bias" in u["reason"] for u in res.unavailable)


@pytest.mark.parametrize("bad, needle", [("int", "not float32"), ("nan", "NaN")])
def test_router_logit_bias_column_is_checked(tmp_path, bad, needle):
    path = write_trace(tmp_path / "t", n_layer=2, moe_layers=[0, 1], n_expert=4, top_k=2, n_embd=3,
                       gating=gating_meta("softmax_weight"), turns=[(1, 2)], seed=2, logit_bias=True)

    def spoil(tb: pa.Table) -> pa.Table:
        i = tb.schema.get_field_index("logit_bias")
        if bad == "int":
            return tb.set_column(i, "logit_bias", pa.array(np.zeros(tb.num_rows, np.int32)))
        v = tb.column("logit_bias").to_numpy().copy()
        v[1] = np.nan
        return tb.set_column(i, "logit_bias", pa.array(v))

    dst = _rewrite_router(path, tmp_path / "bad", spoil)
    with pytest.raises(TraceError, match=needle):
        open_trace(dst)


@pytest.mark.parametrize("name", ["qwen", "gptoss"])
def test_real_traces(real_trace_dir, capsys, name):
    path = real_trace_dir(name)
    res = evaluate(open_trace(path), train="in-sample")  # every decoded token scored; static-hot marked in-sample
    assert res.predictors == ["prev-token", "static-hot", "static-hot-prompt", "pair-table[1]", "request-match", "mix"]
    assert {u["predictor"] for u in res.unavailable} == {"stale-gate[1]", "ctrl", "learned-gate[1]"}
    ov = {r["predictor"]: r for r in res.overall().to_dicts()}
    t = open_trace(path)
    n_moe, decode = len(t.moe_layers), t.token_counts()["tokens_decode"]
    assert ov["static-hot"]["in_sample"] is True and res.in_sample[0] == "static-hot"
    # the default: held out, the first half of the decoded tokens trains, every predictor scored on the rest
    held = {r["predictor"]: r for r in evaluate(open_trace(path)).overall().to_dicts()}
    assert held["static-hot"]["in_sample"] is False
    assert held["static-hot"]["scored"] == held["prev-token"]["scored"] == n_moe * (decode - decode // 2)
    # prev-token: the first decoded token of the (single) turn is unscored at every layer
    assert ov["prev-token"]["unscored"] == n_moe and ov["prev-token"]["scored"] == n_moe * (decode - 1)
    assert ov["static-hot"]["scored"] == n_moe * decode and 0 < ov["static-hot"]["slot_acc_pct"] < 100
    assert ov["static-hot-prompt"]["slot_acc_pct"] <= ov["static-hot"]["recall_pct"] + 1e-9  # the oracle wins
    code, out, _ = run_cli(capsys, "predict", path, "--json")
    obj = json.loads(out)
    assert code == 0 and obj["command"] == "predict" and obj["ctrl_ok"] is None
    assert {u["predictor"] for u in obj["unavailable"]} == {"stale-gate[1]", "ctrl", "learned-gate[1]"}
    assert {"predictor", "layer", "slot_acc_pct", "whole_acc_pct", "scored", "unscored"} <= set(obj["rows"][0])


# -- definitions --------------------------------------------------------------------------------
def test_prev_token_unscored_by_phase(tmp_path):
    path = write_trace(tmp_path / "t", n_layer=3, moe_layers=[0, 2], n_expert=6, top_k=2, n_embd=2,
                       gating=gating_meta("softmax"), turns=[(3, 4), (2, 0), (1, 2)], seed=1)
    t = open_trace(path)
    un = {ph: evaluate(t, ["prev-token"], phase=ph).overall()["unscored"][0] for ph in ("decode", "prefill", "all")}
    # decode: first decoded token of turns 0 and 2; prefill: first prompt token of each turn; all: first token of each
    assert un == {"decode": 2 * 2, "prefill": 3 * 2, "all": 3 * 2}


def test_static_hot_prompt_without_prefill(synth_trace_dir):
    t = open_trace(synth_trace_dir(**dict(SMALL, prompt_tokens=0)))
    res = evaluate(t, ["static-hot", "static-hot-prompt"])
    sp = res.frame.filter(pl.col("predictor") == "static-hot-prompt")
    assert (sp["scored"] == 0).all() and sp["slot_acc_pct"].null_count() == sp.height  # '-', never 0.0
    assert any("no prefill" in n for n in res.notes)


def test_hot_list_ties_count_desc_then_id_asc():
    ex = np.array([[3, 1], [1, 3], [0, 2], [2, 5], [4, 5]], np.int32)
    n = ex.shape[0]
    arr = RoutingArrays(turn=np.zeros(n, np.int32), batch=np.arange(n, dtype=np.int32), phase=np.ones(n, np.int8),
                        step=np.arange(n, dtype=np.int32), layer=np.zeros(n, np.int16), experts=ex,
                        weights=np.full(ex.shape, np.nan, np.float32))
    # counts: 0:1 1:2 2:2 3:2 4:1 5:2 (6,7 never) -> 1,2,3,5 (ties by id), then 0,4, then 6,7
    assert hot_lists(arr, np.ones(n, bool), 8, 8)[0].tolist() == [1, 2, 3, 5, 0, 4, 6, 7]


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 12), st.integers(1, 12), st.integers(0, 2**31), st.booleans())
def test_top_w_kernel_equals_stable_argsort(rows, n_expert, seed, masked):
    rng = np.random.default_rng(seed)
    s = rng.integers(-3, 4, size=(rows, n_expert)).astype(np.float64)  # many ties
    if masked:
        s[rng.random(s.shape) < 0.4] = -np.inf
    for w in range(1, n_expert + 1):
        assert np.array_equal(_top_w(s, w), top_indices(s, w))


def test_horizon_curve_matches_evaluate_and_out_of_reach(synth_trace_dir):
    t = open_trace(synth_trace_dir(**SMALL))
    curve = horizon_curve(t, 5)
    assert curve.overall()["horizon"].to_list() == [1, 2, 3, 4, 5]
    ev = evaluate(t, ["stale-gate"], horizons=[2]).frame
    assert curve.frame.filter(pl.col("horizon") == 2).drop("horizon").equals(ev)
    # 4 MoE layers: d=4 and d=5 reach no layer -> all unscored, every figure '-'
    far = curve.overall().filter(pl.col("horizon") >= 4)
    assert (far["scored"] == 0).all() and far["slot_acc_pct"].null_count() == 2


def test_cli_text_json_and_determinism(synth_trace_dir, capsys):
    path = synth_trace_dir(**SMALL)
    code, out, _ = run_cli(capsys, "predict", path, "--horizon", "1..2", "--width", "6")
    assert code == 0
    assert "recall@6 %" in out and "stale-gate[2]" in out and "slot accuracy % per layer" in out
    assert "100.0" in out.split("ctrl")[1].splitlines()[0]
    _, a, _ = run_cli(capsys, "predict", path, "--json", "--horizon", "1,3")
    _, b, _ = run_cli(capsys, "predict", path, "--json", "--horizon", "1,3")
    assert a == b
    obj = json.loads(a)
    assert obj["ctrl_ok"] is True and obj["predictors"][1:3] == ["stale-gate[1]", "stale-gate[3]"]
    assert sum(r["layer"] is None for r in obj["rows"]) == 12 and len(obj["rows"]) == 12 * 5
    _, c, _ = run_cli(capsys, "predict", path, "--json", "--no-per-layer")
    assert all(r["layer"] is None for r in json.loads(c)["rows"])
    code, out, _ = run_cli(capsys, "predict", path, "--horizon-curve", "3", "--no-per-layer")
    assert code == 0 and "horizon curve d=1..3" in out


@pytest.mark.parametrize("args, needle", [
    (["--width", "0"], "--width 0"),
    (["--width", "17"], "--width 17"),
    (["--horizon", "0"], "--horizon 0"),
    (["--horizon", "x"], "--horizon x"),
    (["--horizon", "3..1"], "backwards"),
    (["--phase", "both"], "--phase"),
    (["--predictors", "oracle"], "unknown predictor"),
    (["--predictors", "stale-gate[0]"], "horizon must be >= 1"),
    (["--predictors", "ctrl", "--horizon", "2"], "no bare stale-gate"),
    (["--horizon", "2", "--horizon-curve", "3"], "one or the other"),
    (["--horizon-curve", "0"], "--horizon-curve 0"),
])
def test_bad_options_are_one_sentence(synth_trace_dir, capsys, args, needle):
    code, out, err = run_cli(capsys, "predict", synth_trace_dir(**SMALL), *args)
    assert code == 2 and out == "" and needle in err and err.count("\n") == 1


def test_library_rejects_bad_width(synth_trace_dir):
    with pytest.raises(UserError, match="--width"):
        evaluate(open_trace(synth_trace_dir(**SMALL)), width=99)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_rank_shortcut_equals_the_full_selection_rule(data):
    """rank() skips the softmax when no bias or groups are involved (softmax keeps the logit
    order); rows where exp underflows (a gap of more than 700 below the maximum inside the top w)
    and sigmoid (saturates to exactly 1.0) take the full rule. On logits that are not within a few
    ulps of each other, the result must be the full rule's exactly, ties to the lower id included."""
    from replay.predictors.gate import rank
    from traces.format.gating import selection_scores

    e = data.draw(st.integers(2, 24))
    t = data.draw(st.integers(1, 12))
    grid = st.integers(-2400, 120).map(lambda v: v / 2.0)  # coarse: exact ties and huge gaps, no ulp-near-ties
    logits = np.array(data.draw(st.lists(st.lists(grid, min_size=e, max_size=e), min_size=t, max_size=t)))
    act = data.draw(st.sampled_from(["softmax", "softmax_weight", "sigmoid"]))
    width = data.draw(st.integers(1, e))
    gating = {"activation": act, "norm_topk": True, "selection_bias": False, "n_group": 1}
    want = _top_w(np.ascontiguousarray(selection_scores(logits, gating, np.zeros(e))), width)
    assert np.array_equal(rank(logits, gating, np.zeros(e), width), want)


def test_rank_shortcut_falls_back_where_softmax_underflows():
    from replay.predictors.gate import rank

    logits = np.array([[0.0, -2000.0, -1000.0]])  # probs [1, 0, 0]: experts 1 and 2 tie, lower id first
    gating = {"activation": "softmax"}
    assert rank(logits, gating, np.zeros(3), 2).tolist() == [[0, 1]]
    assert rank(logits, {"activation": "softmax_weight"}, np.zeros(3), 2).tolist() == [[0, 2]]  # raw logits rank
