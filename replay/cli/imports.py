"""``import``: one command per registered importer (traces/importers), ``import --list`` and ``import auto``.

Each format's flags are derived from its module (``OPTIONS``, and the size options when it takes
sizes): nothing about a format is typed twice.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from types import ModuleType
from typing import Any

import typer

from replay.cli.options import JsonOpt, example

# One source per format for its --help example (a format not named here shows SRC).
_EXAMPLE_SRC = {"bigmoe": "route_trace.csv", "colibri": "route_trace.txt", "llamacpp-moetrace": "moe_trace.csv",
                "megatron": "router_trace_rank0.jsonl", "sglang": "responses.jsonl", "vllm": "routed_experts.npy",
                "table": "routes.csv --map layer=layer,experts=topk_ids"}


class _FormatGroup(typer.core.TyperGroup):
    """The ``import`` group, its format commands made when first listed or looked up: building them
    loads every importer module (numpy, pyarrow, polars), which ``moe-replay --help`` must not wait for."""

    _formats_loaded = False

    def _load_formats(self) -> None:
        if self._formats_loaded:
            return
        self._formats_loaded = True
        from traces.importers import registry

        formats = typer.Typer()
        for name, mod in registry().items():
            formats.command(name, epilog=example(f"moe-replay import {name} {_EXAMPLE_SRC.get(name, 'SRC')} traces/{name}"
                                                 + (" --expert-bytes 1048576" if mod.TAKES_SIZES else "")))(_make_command(mod))
        made = typer.main.get_group(formats).commands
        self.commands = {**made, **{n: c for n, c in self.commands.items() if n not in made}}  # formats, then auto

    def list_commands(self, ctx):  # noqa: ANN001, ANN201 - click's signature
        self._load_formats()
        return super().list_commands(ctx)

    def get_command(self, ctx, cmd_name):  # noqa: ANN001, ANN201 - click's signature
        self._load_formats()
        return super().get_command(ctx, cmd_name)


import_app = typer.Typer(no_args_is_help=True, invoke_without_command=True, cls=_FormatGroup,
                         help="Import other engines' route logs as v1 traces (--list shows the formats).")

PathsArg = typer.Argument(..., metavar="SRC... OUT", help="Source file(s) of the log, then the trace directory to create.",
                          show_default=False)
ForceOpt = typer.Option(False, "--force", help="Replace OUT if it exists.")


def _size_params() -> list[inspect.Parameter]:
    from traces.importers._sizes import DTYPES

    kw = inspect.Parameter.KEYWORD_ONLY
    return [
        inspect.Parameter("expert_bytes", kw, annotation=int | None, default=typer.Option(
            None, "--expert-bytes", help="Bytes of one expert, the same in every layer.")),
        inspect.Parameter("sizes_from", kw, annotation=Path | None, default=typer.Option(
            None, "--sizes-from", help="Expert sizes from the model: a .gguf file, or a Hugging Face config.json "
            "(then --dtype).")),
        inspect.Parameter("dtype", kw, annotation=str | None, default=typer.Option(
            None, "--dtype", help=f"Storage type of the experts for --sizes-from config.json: {', '.join(DTYPES)}.")),
    ]


def _option_param(opt: Any) -> inspect.Parameter:
    ann = bool if opt.type is bool else opt.type | None
    default = False if opt.type is bool else opt.default
    return inspect.Parameter(opt.name, inspect.Parameter.KEYWORD_ONLY, annotation=ann,
                             default=typer.Option(default, opt.flag, help=opt.help))


def _split(paths: list[Path], mod: ModuleType | None, fmt: str) -> tuple[list[Path], Path]:
    from traces.format.errors import UserError

    if len(paths) < 2:
        raise UserError(f"import {fmt}: give the source file(s) and then the trace directory to create (SRC... OUT).")
    sources, out = list(paths[:-1]), paths[-1]
    if mod is not None and mod.MAX_SOURCES is not None and len(sources) > mod.MAX_SOURCES:
        raise UserError(f"import {fmt}: takes {mod.MAX_SOURCES} source file(s), got {len(sources)} "
                        f"({', '.join(str(s) for s in sources)}) before OUT.")
    return sources, out


def _report(fmt: str, out_dir: Path, json_out: bool, chosen: str | None = None) -> None:
    from replay.analyses.info import info_rows
    from replay.present.format import json_object
    from traces import open_trace

    t = open_trace(out_dir)
    row = info_rows(t)[0]
    notes = list(t.meta.get("provenance", {}).get("notes") or [])
    if json_out:
        extra: dict[str, Any] = {"notes": notes} if notes else {}
        if chosen is not None:
            extra["format"] = chosen
        typer.echo(json_object(f"import {fmt}", str(out_dir), [row], **extra))
        return
    lines = [] if chosen is None else [f"format: {chosen} (recognised by its sniffer)"]
    lines.append(
        f"wrote {out_dir}: {row['moe_layers']} MoE layers x {row['n_expert']} experts, top-k {row['top_k']}, "
        f"{row['tokens_prefill']} prefill + {row['tokens_decode']} decode tokens"
        + (", with engine metrics" if t.has_metrics else ""))
    lines += [f"note: {n}" for n in notes]
    typer.echo("\n".join(lines))


def _run(mod: ModuleType, fmt: str, paths: list[Path], values: dict[str, Any], json_out: bool, force: bool,
         chosen: str | None = None) -> None:
    from traces.format.errors import UserError
    from traces.importers._sizes import load_sizes
    from traces.io.atomic import check_not_input, check_not_special

    sources, out = _split(paths, mod, fmt)
    # Before anything is read: OUT may not be, hold or lie inside a file the import reads (the
    # sources, --sizes-from, a --metrics file), with or without --force.
    check_not_input(out, [*sources, values.get("sizes_from"), *(values.get(o.name) for o in mod.OPTIONS if o.type is Path)])
    check_not_special(out)
    size_keys = ("expert_bytes", "sizes_from", "dtype")
    sizes = None
    if mod.TAKES_SIZES:
        sizes = load_sizes(values.get("expert_bytes"), values.get("sizes_from"), values.get("dtype"))
    else:
        given = [k for k in size_keys if values.get(k) is not None]
        if given:
            raise UserError(f"import {mod.NAME}: the {mod.NAME} format states its own expert sizes; drop "
                            f"--{given[0].replace('_', '-')}.")
    opts = {o.name: values[o.name] for o in mod.OPTIONS if o.name in values}
    try:
        mod.import_(sources, out, sizes=sizes, force=force, **opts)
    except UserError as e:
        hint = _table_hint(mod, sources)
        if hint is None or type(e) is not UserError:
            raise
        raise UserError(f"{str(e).rstrip('.')}; {hint}.") from None
    _report(fmt, out, json_out, chosen)


def _table_hint(mod: ModuleType, sources: list[Path]) -> str | None:
    """A dedicated importer refused a file that reads as a table of routings (a patched engine's
    or a hook script's per-row dump): the generic importer, with the columns it would read."""
    from traces.importers import table

    if mod.NAME == table.NAME:
        return None
    found: dict[str, str] = {}
    for p in sources:
        cols = table.columns_of(Path(p))
        if not cols:
            return None
        got, _ = table.resolve_columns({}, cols)
        if "experts" not in got:
            pats = table.wide_patterns(cols)
            if pats is None:
                return None
            got["experts"] = (f"{pats[0]} (--map experts={pats[0]}: one column per expert)" if pats[1] is None else
                              f"{pats[0]} and {pats[1]} (--map experts={pats[0]},weights={pats[1]}: one column per slot)")
        found.update({k: c for k, c in got.items() if k not in found})
    said = ", ".join(f"{c} as {k}" for k, c in found.items())
    return (f"it reads as a table of routings (one row per token and layer): try 'moe-replay import table SRC... OUT' "
            f"(it would read {said}; --map KEY=COLUMN to choose others)")


def _make_command(mod: ModuleType):
    kw = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("paths", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=list[Path], default=PathsArg)]
    if mod.TAKES_SIZES:
        params += _size_params()
    params += [_option_param(o) for o in mod.OPTIONS]
    params += [inspect.Parameter("force", kw, annotation=bool, default=ForceOpt),
               inspect.Parameter("json_out", kw, annotation=bool, default=JsonOpt)]

    def command(**values: Any) -> None:
        _run(mod, mod.NAME, values.pop("paths"), values, values.pop("json_out"), values.pop("force"))

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {}
    command.__doc__ = f"{mod.SUMMARY}."
    command.__name__ = f"import_{mod.NAME.replace('-', '_')}"
    return command


@import_app.callback()
def import_group(ctx: typer.Context,
                 list_: bool = typer.Option(False, "--list", help="List the formats and what each reads.")) -> None:
    """Import other engines' route logs as v1 traces."""
    if list_:
        from traces.importers import registry

        reg = registry()
        width = max(len(n) for n in reg)
        lines = [f"{name:<{width}}  {mod.SUMMARY}" + ("" if mod.TAKES_SIZES else " (sizes in the file)")
                 for name, mod in reg.items()]
        lines.append(f"{'auto':<{width}}  recognise the format from the file(s) and say which was chosen")
        typer.echo("\n".join(lines))
        raise typer.Exit(0)
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())


def _auto(
    paths: list[Path] = PathsArg,
    expert_bytes: int | None = typer.Option(None, "--expert-bytes", help="Bytes of one expert, the same in every layer."),
    sizes_from: Path | None = typer.Option(None, "--sizes-from", help="Expert sizes from a .gguf or a config.json."),
    dtype: str | None = typer.Option(None, "--dtype", help="Storage type of the experts for --sizes-from config.json."),
    drop_warmup: bool = typer.Option(False, "--drop-warmup", help="Leave out rows that look like an engine's warm-up "
                                     "(profiling or dummy) pass (default: keep them and say so)."),
    force: bool = ForceOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Recognise the format of SRC..., say which it is, and import it (format options need 'import FORMAT')."""
    from traces.format.errors import UserError
    from traces.importers import choose_format, get

    sources, _ = _split(paths, None, "auto")
    fmt = choose_format(sources)
    mod = get(fmt)
    values = {"expert_bytes": expert_bytes, "sizes_from": sizes_from, "dtype": dtype}
    values.update({o.name: (False if o.type is bool else o.default) for o in mod.OPTIONS})
    if drop_warmup:
        if "drop_warmup" not in values:
            raise UserError(f"import auto: the {fmt} format is written by the engine itself with no warm-up pass; "
                            "drop --drop-warmup.")
        values["drop_warmup"] = True
    _run(mod, "auto", paths, values, json_out, force, chosen=fmt)


import_app.command("auto", epilog=example("moe-replay import auto routes.jsonl traces/imported --expert-bytes 1048576"))(_auto)


def register(app: typer.Typer) -> None:
    app.add_typer(import_app, name="import")
