"""The report's Quality section: drop-cold's price in output quality as ``moe-replay quality``
measured it, against reads avoided (the run's and the offline replay's prediction), with the cost
model's time per token. Pure: validated results and their frame in, a Section and one PNG out."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from replay.present.format import exact, fmt_q
from replay.present.report import Section, Table

TITLE = "Quality (drop-cold measured in the model)"
# Quality figures at the precision quality's own table prints them; KL (nats) at kl_digits.
DIGITS = {"ppl": 3, "ppl_delta_pct": 2}


def kl_digits(frame: pl.DataFrame) -> int:
    """Decimals for the KL columns: 4, or more (at most 10) so the smallest non-zero KL shows two
    significant digits: a KL of 1e-7 printed as 0.0000 would read as no change."""
    return _kl_decimals([v for c in ("kl_mean", "kl_p95") for v in frame[c].to_list() if v])


def _kl_decimals(vals: list[float]) -> int:
    return 4 if not vals else max(4, min(10, math.ceil(-math.log10(min(vals))) + 1))


def kl_text(v: float, rows: list[dict[str, Any]]) -> str:
    """A KL figure in running text with the decimals the section's table gives these rows' KLs."""
    return f"{v:.{_kl_decimals([x for r in rows for x in (r.get('kl_mean'), r.get('kl_p95')) if x])}f}"


def digits(frame: pl.DataFrame) -> dict[str, int]:
    """The Table's digits for ``frame`` (what the section prints each figure with)."""
    k = kl_digits(frame)
    return {**DIGITS, "kl_mean": k, "kl_p95": k}


HEADERS = {"frac": "F", "keep_k": "keep-k", "ppl_delta_pct": "ppl change %", "kl_mean": "KL mean (nats)",
           "kl_p95": "KL p95 (nats)", "top1_agree_pct": "top-1 agree %", "io_saved_pct": "reads avoided % (run)",
           "io_saved_pct_replay": "reads avoided % (replay's prediction)", "io_saved_gap_pp": "gap run - replay (pp)",
           "mass_lost_pct": "mass lost % (run)", "mass_lost_pct_replay": "mass lost % (replay)",
           "read_mib_per_token": "MiB read per token (run)", "ms_per_token": "ms/token (cost model)",
           "tok_s": "tok/s (cost model)"}
COLUMNS = ["setting", "frac", "keep_k", "ppl", "ppl_delta_pct", "kl_mean", "kl_p95", "top1_agree_pct", "io_saved_pct",
           "io_saved_pct_replay", "io_saved_gap_pp", "mass_lost_pct", "mass_lost_pct_replay", "read_mib_per_token"]
GEN_HEADERS = {**HEADERS, "tokens_generated": "tokens generated", "diverges_at": "diverges at token",
               "routings_dropped_pct": "routings dropped % (run)", "routings_dropped_pct_replay": "routings dropped % (replay)"}
GEN_COLUMNS = ["setting", "frac", "keep_k", "tokens_generated", "diverges_at", "routings_dropped_pct",
               "routings_dropped_pct_replay", "io_saved_pct", "io_saved_pct_replay", "mass_lost_pct", "mass_lost_pct_replay"]


def _model_line(res: Any) -> str:
    obj = res.obj
    head = (f"{res.name} ({res.path.name}): {obj['engine']}, {obj['plain']['tokens']} tokens of text run teacher-forced "
            f"one token per forward; simulated cache {obj['policy']} at {exact(obj['budget_mib'])} MiB; dropped weight "
            + ("zeroed, survivors renormalised" if obj.get("renormalize") else "zeroed, survivors not renormalised")
            + f"; undropped perplexity {obj['plain']['ppl']:.3f}.")
    if res.plain is None:
        return head + " Model: not recorded in quality.json."
    t = res.plain
    prov = t.meta.get("provenance") if isinstance(t.meta.get("provenance"), dict) else {}
    src = prov.get("source_file") or prov.get("engine")
    return (head + f" Model: {t.model.get('name')} ({t.model.get('arch')}, {len(t.moe_layers)} MoE layers x {t.n_expert} "
            f"experts, top-{t.top_k})" + (f", from {src}" if src else "") + ".")


def _weights_line(res: Any) -> str:
    if res.random_weights:
        return ("**Random weights**: this is one of moe-replay's random-weight tiny models, and random weights say nothing "
                "about a real model's quality (its near-uniform outputs barely move whatever is dropped); only the "
                "mechanics are shown.")
    return ("quality.json does not record whether the model's weights are trained: these quality figures are only "
            "meaningful for a real (trained) model; random weights say nothing about a real model's quality.")


def _plot(frame: pl.DataFrame, path: Path, random_weights: bool) -> None:
    from replay.present import plots

    plt = plots.plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    names = list(dict.fromkeys(frame["quality"].to_list()))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, ycol, ylabel in ((axes[0], "kl_mean", "KL(undropped || run), mean over positions (nats)"),
                             (axes[1], "ppl_delta_pct", "perplexity change from the undropped run (%)")):
        for i, name in enumerate(names):
            tag = f"{name}: " if len(names) > 1 else ""
            rows = [r for r in frame.filter(pl.col("quality") == name).to_dicts() if r["io_saved_pct"] is not None]
            cold = sorted((r for r in rows if r["frac"] is not None), key=lambda r: r["frac"])
            cut = sorted((r for r in rows if r["keep_k"] is not None), key=lambda r: -r["keep_k"])
            for group, marker, label, key in ((cold, "o", "drop-cold F", "frac"), (cut, "s", "top-k cut", "keep_k")):
                if not group:
                    continue
                c = colors[(i if key == "frac" else len(names) + i) % len(colors)]  # the cut in its own colour
                x = np.array([r["io_saved_pct"] for r in group])
                y = np.array([r[ycol] for r in group])
                ax.plot(x, y, marker=marker, color=c, linestyle="-" if marker == "o" else "none", markersize=6,
                        label=f"{tag}{label}, as run")
                xr = [r["io_saved_pct_replay"] for r in group]
                if all(v is not None for v in xr):
                    ax.plot(xr, y, marker=marker, color=c, linestyle="none", markerfacecolor="none", markersize=8,
                            label=f"{tag}{label}, replay's prediction")
                    for a, b, yy in zip(x, xr, y):
                        ax.plot([b, a], [yy, yy], color=c, linestyle=":", linewidth=1)
                for r, a, yy in zip(group, x, y):
                    text = f"F={exact(r['frac'])}" if key == "frac" else f"k={r['keep_k']}"
                    ax.annotate(text, (a, yy), textcoords="offset points", xytext=(4, 4), fontsize=7, color=c)
        ax.set_xlabel("reads avoided (% of the undropped run's expert bytes)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle("Quality lost against reads avoided (filled: as run; hollow: offline replay's prediction, same y)"
                 + ("\nRANDOM WEIGHTS: says nothing about a real model's quality" if random_weights else ""))
    plots.save(fig, path)


def quality_section(results: list[Any], frame: pl.DataFrame, model: Any, out: Path) -> Section:
    """The section for validated ``results`` and their ``quality_frame`` (with time when ``model``)."""
    s = Section(TITLE)
    for res in results:
        s.text.append(_model_line(res))
        s.text.append(_weights_line(res))
        s.text += [f"Warning ({res.name}): {w}." for w in res.warnings]
    s.text.append("Quality lost against reads avoided, per setting, as `moe-replay quality` measured it with drop-cold "
                  "applied inside the forward pass: perplexity over the text and its change from the undropped run, "
                  "KL(undropped || run) of the next-token distribution in nats (mean and p95 over positions; printed to "
                  f"{kl_digits(frame)} decimals, quality.json holds them unrounded), top-1 agreement with the undropped run. Reads avoided "
                  "= expert bytes the run's simulated cache did not read, against the undropped run at the same budget, "
                  "as it happened in that run; beside it the offline closed-loop replay's prediction from the undropped "
                  "run's trace, and the gap run - replay in points: the effect a replay of the undropped trace cannot see "
                  "(a dropped expert changes the next layers' inputs, so their routings change). The top-k cut (keep-k) "
                  "is on the same axis for comparison.")
    cols = (["quality"] if len(results) > 1 else []) + list(COLUMNS)
    if model is not None:
        cols += ["ms_per_token", "tok_s"]
        kind = "given on the command line" if model.kind == "manual" else f"{model.kind}"
        s.text.append(f"Time per token under the cost model ({kind}: {model.model}; intercept {fmt_q(model.intercept_ms, 'ms')} "
                      f"ms/token, {fmt_q(model.ms_per_mib, 'ms_per_mib')} ms/MiB): each teacher-forced token is priced as "
                      "one decoded token (one token per forward) from the MiB its run read per token"
                      + (" and its expert reads per token" if model.ms_per_miss else "") + ".")
        if model.kind == "manual":
            s.text.append("A manual model is an assumption, not a measurement: its times rank the settings by bytes read; "
                          "they do not predict a real engine's speed.")
        from replay.analyses.quality_result import price

        for res in results:
            plain_mib = res.obj["rows"][0]["read_mib_plain"]
            ms, _ = price(res, plain_mib, model)
            s.text.append(f"{res.name} undropped: {fmt_q(plain_mib / res.tokens, 'mib_per_token')} MiB read per token, "
                          f"{fmt_q(ms, 'ms')} ms/token.")
        if frame["ms_per_token"].null_count():
            s.text.append("A time shown '-' needs the cost model's per-miss term, and misses per token are known only when "
                          "the run's plain/ trace lies beside quality.json and every MoE layer's experts weigh the same.")
    else:
        s.text.append("No cost model (the trace has no recorded metrics and none was given with --cost-model or "
                      "--flash-mib-s/--compute-ms): MiB read per token are shown, not time.")
    _plot(frame, out / "quality.png", any(r.random_weights for r in results))
    s.images.append(("quality.png", "quality lost against reads avoided"))
    s.tables.append(Table("quality", frame, "quality lost against reads avoided per setting (teacher-forced, one token per "
                          "forward)", columns=cols, digits=digits(frame), headers=HEADERS))
    from replay.analyses.quality_result import generation_frame

    gen = generation_frame(results)
    if gen is not None:
        prompts = "; ".join(f"{res.name}: {res.obj['generation'].get('prompt')!r}, up to "
                            f"{res.obj['generation'].get('max_new_tokens')} tokens" for res in results if "generation" in res.obj)
        s.text.append(f"Greedy generation after the prompt ({prompts}), undropped and once per setting with the drop "
                      "applied: the first generated token (from 0) that differs from the undropped generation ('-': "
                      "identical), and the run's drops beside the offline closed-loop replay's of the undropped "
                      "generation's trace. The generated texts are in the CSV and quality.json.")
        s.tables.append(Table("quality_generation", gen, "greedy generation per setting",
                              columns=(["quality"] if len(results) > 1 else []) + list(GEN_COLUMNS),
                              digits=DIGITS, headers=GEN_HEADERS))
    return s
