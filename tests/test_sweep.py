"""``moe-replay sweep``: grid cells equal the single verbs' --json rows, the local pool and Ray write
byte-identical tables, a killed sweep is finished by a rerun with each cell once, a Ray worker
lost mid-task is retried, and bad grids are refused before anything is written (issue 18)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

import replay
from replay.analyses.sweeps import EXAMPLE, KINDS, read_grid, results_lock
from replay.core.frames import rows_of
from tests.helpers import assert_one_sentence_error, run_cli
from traces.format.errors import UserError
from traces.io.digest import trace_content_id

ROOT = Path(__file__).resolve().parent.parent
KIND_NAMES = ("cache", "predict", "drop", "prefetch", "retention")
SHAPE = {"layers": 4, "experts": 16, "top_k": 2, "embd": 16, "tokens": 40, "prompt_tokens": 8}

GRID = """\
traces = ["traces/t*"]
[cache]
policies = ["lru", "lfu", "belady"]
budgets_mib = [12, 40]
cost_model = "cost.json"
[predict]
predictors = ["prev-token", "stale-gate"]
horizons = [1, 2]
[drop]
modes = ["closed"]
fracs = [0.5, 1.0]
budgets_mib = [24]
[prefetch]
predictors = ["prev-token"]
budgets_mib = [24, 40]
caps = [1]
[retention]
predictors = ["prev-token"]
policies = ["lru"]
budgets_mib = [24]
"""

CRASH_ONCE = """\
import os
from pathlib import Path

import numpy as np

NAME = "crash-once"
DESCRIPTION = "the routed experts themselves (an oracle); kills its process the first time it runs"
MARK = Path({mark!r})


def predict(trace, arr, in_phase, width):
    if not MARK.exists():
        MARK.touch()
        os._exit(1)  # the worker process dies mid-task, as a lost node would
    out = np.full((arr.experts.shape[0], width), -1, np.int32)
    w = min(width, arr.experts.shape[1])
    out[:, :w] = arr.experts[:, :w]
    return out
"""

SLOW = """\
import os
import time

import numpy as np

NAME = "slow"
DESCRIPTION = "no guesses; sleeps SLOW_S seconds per call (to kill a sweep midway)"


def predict(trace, arr, in_phase, width):
    time.sleep(float(os.environ.get("SLOW_S", "0")))
    return np.full((arr.experts.shape[0], width), -1, np.int32)
"""


def start_slow_sweep(tmp_path: Path, traces: str, budgets_mib: str, slow_s: str, workers: int, **popen) -> tuple:
    """(grid, out dir, process): ``moe-replay sweep`` of the SLOW predictor (``slow_s`` seconds per
    call) over ``traces`` at ``budgets_mib``, started in its own session (to be killed midway);
    ``popen``: the Popen options for its output."""
    (tmp_path / "slow.py").write_text(SLOW)
    grid = tmp_path / "grid.toml"
    grid.write_text(f'traces = ["{traces}"]\n[prefetch]\npredictors = ["slow"]\npredictor_file = "slow.py"\n'
                    f'budgets_mib = {budgets_mib}\n')
    out = tmp_path / "R"
    env = {**os.environ, "SLOW_S": slow_s, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "replay.cli", "sweep", str(grid), "-o", str(out), "--workers", str(workers)],
                            env=env, cwd=ROOT, start_new_session=True, **popen)
    return grid, out, proc


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Two tiny synthetic traces, the grid, and its sweep on the local pool (two workers)."""
    root = tmp_path_factory.mktemp("sweep")
    (root / "traces").mkdir()
    for seed in (1, 2):
        replay.synth(root / "traces" / f"t{seed}", seed=seed, **SHAPE)
    model = replay.manual_cost_model(flash_mib_s=2000, compute_ms=50)
    (root / "cost.json").write_text(json.dumps(model.row()))
    (root / "grid.toml").write_text(GRID)
    replay.sweep(root / "grid.toml", root / "local", engine="local", workers=2)
    return root


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray instance for the module (starting Ray is slow)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _verb_rows(*args) -> list[dict]:
    res = run_cli(*args, "--json")
    assert res.code == 0, res.err
    return json.loads(res.out)["rows"]


def _sweep_rows(table: Path, trace: str, keys: list[str]) -> list[dict]:
    f = pl.read_parquet(table).filter(pl.col("trace") == trace)
    return [{k: r.get(k) for k in keys} for r in rows_of(f)]


def _sorted(rows: list[dict], *by: str) -> list[dict]:
    return sorted(rows, key=lambda r: tuple(str(r.get(b)) for b in by))


def test_cells_equal_the_verbs_json_rows(world):
    out = world / "local"
    for t in ("t1", "t2"):
        path = world / "traces" / t
        want = _verb_rows("cache", path, "--policies", "lru,lfu,belady", "--budgets", "12,40", "--cost-model",
                          world / "cost.json")
        # a cell's own figures; the paired columns compare cells with each other (sweep-report computes them)
        from replay.analyses.paired import HIT_COLUMNS, TIME_COLUMNS

        want = [{k: v for k, v in r.items() if k not in HIT_COLUMNS + TIME_COLUMNS} for r in want]
        got = _sweep_rows(out / "cache.parquet", f"traces/{t}", list(want[0]))
        assert len(want) == 6 and "ms_per_token" in want[0]
        assert _sorted(got, "policy", "budget_mib") == _sorted(want, "policy", "budget_mib")

        want = _verb_rows("predict", path, "--predictors", "prev-token,stale-gate", "--horizon", "1,2")
        got = _sweep_rows(out / "predict.parquet", f"traces/{t}", list(want[0]))
        assert {r["predictor"] for r in want} == {"prev-token", "stale-gate[1]", "stale-gate[2]"}
        assert _sorted(got, "predictor", "layer") == _sorted(want, "predictor", "layer")

        want = _verb_rows("drop", path, "--mode", "closed", "--fracs", "0.5,1.0", "--budget-mib", "24")
        assert _sweep_rows(out / "drop.parquet", f"traces/{t}", list(want[0])) == want  # one cell: the verb's order

        for b in ("24", "40"):
            want = _verb_rows("prefetch", path, "--predictor", "prev-token", "--budget-mib", b, "--cap", "1")
            got = [r for r in _sweep_rows(out / "prefetch.parquet", f"traces/{t}", list(want[0]))
                   if r["budget_mib"] == float(b)]
            assert got == want

        want = _verb_rows("cache", path, "--retain", "--predictor", "prev-token", "--policies", "lru", "--budgets", "24")
        assert _sweep_rows(out / "retention.parquet", f"traces/{t}", list(want[0])) == want


def test_table_layout_and_grid_order(world):
    f = pl.read_parquet(world / "local" / "cache.parquet")
    assert f.columns[:6] == ["trace_id", "trace", "cell_key", "cell_policy", "cell_budget_mib", "cell_cost_model"]
    # grid order: traces as matched (sorted), then policies x budgets as listed
    assert f.select("trace", "cell_policy", "cell_budget_mib").rows() == [
        (t, p, b) for t in ("traces/t1", "traces/t2") for p in ("lru", "lfu", "belady") for b in (12.0, 40.0)]
    assert f["cell_key"].n_unique() == f.height
    assert f["trace_id"].to_list()[0] == trace_content_id(world / "traces" / "t1")
    assert (f["policy"] == f["cell_policy"]).all() and (f["budget_mib"] == f["cell_budget_mib"]).all()
    d = pl.read_parquet(world / "local" / "drop.parquet")
    assert d["cell_fracs"].to_list()[0] == [0.5, 1.0] and set(d["mode"]) == {"closed", "closed-k"}


def test_rerun_computes_nothing_force_recomputes(world):
    before = {k: (world / "local" / f"{k}.parquet").read_bytes() for k in KIND_NAMES}
    s = replay.sweep(world / "grid.toml", world / "local", workers=1)
    assert s["computed"].sum() == 0 and s["cells"].sum() == 2 * (6 + 3 + 1 + 2 + 1)
    res = run_cli("sweep", world / "grid.toml", "-o", world / "local", "--workers", "1", "--force", "--json")
    assert res.code == 0, res.err
    summary = json.loads(res.out)
    assert summary["computed"] == summary["cells"] == 26 and summary["reused"] == 0
    assert {k: (world / "local" / f"{k}.parquet").read_bytes() for k in KIND_NAMES} == before
    chunks = list((world / "local" / "chunks").glob("*.parquet"))  # compacted: the newest copy of each cell
    assert len(chunks) == 1 and pl.read_parquet(chunks[0])["key"].n_unique() == pl.read_parquet(chunks[0]).height == 26


def test_ray_tables_byte_identical_and_a_lost_worker_is_retried(world, ray_local, tmp_path):
    out = world / "ray"
    replay.sweep(world / "grid.toml", out, engine="ray")
    for k in KIND_NAMES:
        assert (out / f"{k}.parquet").read_bytes() == (world / "local" / f"{k}.parquet").read_bytes(), k

    # A predictor that kills its worker process the first time it runs: Ray runs the task again
    # and each cell is stored once, equal to a local run of the same grid.
    mark = tmp_path / "crashed"
    (tmp_path / "crash_once.py").write_text(CRASH_ONCE.format(mark=str(mark)))
    grid = tmp_path / "grid.toml"
    grid.write_text(f'traces = ["{world}/traces/t*"]\n[predict]\npredictors = ["crash-once", "prev-token"]\n'
                    'predictor_file = "crash_once.py"\n[cache]\npolicies = ["lru"]\nbudgets_mib = [24]\n')
    s = replay.sweep(grid, tmp_path / "ray", engine="ray")
    assert mark.exists(), "the crashing predictor never ran"
    assert s["computed"].to_list() == [4, 2]
    replay.sweep(grid, tmp_path / "local", workers=1)  # the mark exists: no crash here
    for k in ("predict", "cache"):
        a, b = (tmp_path / "ray" / f"{k}.parquet").read_bytes(), (tmp_path / "local" / f"{k}.parquet").read_bytes()
        assert a == b, k
    p = pl.read_parquet(tmp_path / "ray" / "predict.parquet").filter(pl.col("layer").is_null())
    assert sorted(p.select("trace", "predictor").rows()) == sorted(
        (str(world / "traces" / t), n) for t in ("t1", "t2") for n in ("crash-once", "prev-token"))
    assert p.filter(pl.col("predictor") == "crash-once")["slot_acc_pct"].to_list() == [100.0, 100.0]


def test_killed_sweep_is_finished_by_a_rerun(world, tmp_path):
    grid, out, proc = start_slow_sweep(tmp_path, f"{world}/traces/t*", "[20, 24, 28, 32, 36, 40, 44, 48]", "0.4", 1,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not list((out / "chunks").glob("*.parquet")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and its workers, mid-sweep
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
    chunks = list((out / "chunks").glob("*.parquet"))
    done = sum(pl.read_parquet(c).height for c in chunks)
    assert 1 <= done < 16 and not (out / "prefetch.parquet").exists()
    assert json.loads((out / "sweep.json").read_text())["complete"] is False

    s = replay.sweep(grid, out, workers=1)
    assert s["computed"].to_list() == [16 - done]
    assert json.loads((out / "sweep.json").read_text())["complete"] is True
    fresh = replay.sweep(grid, tmp_path / "fresh", workers=2)
    assert fresh["computed"].to_list() == [16]
    assert (out / "prefetch.parquet").read_bytes() == (tmp_path / "fresh" / "prefetch.parquet").read_bytes()
    f = pl.read_parquet(out / "prefetch.parquet")
    assert f.height == 16 and f["cell_key"].n_unique() == 16


def test_a_second_sweep_on_the_same_results_refuses(world):
    with results_lock(world / "local"):
        with pytest.raises(UserError, match="another sweep is writing these results"):
            replay.sweep(world / "grid.toml", world / "local", workers=1)


BAD = [
    ("[nope]\nx = 1\n", "[nope]", "unknown analysis kind"),
    ("[cache]\npolicies = [\"lru\"]\nbudgets_mib = [10]\nwidth = 3\n", "[cache] width", "unknown key"),
    ("[cache]\npolicies = [\"lru\"]\nbudgets_mib = [10, -5]\n", "[cache] budgets_mib", "-5"),
    ("[cache]\npolicies = [\"lru\", \"fifo9\"]\nbudgets_mib = [10]\n", "[cache] policies", "fifo9"),
    ("[predict]\npredictors = [\"prev-token\"]\nhorizons = [0]\n", "[predict] horizons", ">= 1"),
    ("[drop]\nfracs = [0.5, -2]\n", "[drop] fracs", "-2 is not a drop-cold F, a finite number >= 0"),
]


@pytest.mark.parametrize("body,where,what", BAD)
def test_bad_grid_is_one_sentence_and_writes_nothing(world, tmp_path, body, where, what):
    grid = tmp_path / "g.toml"
    grid.write_text(f'traces = ["{world}/traces/t1"]\n' + body)
    res = run_cli("sweep", grid, "-o", tmp_path / "out")
    assert res.code == 2
    assert_one_sentence_error(res, str(grid), where, what)
    assert not (tmp_path / "out").exists()


def test_missing_trace_glob_and_bad_toml(tmp_path):
    grid = tmp_path / "g.toml"
    grid.write_text('traces = ["nowhere/*"]\n[cache]\npolicies = ["lru"]\nbudgets_mib = [10]\n')
    res = run_cli("sweep", grid, "-o", tmp_path / "out")
    assert res.code == 2
    assert_one_sentence_error(res, str(grid), "traces", "nowhere/*", "matches no trace")
    grid.write_text("traces = [\n")
    assert_one_sentence_error(run_cli("sweep", grid, "-o", tmp_path / "out"), str(grid), "not valid TOML")
    assert not (tmp_path / "out").exists()


def test_example_grid_is_valid(world, tmp_path):
    res = run_cli("sweep", "--example")
    assert res.code == 0 and res.out == EXAMPLE
    lines = [f'traces = ["{world}/traces/t*"]' if ln.startswith("traces =") else ln for ln in EXAMPLE.splitlines()]
    (tmp_path / "g.toml").write_text("\n".join(lines) + "\n")
    g = read_grid(tmp_path / "g.toml")
    assert list(g.kinds) == list(KINDS) and len(g.traces) == 2


def test_sweep_report_compares_traces(world):
    rep = replay.sweep_report(world / "local")
    assert rep.select("trace", "budget_mib").rows() == [(t, b) for t in ("traces/t1", "traces/t2") for b in (12.0, 40.0)]
    cache = pl.read_parquet(world / "local" / "cache.parquet")
    for r in rows_of(rep):
        at = cache.filter((pl.col("trace") == r["trace"]) & (pl.col("budget_mib") == r["budget_mib"]))
        online = at.filter(pl.col("policy").is_in(["lru", "lfu"]) & ~pl.col("over_budget"))
        if online.height == 0:
            assert r["best_online"] is None and r["over_budget_excluded"]
        else:
            assert r["best_online_hit_pct_decode"] == online["hit_pct_decode"].max()
        assert r["belady_hit_pct_decode"] == at.filter(pl.col("policy") == "belady")["hit_pct_decode"].item()
        if online.height:  # the cells had a cost model: the fastest online policy within budget
            assert r["fastest_ms_per_token"] == online["ms_per_token"].min()
    res = run_cli("sweep-report", world / "local")
    assert res.code == 0 and "Best online policy" in res.out
    assert_one_sentence_error(run_cli("sweep-report", world / "traces"), "not a sweep results directory")


def test_ray_missing_names_the_extra(world, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(UserError, match=r"moe-replay\[cluster\]"):
        replay.sweep(world / "grid.toml", world / "never", engine="ray")
    assert not (world / "never").exists()


def test_trace_content_id(world, tmp_path):
    import shutil

    a = world / "traces" / "t1"
    shutil.copytree(a, tmp_path / "copy")
    assert trace_content_id(tmp_path / "copy") == trace_content_id(a) != trace_content_id(world / "traces" / "t2")
    meta = json.loads((tmp_path / "copy" / "trace.json").read_text())
    meta["model"]["name"] = "renamed"
    (tmp_path / "copy" / "trace.json").write_text(json.dumps(meta))
    assert trace_content_id(tmp_path / "copy") != trace_content_id(a)


def test_a_failing_cell_is_named_and_unavailable_predictors_are_noted(tmp_path):
    from replay.analyses.sweeps import compute_cell, run_batch

    t = replay.synth(tmp_path / "plain", routing_only=True, **SHAPE)
    frame, notes = compute_cell("predict", str(t.path), {"predictor": "stale-gate[1]"})
    assert frame.height == 0 and len(notes) == 1 and notes[0].startswith("stale-gate[1]: ")
    with pytest.raises(UserError, match=r"sweep cell \[prefetch\] .*plain \(predictor=prev-token\): .*budget_mib"):
        run_batch([("k", "prefetch", str(t.path), {"predictor": "prev-token"})])


def test_engine_options_are_checked(world, monkeypatch):
    with pytest.raises(UserError, match="^workers: only meaningful with engine local"):
        replay.sweep(world / "grid.toml", world / "never", engine="ray", workers=2)
    with pytest.raises(UserError, match="^address: only meaningful with engine ray"):
        replay.sweep(world / "grid.toml", world / "never", address="auto")
    with pytest.raises(UserError, match="is not local or ray"):
        replay.sweep(world / "grid.toml", world / "never", engine="dask")
    assert not (world / "never").exists()
    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as a fresh process would be
    with pytest.raises(UserError, match="address 127.0.0.1:1: no Ray head node answers there"):
        replay.sweep(world / "grid.toml", world / "never", engine="ray", address="127.0.0.1:1")
    assert not (world / "never").exists()


def test_two_paths_to_one_trace_content_are_computed_once(world, tmp_path):
    import shutil

    shutil.copytree(world / "traces" / "t1", tmp_path / "copy")
    grid = tmp_path / "grid.toml"
    grid.write_text(f'traces = ["{world}/traces/t1", "copy"]\n[cache]\npolicies = ["lru"]\nbudgets_mib = [24]\n')
    s = replay.sweep(grid, tmp_path / "R", workers=1)
    assert s["cells"].to_list() == [2] and s["computed"].to_list() == [1]
    f = pl.read_parquet(tmp_path / "R" / "cache.parquet")
    assert f["trace"].to_list() == [str(world / "traces" / "t1"), "copy"] and f["cell_key"].n_unique() == 1
    assert f.drop("trace").unique().height == 1  # the same rows under both names


def test_sweep_report_text_marks_an_over_budget_belady_and_prints_budgets_exactly(tmp_path):
    # The bound's own hit rate needed more memory than the budget it is listed under: marked, as
    # in `cache`; budgets are parameters, printed exactly (12.25, not through :g).
    from replay.cli.sweep import report_text

    frame = pl.DataFrame([
        {"trace": "t", "budget_mib": 12.25, "best_online": None, "best_online_hit_pct_decode": None,
         "belady_hit_pct_decode": 55.7, "belady_over_budget": True, "gap_to_belady_pp": None,
         "over_budget_excluded": "lru (peak 35.0 MiB)"},
        {"trace": "t", "budget_mib": 40.0, "best_online": "lru", "best_online_hit_pct_decode": 63.3,
         "belady_hit_pct_decode": 80.7, "belady_over_budget": False, "gap_to_belady_pp": 17.4,
         "over_budget_excluded": None},
    ])
    text = report_text(frame, tmp_path)
    rows = [line for line in text.splitlines() if line.lstrip().startswith("t ")]
    assert rows[0].split()[4:6] == ["55.7", "!"] and "!" not in rows[1]
    assert "Belady over budget" in text and "t at 12.25 MiB" in text


def test_a_corrupt_chunk_is_named_set_aside_and_recomputed(world, tmp_path):
    """issue 29 item 4: a chunk that does not read back (garbage, a cell whose rows do not decode)
    was fatal (exit 3) on resume; now it is named, set aside and its cells computed again, and the
    tables come out byte-identical. An unreadable table refuses sweep-report in one sentence."""
    out = tmp_path / "res"
    shutil.copytree(world / "local", out)
    chunks = sorted((out / "chunks").glob("*.parquet"))
    assert len(chunks) == 1  # compacted when the sweep ended
    want = {k: (world / "local" / f"{k}.parquet").read_bytes() for k in KIND_NAMES}
    chunks[0].write_bytes(b"PAR1 this is not a parquet file PAR1")
    res = run_cli("sweep", world / "grid.toml", "-o", out, "--workers", "1", "--json")
    assert res.code == 0, res.err
    assert f"{chunks[0]}: is not a readable Parquet file" in res.err and "computed again" in res.err
    assert res.json()["computed"] == res.json()["cells"]
    assert {k: (out / f"{k}.parquet").read_bytes() for k in KIND_NAMES} == want
    assert (out / "chunks" / (chunks[0].name + ".corrupt")).exists()
    # a chunk whose Parquet is sound but one cell's rows are garbage
    good = sorted((out / "chunks").glob("*.parquet"))[-1]
    t = pl.read_parquet(good)
    t = t.with_columns(pl.when(pl.int_range(pl.len()) == 0).then(pl.lit(b"garbage")).otherwise(pl.col("rows")).alias("rows"))
    t.write_parquet(good)
    res = run_cli("sweep", world / "grid.toml", "-o", out, "--workers", "1", "--json")
    assert res.code == 0, res.err
    assert "whose rows do not decode" in res.err
    assert {k: (out / f"{k}.parquet").read_bytes() for k in KIND_NAMES} == want
    (out / "cache.parquet").write_bytes(b"garbage")
    assert_one_sentence_error(run_cli("sweep-report", out), str(out / "cache.parquet"), "not a readable Parquet table")


def test_sweep_report_gives_the_budget_answer_of_curve_cells_and_where_a_cache_grid_bends(world, tmp_path):
    """issue 32 item 3: a [curve] cell's budget answer is the curve verb's (plateau, knees, cliff,
    doublings); a [cache] grid with enough budgets says where its tested budgets' hit rate bends
    (between the knee and the tested budget below it), computed here again from the table."""
    t1 = world / "traces" / "t1"
    res = replay.curve_run(t1, policies=["lru"])
    W = res.working_set_bytes / 2**20
    budgets = sorted({round(W * f, 2) for f in (0.1, 0.25, 0.5, 0.75, 1.0)})
    grid = tmp_path / "g.toml"
    grid.write_text(f'traces = ["{t1}"]\n[cache]\npolicies = ["lru"]\nbudgets_mib = {budgets}\n'
                    '[curve]\npolicies = ["lru"]\n')
    replay.sweep(grid, tmp_path / "R", workers=1)
    ans = rows_of(replay.sweep_budget_answer(tmp_path / "R"))
    assert [(r["source"], r["policy"]) for r in ans] == [("curve", "lru"), ("cache", "lru")]
    cv, ca = ans
    a = res.answer
    assert cv["plateau_pct"] == a["plateau_pct"] and cv["below_t_pct"] == a["below_t_pct"] and cv["at_t_pct"] == a["at_t_pct"]
    assert [cv["knee_1pp_mib"], cv["knee_5pp_mib"]] == [k["budget_mib"] for k in a["knees"]]
    lru = res.frame.filter(pl.col("policy") == "lru")
    assert cv["plateau_at_mib"] == lru.filter(pl.col("hit_pct_decode") == a["plateau_pct"])["budget_mib"].min() <= W
    assert [(d["from_mib"], d["gain_pp"]) for d in cv["steps"]] == [(d["from_mib"], d["gain_pp"]) for d in a["doublings"]]
    cache = pl.read_parquet(tmp_path / "R" / "cache.parquet").filter(pl.col("layer").is_null()).sort("budget_mib")
    b, h, ob = cache["budget_mib"].to_list(), cache["hit_pct_decode"].to_list(), cache["over_budget"].to_list()
    assert ca["budgets"] == len(budgets) and ca["plateau_pct"] == max(h) and ca["plateau_reached"] is True
    for tol in (1, 5):
        i = next(i for i in range(len(b)) if not ob[i] and h[i] >= max(h) - tol)
        assert ca[f"knee_{tol}pp_mib"] == b[i] and ca[f"knee_{tol}pp_after_mib"] == (b[i - 1] if i else None)
    assert [d["gain_pp"] for d in ca["steps"]] == [y - x for x, y in zip(h, h[1:])]
    out = run_cli("sweep-report", tmp_path / "R")
    assert out.code == 0, out.err
    assert "budget answer" in out.out and "knee" in out.out and "cliff" in out.out and "tested budgets" in out.out
    assert run_cli("sweep-report", tmp_path / "R", "--json").json()["budget_answer"][0]["plateau_pct"] == a["plateau_pct"]
    # a curve-only grid: no cache comparison to make, the budget answer still given; too few budgets: said so
    grid.write_text(f'traces = ["{t1}"]\n[curve]\npolicies = ["lru"]\n')
    replay.sweep(grid, tmp_path / "C", workers=1)
    assert replay.sweep_report(tmp_path / "C").height == 0
    out = run_cli("sweep-report", tmp_path / "C")
    assert out.code == 0 and "plateau" in out.out and "best online" not in out.out
    few = rows_of(replay.sweep_budget_answer(world / "local"))
    assert few == []
    assert "too few to say where the hit rate bends" in run_cli("sweep-report", world / "local").out


def test_drop_cold_f_has_one_range_in_grids_the_api_and_the_cli(synth_trace_dir, tmp_path):
    """F ('skip a miss whose weight < F / k') is checked by one function: a grid takes the values
    'drop --fracs' and 'prefetch --drop' take (0 and F > 1 included: the report runs 1.5), and
    refuses the same ones in the same sentence."""
    t = synth_trace_dir(**SHAPE)
    grid = tmp_path / "g.toml"
    body = '[drop]\nmodes = ["closed"]\nbudgets_mib = [10]\nfracs = [{fracs}]\n[prefetch]\nbudgets_mib = [10]\ndrop_fracs = [{drop}]\n'
    grid.write_text(f'traces = ["{t}"]\n' + body.format(fracs="0, 0.5, 1.5, 2", drop="0, 1.5"))
    kinds = read_grid(grid).kinds
    assert kinds["drop"][0]["fracs"] == [0.0, 0.5, 1.5, 2.0]
    assert [c["drop_frac"] for c in kinds["prefetch"]] == [0.0, 1.5]
    said = "is not a drop-cold F, a finite number >= 0"
    for bad in ("-0.5", "nan", "inf"):
        for fracs, drop in ((f"0.5, {bad}", "1"), ("0.5", bad)):
            grid.write_text(f'traces = ["{t}"]\n' + body.format(fracs=fracs, drop=drop))
            with pytest.raises(UserError) as e:
                read_grid(grid)
            assert str(e.value).startswith(f"{grid.resolve()}: [") and said in str(e.value)
    with pytest.raises(UserError, match=r"^fracs: -0.5 is not a drop-cold F, a finite number >= 0"):
        replay.drop(t, fracs=[0.5, -0.5])
    with pytest.raises(UserError, match=r"^drop_frac: -0.5 is not a drop-cold F, a finite number >= 0"):
        replay.prefetch(t, budget_mib=10, drop_frac=-0.5)
    assert_one_sentence_error(run_cli("drop", t, "--fracs", "0.5,-0.5"), "--fracs: -0.5 " + said)
    assert_one_sentence_error(run_cli("prefetch", t, "--budget-mib", "10", "--drop", "-0.5"), "--drop: -0.5 " + said)
