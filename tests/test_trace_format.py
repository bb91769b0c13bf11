"""Trace format (version 2, as the writer writes it): writer/reader round trip and the reader's validation of
bad traces. Version 1 traces: tests/test_format_v2.py, on the committed fixtures."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pytest

from tests.helpers import assert_one_sentence_error, rewrite_part, run_cli
from traces import TraceError, TraceWriter, open_trace
from traces.format.schema import default_gating


def meta(n_layer=3, n_expert=8, k=2, n_embd=4, moe=(0, 1, 2), eb=1000):
    return {
        "model": {"name": "t", "arch": "test", "n_layer": n_layer, "moe_layers": list(moe), "n_expert": n_expert,
                  "top_k": k, "top_k_native": k, "n_embd": n_embd},
        "expert_bytes": [eb if l in moe else None for l in range(n_layer)],
        "dense_bytes": [None] * n_layer,
        "gating": default_gating("softmax", True),
        "provenance": {"engine": "test"},
    }


def write_small(path, tokens=5, columns=(), tokens_per_part=2, close=True, seed=0):
    rng = np.random.default_rng(seed)
    m = meta()
    path.mkdir(parents=True, exist_ok=True)
    w = TraceWriter(path, m, columns=columns, tokens_per_part=tokens_per_part)
    rows = []
    for t in range(tokens):
        for l in range(3):
            ex = rng.choice(8, size=2, replace=False)
            wt = np.sort(rng.random(2))[::-1]
            opt = {}
            if "logits" in columns:
                opt["logits"] = rng.standard_normal((1, 8))
            if "gate_input" in columns:
                opt["gate_input"] = rng.standard_normal((1, 4))
            if "residency" in columns:
                opt["residency"] = rng.integers(0, 3, (1, 2))
            w.append(turn=0, batch=t, phase=1, step=t, layer=l, experts=ex[None], weights=wt[None], **opt)
            rows.append((t, l, ex, wt))
    if close:
        w.close()
    return w, rows


def test_round_trip_rows_and_parts(tmp_path):
    _, rows = write_small(tmp_path / "t", tokens=5, columns=("logits", "gate_input", "residency"))
    tr = open_trace(tmp_path / "t")
    assert tr.complete and tr.n_rows == 15
    # 2 tokens x 3 layers per part -> 6 rows per part: 6 + 6 + 3
    assert [p.name for p in tr.parts] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert tr.part_rows == [6, 6, 3]
    a = tr.arrays()
    assert a.experts.shape == (15, 2) and a.weights.dtype == np.float32
    for i, (t, l, ex, wt) in enumerate(rows):
        assert a.batch[i] == t and a.layer[i] == l and a.step[i] == t
        assert list(a.experts[i]) == list(ex)
        assert np.array_equal(a.weights[i], wt.astype(np.float32))
    assert a.residency is not None and a.residency.shape == (15, 2)


def test_arrays_do_not_load_wide_columns(tmp_path, monkeypatch):
    import traces.io.reader as reader

    write_small(tmp_path / "t", columns=("logits", "gate_input"))
    tr = open_trace(tmp_path / "t")
    seen, wide = [], []
    real, real_wide = reader.read_part, reader.Trace.wide

    def spy(path, columns, *a):
        seen.append(tuple(columns))
        return real(path, columns, *a)

    def spy_wide(self, i, column):
        wide.append(column)
        return real_wide(self, i, column)

    monkeypatch.setattr(reader, "read_part", spy)
    monkeypatch.setattr(reader.Trace, "wide", spy_wide)
    tr.arrays()
    assert seen and all("logits" not in c and "gate_input" not in c for c in seen) and not wide
    g = tr.table(["gate_input"])
    assert g.num_rows == 15 and set(wide) == {"gate_input"} and len(wide) == len(tr.parts)


def test_byte_identical_rewrite(tmp_path):
    write_small(tmp_path / "a", columns=("logits",))
    write_small(tmp_path / "b", columns=("logits",))
    for f in ["trace.json", "routings/part-00000.parquet", "routings/part-00002.parquet", "routings/part-00002.logits.arrow"]:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()


def test_interrupted_writer_leaves_incomplete_readable_trace(tmp_path):
    w, _ = write_small(tmp_path / "t", tokens=5, close=False)
    # Two parts were closed as they filled; the last token is still buffered (lost if killed now).
    tr = open_trace(tmp_path / "t")
    assert not tr.complete and tr.n_rows == 12
    w.close(complete=False)
    tr = open_trace(tmp_path / "t")
    assert not tr.complete and tr.n_rows == 15


def test_writer_rejects_out_of_order_rows(tmp_path):
    (tmp_path / "t").mkdir()
    w = TraceWriter(tmp_path / "t", meta())
    w.append(turn=0, batch=0, phase=1, step=0, layer=1, experts=[[0, 1]], weights=[[0.5, 0.5]])
    with pytest.raises(ValueError, match="order"):
        w.append(turn=0, batch=0, phase=1, step=0, layer=0, experts=[[0, 1]], weights=[[0.5, 0.5]])


def _edit_meta(path, fn):
    m = json.loads((path / "trace.json").read_text())
    fn(m)
    (path / "trace.json").write_text(json.dumps(m))


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda m: m.update(version=3), "schema version 3; this tool reads versions 1 and 2"),
        (lambda m: m.update(version=1), "wrong columns or types for format version 1"),
        (lambda m: m.update(format="other"), "not a moe-route-trace"),
        (lambda m: m["expert_bytes"].__setitem__(1, None), "expert_bytes for MoE layer 1"),
        (lambda m: m["expert_bytes"].__setitem__(1, 0), "expert_bytes for MoE layer 1"),
        (lambda m: m.pop("expert_bytes"), "'expert_bytes' must be a list"),
        (lambda m: m["model"].update(top_k=3), "wrong columns or types"),
        (lambda m: m["model"].update(n_expert=0), "n_expert"),
        (lambda m: m["model"].update(moe_layers=[2, 1]), "strictly increasing"),
        (lambda m: m["gating"].update(activation="relu"), "gating.activation"),
        (lambda m: m["expert_bytes"].__setitem__(1, 99999999999999999999999), "expert_bytes[1]"),
        (lambda m: m["gating"].update(selection_bias="yes"), "gating.selection_bias"),
        (lambda m: m.update(recorded={"budget_mib": "4000MiB"}), "recorded.budget_mib"),
    ],
)
def test_reader_rejects_bad_metadata(tmp_path, edit, needle):
    write_small(tmp_path / "t")
    _edit_meta(tmp_path / "t", edit)
    with pytest.raises(TraceError) as e:
        open_trace(tmp_path / "t")
    assert needle in str(e.value)
    # The CLI names the offending file in its one sentence.
    assert_one_sentence_error(run_cli("info", tmp_path / "t"), e.value.path.split("/")[-1], needle)


def test_reader_rejects_missing_pieces(tmp_path):
    with pytest.raises(TraceError, match="no such trace directory"):
        open_trace(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match="trace.json is missing"):
        open_trace(tmp_path / "empty")
    write_small(tmp_path / "t")
    (tmp_path / "t" / "trace.json").write_text("{not json")
    with pytest.raises(TraceError, match="not valid JSON"):
        open_trace(tmp_path / "t")
    write_small(tmp_path / "u")
    (tmp_path / "u" / "routings" / "part-00001.parquet").unlink()
    with pytest.raises(TraceError, match="without gaps"):
        open_trace(tmp_path / "u")


@pytest.mark.parametrize("cut", [0.5, 0.9, 0.1])
def test_reader_rejects_part_cut_in_half(tmp_path, cut):
    write_small(tmp_path / "t")
    part = tmp_path / "t" / "routings" / "part-00001.parquet"
    data = part.read_bytes()
    part.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(TraceError, match="part-00001.parquet: is not a readable Parquet file"):
        open_trace(tmp_path / "t")
    assert_one_sentence_error(run_cli("info", tmp_path / "t"), "part-00001.parquet")


def _rewrite_part(path, fn):
    rewrite_part(path, fn)


def _set_fixed(t, name, values, typ):
    width = t.schema.field(name).type.list_size
    arr = pa.FixedSizeListArray.from_arrays(pa.array(np.asarray(values).reshape(-1), type=typ), width)
    return t.set_column(t.schema.get_field_index(name), t.schema.field(name), arr)


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda t: _set_fixed(t, "experts", np.where(np.arange(12).reshape(6, 2) == 3, 8, 1 + np.arange(12).reshape(6, 2) % 7), pa.int32()),
         "expert id outside"),
        (lambda t: _set_fixed(t, "experts", np.array([[2, 2]] * 6), pa.int32()), "same expert twice"),
        (lambda t: _set_fixed(t, "weights", np.array([[0.5, np.nan]] * 6), pa.float32()), "partly NaN"),
        (lambda t: _set_fixed(t, "weights", np.array([[np.inf, 0.1]] * 6), pa.float32()), "infinite"),
        (lambda t: _set_fixed(t, "weights", np.array([[0.5, -0.1]] * 6), pa.float32()), "negative routing weight"),
        (lambda t: _set_fixed(t, "weights", np.array([[0.1, 0.5]] * 6), pa.float32()), "not in router rank order"),
        (lambda t: t.set_column(4, t.schema.field("layer"), pa.array(np.array([0, 1, 2, 0, 1, 1], np.int16))),
         "duplicates the row before it"),
        (lambda t: t.set_column(4, t.schema.field("layer"), pa.array(np.array([0, 2, 1, 0, 1, 2], np.int16))),
         "breaks the (batch, layer, step) row order"),
        (lambda t: t.set_column(4, t.schema.field("layer"), pa.array(np.array([0, 1, 5, 0, 1, 2], np.int16))),
         "outside 0..2"),
        (lambda t: t.drop_columns(["weights"]), "column weight_0 is missing"),
        (lambda t: t.set_column(0, pa.field("turn", pa.int64(), nullable=False), pa.array(np.zeros(6, np.int64))),
         "column turn is int64"),
    ],
)
def test_reader_rejects_bad_rows(tmp_path, mutate, needle):
    write_small(tmp_path / "t")
    _rewrite_part(tmp_path / "t" / "routings" / "part-00000.parquet", mutate)
    with pytest.raises(TraceError, match="part-00000.parquet") as e:
        open_trace(tmp_path / "t")
    assert needle in str(e.value)


def test_reader_rejects_non_moe_layer_rows(tmp_path):
    m = meta(moe=(0, 2))
    (tmp_path / "t").mkdir()
    w = TraceWriter(tmp_path / "t", m)
    w.append(turn=0, batch=0, phase=1, step=0, layer=1, experts=[[0, 1]], weights=[[0.5, 0.5]])
    w.close()
    with pytest.raises(TraceError, match="not a MoE layer"):
        open_trace(tmp_path / "t")


def test_reader_rejects_router_of_wrong_shape(tmp_path):
    write_small(tmp_path / "t", columns=("gate_input",))
    shutil.copy(tmp_path / "t" / "routings" / "part-00000.parquet", tmp_path / "t" / "router.parquet")
    with pytest.raises(TraceError, match="router.parquet"):
        open_trace(tmp_path / "t")
