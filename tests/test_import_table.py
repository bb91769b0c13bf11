"""Issue 16: the ``table`` importer (CSV / JSONL / Parquet, one routing per row, --map, --where)."""

from __future__ import annotations

import csv
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import assert_import_refused, assert_one_sentence_error, run_cli
from traces import open_trace
from traces.format.errors import UserError
from traces.importers._sizes import load_sizes
from traces.importers.table import import_


def routings(seed, n_req, layers, n_prompt, n_dec, n_expert, k):
    rng = np.random.default_rng(seed)
    out = []
    for r in range(n_req):
        for pos in range(n_prompt + n_dec):
            for il in layers:
                ids = [int(x) for x in rng.choice(n_expert, size=k, replace=False)]
                w = [float(np.float32(x)) for x in np.sort(rng.random(k))[::-1]]
                out.append({"req_id": f"req-{r}", "token_idx": pos, "layer": il, "topk_ids": ids, "topk_weights": w,
                            "phase": "prefill" if pos < n_prompt else "decode", "tok": 100 + pos})
    return out


MAP = "token=token_idx,layer=layer,experts=topk_ids,weights=topk_weights,request=req_id,phase=phase,token_id=tok"


def write(path, rows, kind):
    if kind == "jsonl":
        with open(path, "w") as fh:
            fh.write(json.dumps({"type": "meta", "engine_version": "0.9.1", "model": "x"}) + "\n")
            for r in rows:
                fh.write(json.dumps({"type": "route", **r}) + "\n")
    elif kind == "csv":
        with open(path, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(list(rows[0]))
            for r in rows:
                w.writerow([" ".join(map(str, v)) if isinstance(v, list) else v for v in r.values()])
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)


def got_of(out):
    t = open_trace(out)
    a = t.arrays()
    req = t.routings(["request"])["request"].to_numpy() if "request" in t.meta["columns"] else np.zeros(a.n_rows)
    return t, {(int(req[i]), int(a.step[i]), int(a.layer[i])): ([int(x) for x in a.experts[i]], [float(x) for x in a.weights[i]],
                                                               int(a.phase[i])) for i in range(a.n_rows)}


def want_of(rows):
    ids: dict[str, int] = {}  # string request ids are numbered in order of first appearance
    for r in rows:
        ids.setdefault(r["req_id"], len(ids))
    return {(ids[r["req_id"]], r["token_idx"], r["layer"]): (r["topk_ids"], r["topk_weights"],
                                                            0 if r["phase"] == "prefill" else 1) for r in rows}


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    from engine_bridge.tinymodel import TinyModelConfig, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny.gguf", TinyModelConfig(layers=4, experts=16, top_k=4, embd=64))


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet"])
def test_each_table_kind_imports_exactly(tmp_path, gguf, kind):
    rows = routings(0, 2, [0, 1, 2, 3], 3, 4, 16, 4)
    src = tmp_path / f"routes.{kind}"
    write(src, rows, kind)
    args = ["import", "table", src, tmp_path / "t", "--map", MAP, "--sizes-from", gguf]
    if kind == "jsonl":
        args += ["--where", "type=route"]
    res = run_cli(*args)
    assert res.code == 0, res.err
    t, got = got_of(tmp_path / "t")
    assert got == want_of(rows)
    assert "request" in t.meta["columns"] and "token" in t.meta["columns"]
    assert "numbered 0..1" in res.out and "requests one after another" in res.out
    prov = t.meta["provenance"]
    if kind == "jsonl":
        assert prov["skipped_records"] == {"count": 1, "keys": ["engine_version", "model", "type"]}
        assert prov["engine_version"] == "0.9.1" and prov["where"] == {"type": "route"}
    tok = t.routings(["token", "step"])
    assert (tok["token"].to_numpy() == tok["step"].to_numpy() + 100).all()


def test_where_is_needed_for_a_mixed_log(tmp_path):
    """A leading metadata line is read as such (issue 30 item 5); a record of another type among the
    routings still needs --where."""
    rows = routings(1, 1, [0, 1], 2, 2, 8, 2)
    src = tmp_path / "log.jsonl"
    write(src, rows, "jsonl")
    res = run_cli("import", "table", src, tmp_path / "ok", "--map", MAP, "--expert-bytes", "64")
    assert res.code == 0, res.err
    assert "log.jsonl line 1: metadata, not routing" in res.out
    assert open_trace(tmp_path / "ok").meta["provenance"]["engine_version"] == "0.9.1"
    with open(src, "a") as fh:
        fh.write(json.dumps({"type": "stats", "elapsed_s": 3.5}) + "\n")
    res = run_cli("import", "table", src, tmp_path / "t", "--map", MAP, "--expert-bytes", "64")
    assert_one_sentence_error(res, f"row {len(rows) + 2}", "--where")
    assert not (tmp_path / "t").exists()


def test_one_layer_per_file_some_layers_only(tmp_path, gguf):
    rows = routings(2, 1, [1, 3], 2, 5, 16, 4)
    files = []
    for il in (1, 3):
        p = tmp_path / f"router_layer_{il:02d}.jsonl"
        with open(p, "w") as fh:
            for r in rows:
                if r["layer"] == il:  # no layer and no token field: the file name and the file order say them
                    fh.write(json.dumps({"topk_ids": r["topk_ids"], "topk_weights": r["topk_weights"]}) + "\n")
        files.append(p)
    res = run_cli("import", "table", *files, tmp_path / "t", "--map", "experts=topk_ids,weights=topk_weights",
                  "--sizes-from", gguf)
    assert res.code == 0, res.err
    t = open_trace(tmp_path / "t")
    a = t.arrays()
    assert t.moe_layers == [1, 3] and t.model["moe_layers_absent"] == [0, 2]
    got = {(int(a.step[i]), int(a.layer[i])): [int(x) for x in a.experts[i]] for i in range(a.n_rows)}
    assert got == {(r["token_idx"], r["layer"]): r["topk_ids"] for r in rows}
    assert "file order is token order" in res.out and "the number after 'layer' in the file name" in res.out
    assert "layers 0, 2 are absent" in res.out
    info = run_cli("info", tmp_path / "t")
    assert "absent     MoE layers 0, 2" in info.out
    assert run_cli("info", tmp_path / "t", "--json").json()["rows"][0]["moe_layers_absent"] == "0, 2"
    rep = run_cli("report", tmp_path / "t", "-o", tmp_path / "rep", "--budgets", "1")
    assert rep.code == 0, rep.err
    assert "MoE layers 0, 2 of the model are not in the log" in (tmp_path / "rep" / "index.md").read_text()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_round_trip_hypothesis(tmp_path_factory, data):
    k = data.draw(st.integers(1, 3))
    n_expert = data.draw(st.integers(k, 10))
    layers = sorted(data.draw(st.sets(st.integers(0, 5), min_size=1, max_size=3)))
    rows = routings(data.draw(st.integers(0, 999)), data.draw(st.integers(1, 3)), layers, data.draw(st.integers(1, 3)),
                    data.draw(st.integers(0, 3)), n_expert, k)
    kind = data.draw(st.sampled_from(["jsonl", "csv", "parquet"]))
    shuffle = data.draw(st.booleans())
    if shuffle:  # with a token column, file order does not matter
        rows = [rows[i] for i in np.random.default_rng(0).permutation(len(rows))]
    d = tmp_path_factory.mktemp("tb")
    write(d / f"r.{kind}", rows, kind)
    import_([d / f"r.{kind}"], d / "t", sizes=load_sizes(expert_bytes=256), map=MAP,
            where="type=route" if kind == "jsonl" else None)
    _, got = got_of(d / "t")
    assert got == want_of(rows)


def _good(tmp_path):
    rows = routings(3, 1, [0, 1], 2, 2, 8, 2)
    src = tmp_path / "g.jsonl"
    write(src, rows, "jsonl")
    return src


BAD = {
    "truncated": (lambda t: t[:-9], "truncated"),
    "corrupt line": (lambda t: t.replace("}\n", "\n", 2), "not a JSON object"),
    "wrong shape": (lambda t: t.replace('"topk_ids": [', '"topk_ids": [1, ', 1), "experts"),
    "weights shape": (lambda t: t.replace('"topk_weights": [', '"topk_weights": [0.9, ', 1), "weights for"),
    "negative id": (lambda t: t.replace('"topk_ids": [', '"topk_ids": [-1', 1), "negative"),
    "same token twice": (lambda t: t + t.splitlines(keepends=True)[-1], "a second time"),
    "not a number": (lambda t: t.replace('"token_idx": 1', '"token_idx": "one"', 1), "not an integer"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_one_sentence_nothing_written(tmp_path, case):
    src = _good(tmp_path)
    mutate, needle = BAD[case]
    assert_import_refused("table", src, mutate(src.read_text()), tmp_path / "o",
                          ("--map", MAP, "--where", "type=route", "--expert-bytes", "64"), needle)


def test_ids_out_of_range_missing_column_bad_map(tmp_path, gguf):
    src = tmp_path / "r.csv"
    src.write_text("layer,experts\n0,3 17\n1,1 2\n")
    assert_one_sentence_error(run_cli("import", "table", src, tmp_path / "o", "--sizes-from", gguf), "expert 17")
    assert_one_sentence_error(run_cli("import", "table", src, tmp_path / "o", "--map", "experts=ids", "--expert-bytes", "5"),
                              "no column 'ids'")
    assert_one_sentence_error(run_cli("import", "table", src, tmp_path / "o", "--map", "colour=red", "--expert-bytes", "5"),
                              "unknown key 'colour'")
    assert_one_sentence_error(run_cli("import", "table", src, tmp_path / "o"), "--expert-bytes")
    assert not (tmp_path / "o").exists()
    # the default mapping is the column names themselves, and auto recognises such a table
    res = run_cli("import", "auto", src, tmp_path / "ok", "--expert-bytes", "5")
    assert res.code == 0 and res.out.startswith("format: table"), res.err


# -- every source column accounted for (issue 30 item 1) ------------------------------------------

def test_auto_reads_common_column_names_and_lists_the_rest(tmp_path):
    """The silent misread: rows carrying token_idx, problem_id and gating_probs were imported with
    none of them (two prompts merged into one request, weights dropped, nothing listed)."""
    rows = []
    rng = np.random.default_rng(7)
    for prob in ("gsm-12", "gsm-40"):
        for tok in range(4):
            for lay in (0, 1):
                ids = [int(x) for x in rng.choice(6, 2, replace=False)]
                w = [float(np.float32(x)) for x in np.sort(rng.random(2))[::-1]]
                rows.append({"problem_id": prob, "token_idx": tok, "layer": lay, "experts": ids, "gating_probs": w,
                             "latency_ms": 1.5})
    src = tmp_path / "hooks.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = run_cli("import", "auto", src, tmp_path / "t", "--expert-bytes", "64")
    assert res.code == 0, res.err
    assert res.out.startswith("format: table")
    t, got = got_of(tmp_path / "t")
    ids = {"gsm-12": 0, "gsm-40": 1}
    assert got == {(ids[r["problem_id"]], r["token_idx"], r["layer"]): (r["experts"], r["gating_probs"], 1) for r in rows}
    info = run_cli("info", tmp_path / "t", "--json").json()["rows"][0]
    assert info["requests"] == 2 and info["tokens_decode"] == 8
    notes = t.meta["provenance"]["notes"]
    said = ("source columns read: experts -> experts, gating_probs -> weights (matched by name), layer -> layer, "
            "token_idx -> step (matched by name), problem_id -> request (matched by name)")
    assert notes[0].startswith(said) and said in res.out
    assert notes[1] == "source columns not used: latency_ms" and "note: source columns not used: latency_ms" in res.out
    prov = t.meta["provenance"]
    assert prov["unused_columns"] == ["latency_ms"]
    assert prov["mapping"] == {"experts": "experts", "weights": "gating_probs", "layer": "layer", "token": "token_idx",
                               "request": "problem_id"}
    assert sorted(prov["mapped_by_name"]) == ["request", "token", "weights"]


def test_map_wins_and_every_unused_column_is_listed(tmp_path):
    src = tmp_path / "r.csv"
    src.write_text("layer,ids,topk_ids,step,position,note\n0,1 2,3 0,0,5,a\n1,2 3,0 1,0,5,b\n0,1 0,2 3,1,6,c\n1,0 2,1 3,1,6,d\n")
    res = run_cli("import", "table", src, tmp_path / "t", "--expert-bytes", "64", "--map", "experts=ids")
    assert res.code == 0, res.err
    t = open_trace(tmp_path / "t")
    a = t.arrays()
    assert [list(map(int, e)) for e in a.experts] == [[1, 2], [2, 3], [1, 0], [0, 2]]
    # token: 'position' comes before 'step' among the common names; the other is listed unused
    assert [int(s) for s in a.step] == [5, 5, 6, 6]
    assert t.meta["provenance"]["unused_columns"] == ["topk_ids", "step", "note"]
    assert "source columns not used: topk_ids, step, note" in res.out


def test_server_formats_account_for_every_field(tmp_path):
    """The JSON formats name what each response / record field became and every field left unused."""
    from tests.server_logs import random_vreqs, sglang_response, vllm_completion, write_megatron
    from traces.importers import field_notes

    assert field_notes({"a": "x"}, ["a", "b", "a"]) == ["source fields read: a -> x", "source fields not used: b"]
    reqs = random_vreqs(np.random.default_rng(1), 2, 3, 2, 8)
    src = tmp_path / "v.jsonl"
    src.write_text("".join(json.dumps(vllm_completion(r, i)) + "\n" for i, r in enumerate(reqs)))
    res = run_cli("import", "vllm", src, tmp_path / "v", "--expert-bytes", "64")
    assert res.code == 0, res.err
    notes = open_trace(tmp_path / "v").meta["provenance"]["notes"]
    assert notes[0].startswith("source response fields read: prompt_routed_experts -> experts (prompt positions), "
                               "choices[].routed_experts -> experts (generated)")
    assert notes[1].startswith("source response fields not used: id, object, created, service_tier, usage,")
    rng = np.random.default_rng(2)
    rows = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(2)]) for _ in range(6)])
    src = tmp_path / "s.jsonl"
    src.write_text(json.dumps(sglang_response(4, [1, 2, 3], rows)) + "\n")
    res = run_cli("import", "sglang", src, tmp_path / "s", "--expert-bytes", "64", "--top-k", "2")
    assert res.code == 0, res.err
    assert ("note: source response fields not used: text, output_ids, meta_info.id, meta_info.finish_reason, "
            "meta_info.e2e_latency") in res.out
    steps = [{0: rng.integers(0, 8, (2, 1)), 1: rng.integers(0, 8, (2, 1))}]
    jl = write_megatron(tmp_path / "mg", steps)
    res = run_cli("import", "megatron", jl, tmp_path / "m", "--expert-bytes", "64")
    assert res.code == 0, res.err
    assert "note: source record fields not used: stage" in res.out
    assert "top_indices -> experts, layer -> layer" in res.out


# -- the columnar core (session 11): whole columns read at once, the first bad row still named -----

def _err(tmp_path, src, *extra):
    with pytest.raises(UserError) as e:
        import_([src], tmp_path / "o", sizes=load_sizes(64, None, None), **dict(extra))
    return str(e.value)


def test_the_first_bad_row_is_named_whichever_column_holds_it(tmp_path):
    """Each column is converted whole; the refusal is still the one a row-by-row reading meets first:
    the earliest row, and within a row the earliest check (experts, weights, layer, token, ...)."""
    src = tmp_path / "r_layer0.csv"
    src.write_text("token_idx,layer,topk_ids,topk_weights,phase\n"
                   "0,0,1 2,0.5 0.25,decode\n"
                   "1,0,1 2,0.5 0.25,decode\n"
                   "2,0,1 x,0.5 0.25,decode\n"      # line 4: experts
                   "1.5,0,1 2,0.5 0.25,decode\n"    # line 5: token
                   "3,zero,1 2,0.5 0.25,warm\n")    # line 6: layer and phase
    assert _err(tmp_path, src) == f"{src}: row 4: experts 'x' is not an integer."
    lines = src.read_text().splitlines()
    src.write_text("\n".join(lines[:3] + lines[4:]) + "\n")
    assert _err(tmp_path, src) == f"{src}: row 4: token '1.5' is not an integer."
    src.write_text("\n".join(lines[:3] + lines[5:]) + "\n")
    assert _err(tmp_path, src) == f"{src}: row 4: layer 'zero' is not an integer."  # layer before phase
    # JSONL: a record that lacks a column the first had is refused before its values are read
    js = tmp_path / "r.jsonl"
    js.write_text("".join(json.dumps(r) + "\n" for r in (
        {"layer": 0, "topk_ids": [1, 2], "topk_weights": [0.5, 0.2]},
        {"layer": 0, "topk_ids": [1, "y"], "topk_weights": [0.5, 0.2]},
        {"layer": 0, "topk_ids": [1, 2]})))
    assert _err(tmp_path, js) == f"{js}: row 2: experts 'y' is not an integer."
    js.write_text("".join(json.dumps(r) + "\n" for r in (
        {"layer": 0, "topk_ids": [1, 2], "topk_weights": [0.5, 0.2]},
        {"layer": 0, "topk_ids": [1, 2, 3], "topk_weights": "0.5 x"})))
    assert _err(tmp_path, js) == f"{js}: row 2: weights ['0.5', 'x'] is not a list of numbers."
    # a null request id: one sentence (it used to fail inside NumPy)
    js.write_text("".join(json.dumps(r) + "\n" for r in (
        {"req_id": 0, "layer": 0, "topk_ids": [1, 2]}, {"req_id": None, "layer": 0, "topk_ids": [1, 2]})))
    assert _err(tmp_path, js) == f"{js}: row 2: request None is not an integer."
    # integers and names among the request ids: the row where both have been read
    js.write_text("".join(json.dumps(r) + "\n" for r in (
        {"req_id": "a", "layer": 0, "topk_ids": [1, 2]}, {"req_id": "b", "layer": 0, "topk_ids": [1, 2]},
        {"req_id": 7, "layer": 0, "topk_ids": [1, 2]})))
    assert _err(tmp_path, js) == f"{js}: row 3: request ids mix integers and names; use one kind."


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(-2, 3), min_size=3, max_size=3), max_size=40))
def test_unique_rows_is_numpys(rows):
    from traces.util.rows import unique_rows

    keys = np.array(rows, dtype=np.int64).reshape(-1, 3)
    want_u, want_i = np.unique(keys, axis=0, return_inverse=True)
    got_u, got_i = unique_rows(keys)
    assert got_u.tolist() == want_u.tolist() and got_i.tolist() == want_i.reshape(-1).tolist()


@pytest.mark.parametrize("text", ["1 2", "1,2", " 1;2 ", "1|2", "[1, 2]", "[1,2]", "+1 2", "1_0 2", "1\x1c2"])
def test_list_spellings_read_as_the_per_value_definition(tmp_path, text):
    """The whole-column split of CSV lists gives what _list gives value by value (ASCII separators
    that str.split() counts as whitespace included)."""
    from traces.importers.table import _list, _lists

    flat, lens, bad = _lists([text, "3 4"], tmp_path, np.array([2, 3]), "experts", int)
    assert bad is None and flat.tolist() == _list(text, tmp_path, 2, "experts", int) + [3, 4]
    assert lens.tolist() == [len(_list(text, tmp_path, 2, "experts", int)), 2]
