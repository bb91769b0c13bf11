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
