"""The shapes real routing logs come in (issue 30 items 3, 5, 6), each written as its engine or
script writes it by the test (never downloaded), imported, and checked three ways:

- the figures: ``cache`` (LRU, Belady at two budgets) against the naive twin run on the fixture's
  *own* rows (tests/naive/cache.py, fed the routings, phases and batches the fixture was built
  from, not the imported trace), and ``predict`` prev-token against a dictionary-and-loop count
  from the same rows;
- the provenance: every inference the import made is in ``provenance.inferences`` (and said in
  the import's output), and every source column it did not use is in ``unused_columns``;
- the silent misread each shape suffered before (a prompt counted as decode, requests merged,
  a metadata line not read, a wide table refused, ...) is asserted not to happen.

Each fixture's rows are (request, position, phase, batch, layer, experts, weights), batches in the
documented order: requests one after another, a request's prompt one batch, each decoded token
its own batch.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

import replay
from tests.helpers import assert_one_sentence_error, run_cli
from tests.naive.cache import naive_replay
from traces import open_trace

E, K, EB = 12, 2, 4096
BUDGETS = (0.01, 0.02)  # MiB: 2 and 5 experts of 4096 bytes


def truth(reqs, layers=(0, 1, 2), seed=0, n_expert=E):
    """Rows of ``reqs`` [(prompt tokens, decoded tokens), ...]: skewed routing (so a cache has
    something to keep), weights in descending order."""
    rng = np.random.default_rng(seed)
    pop = 1.0 / np.arange(1, n_expert + 1)
    rows, batch = [], 0
    for r, (p, d) in enumerate(reqs):
        for pos in range(p + d):
            b = batch if pos < p else batch + (1 if p else 0) + pos - p
            for lay in layers:
                ids = [int(x) for x in rng.choice(n_expert, K, replace=False, p=rng.permutation(pop) / pop.sum())]
                w = [float(np.float32(x)) for x in np.sort(rng.random(K))[::-1]]
                rows.append({"request": r, "pos": pos, "phase": 0 if pos < p else 1, "batch": b, "layer": lay,
                             "experts": ids, "weights": w})
        batch += (1 if p else 0) + d
    return rows


def check_figures(trace, rows, n_expert=E):
    """cache and predict of the imported ``trace`` equal a replay of the fixture's own ``rows``."""
    layers = sorted({r["layer"] for r in rows})
    order = sorted(rows, key=lambda r: (r["batch"], r["layer"], r["request"], r["pos"]))
    naive_rows = [(r["batch"], r["phase"], r["layer"], r["experts"]) for r in order]
    for budget in BUDGETS:
        got = replay.cache(trace, policies=["lru", "belady"], budgets_mib=[budget])
        for pol in ("lru", "belady"):
            want = naive_replay(naive_rows, layers, n_expert, dict.fromkeys(layers, EB), pol, int(budget * 2 ** 20))
            row = got.filter((got["policy"] == pol) & got["layer"].is_null()).row(0, named=True)
            assert row["lookups"] == sum(want["lookups"].values()), (pol, budget)
            assert row["hits"] == sum(want["hits"].values()), (pol, budget)
            assert row["lookups_decode"] == sum(v for (ph, _), v in want["lookups"].items() if ph == 1)
            assert row["hits_decode"] == sum(v for (ph, _), v in want["hits"].items() if ph == 1)
    # prev-token: a decoded token is scored against the previous decoded token of its request at
    # that layer (docs/design.md); slot accuracy = shared experts / (k x scored).
    seqs: dict = {}
    for r in sorted(rows, key=lambda r: r["pos"]):
        if r["phase"] == 1:
            seqs.setdefault((r["request"], r["layer"]), []).append(set(r["experts"]))
    scored = sum(len(s) - 1 for s in seqs.values())
    shared = sum(len(a & b) for s in seqs.values() for a, b in zip(s, s[1:]))
    pred = replay.predict(trace, predictors=["prev-token"])
    row = pred.filter(pred["layer"].is_null()).row(0, named=True)
    assert row["scored"] == scored
    if scored:
        assert row["slot_acc_pct"] == pytest.approx(100.0 * shared / (K * scored))
    info = run_cli("info", trace, "--json").json()["rows"][0]
    assert info["tokens_prefill"] == len({(r["request"], r["pos"]) for r in rows if r["phase"] == 0})
    assert info["tokens_decode"] == len({(r["request"], r["pos"]) for r in rows if r["phase"] == 1})
    return info


def imported(res, trace, inferences, unused):
    """The import succeeded, said every inference, and its provenance lists exactly the
    inferences (each found by a phrase of ``inferences``) and the unused columns ``unused``."""
    assert res.code == 0, res.err
    prov = open_trace(trace).meta["provenance"]
    got = prov["inferences"]
    assert len(got) == len(inferences), got
    for phrase in inferences:
        hit = [s for s in got if phrase in s]
        assert len(hit) == 1, (phrase, got)
        assert f"note: {hit[0]}" in res.out
    assert prov["unused_columns"] == unused
    return prov


SHAPE_NOTES = ["the log does not state the layer count", "the log does not state the expert count"]


def write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# -- 1. a patched-vLLM JSONL dump: a metadata line, then one row per (pass, layer, position) ------

def test_vllm_dump_with_a_metadata_line_and_a_prompt_pass(tmp_path):
    """Silent misread before: the metadata line stopped `import auto`; without it the prompt pass
    (positions 0..5 in forward pass 0) was counted as decode ("0 prefill + 16 decode")."""
    rows = truth([(6, 10)])
    meta = {"vllm_version": "0.9.2", "model": "Qwen/Qwen3-30B-A3B", "dtype": "bfloat16"}
    src = write_jsonl(tmp_path / "routes.jsonl", [meta] + [
        {"forward_pass": r["batch"], "position": r["pos"], "layer_id": r["layer"], "topk_ids": r["experts"],
         "topk_weights": r["weights"], "latency_us": 12} for r in rows])
    res = run_cli("import", "auto", src, tmp_path / "t", "--expert-bytes", EB)
    prov = imported(res, tmp_path / "t", ["batch 0 holds positions 0..5", *SHAPE_NOTES], ["latency_us"])
    assert res.out.startswith("format: table")
    assert (prov["engine"], prov["engine_version"]) == ("vllm", "0.9.2")
    assert prov["source_meta"]["model"] == "Qwen/Qwen3-30B-A3B" and prov["source_meta"]["keys"] == list(meta)
    assert "routes.jsonl line 1: metadata, not routing" in res.out
    check_figures(tmp_path / "t", rows)
    # the silent misread of the code before: the same log without its metadata line imported as
    # "0 prefill + 16 decode"
    bare = write_jsonl(tmp_path / "bare.jsonl", [json.loads(ln) for ln in src.read_text().splitlines()[1:]])
    res = run_cli("import", "auto", bare, tmp_path / "b", "--expert-bytes", EB)
    imported(res, tmp_path / "b", ["batch 0 holds positions 0..5", *SHAPE_NOTES], ["latency_us"])
    assert check_figures(tmp_path / "b", rows)["tokens_prefill"] == 6


# -- 2. a forward hook's position within each pass: the counter restarts --------------------------

def test_hook_positions_that_restart_each_pass(tmp_path):
    """A hook that logs its index into each forward pass writes 0..P-1 for the prompt pass, then 0
    for every decoded token. Refused before ("a second time"); now read as prompt + decode, said."""
    rows = truth([(5, 7), (3, 4)], seed=1)
    recs = []
    for r in sorted(rows, key=lambda r: (r["request"], r["batch"], r["layer"], r["pos"])):
        within = r["pos"] if r["phase"] == 0 else 0
        recs.append({"prompt_id": f"p{r['request']}", "pos": within, "layer": r["layer"], "expert_ids": r["experts"],
                     "probs": r["weights"]})
    src = write_jsonl(tmp_path / "hook.jsonl", recs)
    res = run_cli("import", "auto", src, tmp_path / "t", "--expert-bytes", EB)
    imported(res, tmp_path / "t", ["the token column pos restarts at 0", *SHAPE_NOTES], [])
    assert "request 0: positions 0..4 in one pass then 7 one-position pass(es)" in res.out
    check_figures(tmp_path / "t", rows)
    # --prompt-tokens says the same, and the figures agree
    res = run_cli("import", "table", src, tmp_path / "t2", "--expert-bytes", EB, "--prompt-tokens", "5")
    assert res.code == 0, res.err
    assert "phase from --prompt-tokens 5" in res.out


# -- 3. hook CSVs of prompt-only passes, one file per prompt, per-file batch numbers ---------------

def _prompt_files(tmp_path, rows):
    files = []
    for r in sorted({r["request"] for r in rows}):
        p = tmp_path / f"prompt_{r:03d}.csv"
        with open(p, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["batch", "layer", "token_pos", "topk_ids", "topk_weights"])
            for x in rows:
                if x["request"] == r:
                    w.writerow([0, x["layer"], x["pos"], " ".join(map(str, x["experts"])),
                                " ".join(map(str, x["weights"]))])
        files.append(p)
    return files


def test_one_file_per_prompt_of_prompt_only_passes(tmp_path):
    """Silent misread before: counted as decode, the files' batch 0 merged into one batch."""
    rows = truth([(7, 0), (4, 0), (9, 0)], seed=2)
    files = _prompt_files(tmp_path, rows)
    res = run_cli("import", "table", *files, tmp_path / "t", "--expert-bytes", EB, "--request-per-file")
    imported(res, tmp_path / "t", ["batch 0 holds positions 0..6", *SHAPE_NOTES], [])
    assert "--request-per-file: each of the 3 file(s) is one request" in res.out
    assert check_figures(tmp_path / "t", rows)["requests"] == 3
    # without the option, the files' request 0 routing the same positions is inferred per file, said
    res = run_cli("import", "table", *files, tmp_path / "u", "--expert-bytes", EB)
    imported(res, tmp_path / "u", ["in both prompt_000.csv and prompt_001.csv with the same positions",
                                   "batch 0 holds positions 0..6", *SHAPE_NOTES], [])
    check_figures(tmp_path / "u", rows)
    # --phase prefill says it outright: the same figures
    res = run_cli("import", "table", *files, tmp_path / "v", "--expert-bytes", EB, "--request-per-file",
                  "--phase", "prefill")
    assert res.code == 0 and "phase from --phase prefill" in res.out, res.err
    check_figures(tmp_path / "v", rows)


# -- 4. a wide table, one score column per expert, one file per layer (layer in the path) ----------

def test_wide_one_column_per_expert_layer_from_path(tmp_path):
    """Refused before (--map experts=expert_* unknown; columns sorted as text: expert_10 after
    expert_1). 12 experts, so numeric order matters; the layer is the directory's number."""
    rows = truth([(0, 9)], layers=(1, 3), seed=3)
    files = []
    for lay in (1, 3):
        p = tmp_path / "dump" / f"layer_{lay}" / "scores_rank0.csv"
        p.parent.mkdir(parents=True)
        with open(p, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["token", *(f"expert_{e}" for e in range(E)), "ts"])
            for r in rows:
                if r["layer"] == lay:
                    score = dict(zip(r["experts"], r["weights"]))
                    w.writerow([r["pos"], *(score.get(e, 0) for e in range(E)), 1.5])
        files.append(p)
    res = run_cli("import", "table", *files, tmp_path / "t", "--expert-bytes", EB, "--map", "experts=expert_*")
    assert_one_sentence_error(res, "scores_rank0.csv", "no number after 'layer'", "--layer-from-path")
    res = run_cli("import", "table", *files, tmp_path / "t", "--expert-bytes", EB, "--map", "experts=expert_*",
                  "--layer-from-path", r"layer_(\d+)/")
    prov = imported(res, tmp_path / "t", ["expert_0..expert_11 read as one column per expert", "every routing counts "
                                          "as decode", "requests one after another", *SHAPE_NOTES], ["ts"])
    assert "k = 2 (the same in every row), the values their weights" in res.out
    assert prov["mapping"]["experts"] == "expert_0..expert_11"
    assert open_trace(tmp_path / "t").moe_layers == [1, 3]
    check_figures(tmp_path / "t", rows)
    tr = open_trace(tmp_path / "t")
    w = tr.routings(["weights"])["weights"].to_list()
    assert sorted(round(x, 6) for ws in w for x in ws) == sorted(round(x, 6) for r in rows for x in r["weights"])


def test_wide_dense_scores_need_top_k(tmp_path):
    src = tmp_path / "router_scores_layer2.csv"
    src.write_text("expert_0,expert_1,expert_2,expert_3\n0.1,0.4,0.3,0.2\n0.5,0.1,0.1,0.3\n")
    res = run_cli("import", "table", src, tmp_path / "t", "--expert-bytes", EB, "--map", "experts=expert_*")
    assert_one_sentence_error(res, "dense scores", "--top-k K")
    res = run_cli("import", "table", src, tmp_path / "t", "--expert-bytes", EB, "--map", "experts=expert_*",
                  "--top-k", "2")
    assert res.code == 0, res.err
    a = open_trace(tmp_path / "t").arrays()
    assert [list(map(int, e)) for e in a.experts] == [[1, 2], [0, 3]] and set(a.layer.tolist()) == {2}


# -- 5. a wide table of one column per slot ------------------------------------------------------

def _slot_csv(src, rows):
    """One column per slot: expert_0, expert_1 the ids, weight_0, weight_1 their weights."""
    with open(src, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["step", "layer", "expert_0", "expert_1", "weight_0", "weight_1", "phase"])
        for r in rows:
            w.writerow([r["pos"], r["layer"], *r["experts"], *r["weights"], "prefill" if r["phase"] == 0 else "decode"])
    return src


def test_wide_one_column_per_slot(tmp_path):
    rows = truth([(4, 6)], seed=4)
    src = _slot_csv(tmp_path / "topk.csv", rows)
    res = run_cli("import", "table", src, tmp_path / "t", "--expert-bytes", EB,
                  "--map", "experts=expert_*,weights=weight_*")
    imported(res, tmp_path / "t", ["requests one after another", *SHAPE_NOTES], [])
    assert "expert_0..expert_1 and weight_0..weight_1 read as the k = 2 slots" in res.out
    check_figures(tmp_path / "t", rows)


# -- 6. NPY / NPZ arrays [tokens, layers, k] -------------------------------------------------------

def test_npy_and_npz_arrays(tmp_path):
    rows = truth([(0, 12)], seed=5)
    ids = np.array([[next(r["experts"] for r in rows if r["pos"] == t and r["layer"] == lay) for lay in range(3)]
                    for t in range(12)], dtype=np.int32)
    wts = np.array([[next(r["weights"] for r in rows if r["pos"] == t and r["layer"] == lay) for lay in range(3)]
                    for t in range(12)], dtype=np.float32)
    np.save(tmp_path / "topk_ids.npy", ids)
    res = run_cli("import", "table", tmp_path / "topk_ids.npy", tmp_path / "a", "--expert-bytes", EB)
    imported(res, tmp_path / "a", ["every routing counts as decode", "requests one after another", *SHAPE_NOTES], [])
    assert "topk_ids.npy: the array [12x3x2] read as [tokens, layers, k]" in res.out
    check_figures(tmp_path / "a", rows)
    assert np.isnan(open_trace(tmp_path / "a").arrays().weights).all()
    np.savez(tmp_path / "routes.npz", topk_ids=ids, topk_weights=wts, token_ids=np.arange(12))
    res = run_cli("import", "table", tmp_path / "routes.npz", tmp_path / "b", "--expert-bytes", EB)
    imported(res, tmp_path / "b", ["every routing counts as decode", "requests one after another", *SHAPE_NOTES],
             ["token_ids"])
    check_figures(tmp_path / "b", rows)
    # --prompt-tokens: the first 4 positions are the prompt
    prompt = truth([(4, 8)], seed=5)
    res = run_cli("import", "table", tmp_path / "routes.npz", tmp_path / "c", "--expert-bytes", EB, "--prompt-tokens", "4")
    assert res.code == 0, res.err
    check_figures(tmp_path / "c", [{**r, "experts": next(x["experts"] for x in rows if (x["pos"], x["layer"]) ==
                                                         (r["pos"], r["layer"]))} for r in prompt])
    assert_one_sentence_error(run_cli("import", "table", tmp_path / "routes.npz", tmp_path / "d", "--expert-bytes", EB,
                                      "--map", "experts=ids"), "routes.npz", "--map experts=")


# -- 7. two files that each number their requests from 0 -------------------------------------------

def test_two_files_numbering_requests_from_zero(tmp_path):
    """Refused before ("routes token 0 of layer 0 a second time", no hint): ids are per file."""
    rows = truth([(3, 4), (2, 5), (4, 3), (3, 3)], seed=6)
    files = []
    for f, reqs in (("a.jsonl", (0, 1)), ("b.jsonl", (2, 3))):
        files.append(write_jsonl(tmp_path / f, [
            {"req_id": r["request"] - reqs[0], "token_idx": r["pos"], "layer": r["layer"], "topk_ids": r["experts"],
             "topk_weights": r["weights"], "phase": "prefill" if r["phase"] == 0 else "decode"}
            for r in rows if r["request"] in reqs]))
    res = run_cli("import", "table", *files, tmp_path / "t", "--expert-bytes", EB)
    imported(res, tmp_path / "t", ["request 0 routes layer 0 in both a.jsonl and b.jsonl with the same positions",
                                   "requests one after another", *SHAPE_NOTES], [])
    assert check_figures(tmp_path / "t", rows)["requests"] == 4
    # without a token column the code before read file b's request 0 as more tokens of file a's
    # request 0 (2 requests, silently); the ids are the files' own
    files = [write_jsonl(tmp_path / f"n{f.name}", [{k: v for k, v in json.loads(ln).items() if k != "token_idx"}
                                                  for ln in f.read_text().splitlines()]) for f in files]
    res = run_cli("import", "table", *files, tmp_path / "n", "--expert-bytes", EB)
    imported(res, tmp_path / "n", ["request 0 routes layer 0 in both na.jsonl and nb.jsonl with no token column",
                                   "no token column: file order is token order", "requests one after another",
                                   *SHAPE_NOTES], [])
    assert check_figures(tmp_path / "n", rows)["requests"] == 4


# -- ambiguous cases refused in one sentence naming the option that settles them ----------------

def test_ambiguous_cases_name_the_option(tmp_path):
    # a multi-position pass after one-position passes: the batches do not say where the prompt ends
    src = write_jsonl(tmp_path / "a.jsonl", [{"batch": b, "token_idx": t, "layer": 0, "topk_ids": [0, 1]}
                                             for b, ts in ((0, [0, 1]), (1, [2]), (2, [3, 4])) for t in ts])
    assert_one_sentence_error(run_cli("import", "table", src, tmp_path / "o", "--expert-bytes", EB),
                              "batch 2 holds 2 positions", "--prompt-tokens N")
    # a counter that restarts at a position other than 0, after a decode pass
    src = write_jsonl(tmp_path / "b.jsonl", [{"pos": p, "layer": 0, "topk_ids": [0, 1]} for p in (0, 1, 2, 0, 0, 1)])
    assert_one_sentence_error(run_cli("import", "table", src, tmp_path / "o", "--expert-bytes", EB),
                              "a second time", "--request-per-file")
    # no layer column: the number after "layer" in the file name, never another number guessed
    src = write_jsonl(tmp_path / "run3_gpu0.jsonl", [{"topk_ids": [0, 1]}])
    assert_one_sentence_error(run_cli("import", "table", src, tmp_path / "o", "--expert-bytes", EB),
                              "no number after 'layer' in its file name (it holds 3, 0)", "--layer-from-path")
    ok = write_jsonl(tmp_path / "run3_layer12_gpu0.jsonl", [{"topk_ids": [0, 1]}])
    assert run_cli("import", "table", ok, tmp_path / "l12", "--expert-bytes", EB).code == 0
    assert open_trace(tmp_path / "l12").moe_layers == [12]
    # options that contradict each other or the log
    assert_one_sentence_error(run_cli("import", "table", src, tmp_path / "o", "--expert-bytes", EB, "--phase",
                                      "decode", "--prompt-tokens", "3"), "give one")
    src = write_jsonl(tmp_path / "c.jsonl", [{"phase": "decode", "layer": 0, "topk_ids": [0, 1]}])
    assert_one_sentence_error(run_cli("import", "table", src, tmp_path / "o", "--expert-bytes", EB, "--phase",
                                      "prefill"), "has a phase column", "drop --phase")
    assert not (tmp_path / "o").exists()


def test_failure_messages_name_what_would_read_the_file(tmp_path):
    """Every file the table importer cannot read is refused naming an option or another importer."""
    txt = tmp_path / "log.txt"
    txt.write_text("layer 0: 3 7\n")
    assert_one_sentence_error(run_cli("import", "table", txt, tmp_path / "o", "--expert-bytes", EB), "import --list")
    binary = tmp_path / "log.csv"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert_one_sentence_error(run_cli("import", "table", binary, tmp_path / "o", "--expert-bytes", EB), "import --list")
    src = write_jsonl(tmp_path / "x.jsonl", [{"ids_here": [1, 2], "layer": 0}])
    assert_one_sentence_error(run_cli("import", "table", src, tmp_path / "o", "--expert-bytes", EB),
                              "--map experts=COLUMN")
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"not an array")
    assert_one_sentence_error(run_cli("import", "table", bad, tmp_path / "o", "--expert-bytes", EB), "numpy.save")
    np.save(tmp_path / "f.npy", np.zeros((3, 2, 2)))
    assert_one_sentence_error(run_cli("import", "table", tmp_path / "f.npy", tmp_path / "o", "--expert-bytes", EB),
                              "not integer expert ids")


def test_dedicated_importers_suggest_the_table_importer(tmp_path):
    """`import vllm` on a patched-vLLM per-row dump (not the server's responses) names `import table`."""
    src = write_jsonl(tmp_path / "dump.jsonl", [{"vllm_version": "0.9.2"},
                                                {"position": 0, "layer_id": 0, "topk_ids": [1, 2]}])
    res = run_cli("import", "vllm", src, tmp_path / "o", "--expert-bytes", EB)
    assert_one_sentence_error(res, "import table")


def test_meta_path_types_are_kept_as_given(tmp_path):
    """A path given relative or absolute: the same trace (file names only in provenance)."""
    rows = truth([(0, 3)], seed=7)
    src = write_jsonl(tmp_path / "r.jsonl", [{"position": r["pos"], "layer": r["layer"], "topk_ids": r["experts"]}
                                             for r in rows])
    assert run_cli("import", "table", src, tmp_path / "t", "--expert-bytes", EB).code == 0
    assert open_trace(tmp_path / "t").meta["provenance"]["source_file"] == Path(src).name


def test_wide_slot_ids_are_not_read_as_weights(tmp_path):
    """expert_0, expert_1 holding ids (one column per slot, no weights) read as one column per
    expert would route experts 0 and 1 with weights 5 and 3: refused, naming the slot form."""
    src = tmp_path / "slots_layer0.csv"
    src.write_text("expert_0,expert_1\n5,3\n2,7\n")
    res = run_cli("import", "table", src, tmp_path / "t", "--expert-bytes", EB, "--map", "experts=expert_*")
    assert_one_sentence_error(res, "integers above 1", "weights=weight_*")
    # a dedicated importer given such a table names the generic one and the wide mapping
    res = run_cli("import", "llamacpp-moetrace", src, tmp_path / "t", "--expert-bytes", EB, "--top-k", "2")
    assert_one_sentence_error(res, "import table", "--map experts=expert_*")


# -- 8. one file per forward pass; the request in the path; the prompt length in a column ----------

def test_one_file_per_pass_request_from_path_prompt_column(tmp_path):
    rows = truth([(5, 4), (3, 3)], seed=8)
    files = []
    for r in rows:
        p = tmp_path / f"req_{r['request'] + 10}" / f"pass_{r['batch']:03d}.jsonl"
        if p not in files:
            files.append(p)
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "a") as fh:
            fh.write(json.dumps({"token_idx": r["pos"], "layer": r["layer"], "topk_ids": r["experts"],
                                 "topk_weights": r["weights"], "prompt_len": [5, 3][r["request"]]}) + "\n")
    base = ["import", "table", *files]
    res = run_cli(*base, tmp_path / "t", "--expert-bytes", EB, "--batch-per-file", "--request-from-path", r"req_(\d+)/")
    imported(res, tmp_path / "t", ["request 10: batch 0 holds positions 0..4", *SHAPE_NOTES], ["prompt_len"])
    assert "--batch-per-file: each of the 9 file(s) is one forward pass" in res.out
    check_figures(tmp_path / "t", rows)
    res = run_cli(*base, tmp_path / "u", "--expert-bytes", EB, "--request-from-path", r"req_(\d+)/",
                  "--prompt-tokens", "prompt_len")
    imported(res, tmp_path / "u", ["requests one after another", *SHAPE_NOTES], [])
    assert "prompt_len -> prompt length (--prompt-tokens)" in res.out
    check_figures(tmp_path / "u", rows)
    bad = tmp_path / "req_10" / "pass_000.jsonl"
    bad.write_text(bad.read_text().replace('"prompt_len": 5', '"prompt_len": 4', 1))
    assert_one_sentence_error(run_cli(*base, tmp_path / "v", "--expert-bytes", EB, "--request-from-path",
                                      r"req_(\d+)/", "--prompt-tokens", "prompt_len"), "changes within request 10")


# -- 9. `import auto` on the shapes `import table` reads (session 11) -----------------------------

def _wide_csv(path, rows, lay, extra=("ts",)):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["token", *(f"expert_{e}" for e in range(E)), *extra])
        for r in rows:
            if r["layer"] == lay:
                score = dict(zip(r["experts"], r["weights"]))
                w.writerow([r["pos"], *(score.get(e, 0) for e in range(E)), *(1.5 for _ in extra)])
    return path


def test_auto_reads_a_wide_table_by_its_column_names_and_says_so(tmp_path):
    """Before: `import auto` did not recognise one score column per expert ("no importer
    recognises it"), and `import table` needed --map experts=expert_*."""
    rows = truth([(0, 9)], layers=(1, 3), seed=3)
    files = [_wide_csv(tmp_path / f"router_layer_{lay}.csv", rows, lay) for lay in (1, 3)]
    res = run_cli("import", "auto", *files, tmp_path / "t", "--expert-bytes", EB)
    assert res.out.startswith("format: table"), res.err
    prov = imported(res, tmp_path / "t", ["the numbered columns expert_* taken as the experts, one column per expert by "
                                          "their names", "expert_0..expert_11 read as one column per expert",
                                          "router_layer_1.csv: no layer column", "router_layer_3.csv: no layer column",
                                          "every routing counts as decode", "requests one after another", *SHAPE_NOTES],
                    ["ts"])
    assert prov["mapped_by_name"][0] == "experts" and prov["mapping"]["experts"] == "expert_0..expert_11"
    check_figures(tmp_path / "t", rows)
    # the same files through `import table` with no --map: the same trace
    assert run_cli("import", "table", *files, tmp_path / "u", "--expert-bytes", EB).code == 0
    assert (tmp_path / "t" / "trace.json").read_bytes() == (tmp_path / "u" / "trace.json").read_bytes()
    # the layer only in a directory's name: auto cannot tell, and says what settles it
    where = [_wide_csv(tmp_path / "dump" / f"layer_{lay}" / "scores_rank0.csv", rows, lay) for lay in (1, 3)]
    res = run_cli("import", "auto", *where, tmp_path / "v", "--expert-bytes", EB)
    assert_one_sentence_error(res, "reads as a table of routings", "--layer-from-path REGEX", "import table")
    assert not (tmp_path / "v").exists()


def test_auto_reads_slot_columns_and_refuses_two_families(tmp_path):
    rows = truth([(4, 6)], seed=4)
    src = _slot_csv(tmp_path / "topk.csv", rows)
    res = run_cli("import", "auto", src, tmp_path / "t", "--expert-bytes", EB)
    assert res.out.startswith("format: table"), res.err
    imported(res, tmp_path / "t", ["expert_* and weight_* taken as one column per slot", "requests one after another",
                                   *SHAPE_NOTES], [])
    check_figures(tmp_path / "t", rows)
    # two families of numbered expert columns: which one routes is not for auto to guess
    two = tmp_path / "two_layer0.csv"
    two.write_text("expert_0,expert_1,expert_score_0,expert_score_1\n1,0,0.5,0.5\n")
    assert_one_sentence_error(run_cli("import", "auto", two, tmp_path / "w", "--expert-bytes", EB),
                              "several families", "--map experts=expert_*", "import table")


def test_auto_reads_arrays_and_a_wide_jsonl_after_its_metadata_line(tmp_path):
    rows = truth([(0, 12)], seed=5)
    ids = np.array([[next(r["experts"] for r in rows if r["pos"] == t and r["layer"] == lay) for lay in range(3)]
                    for t in range(12)], dtype=np.int32)
    np.save(tmp_path / "topk_ids.npy", ids)
    res = run_cli("import", "auto", tmp_path / "topk_ids.npy", tmp_path / "a", "--expert-bytes", EB)
    assert res.out.startswith("format: table"), res.err
    imported(res, tmp_path / "a", ["every routing counts as decode", "requests one after another", *SHAPE_NOTES], [])
    check_figures(tmp_path / "a", rows)
    np.savez(tmp_path / "routes.npz", topk_ids=ids, token_ids=np.arange(12))
    res = run_cli("import", "auto", tmp_path / "routes.npz", tmp_path / "b", "--expert-bytes", EB)
    assert res.out.startswith("format: table"), res.err
    check_figures(tmp_path / "b", rows)
    # [tokens, k] of one layer: the layer from the name, or auto refuses naming --layer-from-path
    np.save(tmp_path / "ids_layer2.npy", ids[:, 2])
    res = run_cli("import", "auto", tmp_path / "ids_layer2.npy", tmp_path / "c", "--expert-bytes", EB)
    assert res.code == 0 and open_trace(tmp_path / "c").moe_layers == [2], res.err
    np.save(tmp_path / "ids.npy", ids[:, 2])
    assert_one_sentence_error(run_cli("import", "auto", tmp_path / "ids.npy", tmp_path / "d", "--expert-bytes", EB),
                              "of one layer", "--layer-from-path")
    # a float array is no routing: not recognised
    np.save(tmp_path / "f.npy", ids.astype(np.float32))
    assert_one_sentence_error(run_cli("import", "auto", tmp_path / "f.npy", tmp_path / "e", "--expert-bytes", EB),
                              "no importer recognises it")
    # JSONL: a metadata line, then one score field per expert
    src = write_jsonl(tmp_path / "scores.jsonl", [{"vllm_version": "0.9.2"}] + [
        {"position": r["pos"], "layer": r["layer"], **{f"expert_{e}": dict(zip(r["experts"], r["weights"])).get(e, 0.0)
                                                        for e in range(E)}} for r in rows])
    res = run_cli("import", "auto", src, tmp_path / "j", "--expert-bytes", EB)
    assert res.out.startswith("format: table"), res.err
    prov = imported(res, tmp_path / "j", ["expert_* taken as the experts", "expert_0..expert_11 read as one column",
                                          "every routing counts as decode", "requests one after another", *SHAPE_NOTES],
                    [])
    assert prov["engine_version"] == "0.9.2"
    check_figures(tmp_path / "j", rows)
