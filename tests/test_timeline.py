"""The timeline (replay.analyses.timeline): the Numba kernel equals the event-by-event twin in
tests/naive/timeline.py exactly, on random traces, predictions and device profiles."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.analyses.timeline import Profile, kernel_params, time_replay
from replay.core.simulate import replay
from tests.naive.timeline import naive_timeline
from tests.test_cache_twin import drawn_loads, traces
from tests.test_whatif_twin import predictions

STATUS = {0: "wasted", 1: "useful", 2: "late", 3: "untimed"}


@st.composite
def profiles(draw):
    return Profile(lanes=draw(st.integers(1, 4)), lane_mib_s=draw(st.sampled_from([0.5, 3.0, 100.0, 1000.0])),
                   read_latency_ms=draw(st.sampled_from([0.0, 0.05, 1.0])),
                   compute_ms_per_layer=draw(st.sampled_from([0.0, 0.3, 2.5])), overlap=draw(st.booleans()),
                   expert_share=draw(st.sampled_from([0.0, 0.4, 1.0])),
                   token_overhead_ms=draw(st.sampled_from([0.0, 1.5])), serial_ms_per_mib=draw(st.sampled_from([0.0, 0.7])))


def _naive_loads(loads, res, pred):
    out = []
    for g in range(loads.load_start.shape[0] - 1):
        lo, hi = int(loads.load_start[g]), int(loads.load_start[g + 1])
        rows = []
        for r in range(lo, hi):
            slots = [(int(e), int(c)) for e, c in zip(loads.entries[r], res.slots[r], strict=True)]
            preds = [] if res.fills is None else [(int(e), int(c)) for e, c in zip(pred[r], res.fills[r], strict=True)]
            rows.append((slots, preds))
        b = int(loads.load_batch[g])
        out.append({"batch": b, "phase": int(loads.batch_phase[b]), "pos": int(loads.load_lidx[g]), "rows": rows})
    return out


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), t=traces(), prof=profiles(), policy=st.sampled_from(["lru", "lfru"]), ahead=st.integers(1, 3),
       fill=st.booleans(), layer_issue=st.booleans())
def test_timeline_matches_event_by_event_twin(data, t, prof, policy, ahead, fill, layer_issue):
    moe_layers, n_layer, n_expert, k, eb, rows, budget_units = t
    if not rows:
        return
    loads = drawn_loads(*t)
    pred = None
    if fill:
        preds = data.draw(predictions(rows, n_expert, data.draw(st.integers(1, 3))))
        lidx = {layer: i for i, layer in enumerate(moe_layers)}
        pred = np.full((len(rows), len(preds[0])), -1, np.int32)
        for r, p in enumerate(preds):
            for j, ex in enumerate(p):
                if ex is not None:
                    pred[r, j] = lidx[rows[r][4]] * n_expert + ex
        res = replay(loads, policy, budget_units / 16, slots=True, pred=pred, ahead=ahead, fill=True, fills=True)
    else:
        res = replay(loads, policy, budget_units / 16, slots=True)
    issue = ahead if layer_issue else 0
    got = time_replay(loads, res, prof, pred, issue)
    want = naive_timeline(_naive_loads(loads, res, pred), [int(x) for x in loads.layer_expert_bytes],
                          [float(x) for x in kernel_params(prof)], issue, prof.lanes, prof.overlap)
    assert got.tok.tolist() == want["tok"]
    assert [STATUS[int(s)] for s in got.fill_status] == [f["status"] for f in want["fills"]]
    assert got.fill_bytes.tolist() == [f["bytes"] for f in want["fills"]]
    assert all(_same(a, f["lead"]) for a, f in zip(got.fill_lead_ms.tolist(), want["fills"], strict=True))
    assert got.read_ms_total == want["read_ms_total"]


def test_timeline_twin_agrees_to_the_last_bit_with_fills_on_one_slow_lane():
    # Hypothesis found it: a load's speculative reads were summed apart and then added to the token's
    # lane time (750.1999999999999 ms against the twin's 750.2); every read now adds in turn.
    rows = [(0, b, 1, b, layer, [0, 0, 0, 0]) for b in range(6) for layer in range(4)]
    t = ([0, 1, 2, 3], 4, 3, 4, {0: 65536, 1: 65536, 2: 65536, 3: 131072}, rows, 8)
    loads = drawn_loads(*t)
    pred = np.full((len(rows), 3), -1, np.int32)
    pred[22, 2] = rows[22][4] * 3 + 1
    pred[23, 1], pred[23, 2] = rows[23][4] * 3 + 1, rows[23][4] * 3 + 2
    prof = Profile(lanes=1, lane_mib_s=0.5, read_latency_ms=0.05, compute_ms_per_layer=0.0, overlap=False,
                   expert_share=0.0, token_overhead_ms=0.0, serial_ms_per_mib=0.0)
    res = replay(loads, "lfru", 8 / 16, slots=True, pred=pred, ahead=2, fill=True, fills=True)
    got = time_replay(loads, res, prof, pred, 0)
    want = naive_timeline(_naive_loads(loads, res, pred), [int(x) for x in loads.layer_expert_bytes],
                          [float(x) for x in kernel_params(prof)], 0, prof.lanes, prof.overlap)
    assert got.tok.tolist() == want["tok"]
    assert got.tok[5, 3] == want["tok"][5][3] and got.tok[5, 5] > 0  # the token with the fills, timed


# -- the done-when cases: prefetch wins, loses, or gains less with late guesses, on numbers ----------

MiB = 1 << 20
LATE_PLUGIN = '''"""prev-token's guesses, readable only once the layer before has routed (a test plugin)."""
from replay.predictors.prev_token import predict  # noqa: F401

NAME = "prev-token-late"
DESCRIPTION = "prev-token, issued when the layer before routes"
ISSUE = "layer"
'''


def _synthetic(tmp_path, alternate: bool, tokens: int = 40):
    """4 MoE layers x 16 experts of 1 MiB, top-2, one prefill token then ``tokens`` decoded; every
    token routes experts 2l, 2l+1 at layer l (``alternate``: the second one is 2l+1 or 2l+8 by the
    token's parity, so prev-token's second guess is always wrong). At 4 MiB (half a token's 8 MiB)
    LRU misses every routing; prev-token's fills turn layers 1-3 into hits."""
    from tests.trace_strategies import write_trace
    from traces import open_trace

    rows = []
    for b in range(tokens + 1):
        for layer in range(4):
            second = 2 * layer + (8 if alternate and b % 2 else 1)
            rows.append({"turn": 0, "batch": b, "phase": 0 if b == 0 else 1, "step": b, "layer": layer,
                         "experts": [2 * layer, second], "weights": [0.6, 0.4], "residency": [0, 0],
                         "read_bytes": [MiB, MiB]})
    spec = {"n_layer": 4, "n_expert": 16, "k": 2, "sizes": [MiB] * 4, "rows": rows}
    return open_trace(write_trace(spec, tmp_path))


def _prefetch(tr, profile, predictor="prev-token", **kw):
    from replay.api import prefetch

    return prefetch(tr, predictor=predictor, budget_mib=4, time_model="profile", device_profile=profile, **kw).row(0, named=True)


def test_idle_lanes_and_a_good_predictor_win_on_time(tmp_path):
    # reads of 1 ms on 8 lanes, 5 ms of compute per layer before the router: the lanes idle during compute
    prof = Profile(lanes=8, lane_mib_s=1000.0, read_latency_ms=0.0, compute_ms_per_layer=5.0)
    r = _prefetch(_synthetic(tmp_path, alternate=False), prof)
    assert r["ms_per_token_baseline"] == 24.0  # 4 layers x (5 ms compute + 1 ms stall for its two misses)
    assert r["ms_per_token"] < 22.0  # layers 1-3 find their guesses arrived (the first token's layer 0 also waits)
    assert r["delta_ms_ci_high"] < 0 and r["vs_baseline_time"] == "better"
    # every guess used: 3 layers x 2 experts x 39 tokens (the first decoded token has no decoded token before it)
    assert r["wasted_mib"] == 0 and r["late_mib"] == 0 and r["useful_mib"] == 6 * 39
    assert r["useful_lead_ms_mean"] > 0 and r["lane_busy_pct_baseline"] < 50
    assert r["verdict"].startswith("prefetch wins on time") and "idle during compute" in r["verdict"]
    assert r["best_plain_ms_per_token"] > 0 and r["best_plain_tok_s"] > 0  # the best plain policy, timed alike


def test_saturated_lanes_make_prefetch_lose(tmp_path):
    # one lane reading 100 MiB/s (10 ms an expert) against 1 ms of compute: reads bind; half the guesses are wrong
    prof = Profile(lanes=1, lane_mib_s=100.0, read_latency_ms=0.0, compute_ms_per_layer=1.0)
    r = _prefetch(_synthetic(tmp_path, alternate=True), prof)
    assert r["wasted_mib"] > 0 and r["useful_mib"] > 0
    assert r["lane_busy_pct"] >= 80.0
    assert r["ms_per_token"] > r["ms_per_token_baseline"]
    assert r["delta_ms_ci_low"] > 0 and r["vs_baseline_time"] == "worse"
    assert r["verdict"].startswith("prefetch loses on time") and "(saturated)" in r["verdict"]


def test_late_guesses_show_late_bytes_and_a_smaller_gain(tmp_path):
    # reads of 4 ms on 8 lanes, 1 ms of compute per layer: a guess read when the layer before routes
    # arrives 3 ms after its own layer's router asked for it at layer 2 of each token
    prof = Profile(lanes=8, lane_mib_s=250.0, read_latency_ms=0.0, compute_ms_per_layer=1.0)
    tr = _synthetic(tmp_path, alternate=False)
    plugin = tmp_path / "late.py"
    plugin.write_text(LATE_PLUGIN)
    early = _prefetch(tr, prof)
    late = _prefetch(tr, prof, predictor="prev-token-late", predictor_file=plugin)
    assert early["late_mib"] == 0 and late["late_mib"] > 0
    assert late["useful_mib"] == early["useful_mib"]  # the same guesses, read later
    assert early["delta_ms_per_token"] < late["delta_ms_per_token"] < 0  # still a gain, a smaller one
    assert late["vs_baseline_time"] == "better"
    assert late["stall_ms_per_token"] > early["stall_ms_per_token"]
    assert "late" in late["verdict"] and late["useful_lead_ms_mean"] < early["useful_lead_ms_mean"]


# -- profiles, the CLI, and the real traces ----------------------------------------------------------

def test_device_profile_files_and_presets_are_checked(tmp_path):
    import json

    from replay.analyses.timeline_fit import PRESETS, load_profile
    from tests.helpers import assert_one_sentence_error, run_cli

    p = load_profile("phone-ufs4")
    assert p.name == "preset:phone-ufs4" and p.source == "preset" and p.lanes == PRESETS["phone-ufs4"]["lanes"]
    good = {"lanes": 2, "lane_mib_s": 500, "read_latency_ms": 0.1, "compute_ms_per_layer": 1.5}
    f = tmp_path / "dev.json"
    f.write_text(json.dumps(good))
    before = f.read_bytes()
    q = load_profile(f)
    assert (q.lanes, q.lane_mib_s, q.overlap, q.expert_share, q.source) == (2, 500.0, True, 0.0, "file")
    assert f.read_bytes() == before
    tr = _synthetic(tmp_path / "t", alternate=False).path
    for bad, needle in (({**good, "lanes": 0}, "lanes 0"), ({**good, "lanes": 1.5}, "lanes 1.5"),
                        ({**good, "lane_mib_s": -1}, "lane_mib_s -1"), ({**good, "overlap": "yes"}, "overlap 'yes'"),
                        ({**good, "expert_share": 2}, "expert_share 2"), ({**good, "lanse": 2}, "unknown device-profile key"),
                        ({"lanes": 2}, "has no lane_mib_s"), ([1, 2], "a JSON object")):
        f.write_text(json.dumps(bad))
        res = run_cli("prefetch", tr, "--budget-mib", "4", "--time-model", "profile", "--device-profile", f)
        assert_one_sentence_error(res, str(f), needle)
        assert res.code == 2
    res = run_cli("prefetch", tr, "--budget-mib", "4", "--device-profile", "phone-ufs4")
    assert_one_sentence_error(res, "--device-profile is read only with --time-model profile")
    res = run_cli("prefetch", tr, "--budget-mib", "4", "--time-model", "profile", "--device-profile", tmp_path / "nope.json")
    assert_one_sentence_error(res, "no such file, and not a preset")
    res = run_cli("prefetch", tr, "--budget-mib", "4", "--time-model", "fitted")
    assert_one_sentence_error(res, "no recorded per-token metrics")


def test_prefetch_time_model_profile_prints_the_timeline(tmp_path):
    from tests.helpers import run_cli

    tr = _synthetic(tmp_path, alternate=False).path
    res = run_cli("prefetch", tr, "--budget-mib", "4", "--time-model", "profile", "--device-profile", "gpu-pcie4")
    assert res.code == 0, res.err
    assert "time per decoded token on the timeline (profile preset:gpu-pcie4" in res.out
    assert "speculative bytes: useful 234.0 MiB (late 0.0 MiB), wasted 0.0 MiB" in res.out
    assert "is a preset: an assumption about a class of device, not a measurement" in res.out


def test_timeline_fit_on_the_real_traces(real_trace_dir):
    """The fitted timeline reproduces each phone run's held-out tok/s within its held-out error
    (qwen, gemma; gpt-oss too, whose interval is wide), and its io_ms tracks the recorded one."""
    from replay.api import timeline_fit

    for name in ("qwen", "gemma", "gptoss"):
        r = timeline_fit(real_trace_dir(name))
        assert r["timeline_reproduces_tok_s"], name
        assert r["timeline_io_ms"]["corr"] > 0.99 and r["timeline_io_ms"]["mape_pct"] < 10, name
        assert r["tokens_heldout"] == r["tokens_fit"]
        assert r["better"] in ("timeline", "linear", "tie")


def test_cache_time_model_profile_times_every_cell(tmp_path):
    from replay.api import cache
    from replay.core.simulate import loads_of, replay

    tr = _synthetic(tmp_path, alternate=True)
    prof = Profile(lanes=2, lane_mib_s=400.0, read_latency_ms=0.05, compute_ms_per_layer=1.0, expert_share=0.5)
    f = cache(tr, policies=["lru", "lfu", "belady"], budgets_mib=[4, 8], time_model="profile", device_profile=prof)
    rows = [r for r in f.to_dicts() if r["layer"] is None]
    assert all(r["ms_per_token"] is not None and r["time_model"] == "profile" for r in rows)
    loads = loads_of(tr)
    want = time_replay(loads, replay(loads, "lru", 4.0, slots=True), prof).summary()["ms_per_token"]
    lru4 = next(r for r in rows if r["policy"] == "lru" and r["budget_mib"] == 4)
    assert lru4["ms_per_token"] == want and lru4["delta_ms_vs_lru"] is None
    lru8 = next(r for r in rows if r["policy"] == "lru" and r["budget_mib"] == 8)
    bel8 = next(r for r in rows if r["policy"] == "belady" and r["budget_mib"] == 8)
    assert bel8["hit_pct_decode"] > lru8["hit_pct_decode"]
    assert bel8["ms_per_token"] < lru8["ms_per_token"] and bel8["vs_lru_time"] == "better"


def test_sweep_grid_has_a_device_profile_axis(tmp_path):
    import json

    from replay.analyses.sweeps import cells_of, compute_cell, grid_inputs, read_grid

    tr = _synthetic(tmp_path / "t", alternate=False)
    f = tmp_path / "dev.json"
    f.write_text(json.dumps({"lanes": 1, "lane_mib_s": 100, "read_latency_ms": 0, "compute_ms_per_layer": 1}))
    g = tmp_path / "grid.toml"
    g.write_text(f'traces = ["{tr.path}"]\n[prefetch]\npredictors = ["prev-token"]\nbudgets_mib = [4]\n'
                 f'time_model = "profile"\ndevice_profiles = ["gpu-pcie4", "dev.json"]\n')
    grid = read_grid(g)
    cells = cells_of(grid)
    assert [c.params["device_profile"] for c in cells] == ["gpu-pcie4", str(f.resolve())]
    assert str(f.resolve()) in grid_inputs(grid) and "gpu-pcie4" not in grid_inputs(grid)
    rows = [compute_cell("prefetch", c.path, c.params)[0].row(0, named=True) for c in cells]
    assert rows[0]["time_profile"] == "preset:gpu-pcie4" and rows[1]["time_profile"] == "dev.json"
    assert rows[1]["ms_per_token_baseline"] > rows[0]["ms_per_token_baseline"]  # one slow lane against PCIe
    before = cells[1].key
    f.write_text(json.dumps({"lanes": 2, "lane_mib_s": 100, "read_latency_ms": 0, "compute_ms_per_layer": 1}))
    assert cells_of(read_grid(g))[1].key != before  # the profile's bytes are in the cell key
    g.write_text(f'traces = ["{tr.path}"]\n[prefetch]\ntime_models = ["quick"]\n')
    import pytest

    from traces.format.errors import UserError

    with pytest.raises(UserError, match="'quick' is not one of linear, fitted, profile"):
        read_grid(g)


def test_report_verdict_says_why_prefetch_won_lost_or_was_late(tmp_path):
    """report --time-model profile: the verdict's prefetch line and the prefetch section say, on the
    timeline's numbers, that prefetch wins with idle lanes, loses on a saturated lane, and that guesses
    read one layer ahead arrive late."""
    import json

    from replay.api import write_report

    idle = Profile(lanes=8, lane_mib_s=1000.0, read_latency_ms=0.0, compute_ms_per_layer=5.0)
    saturated = Profile(lanes=1, lane_mib_s=100.0, read_latency_ms=0.0, compute_ms_per_layer=1.0)
    late_prof = Profile(lanes=8, lane_mib_s=250.0, read_latency_ms=0.0, compute_ms_per_layer=1.0)
    plugin = tmp_path / "late.py"
    # its own name: a plugin name is registered once per process (test_late_guesses... took prev-token-late)
    plugin.write_text(LATE_PLUGIN.replace('"prev-token-late"', '"prev-token-late-report"') + "REPORT_PREFETCH = True\n")
    out = {}
    for name, alt, prof in (("idle", False, idle), ("saturated", True, saturated), ("late", False, late_prof)):
        tr = _synthetic(tmp_path / name, alternate=alt)
        d = write_report(tr.path, tmp_path / f"r-{name}", budget_mib=4, policies=["lru"], time_model="profile",
                         device_profile=prof, predictor_file=plugin if name == "late" else None)
        rows = json.loads((d / "verdict.json").read_text())["rows"]
        out[name] = (next(r for r in rows if r["kind"] == "prefetch"), (d / "index.md").read_text())
    r, md = out["idle"]
    assert r["vs_baseline_time"] == "better" and r["delta_ms_ci_high"] < 0 and r["time_model"] == "profile"
    assert "prefetching wins on time beyond noise" in md and "on the timeline, because the read lanes were busy" in md
    assert "(idle during compute)" in md and "timeline.png" in md
    r, md = out["saturated"]
    # the verdict shows the configuration that helps most: on a saturated lane none wins (the best ties)
    line = next(x for x in md.splitlines() if x.startswith("- Prefetch with"))
    assert r["vs_baseline_time"] in ("worse", "tie") and r["lane_busy_pct"] >= 80
    assert "wins" not in line and "(saturated)" in line and "% wasted" in line
    assert "prev-token (lru): prefetch loses on time on the timeline: +28.3 ms/token" in md
    r, md = out["late"]
    assert "prev-token-late-report (lru): prefetch wins on time on the timeline" in md
    assert "(33.3% of those late)" in md  # the guesses for each token's layer 2 of 1-3
