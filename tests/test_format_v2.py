"""Trace format version 2 against version 1: the committed v1 fixtures (tests/fixtures/v1, written by
the v1 writer) read directly and after ``moe-replay upgrade`` give the figures the v1 code gave
(tests/fixtures/v1/expected); a corrupt v2 file is refused in one sentence naming it; every writer
of routings goes through traces/io/writer.py, so importers and capture write version 2."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers import assert_one_sentence_error, run_cli
from traces import TraceError, open_trace
from traces.format.schema import VERSION

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "v1"
NAMES = ("syn", "srv", "bigmoe", "rec")
VERBS = ("cache", "predict", "info", "drop")


# The v1 code's predict: these five predictors, static-hot learned on the scored tokens themselves
# (since issue 34 a learner is held out by default, and in-sample only when asked for).
V1_PREDICT = ["--predictors", "prev-token,stale-gate,ctrl,static-hot,static-hot-prompt", "--train", "in-sample"]


def _args(name: str, verb: str) -> list[str]:
    if verb == "drop" and name in ("syn", "srv"):  # no recorded budget: the closed-loop drop (tests/fixtures/v1/README.md)
        return ["--mode", "closed", "--budget-mib", "12"]
    if verb == "predict":
        return V1_PREDICT
    return []


def _as_v1(out: dict, want: dict) -> dict:
    """``out`` cut to the keys the v1 code printed (later versions add keys: the held-out protocol's
    train / in_sample, intervals, lead, unused bytes); every v1 key and value must still match."""
    cut = {k: out.get(k) for k in want}
    if isinstance(want.get("rows"), list) and want["rows"] and isinstance(out.get("rows"), list):
        keys = list(want["rows"][0])
        cut["rows"] = [{k: r.get(k) for k in keys} for r in out["rows"]]
    return cut


def _figures(trace: Path, name: str, verb: str) -> dict:
    res = run_cli(verb, trace, *_args(name, verb), "--json")
    assert res.code == 0, res.err
    out = res.json()
    assert out["trace"] == str(trace)
    out["trace"] = name
    return out


def _expected(name: str, verb: str) -> dict:
    return json.loads((FIX / "expected" / f"{name}.{verb}.json").read_text())


def _digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def upgraded(tmp_path_factory) -> dict[str, Path]:
    out = {}
    base = tmp_path_factory.mktemp("upgraded")
    for name in NAMES:
        before = _digest(FIX / name)
        res = run_cli("upgrade", FIX / name, base / name, "--json")
        assert res.code == 0, res.err
        assert res.json()["rows"][0]["from_version"] == 1 and res.json()["rows"][0]["version"] == VERSION
        assert _digest(FIX / name) == before, "upgrade modified its input"
        out[name] = base / name
    return out


@pytest.mark.parametrize("name", NAMES)
def test_v1_fixtures_are_version_1(name):
    assert open_trace(FIX / name).version == 1
    assert any(pa.types.is_fixed_size_list(f.type) for f in pq.ParquetFile(FIX / name / "routings" / "part-00000.parquet").schema_arrow)


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("name", NAMES)
def test_v1_read_directly_gives_the_v1_figures(tmp_path, name, verb):
    shutil.copytree(FIX / name, tmp_path / name)  # the CLI on a copy: nothing may write into the fixtures
    want = _expected(name, verb)
    assert _as_v1(_figures(tmp_path / name, name, verb), want) == want


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("name", NAMES)
def test_upgraded_gives_the_v1_figures(upgraded, name, verb):
    want = _expected(name, verb)
    assert _as_v1(_figures(upgraded[name], name, verb), want) == want


@pytest.mark.parametrize("name", NAMES)
def test_upgrade_keeps_trace_json_and_side_files(upgraded, name):
    old = json.loads((FIX / name / "trace.json").read_text())
    new = json.loads((upgraded[name] / "trace.json").read_text())
    assert old.pop("version") == 1 and new.pop("version") == 2
    assert old == new
    for f in ("router.parquet", "metrics.parquet"):
        assert (FIX / name / f).is_file() == (upgraded[name] / f).is_file()
        if (FIX / name / f).is_file():
            assert (FIX / name / f).read_bytes() == (upgraded[name] / f).read_bytes()
    t_old, t_new = open_trace(FIX / name), open_trace(upgraded[name])
    assert t_new.part_rows == t_old.part_rows
    cols = ["turn", "batch", "phase", "step", "layer", "experts", "weights", *t_old.columns]
    assert t_new.table(cols).equals(t_old.table(cols))
    a, b = t_old.arrays(), t_new.arrays()
    for f in ("turn", "batch", "phase", "step", "layer", "experts", "weights", "residency", "read_bytes", "dropped",
              "request", "token"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), f


def test_v2_layout_on_disk(upgraded):
    part = upgraded["syn"] / "routings" / "part-00000.parquet"
    names = pq.ParquetFile(part).schema_arrow.names
    assert names == ["turn", "batch", "phase", "step", "layer", "expert_0", "expert_1", "weight_0", "weight_1"]
    md = pq.ParquetFile(part).metadata
    assert md.num_row_groups == 1 and {md.row_group(0).column(i).compression for i in range(md.num_columns)} == {"LZ4"}
    for wide in ("logits", "gate_input"):
        f = part.with_name(f"part-00000.{wide}.arrow")
        with pa.memory_map(str(f)) as src:
            t = pa.ipc.open_file(src).read_all()
        assert t.schema.names == [wide] and t.num_rows == md.num_rows
    rec = pq.ParquetFile(upgraded["rec"] / "routings" / "part-00000.parquet").schema_arrow
    assert [rec.field(n).type for n in ("residency_1", "read_bytes_1", "dropped_1", "request", "token")] == \
        [pa.uint8(), pa.uint32(), pa.bool_(), pa.int64(), pa.int32()]


def test_upgrade_refuses_its_input_and_a_v2_trace(upgraded, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIX / "syn", src)
    before = _digest(src)
    assert_one_sentence_error(run_cli("upgrade", src, src), "is the input")
    assert_one_sentence_error(run_cli("upgrade", src, src / "inside", "--force"), "lies inside the input")
    assert_one_sentence_error(run_cli("upgrade", upgraded["syn"], tmp_path / "again"), "already format version 2")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert_one_sentence_error(run_cli("upgrade", src, tmp_path / "full"), "not empty")
    assert _digest(src) == before
    assert run_cli("upgrade", src, tmp_path / "full", "--force").code == 0
    assert open_trace(tmp_path / "full").version == 2


def _copy(upgraded: Path, tmp_path: Path) -> Path:
    d = tmp_path / "t"
    shutil.copytree(upgraded, d)
    return d


@pytest.mark.parametrize("what, needle", [
    ("truncate_part", "part-00000.parquet: is not a readable Parquet file"),
    ("garble_part", "part-00000.parquet: "),
    ("truncate_wide", "part-00000.gate_input.arrow: is not a readable Arrow IPC file"),
    ("remove_wide", "part-00000.logits.arrow: is missing"),
    ("wide_rows", "part-00000.logits.arrow: holds 47 rows, its part 48"),
    ("wide_type", "part-00000.logits.arrow: holds column(s) logits fixed_size_list<item: double>[8] not null"),
    ("v1_part_in_v2", "part-00000.parquet: has the wrong columns or types for format version 2: column expert_0 is missing"),
])
def test_a_corrupt_v2_trace_is_refused_in_one_sentence(upgraded, tmp_path, what, needle):
    d = _copy(upgraded["syn"], tmp_path)
    r = d / "routings"
    part, logits = r / "part-00000.parquet", r / "part-00000.logits.arrow"
    if what == "truncate_part":
        part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    elif what == "garble_part":  # the data pages, footer intact: LZ4 refuses, or the row checks do
        b = bytearray(part.read_bytes())
        for i in range(8, len(b) // 2):
            b[i] ^= 0x5A
        part.write_bytes(bytes(b))
    elif what == "truncate_wide":
        g = r / "part-00000.gate_input.arrow"
        g.write_bytes(g.read_bytes()[:-100])
    elif what == "remove_wide":
        logits.unlink()
    elif what in ("wide_rows", "wide_type"):
        with pa.memory_map(str(logits)) as src:
            col = pa.ipc.open_file(src).read_all().column(0).combine_chunks()
        if what == "wide_rows":
            col = col.slice(1)
        else:
            col = pa.FixedSizeListArray.from_arrays(col.values.cast(pa.float64()), 8)
        schema = pa.schema([pa.field("logits", col.type, nullable=False)])
        with pa.ipc.new_file(str(logits), schema) as w:
            w.write_batch(pa.record_batch([col], schema=schema))
    elif what == "v1_part_in_v2":
        shutil.copy(FIX / "syn" / "routings" / "part-00000.parquet", part)
    with pytest.raises(TraceError) as e:
        t = open_trace(d)
        t.arrays()
        t.table(["logits", "gate_input"])
    assert needle in str(e.value)
    for verb in ("info", "cache"):
        assert_one_sentence_error(run_cli(verb, d), needle.strip())


def test_routings_are_written_only_by_traces_writer():
    """Importers, capture (engine_bridge), synth and schedule all write routings through
    traces/io/writer.py, so they write version 2: no other module writes Parquet or Arrow IPC."""
    writers = re.compile(r"write_table|ParquetWriter|ipc\.new_file|RecordBatchFileWriter|write_parquet_atomic\(")
    found = []
    for d in ("traces", "replay", "engine_bridge"):
        for p in sorted((ROOT / d).rglob("*.py")):
            if p.relative_to(ROOT).as_posix() == "traces/io/writer.py":
                continue
            for i, line in enumerate(p.read_text().splitlines(), 1):
                if writers.search(line):
                    found.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert found == []
    uses = [p.relative_to(ROOT).as_posix() for d in ("traces/importers", "engine_bridge") for p in (ROOT / d).rglob("*.py")
            if "TraceWriter" in p.read_text()]
    assert "traces/importers/__init__.py" in uses and any(u.startswith("engine_bridge/") for u in uses)


def test_an_import_writes_version_2(tmp_path):
    src = tmp_path / "r.csv"
    src.write_text("\n".join(["# route_trace v1",
                              "# model=/m/x.gguf arch=qwen3moe n_layer=2 n_expert=4 n_expert_used=2",
                              "# layer=0 expert_bytes=1000 dense_bytes=10", "# layer=1 expert_bytes=1000 dense_bytes=10",
                              "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes",
                              *[f"0,1,{s},{l},{k},{(s + l + k) % 4},{0.6 if k == 0 else 0.4},0,1000"
                                for s in range(3) for l in range(2) for k in range(2)]]) + "\n")
    res = run_cli("import", "bigmoe", src, tmp_path / "t")
    assert res.code == 0, res.err
    t = open_trace(tmp_path / "t")
    assert t.version == 2 and "expert_0" in pq.ParquetFile(t.parts[0]).schema_arrow.names
