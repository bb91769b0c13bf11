"""``moe-replay capture`` and ``moe-replay make-model``: thin typer verbs over engine_bridge.

Registered through the ``moe_replay.commands`` entry point (replay never imports engine_bridge).
This module imports nothing of the capture extra (llama_cpp, gguf) at import time, so the verbs are
always registered and a missing extra is reported by the verb itself, naming what to install.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import typer

from replay.cli.options import BUDGET_UNITS_HELP
from traces.format.errors import UserError


def register(app: typer.Typer) -> None:
    from replay.cli.options import example

    app.command("capture", epilog=example('moe-replay capture model.gguf --prompt "Hello" -n 32 --out traces/mine'))(capture_cmd)
    app.command("make-model", epilog=example("moe-replay make-model /tmp/tiny.gguf --layers 4 --experts 16"))(make_model_cmd)
    app.command("capture-hf", epilog=example('moe-replay capture-hf /tmp/q3 --prompt "Hello" -n 32 --out traces/mine-hf'))(capture_hf_cmd)
    app.command("make-hf-model", epilog=example("moe-replay make-hf-model /tmp/q3 --family qwen3_moe"))(make_hf_model_cmd)
    app.command("quality", epilog=example("moe-replay quality /tmp/q3 --text wiki.txt --drop-frac 0,0.5,1 --budget-mib 64 "
                                          "-o /tmp/q3-quality"))(quality_cmd)


def capture_cmd(
    model: Path = typer.Argument(..., help="A GGUF Mixture-of-Experts model file.", show_default=False),
    prompt: str | None = typer.Option(None, "--prompt", help="Prompt text."),
    prompt_file: Path | None = typer.Option(None, "--prompt-file", help="Read the prompt from this UTF-8 file."),
    n_decode: int = typer.Option(64, "-n", "--n-decode", help="Tokens to decode after the prompt (each one is a batch); "
                                 "prompt tokens + this must fit the model's training context."),
    out: Path = typer.Option(..., "--out", help="Trace directory to create (must not exist or be empty).", show_default=False),
    no_logits: bool = typer.Option(False, "--no-logits", help="Do not record the router logits column."),
    no_gate_input: bool = typer.Option(False, "--no-gate-input", help="Do not record the router input (gate_input) column."),
    n_expert_used: int | None = typer.Option(None, "--n-expert-used", help="Override the model's top-k (1..n_expert)."),
    ubatch: int = typer.Option(512, "--ubatch", help="Compute batch (ubatch) size in tokens: the prompt is split into batches "
                               "of this many tokens, each one llama_decode call and one batch of the trace (n_batch = n_ubatch)."),
    threads: int | None = typer.Option(None, "--threads", help="CPU threads (default: llama.cpp's)."),
    seed: int = typer.Option(0, "--seed", help="Seed for sampling when --temp > 0."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature; 0 = greedy (default)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep decoding past an end-of-generation token."),
    part_tokens: int = typer.Option(64, "--part-tokens", help="Tokens per routings/ part file (an interrupted run keeps whole parts)."),
    verbose: bool = typer.Option(False, "--verbose", help="Show llama.cpp's own log."),
    kv_type: str = typer.Option("f16", "--kv-type", help="KV cache type: f16 (llama.cpp's default), f32, bf16, q8_0."),
    flash_attn: str = typer.Option("auto", "--flash-attn", help="Flash attention: auto (llama.cpp's default), on, off. "
                                   "--kv-type f32 --flash-attn off computes attention in float32 (to compare with "
                                   "another float32 engine)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
) -> None:
    """Run MODEL on a prompt through llama.cpp and record every MoE layer's routing as a v1 trace.

    The prompt is tokenized first (with the model's vocabulary alone) and checked before llama.cpp
    runs: the context holds exactly the prompt tokens + -n, which must fit the model's training
    context. The prompt is computed in batches of --ubatch tokens, each one batch of the trace."""
    from engine_bridge.engine import require_capture_extra

    require_capture_extra("capture")  # before any file is looked at: name the extra, not a module
    from engine_bridge.capture import CaptureOptions, capture, validate
    from replay.core.progress import progress

    if (prompt is None) == (prompt_file is None):
        raise UserError("give exactly one of --prompt TEXT or --prompt-file FILE.")
    if prompt_file is not None:
        prompt = _read_text(prompt_file, "prompt")
    opts = CaptureOptions(
        model=str(model), prompt=prompt or "", out=str(out), n_decode=n_decode, logits=not no_logits,
        gate_input=not no_gate_input, n_expert_used=n_expert_used, ubatch=ubatch, threads=threads, seed=seed,
        temp=temp, ignore_eos=ignore_eos, tokens_per_part=part_tokens, verbose=verbose,
        prompt_source=str(prompt_file) if prompt_file else None, kv_type=kv_type, flash_attn=flash_attn,
    )
    plan = validate(opts)
    bar = progress(len(plan.tokens) + n_decode, "capture", unit="tok")

    def tick(n: int, phase: str) -> None:
        bar.set_postfix_str(phase, refresh=False)
        bar.update(n)

    try:
        res = capture(opts, plan=plan, progress=tick)
    finally:
        bar.close()
    row = {
        "complete": res.complete, "stop_reason": res.stop_reason, "tokens_prefill": res.prompt_tokens,
        "prefill_batches": res.prefill_batches, "tokens_decode": res.decode_tokens,
        "prefill_tok_s": res.prefill_tok_s, "decode_tok_s": res.decode_tok_s,
        "checks_passed": res.checks["passed"],
    }
    state = "complete" if res.complete else f"INCOMPLETE ({res.stop_reason})"
    _report("capture", out, row, res, json_out, "engine's",
            f"wrote {out} [{state}]: {_model_line(res.meta['model'])}; {res.prompt_tokens} prompt tokens in "
            f"{res.prefill_batches} batches of up to {plan.ubatch} + {res.decode_tokens} decoded tokens")
    if not res.complete and res.stop_reason.startswith("interrupted"):
        sig = signal.SIGTERM if "SIGTERM" in res.stop_reason else signal.SIGINT
        sys.exit(128 + int(sig))


def make_model_cmd(
    out: Path = typer.Argument(..., help="GGUF file to write.", show_default=False),
    arch: str = typer.Option("qwen3moe", "--arch", help="qwen3moe (softmax, top-k renormalized) | minimax-m2 (sigmoid "
                             "+ selection bias) | gpt-oss (router logit bias, softmax over the chosen)."),
    layers: int = typer.Option(4, "--layers", help="Layers (all MoE)."),
    experts: int = typer.Option(16, "--experts", help="Experts per layer."),
    top_k: int = typer.Option(4, "--top-k", help="Experts used per token."),
    embd: int = typer.Option(64, "--embd", help="Embedding width (multiple of 8)."),
    expert_ff: int | None = typer.Option(None, "--expert-ff", help="Expert hidden width (default embd/2)."),
    router_type: str = typer.Option("f32", "--router-type", help="Storage of the router matrices: f32 | f16 | q8_0."),
    weight_type: str = typer.Option("f16", "--weight-type", help="Storage of the other matrices: f32 | f16."),
    context: int = typer.Option(4096, "--context", help="Training context in tokens (<arch>.context_length): "
                                "capture refuses prompt tokens + -n beyond it."),
    seed: int = typer.Option(0, "--seed"),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it exists."),
) -> None:
    """Write a random-weight MoE GGUF that llama.cpp loads (tests, demos, benchmarks)."""
    from engine_bridge.engine import require_capture_extra

    require_capture_extra("make-model", llama=False)  # gguf-py writes the file
    from engine_bridge.tinymodel import TinyModelConfig, write_tiny_model

    cfg = TinyModelConfig(arch=arch, layers=layers, experts=experts, top_k=top_k, embd=embd, expert_ff=expert_ff,
                          router_type=router_type, weight_type=weight_type, seed=seed, context=context)
    write_tiny_model(out, cfg, force=force)
    typer.echo(f"wrote {out}: {arch}, {layers} layers x {experts} experts, top-k {top_k}, embd {embd}, "
               f"expert ff {cfg.ff}, router {router_type}, context {context}, seed {seed} ({out.stat().st_size} bytes)")


def _model_line(m: dict) -> str:
    """The captured model in a summary line: name, arch, MoE layers x experts, top-k."""
    return f"{m['name']} ({m['arch']}), {len(m['moe_layers'])} MoE layers x {m['n_expert']} experts, top-k {m['top_k']}"


def _report(verb: str, out: Path, row: dict, res: Any, json_out: bool, whose: str, text: str) -> None:
    """A capture's result: one JSON object (``--json``), or ``text`` then its speed and self-check
    lines; then exit 1 if a self-check failed (:func:`_exit_if_checks_failed`, ``whose`` routing)."""
    from replay.present.format import json_object

    if json_out:
        typer.echo(json_object(verb, str(out), [row], checks=res.checks))
    else:
        typer.echo(text)
        _echo_speed_and_checks(res)
    _exit_if_checks_failed(res, whose)


def _echo_speed_and_checks(res: Any) -> None:
    """A capture's speed line (capture on) and self-check line, for the text output."""
    from engine_bridge.checks import summary_line

    dec = f"{res.decode_tok_s:.1f} tok/s" if res.decode_tok_s else "-"
    pre = f"{res.prefill_tok_s:.1f} tok/s" if res.prefill_tok_s else "-"
    typer.echo(f"speed with capture on (includes the capture's own cost): prefill {pre}, decode {dec}")
    typer.echo(f"self-checks: {summary_line(res.checks)}")


def _exit_if_checks_failed(res: Any, whose: str) -> None:
    """Exit 1 with one sentence when a capture self-check failed (the trace does not reproduce
    ``whose`` routing: "engine's" or "model's")."""
    if not res.checks["passed"]:
        print(f"moe-replay: error: a capture self-check failed: the trace does not reproduce the {whose} routing "
              "(this is a bug in the capture, please report it)", file=sys.stderr)
        sys.exit(1)


def _read_text(path: Path, what: str) -> str:
    """The UTF-8 text of ``path``, a ``what`` file ("prompt", "prompts"), or one sentence saying why not."""
    if not path.is_file():
        raise UserError(f"{path}: no such {what} file.")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot be read as UTF-8 text ({e.__class__.__name__}).") from None


def _read_prompts(prompt: str | None, prompts_file: Path | None) -> list[str]:
    if (prompt is None) == (prompts_file is None):
        raise UserError("give exactly one of --prompt TEXT or --prompts FILE.")
    if prompts_file is None:
        return [prompt or ""]
    text = _read_text(prompts_file, "prompts")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise UserError(f"{prompts_file}: holds no prompt (one prompt per non-empty line).")
    return lines


def capture_hf_cmd(
    model: Path = typer.Argument(..., help="A local transformers checkpoint directory (config.json, weights, tokenizer).",
                                 show_default=False),
    prompt: str | None = typer.Option(None, "--prompt", help="Prompt text."),
    prompts_file: Path | None = typer.Option(None, "--prompts", help="UTF-8 file, one prompt per non-empty line: each is "
                                             "its own request (request column), run one after the other with a fresh KV cache."),
    n_decode: int = typer.Option(64, "-n", "--n-decode", help="Tokens to decode greedily after each prompt."),
    out: Path = typer.Option(..., "--out", help="Trace directory to create (must not exist or be empty).", show_default=False),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda | cuda:N."),
    dtype: str = typer.Option("float32", "--dtype", help="Load the weights as float32 | bfloat16 | float16 | auto "
                              "(the checkpoint's)."),
    expert_dtype: str | None = typer.Option(None, "--expert-dtype", help="Size experts as an offloading engine would "
                                            "store them: f32 f16 bf16 fp8 q8_0 q6_k q5_k q5_0 q4_k q4_0 iq4_xs q3_k q2_k "
                                            "mxfp4 (matrices; biases as f32). Default: as loaded."),
    no_logits: bool = typer.Option(False, "--no-logits", help="Do not record the router logits column."),
    no_gate_input: bool = typer.Option(False, "--no-gate-input", help="Do not record the router input (gate_input) column."),
    ubatch: int = typer.Option(512, "--ubatch", help="Prompt tokens per forward (each forward is one batch of the trace)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep decoding past an end-of-generation token."),
    part_tokens: int = typer.Option(64, "--part-tokens", help="Tokens per routings/ part file."),
    drop: str | None = typer.Option(None, "--drop", help="Routing override inside the forward pass: zero chosen experts' "
                                    "weights by a rule (weight<W; rank>=R; expert=I|J; layers=L|M), renormalised as the "
                                    "model does; the trace marks them in a dropped column."),
    no_renormalise: bool = typer.Option(False, "--no-renormalise", help="With --drop: leave the surviving weights as they are."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
) -> None:
    """Run MODEL through Hugging Face transformers (greedy, KV cache) and record every MoE layer's
    router input, raw router logits, selected experts and applied weights as a v1 trace."""
    from engine_bridge.hf import require_hf_extra

    require_hf_extra("capture-hf")
    from engine_bridge.hf import capture_hf, parse_drop_rule

    prompts = _read_prompts(prompt, prompts_file)
    rule = parse_drop_rule(drop, renormalise=not no_renormalise) if drop is not None else None
    if rule is None and no_renormalise:
        raise UserError("--no-renormalise applies to --drop only.")
    res = capture_hf(str(model), prompts, n_predict=n_decode, out=out, device=device, dtype=dtype, expert_dtype=expert_dtype,
                     override=rule, ignore_eos=ignore_eos, ubatch=ubatch, logits=not no_logits, gate_input=not no_gate_input,
                     tokens_per_part=part_tokens, prompt_source=str(prompts_file) if prompts_file else None)
    row = {
        "complete": res.complete, "stop_reasons": res.stop_reasons, "tokens_prefill": res.prompt_tokens,
        "tokens_decode": res.decode_tokens, "prefill_tok_s": res.prefill_tok_s, "decode_tok_s": res.decode_tok_s,
        "checks_passed": res.checks["passed"],
    }
    state = "" if res.complete else f" [INCOMPLETE: {res.stop_reason}]"
    _report("capture-hf", out, row, res, json_out, "model's",
            f"wrote {out}{state}: {_model_line(res.meta['model'])}; {len(prompts)} prompt(s), {res.prompt_tokens} prompt "
            f"tokens + {res.decode_tokens} decoded tokens"
            + (f"; override: {res.meta['intervention']}" if res.meta.get("intervention") else ""))
    if not res.complete:
        sig = signal.SIGTERM if "SIGTERM" in res.stop_reason else signal.SIGINT
        sys.exit(128 + int(sig))


def make_hf_model_cmd(
    out: Path = typer.Argument(..., help="Directory to write the checkpoint and tokenizer into.", show_default=False),
    family: str = typer.Option("qwen3_moe", "--family", help="A transformers model_type: qwen3_moe qwen2_moe mixtral olmoe "
                               "deepseek_v3 gpt_oss glm4_moe flex_olmo dots1 glm4_moe_lite minimax minimax_m2 "
                               "hunyuan_v1_moe lfm2_moe ernie4_5_moe deepseek_v2."),
    layers: int = typer.Option(3, "--layers", help="Decoder layers (families with dense first layers keep layer 0 dense)."),
    experts: int = typer.Option(8, "--experts", help="Routed experts per MoE layer."),
    top_k: int = typer.Option(2, "--top-k", help="Experts used per token."),
    hidden: int = typer.Option(64, "--hidden", help="Hidden size (multiple of 16)."),
    expert_ff: int = typer.Option(32, "--expert-ff", help="Expert hidden width."),
    seed: int = typer.Option(0, "--seed"),
    force: bool = typer.Option(False, "--force", help="Write into OUT even if it holds files."),
) -> None:
    """Write a tiny random-weight transformers MoE checkpoint with a small BPE tokenizer (tests, demos)."""
    from engine_bridge.hf import require_hf_extra

    require_hf_extra("make-hf-model")
    from engine_bridge.hf_tiny import TinyHfConfig, write_tiny_hf_model

    cfg = TinyHfConfig(family=family, layers=layers, experts=experts, top_k=top_k, hidden=hidden, expert_ff=expert_ff, seed=seed)
    write_tiny_hf_model(out, cfg, force=force)
    typer.echo(f"wrote {out}: {family}, {layers} layers x {experts} experts, top-k {top_k}, hidden {hidden}, "
               f"expert ff {expert_ff}, seed {seed}")


def quality_cmd(
    model: Path = typer.Argument(..., help="A local transformers checkpoint directory, or a GGUF file with --engine llama.cpp.",
                                 show_default=False),
    text: Path = typer.Option(..., "--text", help="UTF-8 text run teacher-forced, one token per forward.", show_default=False),
    drop_frac: str = typer.Option("0,0.5,0.75,1.0", "--drop-frac", help="Drop-cold F values (comma-separated): a miss "
                                  "whose weight is below F / k is dropped, never the routing's top expert."),
    budget_mib: str = typer.Option(..., "--budget-mib", help=f"Simulated expert cache budget in {BUDGET_UNITS_HELP}.",
                                   show_default=False),
    policy: str = typer.Option("lru", "--policy", help="Cache policy of the simulated cache: any policy the replay can step "
                               "load by load (not belady, which needs the future, nor pin / colibri / layer-opt, which "
                               "plan from the whole trace)."),
    prompt: str | None = typer.Option(None, "--prompt", help="Also generate greedily after this prompt, once per setting "
                                      "and undropped, and report where each output diverges."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Tokens to generate after --prompt (at most)."),
    engine: str = typer.Option("transformers", "--engine", help="transformers (MODEL: a checkpoint directory) | llama.cpp "
                               "(MODEL: a GGUF file; CPU, KV cache f32, flash attention off)."),
    renormalize: bool = typer.Option(False, "--renormalize", help="Rescale the surviving weights to the sum the router "
                                     "gave the whole set (default: dropped weight is zeroed, survivors unchanged)."),
    keep_k: list[int] = typer.Option([], "--keep-k", help="Also run the static top-k cut at K (repeatable)."),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda | cuda:N."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16 | auto."),
    expert_dtype: str | None = typer.Option(None, "--expert-dtype", help="Size experts as an offloading engine stores them "
                                            "(as capture-hf)."),
    out: Path = typer.Option(..., "-o", "--out", help="Directory to create: quality.json, plain/ and one trace per setting.",
                             show_default=False),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it exists."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
) -> None:
    """Run MODEL teacher-forced over a text with drop-cold applied inside the forward pass (a
    simulated expert cache decides the misses), once per setting, and compare each run's outputs
    with the undropped run's, beside the offline closed-loop replay's prediction."""
    from engine_bridge.quality import format_table, parse_fracs, quality
    from replay.cli.options import parse_budget
    if engine not in ("transformers", "llama.cpp"):
        raise UserError(f"--engine {engine!r} is not transformers or llama.cpp.")
    if not text.is_file():
        raise UserError(f"{text}: no such text file (--text).")
    try:
        body = text.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{text}: cannot be read as UTF-8 text ({e.__class__.__name__}).") from None
    obj = quality(str(model), body, fracs=parse_fracs(drop_frac), out=out, budget_mib=parse_budget(budget_mib), policy=policy,
                  keep_ks=list(keep_k), renormalize=renormalize, device=device, dtype=dtype, expert_dtype=expert_dtype,
                  force=force, text_source=str(text), engine=engine, prompt=prompt, max_new_tokens=max_new_tokens)
    import json

    typer.echo(json.dumps(obj, indent=1, allow_nan=False) if json_out else format_table(obj))
