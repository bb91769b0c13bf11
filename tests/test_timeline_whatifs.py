"""Drop-cold and retention timed on the timeline (issue 31, item 4): ``drop --time-model`` and
``cache --retain --time-model``, and the report's verdict lines under ``--time-model``."""

from __future__ import annotations

from replay.analyses.timeline import Profile
from tests.test_timeline import _synthetic

# one lane, 1 MiB = 10 ms on it, 1 ms of compute per layer before the router: reads dominate
SLOW_LANE = Profile(lanes=1, lane_mib_s=100.0, read_latency_ms=0.0, compute_ms_per_layer=1.0)


def test_static_drop_on_the_timeline_saves_the_dropped_reads(tmp_path):
    from replay.api import drop

    tr = _synthetic(tmp_path, alternate=False)
    f = drop(tr, fracs=[0.25, 1.0], time_model="profile", device_profile=SLOW_LANE)
    rows = {r["frac"]: r for r in f.to_dicts() if r["mode"] == "static"}
    # no drop: every layer waits for its two 10 ms reads on the one lane after 1 ms of compute: 4 x 21 ms
    assert rows[1.0]["ms_per_token_baseline"] == 84.0 and rows[1.0]["time_model"] == "profile"
    # F = 1: the second expert (weight 0.4 < 1/2) is dropped, one read per layer: 4 x 11 ms
    assert rows[1.0]["ms_per_token"] == 44.0 and rows[1.0]["ms_saved_per_token"] == 40.0
    assert rows[1.0]["ms_saved_ci_low"] == rows[1.0]["ms_saved_ci_high"] == 40.0
    assert rows[1.0]["vs_baseline_time"] == "better" and rows[1.0]["stall_ms_per_token"] == 40.0
    # F = 0.25 drops nothing (0.4 >= 0.125): no time saved, a tie
    assert rows[0.25]["ms_saved_per_token"] == 0.0 and rows[0.25]["vs_baseline_time"] == "tie"


def test_closed_drop_on_the_timeline_and_the_cli(tmp_path):
    from replay.api import drop
    from tests.helpers import run_cli

    tr = _synthetic(tmp_path, alternate=False)
    f = drop(tr, fracs=[1.0], mode="closed", budget_mib=4, time_model="profile", device_profile=SLOW_LANE)
    r = next(r for r in f.to_dicts() if r["mode"] == "closed")
    # LRU at 4 MiB misses all 8 MiB a token routes (4 x 21 ms); with dropping in the loop the replay reads
    # read_mib_decode (1 MiB reads, one at a time, per layer at most one here): 4 ms of compute + 10 ms a MiB
    assert r["ms_per_token_baseline"] == 84.0 and r["read_mib_decode_baseline"] == 8 * 40
    assert r["ms_per_token"] == 4.0 + 10.0 * r["read_mib_decode"] / 40 == 44.0
    assert r["ms_saved_per_token"] == r["ms_saved_ci_low"] == 40.0 and r["vs_baseline_time"] == "better"
    res = run_cli("drop", tr.path, "--mode", "closed", "--budget-mib", "4", "--fracs", "1", "--time-model", "profile",
                  "--device-profile", "gpu-pcie4")
    assert res.code == 0, res.err
    assert "time per decoded token on the timeline (profile, profile preset:gpu-pcie4" in res.out
    res = run_cli("drop", tr.path, "--phase", "all", "--time-model", "profile", "--device-profile", "gpu-pcie4")
    assert res.code == 2 and "the timeline times decoded tokens" in res.err


def test_report_drop_line_on_the_timeline(tmp_path):
    """report --time-model profile: the verdict's drop-cold line says what each F saves on the timeline,
    with its interval, from the same rows as ``drop --time-model``."""
    import json

    from replay.api import drop, write_report

    tr = _synthetic(tmp_path / "t", alternate=False)
    d = write_report(tr.path, tmp_path / "r", budget_mib=4, policies=["lru"], time_model="profile",
                     device_profile=SLOW_LANE)
    rows = [r for r in json.loads((d / "verdict.json").read_text())["rows"] if r["kind"] == "drop"]
    want = {r["frac"]: r for r in drop(tr, fracs=[r["frac"] for r in rows], time_model="profile",
                                       device_profile=SLOW_LANE).to_dicts() if r["mode"] == "static"}
    assert rows and all(r["mode"] == "static" and r["time_model"] == "profile" for r in rows)
    for r in rows:
        assert r["ms_saved_per_token"] == want[r["frac"]]["ms_saved_per_token"]
        assert r["ms_saved_ci_low"] == want[r["frac"]]["ms_saved_ci_low"]
    one = next(r for r in rows if r["frac"] == 1.0)
    assert one["ms_per_token_baseline"] == 84.0 and one["ms_saved_per_token"] == 40.0
    md = (d / "index.md").read_text()
    line = next(x for x in md.splitlines() if x.startswith("- Drop-cold"))
    assert "the time it saves per decoded token on the timeline of reads on lanes against compute" in line
    assert "saves 40.0 ms/token (95% interval [+40.0, +40.0])" in line


def test_cache_retain_on_the_timeline(tmp_path):
    from replay.api import cache
    from tests.helpers import run_cli

    tr = _synthetic(tmp_path, alternate=False)
    f = cache(tr, policies=["lru"], budgets_mib=[4, 6], retain_predictor="prev-token", time_model="profile",
              device_profile=SLOW_LANE)
    rows = {r["budget_mib"]: r for r in f.to_dicts() if r["layer"] is None}
    # 4 MiB: retention changes no hit (all 8 MiB a token routes miss either way): 4 x 21 ms both, a tie at zero
    r = rows[4.0]
    assert r["ms_per_token"] == r["ms_per_token_no_retain"] == 84.0 and r["retain_vs_no_retain_time"] == "tie"
    assert r["retain_ms_saved_per_token"] == r["retain_ms_ci_low"] == r["retain_ms_ci_high"] == 0.0
    # 6 MiB: retention keeps the next layer's guesses; the decoded tokens read 164 MiB (172 less prefill's 8), each
    # MiB a 10 ms read on the one lane that the layer waits for: 4 ms of compute + 10 x 164 / 40 = 45 ms/token
    r = rows[6.0]
    assert r["hit_pct_decode"] > r["hit_pct_decode_no_retain"] == 0.0 and r["read_mib"] == 172.0
    assert r["ms_per_token"] == 45.0 and r["ms_per_token_no_retain"] == 84.0 and r["stall_ms_per_token"] == 41.0
    assert r["retain_ms_saved_per_token"] == 39.0 and 30.0 < r["retain_ms_ci_low"] < 39.0 < r["retain_ms_ci_high"]
    assert r["retain_vs_no_retain_time"] == "better" and r["time_model"] == "profile"
    res = run_cli("cache", tr.path, "--policies", "lru", "--budget-mib", "4", "--retain", "--time-model", "profile",
                  "--device-profile", "gpu-pcie4")
    assert res.code == 0, res.err
    assert "without retention 2.6 ms: retention tie within noise (±0.0 ms/token)" in res.out


def test_report_retention_line_on_the_timeline(tmp_path):
    """report --time-model profile: the verdict's retention line gives each policy's time with and
    without retention on the timeline, with its interval, from the same rows as ``cache --retain``."""
    import json

    from replay.api import write_report

    tr = _synthetic(tmp_path / "t", alternate=False)
    d = write_report(tr.path, tmp_path / "r", budget_mib=6, policies=["lru"], time_model="profile",
                     device_profile=SLOW_LANE)
    rows = [r for r in json.loads((d / "verdict.json").read_text())["rows"] if r["kind"] == "retention"]
    lru = next(r for r in rows if r["policy"] == "lru")
    assert lru["budget_mib"] == 6 and lru["time_model"] == "profile"
    assert lru["ms_per_token_no_retain"] == 84.0 and lru["ms_per_token"] == 45.0
    assert lru["retain_ms_saved_per_token"] == 39.0 and lru["retain_vs_no_retain_time"] == "better"
    md = (d / "index.md").read_text()
    line = next(x for x in md.splitlines() if x.startswith("- Retention"))
    assert "lru at 6 MiB 0.0% → 48.8%: **helps beyond noise**" in line
    assert "on the timeline 84.0 → 45.0 ms/token: **faster beyond noise**, saves 39.0 ms/token (95% interval [+35.6" in line
