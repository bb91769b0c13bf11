"""quality: drop-cold applied inside the forward pass of a tiny transformers model. F = 0 is
bit-identical to a plain run; a budget at or above the working set never evicts, so it drops only
first touches; the top expert is never dropped; a dropping setting changes the outputs, and the
drops it recorded are exactly those of the offline closed-loop replay of its own trace."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install 'moe-replay[hf]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'moe-replay[hf]')")

from engine_bridge import hf  # noqa: E402
from engine_bridge.hf_tiny import TinyHfConfig, write_tiny_hf_model  # noqa: E402
from engine_bridge.quality import KernelStep, Setting, _DropCold, _router_logit_hooks, quality  # noqa: E402
from replay.core.simulate import budget_bytes, prepare_loads, replay  # noqa: E402
from traces import open_trace  # noqa: E402
from traces.format.errors import UserError  # noqa: E402
from traces.util.units import MIB  # noqa: E402

pytestmark = pytest.mark.hf
os.environ.setdefault("HF_HUB_OFFLINE", "1")
TEXT = "the quick brown fox jumps over the lazy dog and the router picks the top experts by their scores"
BUDGET = 0.05  # MiB: about two of the tiny model's 24 KiB experts, so the cache misses often
FRACS = [0.0, 0.5, 1.0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("qm") / "m", TinyHfConfig(family="qwen3_moe", experts=8, top_k=2, seed=1))


@pytest.fixture(scope="module")
def run(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "out"
    obj = quality(str(model_dir), TEXT, fracs=FRACS, keep_ks=[1], out=out, budget_mib=BUDGET)
    return out, obj


def own_replay_drops(trace_dir: Path, setting: Setting, budget_mib: float, policy: str = "lru") -> np.ndarray:
    """The slots the offline closed-loop replay of this trace drops (replay.analyses.drop_cold.closed_drop's flags)."""
    t = open_trace(trace_dir)
    a = t.arrays(recorded=False)
    w = a.weights.astype(np.float64)
    flags = np.zeros(a.experts.shape, np.uint8)
    if setting.frac is not None:
        top = np.zeros(w.shape, dtype=bool)
        top[np.arange(w.shape[0]), np.argmax(w, axis=1)] = True
        flags[(w < setting.frac / t.top_k) & ~top] = 1
    else:
        flags[:, setting.keep_k:] = 2
    loads = prepare_loads(a, t.moe_layers, t.n_expert, t.expert_bytes)
    return replay(loads, policy, budget_mib, slots=True, drop=flags).slots == 3


def test_f0_is_bit_identical_to_a_plain_run(model_dir, tmp_path):
    model, tok = hf.load_model(str(model_dir))
    plain = hf.capture_hf(model, TEXT, tokenizer=tok, n_predict=0, out=tmp_path / "p", keep_output_logits=True, ubatch=1)
    fam = hf._family_of(model.config, "m")
    blocks = hf.find_blocks(model, fam, "m")
    gating, k = hf.gating_of(blocks, fam)
    layers = [b.layer for b in blocks]
    store: dict[int, np.ndarray] = {}
    handles = _router_logit_hooks(blocks, store)
    cache = KernelStep("lru", np.full(len(layers), 24576, np.int64), 8, budget_bytes(BUDGET))
    ov = _DropCold(Setting(frac=0.0), k, layers, gating, {l: np.zeros(8, np.float32) for l in layers}, store, cache, False)
    try:
        f0 = hf.capture_hf(model, TEXT, tokenizer=tok, n_predict=0, out=tmp_path / "f0", keep_output_logits=True, ubatch=1,
                           override=ov)
    finally:
        for h in handles:
            h.remove()
    assert cache.lookups > 0 and cache.read_bytes > 0  # the cache was stepped
    assert np.array_equal(plain.output_logits[0], f0.output_logits[0])


def test_rows_f0_no_change_and_dropping_changes_outputs(run):
    out, obj = run
    rows = {r["setting"]: r for r in obj["rows"]}
    f0 = rows["drop F=0"]
    assert f0["kl_mean"] == 0.0 and f0["kl_p95"] == 0.0 and f0["ppl_delta_pct"] == 0.0 and f0["top1_agree_pct"] == 100.0
    assert f0["routings_dropped_pct"] == 0.0 and f0["io_saved_pct"] == 0.0
    for name in ("drop F=0.5", "drop F=1", "keep-k 1"):
        r = rows[name]
        assert r["routings_dropped_pct"] > 0 and r["io_saved_pct"] > 0 and r["mass_lost_pct"] > 0
        assert r["kl_mean"] > 0, name
    # F = 1 at top-2 drops every second expert on a miss; keep-k 1 drops it always
    assert rows["keep-k 1"]["routings_dropped_pct"] == 100.0
    saved = json.loads((out / "quality.json").read_text())
    assert saved == obj
    for key in ("setting", "ppl", "ppl_delta_pct", "kl_mean", "kl_p95", "top1_agree_pct", "routings_dropped_pct",
                "io_saved_pct", "mass_lost_pct", "routings_dropped_pct_replay", "io_saved_pct_replay", "mass_lost_pct_replay"):
        assert key in obj["rows"][0]


@pytest.mark.parametrize("setting", [Setting(frac=0.5), Setting(frac=1.0), Setting(keep_k=1)], ids=lambda s: s.dirname)
def test_recorded_drops_equal_the_closed_loop_replay_of_the_runs_own_trace(run, setting):
    out, _ = run
    t = open_trace(out / setting.dirname)
    rec = t.arrays(recorded=True).dropped
    assert rec is not None and rec.any()
    assert np.array_equal(rec, own_replay_drops(out / setting.dirname, setting, BUDGET))


@pytest.mark.parametrize("name", ["drop-F0.5", "drop-F1"])
def test_top_expert_never_dropped(run, name):
    out, _ = run
    a = open_trace(out / name).arrays(recorded=True)
    top = np.argmax(a.weights, axis=1)
    assert a.dropped.any()
    assert not a.dropped[np.arange(top.size), top].any()


def test_replay_prediction_is_the_closed_loop_replay_of_the_plain_trace(run):
    from replay.analyses.drop_cold import closed_drop

    out, obj = run
    pred = closed_drop(open_trace(out / "plain"), [0.5], budget_mib=BUDGET, phase="all", keep_ks=[]).to_dicts()[0]
    row = next(r for r in obj["rows"] if r["setting"] == "drop F=0.5")
    for key in ("routings_dropped_pct", "io_saved_pct", "mass_lost_pct"):
        assert row[f"{key}_replay"] == pred[key]


def test_budget_at_the_working_set_never_evicts(run, model_dir, tmp_path):
    """A cold cache at or above the working set (here: every expert of the model, the working set
    of any run) still misses each entry once (the replay starts empty), so drop-cold can drop a
    first touch; it never drops an entry that was read before, and the run equals the one at a
    budget 100x larger."""
    out, _ = run
    t = open_trace(out / "plain")
    ws = sum(t.expert_bytes[l] for l in t.moe_layers) * t.n_expert / MIB
    a_obj = quality(str(model_dir), TEXT, fracs=[2.0], out=tmp_path / "a", budget_mib=ws)
    b_obj = quality(str(model_dir), TEXT, fracs=[2.0], out=tmp_path / "b", budget_mib=ws * 100)
    for ra, rb in zip(a_obj["rows"], b_obj["rows"]):
        assert ra["overflow_loads"] == 0
        for key in ("ppl", "kl_mean", "routings_dropped_pct", "mass_lost_pct", "io_saved_pct"):
            assert ra[key] == rb[key]
    for name in ("drop-F2",):
        a = open_trace(tmp_path / "a" / name).arrays(recorded=True)
        seen: set[tuple[int, int]] = set()
        for r in range(a.experts.shape[0]):
            for j in range(a.experts.shape[1]):
                key = (int(a.layer[r]), int(a.experts[r, j]))
                if a.dropped[r, j]:
                    assert key not in seen  # a dropped slot is a first touch, never a capacity miss
                else:
                    seen.add(key)


@pytest.mark.parametrize("policy", ["lfu", "lfru", "s3fifo", "sieve", "least-stale", "layer"])
def test_other_policies_drops_equal_the_closed_loop_replay_of_the_runs_own_trace(model_dir, tmp_path, policy):
    """The simulated cache follows the policy's replay semantics: each setting's recorded drops are
    exactly the closed-loop replay's at that policy, and the *_replay figures are closed_drop's."""
    from replay.analyses.drop_cold import closed_drop

    obj = quality(str(model_dir), TEXT[:60], fracs=[1.0], keep_ks=[1], out=tmp_path / "o", budget_mib=BUDGET, policy=policy)
    assert obj["policy"] == policy
    pred = closed_drop(open_trace(tmp_path / "o" / "plain"), [1.0], budget_mib=BUDGET, policy=policy, phase="all",
                       keep_ks=[1]).to_dicts()
    for s, p in zip((Setting(frac=1.0), Setting(keep_k=1)), pred):
        rec = open_trace(tmp_path / "o" / s.dirname).arrays(recorded=True).dropped
        assert rec is not None and rec.any()
        assert np.array_equal(rec, own_replay_drops(tmp_path / "o" / s.dirname, s, BUDGET, policy))
        row = next(r for r in obj["rows"] if r["setting"] == s.label)
        assert row["io_saved_pct_replay"] == p["io_saved_pct"]


PROMPT = "the quick brown fox"  # the tiny model does not end it at once (it does "the router picks")
GEN_N = 10


def check_generation(out: Path, gen: dict, budget_mib: float, policy: str = "lru") -> None:
    """Every generation row is recorded consistently: its token ids are its trace's decode tokens,
    ``diverges_at`` is the first index where they leave the undropped run's (None: identical), and
    its recorded drops are the closed-loop replay's of its own trace."""
    plain = gen["plain"]["token_ids"]
    assert len(plain) > 0
    for r in gen["rows"]:
        toks, d = r["token_ids"], r["diverges_at"]
        assert r["tokens_generated"] == len(toks)
        if d is None:
            assert toks == plain
        else:
            assert toks[:d] == plain[:d] and (d == min(len(toks), len(plain)) or toks[d] != plain[d])
        a = open_trace(out / r["trace"]).arrays(recorded=True)
        first = (a.phase == 1) & (a.layer == a.layer.min())
        assert a.token[first].tolist() == toks
        s = Setting(frac=r["frac"]) if r["frac"] is not None else Setting(keep_k=r["keep_k"])
        drops = own_replay_drops(out / r["trace"], s, budget_mib, policy)
        assert np.array_equal(a.dropped, drops)
        top = np.argmax(a.weights, axis=1)
        assert not a.dropped[np.arange(top.size), top].any()


def test_generation_f0_is_plain_greedy_and_drops_are_recorded_consistently(model_dir, tmp_path):
    import torch

    out = tmp_path / "g"
    obj = quality(str(model_dir), TEXT[:30], fracs=[0.0, 1.0], keep_ks=[1], out=out, budget_mib=BUDGET, prompt=PROMPT,
                  max_new_tokens=GEN_N)
    gen = obj["generation"]
    rows = {r["setting"]: r for r in gen["rows"]}
    assert rows["drop F=0"]["diverges_at"] is None and rows["drop F=0"]["routings_dropped_pct"] == 0.0
    # the undropped generation is transformers' own greedy decoding
    model, tok = hf.load_model(str(model_dir))
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GEN_N, do_sample=False)[0, ids.shape[1]:]
    ref = ref.tolist()
    if tok.eos_token_id in ref:  # capture stops before the end-of-generation token; generate emits it
        ref = ref[:ref.index(tok.eos_token_id)]
    assert gen["plain"]["token_ids"] == ref and rows["drop F=0"]["token_ids"] == ref
    assert gen["plain"]["text"] == tok.decode(ref) and rows["drop F=0"]["text"] == tok.decode(ref)
    assert rows["keep-k 1"]["routings_dropped_pct"] == 100.0 and rows["drop F=1"]["routings_dropped_pct"] > 0
    check_generation(out, gen, BUDGET)
    assert json.loads((out / "quality.json").read_text())["generation"] == gen


def test_refusals(model_dir, tmp_path):
    with pytest.raises(UserError, match="--policy belady: .*next use"):
        quality(str(model_dir), TEXT, fracs=[0.5], out=tmp_path / "x", budget_mib=1, policy="belady")
    with pytest.raises(UserError, match="keep-k 2"):
        quality(str(model_dir), TEXT, fracs=[0.5], keep_ks=[2], out=tmp_path / "x", budget_mib=1)
    with pytest.raises(UserError, match="given twice"):
        quality(str(model_dir), TEXT, fracs=[0.5, 0.5], out=tmp_path / "x", budget_mib=1)
    with pytest.raises(UserError, match="--max-new-tokens 0"):
        quality(str(model_dir), TEXT, fracs=[0.5], out=tmp_path / "x", budget_mib=1, prompt="hi", max_new_tokens=0)
    with pytest.raises(UserError, match="--prompt: the prompt is empty"):
        quality(str(model_dir), TEXT, fracs=[0.5], out=tmp_path / "x", budget_mib=1, prompt=" ")
    assert not (tmp_path / "x").exists()


def test_cli_json_and_bad_input(model_dir, tmp_path):
    from tests.helpers import assert_one_sentence_error, run_cli

    text = tmp_path / "t.txt"
    text.write_text(TEXT[:40], encoding="utf-8")
    base = ["quality", model_dir, "--text", text, "--budget-mib", "0.05"]
    res = run_cli(*base, "--drop-frac", "0,1", "--keep-k", "1", "-o", tmp_path / "o", "--json")
    assert res.code == 0, res.err
    obj = res.json()
    assert obj["command"] == "quality" and [r["setting"] for r in obj["rows"]] == ["drop F=0", "drop F=1", "keep-k 1"]
    assert (tmp_path / "o" / "drop-F1" / "trace.json").is_file()
    res = run_cli(*base, "--drop-frac", "0,-1", "-o", tmp_path / "bad")
    assert res.code == 2
    assert_one_sentence_error(res, "--drop-frac")
    res = run_cli(*base, "--keep-k", "5", "-o", tmp_path / "bad")
    assert res.code == 2
    assert_one_sentence_error(res, "--keep-k 5")
    assert not (tmp_path / "bad").exists()


# -- llama.cpp ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'moe-replay[capture]')")
    from engine_bridge.tinymodel import TinyModelConfig, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("qg") / "q.gguf",
                            TinyModelConfig(arch="qwen3moe", layers=3, experts=16, top_k=4, embd=64, seed=1))


@pytest.fixture(scope="module")
def llama_run(gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("ql") / "out"
    return out, quality(str(gguf), TEXT, fracs=[0.0, 1.0], keep_ks=[2], out=out, budget_mib=0.1, engine="llama.cpp")


def test_llama_f0_is_bit_identical_to_a_plain_run(gguf, tmp_path):
    from engine_bridge.capture import CaptureOptions, capture
    from engine_bridge.quality import _DropColdGgml
    from traces import open_trace as ot

    def go(name, ov):
        logits: list[np.ndarray] = []
        opts = CaptureOptions(model=str(gguf), prompt=TEXT, out=str(tmp_path / name), n_decode=0, ubatch=1, gate_input=False,
                              kv_type="f32", flash_attn="off")
        capture(opts, override=ov, output_logits=logits)
        return np.stack(logits)

    plain = go("p", None)
    t = ot(tmp_path / "p")
    cache = KernelStep("lru", np.array([t.expert_bytes[l] for l in t.moe_layers], np.int64), t.n_expert, budget_bytes(0.1))
    f0 = go("f0", _DropColdGgml(Setting(frac=0.0), list(t.moe_layers), cache, False))
    assert cache.lookups > 0 and np.array_equal(plain, f0)


def test_llama_drops_change_outputs_and_equal_the_replay_of_the_runs_own_trace(llama_run):
    out, obj = llama_run
    rows = {r["setting"]: r for r in obj["rows"]}
    assert rows["drop F=0"]["kl_mean"] == 0.0 and rows["drop F=0"]["ppl_delta_pct"] == 0.0
    for s in (Setting(frac=1.0), Setting(keep_k=2)):
        assert rows[s.label]["kl_mean"] > 0 and rows[s.label]["routings_dropped_pct"] > 0
        a = open_trace(out / s.dirname).arrays(recorded=True)
        assert np.array_equal(a.dropped, own_replay_drops(out / s.dirname, s, 0.1))
        top = np.argmax(a.weights, axis=1)
        assert not a.dropped[np.arange(top.size), top].any()


def test_llama_generation(gguf, tmp_path):
    from engine_bridge.capture import CaptureOptions, capture

    out = tmp_path / "g"
    obj = quality(str(gguf), TEXT[:30], fracs=[0.0, 1.0], keep_ks=[2], out=out, budget_mib=0.1, engine="llama.cpp",
                  prompt=PROMPT, max_new_tokens=GEN_N)
    gen = obj["generation"]
    rows = {r["setting"]: r for r in gen["rows"]}
    f0 = rows["drop F=0"]
    # a plain greedy capture (no eval-callback override) generates the same tokens
    res = capture(CaptureOptions(model=str(gguf), prompt=PROMPT, out=str(tmp_path / "p"), n_decode=GEN_N, ubatch=1,
                                 gate_input=False, kv_type="f32", flash_attn="off"))
    a = open_trace(tmp_path / "p").arrays(recorded=True)
    plain = a.token[(a.phase == 1) & (a.layer == a.layer.min())].tolist()
    assert gen["plain"]["token_ids"] == plain and f0["token_ids"] == plain and f0["diverges_at"] is None
    assert f0["text"] == gen["plain"]["text"] == res.meta["capture_summary"]["generated_text"]
    assert rows["keep-k 2"]["routings_dropped_pct"] == 100.0
    check_generation(out, gen, 0.1)


def test_interrupt_leaves_nothing(model_dir, tmp_path, monkeypatch):
    """SIGINT during a setting's run: the capture stops the run cleanly, quality re-raises the signal,
    exit 130 and no OUT (the staged directory is removed)."""
    import signal

    from engine_bridge import quality as q
    from tests.helpers import run_cli

    step, calls = q.KernelStep.step, []

    def interrupting(self, lidx, ids, flags):
        calls.append(1)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGINT)
        return step(self, lidx, ids, flags)

    monkeypatch.setattr(q.KernelStep, "step", interrupting)
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    res = run_cli("quality", model_dir, "--text", text, "--budget-mib", "0.05", "--drop-frac", "0.5", "-o", tmp_path / "o")
    assert res.code == 130, res.err
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.partial-*"))
