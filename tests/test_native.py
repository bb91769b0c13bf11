"""The native path of ``cache --json`` (replay/native.py): no NumPy, no Arrow, the same JSON as the
ordinary path byte for byte, and None (the ordinary path runs) for anything it does not take."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay import aot, fastcli, native
from tests.helpers import modules_after
from traces import TraceWriter, pq_native
from traces.schema import default_gating

pytestmark = pytest.mark.skipif(aot.load() is None or pq_native.load() is None,
                                reason=f"the compiled modules are not built: {aot.why_unavailable() or pq_native.why_unavailable()}")
_counter = itertools.count()


def native_json(**opts) -> str | None:
    """The JSON the console script prints when the native path takes the run, else None."""
    got = native.cache_rows(**opts)
    return None if got is None else fastcli.cache_json_text(opts["trace"], opts["phase"], *got)


def both(trace: Path | str, budgets: str | None = None, budget_mib: str | None = "1", policies: str = "lru", phase: str = "decode",
         seed: int = 0, stream: str = "on", per_layer: bool = False) -> tuple[str | None, str]:
    """(the native path's JSON or None, the ordinary path's JSON) for the same options."""
    opts = dict(trace=str(trace), budgets=budgets, budget_mib=budget_mib, policies=policies, phase=phase, seed=seed,
                stream=stream, per_layer=per_layer)
    return native_json(**opts), fastcli.cache_json(**opts)


@st.composite
def plans(draw):
    """A small trace as rows: batches of 1-4 tokens (a prefill batch's load holds several rows),
    each token routed at every MoE layer; weights in rank order, or NaN for a whole routing."""
    n_layer = draw(st.integers(1, 4))
    moe = sorted(draw(st.sets(st.integers(0, n_layer - 1), min_size=1)))
    n_expert = draw(st.integers(2, 9))
    k = draw(st.integers(1, min(4, n_expert)))
    sizes = [draw(st.integers(1, 5000)) if layer in moe else None for layer in range(n_layer)]
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    rows, step = [], 0
    for b in range(draw(st.integers(1, 6))):
        phase = draw(st.integers(0, 1))
        toks = draw(st.integers(1, 4))
        for layer in moe:
            for s in range(toks):
                ex = rng.choice(n_expert, size=k, replace=False).tolist()
                w = (np.full(k, np.nan, np.float32) if rng.random() < 0.2 else
                     np.sort(rng.integers(0, 5, size=k).astype(np.float32) / 4.0)[::-1]).tolist()
                rows.append(dict(turn=0, batch=b, phase=phase, step=step + s, layer=layer, experts=ex, weights=w))
        step += toks
    return {"n_layer": n_layer, "moe": moe, "n_expert": n_expert, "k": k, "sizes": sizes, "rows": rows,
            "tpp": draw(st.integers(1, 3)), "wide": draw(st.booleans())}


def write(plan: dict, root: Path) -> Path:
    out = root / f"t{next(_counter)}"
    meta = {"model": {"name": "h", "arch": "test", "n_layer": plan["n_layer"], "moe_layers": plan["moe"],
                      "n_expert": plan["n_expert"], "top_k": plan["k"], "top_k_native": plan["k"], "n_embd": None},
            "expert_bytes": plan["sizes"], "dense_bytes": [None] * plan["n_layer"],
            "gating": default_gating("softmax", True), "provenance": {"engine": "hypothesis"}}
    cols = ("logits",) if plan["wide"] else ()
    w = TraceWriter(out, meta, columns=cols, tokens_per_part=plan["tpp"])
    for r in plan["rows"]:  # one row at a time: parts end anywhere, loads straddle them
        extra = {"logits": np.zeros((1, plan["n_expert"]), np.float32)} if plan["wide"] else {}
        w.append(turn=r["turn"], batch=r["batch"], phase=r["phase"], step=r["step"], layer=r["layer"],
                 experts=[r["experts"]], weights=[r["weights"]], **extra)
    w.close()
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=plans(), data=st.data())
def test_same_json_as_the_ordinary_path(tmp_path, plan, data):
    trace = write(plan, tmp_path)
    total = sum(s or 0 for s in plan["sizes"]) * plan["n_expert"]
    budgets = ",".join(str(data.draw(st.integers(1, total)) / 2**20 + 1e-9 * i) for i in range(data.draw(st.integers(1, 3))))
    policies = data.draw(st.sampled_from(["lru", "layer", "lru,layer", "layer,lru", " lru , lru"]))
    kw = dict(budgets=budgets, budget_mib=None) if data.draw(st.booleans()) else dict(budget_mib=budgets.split(",")[0])
    mine, theirs = both(trace, policies=policies, per_layer=data.draw(st.booleans()),
                        stream=data.draw(st.sampled_from(["on", "off", "auto"])), phase=data.draw(st.sampled_from(["decode", "all"])),
                        **kw)
    assert mine is not None, "the native path gave up on a trace it takes"
    assert mine == theirs


def test_the_synthetic_trace_and_per_layer_rows(synth_trace_dir):
    t = synth_trace_dir(layers=6, experts=16, top_k=2, tokens=300, prompt_tokens=20, seed=3, routing_only=True)
    for pol, per_layer in (("lru", False), ("lru,layer", True)):
        mine, theirs = both(t, budgets="0.5,2.5,40", budget_mib=None, policies=pol, per_layer=per_layer)
        assert mine is not None and mine == theirs
        rows = json.loads(mine)["rows"]
        assert all(r["lookups"] > 0 for r in rows)
        assert any(0 < r["hits"] < r["lookups"] for r in rows)  # budgets between "nothing fits" and "everything fits"


@pytest.mark.parametrize("name", ["qwen", "gptoss"])
def test_real_traces(tmp_path, real_trace_dir, name):
    """A phone trace as imported (recorded residency and bytes, engine metrics: their checks are the
    ordinary path's) is given back; its routings alone (the same rows, written without those) are
    replayed natively, with the same JSON."""
    from traces import open_trace

    src = real_trace_dir(name)
    assert native_json(trace=str(src), budgets=None, budget_mib="3000", policies="lru", phase="decode", seed=0,
                             stream="on", per_layer=False) is None
    t = open_trace(src)
    a = t.arrays(recorded=False)
    meta = {key: t.meta[key] for key in ("model", "expert_bytes", "dense_bytes", "gating", "provenance")}
    out = tmp_path / "routings-only"
    w = TraceWriter(out, meta, tokens_per_part=37)  # parts end inside batches and loads
    w.append(turn=a.turn, batch=a.batch, phase=a.phase, step=a.step, layer=a.layer, experts=a.experts, weights=a.weights)
    w.close()
    mine, theirs = both(out, budgets="1500,3000,4000", budget_mib=None, policies="lru,layer", per_layer=True)
    assert mine is not None and mine == theirs
    assert json.loads(mine)["rows"][0]["hits"] > 0


@pytest.fixture(scope="module")
def tiny(synth_trace_dir):
    return synth_trace_dir(layers=4, experts=16, top_k=2, tokens=40, prompt_tokens=8, seed=5, routing_only=True)


def test_options_it_gives_back(tiny):
    assert both(tiny)[0] is not None
    for kw in (dict(budget_mib=None),  # default budgets: the working set first
               dict(policies="lru,lfu"), dict(policies="belady"), dict(policies="nope"), dict(policies=""),
               dict(phase="both"), dict(stream="sometimes"), dict(seed=-1), dict(budget_mib="-1"), dict(budget_mib="x"),
               dict(budgets="1,2")):  # --budgets and --budget-mib both
        assert native_json(**{**dict(trace=str(tiny), budgets=None, budget_mib="1", policies="lru", phase="decode",
                                           seed=0, stream="on", per_layer=False), **kw}) is None, kw


def copy_trace(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_part(trace: Path, i: int, **opts) -> None:
    part = trace / "routings" / f"part-{i:05d}.parquet"
    table = pq.read_table(part)
    part.unlink()
    pq.write_table(table, part, **opts)


@pytest.mark.parametrize("how", ["dictionary", "snappy", "no arrow schema", "v2 pages", "bad row", "metrics", "router",
                                 "request column", "missing part", "truncated", "rows mismatch"])
def test_traces_it_gives_back(tmp_path, tiny, how):
    t = copy_trace(tiny, tmp_path / "t")
    if how == "dictionary":
        rewrite_part(t, 0, use_dictionary=True, compression="zstd")
    elif how == "snappy":
        rewrite_part(t, 0, compression="snappy", use_dictionary=False)
    elif how == "no arrow schema":
        rewrite_part(t, 0, store_schema=False, use_dictionary=False)
    elif how == "v2 pages":
        rewrite_part(t, 0, data_page_version="2.0", use_dictionary=False, compression="zstd")
    elif how == "bad row":
        part = t / "routings" / "part-00000.parquet"
        table = pq.read_table(part)
        ex = table.column("experts").combine_chunks()
        vals = ex.values.to_numpy().copy()
        vals[3] = 99  # out of range
        import pyarrow as pa

        table = table.set_column(table.schema.get_field_index("experts"), table.schema.field("experts"),
                                 pa.FixedSizeListArray.from_arrays(pa.array(vals, pa.int32()), ex.type.list_size))
        part.unlink()
        pq.write_table(table, part, compression="zstd", use_dictionary=False)
    elif how == "metrics":
        (t / "metrics.parquet").write_bytes(b"x")
    elif how == "router":
        (t / "router.parquet").write_bytes(b"x")
    elif how == "request column":
        meta = json.loads((t / "trace.json").read_text())
        meta["columns"] = ["request"]
        (t / "trace.json").write_text(json.dumps(meta))
    elif how == "missing part":
        (t / "routings" / "part-00000.parquet").unlink()
    elif how == "truncated":
        part = t / "routings" / "part-00000.parquet"
        part.write_bytes(part.read_bytes()[:-100])
    elif how == "rows mismatch":
        meta = json.loads((t / "trace.json").read_text())
        meta["rows"] = meta["rows"] + 1
        (t / "trace.json").write_text(json.dumps(meta))
    mine = native_json(trace=str(t), budgets=None, budget_mib="1", policies="lru", phase="decode", seed=0, stream="on",
                             per_layer=False)
    if how == "v2 pages" and mine is not None:  # the C reader may take v2 pages: then it must agree
        assert mine == fastcli.cache_json(trace=str(t), budgets=None, budget_mib="1", policies="lru", phase="decode", seed=0,
                                          stream="on", per_layer=False)
        return
    assert mine is None


@pytest.mark.parametrize("opts", [dict(row_group_size=7), dict(compression="none"), dict(data_page_size=64),
                                  dict(write_statistics=False, row_group_size=50)])
def test_other_layouts_it_takes(tmp_path, tiny, opts):
    """Part files written by other pyarrow options it reads (several row groups, no compression,
    many small pages): the same JSON."""
    t = copy_trace(tiny, tmp_path / "t")
    for i in range(len(list((t / "routings").glob("part-*.parquet")))):
        rewrite_part(t, i, **{"compression": "zstd", "use_dictionary": False, **opts})
    mine, theirs = both(t, budgets="0.01,0.05", budget_mib=None, policies="lru,layer", per_layer=True)
    assert mine is not None and mine == theirs


def test_turned_off(tiny, monkeypatch):
    monkeypatch.setenv("MOE_REPLAY_NATIVE", "0")
    assert both(tiny)[0] is None


def test_console_script_imports_neither_numpy_nor_arrow(tiny):
    out, mods = modules_after("replay.fastcli", "cache", str(tiny), "--budget-mib", "1", "--policies", "lru,layer", "--json")
    assert json.loads(out)["rows"][0]["lookups"] > 0
    assert not {"numpy", "pyarrow", "polars", "typer", "numba"} & mods, sorted({"numpy", "pyarrow", "polars", "typer", "numba"} & mods)
    assert out == fastcli.cache_json(trace=str(tiny), budgets=None, budget_mib="1", policies="lru,layer", phase="decode", seed=0,
                                     stream="auto", per_layer=False) + "\n"


def test_state_constants_are_the_replays():
    import importlib

    from replay import cache_kernel, cache_state

    cache = importlib.import_module("replay.cache")  # the package's attribute `cache` is the API's function

    for name in ("RESIDENT", "LAST_TICK", "LAST_LOAD", "NEXT_USE", "PIN", "GROUP", "BYTES", "RES_POS", "PRED_MARK", "N_ENT",
                 "BASE", "BUDGET", "BATCH_LOAD", "N_GRP", "NEVER", "MAX_SLOTS"):
        assert getattr(native, name) == getattr(cache_state, name), name
    for name in ("N_ACC", "ACC_LOOKUPS", "ACC_HITS", "ACC_READ", "N_STATS", "STAT_EVICTIONS", "STAT_OVERFLOW", "STAT_TICKS",
                 "STAT_PEAK_BYTES", "N_OPTS", "OPT_AHEAD", "OPT_CAP", "OPT_TICK0", "OPT_LOAD0", "OPT_BATCH0"):
        assert getattr(native, name) == getattr(cache_kernel, name), name
    assert native.STATE_BYTES_PER_ENTRY == cache.STATE_BYTES_PER_ENTRY
    for n in (1, 15, 16, 17, 6144, 100_000):
        assert native._row_length(n) == cache_state.row_length(n)


@pytest.mark.parametrize("policy", ["lru", "layer"])
def test_fresh_state_is_the_replays(tiny, policy):
    """The native path builds a cell's state without NumPy (replay.native._Cell); it holds the bytes
    replay.cache_state.new_state, replay.cache._groups and replay.policies.lru.init make for the
    same trace, policy and budget (as replay.cache_stream builds a cell)."""
    import importlib

    from replay.cache_state import new_state
    from replay.policies import policy_module
    from traces import open_trace

    cache = importlib.import_module("replay.cache")
    loads = cache.loads_of(open_trace(tiny))
    t = native._open(str(tiny))
    for budget_mib in (0.001, 0.37, 5.0):
        cell = native._Cell(t, policy, budget_mib)
        pm = policy_module(policy)
        group, gbud = cache._groups(loads, pm, cache.budget_bytes(budget_mib))
        ent, grp = new_state(loads.entry_bytes, group, gbud)
        info = np.stack([group[::loads.n_expert], loads.layer_expert_bytes]).T.astype(np.int64)
        assert bytes(cell.ent) == ent.tobytes()
        assert bytes(cell.grp) == grp.tobytes()
        assert bytes(cell.ps) == pm.init(ent, grp, 0).tobytes()
        assert bytes(cell.layer_info) == info.tobytes()


def test_memory_estimate_is_what_it_allocates(tmp_path):
    """replay.native.memory_bytes (what `info` prints for the native path) counts the buffers a run
    allocates: two parts' columns at the largest part's size, and each cell's state; None for a
    trace the native path does not take."""
    from replay.info import info_rows
    from traces import open_trace
    from traces.units import MIB

    d = tmp_path / "t"
    meta = {"model": {"name": "h", "arch": "test", "n_layer": 3, "moe_layers": [0, 2], "n_expert": 8, "top_k": 2,
                      "top_k_native": 2, "n_embd": None},
            "expert_bytes": [100, None, 300], "dense_bytes": [None] * 3, "gating": default_gating("softmax", True),
            "provenance": {"engine": "test"}}
    w = TraceWriter(d, meta, tokens_per_part=256)
    rng = np.random.default_rng(4)
    for s in range(700):
        for layer in (0, 2):
            w.append(turn=0, batch=s, phase=1, step=s, layer=layer, experts=[rng.choice(8, 2, replace=False)],
                     weights=[[0.6, 0.4]])
    w.close()
    tr = open_trace(d)
    assert len(tr.parts) == 3 and tr.part_rows[0] == max(tr.part_rows) > tr.part_rows[-1]
    t = native._open(str(d))
    reader = native._Reader(pq_native.load(), aot.load(), t)
    for i in (0, 1):
        reader.start(i)
        reader.get()
    columns = sum(len(b) for store in reader.stores for b in store.values())
    assert columns == 2 * max(tr.part_rows) * native.row_bytes(tr.top_k)
    cell = native._Cell(t, "layer", 1.0)
    held = sum(m.nbytes for m in (cell.ent, cell.grp, cell.layer_info, cell.acc)) + len(cell.ps) * cell.ps.itemsize
    assert held == native.cell_bytes(len(tr.moe_layers), tr.n_expert)
    transient = 2 * max(tr.part_rows) * 4 * tr.top_k
    assert native.memory_bytes(tr) == columns + transient + held
    assert info_rows(tr)[0]["cache_memory_mib_native"] == native.memory_bytes(tr) / MIB


def test_memory_estimate_none_where_it_gives_back(tmp_path, tiny):
    from replay.info import info_rows
    from traces import open_trace

    t = copy_trace(tiny, tmp_path / "t")
    assert native.memory_bytes(open_trace(t)) is not None
    meta = json.loads((t / "trace.json").read_text())
    meta["columns"] = ["residency"]
    import pyarrow as pa

    k = meta["model"]["top_k"]
    for p in sorted((t / "routings").glob("part-*.parquet")):
        tb = pq.read_table(p)
        res = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(tb.num_rows * k, np.uint8)), k)
        tb = tb.append_column(pa.field("residency", res.type, nullable=False), res)
        p.unlink()
        pq.write_table(tb, p)
    (t / "trace.json").write_text(json.dumps(meta))
    tr = open_trace(t)
    assert native.memory_bytes(tr) is None and info_rows(tr)[0]["cache_memory_mib_native"] is None
