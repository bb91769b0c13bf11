"""Hostile inputs (issue 14, items 5, 7, 8, 12): every one is refused with one sentence naming the
file or option, exit 2, and nothing written -- or, where it is valid, answered correctly."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import SHARED_DATA
from tests.helpers import assert_one_sentence_error, rewrite_part, rewrite_wide, run_cli
from traces import TraceError, TraceWriter, open_trace
from traces.format.errors import UserError
from traces.format.schema import default_gating

# -- a small BigMoeOnEdge run: route CSV + .metrics, consistent with each other ------------------

PRE = "# route_trace v1"
MODEL = "# model=/x/m.gguf arch=qwen3moe n_layer=2 n_expert=4 n_expert_used=2"
LAYERS = ["# layer=0 expert_bytes=1000 dense_bytes=10", "# layer=1 expert_bytes=2000 dense_bytes=10"]
HEADER = "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes"
METRICS_HEADER = "step,steps,wall_ms,io_ms,compute_ms,read_bytes,cache_hit_pct,stall_ms,mgmt_ms,majflt,cpu_ms"
N_PROMPT, N_DECODE = 2, 12


def route_rows(weights=(0.6, 0.4)):
    rows = []
    for i in range(N_PROMPT + N_DECODE):
        phase = 0 if i < N_PROMPT else 1
        for layer in range(2):
            for slot in range(2):
                e = (i + slot + layer) % 4
                res = (i + layer) % 2 if slot else 0  # slot 0 always misses, slot 1 every other token
                rb = 0 if res else 1000 * (layer + 1)
                rows.append(f"0,{phase},{i},{layer},{slot},{e},{weights[slot]},{res},{rb}")
    return rows


def expert_bytes_per_token(i):
    return sum(1000 * (layer + 1) * (1 + (0 if (i + layer) % 2 else 1)) for layer in range(2))


def metrics_lines(wall=None, budget="1.0", extra=0):
    out = [METRICS_HEADER]
    for t in range(N_DECODE):
        i = N_PROMPT + t
        rb = expert_bytes_per_token(i) + 100 + extra
        w = wall[t] if wall is not None else 20.0 + rb / 1000.0 + (t % 3)
        out.append(f"{t + 1},{N_DECODE},{w},5.0,4.0,{rb},50.0,1.0,0.5,0,20.0")
    out.append(f"# summary tokens={N_DECODE} n_prompt={N_PROMPT} cache_hit_pct=50.0 cache_budget_MiB={budget}")
    return out


def write(path: Path, lines, prefix: bytes = b"") -> Path:
    path.write_bytes(prefix + ("\n".join(lines) + "\n").encode())
    return path


def run_files(tmp: Path, rows=None, metrics=None, preamble=None):
    csv = write(tmp / "run.route.csv", (preamble or [PRE, MODEL, *LAYERS]) + [HEADER] + (rows or route_rows()))
    met = write(tmp / "run.metrics", metrics or metrics_lines())
    return csv, met


def nothing_left(tmp: Path, name: str) -> None:
    """No destination and no staging directory beside it."""
    assert not (tmp / name).exists()
    assert not [p for p in tmp.iterdir() if p.name.startswith(f".{name}.")]


def refused_import(tmp: Path, csv: Path, *needles: str, metrics: Path | None = None) -> None:
    args = ["import", "bigmoe", csv, tmp / "out"] + (["--metrics", metrics] if metrics else [])
    res = run_cli(*args)
    assert res.code == 2, res.err
    assert_one_sentence_error(res, *needles)
    nothing_left(tmp, "out")


def test_good_run_imports_and_fits(tmp_path):
    csv, met = run_files(tmp_path)
    res = run_cli("import", "bigmoe", csv, tmp_path / "t", "--metrics", met)
    assert res.code == 0, res.err
    res = run_cli("cost", "fit", tmp_path / "t", "--json")
    assert res.code == 0, res.err


# -- item 5: validate everything before the rename; bound every integer --------------------------

@pytest.mark.parametrize("line, needle", [
    ("# layer=1 expert_bytes=99999999999999999999999 dense_bytes=10", "expert_bytes"),
    ("# layer=1 expert_bytes=2000 dense_bytes=99999999999999999999999", "dense_bytes"),
    ("# layer=1 expert_bytes=2000000000000000 dense_bytes=10", "expert_bytes"),
])
def test_import_huge_sizes_refused_before_the_rename(tmp_path, line, needle):
    csv, _ = run_files(tmp_path, preamble=[PRE, MODEL, LAYERS[0], line])
    refused_import(tmp_path, csv, "run.route.csv", needle)


def test_import_step_beyond_int32_refused(tmp_path):
    rows = [r.replace("0,1,13,", "0,1,4294967296,", 1) for r in route_rows()]
    csv, _ = run_files(tmp_path, rows=rows)
    refused_import(tmp_path, csv, "run.route.csv", "step")


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m["expert_bytes"].__setitem__(1, 99999999999999999999999), "expert_bytes[1]"),
    (lambda m: m["dense_bytes"].__setitem__(0, 1 << 62), "dense_bytes[0]"),
    (lambda m: m["model"].update(n_layer=1 << 20, moe_layers=[0, 1]), "n_layer"),
    (lambda m: m.update(gate_input_dtype="int8"), "gate_input_dtype"),
    (lambda m: m.update(rows="many"), "'rows'"),
])
def test_trace_json_sizes_bounded(tmp_path, edit, needle):
    csv, met = run_files(tmp_path)
    assert run_cli("import", "bigmoe", csv, tmp_path / "t", "--metrics", met).code == 0
    meta = json.loads((tmp_path / "t" / "trace.json").read_text())
    edit(meta)
    (tmp_path / "t" / "trace.json").write_text(json.dumps(meta))
    for verb in (["info"], ["cache", "--budgets", "1"]):
        assert_one_sentence_error(run_cli(verb[0], tmp_path / "t", *verb[1:]), "trace.json", needle)


@pytest.mark.parametrize("args, needle", [
    (["--seed", "-1"], "--seed"),
    (["--seed", str(1 << 64)], "--seed"),
    (["--drift", "inf"], "--drift"),
    (["--drift", "nan"], "--drift"),
    (["--skew", "1e308"], "--skew"),
    (["--layers", "40000"], "--layers"),
    (["--tokens", str(1 << 31)], "--tokens"),
])
def test_synth_options_bounded(tmp_path, args, needle):
    res = run_cli("synth", tmp_path / "s", "--layers", "2", "--experts", "8", "--top-k", "2", "--embd", "8",
                  "--tokens", "4", "--prompt-tokens", "2", *args)
    assert res.code == 2
    assert_one_sentence_error(res, needle)
    nothing_left(tmp_path, "s")


@pytest.fixture(scope="module")
def small_synth(tmp_path_factory):
    out = tmp_path_factory.mktemp("syn") / "s"
    res = run_cli("synth", out, "--layers", "3", "--experts", "8", "--top-k", "2", "--embd", "8", "--tokens", "24",
                  "--prompt-tokens", "4")
    assert res.code == 0, res.err
    return out


@pytest.mark.parametrize("args, needle", [
    (["cache", "--budgets", "1e300"], "--budgets"),
    (["cache", "--budgets", "1", "--validate", "--budget-mib", "1e300"], "--budget-mib"),
    (["cache", "--budgets", "1", "--policies", "random", "--seed", str(10 ** 23)], "--seed"),
    (["drop", "--mode", "closed", "--budget-mib", "1e300"], "--budget-mib"),
    (["prefetch", "--budget-mib", "1e300"], "--budget-mib"),
    (["prefetch", "--budget-mib", "4", "--cap", str(10 ** 20)], "--cap"),
])
def test_budgets_seeds_caps_bounded(small_synth, args, needle):
    res = run_cli(args[0], small_synth, *args[1:])
    assert res.code == 2, res.err
    assert_one_sentence_error(res, needle)


def test_library_budget_bounded():
    from replay.core.simulate import budget_bytes

    with pytest.raises(UserError, match="at most 2"):
        budget_bytes(1e300)
    assert budget_bytes(2.0) == 2 << 20


# -- item 7: silent wrong answers -----------------------------------------------------------------

def test_negative_router_weight_refused_by_importer(tmp_path):
    csv, _ = run_files(tmp_path, rows=route_rows(weights=(0.6, -0.4)))
    refused_import(tmp_path, csv, "run.route.csv", "line 7", "negative")


def test_unranked_weights_refused_by_importer(tmp_path):
    csv, _ = run_files(tmp_path, rows=route_rows(weights=(0.4, 0.6)))
    refused_import(tmp_path, csv, "run.route.csv", "line 6", "layer 0", "rank order")


def _small_trace(path: Path, weights, gating=None, columns=(), extra=None) -> Path:
    meta = {
        "model": {"name": "t", "arch": "test", "n_layer": 2, "moe_layers": [0, 1], "n_expert": 4, "top_k": 2,
                  "top_k_native": 2, "n_embd": 4},
        "expert_bytes": [1000, 1000], "dense_bytes": [None, None],
        "gating": gating or default_gating("softmax", True), "provenance": {"engine": "test"},
    }
    path.mkdir(parents=True)
    w = TraceWriter(path, meta, columns=columns)
    for t in range(6):
        for layer in range(2):
            w.append(turn=0, batch=t, phase=1, step=t, layer=layer, experts=[[t % 4, (t + 1) % 4]],
                     weights=[weights(t, layer)], **(extra(t, layer) if extra else {}))
    w.close()
    return path


def _rewrite_weights(trace: Path, fn) -> None:
    def edit(t: pa.Table) -> pa.Table:
        w = np.array(t.column("weights").to_pylist(), dtype=np.float32)
        fn(w)
        arr = pa.FixedSizeListArray.from_arrays(pa.array(w.reshape(-1), type=pa.float32()), 2)
        i = t.schema.get_field_index("weights")
        return t.set_column(i, t.schema.field(i), arr)

    rewrite_part(trace / "routings" / "part-00000.parquet", edit)


def test_reader_refuses_negative_weights(tmp_path):
    tr = _small_trace(tmp_path / "t", lambda t, l: [0.7, 0.3])
    _rewrite_weights(tr, lambda w: w.__setitem__((3, 1), -0.3))
    with pytest.raises(TraceError, match="part-00000.parquet") as e:
        open_trace(tr)
    assert "row 3 (layer 1)" in str(e.value) and "negative" in str(e.value)
    assert_one_sentence_error(run_cli("drop", tr), "part-00000.parquet", "negative")


def test_reader_refuses_unranked_weights_unless_selection_bias(tmp_path):
    tr = _small_trace(tmp_path / "t", lambda t, l: [0.7, 0.3])
    _rewrite_weights(tr, lambda w: w.__setitem__(5, [0.2, 0.8]))
    assert_one_sentence_error(run_cli("drop", tr), "part-00000.parquet", "row 5 (layer 1)", "rank order")
    # With a selection bias the rank order is by biased score: the same weights are valid.
    g = default_gating("sigmoid", True)
    g["selection_bias"] = True
    ok = _small_trace(tmp_path / "b", lambda t, l: [0.7, 0.3], gating=g)
    _rewrite_weights(ok, lambda w: w.__setitem__(5, [0.2, 0.8]))
    assert open_trace(ok).arrays().weights[5].tolist() == pytest.approx([0.2, 0.8])


def test_nan_weights_of_a_whole_routing_still_accepted(tmp_path):
    tr = _small_trace(tmp_path / "t", lambda t, l: [np.nan, np.nan] if t == 2 else [0.7, 0.3])
    assert np.isnan(open_trace(tr).arrays().weights[4]).all()


@pytest.mark.parametrize("weights, logits, needle", [
    ([0.5, -0.1], None, "weights"),
    ([np.inf, 0.1], None, "weights"),
    ([0.5, np.nan], None, "weights"),
    ([0.5, 0.1], [0.0, np.nan, 1.0, 2.0], "logits"),
    ([0.5, 0.1], [0.0, np.inf, 1.0, 2.0], "logits"),
])
def test_writer_refuses_non_finite_or_negative(tmp_path, weights, logits, needle):
    meta = {
        "model": {"name": "t", "arch": "test", "n_layer": 1, "moe_layers": [0], "n_expert": 4, "top_k": 2,
                  "top_k_native": 2, "n_embd": None},
        "expert_bytes": [1000], "dense_bytes": [None], "gating": default_gating("softmax", True),
        "provenance": {"engine": "test"},
    }
    (tmp_path / "t").mkdir()
    cols = ("logits",) if logits is not None else ()
    w = TraceWriter(tmp_path / "t", meta, columns=cols)
    opt = {"logits": [logits]} if logits is not None else {}
    with pytest.raises(UserError, match=needle):
        w.append(turn=0, batch=0, phase=1, step=0, layer=0, experts=[[0, 1]], weights=[weights], **opt)


def test_synth_extreme_skew_within_bounds_stays_exact(tmp_path):
    """The largest skew synth accepts still writes finite logits and ctrl reads 100%."""
    out = tmp_path / "s"
    res = run_cli("synth", out, "--layers", "2", "--experts", "8", "--top-k", "2", "--embd", "8", "--tokens", "8",
                  "--prompt-tokens", "0", "--skew", "1000", "--drift", "1000")
    assert res.code == 0, res.err
    t = open_trace(out).table(["logits"])
    assert np.isfinite(np.array(t.column("logits").to_pylist())).all()
    res = run_cli("predict", out, "--predictors", "ctrl", "--json")
    assert res.code == 0, res.err
    row = [r for r in res.json()["rows"] if r["layer"] is None][0]
    assert row["whole_acc_pct"] == 100.0


def test_metrics_of_another_run_refused(tmp_path):
    csv, _ = run_files(tmp_path)
    fewer = [ln if ln.startswith(("#", "step")) else ln.replace(f",{ln.split(',')[5]},", ",500,", 1)
             for ln in metrics_lines()]
    met = write(tmp_path / "other.metrics", fewer)
    refused_import(tmp_path, csv, "other.metrics", "not the metrics of the run", metrics=met)
    prompt = [ln.replace(f"n_prompt={N_PROMPT}", "n_prompt=29") for ln in metrics_lines()]
    refused_import(tmp_path, csv, "n_prompt=29", metrics=write(tmp_path / "p.metrics", prompt))


@pytest.mark.skipif(not (SHARED_DATA / "qwen.route.csv").is_file(), reason="real traces absent")
def test_real_qwen_with_gemma_metrics_refused(tmp_path):
    refused_import(tmp_path, SHARED_DATA / "qwen.route.csv", "gemma.metrics", "not the metrics of the run",
                   metrics=SHARED_DATA / "gemma.metrics")


@pytest.mark.parametrize("value, needle", [
    ("1e308", "more than a day"), ("-5", "negative"), ("0", "wall_ms is not > 0"),
])
def test_implausible_wall_ms_refused(tmp_path, value, needle):
    wall = [20.0] * N_DECODE
    wall[4] = value
    csv, met = run_files(tmp_path, metrics=metrics_lines(wall=wall))
    refused_import(tmp_path, csv, "run.metrics", "line 6", needle, metrics=met)
    # The same file given to `cost fit --metrics` for a trace imported without one.
    assert run_cli("import", "bigmoe", csv, tmp_path / "bare").code == 0
    assert_one_sentence_error(run_cli("cost", "fit", tmp_path / "bare", "--metrics", met), "run.metrics", needle)


def test_cost_fit_refuses_absurd_coefficients():
    import polars as pl

    from replay.analyses.cost_model import fit_candidates

    f = pl.DataFrame({"wall_ms": [1e300, 1.0] * 8, "read_bytes": [float(1 << 20), 0.0] * 8, "misses": [1.0, 0.0] * 8})
    with pytest.raises(UserError, match="not plausible"):
        fit_candidates(f, "src")


def _cost_file(path: Path, **row) -> Path:
    base = {"model": "wall_ms = intercept_ms + ms_per_mib * read_mib", "terms": "bytes", "intercept_ms": 50.0,
            "ms_per_mib": 0.5, "selected": True}
    base.update(row)
    path.write_text(json.dumps({"command": "cost fit", "rows": [base]}))
    return path


@pytest.mark.parametrize("row, needle", [
    ({"ms_per_mib": -0.6}, "ms_per_mib"),
    ({"ms_per_mib": 0.0}, "ms_per_mib"),
    ({"ms_per_miss": -3.0}, "ms_per_miss"),
    ({"intercept_ms": 9.4e304}, "intercept_ms"),
    ({"tokens_fit": "abc"}, "tokens_fit"),
    ({"r2": "high"}, "r2"),
    ({"notes": 5}, "notes"),
])
def test_cost_model_file_validated(tmp_path, small_synth, row, needle):
    f = _cost_file(tmp_path / "m.json", **row)
    res = run_cli("drop", small_synth, "--cost-model", f)
    assert res.code == 2, res.out
    assert_one_sentence_error(res, "m.json", needle)


def test_manual_cost_model_validated(small_synth):
    res = run_cli("cache", small_synth, "--budgets", "1", "--flash-mib-s", "1000", "--compute-ms", "1e300")
    assert_one_sentence_error(res, "--compute-ms")
    res = run_cli("cache", small_synth, "--budgets", "1", "--flash-mib-s", "1e-12", "--compute-ms", "10")
    assert_one_sentence_error(res, "--flash-mib-s")


def _ctrl_warning(path: Path) -> str:
    res = run_cli("predict", path, "--predictors", "ctrl", "--json")
    assert res.code == 0, res.err
    (w,) = res.json()["warnings"]
    return w


def test_nan_gate_input_named_not_blamed_on_near_ties(tmp_path, small_synth):
    tr = tmp_path / "t"
    shutil.copytree(small_synth, tr)
    part = tr / "routings" / "part-00000.parquet"
    lay = pq.read_table(part, columns=["layer"]).column("layer").to_numpy()
    row = int(np.flatnonzero(lay == 1)[-1])
    rewrite_wide(part, "gate_input", lambda g: g.__setitem__((row, 3), np.nan))
    w = _ctrl_warning(tr)
    assert "layer 1: 1 routing(s) have a gate input holding NaN" in w
    assert "near-ties" not in w and "float16" not in w


def test_nan_router_matrix_named(tmp_path, small_synth):
    tr = tmp_path / "t"
    shutil.copytree(small_synth, tr)
    t = pq.read_table(tr / "router.parquet")
    w = np.array(t.column("weight").to_pylist(), dtype=np.float32)
    lay = t.column("layer").to_numpy()
    w[lay == 2] = np.nan
    i = t.schema.get_field_index("weight")
    arr = pa.FixedSizeListArray.from_arrays(pa.array(w.reshape(-1), type=pa.float32()), w.shape[1])
    pq.write_table(t.set_column(i, t.schema.field(i), arr), tr / "router.parquet")
    warning = _ctrl_warning(tr)
    assert "router.parquet's matrix or selection bias for layer 2 holds NaN" in warning
    assert "near-ties" not in warning


# -- item 8: unvalidated parts of a trace -----------------------------------------------------------

@pytest.fixture
def imported(tmp_path):
    csv, met = run_files(tmp_path)
    assert run_cli("import", "bigmoe", csv, tmp_path / "t", "--metrics", met).code == 0
    return tmp_path / "t"


@pytest.mark.parametrize("recorded, needle", [
    ({"budget_mib": "4000MiB"}, "recorded.budget_mib"),
    ({"budget_mib": -1}, "recorded.budget_mib"),
    ({"budget_mib": 1.0, "cache_hit_pct_cum": 250.0}, "recorded.cache_hit_pct_cum"),
    ({"policy": 3}, "recorded.policy"),
    ([1, 2], "'recorded'"),
])
def test_recorded_block_validated(imported, recorded, needle):
    meta = json.loads((imported / "trace.json").read_text())
    meta["recorded"] = recorded
    (imported / "trace.json").write_text(json.dumps(meta))
    assert_one_sentence_error(run_cli("info", imported), "trace.json", needle)


def test_importer_refuses_a_string_budget(tmp_path):
    csv, met = run_files(tmp_path, metrics=metrics_lines(budget="4000MiB"))
    refused_import(tmp_path, csv, "run.metrics", "cache_budget_MiB=4000MiB", metrics=met)


def test_garbage_metrics_parquet_refused_on_open(imported):
    (imported / "metrics.parquet").write_bytes(b"PAR1 this is not parquet PAR1")
    for verb in (["info"], ["cost", "fit"]):
        assert_one_sentence_error(run_cli(verb[0], *verb[1:], imported), "metrics.parquet", "not a readable Parquet")


@pytest.mark.parametrize("mutate, needle", [
    (lambda t: t.set_column(t.schema.get_field_index("wall_ms"), "wall_ms", pa.array([np.nan] * t.num_rows)),
     "wall_ms is not finite"),
    (lambda t: t.set_column(t.schema.get_field_index("wall_ms"), "wall_ms", pa.array([1e308] * t.num_rows)),
     "more than a day"),
    (lambda t: t.set_column(t.schema.get_field_index("cache_hit_pct"), "cache_hit_pct", pa.array([-1.0] * t.num_rows)),
     "negative"),
    (lambda t: t.set_column(t.schema.get_field_index("wall_ms"), "wall_ms", pa.array(["x"] * t.num_rows)), "not a number"),
    (lambda t: t.drop_columns(["wall_ms"]), "no wall_ms"),
])
def test_bad_metrics_values_refused_on_open(imported, mutate, needle):
    pq.write_table(mutate(pq.read_table(imported / "metrics.parquet")), imported / "metrics.parquet")
    assert_one_sentence_error(run_cli("cost", "fit", imported), "metrics.parquet", needle)


def _corrupt_column(part: Path, column: str) -> None:
    """Overwrite the data of one column chunk with garbage; the footer stays intact."""
    md = pq.ParquetFile(part).metadata
    names = [md.schema.column(i).path for i in range(md.num_columns)]
    cc = md.row_group(0).column(names.index(column))
    start = cc.data_page_offset + 12  # past the start of the page header
    end = cc.data_page_offset + cc.total_compressed_size
    data = bytearray(part.read_bytes())
    data[start:end] = bytes((7 * i + 13) % 256 for i in range(end - start))
    part.write_bytes(bytes(data))


@pytest.mark.parametrize("version, column", [(2, "expert_0"), (2, "batch"), (1, "experts.list.element"), (1, "batch")])
def test_corrupt_data_page_named(imported, tmp_path, version, column):
    trace = imported
    if version == 1:  # a version 1 trace (tests/fixtures/v1): read by pyarrow too, the same sentence
        trace = tmp_path / "v1"
        shutil.copytree(Path(__file__).parent / "fixtures" / "v1" / "bigmoe", trace)
    part = trace / "routings" / "part-00000.parquet"
    _corrupt_column(part, column)
    for verb in (["info"], ["cache", "--budgets", "1"], ["drop"]):
        res = run_cli(verb[0], trace, *verb[1:])
        assert res.code == 2, res.err
        assert_one_sentence_error(res, "part-00000.parquet")


# -- item 12: messages ------------------------------------------------------------------------------

def test_bom_before_preamble_accepted(tmp_path):
    csv, met = run_files(tmp_path)
    write(csv, [PRE, MODEL, *LAYERS, HEADER, *route_rows()], prefix=b"\xef\xbb\xbf")
    write(met, metrics_lines(), prefix=b"\xef\xbb\xbf")
    res = run_cli("import", "bigmoe", csv, tmp_path / "t", "--metrics", met, "--json")
    assert res.code == 0, res.err
    assert res.json()["rows"][0]["tokens_decode"] == N_DECODE


def test_option_names_in_errors(small_synth):
    res = run_cli("prefetch", small_synth, "--predictor", "magic", "--budget-mib", "4")
    assert_one_sentence_error(res, "--predictor:", "magic")
    assert "--predictors" not in res.err
    res = run_cli("drop", small_synth, "--mode", "closed", "--policy", "mru", "--budget-mib", "4")
    assert_one_sentence_error(res, "--policy:", "mru")
    assert "--policies" not in res.err
    # the plural verbs keep their plural flags
    assert_one_sentence_error(run_cli("cache", small_synth, "--policies", "mru"), "--policies:")
    assert_one_sentence_error(run_cli("predict", small_synth, "--predictors", "magic"), "--predictors:")


def test_markdown_table_escapes_pipes():
    import polars as pl

    from replay.present.report import Table, _md_table

    t = Table("summary", pl.DataFrame({"model": ["qwen|evil\nname"], "top_k": [6]}), "c")
    lines = _md_table(t).splitlines()
    assert len(lines) == 3
    assert lines[2] == "| qwen\\|evil name | 6 |"
    # every row has as many unescaped cell separators as the header
    seps = [len(ln.replace("\\|", "")) - len(ln.replace("\\|", "").replace("|", "")) for ln in lines]
    assert len(set(seps)) == 1


def test_cost_fit_table_does_not_embed_the_typed_path(imported, tmp_path):
    from replay.analyses.report import ReportContext, section_cost

    frames = []
    cwd = os.getcwd()
    try:
        os.chdir(imported.parent)
        for spelling in ("t", "./t", str(imported), f"../{imported.parent.name}/t"):
            ctx = ReportContext(open_trace(spelling), "t", tmp_path)
            frames.append(section_cost(ctx).tables[0].frame.write_csv())
    finally:
        os.chdir(cwd)
    assert len(set(frames)) == 1 and str(imported) not in frames[0]


def test_corrupt_gate_input_page_named(tmp_path):
    """Version 1: a wide column is read only by the verbs that need it: its corrupt page is named there."""
    tr = tmp_path / "t"
    shutil.copytree(Path(__file__).parent / "fixtures" / "v1" / "syn", tr)
    _corrupt_column(tr / "routings" / "part-00000.parquet", "gate_input.list.element")
    res = run_cli("predict", tr, "--predictors", "stale-gate")
    assert res.code == 2, res.err
    assert_one_sentence_error(res, "part-00000.parquet")


def test_corrupt_gate_input_file_named(tmp_path, small_synth):
    """Version 2: a wide column's Arrow IPC file with a garbled footer is refused on open, by every verb,
    naming the file (its values are raw floats: what a checksum-free format cannot check, nothing does)."""
    tr = tmp_path / "t"
    shutil.copytree(small_synth, tr)
    f = tr / "routings" / "part-00000.gate_input.arrow"
    data = bytearray(f.read_bytes())
    data[-60:-10] = bytes((7 * i + 13) % 256 for i in range(50))
    f.write_bytes(bytes(data))
    for verb in (["info"], ["cache", "--budgets", "1"], ["predict", "--predictors", "stale-gate"]):
        res = run_cli(verb[0], tr, *verb[1:])
        assert res.code == 2, res.err
        assert_one_sentence_error(res, "part-00000.gate_input.arrow")


# -- metrics that are not this run's (issue 29 item 6) -----------------------------------------
# cache --validate, cost fit and cost check apply one identity check (replay.core.run_identity):
# before it, --validate exited 0 on another run's metrics (a 6.65-point per-token gap), on the
# run's own metrics shuffled, and dropped its per-token line when rows were missing.

def _copy_with_metrics(src, dst, change):
    shutil.copytree(src, dst)
    t = pq.read_table(dst / "metrics.parquet")
    pq.write_table(change(t, pa), dst / "metrics.parquet")
    return dst


def _shuffled(t, pa):
    return t.take(pa.array(np.random.default_rng(0).permutation(t.num_rows)))


@pytest.mark.parametrize("case, change, needle", [
    ("shuffled", _shuffled, "not in decode order"),
    ("short", lambda t, pa: t.slice(0, t.num_rows - 5), "123 per-token rows but the trace has 128"),
])
def test_validate_and_cost_refuse_metrics_that_are_not_this_runs(real_trace_dir, tmp_path, case, change, needle):
    t = _copy_with_metrics(real_trace_dir("qwen"), tmp_path / case, change)
    for verb in (["cache", t, "--validate"], ["cost", "fit", t], ["cost", "check", t]):
        r = run_cli(*verb)
        assert_one_sentence_error(r, str(t), needle, "not the metrics of this run")
        assert r.code == 2


def test_validate_refuses_another_runs_metrics(real_trace_dir, tmp_path):
    gemma = pq.read_table(real_trace_dir("gemma") / "metrics.parquet")  # 128 rows too: only its totals tell
    t = _copy_with_metrics(real_trace_dir("qwen"), tmp_path / "foreign", lambda t, pa: gemma)
    for verb in (["cache", t, "--validate"], ["cost", "fit", t], ["cost", "check", t]):
        assert_one_sentence_error(run_cli(*verb), str(t), "76.78% but the run's summary says 74.9%", "not the metrics of this run")


def test_a_recorded_read_larger_than_the_expert_is_refused(real_trace_dir, tmp_path):
    t = tmp_path / "bigread"
    shutil.copytree(real_trace_dir("qwen"), t)

    def grow(tab):
        i = tab.column_names.index("read_bytes")
        rb = tab.column(i).combine_chunks()
        flat = rb.values.to_numpy().copy()
        flat[0] = (4 << 30) - 1  # ~4 GiB for one slot of a ~3 MiB expert
        new = pa.FixedSizeListArray.from_arrays(pa.array(flat, rb.type.value_type), rb.type.list_size)
        return tab.set_column(i, tab.field(i), new)

    rewrite_part(sorted((t / "routings").glob("*.parquet"))[0], grow)
    for verb in (["cache", t, "--validate"], ["cost", "fit", t]):
        assert_one_sentence_error(run_cli(*verb), str(t), "records read_bytes 4294967295", "bytes of one expert")


# -- every reader bounds what it parses (issue 29 item 4) -------------------------------------
# Before: RecursionError / OverflowError / "internal error: invalid trace metadata", exit 3.

DEEP = "[" * 100_000 + "]" * 100_000
HUGE = "1" + "0" * 30  # 10^30: past int64


def _no_bug(res, *needles):
    assert_one_sentence_error(res, *needles)
    assert res.code == 2 and "internal error" not in res.err


def test_trace_json_nested_or_huge_is_one_sentence(synth_trace_dir, tmp_path):
    src = synth_trace_dir(layers=2, experts=4, top_k=1, embd=8, tokens=8, prompt_tokens=2)
    deep = tmp_path / "deep"
    shutil.copytree(src, deep)
    (deep / "trace.json").write_text(DEEP)
    _no_bug(run_cli("info", deep), "trace.json", "nests more than")
    huge = tmp_path / "huge"
    shutil.copytree(src, huge)
    meta = json.loads((huge / "trace.json").read_text())
    (huge / "trace.json").write_text(json.dumps(meta).replace('"n_expert": 4', f'"n_expert": {HUGE}'))
    _no_bug(run_cli("info", huge), "trace.json", "model.n_expert holds an integer of 31 digits")


def test_vllm_log_nested_or_huge_is_one_sentence(tmp_path):
    log = tmp_path / "v.json"
    log.write_text(DEEP)
    _no_bug(run_cli("import", "vllm", log, tmp_path / "o", "--expert-bytes", "1000"), str(log), "nests more than")
    log = tmp_path / "v.jsonl"
    log.write_text('{"request_id": "a", "routed_experts": [[[HUGE]]]}\n'.replace("HUGE", HUGE))
    _no_bug(run_cli("import", "vllm", log, tmp_path / "o", "--expert-bytes", "1000"), str(log), "line 1", "31 digits")
    assert not (tmp_path / "o").exists()


def test_moetrace_and_table_huge_integers_are_one_sentence(tmp_path):
    mt = tmp_path / "moe-trace.csv"
    mt.write_text(f"phase,token,layer,rank,expert\nprefill,0,0,0,{HUGE}\n")
    _no_bug(run_cli("import", "llamacpp-moetrace", mt, tmp_path / "o", "--expert-bytes", "64"), str(mt), "line 2",
            "beyond int32")
    tb = tmp_path / "r.csv"
    tb.write_text(f"layer,experts\n0,3 1\n{HUGE},1 2\n")
    _no_bug(run_cli("import", "table", tb, tmp_path / "o", "--expert-bytes", "64"), str(tb), "row", "beyond any")
    tj = tmp_path / "r.jsonl"
    tj.write_text('{"layer": 0, "experts": [1, 2]}\n{"layer": HUGE, "experts": [1, 2]}\n'.replace("HUGE", HUGE))
    _no_bug(run_cli("import", "table", tj, tmp_path / "o", "--expert-bytes", "64"), str(tj), "line 2", "31 digits")
    assert not (tmp_path / "o").exists()


def test_limits_are_checked_where_the_input_is_read(tmp_path):
    jl = tmp_path / "router_trace_rank0.jsonl"
    jl.write_text(json.dumps({"step": 0, "layer": 10**6, "num_tokens": 1, "topk": 1, "top_indices": [[0]]}) + "\n")
    _no_bug(run_cli("import", "megatron", jl, tmp_path / "o", "--expert-bytes", "1000"), str(jl), "line 1",
            "layer 1000000 is beyond")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 1 << 40, "num_hidden_layers": 2, "num_experts": 8,
                               "moe_intermediate_size": 64, "num_experts_per_tok": 2}))
    _no_bug(run_cli("import", "megatron", jl, tmp_path / "o", "--sizes-from", cfg, "--dtype", "bf16"), str(cfg),
            "hidden_size 1099511627776 is beyond")
    cfg.write_text(json.dumps({"hidden_size": 1 << 20, "num_hidden_layers": 2, "num_experts": 8,
                               "moe_intermediate_size": 1 << 20, "num_experts_per_tok": 2}))
    _no_bug(run_cli("import", "megatron", jl, tmp_path / "o", "--sizes-from", cfg, "--dtype", "bf16"), str(cfg),
            "beyond the 1 TiB a trace allows")
    cfg.write_text(DEEP)
    _no_bug(run_cli("import", "megatron", jl, tmp_path / "o", "--sizes-from", cfg, "--dtype", "bf16"), str(cfg),
            "nests more than")
    assert not (tmp_path / "o").exists()
