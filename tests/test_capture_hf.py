"""capture-hf: tiny random transformers MoE models of every family capture-hf knows, captured with the
self-checks passing, ctrl 100.0% and stale-gate figures from predict, sizes from the parameters,
refusals in one sentence, and routing overrides applied inside the forward pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install 'moe-replay[hf]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'moe-replay[hf]')")

import torch  # noqa: E402

import replay  # noqa: E402
from engine_bridge import hf  # noqa: E402
from engine_bridge.hf import DropRule, capture_hf  # noqa: E402
from engine_bridge.hf_tiny import TINY_FAMILIES, TinyHfConfig, build_tiny_model, write_tiny_hf_model  # noqa: E402
from traces import open_trace  # noqa: E402
from traces.format.errors import UserError  # noqa: E402
from traces.format.gating import select  # noqa: E402
from traces.io.reader import fixed_list_to_numpy  # noqa: E402

pytestmark = pytest.mark.hf
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
PROMPT = "hello world, the router picks the top experts"
N = 8


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """{family: checkpoint directory}, built once per session on first use."""
    base = tmp_path_factory.mktemp("hf")
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = write_tiny_hf_model(base / family, TinyHfConfig(family=family, seed=1))
        return made[family]
    return get


@pytest.fixture(scope="session")
def hf_traces(hf_models, tmp_path_factory):
    base = tmp_path_factory.mktemp("hft")
    done: dict[str, tuple[Path, object]] = {}

    def get(family: str):
        if family not in done:
            out = base / family
            res = capture_hf(hf_models(family), PROMPT, n_predict=N, out=out, ignore_eos=True, keep_output_logits=True)
            done[family] = (out, res)
        return done[family]
    return get


def _rows(trace_dir: Path, cols: list[str]) -> dict[str, np.ndarray]:
    t = open_trace(trace_dir)
    tables = list(t.iter_tables(cols))
    out = {}
    for c in cols:
        parts = [tb.column(c) for tb in tables]
        out[c] = np.concatenate([fixed_list_to_numpy(p) if pa.types.is_fixed_size_list(p.type) else p.to_numpy()
                                 for p in parts])
    return out


EXPECTED_GATING = {
    "qwen3_moe": ("softmax", True, False, 1),
    "qwen2_moe": ("softmax", False, False, 1),
    "mixtral": ("softmax", True, False, 1),
    "olmoe": ("softmax", False, False, 1),
    "deepseek_v3": ("sigmoid", True, True, 4),
    "glm4_moe": ("sigmoid", True, True, 1),
    "gpt_oss": ("softmax_weight", False, False, 1),
    "flex_olmo": ("softmax", False, False, 1),
    "dots1": ("sigmoid", True, True, 2),
    "glm4_moe_lite": ("sigmoid", True, True, 1),
    "minimax": ("softmax", True, False, 1),
    "minimax_m2": ("sigmoid", True, True, 1),
    "hunyuan_v1_moe": ("softmax", True, False, 1),
    "lfm2_moe": ("sigmoid", True, True, 1),
    "ernie4_5_moe": ("softmax", True, True, 1),
    "deepseek_v2": ("softmax", False, False, 1),
}


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_family_captures_with_self_checks_and_ctrl_100(hf_traces, family):
    out, res = hf_traces(family)
    assert res.checks["passed"], res.checks
    a, b = res.checks["topk_of_logits"], res.checks["fresh_gate"]
    assert a["agree"] == a["rows"] == b["agree"] == b["rows"] > 0
    assert a["weights_within_tol"] and b["logits_within_tol"]
    t = open_trace(out)
    assert t.meta["complete"] and t.meta["checks"]["passed"]
    g = t.gating
    assert (g["activation"], g["norm_topk"], g["selection_bias"], g["n_group"]) == EXPECTED_GATING[family]
    assert res.decode_tokens == N and len(res.generated[0]) == N
    # predict: ctrl reproduces every decode routing, stale-gate[1] is a figure below or at 100
    df = replay.predict(out, predictors=["ctrl", "stale-gate"], horizons=[1])
    overall = {r["predictor"]: r for r in df.filter(df["layer"].is_null()).iter_rows(named=True)}
    assert overall["ctrl"]["slot_acc_pct"] == 100.0 and overall["ctrl"]["whole_acc_pct"] == 100.0
    assert overall["ctrl"]["scored"] == N * len(t.moe_layers)
    sg = overall["stale-gate[1]"]["slot_acc_pct"]
    assert sg is not None and 0.0 <= sg <= 100.0 and overall["stale-gate[1]"]["scored"] > 0


def test_token_column_holds_the_prompt_and_the_generated_ids(hf_models, hf_traces):
    out, res = hf_traces("mixtral")
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(hf_models("mixtral"))(PROMPT)["input_ids"]
    t = open_trace(out)
    assert t.has("token") and not t.has("request")
    r = _rows(out, ["layer", "step", "phase", "token"])
    first = r["layer"] == t.moe_layers[0]
    assert r["token"][first].tolist() == prompt_ids + res.generated[0]
    assert r["step"][first].tolist() == list(range(len(prompt_ids) + N))


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "gpt_oss", "qwen2_moe", "minimax_m2", "ernie4_5_moe", "lfm2_moe",
                                    "dots1"])
def test_the_rule_the_trace_states_is_needed(hf_traces, family):
    """The captured routings are the stated rule's and not a simpler one's: without the selection
    bias / groups (sigmoid families), the logit bias (gpt-oss) or the rule's normalisation
    (Qwen2-MoE does not renormalise its top-k), some routing or weight comes out different."""
    out, _ = hf_traces(family)
    t = open_trace(out)
    routers = t.router_matrices()
    r = _rows(out, ["layer", "experts", "weights", "logits", "gate_input"])
    g = dict(t.gating)
    diff = 0
    for l in t.moe_layers:
        idx = r["layer"] == l
        logits = r["logits"][idx]
        if family == "gpt_oss":
            w, _ = routers[l]
            logits = r["gate_input"][idx].astype(np.float64) @ w.astype(np.float64).T  # without the logit bias
            ids, _ = select(logits, g, t.top_k)
            diff += int((ids != r["experts"][idx]).any(axis=1).sum())
        elif family == "qwen2_moe":
            _, wts = select(logits, {**g, "norm_topk": True}, t.top_k)
            diff += int((np.abs(wts - r["weights"][idx]) > 1e-3).any(axis=1).sum())
        else:
            ids, _ = select(logits, {**g, "selection_bias": False, "n_group": 1}, t.top_k, routers[l][1])
            diff += int((np.sort(ids, axis=1) != np.sort(r["experts"][idx], axis=1)).any(axis=1).sum())
    assert diff > 0


def test_a_wrong_rule_fails_the_self_check(hf_models, tmp_path, monkeypatch):
    """If capture-hf misread a family's rule (Mixtral without its top-k normalisation), the
    self-check catches it: the weights disagree and the capture is not passed."""
    monkeypatch.setitem(hf.FAMILIES, "mixtral", hf.Family("gate", "MixtralTopKRouter", "softmax", always_norm=False))
    res = capture_hf(hf_models("mixtral"), PROMPT, n_predict=2, out=tmp_path / "t", ignore_eos=True)
    assert not res.checks["passed"]
    assert not res.checks["topk_of_logits"]["weights_within_tol"]


def test_bf16_capture_checks_with_dtype_tolerances(hf_models, tmp_path):
    """bfloat16 weights: logits and weights are bf16-rounded, so the checks use bf16 tolerances,
    emulate the output rounding, and accept exact ties broken the other way; a float32 run's
    tolerances would fail it."""
    res = capture_hf(hf_models("qwen3_moe"), PROMPT, n_predict=N, out=tmp_path / "t", dtype="bfloat16", ignore_eos=True)
    assert res.checks["passed"], res.checks
    a = res.checks["topk_of_logits"]
    assert a["weights_tol"] == 4e-3 and a["weights_max_abs_err"] > 1e-5  # float32's tolerance would fail
    assert open_trace(res.out).meta["router_input_rounding"] == "bf16"


def test_exact_ties_are_told_from_wrong_ids():
    from engine_bridge.checks import _tied

    g = {"activation": "softmax", "norm_topk": True}
    logits = np.array([[2.0, 1.0, 1.0, 0.0], [2.0, 1.0, 1.0, 0.0]])
    rule = np.array([[0, 1], [0, 1]])
    assert _tied(logits, np.array([[0, 2], [0, 2]]), rule, g, None) == 2  # 1 and 2 tie: either is the rule's
    assert _tied(logits, np.array([[0, 3], [1, 2]]), rule, g, None) == 0  # 3 is below the k-th; 0 is left out


def test_a_rule_the_gating_cannot_state_is_refused(tmp_path):
    """DeepSeek-V2's group-limited greedy ranks groups by their best expert: not expressible in the
    trace's gating, so the capture refuses before writing anything."""
    model, tok = build_tiny_model(TinyHfConfig(family="deepseek_v2", seed=1))
    for layer in model.model.layers[1:]:
        layer.mlp.gate.topk_method = "group_limited_greedy"
    with pytest.raises(UserError, match="topk_method 'group_limited_greedy'"):
        capture_hf(model, "hi", tokenizer=tok, n_predict=1, out=tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_ids_in_rank_order_for_unsorted_topk(hf_traces):
    """DeepSeek-V3 selects with topk(sorted=False); the trace lists experts by descending score."""
    out, _ = hf_traces("deepseek_v3")
    t = open_trace(out)
    r = _rows(out, ["layer", "experts", "logits"])
    from traces.format.gating import selection_scores
    for l in t.moe_layers:
        idx = r["layer"] == l
        sel = selection_scores(r["logits"][idx], t.gating, t.router_matrices()[l][1])
        s = np.take_along_axis(sel, r["experts"][idx].astype(np.int64), axis=1)
        assert (np.diff(s, axis=1) <= 0).all()


def test_expert_and_dense_sizes_from_parameters(hf_models, hf_traces, tmp_path):
    out, _ = hf_traces("qwen3_moe")
    m = open_trace(out).meta
    h, ff = 64, 32
    assert m["expert_bytes"] == [3 * h * ff * 4] * 3  # gate, up, down; float32
    assert all(d > 0 for d in m["dense_bytes"]) and m["nonlayer_bytes"] > 0
    # shared experts are dense bytes: Qwen2-MoE's layer 0 is dense (mlp_only_layers), 1.. MoE
    q2, _ = hf_traces("qwen2_moe")
    m2 = open_trace(q2).meta
    assert m2["expert_bytes"][0] is None and m2["model"]["moe_layers"] == [1, 2]
    model, _ = build_tiny_model(TinyHfConfig(family="qwen2_moe", seed=1))
    blk = model.model.layers[1]
    want = sum(p.numel() * 4 for p in blk.parameters()) - sum(p.numel() * 4 for p in blk.mlp.experts.parameters())
    assert m2["dense_bytes"][1] == want
    assert m2["dense_bytes"][1] > m2["dense_bytes"][0] - sum(p.numel() * 4 for p in model.model.layers[0].mlp.parameters())
    # --expert-dtype: what an offloading engine would store
    r = capture_hf(hf_models("qwen3_moe"), "hi", n_predict=1, out=tmp_path / "q8", expert_dtype="q8_0")
    assert open_trace(r.out).meta["expert_bytes"][0] == 3 * h * ff // 32 * 34
    with pytest.raises(UserError, match="--expert-dtype q4_k .* multiple of 256"):
        capture_hf(hf_models("qwen3_moe"), "hi", n_predict=1, out=tmp_path / "q4", expert_dtype="q4_k")
    assert not (tmp_path / "q4").exists()


def test_gpt_oss_router_bias_goes_to_router_parquet(hf_traces):
    out, _ = hf_traces("gpt_oss")
    t = open_trace(out)
    assert t.meta["router_logit_bias"] and t.has_router_logit_bias
    # expert size counts the biases (gate_up_proj_bias, down_proj_bias)
    h, ff = 64, 32
    assert t.meta["expert_bytes"][0] == (h * 2 * ff + ff * h + 2 * ff + h) * 4


def test_same_input_same_bytes(hf_models, tmp_path):
    a = capture_hf(hf_models("olmoe"), PROMPT, n_predict=4, out=tmp_path / "a", ignore_eos=True).out
    b = capture_hf(hf_models("olmoe"), PROMPT, n_predict=4, out=tmp_path / "b", ignore_eos=True).out
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for f in files:
        if f.name == "trace.json":
            ta, tb = (x.read_text().replace(str(x.parent), "OUT") for x in (a / f, b / f))
            assert ta == tb
        else:
            assert (a / f).read_bytes() == (b / f).read_bytes(), f


# -- interventions ------------------------------------------------------------------------------
def test_noop_override_gives_bit_identical_logits(hf_models, hf_traces, tmp_path):
    _, base = hf_traces("qwen3_moe")
    calls = []

    def noop(layer, positions, ids, weights):
        calls.append((layer, positions.copy()))
        return weights.clone()
    res = capture_hf(hf_models("qwen3_moe"), PROMPT, n_predict=N, out=tmp_path / "t", ignore_eos=True,
                     keep_output_logits=True, override=noop)
    assert res.generated == base.generated
    assert np.array_equal(res.output_logits[0], base.output_logits[0])  # bit-identical
    assert res.checks["passed"]
    assert not fixed_list_to_numpy(next(open_trace(res.out).iter_tables(["dropped"])).column("dropped")).any()
    assert {c[0] for c in calls} == {0, 1, 2} and calls[-1][1].tolist() == [res.prompt_tokens + N - 1]


def test_drop_override_changes_the_output_and_is_recorded(hf_models, hf_traces, tmp_path):
    _, base = hf_traces("qwen3_moe")
    rule = DropRule(keep_top=1)
    forced = [base.generated[0]]  # the same sequence, so the logits compare position by position
    res = capture_hf(hf_models("qwen3_moe"), PROMPT, n_predict=N, out=tmp_path / "t", override=rule,
                     forced_tokens=forced, keep_output_logits=True)
    assert res.checks["passed"]  # the router's own routing is still what the rule gives
    assert res.generated == base.generated
    assert not np.allclose(res.output_logits[0], base.output_logits[0])
    t = open_trace(res.out)
    assert t.meta["intervention"] == "drop rank>=1, renormalised as the model does"
    r = _rows(res.out, ["layer", "experts", "weights", "dropped"])
    assert (r["dropped"][:, 1:]).all() and not r["dropped"][:, 0].any()  # rank 0 kept, rank 1 dropped
    # the routing recorded is the router's: layer 0 sees the same input as without the override (same
    # tokens), so its routing is identical; later layers see the overridden residual stream
    b = _rows(base.out, ["layer", "experts", "weights"])
    l0 = r["layer"] == 0
    assert np.array_equal(r["experts"][l0], b["experts"][l0]) and np.array_equal(r["weights"][l0], b["weights"][l0])
    assert not np.array_equal(r["weights"][~l0], b["weights"][~l0])


def test_interrupt_leaves_a_valid_incomplete_trace(hf_models, tmp_path):
    """SIGTERM (or Ctrl-C) during the decode: the forward under way finishes, every routing so far is
    written, trace.json says complete: false, the self-checks pass on what is there."""
    import signal

    decoded = []

    def kill_at_decode_4(layer, positions, ids, weights):
        if layer == 0 and len(positions) == 1:
            decoded.append(int(positions[0]))
            if len(decoded) == 4:
                os.kill(os.getpid(), signal.SIGTERM)
        return None
    res = capture_hf(hf_models("qwen3_moe"), PROMPT, n_predict=40, out=tmp_path / "t", ignore_eos=True,
                     override=kill_at_decode_4)
    assert not res.complete and res.stop_reason == "interrupted by SIGTERM"
    assert res.decode_tokens == 4 == len(decoded)
    t = open_trace(res.out)
    assert t.meta["complete"] is False and res.checks["passed"]
    steps = _rows(res.out, ["step"])["step"]
    assert steps.max() == decoded[-1] and len(steps) == (decoded[-1] + 1) * len(t.moe_layers)


def test_drop_rule_renormalises_as_the_model_does():
    w = torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.45, 0.05]])
    ids = torch.tensor([[3, 1, 2], [0, 2, 1]])
    ov = hf.drop_override(DropRule(min_weight=0.2), {"norm_topk": True, "activation": "softmax"})
    new = ov(0, np.arange(2), ids, w)
    assert torch.allclose(new, torch.tensor([[2 / 3, 1 / 3, 0.0], [0.5 / 0.95, 0.45 / 0.95, 0.0]]))
    ov = hf.drop_override(DropRule(min_weight=0.2), {"norm_topk": False, "activation": "softmax"})
    assert torch.equal(ov(0, np.arange(2), ids, w), torch.tensor([[0.6, 0.3, 0.0], [0.5, 0.45, 0.0]]))
    ov = hf.drop_override(DropRule(experts=(0,)), {"norm_topk": True})
    assert torch.allclose(ov(0, np.arange(2), ids, w), torch.tensor([[0.6, 0.3, 0.1], [0.0, 0.9, 0.1]]))
    # min_weight never drops a routing's largest weight
    ov = hf.drop_override(DropRule(min_weight=0.9), {"norm_topk": True})
    assert torch.equal(ov(0, np.arange(2), ids, w), torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    ov = hf.drop_override(DropRule(keep_top=1, layers=(2,)), {"norm_topk": True})
    assert ov(1, np.arange(2), ids, w) is None


def test_parse_drop_rule():
    r = hf.parse_drop_rule("weight<0.1; rank>=2; expert=3|5; layers=1|2")
    assert (r.min_weight, r.keep_top, r.experts, r.layers) == (0.1, 2, (3, 5), (1, 2))
    for bad in ("", "rank>=0", "weight<-1", "bogus"):
        with pytest.raises(UserError, match="--drop"):
            hf.parse_drop_rule(bad)


# -- refusals and the CLI -----------------------------------------------------------------------
class Run:
    def __init__(self, code: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = code, stdout, stderr


@pytest.fixture
def cli(capsys):
    """The real CLI in this process (importing torch in a subprocess per call costs seconds)."""
    from replay.cli import main

    def run(*args) -> Run:
        capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = int(e.code or 0)
        out, err = capsys.readouterr()
        return Run(code, out, err)
    return run


def one_sentence(r) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moe-replay: error: "), r.stderr
    return lines[0]


def _save_config_only(path: Path, model_type: str, **kw) -> Path:
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, **kw).save_pretrained(path)
    return path


def test_dense_and_unknown_architectures_refused_in_one_sentence(cli, tmp_path):
    dense = _save_config_only(tmp_path / "dense", "llama", hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    msg = one_sentence(cli("capture-hf", dense, "--prompt", "hi", "--out", tmp_path / "o1"))
    assert "llama" in msg and "no MoE layer" in msg
    unknown = _save_config_only(tmp_path / "unk", "phimoe", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_local_experts=4)
    msg = one_sentence(cli("capture-hf", unknown, "--prompt", "hi", "--out", tmp_path / "o2"))
    assert "phimoe" in msg and "does not know its routing rule" in msg
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_cli_capture_and_bad_input(cli, hf_models, tmp_path):
    m = hf_models("qwen3_moe")
    r = cli("capture-hf", m, "--prompt", "hello", "-n", "3", "--out", tmp_path / "t", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert "self-checks: ids = top-k(logits)" in r.stdout and "(100.0%)" in r.stdout
    assert "Loading weights" not in r.stderr
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello world\n\nthe quick brown fox\n", encoding="utf-8")
    r = cli("capture-hf", m, "--prompts", prompts, "-n", "2", "--out", tmp_path / "t2", "--ignore-eos", "--drop", "rank>=1")
    assert r.returncode == 0, r.stderr
    t = open_trace(tmp_path / "t2")
    req = _rows(tmp_path / "t2", ["request"])["request"]
    assert set(req.tolist()) == {0, 1} and t.has("dropped") and t.has("token")
    for args, needle in [
        (("--prompt", "hi", "--expert-dtype", "q9"), "--expert-dtype 'q9'"),
        (("--prompt", "hi", "--dtype", "float8"), "--dtype 'float8'"),
        (("--prompt", "hi", "--drop", "rank>=x"), "--drop"),
        (("--prompt", "hi", "--device", "cuda:0"), "--device cuda:0") if not torch.cuda.is_available() else
        (("--prompt", "hi", "--device", "tpu"), "--device 'tpu'"),
        (("--prompts", tmp_path / "missing.txt"), "no such prompts file"),
        (("--prompt", "hi", "-n", "-1"), "-n must be"),
        (("--prompt", "hi", "-n", "100000"), "max_position_embeddings"),
        (("--prompt", "hi", "--no-renormalise"), "--no-renormalise"),
    ]:
        out = tmp_path / "bad"
        msg = one_sentence(cli("capture-hf", m, *args, "--out", out))
        assert needle in msg, msg
        assert not out.exists()
    msg = one_sentence(cli("capture-hf", tmp_path / "nope", "--prompt", "hi", "--out", tmp_path / "bad"))
    assert "not a model directory" in msg
    r = cli("capture-hf", m, "--prompt", "hi", "--out", tmp_path / "t")  # exists, not empty
    assert "not empty" in one_sentence(r)


def test_make_hf_model_is_deterministic_and_refuses_a_full_directory(cli, tmp_path):
    for d in ("a", "b"):
        r = cli("make-hf-model", tmp_path / d, "--family", "olmoe", "--layers", "2", "--seed", "5")
        assert r.returncode == 0, r.stderr
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert "model.safetensors" in files and "tokenizer.json" in files
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    assert "not empty" in one_sentence(cli("make-hf-model", tmp_path / "a"))
    assert "--family 'bogus'" in one_sentence(cli("make-hf-model", tmp_path / "c", "--family", "bogus"))


def test_missing_extra_named_in_one_sentence(tmp_path):
    code = "import sys; sys.modules['torch'] = None; from replay.cli import main; main(sys.argv[1:])"
    r = subprocess.run([sys.executable, "-c", code, "capture-hf", str(tmp_path), "--prompt", "hi", "--out", str(tmp_path / "o")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    msg = one_sentence(Run(r.returncode, r.stdout, r.stderr))
    assert "pip install 'moe-replay[hf]'" in msg and "'torch'" in msg


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device on this machine (--device cuda untested)")
def test_cuda_capture_matches_cpu(hf_models, hf_traces, tmp_path):
    _, cpu = hf_traces("qwen3_moe")
    res = capture_hf(hf_models("qwen3_moe"), PROMPT, n_predict=N, out=tmp_path / "t", device="cuda", ignore_eos=True)
    assert res.checks["passed"]
    a = _rows(cpu.out, ["experts"])["experts"]
    b = _rows(res.out, ["experts"])["experts"]
    assert (np.sort(a, axis=1) == np.sort(b, axis=1)).all(axis=1).mean() >= 0.99
