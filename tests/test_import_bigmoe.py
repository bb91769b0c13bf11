"""The BigMoeOnEdge route_trace v1 importer: real traces, exact round trip, malformed input."""

from __future__ import annotations

import csv
import math
import string

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import real_files
from tests.helpers import assert_one_sentence_error, run_cli
from traces import open_trace
from traces.format.errors import UserError
from traces.importers.bigmoe import import_bigmoe

EXPECTED = {
    # model: (MoE layers, experts, top-k, prefill tokens, decode tokens, budget MiB, recorded hit %)
    "qwen": (48, 128, 6, 28, 128, 4000.0, 74.9),
    "gemma": (30, 128, 6, 29, 128, 4000.0, 76.8),
    "gptoss": (36, 128, 2, 85, 64, 3000.0, 32.4),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_trace_info(real_trace_dir, name):
    res = run_cli("info", real_trace_dir(name), "--json")
    assert res.code == 0, res.err
    obj = res.json()
    assert obj["command"] == "info"
    row = obj["rows"][0]
    layers, experts, k, pre, dec, budget, hit = EXPECTED[name]
    assert (row["moe_layers"], row["n_expert"], row["top_k"]) == (layers, experts, k)
    assert (row["tokens_prefill"], row["tokens_decode"]) == (pre, dec)
    assert row["recorded_budget_mib"] == budget and row["recorded_hit_pct_cum"] == hit
    assert row["complete"] is True and row["has_residency"] and row["has_metrics"]
    assert not row["has_logits"] and not row["has_gate_input"] and not row["has_router"]


def _csv_rows(path):
    with open(path) as fh:
        body = [ln for ln in fh if not ln.startswith("#")]
    return list(csv.DictReader(body))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_round_trip_reproduces_every_slot(real_trace_dir, name):
    csv_path, _ = real_files(name)
    tr = open_trace(real_trace_dir(name))
    a = tr.arrays()
    got = {}
    for i in range(a.n_rows):
        for s in range(tr.top_k):
            got[(int(a.turn[i]), int(a.phase[i]), int(a.step[i]), int(a.layer[i]), s)] = (
                int(a.experts[i, s]), float(a.weights[i, s]), int(a.residency[i, s]), int(a.read_bytes[i, s]))
    rows = _csv_rows(csv_path)
    assert len(rows) == len(got)
    for r in rows:
        key = (int(r["turn"]), int(r["phase"]), int(r["step"]), int(r["layer"]), int(r["slot"]))
        ex, w, res, rb = got[key]
        assert ex == int(r["expert"]) and res == int(r["residency"]) and rb == int(r["expert_bytes"])
        assert w == float(np.float32(float(r["weight"])))  # exact at float32


def test_real_trace_batches_and_metrics(real_trace_dir):
    tr = open_trace(real_trace_dir("qwen"))
    a = tr.arrays()
    pre = a.phase == 0
    assert np.unique(a.batch[pre]).tolist() == [0]  # the prompt was one pass
    dec_batches = a.batch[~pre]
    assert len(np.unique(dec_batches)) == 128  # one batch per decoded token
    m = tr.metrics()
    assert m is not None and m.height == 128
    assert {"wall_ms", "io_ms", "read_bytes", "cache_hit_pct"} <= set(m.columns)
    assert tr.expert_bytes[tr.moe_layers].min() > 0


def test_import_is_byte_identical(tmp_path):
    csv_path, metrics = real_files("gptoss")
    import_bigmoe(csv_path, tmp_path / "a", metrics=metrics)
    import_bigmoe(csv_path, tmp_path / "b", metrics=metrics)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert files
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


# -- malformed input ---------------------------------------------------------------------------

PREAMBLE = ["# route_trace v1", "# model=/x/m.gguf arch=qwen3moe n_layer=2 n_expert=4 n_expert_used=2",
            "# layer=0 expert_bytes=1000 dense_bytes=10", "# layer=1 expert_bytes=2000 dense_bytes=10"]
HEADER = "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes"


def good_rows():
    rows = []
    for phase, step in [(0, 0), (0, 1), (1, 2), (1, 3)]:
        for layer in range(2):
            for slot, (e, w) in enumerate([(step % 4, 0.6), ((step + 1) % 4, 0.4)]):
                rows.append(f"0,{phase},{step},{layer},{slot},{e},{w},0,{1000 * (layer + 1)}")
    return rows


def write_csv(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_minimal_good_csv_imports(tmp_path):
    src = write_csv(tmp_path / "a.route.csv", PREAMBLE + [HEADER] + good_rows())
    res = run_cli("import", "bigmoe", src, tmp_path / "out", "--json")
    assert res.code == 0, res.err
    row = res.json()["rows"][0]
    assert (row["tokens_prefill"], row["tokens_decode"], row["moe_layers"]) == (2, 2, 2)


def _mutations():
    rows = good_rows()
    return {
        "missing preamble": ([HEADER] + rows, "preamble"),
        "no model line": (PREAMBLE[:1] + PREAMBLE[2:] + [HEADER] + rows, "model"),
        "wrong header": (PREAMBLE + ["turn,phase,step"] + rows, "header"),
        "too few fields": (PREAMBLE + [HEADER] + rows[:3] + ["0,1,2,0,0,1"] + rows[3:], "fields"),
        "non-numeric expert": (PREAMBLE + [HEADER] + [rows[0].replace(",0,0.6,", ",x,0.6,")] + rows[1:], "not an integer"),
        "non-numeric weight": (PREAMBLE + [HEADER] + [rows[0].replace("0.6", "abc")] + rows[1:], "weight"),
        "partial NaN weights": (PREAMBLE + [HEADER] + [rows[0].replace("0.6", "nan")] + rows[1:], "NaN"),
        "infinite weight": (PREAMBLE + [HEADER] + [rows[0].replace("0.6", "inf")] + rows[1:], "infinite"),
        "duplicate row": (PREAMBLE + [HEADER] + rows + [rows[-1]], "duplicates"),
        "expert out of range": (PREAMBLE + [HEADER] + [rows[0].replace(",0,0.6,", ",9,0.6,")] + rows[1:], "expert id"),
        "missing slot": (PREAMBLE + [HEADER] + rows[1:], "slots"),
        "same expert twice": (PREAMBLE + [HEADER] + [rows[0].replace(",0,0.6,", ",1,0.6,")] + rows[1:], "twice"),
        "zero expert_bytes": (PREAMBLE[:3] + ["# layer=1 expert_bytes=0 dense_bytes=10", HEADER] + rows, "expert_bytes"),
        "no expert_bytes line": (PREAMBLE[:3] + [HEADER] + rows, "expert_bytes"),
        "bad phase": (PREAMBLE + [HEADER] + [r.replace("0,1,2,", "0,7,2,", 1) for r in rows], "phase"),
        "bad residency": (PREAMBLE + [HEADER] + [rows[0][:-6] + "5,1000"] + rows[1:], "residency"),
        "dense model": ([PREAMBLE[0], "# model=/x/d.gguf arch=llama n_layer=2 n_expert=0 n_expert_used=0"] + PREAMBLE[2:]
                        + [HEADER] + rows, "not a MoE model"),
        "no rows": (PREAMBLE + [HEADER], "no rows"),
        "expert_bytes beyond int64": (PREAMBLE[:3] + ["# layer=1 expert_bytes=99999999999999999999999 dense_bytes=10", HEADER]
                                      + rows, "expert_bytes"),
        "negative weight": (PREAMBLE + [HEADER] + [rows[0], rows[1].replace("0.4", "-0.4")] + rows[2:], "negative"),
        "weights not in rank order": (PREAMBLE + [HEADER] + [rows[0].replace("0.6", "0.3")] + rows[1:], "rank order"),
        "empty file": ([""], "preamble"),
    }


@pytest.mark.parametrize("case", sorted(_mutations()))
def test_malformed_csv_one_sentence_no_output(tmp_path, case):
    lines, needle = _mutations()[case]
    src = write_csv(tmp_path / "bad.route.csv", lines)
    out = tmp_path / "out"
    res = run_cli("import", "bigmoe", src, out)
    assert_one_sentence_error(res, "bad.route.csv", needle)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no staging left behind


def test_missing_file_and_existing_output(tmp_path):
    assert_one_sentence_error(run_cli("import", "bigmoe", tmp_path / "nope.csv", tmp_path / "o"), "no such file")
    src = write_csv(tmp_path / "a.route.csv", PREAMBLE + [HEADER] + good_rows())
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep").write_text("x")
    assert_one_sentence_error(run_cli("import", "bigmoe", src, tmp_path / "o"), "not empty")
    assert (tmp_path / "o" / "keep").read_text() == "x"
    assert run_cli("import", "bigmoe", src, tmp_path / "o", "--force").code == 0
    assert not (tmp_path / "o" / "keep").exists()


def test_metrics_mismatch_and_malformed(tmp_path):
    src = write_csv(tmp_path / "a.route.csv", PREAMBLE + [HEADER] + good_rows())
    hdr = "step,steps,wall_ms,io_ms,compute_ms,read_bytes,cache_hit_pct,stall_ms,mgmt_ms,majflt,cpu_ms"
    row = "1,2,10.0,5.0,4.0,6000,50.0,1.0,0.5,0,20.0"  # read_bytes covers the 6000 expert bytes per token
    summ = "# summary tokens=2 cache_hit_pct=50.0 cache_budget_MiB=1.0"
    good = write_csv(tmp_path / "a.metrics", [hdr, row, row.replace("1,2,", "2,2,", 1), summ])
    assert run_cli("import", "bigmoe", src, tmp_path / "ok", "--metrics", good).code == 0
    assert open_trace(tmp_path / "ok").recorded["budget_mib"] == 1.0
    short = write_csv(tmp_path / "s.metrics", [hdr, row, summ])
    assert_one_sentence_error(run_cli("import", "bigmoe", src, tmp_path / "o1", "--metrics", short), "decode tokens")
    bad = write_csv(tmp_path / "b.metrics", [hdr, row.replace("10.0", "ten"), row, summ])
    assert_one_sentence_error(run_cli("import", "bigmoe", src, tmp_path / "o2", "--metrics", bad), "not a number")
    nosum = write_csv(tmp_path / "n.metrics", [hdr, row, row])
    assert_one_sentence_error(run_cli("import", "bigmoe", src, tmp_path / "o3", "--metrics", nosum), "summary")
    for o in ("o1", "o2", "o3"):
        assert not (tmp_path / o).exists()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_csv_never_tracebacks(tmp_path_factory, data):
    """Random damage to a good file: either a valid trace or one clear sentence, never a traceback,
    never a half-written output directory."""
    tmp = tmp_path_factory.mktemp("fuzz")
    lines = PREAMBLE + [HEADER] + good_rows()
    kind = data.draw(st.sampled_from(["truncate", "replace_field", "drop_line", "dup_line", "garbage_line", "swap_char"]))
    i = data.draw(st.integers(0, len(lines) - 1))
    if kind == "truncate":
        text = "\n".join(lines)
        text = text[: data.draw(st.integers(0, len(text)))]
        lines = text.split("\n")
    elif kind == "replace_field" and not lines[i].startswith("#"):
        f = lines[i].split(",")
        j = data.draw(st.integers(0, len(f) - 1))
        f[j] = data.draw(st.sampled_from(["", "-1", "nan", "1e9", "x", "4294967296", "3.5", "99", "inf", " "]))
        lines[i] = ",".join(f)
    elif kind == "drop_line":
        del lines[i]
    elif kind == "dup_line":
        lines.insert(i, lines[i])
    elif kind == "garbage_line":
        lines.insert(i, data.draw(st.text(alphabet=string.printable.replace("\n", "").replace("\r", ""), max_size=40)))
    elif kind == "swap_char" and lines[i]:
        j = data.draw(st.integers(0, len(lines[i]) - 1))
        lines[i] = lines[i][:j] + data.draw(st.sampled_from(list(",#=x9-. "))) + lines[i][j + 1:]
    src = write_csv(tmp / "f.route.csv", lines)
    out = tmp / "out"
    try:
        import_bigmoe(src, out)
    except UserError as e:
        msg = str(e)
        assert "\n" not in msg and "f.route.csv" in msg
        assert not out.exists()
        return
    tr = open_trace(out)  # whatever was accepted must be a valid trace
    assert tr.n_rows > 0
    assert not math.isnan(float(tr.expert_bytes[tr.moe_layers].min()))
