"""``moe-replay``: a thin typer layer over the library. No analysis logic lives here.

Bad input raises :class:`traces.format.errors.UserError`; :func:`main` prints its one sentence and exits
2 without a traceback (``--debug`` anywhere on the command line shows it).
"""

from __future__ import annotations

# First, before the imports that take most of a second: a signal from here on ends the command
# with its own message and 128 + N, never the default action (replay.runner.exit_on_signals).
from replay.runner import _interrupted, exit_on_signals, guarded, hold_signals, is_command_process

if is_command_process():
    exit_on_signals()

import signal  # noqa: E402
import sys  # noqa: E402
from importlib.metadata import entry_points  # noqa: E402
from pathlib import Path  # noqa: E402

import typer  # noqa: E402

from replay.cli.options import JsonOpt, TraceArg, example  # noqa: E402
from traces.format.errors import UserError  # noqa: F401 (re-exported)

app = typer.Typer(
    add_completion=True,  # --install-completion / --show-completion (typer's, for bash, zsh, fish, PowerShell)
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Replay what a Mixture-of-Experts router did through expert-cache policies, predictors, "
    "drop and prefetch what-ifs, offline and exactly.",
)

def _usage_name(self: typer.core.TyperArgument) -> str:
    """An argument on the usage line as a command line reads: TRACE, OUT_DIR, [OPTIONAL]; typer 0.29
    writes a required one as {TRACE} (and a plain one in lower case), which reads like a placeholder
    of a format string."""
    name = self.metavar or (self.name or self.display_name_raw).upper()
    return (name if self.required else f"[{name}]") + ("..." if self.nargs != 1 else "")


if hasattr(typer.core.TyperArgument, "_usage_display_name"):
    typer.core.TyperArgument._usage_display_name = _usage_name


def _version(value: bool) -> None:
    if value:
        from traces.format.version import __version__

        typer.echo(f"moe-replay {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", help="Print the version and exit.", callback=_version,
                                       is_eager=True)) -> None:
    pass  # the group's own options (--version); the verbs do the work


# The verbs of replay/ (one module each in this package, each with ``register(app)``).
VERB_MODULES = ("replay.cli.cache", "replay.cli.predict", "replay.cli.whatif", "replay.cli.cost", "replay.cli.report",
                "replay.cli.imports", "replay.cli.exports", "replay.cli.schedule")
VERB_MODULES += ("replay.cli.sweep",)
VERB_MODULES += ("replay.cli.compare",)
VERB_MODULES += ("replay.cli.upgrade",)
VERB_MODULES += ("replay.cli.curve",)


def _echo(text: str) -> None:
    typer.echo(text)


@app.command(epilog=example("moe-replay info traces/qwen"))
def info(trace: Path = TraceArg, json_out: bool = JsonOpt) -> None:
    """Model, shape, tokens per phase, optional columns, expert sizes, token-cycle size, provenance."""
    from replay.analyses.info import info_rows
    from replay.present.format import json_object
    from replay.present.info import info_text
    from traces import open_trace

    t = open_trace(trace)
    rows = info_rows(t)
    _echo(json_object("info", str(trace), rows) if json_out else info_text(t, rows[0]))


@app.command(epilog=example("moe-replay synth /tmp/demo-trace --layers 8 --tokens 128 --seed 1"))
def synth(
    out_dir: Path = typer.Argument(..., help="Trace directory to create."),
    layers: int = typer.Option(16, "--layers", help="MoE layers."),
    experts: int = typer.Option(64, "--experts", help="Experts per layer."),
    top_k: int = typer.Option(8, "--top-k", help="Experts routed per token and layer."),
    embd: int = typer.Option(128, "--embd", help="Width of the router input (gate input)."),
    tokens: int = typer.Option(256, "--tokens", help="Decoded tokens."),
    prompt_tokens: int = typer.Option(32, "--prompt-tokens", help="Prefill tokens (one batch)."),
    seed: int = typer.Option(0, "--seed"),
    gating: str = typer.Option("softmax", "--gating", help="softmax | sigmoid-bias | grouped"),
    routing_only: bool = typer.Option(False, "--routing-only", help="Skip logits, gate inputs and router matrices."),
    expert_bytes: int | None = typer.Option(None, "--expert-bytes", help="Bytes of one expert (default: realistic per-layer sizes)."),
    drift: float = typer.Option(0.35, "--drift", help="Residual update per layer (stale-gate agreement falls as it grows)."),
    reuse: float = typer.Option(0.8, "--reuse", help="Token-to-token persistence of the topic vector, 0..1 (temporal reuse)."),
    skew: float = typer.Option(3.0, "--skew", help="Expert popularity skew at the last layer (rises linearly with depth from 0)."),
    force: bool = typer.Option(False, "--force", help="Replace OUT_DIR if it exists."),
    json_out: bool = JsonOpt,
    requests: int | None = typer.Option(None, "--requests", help="Generate N requests (each --prompt-tokens + --tokens, its own "
                                        "seeded stream) batched by the continuous schedule; default: one request."),
    max_batch: int = typer.Option(1, "--max-batch", help="With --requests: requests decoding together (continuous schedule)."),
    prefill_chunk: int | None = typer.Option(None, "--prefill-chunk", help="With --requests: prompt tokens per prefill batch "
                                             "(default: unbounded)."),
    rank: int | None = typer.Option(None, "--rank", help="Low-rank model: the residual stream in R latent dimensions "
                                    "(1..embd-1; faster on large traces, other routings than the default full-width model)."),
) -> None:
    """Generate a synthetic trace from a small residual-stream model (deterministic per seed)."""
    from traces.synth.generator import SynthConfig, write_synthetic

    cfg = SynthConfig(
        layers=layers, experts=experts, top_k=top_k, embd=embd, tokens=tokens, prompt_tokens=prompt_tokens,
        seed=seed, gating=gating, routing_only=routing_only, expert_bytes=expert_bytes, drift=drift,
        reuse=reuse, skew=skew, requests=requests, max_batch=max_batch, prefill_chunk=prefill_chunk, rank=rank,
    )
    from replay.core.progress import progress

    with progress((tokens + prompt_tokens) * (requests or 1), "synth", unit="tok") as bar:
        write_synthetic(out_dir, cfg, force=force, on_tokens=bar.update)
    if json_out:  # info's row only when printed: it decodes the key columns (0.5 s on 100,000 x 48 rows)
        from replay.analyses.info import info_rows
        from replay.present.format import json_object
        from traces import open_trace

        _echo(json_object("synth", str(out_dir), [info_rows(open_trace(out_dir, check_rows=False))[0]]))
    else:
        many = f" in each of {requests} requests, continuous batching at --max-batch {max_batch}" if requests else ""
        _echo(f"wrote {out_dir}: {layers} MoE layers x {experts} experts, top-k {top_k}, "
              f"{prompt_tokens} prefill + {tokens} decode tokens{many}, gating {gating}")


def _register_plugins() -> None:
    """Add commands that live outside replay/ (engine_bridge's capture, make-model).

    A plugin module imports nothing optional at import time (its verbs name a missing extra
    themselves), so one that fails to load is a broken installation: said on stderr with the entry
    point and the error, never skipped in silence (its verbs would vanish as "No such command")."""
    for ep in entry_points(group="moe_replay.commands"):
        if (ep.name, ep.value) in _registered:
            continue
        try:
            ep.load()(app)
            _registered.add((ep.name, ep.value))
        except Exception as e:  # noqa: BLE001 - every other verb still works; this one is reported
            print(f"moe-replay: warning: the commands of plugin {ep.name!r} ({ep.value}) could not be loaded "
                  f"({e.__class__.__name__}: {e}); this is a bug, please report it.", file=sys.stderr)


def _register_modules() -> None:
    """Commands of the replay/ modules (each module owns its verb)."""
    import importlib

    for name in VERB_MODULES:
        if name not in _registered:
            importlib.import_module(name).register(app)
            _registered.add(name)


# What has registered its verbs on ``app`` (a module name, or a plugin's (name, value)): main()
# registers before every run, and typer appends a command each time it is added, so a process that
# calls main() many times (the tests, a notebook) would rebuild ever more copies of every verb.
_registered: set = set()


def _run(args: list[str], debug: bool) -> int:
    from replay.api import cli_flags

    token = cli_flags.set(True)  # library messages name the flags the user typed, not the API's keywords
    try:
        return _run_command(args, debug)
    finally:
        cli_flags.reset(token)


def _run_command(args: list[str], debug: bool) -> int:
    """Run one command through typer; return its exit code (:func:`replay.runner.guarded`: 0 done,
    1 a check ran and failed, 2 bad input or an OS error, 3 a bug, 128 + N killed by signal N)."""

    def call() -> int:
        rv = app(args=args, prog_name="moe-replay", standalone_mode=False)
        # standalone_mode=False: click *returns* the code of an Exit (typer's KeyboardInterrupt
        # becomes Exit(130)) instead of exiting; a command itself returns None.
        if isinstance(rv, int) and not isinstance(rv, bool):
            return _interrupted(signal.SIGINT) if rv == 130 else rv
        return 0

    return guarded(call, debug, quiet="--json" in args, usage_error=_typer_error)


def _typer_error(e: Exception, debug: bool) -> int | None:
    """typer's own exceptions (an abort, a usage error) as an exit code; None for anything else."""
    if isinstance(e, typer.Abort):
        if isinstance(e.__context__, KeyboardInterrupt):
            return _interrupted(signal.SIGINT)
        print("moe-replay: aborted", file=sys.stderr)
        return 1
    if isinstance(e, typer.TyperException):  # usage errors: unknown option, bad value, missing argument
        if debug:
            raise e
        from typer._click.exceptions import NoArgsIsHelpError

        if isinstance(e, NoArgsIsHelpError) or not hasattr(e, "format_message"):
            e.show()  # a bare command prints its help
        else:
            # One sentence, like every other refusal (click's own form spans four lines).
            ctx = getattr(e, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            print(f"moe-replay: error: {' '.join(e.format_message().split()).rstrip('.')}{hint}.", file=sys.stderr)
        return e.exit_code
    return None


def main(argv: list[str] | None = None) -> None:
    from traces.io import atomic

    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    _register_modules()
    _register_plugins()
    with atomic.command_scope():  # what it writes, the inputs its readers note (no output may touch them)
        code = _run(args, debug)
    if is_command_process():  # done: the interpreter's finalization is not interrupted (replay.runner)
        hold_signals()
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
