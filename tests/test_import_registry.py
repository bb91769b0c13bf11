"""Issue 16 item 1: one importer registry, ``import --list``, ``import auto`` and the module contract."""

from __future__ import annotations

import pytest

from tests.conftest import real_files
from tests.helpers import assert_one_sentence_error, run_cli
from traces.importers import provenance, registry


def test_every_importer_module_keeps_the_contract():
    reg = registry()
    assert "bigmoe" in reg
    for name, mod in reg.items():
        assert mod.NAME == name and mod.SUMMARY and mod.ENGINE
        assert isinstance(mod.TAKES_SIZES, bool)
        assert mod.MAX_SOURCES is None or mod.MAX_SOURCES >= 1
        for o in mod.OPTIONS:
            assert o.flag.startswith("--") and o.name.isidentifier() and o.help


def test_list_names_every_format():
    res = run_cli("import", "--list")
    assert res.code == 0, res.err
    for name, mod in registry().items():
        assert any(line.split()[0] == name and mod.SUMMARY in line for line in res.out.splitlines())
    assert "auto" in res.out


def test_auto_chooses_bigmoe_and_says_so(tmp_path):
    csv_path, _ = real_files("qwen")
    res = run_cli("import", "auto", csv_path, tmp_path / "t")
    assert res.code == 0, res.err
    assert res.out.splitlines()[0] == "format: bigmoe (recognised by its sniffer)"
    direct = tmp_path / "d"
    assert run_cli("import", "bigmoe", csv_path, direct).code == 0
    assert (tmp_path / "t" / "trace.json").read_bytes() == (direct / "trace.json").read_bytes()
    js = run_cli("import", "auto", csv_path, tmp_path / "j", "--json").json()
    assert js["format"] == "bigmoe" and js["command"] == "import auto"


def test_auto_refuses_what_no_importer_reads(tmp_path):
    src = tmp_path / "notes.txt"
    src.write_text("hello\nworld\n")
    res = run_cli("import", "auto", src, tmp_path / "t")
    assert_one_sentence_error(res, "no importer recognises it", "import FORMAT")
    assert not (tmp_path / "t").exists()


def test_bigmoe_takes_one_source_and_no_size_options(tmp_path):
    csv_path, _ = real_files("qwen")
    assert_one_sentence_error(run_cli("import", "bigmoe", csv_path, csv_path, tmp_path / "t"), "takes 1 source")
    assert_one_sentence_error(run_cli("import", "bigmoe", tmp_path / "t"), "SRC... OUT")
    res = run_cli("import", "bigmoe", csv_path, tmp_path / "t", "--expert-bytes", "5")
    assert res.code == 2 and "--expert-bytes" in res.err
    assert not (tmp_path / "t").exists()


def test_auto_refuses_sizes_for_a_format_that_states_them(tmp_path):
    csv_path, _ = real_files("qwen")
    res = run_cli("import", "auto", csv_path, tmp_path / "t", "--expert-bytes", "5")
    assert_one_sentence_error(res, "states its own expert sizes", "--expert-bytes")
    assert not (tmp_path / "t").exists()


def test_provenance_names_files_and_hashes(tmp_path):
    a = tmp_path / "a.log"
    a.write_bytes(b"abc")
    p = provenance("x", [a], engine="E", engine_version="1.2", notes=["n"])
    assert p["sources"] == [{"file": "a.log", "sha256": "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
                             "bytes": 3}]
    assert p["engine_version"] == "1.2" and p["importer"] == "x" and p["notes"] == ["n"]


@pytest.mark.parametrize("fmt", sorted(registry()))
def test_each_format_has_help(fmt):
    res = run_cli("import", fmt, "--help")
    assert res.code == 0 and "SRC" in res.out


def test_shared_routing_helpers_agree_with_a_plain_loop():
    """The registry's helpers that colibri, llamacpp-moetrace, table, bigmoe, megatron and sglang share."""
    import numpy as np

    from traces.importers import repeated_expert_rows, slots_by_weight

    rng = np.random.default_rng(7)
    experts = rng.integers(0, 5, (200, 3))
    want = [r for r in range(200) if len(set(experts[r].tolist())) < 3]
    assert repeated_expert_rows(experts).tolist() == want and want
    assert repeated_expert_rows(experts[:, :1]).size == 0
    weights = rng.integers(0, 4, (200, 3)).astype(np.float64)  # ties: the logged order stays
    ex, w, moved = slots_by_weight(experts, weights)
    for r in range(200):
        order = sorted(range(3), key=lambda j: -weights[r, j])  # sorted() is stable
        assert ex[r].tolist() == experts[r, order].tolist() and w[r].tolist() == weights[r, order].tolist()
    assert moved == sum(sorted(range(3), key=lambda j: -weights[r, j]) != [0, 1, 2] for r in range(200))


def test_json_objects_names_where_each_value_stands(tmp_path):
    from traces.format.errors import UserError
    from traces.importers import json_objects

    (tmp_path / "a.jsonl").write_text('{"x": 1}\n\n[2]\n')
    (tmp_path / "b.json").write_text('[{"x": 1}, 3]')
    (tmp_path / "c.json").write_text('{"x": 1}')
    (tmp_path / "d.jsonl").write_text('{"x": 1}\n{"x":\n')
    assert json_objects(tmp_path / "a.jsonl") == [(f"{tmp_path / 'a.jsonl'}: line 1", {"x": 1}), (f"{tmp_path / 'a.jsonl'}: line 3", [2])]
    assert json_objects(tmp_path / "b.json") == [(f"{tmp_path / 'b.json'}: item 0", {"x": 1}), (f"{tmp_path / 'b.json'}: item 1", 3)]
    assert json_objects(tmp_path / "c.json") == [(str(tmp_path / "c.json"), {"x": 1})]
    with pytest.raises(UserError, match=r"d\.jsonl: line 2: is not valid JSON"):
        json_objects(tmp_path / "d.jsonl")
