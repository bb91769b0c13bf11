"""Learned predictors judged on tokens they never saw (issue 34): the held-out protocol (no training
token is ever scored; in-sample figures are marked), the twin on multi-request traces, and the
constructions whose accuracy is known (pair-table[1] on a cross-layer dependence and on none,
request-match on repeated requests and on none)."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay import predictors as registry
from replay.analyses.accuracy import evaluate, phase_mask
from replay.predictors.training import make_split, token_index
from tests.helpers import assert_one_sentence_error, run_cli
from tests.naive.predict import naive_evaluate
from tests.trace_strategies import recorded_traces, write_trace
from traces import TraceWriter, open_trace
from traces.format.errors import UserError
from traces.format.schema import default_gating

LEARNED = ["prev-token", "static-hot", "pair-table[1]", "pair-table[2]", "request-match", "mix"]


def _meta(L: int, E: int, k: int, name: str = "learn") -> dict:
    return {
        "model": {"name": name, "arch": "test", "n_layer": L, "moe_layers": list(range(L)), "n_expert": E,
                  "top_k": k, "top_k_native": k, "n_embd": None},
        "expert_bytes": [1 << 20] * L, "dense_bytes": [None] * L,
        "gating": default_gating("softmax", True), "provenance": {"engine": "test"},
    }


def _write(path, experts: np.ndarray, requests: np.ndarray | None = None, prompt: int = 0, name: str = "learn"):
    """experts [tokens, L] (top-1) -> a trace: one request (or ``requests[t]`` per token, each
    request's tokens consecutive), its first ``prompt`` tokens of each request prefill."""
    T, L = experts.shape
    E = int(experts.max()) + 1 if experts.size else 1
    w = TraceWriter(path, _meta(L, max(E, 8), 1, name), columns=("request",) if requests is not None else ())
    req = requests if requests is not None else np.zeros(T, np.int64)
    pos: dict[int, int] = {}
    for t in range(T):
        r = int(req[t])
        s = pos.get(r, 0)
        pos[r] = s + 1
        phase = 0 if s < prompt else 1
        for layer in range(L):
            opt = {"request": [r]} if requests is not None else {}
            w.append(turn=0, batch=t, phase=phase, step=s, layer=layer, experts=[[int(experts[t, layer])]],
                     weights=[[1.0]], **opt)
    w.close()
    return path


def _overall(res, name: str) -> dict:
    return res.overall().filter(pl.col("predictor") == name).to_dicts()[0]


# -- the twin on multi-request traces (request-match needs requests) ------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(spec=recorded_traces(max_requests=4, max_tokens=8), phase=st.sampled_from(["decode", "all"]),
       train=st.sampled_from([None, "in-sample", "40%"]), width=st.integers(1, 3))
def test_learned_predictors_equal_their_twin(tmp_path_factory, spec, phase, train, width):
    path = write_trace(spec, tmp_path_factory.mktemp("learn"))
    tr = open_trace(path)
    width = min(width, tr.n_expert)
    got = evaluate(tr, LEARNED, phase=phase, train=train, width=width).frame.to_dicts()
    want = naive_evaluate(path, LEARNED, phase=phase, train=train, width=width)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert {c: g[c] for c in w} == w, (g, w)


# -- no training token is ever scored -------------------------------------------------------------
@pytest.mark.parametrize("train", [None, "50%", "trace:30%", "folds:3"])
def test_no_training_token_is_scored(tmp_path, train):
    rng = np.random.default_rng(1)
    path = _write(tmp_path / "t", rng.integers(0, 8, size=(60, 3)), requests=np.repeat(np.arange(6), 10), prompt=2)
    tr = open_trace(path)
    arr = tr.arrays(recorded=False)
    in_phase = phase_mask(arr.phase, "decode")
    split = make_split(tr, arr, in_phase, train=train, learns=True, seed=3)
    tok, _ = token_index(arr)
    seen: list[tuple[np.ndarray, np.ndarray]] = []  # (training rows, rows scored) per learner call
    names = [n for n in LEARNED if n != "prev-token"]
    mods = {registry.parse_predictor(n)[0] for n in names}
    originals = {f: registry.module(f).predict for f in mods}
    try:
        for f in mods:
            def spy(trace, a, ev, width, _orig=originals[f], **kw):
                out = _orig(trace, a, ev, width, **kw)
                if "training" in kw:
                    seen.append((kw["training"].rows, ev))
                return out
            registry.module(f).predict = spy
        preds = registry.run(tr, arr, in_phase, 1, [registry.parse_predictor(n) for n in names], split=split)
    finally:
        for f, fn in originals.items():
            registry.module(f).predict = fn
    assert seen
    train_tokens = set()
    for training_rows, ev in seen:
        assert not (training_rows & ev).any()  # a fit never sees the rows it is asked to score
        train_tokens |= set(tok[training_rows].tolist()) if train != "folds:3" else set()
    for p in preds.values():
        scored_tokens = set(tok[p.scored].tolist())
        assert p.scored.any()
        assert not (p.scored & ~split.evaluated).any()
        if train != "folds:3":  # one fold: no scored token is a training token
            assert not scored_tokens & train_tokens
    if train == "folds:3":  # every decode token scored once, each by a fit on the other requests
        assert split.evaluated.sum() == in_phase.sum()
        req = arr.request_or_zero
        for training, ev in split.folds:
            assert not set(req[training.rows].tolist()) & set(req[ev].tolist())


@pytest.mark.parametrize("train", [None, "trace:30%", "folds:3"])
def test_cache_retain_never_guesses_for_a_training_token(tmp_path, monkeypatch, train):
    from replay import api
    from replay.analyses import prefetching

    rng = np.random.default_rng(1)
    path = _write(tmp_path / "t", rng.integers(0, 8, size=(60, 3)), requests=np.repeat(np.arange(6), 10), prompt=2)
    tr = open_trace(path)
    tok, _ = token_index(tr.arrays(recorded=False))
    fits: list[np.ndarray] = []  # the training rows of every fit
    made: list = []  # the guesses the replay protected
    mod = registry.module("pair-table")
    orig_predict, orig_guesses = mod.predict, prefetching.guesses

    def spy(trace, a, ev, width, **kw):
        fits.append(kw["training"].rows)
        return orig_predict(trace, a, ev, width, **kw)

    def spy_guesses(*a, **kw):
        made.append(orig_guesses(*a, **kw))
        return made[-1]

    monkeypatch.setattr(mod, "predict", spy)
    monkeypatch.setattr(prefetching, "guesses", spy_guesses)
    rows = api.cache(tr, policies=["lru"], budgets_mib=[3.0], retain_predictor="pair-table[1]", train=train,
                     seed=3).to_dicts()
    assert rows[0]["retain_train"] == (train or "50%") and len(made) == 1 and fits
    guessed = (made[0].entries >= 0).any(axis=1)
    assert guessed.any()
    if train == "folds:3":  # each fold guessed by a fit on the other requests: every decode token guessed
        assert len(fits) == 3
        other = []
        monkeypatch.setattr(mod, "predict", lambda trace, a, ev, width, **kw: other.append(kw["training"].rows)
                            or orig_predict(trace, a, ev, width, **kw))
        api.cache(tr, policies=["lru"], budgets_mib=[3.0], retain_predictor="pair-table[1]", train=train, seed=4)
        assert any(not np.array_equal(x, y) for x, y in zip(fits, other))  # --seed deals the folds
    else:  # one fit: no token it learned from gets a guess
        assert len(fits) == 1
        assert not set(tok[guessed].tolist()) & set(tok[fits[0]].tolist())


def test_cache_train_options_need_retain_and_reach_the_replay(tmp_path):
    rng = np.random.default_rng(1)
    path = _write(tmp_path / "t", rng.integers(0, 8, size=(40, 2)))
    other = _write(tmp_path / "o", rng.integers(0, 8, size=(40, 3)))
    assert_one_sentence_error(run_cli("cache", str(path), "--train", "30%"), "--retain")
    assert_one_sentence_error(run_cli("cache", str(path), "--train-trace", str(path)), "--retain")
    assert_one_sentence_error(run_cli("cache", str(path), "--retain", "--predictor", "static-hot", "--train-trace",
                                      str(other)), "MoE layers")
    with pytest.raises(UserError, match="retain_predictor"):
        from replay import api

        api.cache(path, train="30%")
    r = run_cli("cache", str(path), "--retain", "--predictor", "static-hot", "--train", "trace:30%", "--budgets", "2",
                "--json")
    assert r.code == 0 and {x["retain_train"] for x in json.loads(r.out)["rows"]} == {"trace:30%"}
    r = run_cli("cache", str(path), "--retain", "--predictor", "static-hot", "--train", "in-sample", "--budgets", "2")
    assert r.code == 0 and "IN-SAMPLE" in r.out


def test_cache_retain_takes_mix_as_predict_and_prefetch_do(tmp_path, monkeypatch):
    # one option set on every verb that runs a predictor: cache --retain had no --mix
    from replay import api
    from replay.predictors import mix as mix_mod

    rng = np.random.default_rng(1)
    path = _write(tmp_path / "t", rng.integers(0, 8, size=(40, 2)))
    seen = []
    orig = mix_mod.predict
    monkeypatch.setattr(mix_mod, "predict", lambda *a, **kw: seen.append(mix_mod.spec.get()) or orig(*a, **kw))
    r = run_cli("cache", str(path), "--retain", "--predictor", "mix", "--mix", "static-hot,prev-token,0.25", "--budgets", "2",
                "--json")
    assert r.code == 0, r.err
    assert seen == [("static-hot", "prev-token", 0.25)] and {x["retain_predictor"] for x in r.json()["rows"]} == {"mix"}
    from polars.testing import assert_frame_equal

    assert_frame_equal(api.retain(path, predictor="mix", budgets_mib=[2], mix="static-hot,prev-token,0.25"),
                       api.cache(path, policies=["lru"], budgets_mib=[2], retain_predictor="mix",
                                 mix=("static-hot", "prev-token", 0.25)))
    assert seen[1:] == [("static-hot", "prev-token", 0.25)] * 2
    # --mix where no predictor is mix (or without --retain) would be silently ignored: refused on every verb
    assert_one_sentence_error(run_cli("cache", str(path), "--mix", "prev-token,static-hot"), "--mix", "--retain")
    for args in (["cache", "--retain", "--predictor", "prev-token", "--budgets", "2"],
                 ["prefetch", "--predictor", "prev-token", "--budget-mib", "2"], ["predict", "--predictors", "prev-token"]):
        r = run_cli(args[0], str(path), *args[1:], "--mix", "prev-token,static-hot")
        assert_one_sentence_error(r, "--mix prev-token,static-hot: only meaningful when the predictor is mix")
    with pytest.raises(UserError, match="^mix prev-token,static-hot: only meaningful when the predictor is mix"):
        api.retain(path, predictor="prev-token", budgets_mib=[2], mix="prev-token,static-hot")
    assert_one_sentence_error(run_cli("cache", str(path), "--retain", "--predictor", "mix", "--mix", "prev-token", "--budgets",
                                      "2"), "--mix 'prev-token': give two predictors")


def test_default_is_held_out_and_in_sample_is_marked(tmp_path):
    rng = np.random.default_rng(2)
    path = _write(tmp_path / "t", rng.integers(0, 8, size=(40, 2)), prompt=4)
    tr = open_trace(path)
    held = evaluate(tr, ["prev-token", "static-hot"])
    assert held.train == "50%" and held.in_sample == []
    sh = _overall(held, "static-hot")
    assert sh["in_sample"] is False and sh["scored"] == 2 * 18  # the last 18 of 36 decode tokens, 2 layers
    assert _overall(held, "prev-token")["scored"] == 2 * 18
    ins = evaluate(tr, ["prev-token", "static-hot"], train="in-sample")
    assert ins.in_sample == ["static-hot"] and _overall(ins, "static-hot")["in_sample"] is True
    assert _overall(ins, "static-hot")["scored"] == 2 * 36
    # nothing learns: nothing is split, every routing scored
    assert evaluate(tr, ["prev-token"]).train == "none"
    r = run_cli("predict", str(path), "--train", "in-sample", "--no-per-layer")
    assert r.code == 0 and "static-hot (in-sample)" in r.out and "have seen the answers" in r.out
    r = run_cli("predict", str(path), "--no-per-layer")
    assert r.code == 0 and "(in-sample)" not in r.out and "never saw a scored token" in r.out
    r = run_cli("predict", str(path), "--train", "in-sample", "--json")
    doc = json.loads(r.out)
    assert {"static-hot", "pair-table[1]", "request-match", "mix"} <= set(doc["in_sample"])
    assert [r["in_sample"] for r in doc["rows"] if r["predictor"] == "static-hot" and r["layer"] is None] == [True]


def test_bad_splits_and_foreign_training_traces_are_refused(tmp_path):
    rng = np.random.default_rng(3)
    a = _write(tmp_path / "a", rng.integers(0, 8, size=(20, 2)))
    b = _write(tmp_path / "b", rng.integers(0, 8, size=(20, 3)))
    c = _write(tmp_path / "c", rng.integers(0, 8, size=(20, 2)), name="other")
    ta = open_trace(a)
    with pytest.raises(UserError, match="MoE layers"):
        evaluate(ta, ["pair-table[1]"], train_trace=open_trace(b))
    with pytest.raises(UserError, match="model"):
        evaluate(ta, ["pair-table[1]"], train_trace=open_trace(c))
    for bad in ("0%", "100%", "folds:1", "half"):
        with pytest.raises(UserError, match="--train"):
            evaluate(ta, ["static-hot"], train=bad)
    with pytest.raises(UserError, match="request"):
        evaluate(ta, ["static-hot"], train="folds:2")  # one request: no k-fold by request
    assert_one_sentence_error(run_cli("predict", str(a), "--train-trace", str(b)), "MoE layers")
    # a same-shaped training trace: every token of the scored one is scored
    d = _write(tmp_path / "d", rng.integers(0, 8, size=(30, 2)))
    res = evaluate(ta, ["static-hot"], train_trace=open_trace(d))
    assert _overall(res, "static-hot")["scored"] == 2 * 20


# -- constructions with a known answer ------------------------------------------------------------
def _dependent(rng, T: int, L: int, E: int, p: float) -> np.ndarray:
    """Layer 0 uniform; layer l+1 = perm_l(layer l) with probability p, else uniform over all E."""
    perms = [rng.permutation(E) for _ in range(L - 1)]
    x = np.zeros((T, L), np.int64)
    x[:, 0] = rng.integers(0, E, T)
    for l in range(1, L):
        follow = rng.random(T) < p
        x[:, l] = np.where(follow, perms[l - 1][x[:, l - 1]], rng.integers(0, E, T))
    return x


def test_pair_table_finds_a_known_cross_layer_dependence(tmp_path):
    rng = np.random.default_rng(4)
    T, L, E, p = 2000, 3, 8, 0.8
    res = evaluate(open_trace(_write(tmp_path / "dep", _dependent(rng, T, L, E, p))), ["pair-table[1]", "prev-token"])
    o = _overall(res, "pair-table[1]")
    implied = 100.0 * (p + (1 - p) / E)  # the permutation's image, or a uniform draw that lands on it
    sd = 100.0 * np.sqrt(implied / 100 * (1 - implied / 100) / o["scored"])
    assert abs(o["slot_acc_pct"] - implied) < 4 * sd, (o["slot_acc_pct"], implied)
    assert o["scored"] == (L - 1) * T // 2  # layer 0 has no source; half the tokens held out
    assert o["slot_acc_ci_low"] < o["slot_acc_pct"] < o["slot_acc_ci_high"]
    assert o["vs_prev_token"] == "better"
    # no dependence: not better than chance (1/E), the interval covers it
    flat = evaluate(open_trace(_write(tmp_path / "flat", rng.integers(0, E, (T, L)))), ["pair-table[1]"])
    f = _overall(flat, "pair-table[1]")
    assert f["slot_acc_ci_low"] <= 100.0 / E + 1e-9 or f["slot_acc_pct"] <= 100.0 / E
    assert f["slot_acc_pct"] < 100.0 / E + 4 * 100.0 * np.sqrt((1 / E) * (1 - 1 / E) / f["scored"])


def _typed_requests(rng, n_req: int, per: int, L: int, E: int, p: float, types: int):
    """Requests of ``types`` kinds, repeated: a kind routes its own hot expert at each layer with
    probability p, else uniform over all E. Returns (experts [tokens, L], request of each token)."""
    hot = rng.integers(0, E, size=(types, L))
    kinds = np.arange(n_req) % types
    rows, req = [], []
    for r in range(n_req):
        follow = rng.random((per, L)) < p
        rows.append(np.where(follow, hot[kinds[r]][None, :], rng.integers(0, E, (per, L))))
        req += [r] * per
    return np.concatenate(rows), np.array(req)


@pytest.mark.parametrize("train", ["folds:4", "50%"])
def test_request_match_finds_repeated_requests(tmp_path, train):
    rng = np.random.default_rng(5)
    L, E, p = 4, 8, 0.85
    x, req = _typed_requests(rng, 16, 24, L, E, p, types=4)
    res = evaluate(open_trace(_write(tmp_path / "rep", x, req, prompt=4)), ["request-match"], train=train, seed=1)
    o = _overall(res, "request-match")
    implied = 100.0 * (p + (1 - p) / E)  # matched to a request of its own kind: that kind's hot expert
    sd = 100.0 * np.sqrt(implied / 100 * (1 - implied / 100) / o["scored"])
    assert o["scored"] > 0 and abs(o["slot_acc_pct"] - implied) < 5 * sd, (o["slot_acc_pct"], implied)
    # every request its own random routing: nothing to match, chance
    y, _ = _typed_requests(rng, 16, 24, L, E, 0.0, types=16)
    flat = evaluate(open_trace(_write(tmp_path / "flat", y, req, prompt=4)), ["request-match"], train=train, seed=1)
    f = _overall(flat, "request-match")
    assert f["slot_acc_pct"] < 100.0 / E + 4 * 100.0 * np.sqrt((1 / E) * (1 - 1 / E) / f["scored"])


def test_mix_and_byte_budget(tmp_path):
    rng = np.random.default_rng(6)
    path = _write(tmp_path / "t", _dependent(rng, 400, 3, 8, 0.9))
    tr = open_trace(path)
    res = evaluate(tr, ["prev-token", "pair-table[1]", "mix"], byte_budget_mib=1.0, width=2)
    for n in ("prev-token", "pair-table[1]", "mix"):
        o = _overall(res, n)
        # 1 MiB per routing fits one 1 MiB expert: recall at the budget is recall at width 1 (top-1 routing: slot acc)
        assert o["bytes_recall_pct"] == pytest.approx(o["slot_acc_pct"])
        assert o["lead_layers"] == 1
    # the mix leans on pair-table at weight 0: exactly its guesses where pair-table scores
    from replay.api import predict_run

    only_b = predict_run(tr, predictors=["pair-table[1]", "mix"], mix=("prev-token", "pair-table[1]", 0.0)).frame
    ov = {r["predictor"]: r for r in only_b.filter(pl.col("layer") == 1).to_dicts()}
    assert ov["mix"]["slot_acc_pct"] == ov["pair-table[1]"]["slot_acc_pct"]
    with pytest.raises(UserError, match="weight"):
        predict_run(tr, predictors=["mix"], mix="prev-token,pair-table[1],2")


# -- learned-gate: the learned counterpart of stale-gate --------------------------------------------
@pytest.mark.parametrize("kind", ["softmax", "sigmoid-bias"])
def test_learned_gate_reaches_ctrl_when_the_router_input_carries_over(tmp_path, kind):
    from tests.predict_traces import gating_meta
    from tests.predict_traces import write_trace as write_gate_trace

    path = write_gate_trace(tmp_path / "g", n_layer=3, moe_layers=[0, 1, 2], n_expert=8, top_k=2, n_embd=6,
                            gating=gating_meta(kind), turns=[(4, 120)], seed=7, consistent=1.0, shared_gate=True,
                            continuous=True, tokens_per_part=40)
    tr = open_trace(path)
    res = evaluate(tr, ["ctrl", "stale-gate[1]", "learned-gate[1]"])
    assert res.train == "50%"  # held out: fitted on the first 60 decode tokens, scored on the last 60
    lg, ctrl = _overall(res, "learned-gate[1]"), _overall(res, "ctrl")
    assert ctrl["slot_acc_pct"] == 100.0 and lg["in_sample"] is False
    assert lg["slot_acc_pct"] == ctrl["slot_acc_pct"] and lg["whole_acc_pct"] == 100.0
    assert lg["scored"] == 2 * 60  # layers 1 and 2 of the 60 held-out tokens (layer 0 has no source)
    # a fresh input per layer: the regression has nothing to carry over, well below ctrl
    path2 = write_gate_trace(tmp_path / "h", n_layer=3, moe_layers=[0, 1, 2], n_expert=8, top_k=2, n_embd=6,
                             gating=gating_meta(kind), turns=[(4, 120)], seed=7, consistent=1.0, continuous=True)
    lg2 = _overall(evaluate(open_trace(path2), ["learned-gate[1]"]), "learned-gate[1]")
    assert lg2["slot_acc_pct"] < 60.0


def test_learned_gate_is_unavailable_without_router_inputs(tmp_path):
    rng = np.random.default_rng(8)
    res = evaluate(open_trace(_write(tmp_path / "t", rng.integers(0, 8, size=(20, 2)))), ["learned-gate[1]", "prev-token"])
    assert res.unavailable and res.unavailable[0]["predictor"] == "learned-gate[1]"
    assert "gate_input" in res.unavailable[0]["reason"]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(["softmax", "sigmoid", "sigmoid-bias", "softmax_weight"]),
       shared=st.booleans(), n_embd=st.integers(1, 5), d=st.integers(1, 2), train=st.sampled_from([None, "30%", "in-sample"]),
       phase=st.sampled_from(["decode", "all"]))
def test_learned_gate_equals_its_twin(tmp_path_factory, seed, kind, shared, n_embd, d, train, phase):
    # continuous gate inputs: the fast fit (BLAS, LAPACK) and the twin's (loops, Gauss-Jordan) agree
    # to ~1e-12, far inside any gap between two experts' predicted logits
    from tests.predict_traces import gating_meta
    from tests.predict_traces import write_trace as write_gate_trace

    path = write_gate_trace(tmp_path_factory.mktemp("lg") / "t", n_layer=3, moe_layers=[0, 1, 2], n_expert=6, top_k=2,
                            n_embd=n_embd, gating=gating_meta(kind), turns=[(3, 12)], seed=seed, consistent=0.7,
                            shared_gate=shared, continuous=True, tokens_per_part=5)
    names = [f"learned-gate[{d}]", "ctrl"]
    got = evaluate(open_trace(path), names, phase=phase, train=train).frame.to_dicts()
    want = naive_evaluate(path, names, phase=phase, train=train)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert {c: g[c] for c in w} == w, (g, w)
