"""report --quality: the Quality section prints quality.json's figures exactly as the formatter
gives them, the run's reads avoided beside the offline replay's prediction, and the cost model's
time per token from each setting's bytes; a bad or mismatched quality result is refused in one
sentence before anything is written."""

from __future__ import annotations

import json
import os
import shutil

import polars as pl
import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install 'moe-replay[hf]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'moe-replay[hf]')")

from engine_bridge.hf_tiny import TinyHfConfig, write_tiny_hf_model  # noqa: E402
from engine_bridge.quality import quality  # noqa: E402
from replay.analyses.cost_model import CostModel, manual_model  # noqa: E402
from replay.analyses.quality_result import load_all, load_quality, quality_frame  # noqa: E402
from replay.present.format import cell  # noqa: E402
from replay.present.quality import COLUMNS, digits, quality_section  # noqa: E402
from tests.helpers import assert_one_sentence_error, run_cli  # noqa: E402
from traces import open_trace  # noqa: E402
from traces.util.units import MIB  # noqa: E402

pytestmark = pytest.mark.hf
os.environ.setdefault("HF_HUB_OFFLINE", "1")
TEXT = "the quick brown fox jumps over the lazy dog and the router picks the top experts by their scores"
FLASH, COMPUTE = 100.0, 5.0  # the manual cost model: 10 ms per MiB read, 5 ms per token


@pytest.fixture(scope="module")
def qdir(tmp_path_factory):
    model = write_tiny_hf_model(tmp_path_factory.mktemp("qrm") / "m", TinyHfConfig(family="qwen3_moe", experts=8, top_k=2,
                                                                                   seed=1))
    out = tmp_path_factory.mktemp("qr") / "q"
    quality(str(model), TEXT, fracs=[0.0, 0.25, 1.0], keep_ks=[1], out=out, budget_mib=0.05, prompt="the quick brown fox",
            max_new_tokens=4)
    return out


@pytest.fixture(scope="module")
def report(qdir, tmp_path_factory):
    out = tmp_path_factory.mktemp("rep") / "r"
    res = run_cli("report", qdir / "plain", "-o", out, "--quality", qdir, "--flash-mib-s", FLASH, "--compute-ms", COMPUTE,
                  "--budgets", "0.05", "--policies", "lru")
    assert res.code == 0, res.err
    return out


def _section(md: str) -> str:
    return md.split("\n## Quality (drop-cold measured in the model)\n")[1].split("\n## ")[0]


def _table_rows(section: str) -> list[list[str]]:
    """The rows of the section's first table (the settings; the generation table follows it)."""
    section = section.split("**greedy generation per setting**")[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("| ")]
    return [[c.strip() for c in ln.strip("| ").split(" | ")] for ln in lines[1:]]  # past the header


def test_section_prints_quality_json_figures_and_the_cost_models_time(qdir, report):
    obj = json.loads((qdir / "quality.json").read_text())
    md = (report / "index.md").read_text()
    sec = _section(md)
    rows = _table_rows(sec)
    assert [r[0] for r in rows] == [r["setting"] for r in obj["rows"]] == ["drop F=0", "drop F=0.25", "drop F=1", "keep-k 1"]
    frame = quality_frame([load_quality(qdir)], manual_model(FLASH, COMPUTE))
    dig = digits(frame)
    cols = COLUMNS + ["ms_per_token", "tok_s"]
    model = manual_model(FLASH, COMPUTE)
    for printed, r in zip(rows, obj["rows"]):
        want = {k: r[k] for k in COLUMNS if k in r}
        want["io_saved_gap_pp"] = r["io_saved_pct"] - r["io_saved_pct_replay"]
        want["read_mib_per_token"] = r["read_mib"] / obj["plain"]["tokens"]
        ms = COMPUTE + 1000.0 / FLASH * r["read_mib"] / obj["plain"]["tokens"]  # the model, written out
        assert float(model.predict_ms(r["read_mib"] * MIB / obj["plain"]["tokens"])) == pytest.approx(ms, rel=1e-12)
        want["ms_per_token"], want["tok_s"] = ms, 1000.0 / ms
        assert printed == [cell(c, want[c], dig) for c in cols], r["setting"]
    assert rows[1][1] == "0.25"  # F exactly, never "0.2"
    assert float(rows[2][cols.index("kl_mean")]) > 0  # a dropping setting's KL is not printed as 0
    # the CSV holds the same figures, the time included
    csv = pl.read_csv(report / "tables" / "quality.csv")
    for got, r in zip(csv.to_dicts(), obj["rows"]):
        assert got["ms_per_token"] == pytest.approx(COMPUTE + 10.0 * r["read_mib"] / obj["plain"]["tokens"], abs=2e-6)
        assert got["io_saved_pct_replay"] == pytest.approx(r["io_saved_pct_replay"], abs=1e-6)
    plain_ms = COMPUTE + 10.0 * obj["rows"][0]["read_mib_plain"] / obj["plain"]["tokens"]
    assert f"undropped: {cell('mib_per_token', obj['rows'][0]['read_mib_plain'] / obj['plain']['tokens'])} MiB read per " \
           f"token, {cell('ms', plain_ms)} ms/token" in sec
    # the model is named, and the figures are said to mean something only for trained weights
    assert "Model: m (qwen3_moe, 3 MoE layers x 8 experts, top-2), from Qwen3MoeForCausalLM." in sec
    assert "only meaningful for a real (trained) model" in sec
    assert (report / "quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![quality lost against reads avoided](quality.png)" in sec
    html = (report / "index.html").read_text()
    assert "<h2 id='quality-drop-cold-measured-in-the-model'>Quality (drop-cold measured in the model)</h2>" in html \
        and "reads avoided % (replay&#x27;s prediction)" in html


def test_time_with_a_per_miss_term_counts_expert_reads(qdir, tmp_path):
    res = load_quality(qdir)
    eb = int(open_trace(qdir / "plain").expert_bytes[0])
    m = CostModel(model="fit", terms="bytes+misses", intercept_ms=2.0, ms_per_mib=3.0, ms_per_miss=0.5)
    frame = quality_frame([res], m)
    for got, r in zip(frame.to_dicts(), res.obj["rows"]):
        misses = r["read_mib"] * MIB / eb / res.tokens
        assert got["ms_per_token"] == pytest.approx(2.0 + 3.0 * r["read_mib"] / res.tokens + 0.5 * misses, rel=1e-12)
    # quality.json alone: its expert sizes are unknown, so a per-miss model gives no time, and says so
    shutil.copy(qdir / "quality.json", tmp_path / "quality.json")
    alone = load_quality(tmp_path / "quality.json")
    assert any("no undropped trace plain/" in w for w in alone.warnings)
    f2 = quality_frame([alone], m)
    assert f2["ms_per_token"].null_count() == f2.height
    s = quality_section([alone], f2, m, tmp_path)
    assert any("needs the cost model's per-miss term" in t for t in s.text)
    assert any("Model: not recorded in quality.json" in t for t in s.text)


def test_random_weight_gguf_is_named_so_and_the_plot_is_reproducible(qdir, tmp_path):
    q = tmp_path / "q"
    shutil.copytree(qdir, q)
    meta = json.loads((q / "plain" / "trace.json").read_text())
    meta["model"]["name"] = "tiny-qwen3moe-L2-E8-k2-d64-seed1"  # engine_bridge.tinymodel's naming
    (q / "plain" / "trace.json").write_text(json.dumps(meta))
    res = load_all([q], open_trace(qdir / "plain"), "plain")
    assert res[0].random_weights and not load_quality(qdir).random_weights
    frame = quality_frame(res)
    s = quality_section(res, frame, None, tmp_path)
    assert any(t.startswith("**Random weights**") and "say nothing about a real model's quality" in t for t in s.text)
    assert any("model is named 'tiny-qwen3moe" in t for t in s.text)  # named differently from the trace: warned
    assert any(t.startswith("No cost model") for t in s.text) and "ms_per_token" not in frame.columns
    first = (tmp_path / "quality.png").read_bytes()
    quality_section(res, frame, None, tmp_path)
    assert (tmp_path / "quality.png").read_bytes() == first


def test_api_takes_one_result_and_a_report_without_one_says_why(qdir, tmp_path):
    from replay.api import write_report

    write_report(qdir / "plain", tmp_path / "a", quality=str(qdir), budgets_mib=[0.05], policies=["lru"])
    assert "| drop F=0.25 | 0.25 |" in _section((tmp_path / "a" / "index.md").read_text())
    assert run_cli("report", qdir / "plain", "-o", tmp_path / "b", "--budgets", "0.05", "--policies", "lru").code == 0
    # a section the trace cannot support is one entry of the report's single "Not in this report" line
    missing = next(l for l in (tmp_path / "b" / "index.md").read_text().splitlines() if l.startswith("*Not in this report:"))
    assert "the quality (drop-cold measured in the model) section: no quality result given (run 'moe-replay quality'" in missing


def _mutate(obj: dict, how: str) -> object:
    if how == "command":
        obj["command"] = "cache"
    elif how == "no-rows":
        obj["rows"] = []
    elif how == "missing-key":
        del obj["rows"][1]["kl_mean"]
    elif how == "not-a-number":
        obj["rows"][1]["kl_mean"] = "small"
    elif how == "share":
        obj["rows"][1]["top1_agree_pct"] = 140.0
    elif how == "plain":
        del obj["plain"]["tokens"]
    elif how == "both-settings":
        obj["rows"][1]["keep_k"] = 1
    elif how == "twice":
        obj["rows"][1]["setting"] = obj["rows"][0]["setting"]
    elif how == "list":
        return [obj]
    elif how == "gen-diverges":
        obj["generation"]["rows"][1]["diverges_at"] = -1
    elif how == "gen-share":
        obj["generation"]["rows"][1]["mass_lost_pct"] = None
    return obj


@pytest.mark.parametrize(("how", "needle"), [
    ("command", "is not a 'moe-replay quality' result"), ("no-rows", "holds no settings"), ("missing-key", "lacks 'kl_mean'"),
    ("not-a-number", "kl_mean = 'small', not a finite number"), ("share", "not a percentage"),
    ("plain", "\"plain\" must hold"), ("both-settings", "exactly one of frac"), ("twice", "appears twice"),
    ("list", "is not a 'moe-replay quality' result"), ("json", "is not a JSON quality result"),
    ("missing", "no such quality result"), ("empty-dir", "holds no quality.json"),
    ("gen-diverges", "diverges_at = -1, not a token index or null"), ("gen-share", "mass_lost_pct = None, not a percentage"),
])
def test_bad_quality_results_are_refused_before_anything_is_written(qdir, tmp_path, how, needle):
    bad = tmp_path / "bad"
    bad.mkdir()
    arg = bad / "quality.json"
    if how == "json":
        arg.write_text("{\"command\": \"quality\", \"rows\": [")
    elif how == "missing":
        arg = tmp_path / "nowhere"
    elif how == "empty-dir":
        arg = bad
    else:
        arg.write_text(json.dumps(_mutate(json.loads((qdir / "quality.json").read_text()), how)))
    out = tmp_path / "r"
    res = run_cli("report", qdir / "plain", "-o", out, "--quality", arg)
    assert res.code == 2
    assert_one_sentence_error(res, needle)
    assert str(arg.name) in res.err or str(arg) in res.err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".r")]


def test_a_quality_result_of_another_model_is_refused(qdir, synth_trace_dir, tmp_path):
    d = synth_trace_dir(layers=6, experts=16, top_k=2, embd=8, tokens=40, prompt_tokens=8)
    res = run_cli("report", d, "-o", tmp_path / "r", "--quality", qdir)
    assert res.code == 2
    assert_one_sentence_error(res, "quality.json: its model", "is not the trace", "give a quality result of the trace's model")
    assert not (tmp_path / "r").exists()


def test_generation_table_prints_quality_json_figures(qdir, report):
    """With --prompt, each setting's first diverging token and the run's drops beside the replay's,
    as quality.json holds them (printed with the table's digits; '-' for an identical generation)."""
    from replay.present.quality import GEN_COLUMNS

    gen = json.loads((qdir / "quality.json").read_text())["generation"]["rows"]
    md = (report / "index.md").read_text()
    table = md.split("**greedy generation per setting**")[1].split("\n\n")[1].splitlines()
    assert len(table) == 2 + len(gen)
    for line, r in zip(table[2:], gen):
        cells = [c.strip() for c in line.strip("|").split("|")]
        want = {"diverges_at": "-" if r["diverges_at"] is None else str(r["diverges_at"]),
                "tokens_generated": str(r["tokens_generated"]), "setting": r["setting"],
                "frac": "-" if r["frac"] is None else cell("frac", r["frac"]),
                "keep_k": "-" if r["keep_k"] is None else str(r["keep_k"])}
        for col, got in zip(GEN_COLUMNS, cells):
            assert got == want.get(col, cell(col, r[col])), (col, got, r)
    assert gen[0]["diverges_at"] is None  # F = 0 generates the undropped tokens exactly
    csv = pl.read_csv(report / "tables" / "quality_generation.csv")
    assert csv["text"].to_list() == [r["text"] for r in gen]


def test_verdict_states_the_measured_quality_as_quality_json_has_it(qdir, report):
    """With --quality the verdict gains a line per result: each setting's reads avoided (the replay's
    beside it) and quality lost, copied from quality.json (verdict.json) and printed from those rows."""
    from replay.present.quality import kl_text

    obj = json.loads((qdir / "quality.json").read_text())
    verdict = json.loads((report / "verdict.json").read_text())
    got = [r for r in verdict["rows"] if r["kind"] == "quality"]
    assert [r["setting"] for r in got] == [r["setting"] for r in obj["rows"]]
    for v, r in zip(got, obj["rows"]):
        for k in ("frac", "keep_k", "io_saved_pct", "io_saved_pct_replay", "ppl_delta_pct", "kl_mean", "kl_p95", "top1_agree_pct"):
            assert v[k] == r.get(k), k
        assert (v["policy"], v["budget_mib"], v["engine"]) == (obj["policy"], obj["budget_mib"], obj["engine"])
    md = (report / "index.md").read_text()
    line = next(ln for ln in md.split("## Verdict")[1].split("**Contents:**")[0].splitlines() if "measured in the model" in ln)
    for v in got:
        what = f"F = {cell('frac', v['frac'])}" if v["frac"] is not None else f"keep-k {v['keep_k']}"
        assert (f"{what}: {cell('io_saved_pct', v['io_saved_pct'])}% reads avoided (replay predicted "
                f"{cell('io_saved_pct', v['io_saved_pct_replay'])}%), perplexity {v['ppl_delta_pct']:+.2f}%, KL mean "
                f"{kl_text(v['kl_mean'], got)} nats, top-1 agreement {cell('top1_agree_pct', v['top1_agree_pct'])}%") in line
    assert "F = 0.25:" in line  # the parameter exactly, never rounded
    assert line.endswith("(#quality-drop-cold-measured-in-the-model)")
