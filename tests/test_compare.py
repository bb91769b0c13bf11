"""``compare``: hand-built traces of the same prompt, the near-tie margin, refusals, and properties
(a trace against itself agrees 100%; one changed routing lowers agreement by exactly that routing)
checked against the naive twin in tests/naive/compare.py."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.analyses.trace_compare import compare
from tests.helpers import assert_one_sentence_error, run_cli
from tests.naive.compare import compare_naive
from traces import TraceWriter, open_trace
from traces.format.errors import UserError
from traces.format.schema import default_gating

_n = itertools.count()


def spec(*, n_layer=2, n_expert=6, k=2, prefill=3, decode=3, seed=0, logits=True, tokens=True) -> dict:
    """A self-consistent run: random logits, experts = their top-k, weights = softmax over the k (norm_topk)."""
    rng = np.random.default_rng(seed)
    T = prefill + decode
    lg = rng.standard_normal((T, n_layer, n_expert)).astype(np.float32)
    ex = np.argsort(-lg.astype(np.float64), axis=2, kind="stable")[:, :, :k].astype(np.int32)
    top = np.take_along_axis(lg.astype(np.float64), ex, axis=2)
    w = np.exp(top - top.max(axis=2, keepdims=True))
    w = (w / w.sum(axis=2, keepdims=True)).astype(np.float32)
    return {"n_layer": n_layer, "n_expert": n_expert, "k": k, "prefill": prefill, "decode": decode,
            "experts": ex, "weights": w, "logits": lg if logits else None,
            "tokens": rng.integers(0, 100, size=T).astype(np.int32) if tokens else None, "gating": default_gating("softmax", True)}


def write(s: dict, root: Path, *, drop_steps: tuple[int, ...] = (), router_bias: list[float] | None = None,
          prompt: str = "p") -> Path:
    out = root / f"t{next(_n)}"
    out.mkdir(parents=True)
    L, k = s["n_layer"], s["k"]
    meta = {"model": {"name": "m", "arch": "test", "n_layer": L, "moe_layers": list(range(L)), "n_expert": s["n_expert"],
                      "top_k": k, "top_k_native": k, "n_embd": None if router_bias is None else 1},
            "expert_bytes": [1000] * L, "dense_bytes": [None] * L, "gating": s["gating"],
            "provenance": {"engine": "test", "prompts": [prompt]}}
    cols = tuple(c for c in ("logits", "token") if s[c if c == "logits" else "tokens"] is not None)
    w = TraceWriter(out, meta, columns=cols, tokens_per_part=2)
    if router_bias is not None:  # a selection bias per expert (the router matrices themselves are not used)
        E = s["n_expert"]
        w.write_router(np.repeat(np.arange(L), E), np.tile(np.arange(E), L), np.zeros((L * E, 1)), np.tile(router_bias, L))
    P, T = s["prefill"], s["prefill"] + s["decode"]
    batches = ([(0, list(range(P)))] if P else []) + [(1, [t]) for t in range(P, T)]
    for b, (phase, steps) in enumerate(batches):
        steps = [t for t in steps if t not in drop_steps]
        if not steps:
            continue
        for layer in range(L):
            opt = {}
            if s["logits"] is not None:
                opt["logits"] = s["logits"][steps, layer]
            if s["tokens"] is not None:
                opt["token"] = s["tokens"][steps]
            w.append(turn=0, batch=b, phase=phase, step=np.asarray(steps), layer=layer, experts=s["experts"][steps, layer],
                     weights=s["weights"][steps, layer], **opt)
    w.close()
    return out


def copy_spec(s: dict) -> dict:
    return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in s.items()}


def _same_rows(fast: list[dict], naive: list[dict]) -> None:
    assert [r["layer"] for r in fast] == [r["layer"] for r in naive]
    for f, n in zip(fast, naive):
        for key, v in n.items():
            if key.endswith("mean_abs_diff") and v is not None:
                assert math.isclose(f[key], v, rel_tol=1e-12, abs_tol=1e-15), (key, f, n)
            else:
                assert f[key] == v, (key, f, n)


specs = st.builds(
    lambda L, E, k, P, D, seed, logits: spec(n_layer=L, n_expert=E, k=min(k, E - 1), prefill=P, decode=D, seed=seed,
                                             logits=logits),
    st.integers(1, 3), st.integers(3, 8), st.integers(1, 3), st.integers(0, 3), st.integers(1, 4),
    st.integers(0, 2**31 - 1), st.booleans(),
)
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(s=specs)
def test_a_trace_against_itself_agrees_everywhere(tmp_path, s):
    p = write(s, tmp_path)
    res = compare(open_trace(p), open_trace(p))
    rows = res.per_layer.to_dicts()
    _same_rows(rows, compare_naive(p, p, 1e-3))
    for r in rows:
        assert r["set_agree_pct"] == 100.0 and r["top1_agree_pct"] == 100.0 and r["disagreements"] == 0
        assert r["weight_max_abs_diff"] == 0.0
        assert r["logit_max_abs_diff"] == (0.0 if s["logits"] is not None else None)
    assert res.tokens_checked and res.disagreements.height == 0


@SETTINGS
@given(s=specs, data=st.data())
def test_one_changed_routing_lowers_agreement_by_exactly_that_routing(tmp_path, s, data):
    T = s["prefill"] + s["decode"]
    t = data.draw(st.integers(0, T - 1), label="step")
    layer = data.draw(st.integers(0, s["n_layer"] - 1), label="layer")
    slot = data.draw(st.integers(0, s["k"] - 1), label="slot")
    outside = [e for e in range(s["n_expert"]) if e not in s["experts"][t, layer]]
    new = data.draw(st.sampled_from(outside), label="new expert")
    b = copy_spec(s)
    old = int(b["experts"][t, layer, slot])
    b["experts"][t, layer, slot] = new  # one expert swapped for one the router did not choose
    pa, pb = write(s, tmp_path), write(b, tmp_path)
    tol = data.draw(st.sampled_from([1e-3, 0.5, 10.0]), label="tol")
    res = compare(open_trace(pa), open_trace(pb), tol=tol)
    rows = res.per_layer.to_dicts()
    _same_rows(rows, compare_naive(pa, pb, tol))
    n_l = T  # routings per layer
    for r in rows:
        lost = 1 if r["layer"] in (layer, None) else 0
        n = n_l * (s["n_layer"] if r["layer"] is None else 1)
        assert r["routings"] == n and r["disagreements"] == lost
        assert r["set_agree_pct"] == 100.0 * (n - lost) / n
    d = res.disagreements.to_dicts()
    assert len(d) == 1 and (d[0]["step"], d[0]["layer"]) == (t, layer)
    if s["logits"] is not None:
        gap = abs(float(s["logits"][t, layer, old]) - float(s["logits"][t, layer, new]))
        assert d[0]["margin"] == gap and d[0]["explained"] == (gap < tol)
    else:
        assert d[0]["margin"] is None and not d[0]["explained"]


@SETTINGS
@given(s=specs.filter(lambda s: s["k"] >= 2), data=st.data())
def test_swapped_rank_order_lowers_top1_only(tmp_path, s, data):
    T = s["prefill"] + s["decode"]
    t = data.draw(st.integers(0, T - 1), label="step")
    layer = data.draw(st.integers(0, s["n_layer"] - 1), label="layer")
    b = copy_spec(s)
    b["experts"][t, layer, [0, 1]] = b["experts"][t, layer, [1, 0]]
    res = compare(open_trace(write(s, tmp_path)), open_trace(write(b, tmp_path)))
    ov = res.overall()
    n = T * s["n_layer"]
    assert ov["set_agree_pct"] == 100.0 and ov["disagreements"] == 0
    assert ov["top1_agree_pct"] == 100.0 * (n - 1) / n


def _tie_pair(tmp_path, gap: float, **kw):
    """A and B identical except one decode routing, where B chose expert 2 over expert 1, whose logits
    differ by ``gap`` (A's view: 1 > 2)."""
    s = spec(n_layer=1, n_expert=4, k=2, prefill=2, decode=2, **kw)
    for t in range(4):
        s["logits"][t, 0] = [3.0, 2.0, 2.0 - gap, -1.0]
        s["experts"][t, 0] = [0, 1]
    b = copy_spec(s)
    b["experts"][3, 0] = [0, 2]
    return write(s, tmp_path), write(b, tmp_path)


def test_near_tie_is_explained_and_a_wide_margin_is_not(tmp_path):
    a, b = _tie_pair(tmp_path, 2.0**-12)
    res = compare(open_trace(a), open_trace(b), tol=1e-3)
    d = res.disagreements.to_dicts()
    assert len(d) == 1 and d[0]["margin"] == 2.0**-12 and d[0]["explained"]
    assert d[0]["experts_a"] == [0, 1] and d[0]["experts_b"] == [0, 2] and d[0]["phase"] == 1
    ov = res.overall()
    assert ov["set_agree_pct"] == 75.0 and ov["explained"] == 1 and ov["unexplained"] == 0
    a2, b2 = _tie_pair(tmp_path, 0.5)
    res2 = compare(open_trace(a2), open_trace(b2), tol=1e-3)
    assert res2.overall()["unexplained"] == 1 and res2.disagreements["margin"].to_list() == [0.5]
    # the same pair explained once the tolerance is wider than the margin
    assert compare(open_trace(a2), open_trace(b2), tol=0.75).overall()["explained"] == 1


def test_margin_from_the_trace_that_has_logits(tmp_path):
    s = spec(n_layer=1, n_expert=4, k=2, prefill=1, decode=1)
    s["logits"][:, 0] = [3.0, 2.0, 1.999, -1.0]
    s["experts"][:, 0] = [0, 1]
    b = copy_spec(s)
    b["logits"] = None
    b["experts"][1, 0] = [0, 2]
    res = compare(open_trace(write(s, tmp_path)), open_trace(write(b, tmp_path)), tol=1e-2)
    assert res.margin_source == "A" and res.overall()["explained"] == 1
    assert res.overall()["logit_max_abs_diff"] is None  # only one trace holds logits


def test_selection_bias_margin_is_in_selection_scores(tmp_path):
    """A sigmoid router with a selection bias ranks sigmoid(logit) + bias: the margin is measured there."""
    s = spec(n_layer=1, n_expert=4, k=1, prefill=1, decode=1)
    g = default_gating("sigmoid", True)
    g["selection_bias"] = True
    s["gating"] = g
    s["logits"][:, 0] = [0.0, 1.0, -4.0, -4.0]
    s["experts"][:, 0] = [[0], [0]]  # bias 0.5 on expert 0 wins: 0.5 + 0.5 = 1.0 > sigmoid(1) = 0.731
    s["weights"][:, 0] = 0.5
    b = copy_spec(s)
    b["experts"][1, 0] = [1]
    bias = [0.5, 0.0, 0.0, 0.0]
    pa, pb = write(s, tmp_path, router_bias=bias), write(b, tmp_path, router_bias=bias)
    res = compare(open_trace(pa), open_trace(pb), tol=0.3)
    assert res.margin_unit == "selection score"
    margin = res.disagreements["margin"].to_list()[0]
    assert margin == pytest.approx(1.0 - 1.0 / (1.0 + math.exp(-1.0)))
    assert res.overall()["explained"] == 1


def test_different_models_are_refused(tmp_path):
    a = write(spec(n_expert=6), tmp_path)
    b = write(spec(n_expert=8), tmp_path)
    with pytest.raises(UserError, match="experts per layer 6 vs 8"):
        compare(open_trace(a), open_trace(b))
    res = run_cli("compare", a, b)
    assert_one_sentence_error(res, "not comparable", "experts per layer 6 vs 8")
    assert res.code == 2


def test_different_tokens_refused_unless_aligned(tmp_path):
    s = spec(prefill=3, decode=4)
    b = copy_spec(s)
    b["tokens"][5] = (b["tokens"][5] + 1) % 100
    b["experts"][5:] = b["experts"][5:, :, ::-1]  # after the token differs, anything may differ
    pa, pb = write(s, tmp_path), write(b, tmp_path)
    res = run_cli("compare", pa, pb)
    assert_one_sentence_error(res, "token ids differ from turn 0 step 5", "--align step")
    out = compare(open_trace(pa), open_trace(pb), align="step")
    assert out.positions == 5 and out.overall()["routings"] == 5 * 2
    assert out.overall()["set_agree_pct"] == 100.0 and out.left_out == {"a": 4, "b": 4}
    assert any("token ids differ" in n for n in out.notes)


def test_missing_positions_refused_unless_aligned(tmp_path):
    s = spec(prefill=2, decode=4)
    pa, pb = write(s, tmp_path), write(s, tmp_path, drop_steps=(4, 5))  # B stopped two tokens early
    res = run_cli("compare", pa, pb)
    assert_one_sentence_error(res, "A holds 6 token positions, B 4", "B lacks turn 0 step 4 and 1 more")
    out = compare(open_trace(pa), open_trace(pb), align="step")
    assert out.positions == 4 and out.overall()["set_agree_pct"] == 100.0 and out.left_out == {"a": 4, "b": 0}


def test_without_tokens_it_says_so(tmp_path):
    s = spec(tokens=False)
    p = write(s, tmp_path)
    res = compare(open_trace(p), open_trace(p))
    assert not res.tokens_checked and any("no token ids" in n for n in res.notes)


def test_phase_filter(tmp_path):
    a, b = _tie_pair(tmp_path, 0.5)
    pre = compare(open_trace(a), open_trace(b), phase="prefill").overall()
    dec = compare(open_trace(a), open_trace(b), phase="decode").overall()
    assert (pre["routings"], pre["disagreements"]) == (2, 0) and (dec["routings"], dec["disagreements"]) == (2, 1)


def test_cli_text_json_and_strict(tmp_path):
    a, b = _tie_pair(tmp_path, 0.5)
    txt = run_cli("compare", a, b)
    assert txt.code == 0, txt.err
    assert "set agree %" in txt.out and "1 routings select different expert sets: 0 explained" in txt.out
    assert "0,1" in txt.out and "0,2" in txt.out and "NO" in txt.out
    js = run_cli("compare", a, b, "--json", "--tol", "0.75").json()
    assert js["command"] == "compare" and js["trace"] == str(a) and js["trace_b"] == str(b)
    assert js["tol"] == 0.75 and js["rows"][-1]["layer"] is None and js["rows"][-1]["explained"] == 1
    assert js["disagreements"][0]["margin"] == 0.5 and js["disagreements"][0]["experts_b"] == [0, 2]
    assert run_cli("compare", a, b, "--strict").code == 1
    assert run_cli("compare", a, b, "--strict", "--tol", "0.75").code == 0
    assert_one_sentence_error(run_cli("compare", a, b, "--align", "bogus"), "--align 'bogus'")
    assert_one_sentence_error(run_cli("compare", a, b, "--tol", "nan"), "--tol")
    assert_one_sentence_error(run_cli("compare", a, tmp_path / "nope"), "nope")


def test_same_input_same_output(tmp_path):
    a, b = _tie_pair(tmp_path, 0.5)
    assert run_cli("compare", a, b, "--json").out == run_cli("compare", a, b, "--json").out


def test_public_api(tmp_path):
    import replay

    a, b = _tie_pair(tmp_path, 0.5)
    frame = replay.compare(str(a), str(b), tol=0.75)
    assert frame["layer"].to_list() == [0, None] and frame["explained"].to_list() == [1, 1]
    run = replay.compare_run(a, b)
    assert run.disagreements["margin"].to_list() == [0.5] and run.tokens_checked
    with pytest.raises(replay.ReplayError, match="^align 'x'"):  # the keyword, not the CLI flag
        replay.compare(a, b, align="x")


def test_note_when_a_flip_is_within_the_engines_own_logit_difference(tmp_path):
    """B's logits differ from A's by 0.3 at the flipped routing and its margin is 0.5 < 2 x 0.3: said."""
    a, b = _tie_pair(tmp_path, 0.5)
    s = spec(n_layer=1, n_expert=4, k=2, prefill=2, decode=2)
    for t in range(4):
        s["logits"][t, 0] = [3.0, 2.0, 1.5, -1.0]
        s["experts"][t, 0] = [0, 1]
    b2 = copy_spec(s)
    b2["experts"][3, 0] = [0, 2]
    b2["logits"][3, 0] = [3.0, 1.7, 1.8, -1.0]
    res = compare(open_trace(write(s, tmp_path)), open_trace(write(b2, tmp_path)), tol=1e-3)
    assert res.overall()["unexplained"] == 1
    assert any("below twice the two traces' own logit difference" in n for n in res.notes)
    assert not any("twice" in n for n in compare(open_trace(a), open_trace(b), tol=1e-3).notes)


def test_without_tokens_different_recorded_prompts_are_refused(tmp_path):
    s = spec(tokens=False)
    a, b = write(s, tmp_path, prompt="one"), write(s, tmp_path, prompt="two")
    assert_one_sentence_error(run_cli("compare", a, b), "recorded prompts differ")
    assert compare(open_trace(a), open_trace(b), align="step").overall()["set_agree_pct"] == 100.0
    # with token ids on both sides the ids decide, not the prompt text (a prompt file vs the same text)
    t = spec()
    assert compare(open_trace(write(t, tmp_path, prompt="one")), open_trace(write(t, tmp_path, prompt="two"))).tokens_checked
