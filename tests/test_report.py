"""The report: answer first (verdict, contents), every section present (or listed on the one line saying
why not), every file non-empty, reruns identical."""

from __future__ import annotations

import pytest

from tests.helpers import assert_one_sentence_error, run_cli

EXPECTED_SECTIONS = ["Trace summary", "Predictor accuracy (decode)", "Cost model", "Expert cache", "Expert popularity",
                     "Drop-cold trade-off", "Prefetch and retention what-ifs", "Quality (drop-cold measured in the model)"]


def _report(trace, out):
    from replay.present.report import anchor

    res = run_cli("report", trace, "-o", out)
    assert res.code == 0, res.err
    md = (out / "index.md").read_text()
    html = (out / "index.html").read_text()
    # answer first: the verdict, then the contents, then the sections
    assert md.index("## Verdict") < md.index("**Contents:**") < md.index("## Trace summary")
    assert html.index("<h2 id='verdict'>Verdict</h2>") < html.index("<nav>") < html.index("<h2 id='trace-summary'>")
    missing = next((ln for ln in md.splitlines() if ln.startswith("*Not in this report:")), "")
    for title in EXPECTED_SECTIONS:
        shown = f"## {title}" in md and f"<h2 id='{anchor(title)}'>{title}</h2>" in html
        # a section the trace cannot support is not a heading: it is named on the one "not in this report" line
        assert shown != (f"the {title.lower()} section" in missing), title
        if shown:
            assert f"[{title}](#{anchor(title)})" in md and f"<a href='#{anchor(title)}'>{title}</a>" in html
    for f in out.rglob("*"):
        if f.is_file():
            assert f.stat().st_size > 0, f
    assert "data:image/png;base64," in html  # self-contained
    return md


@pytest.mark.parametrize("name", ["qwen", "gemma", "gptoss"])
def test_report_on_real_traces(real_trace_dir, tmp_path, name):
    md = _report(real_trace_dir(name), tmp_path / "r")
    assert (tmp_path / "r" / "drop_tradeoff.png").is_file() and (tmp_path / "r" / "tables" / "drop_static.csv").is_file()
    assert (tmp_path / "r" / "tables" / "drop_closed.csv").is_file()
    assert "Fitted on this run's recorded decode tokens" in md


def test_report_on_synthetic_trace_says_why_not(synth_trace_dir, tmp_path):
    d = synth_trace_dir(layers=6, experts=16, top_k=2, embd=8, tokens=40, prompt_tokens=8)
    md = _report(d, tmp_path / "r")
    assert "Static mode needs the engine's recorded residency" in md and "Closed loop: LRU at" in md
    assert "*Not in this report: the cost model section: the trace has no recorded per-token engine metrics" in md
    assert "## Cost model" not in md and md.count("Not in this report") == 1


def test_report_is_byte_identical(synth_trace_dir, tmp_path):
    d = synth_trace_dir(layers=6, experts=16, top_k=2, embd=8, tokens=40, prompt_tokens=8)
    for n in ("a", "b"):
        assert run_cli("report", d, "-o", tmp_path / n).code == 0
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert len(files) >= 5
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_report_refuses_existing_output(synth_trace_dir, tmp_path):
    d = synth_trace_dir(layers=6, experts=16, top_k=2, embd=8, tokens=40, prompt_tokens=8)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "x").write_text("keep")
    assert_one_sentence_error(run_cli("report", d, "-o", tmp_path / "r"), "not empty")
    assert (tmp_path / "r" / "x").read_text() == "keep"


def test_report_prints_parameters_exactly_and_labels_the_dropped_shares(synth_trace_dir, tmp_path):
    """F = 0.25 and 0.75 in the drop tables (they used to print as 0.2 and 0.8: other thresholds)."""
    d = synth_trace_dir(layers=6, experts=16, top_k=2, embd=8, tokens=40, prompt_tokens=8)
    md = _report(d, tmp_path / "r")
    drop = md.split("## Drop-cold trade-off")[1].split("\n## ")[0]
    fracs = [ln.split("|")[2].strip() for ln in drop.splitlines() if ln.startswith("| closed |")]
    assert fracs == ["0.25", "0.5", "0.75", "1", "1.5"]
    assert "Routings with a drop (%)" in drop and "Experts dropped (%, engine's 'routings dropped')" in drop
    assert "| Hit % (decode, no drop) | Hit % (decode, with drop) |" in drop


def test_one_precision_per_quantity():
    from replay.present.format import PRECISION, cell, text_table

    assert cell("frac", 0.25) == "0.25" and cell("budget_mib", 390.5, digits=0) == "390.5" and cell("keep_k", 3) == "3"
    for col in ("hit_pct_decode", "hit_pct", "io_saved_pct", "experts_dropped_pct", "tok_s_err_pct", "heldout_mape_pct"):
        assert cell(col, 12.3456) == f"{12.3456:.{PRECISION['pct']}f}", col
    for col in ("tok_s", "tok_s_baseline", "best_plain_tok_s", "predicted_tok_s"):
        assert cell(col, 5.6789) == f"{5.6789:.{PRECISION['tok_s']}f}", col
    for col in ("ms_per_token", "ms_per_token_baseline", "best_plain_ms_per_token", "ms_per_token_ci95"):
        assert cell(col, 176.849) == f"{176.849:.{PRECISION['ms']}f}", col
    assert text_table([{"frac": 0.75, "io_saved_pct": 45.04}], ["frac", "io_saved_pct"]).splitlines()[-1].split() == ["0.75", "45.0"]
