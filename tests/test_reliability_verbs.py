"""Issue 14, items 6 and 11: every verb answers for the phases a trace has (or says what is missing)
and refuses impossible options at once, naming them.

- prefill-only traces (``synth --tokens 0``), decode-only traces (no prompt) and zero-row traces
  (an interrupted capture that wrote no part) through info, cache (+ --retain, --validate), predict,
  drop, prefetch, cost and report: exit 0 with decode figures null/'-' and a note, or exit 2 with one
  sentence; never exit 3 (a TypeError or IndexError called a bug);
- report validates --budgets/--policies up front as cache does;
- stale-gate horizons beyond the trace's MoE layers are refused before any work;
- sizes that cannot fit in memory (n_expert 1e9, synth --layers 1000000) are refused with the GiB.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from tests.helpers import assert_one_sentence_error, run_cli

SMALL = dict(layers=3, experts=8, top_k=2, embd=8)


@pytest.fixture(scope="module")
def prefill_only(synth_trace_dir):
    return synth_trace_dir(**SMALL, tokens=0, prompt_tokens=8)


@pytest.fixture(scope="module")
def decode_only(synth_trace_dir):
    return synth_trace_dir(**SMALL, tokens=8, prompt_tokens=0)


@pytest.fixture(scope="module")
def small(synth_trace_dir):
    return synth_trace_dir(**SMALL, tokens=12, prompt_tokens=4)


@pytest.fixture(scope="module")
def zero_rows(small, tmp_path_factory):
    """An interrupted capture that wrote trace.json but no routing part."""
    out = tmp_path_factory.mktemp("zero") / "trace"
    shutil.copytree(small, out)
    for f in (out / "routings").iterdir():
        f.unlink()
    meta = json.loads((out / "trace.json").read_text())
    meta["complete"], meta["rows"] = False, 0
    (out / "trace.json").write_text(json.dumps(meta))
    return out


def _ok_or_one_sentence(res) -> None:
    assert res.code in (0, 2), (res.code, res.err)
    assert "Traceback" not in res.err and "internal error" not in res.err, res.err
    if res.code == 2:
        assert_one_sentence_error(res)


# -- item 6: traces without decode tokens ------------------------------------------------------

def test_cache_prefill_only_below_token_cycle_answers_cumulative(prefill_only):
    # T is 16 MiB here: 1 MiB is below one token cycle (was a TypeError formatting a None hit %).
    res = run_cli("cache", prefill_only, "--budgets", "1,100")
    assert res.code == 0, res.err
    assert "no decoded tokens" in res.out
    assert "collapses" not in res.out  # a null decode hit % is not a collapse


def test_cache_json_prefill_only_does_not_claim_collapse(prefill_only):
    res = run_cli("cache", prefill_only, "--budgets", "1", "--json")
    assert res.code == 0, res.err
    obj = res.json()
    assert "collapses" not in (obj["note"] or "")
    assert "no decoded tokens" in obj["note"]
    lru = [r for r in obj["rows"] if r["policy"] == "lru" and r["layer"] is None][0]
    assert lru["hit_pct_decode"] is None and lru["lookups_decode"] == 0
    assert lru["lookups"] > 0 and lru["hit_pct_cum"] is not None  # the prefill is answered


@pytest.mark.parametrize("extra", [["--retain"], ["--per-layer"], ["--retain", "--predictor", "static-hot"]])
def test_cache_variants_prefill_only(prefill_only, extra):
    res = run_cli("cache", prefill_only, "--budgets", "1,50", *extra)
    assert res.code == 0, res.err
    assert "no decoded tokens" in res.out


@pytest.mark.parametrize("predictor", ["prev-token", "static-hot-prompt", "stale-gate[1]"])
def test_prefetch_prefill_only_says_what_is_missing(prefill_only, predictor):
    res = run_cli("prefetch", prefill_only, "--budget-mib", "10", "--predictor", predictor)
    assert_one_sentence_error(res, str(prefill_only), "no decoded tokens")
    assert res.code == 2


@pytest.mark.parametrize("args", [["cache"], ["cache", "--json"], ["cache", "--validate", "--budget-mib", "10"],
                                  ["predict"], ["predict", "--phase", "all"], ["prefetch", "--budget-mib", "10"]])
def test_zero_row_trace_refused_with_one_sentence(zero_rows, args):
    res = run_cli(args[0], zero_rows, *args[1:])
    assert res.code == 2, (res.code, res.err, res.out)
    assert_one_sentence_error(res, str(zero_rows))
    assert "routings" in res.err


def test_zero_row_trace_info_says_so(zero_rows):
    res = run_cli("info", zero_rows)
    assert res.code == 0, res.err
    assert "holds no routings" in res.out
    assert run_cli("info", zero_rows, "--json").json()["rows"][0]["rows"] == 0


def test_report_zero_row_trace_writes_summary_and_marks_the_rest(zero_rows, tmp_path):
    out = tmp_path / "rep"
    res = run_cli("report", zero_rows, "-o", out)  # was an IndexError (exit 3)
    assert res.code == 0, res.err
    md = (out / "index.md").read_text()
    assert "## Trace summary" in md
    missing = next(ln for ln in md.splitlines() if ln.startswith("*Not in this report:"))
    assert missing.endswith(": the trace holds no routings.*") and missing.count(" section") >= 5


@pytest.mark.parametrize("which", ["prefill_only", "decode_only"])
def test_every_verb_answers_or_refuses_one_phase_traces(which, request, tmp_path):
    tr = request.getfixturevalue(which)
    cmds = [["info"], ["cache", "--budgets", "1,100"], ["cache", "--json"], ["cache", "--retain", "--budgets", "1"],
            ["cache", "--validate", "--budget-mib", "10"], ["predict"], ["predict", "--phase", "prefill"],
            ["predict", "--horizon-curve", "2"], ["drop", "--mode", "closed", "--budget-mib", "10"],
            ["prefetch", "--budget-mib", "10"], ["cache", "--flash-mib-s", "1000", "--compute-ms", "5", "--budgets", "10"]]
    for c in cmds:
        _ok_or_one_sentence(run_cli(c[0], tr, *c[1:]))
    for c in (["cost", "fit"], ["cost", "check", "--budget-mib", "10"]):
        _ok_or_one_sentence(run_cli(*c, tr))
    res = run_cli("report", tr, "-o", tmp_path / "rep")
    assert res.code == 0, res.err


def test_decode_only_trace_answers(decode_only):
    """Guard (passes before and after): the no-decode handling must not refuse a trace without prefill."""
    res = run_cli("cache", decode_only, "--budgets", "1,100", "--json")
    assert res.code == 0, res.err
    lru = [r for r in res.json()["rows"] if r["policy"] == "lru"][0]
    assert lru["hit_pct_decode"] == lru["hit_pct_cum"]  # no prefill: the two coincide
    res = run_cli("prefetch", decode_only, "--budget-mib", "10", "--json")
    assert res.code == 0, res.err


# -- item 11: report options, horizons, memory -------------------------------------------------

@pytest.mark.parametrize("opt,value,needle", [("--budgets", "100,-1", "--budgets"), ("--budgets", "nan", "--budgets"),
                                              ("--budgets", "", "--budgets"), ("--policies", "lru,nope", "--policies"),
                                              ("--policies", ",", "--policies")])
def test_report_validates_options_up_front(small, tmp_path, opt, value, needle):
    out = tmp_path / "rep"
    res = run_cli("report", small, "-o", out, opt, value)  # was exit 0 with the cache section dropped
    assert_one_sentence_error(res, needle)
    assert res.code == 2
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir()]  # no staging directory either


@pytest.mark.parametrize("args,needle", [
    (["predict", "--horizon", "1..1000000"], "--horizon"),
    (["predict", "--horizon", "3"], "--horizon"),  # 3 MoE layers: d = 3 reaches none
    (["predict", "--horizon", "1,2,40000"], "--horizon"),
    (["predict", "--predictors", "stale-gate[7]"], "--predictors"),
    (["predict", "--horizon-curve", "1000000"], "--horizon-curve"),
    (["prefetch", "--budget-mib", "10", "--predictor", "stale-gate[3]"], "--predictor"),
])
def test_horizon_beyond_moe_layers_refused_at_once(small, args, needle):
    t0 = time.perf_counter()
    res = run_cli(args[0], small, *args[1:])
    assert_one_sentence_error(res, needle)
    assert res.code == 2
    assert time.perf_counter() - t0 < 10.0


def test_largest_reachable_horizon_still_answers(small):
    """Guard (passes before and after): the horizon refusal stops at d = MoE layers - 1."""
    res = run_cli("predict", small, "--horizon", "1..2", "--json")
    assert res.code == 0, res.err
    assert {"stale-gate[1]", "stale-gate[2]"} <= set(res.json()["predictors"])


def test_synth_layers_beyond_int16_refused(tmp_path):
    out = tmp_path / "huge"
    res = run_cli("synth", out, "--layers", "1000000")
    assert_one_sentence_error(res, "--layers", "32768")
    assert not out.exists()


def test_synth_too_large_for_memory_refused_with_gib(tmp_path):
    out = tmp_path / "huge"
    # 32,768 layers (the most int16 layer ids allow) x 4096 x 4096 router weights: petabytes on any machine.
    res = run_cli("synth", out, "--layers", "32768", "--experts", "4096", "--embd", "4096")
    assert_one_sentence_error(res, "--layers", "GiB")
    assert res.code == 2
    assert not out.exists()


@pytest.fixture(scope="module")
def huge_n_expert(synth_trace_dir, tmp_path_factory):
    """A routing-only trace whose trace.json claims n_expert = 1e9 (as a bad import preamble would)."""
    src = synth_trace_dir(**SMALL, tokens=8, prompt_tokens=4, routing_only=True)
    out = tmp_path_factory.mktemp("huge") / "trace"
    shutil.copytree(src, out)
    meta = json.loads((out / "trace.json").read_text())
    meta["model"]["n_expert"] = 10**9
    meta["recorded"] = {"budget_mib": 10}
    (out / "trace.json").write_text(json.dumps(meta))
    return out


@pytest.mark.parametrize("args", [["cache"], ["cache", "--validate"], ["predict"], ["drop", "--mode", "closed"],
                                  ["prefetch"], ["cache", "--retain"]])
def test_n_expert_too_large_for_memory_refused_with_gib(huge_n_expert, args):
    res = run_cli(args[0], huge_n_expert, *args[1:])
    assert_one_sentence_error(res, "trace.json", "n_expert", "GiB")
    assert res.code == 2


def test_report_n_expert_too_large_writes_nothing(huge_n_expert, tmp_path):
    out = tmp_path / "rep"
    res = run_cli("report", huge_n_expert, "-o", out)
    assert_one_sentence_error(res, "trace.json", "GiB")
    assert not out.exists()
    assert run_cli("info", huge_n_expert).code == 0  # info allocates nothing per expert and still answers


# -- option validation found by the fuzz test (tests/test_fuzz_cli.py) -------------------------

@pytest.mark.parametrize("args,needle", [
    (["cache", "{t}", "--seed", "abc"], "--seed"),  # was click's four-line usage block
    (["cache", "{t}", "--bogus"], "--bogus"),
    (["cache", "{t}", "--budgets", "1e300"], "--budgets"),  # was OverflowError, exit 3
    (["cache", "{t}", "--validate", "--budget-mib", "1e300"], "--budget-mib"),
    (["drop", "{t}", "--mode", "closed", "--budget-mib", "1e300"], "--budget-mib"),
    (["cost", "check", "{t}", "--budget-mib", "1e300"], "--budget-mib"),
    (["prefetch", "{t}", "--budget-mib", "10", "--cap", "99999999999999999999999"], "--cap"),
    (["cache", "{t}", "--budgets", "10", "--policies", "random", "--seed", "99999999999999999999999"], "--seed"),
])
def test_option_refused_in_one_line_naming_it(small, args, needle):
    res = run_cli(*[str(small) if a == "{t}" else a for a in args])
    assert_one_sentence_error(res, needle)
    assert res.code == 2
