"""Completeness measured, not assumed (issue 30 item 2): per token, the set of MoE layers routed is
checked; missing (token, layer) routings are counted and named by the import's notes, the
provenance, ``info`` (text and JSON) and the report, and ``complete`` is no; the replay of a trace
with missing routings is the replay of the routings present (docs/design.md, "Completeness"),
checked against the naive twins on the fixture's own rows.

The fixture is what a forward-hook script writes (one JSONL row per (token, layer) the hook fired
at) when the hook missed some layers of some tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers import run_cli
from tests.naive.cache import naive_replay
from tests.naive.predict import naive_evaluate
from traces import open_trace

L, E, K, EB = 4, 6, 2, 4096
GONE = {(1, 2, 1), (1, 5, 1), (1, 5, 2), (0, 7, 3)}  # (request, token, layer) the hook did not write


def hook_rows(gone=GONE):
    rng = np.random.default_rng(11)
    rows = []
    for req in (0, 1):
        for tok in range(9):
            for lay in range(L):
                ids = [int(x) for x in rng.choice(E, K, replace=False)]
                w = [float(np.float32(x)) for x in np.sort(rng.random(K))[::-1]]
                if (req, tok, lay) not in gone:
                    rows.append({"req_id": req, "position": tok, "layer_id": lay, "topk_ids": ids, "topk_weights": w,
                                 "phase": "prefill" if tok < 3 else "decode"})
    return rows


@pytest.fixture(scope="module")
def gap(tmp_path_factory):
    d = tmp_path_factory.mktemp("gap")
    src = d / "hooks.jsonl"
    rows = hook_rows()
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = run_cli("import", "table", src, d / "t", "--expert-bytes", str(EB))
    assert res.code == 0, res.err
    return d / "t", rows, res


def test_missing_routings_counted_and_named(gap):
    t, rows, res = gap
    said = ("4 (token, layer) routing(s) missing: 3 token(s) routed at fewer than the trace's 4 MoE layers "
            "(request 0, step 7: layer 3; request 1, step 2: layer 1; request 1, step 5: layers 1-2)")
    assert said in res.out
    tr = open_trace(t)
    assert any(n.startswith(said) for n in tr.meta["provenance"]["notes"])
    assert tr.meta["provenance"]["routings_missing"] == {"routings_missing": 4, "tokens_missing_layers": 3,
                                                        "routings_missing_at": said.split("layers (", 1)[1][:-1]}
    row = run_cli("info", t, "--json").json()["rows"][0]
    assert row["complete"] is False and row["capture_complete"] is True
    assert (row["routings_missing"], row["tokens_missing_layers"], row["routings_not_computed"]) == (4, 3, 0)
    text = run_cli("info", t).out
    assert f"complete   NO: {said}" in text
    rep = run_cli("report", t, "-o", t.parent / "rep", "--budgets", "0.01")
    assert rep.code == 0, rep.err
    assert said in (t.parent / "rep" / "index.md").read_text()


def test_a_complete_log_stays_complete(tmp_path):
    src = tmp_path / "hooks.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in hook_rows(gone=set())))
    res = run_cli("import", "table", src, tmp_path / "t", "--expert-bytes", str(EB))
    assert res.code == 0 and "missing" not in res.out, res.out
    row = run_cli("info", tmp_path / "t", "--json").json()["rows"][0]
    assert row["complete"] is True and row["routings_missing"] == 0 and row["routings_missing_at"] is None
    assert "routings_missing" not in open_trace(tmp_path / "t").meta["provenance"]


def test_prompt_rows_the_engine_did_not_compute_are_not_missing(tmp_path):
    """llama.cpp computes only the output row of a prompt pass in its last layer: the other prompt
    tokens lack that layer because the routing never happened (counted apart, not missing)."""
    gone = {(r, tok, L - 1) for r in (0, 1) for tok in (0, 1)}  # prompt = tokens 0..2, token 2 its output row
    src = tmp_path / "hooks.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in hook_rows(gone=gone)))
    assert run_cli("import", "table", src, tmp_path / "t", "--expert-bytes", str(EB)).code == 0
    row = run_cli("info", tmp_path / "t", "--json").json()["rows"][0]
    assert row["complete"] is True and row["routings_missing"] == 0 and row["routings_not_computed"] == 4


def test_replay_of_missing_routings_is_the_replay_of_the_rows_present(gap):
    """docs/design.md: a missing routing is no lookup (no hit, no miss, no bytes); prev-token predicts
    from the request's latest routing at that layer. Checked against the naive twins."""
    t, rows, _ = gap
    tr = open_trace(t)
    df = tr.routings(["batch", "phase", "layer", "experts"])
    naive_rows = [(r["batch"], r["phase"], r["layer"], list(r["experts"])) for r in df.to_dicts()]
    assert len(naive_rows) == len(rows) == 2 * 9 * L - len(GONE)
    for budget_mib in (0.01, 0.02):
        got = run_cli("cache", t, "--policies", "lru,belady", "--budgets", str(budget_mib), "--json").json()["rows"]
        for policy in ("lru", "belady"):
            want = naive_replay(naive_rows, list(range(L)), E, dict.fromkeys(range(L), EB), policy,
                                int(budget_mib * 2 ** 20))
            row = next(r for r in got if r["policy"] == policy and r["layer"] is None)
            assert row["lookups"] == sum(want["lookups"].values())
            assert row["hits"] == sum(want["hits"].values())
            assert row["lookups_decode"] == sum(v for (ph, _), v in want["lookups"].items() if ph == 1)
    got = run_cli("predict", t, "--predictors", "prev-token", "--json").json()["rows"]
    want = naive_evaluate(t, ["prev-token"])
    for w in want:
        g = next(r for r in got if r["predictor"] == "prev-token" and r["layer"] == w["layer"])
        assert (g["scored"], g["unscored"], g["slot_acc_pct"]) == (w["scored"], w["unscored"], w["slot_acc_pct"])
    # layer 3 of request 0 lacks token 7: token 8 is scored against token 6's routing there (each
    # request's first decode token is unscored: request 1 scores 5 of its 6, request 0 4 of its 5)
    assert next(w for w in want if w["layer"] == 3)["scored"] == 5 + 4
