"""``compare``: two traces of the same prompt, routing by routing (the work is in :mod:`replay.analyses.trace_compare`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from replay.cli.options import JsonOpt, example


def _sci(v: Any) -> Any:
    """A difference or margin: small, so in scientific notation ('-' when absent)."""
    return "-" if v is None else f"{v:.2e}"


def compare_text(path_a: Path, path_b: Path, a: Any, b: Any, res: Any, show: int) -> str:
    from replay.core.frames import rows_of
    from replay.present.format import text_table

    ov = res.overall()
    tok = ("token ids identical on every compared position" if res.tokens_checked
           else "token ids not checked (see note)")
    out = [
        f"compare A={path_a}  B={path_b}",
        f"A: {a.model['name']} ({a.model['arch']}), {a.meta.get('provenance', {}).get('engine') or 'unknown engine'}",
        f"B: {b.model['name']} ({b.model['arch']}), {b.meta.get('provenance', {}).get('engine') or 'unknown engine'}",
        f"{len(a.moe_layers)} MoE layers x {a.n_expert} experts, top-{a.top_k}; {res.positions} token positions, "
        f"{ov['routings']:,} routings compared (phase {res.phase}); {tok}",
        "",
    ]
    rows = []
    for r in rows_of(res.per_layer):
        r = dict(r)
        r["layer"] = "all" if r["layer"] is None else r["layer"]
        for c in ("weight_max_abs_diff", "weight_mean_abs_diff", "logit_max_abs_diff", "logit_mean_abs_diff"):
            r[c] = _sci(r[c])
        rows.append(r)
    cols = ["layer", "routings", "set_agree_pct", "top1_agree_pct", "weight_max_abs_diff", "weight_mean_abs_diff",
            "logit_max_abs_diff", "logit_mean_abs_diff", "disagreements", "explained", "unexplained"]
    heads = ["layer", "routings", "set agree %", "top-1 agree %", "weight max|d|", "weight mean|d|", "logit max|d|",
             "logit mean|d|", "disagree", "explained", "unexplained"]
    out.append(text_table(rows, cols, heads))
    out.append("")
    n_dis, n_exp = ov["disagreements"], ov["explained"]
    if n_dis == 0:
        out.append("every compared routing selects the same expert set in both traces.")
    else:
        out.append(f"{n_dis} routings select different expert sets: {n_exp} explained by a near-tie "
                   f"(margin < --tol {res.tol:g} {res.margin_unit}s, measured on {res.margin_source}), "
                   f"{n_dis - n_exp} not explained.")
        d = res.disagreements.sort(["explained", "margin"], descending=[False, True], nulls_last=False)
        listed = [dict(r) for r in rows_of(d.head(show))]
        for r in listed:
            r["margin"] = _sci(r["margin"])
            r["experts_a"] = ",".join(map(str, r["experts_a"]))
            r["experts_b"] = ",".join(map(str, r["experts_b"]))
            r["explained"] = "yes" if r["explained"] else "NO"
        if listed:
            out.append(f"{'unexplained first, ' if n_dis > n_exp else ''}up to {show} of them (--show N):")
            out.append(text_table(listed, ["turn", "step", "layer", "experts_a", "experts_b", "margin", "explained"],
                                  ["turn", "step", "layer", "A's experts", "B's experts", "margin", "explained"]))
    out.append("")
    out.append("set agree = the same experts chosen (any order); top-1 = the same highest-ranked expert; weight |d| over "
               "routings whose sets agree, matched by expert id; logit |d| over every expert, '-' unless both hold logits.")
    out.append("margin = spread of the ranked router values over the experts the two traces disagree on (one swap at the "
               "k-th place: the k-th minus the (k+1)-th value); below --tol it is a near-tie, not an engine difference.")
    out += [f"note: {n}" for n in res.notes]
    return "\n".join(out)


def compare_cmd(
    trace_a: Path = typer.Argument(..., help="First trace directory (A).", show_default=False),
    trace_b: Path = typer.Argument(..., help="Second trace directory (B), of the same prompt.", show_default=False),
    tol: float = typer.Option(1e-3, "--tol", help="A disagreement whose router margin is below this is a near-tie "
                              "(explained); in logits (selection scores for biased or grouped routers)."),
    align: str = typer.Option("none", "--align", help="none: refuse traces whose token positions or ids differ; "
                              "step: compare the positions both hold, up to the first differing token."),
    phase: str = typer.Option("all", "--phase", help="all (prefill and decode), prefill or decode."),
    show: int = typer.Option(10, "--show", help="Disagreements listed in the text output (all of them with --json)."),
    strict: bool = typer.Option(False, "--strict", help="Exit 1 when a disagreement is not explained by a near-tie."),
    json_out: bool = JsonOpt,
) -> None:
    """Per layer: how often two traces of the same prompt choose the same experts, their weight and logit
    differences, and whether each disagreement is a near-tie of the router (two engines, two quantisations,
    CPU vs GPU)."""
    from replay.analyses.trace_compare import compare
    from replay.core.frames import rows_of
    from replay.present.format import json_object
    from traces import open_trace
    from traces.format.errors import UserError

    if show < 0:
        raise UserError(f"--show {show} must be 0 or more.")
    a, b = open_trace(trace_a), open_trace(trace_b)
    res = compare(a, b, tol=tol, align=align, phase=phase)
    if json_out:
        typer.echo(json_object("compare", str(trace_a), rows_of(res.per_layer), trace_b=str(trace_b), tol=res.tol,
                               align=res.align, phase=res.phase, margin_unit=res.margin_unit, margin_source=res.margin_source,
                               positions=res.positions, tokens_checked=res.tokens_checked, left_out=res.left_out,
                               notes=res.notes, disagreements=rows_of(res.disagreements)))
    else:
        typer.echo(compare_text(trace_a, trace_b, a, b, res, show))
    if strict and res.overall()["unexplained"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("compare", epilog=example("moe-replay compare traces/llamacpp traces/hf"))(compare_cmd)
