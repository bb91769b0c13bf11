"""``profile``'s text (the cacheability answer first, then the tables) and its plots, from a
:class:`replay.analyses.locality.Profile`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from replay.analyses.locality import Profile, summary
from replay.present.format import exact, fmt_q, rows_of, text_table


def _mib(v: float | None) -> str:
    """MiB as every other text and the report print them (``fmt_q``: one decimal, no separator)."""
    return "-" if v is None else f"{fmt_q(v, 'mib')} MiB"


def answer_lines(a: dict[str, Any]) -> list[str]:
    """The answer to "is this routing cacheable?" (``Profile.answer``, or the report's verdict row):
    one headline and the three figures it rests on (hot set against the budget, reuse within one
    step and within one token's routing, SCH)."""
    ph = a["phase"]
    budget = a["budget_mib"]
    hot, n_hot = a["hot_set_80_mib"], a["hot_set_80_experts"]
    if hot is None:
        return [f"Is this routing cacheable? No {ph} routing to profile."]
    if budget is None:
        head = (f"Is this routing cacheable? No budget given (--budget-mib): the experts taking 80% of {ph} routed "
                f"slots need {_mib(hot)}, of a working set of {_mib(a['working_set_mib'])}.")
    elif hot <= budget:
        head = (f"Is this routing cacheable? Yes at {exact(budget)} MiB: the experts taking 80% of {ph} routed slots "
                f"({_mib(hot)}) fit in the budget; LRU hits {fmt_q(a['lru_hit_pct_at_budget'], 'pct')}% of {ph} lookups there.")
    else:
        head = (f"Is this routing cacheable? Not by popularity at {exact(budget)} MiB: the experts taking 80% of {ph} "
                f"routed slots need {_mib(hot)}; what a cache gains there comes from reuse in time (LRU hits "
                f"{fmt_q(a['lru_hit_pct_at_budget'], 'pct')}% of {ph} lookups).")
    lines = [head,
             f"  hot set: 80% of {ph} routed slots fall on {n_hot:,} of {a['entries']:,} (layer, expert) entries "
             f"({_mib(hot)}).",
             f"  reuse: {fmt_q(a['within_1_steps_pct'], 'pct')}% of {ph} lookups reuse an expert its layer used one "
             f"step before; LRU at one token's routing (T = {_mib(a['token_cycle_mib'])}) hits "
             f"{fmt_q(a['lru_hit_pct_at_token_cycle'], 'pct')}%; {fmt_q(a['reused_pct'], 'pct')}% are ever reused "
             "(the infinite cache's hit %).",
             f"  SCH (Liang et al. 2025; 16-token segments, 2k experts per layer): {fmt_q(a['sch_2k_16_pct'], 'pct')}% "
             "(a cache that knows the next 16 tokens; the paper finds ~2k the sweet spot where this is high)."]
    return lines


def profile_text(trace: Any, prof: Profile, per_layer: bool = True) -> str:
    k = prof.top_k
    out = [*answer_lines(prof.answer), ""]
    summ = summary(prof)
    cols = ["layer", "routings", "topk_pct", "hot_set_80", "gini", "experts_never_routed", "hottest_vs_uniform",
            "drift_kept_pct", "reused_pct", "within_1_steps_pct", "lru_hit_pct_at_token_cycle", "srp16_pct",
            "sch16_2k_pct", "cond_entropy_bits"]
    heads = ["layer", "routings", f"top-{k} %", "hot80", "gini", "unused", "hottest/unif", "drift kept %", "reused %",
             "1 step %", "LRU@T %", "SRP16 %", "SCH16@2k %", "H(next|e)"]
    rows = rows_of(summ)
    rows = rows if per_layer else rows[-1:]  # the pooled row is last
    for r in rows:
        if r["layer"] is None:
            r["layer"] = "all"
    out.append(text_table(rows, cols, heads, digits={"gini": 3, "hottest_vs_uniform": 2, "cond_entropy_bits": 2}))
    srp = prof.srp.filter(pl.col("request").is_null() & pl.col("layer").is_null())
    sch = prof.sch.filter(pl.col("request").is_null() & pl.col("layer").is_null())
    out += ["", "SRP and SCH by segment length (pooled over layers and requests):"]
    table = []
    for m in srp["segment_tokens"].to_list():
        r = srp.filter(pl.col("segment_tokens") == m).row(0, named=True)
        row = {"segment_tokens": m, "srp_pct": r["srp_pct"], "threshold": r["threshold"]}
        for s in sch.filter(pl.col("segment_tokens") == m).iter_rows(named=True):
            row[f"sch_{s['cache_experts']}"] = s["sch_pct"]
        table.append(row)
    sizes = sorted(set(sch["cache_experts"].to_list()))
    out.append(text_table(table, ["segment_tokens", "srp_pct", "threshold", *(f"sch_{c}" for c in sizes)],
                          ["segment", "SRP %", "theta", *(f"SCH@{c} %" for c in sizes)], digits={"threshold": 0}))
    if prof.pairs.height:
        top = prof.pairs.sort(["lift", "routings_both"], descending=True).head(5)
        out += ["", "Most co-activated pairs within a layer (lift = routings with both x routings / (count_a x count_b)):",
                text_table(rows_of(top), ["layer", "expert_a", "expert_b", "routings_both", "lift"],
                           ["layer", "a", "b", "both", "lift"], digits={"lift": 1})]
    if prof.top_transitions.height:
        top = prof.top_transitions.sort(["p_next_pct", "count"], descending=True).head(5)
        out += ["", "Strongest cross-layer transitions (P(e' at the next MoE layer | e here)):",
                text_table(rows_of(top), ["layer", "expert", "next_expert", "count", "p_next_pct"],
                           ["layer", "e", "e'", "count", "P %"])]
    out += ["",
            f"Figures over {prof.phase} routings (reuse: {prof.phase} lookups of a cache that runs through every phase).",
            "hot80 = fewest experts covering 80% of routed slots; gini over experts' slot counts (0 = uniform); unused = "
            "experts never routed; hottest/unif = the hottest expert's slots over uniform (slots / experts).",
            f"drift kept % = share of a {prof.drift['top_n'][0] if prof.drift.height else 2 * k}-expert top set kept from one "
            f"{prof.drift_window}-token window to the next; reused % = lookups whose (layer, expert) was looked up before (the infinite "
            "cache); 1 step % = reused from the step before; LRU@T % = LRU's hit % at one token's routing T.",
            "SRP/SCH: Liang et al., arXiv 2505.16056 (docs/profile.md): SRP = best F1 of predicting each segment's "
            "frequent experts for all its tokens; SCH@C = hit % of a C-expert cache per layer that evicts the expert "
            "least used in the next segment (an oracle, not a policy); first uses count as hits where the cache has "
            "room, as in the paper. H(next|e) = conditional entropy (bits) of the next layer's experts."]
    return "\n".join(out)


# -- plots ---------------------------------------------------------------------------------------


def _cdf_points(values: np.ndarray, counts: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The step points of the CDF the sorted per-lookup values draw (the i-th at 100 i / n %), from
    their histogram (distinct ``values`` ascending, ``counts``): each value's first and last lookup;
    the lookups between lie on the vertical joining them, so the curve is the same line."""
    counts = np.asarray(counts, dtype=np.int64)
    cum = np.cumsum(counts)
    two = counts > 1
    reps = np.where(two, 2, 1)
    at = np.cumsum(reps) - reps
    y = np.empty(int(reps.sum()), np.int64)
    y[at] = cum - counts + 1
    y[at[two] + 1] = cum[two]
    return np.repeat(values, reps), 100.0 * y / max(n, 1)


def write_plots(prof: Profile, out_dir: Path, pair_layer: int | None = None) -> list[tuple[str, str, str]]:
    """coverage.png, reuse_mib_cdf.png, reuse_steps_cdf.png, transitions_L{a}_L{b}.png (a = ``pair_layer``,
    default the layer pair whose next layer is most predictable: most bits of information), drift.png."""
    import matplotlib.pyplot as plt

    from replay.present import plots
    from traces.util.units import MIB

    out = []
    L, E = len(prof.moe_layers), prof.n_expert
    cmap = plt.get_cmap(plots.HEATMAP_CMAP)
    # coverage curves per layer
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    x = np.arange(1, E + 1)
    for li, curve in sorted(prof.coverage_curves.items()):
        ax.plot(x, curve, color=cmap(li / max(L - 1, 1)), lw=0.8, alpha=0.8)
    ax.plot(x, 100.0 * x / E, color="black", ls="--", lw=1, label="uniform routing")
    ax.set_xscale("log")
    ax.set_xlabel("hottest experts of the layer (N)")
    ax.set_ylabel(f"share of {prof.phase} routed slots (%)")
    ax.set_title("Coverage by the hottest N experts, one line per MoE layer (dark = first)")
    ax.legend(loc="lower right")
    out.append(plots.save(fig, out_dir / "coverage.png", "The higher and further left a layer's line, the fewer "
                          "experts carry its routing; the dashed line is uniform routing."))
    # reuse-distance CDFs
    # the CDFs of the phase's lookups, drawn from the distance histograms (nothing is kept per lookup)
    n = int(prof.reuse.filter(pl.col("layer").is_null())["lookups"][0]) if prof.reuse.height else 0
    dv, dc = prof.reuse_bytes_hist
    d, d_y = _cdf_points(dv / MIB, dc, n)
    s_counts = prof.reuse_steps_hist
    s, s_y = _cdf_points(np.flatnonzero(s_counts), s_counts[s_counts > 0], n)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    if n and d.size:
        ax.step(d, d_y, where="post", color=plots.OKABE_ITO[0], label="all layers")
    ax.axvline(prof.token_cycle_bytes / MIB, color=plots.OKABE_ITO[1], ls=":", label="T (one token's routing)")
    if prof.budget_mib is not None:
        ax.axvline(prof.budget_mib, color=plots.OKABE_ITO[3], ls="--", label=f"budget {plots.budget_label(prof.budget_mib)}")
    ax.set_xscale("log")
    ax.set_xlabel("load-aware reuse distance (MiB of distinct experts since the last use)")
    ax.set_ylabel(f"{prof.phase} lookups within it (%)")
    ax.set_title("Reuse distance in bytes (= LRU's hit % at that budget, overflow aside)")
    plots._legend(ax)
    out.append(plots.save(fig, out_dir / "reuse_mib_cdf.png", "Where the curve crosses the budget line is what LRU "
                          "hits there; the curve's top is the infinite cache."))
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    if n and s.size:
        ax.step(s, s_y, where="post", color=plots.OKABE_ITO[2], label="all layers")
    ax.set_xscale("log")
    ax.set_xlabel("steps since the layer last used the expert (one token per step for one request)")
    ax.set_ylabel(f"{prof.phase} lookups within it (%)")
    ax.set_title("Reuse distance in steps")
    plots._legend(ax)
    out.append(plots.save(fig, out_dir / "reuse_steps_cdf.png", "How soon a layer uses an expert again."))
    # cross-layer transitions
    if prof.transition_matrices:
        if pair_layer is None:
            t = prof.transitions.drop_nulls("info_bits")
            li = (prof.moe_layers.index(int(t.sort(["info_bits", "layer"], descending=[True, False])["layer"][0]))
                  if t.height else 0)
        else:
            li = prof.moe_layers.index(pair_layer)
        mat = prof.transition_matrices[li].astype(float)
        rs = mat.sum(axis=1, keepdims=True) / prof.top_k
        p = np.divide(100.0 * mat, rs, out=np.zeros_like(mat), where=rs > 0)
        a, b = prof.moe_layers[li], prof.moe_layers[li + 1]
        fig, ax = plt.subplots(figsize=(7.5, 6.5))
        im = ax.imshow(p, aspect="auto", interpolation="nearest", cmap=plots.HEATMAP_CMAP, vmin=0, vmax=100)
        ax.grid(False)
        ax.set_xlabel(f"expert e' at MoE layer {b}")
        ax.set_ylabel(f"expert e at MoE layer {a}")
        ax.set_title(f"P(e' at layer {b} | e at layer {a}), {prof.phase}")
        fig.colorbar(im, ax=ax, label="%")
        out.append(plots.save(fig, out_dir / f"transitions_L{a}_L{b}.png", "A bright cell: when this layer routes e, "
                              "the next routes e'; rows of experts never routed here stay dark."))
    # drift over tokens
    if prof.drift.height:
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        base = prof.drift.filter(pl.col("request") == prof.drift["request"][0]) if prof.has_request else prof.drift
        for li, layer in enumerate(prof.moe_layers):
            f = base.filter(pl.col("layer") == layer)
            ax.plot(f["window"].to_numpy(), f["kept_pct"].to_numpy(), color=cmap(li / max(L - 1, 1)), lw=0.6, alpha=0.6)
        mean = base.group_by("window").agg(pl.col("kept_pct").mean()).sort("window")
        ax.plot(mean["window"].to_numpy(), mean["kept_pct"].to_numpy(), color="black", lw=2, label="mean over layers")
        ax.set_ylim(0, 100)
        ax.set_xlabel(f"window ({prof.drift_window} tokens each)" + (" of the first request" if prof.has_request else ""))
        ax.set_ylabel("top set kept from the window before (%)")
        ax.set_title(f"Popularity drift: top-{int(prof.drift['top_n'][0])} experts kept, per MoE layer")
        plots._legend(ax)
        out.append(plots.save(fig, out_dir / "drift.png", "High: the hot experts stay hot (a pin list holds); low: "
                              "they move (recency does better)."))
    return out

