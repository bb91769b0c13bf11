"""Cost models that know their origin, intervals that widen where they should, and no nonsense
printed as a number (issue 28 items 2 and 4, issue 29 items 4 and 5; docs/design.md, "Cost model")."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import polars as pl
import pytest

import replay
from replay.analyses.cost_model import MIB, CostModel, add_time_columns, device_check, fit_candidates, load_cost_model
from replay.analyses.cost_sense import t_quantile_975
from tests.helpers import assert_one_sentence_error, run_cli
from traces import open_trace
from traces.format.errors import UserError

TIME = r"(?<![\d.])(?<!\+-)\d+(?:\.\d+)? (?:ms/token|ms|tok/s)(?![\w/])"
SHAPE = {"layers": 4, "experts": 16, "top_k": 2, "embd": 16, "tokens": 40, "prompt_tokens": 8}


def feats(wall, rb):
    n = len(wall)
    return pl.DataFrame({"token": np.arange(n), "wall_ms": np.asarray(wall, float), "read_bytes": np.asarray(rb, float),
                         "misses": np.zeros(n)})


def fitted_row(**over):
    """A model row as 'cost fit --json' writes it (bytes model), with fields overridden."""
    rng = np.random.default_rng(3)
    mib = rng.uniform(100, 200, 64)
    m = fit_candidates(feats(50 + 0.5 * mib + rng.normal(0, 4, 64), mib * MIB), "t")[0]
    m.origin = {"model": "other-model", "arch": "other", "expert_bytes": [1, 2], "engine": "x", "engine_version": None,
                "device": None, "trace_content_sha256": "sha256:0"}
    return {**m.row(), **over}


def write_model(path, row):
    path.write_text(json.dumps({"command": "cost fit", "rows": [{**row, "selected": True}]}))
    return path


# -- intervals (issue 28 item 2) ------------------------------------------------------------------


def test_prediction_interval_widens_with_distance_from_the_fitted_volumes():
    rng = np.random.default_rng(0)
    mib = rng.uniform(100, 200, 128)
    wall = 80 + 0.4 * mib + rng.normal(0, 10, 128)
    m = fit_candidates(feats(wall, mib * MIB), "t")[0]
    n = 128
    x = np.array([mib.mean(), 100.5, 199.0, 20.0, 400.0])  # mean, inside near both edges, far below, far above
    frame = pl.DataFrame({"budget_mib": [1.0, 2.0, 3.0, 4.0, 5.0], "read_mib_decode": x * n, "misses_decode": [0] * 5,
                          "tokens_decode": [n] * 5})
    out = add_time_columns(frame, m, "read_mib_decode", "misses_decode", "tokens_decode")
    ci = out["ms_per_token_ci95"].to_list()
    # the closed form of the OLS prediction interval of the mean of n new tokens at x0
    N, xbar, sxx = len(mib), mib.mean(), ((mib - mib.mean()) ** 2).sum()
    resid = wall - (m.intercept_ms + m.ms_per_mib * mib)
    s = math.sqrt((resid ** 2).sum() / (N - 2))
    want = [t_quantile_975(N - 2) * s * math.sqrt(1 / n + 1 / N + (x0 - xbar) ** 2 / sxx) for x0 in x]
    assert ci == pytest.approx(want, rel=1e-9)
    assert ci[0] < ci[1] and ci[0] < ci[2] < ci[4] and ci[1] < ci[3]  # narrowest at the mean, wider further out
    assert ci[4] > 5 * ci[0]  # far outside: many times the interval at the fitted mean
    assert out["extrapolated"].to_list() == [False, False, False, True, True]
    # the t quantile, not 1.96, with few degrees of freedom
    assert t_quantile_975(6) == pytest.approx(2.446912, abs=1e-6)
    assert t_quantile_975(30) == pytest.approx(2.042272, abs=1e-6)
    assert t_quantile_975(1000) == pytest.approx(1.962339, abs=1e-6)


def test_real_trace_interval_at_390_mib_is_wider_and_extrapolated(real_trace_dir, tmp_path):
    q = real_trace_dir("qwen")
    fit = run_cli("cost", "fit", q, "--json")
    (tmp_path / "q.json").write_text(fit.out)
    rows = run_cli("cache", q, "--cost-model", tmp_path / "q.json", "--policies", "lru", "--budgets", "390,4000",
                   "--json").json()["rows"]
    at = {r["budget_mib"]: r for r in rows}
    assert at[390.0]["extrapolated"] is True and at[4000.0]["extrapolated"] is False
    assert at[390.0]["ms_per_token_ci95"] > 3 * at[4000.0]["ms_per_token_ci95"]  # today: the same +-13.2 at both
    text = run_cli("cache", q, "--cost-model", tmp_path / "q.json", "--policies", "lru", "--budgets", "390,4000").out
    # 390 MiB is below one token cycle: its * mark is kept in the ms/token grid too (issue 28 item 8)
    assert re.search(r"^\s+390 \*\s+\d+\.\d\^", text, re.M) and "^ = extrapolated" in text


# -- origin (issue 28 item 4) ------------------------------------------------------------------


def test_fitted_model_records_its_origin(real_trace_dir):
    q = real_trace_dir("qwen")
    row = [r for r in run_cli("cost", "fit", q, "--json").json()["rows"] if r["selected"]][0]
    o = row["origin"]
    t = open_trace(q)
    assert o["model"] == t.model["name"] and o["arch"] == "qwen3moe" and o["engine"] == "BigMoeOnEdge"
    assert o["expert_bytes"] == t.expert_bytes.tolist() and len(set(o["expert_bytes"])) == 2
    assert o["trace_content_sha256"].startswith("sha256:") and len(o["trace_content_sha256"]) == 71
    assert row["df_resid"] == 126 and row["fit_read_mib_min"] < row["fit_read_mib_max"]


def test_qwen_model_on_gemma_is_refused_unless_foreign(real_trace_dir, tmp_path):
    q, g = real_trace_dir("qwen"), real_trace_dir("gemma")
    (tmp_path / "q.json").write_text(run_cli("cost", "fit", q, "--json").out)
    qm = tmp_path / "q.json"
    for args in (("cache", g), ("drop", g), ("prefetch", g), ("cost", "check", g),
                 ("report", g, "-o", tmp_path / "rep")):
        res = run_cli(*args, "--cost-model", qm)
        assert res.code == 2, (args, res.err)
        assert_one_sentence_error(res, str(qm), "fitted on Qwen3-30B-A3B-Q4_K_M", "--foreign-cost-model")
    assert not (tmp_path / "rep").exists()
    # with leave: every time figure is marked
    obj = run_cli("cache", g, "--cost-model", qm, "--foreign-cost-model", "--budgets", "390,4000", "--json").json()
    rows = obj["rows"]
    assert rows and all(r["cost_model_foreign"] is True for r in rows) and obj["cost_model_foreign"] is True
    text = run_cli("cache", g, "--cost-model", qm, "--foreign-cost-model", "--budgets", "390,4000").out
    timed = text[text.index("estimated ms per decoded token"):]
    assert "FOREIGN" in timed.splitlines()[0]
    figures = re.findall(r"\b\d+\.\d\b[\^~]*", "\n".join(timed.splitlines()[3:5]))  # the two budget rows of the grid
    assert figures and all(f.endswith("~") for f in figures)
    assert all(m.endswith("~") for m in re.findall(r"ms[\^~]*(?= \()", timed))  # the verdict's ms figures
    for verb in ("drop", "prefetch"):
        out = run_cli(verb, g, "--cost-model", qm, "--foreign-cost-model").out
        assert "~ = FOREIGN" in out
        # every time figure but the interval's half-width (it belongs to the figure it follows) is marked
        assert re.findall(TIME, out) and all(m[-1] in "^~" for m in re.findall(TIME + r"[\^~]?", out)), out
    drop_rows = run_cli("drop", g, "--cost-model", qm, "--foreign-cost-model", "--json").json()["rows"]
    assert all(r["cost_model_foreign"] is True for r in drop_rows)
    assert run_cli("report", g, "-o", tmp_path / "rep", "--cost-model", qm, "--foreign-cost-model").code == 0
    md = (tmp_path / "rep" / "index.md").read_text()
    assert "FOREIGN cost model" in md
    assert re.findall(r"\d (?:ms/token|tok/s)", md) and not re.findall(r"\d (?:ms/token|tok/s)(?![\^~])", md)
    verdict = json.loads((tmp_path / "rep" / "verdict.json").read_text())["rows"]
    assert all(r.get("cost_model_foreign") for r in verdict if r.get("ms_per_token") is not None or r["kind"] == "cost")
    # the same model on its own trace is applied as it is, unmarked
    own = run_cli("cache", q, "--cost-model", qm, "--budgets", "4000", "--json").json()["rows"]
    assert own and not any("cost_model_foreign" in r for r in own)


def test_api_follows_the_same_rule(real_trace_dir, tmp_path):
    q, g = real_trace_dir("qwen"), real_trace_dir("gemma")
    model = replay.fit_cost_model(q)
    with pytest.raises(UserError, match=r"fitted on Qwen3-30B-A3B-Q4_K_M.*foreign_cost_model=True"):
        replay.cache(g, policies=["lru"], budgets_mib=[4000], cost_model=model)
    with pytest.raises(UserError, match="foreign_cost_model=True"):
        replay.drop(g, cost_model=model)
    with pytest.raises(UserError, match="foreign_cost_model=True"):
        replay.prefetch(g, cost_model=model)
    with pytest.raises(UserError, match="foreign_cost_model=True"):
        replay.with_time(replay.cache(g, policies=["lru"], budgets_mib=[4000]), model, trace=g)
    f = replay.cache(g, policies=["lru"], budgets_mib=[4000], cost_model=model, foreign_cost_model=True)
    assert f["cost_model_foreign"].to_list() == [True]
    assert replay.prefetch(g, cost_model=model, foreign_cost_model=True)["cost_model_foreign"].to_list() == [True]


def test_old_model_file_without_origin_is_refused_unless_foreign(synth_trace_dir, tmp_path):
    t = synth_trace_dir(**SHAPE, seed=1)
    row = fitted_row()
    for k in ("origin", "cov_unscaled", "df_resid", "fit_read_mib_min", "fit_read_mib_max", "fit_misses_min", "fit_misses_max"):
        del row[k]
    old = write_model(tmp_path / "old.json", row)
    res = run_cli("cache", t, "--cost-model", old, "--budgets", "40")
    assert res.code == 2
    assert_one_sentence_error(res, str(old), "records no origin", "predates", "--foreign-cost-model")
    rows = run_cli("cache", t, "--cost-model", old, "--budgets", "40", "--foreign-cost-model", "--json").json()["rows"]
    assert all(r["cost_model_foreign"] is True and r["extrapolated"] is None for r in rows)
    # a model of another model (synthetic origin) is refused on the synthetic trace, naming what differs
    other = write_model(tmp_path / "other.json", fitted_row())
    assert_one_sentence_error(run_cli("drop", t, "--cost-model", other), "other-model", "differs in model")


def test_sweep_follows_the_same_rule(synth_trace_dir, tmp_path):
    t = synth_trace_dir(**SHAPE, seed=1)
    write_model(tmp_path / "other.json", fitted_row())
    grid = tmp_path / "grid.toml"
    grid.write_text(f'traces = ["{t}"]\n[drop]\nmodes = ["closed"]\nbudgets_mib = [40]\ncost_model = "other.json"\n')
    res = run_cli("sweep", grid, "-o", tmp_path / "out", "--workers", "1")
    assert res.code == 2 and "other-model" in res.err and "Traceback" not in res.err
    grid.write_text(f'traces = ["{t}"]\n[drop]\nmodes = ["closed"]\nbudgets_mib = [40]\ncost_model = "other.json"\n'
                    'foreign_cost_model = true\n')
    res = run_cli("sweep", grid, "-o", tmp_path / "out2", "--workers", "1")
    assert res.code == 0, res.err
    f = pl.read_parquet(tmp_path / "out2" / "drop.parquet")
    assert f["cost_model_foreign"].to_list() == [True] * f.height


def test_foreign_flag_alone_is_refused(synth_trace_dir):
    t = synth_trace_dir(**SHAPE, seed=1)
    assert_one_sentence_error(run_cli("cache", t, "--foreign-cost-model"), "--foreign-cost-model", "only meaningful")


# -- nonsense refused (issue 29 items 4 and 5) --------------------------------------------------


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("intercept_ms", -84.4, "intercept_ms -84.4"),
    ("ms_per_mib", 1e-300, "ms_per_mib 1e-300"),
    ("tokens_fit", 10 ** 400, "tokens_fit holds an integer of 401 digits"),
    ("resid_std_ms", 10 ** 30, "resid_std_ms"),
    ("df_resid", -3, "df_resid -3"),
])
def test_nonsense_model_fields_refused_naming_file_and_field(synth_trace_dir, tmp_path, field, value, needle):
    t = synth_trace_dir(**SHAPE, seed=1)
    p = write_model(tmp_path / "bad.json", fitted_row(**{field: value}))
    for args in (("cache", t, "--budgets", "40"), ("cost", "check", t)):
        res = run_cli(*args, "--cost-model", p, "--foreign-cost-model")
        assert res.code == 2, res.out
        assert_one_sentence_error(res, str(p), needle)
    with pytest.raises(UserError, match=re.escape(needle)):
        load_cost_model(p)


def test_deeply_nested_model_file_refused(tmp_path):
    p = tmp_path / "deep.json"
    p.write_text("[" * 100_000 + "]" * 100_000)
    assert_one_sentence_error(run_cli("cache", tmp_path, "--cost-model", p), str(p), "nests more than")
    p.write_text('{"rows": [{"selected": true, "notes": ' + "[" * 70 + "]" * 70 + "}]}")
    with pytest.raises(UserError, match="nests more than 64 levels"):
        load_cost_model(p)


def test_model_giving_nonsense_at_a_budget_is_refused_naming_the_budget(synth_trace_dir):
    t = synth_trace_dir(**SHAPE, seed=1)
    # built in code (no loader in the way): 0 ms to read nothing, next to nothing per MiB
    tiny = CostModel(model="m", terms="bytes", intercept_ms=0.0, ms_per_mib=1e-9, kind="manual")
    with pytest.raises(UserError, match=r"at 40 MiB \(lru\).*not a time"):
        replay.cache(t, policies=["lru"], budgets_mib=[40], cost_model=tiny)
    neg = CostModel(model="m", terms="bytes", intercept_ms=-500.0, ms_per_mib=0.4, kind="manual")
    with pytest.raises(UserError, match=r"-\d+.* ms per decoded token at 40 MiB"):
        replay.cache(t, policies=["lru"], budgets_mib=[40], cost_model=neg)
    # the manual options are held to the same bounds
    assert_one_sentence_error(run_cli("cache", t, "--flash-mib-s", "1e300", "--compute-ms", "0"), "--flash-mib-s",
                              "above any device")


def test_device_check_refuses_a_nonsense_prediction(real_trace_dir):
    q = open_trace(real_trace_dir("qwen"))
    neg = CostModel(model="m", terms="bytes", intercept_ms=-500.0, ms_per_mib=0.4, kind="manual")
    with pytest.raises(UserError, match=r"at 4000 MiB \(lru, decode token \d+\)"):
        device_check(q, neg)
