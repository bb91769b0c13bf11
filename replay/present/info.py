"""``info``'s text: what a trace holds, from :func:`replay.analyses.info.info_rows`'s row."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from replay.analyses.info import prov_notes
from replay.core.notes import NO_DECODE

if TYPE_CHECKING:
    from traces.io.reader import Trace


def info_text(trace: Trace, row: dict[str, Any]) -> str:
    from replay.core.streaming import AUTO_STREAM_MIB

    opt = [c for c in ("logits", "gate_input", "residency", "read_bytes", "dropped", "request", "token") if trace.has(c)]
    native = row["top_k_native"]
    eb = sorted({int(trace.expert_bytes[l]) for l in trace.moe_layers})
    eb_txt = ", ".join(f"{b:,}" for b in eb[:6]) + (" ..." if len(eb) > 6 else "")
    lines = [
        f"trace      {trace.path}",
        f"model      {row['model']} (arch {row['arch']})",
        f"layers     {row['n_layer']} ({row['moe_layers']} MoE), {row['n_expert']} experts, "
        f"top-k {row['top_k']} effective / {native if native is not None else 'unknown'} native, "
        f"n_embd {row['n_embd'] if row['n_embd'] else 'unknown'}",
        f"tokens     {row['tokens_prefill']} prefill + {row['tokens_decode']} decode in {row['turns']} turn(s)"
        + (f" of {row['requests']:,} requests" if row["has_request"] else "") + f"; {row['rows']:,} routings",
        f"batches    {_batches_text(row)}",
        f"columns    {', '.join(opt) if opt else 'routing only (experts, weights)'}"
        + ("; router.parquet" if row["has_router"] else "") + ("; metrics.parquet" if row["has_metrics"] else ""),
        f"expert     bytes of one expert per layer: {eb_txt}",
        f"T          one token cycle (sum over MoE layers of top_k x expert_bytes) = {row['token_cycle_mib']:.1f} MiB",
        f"memory     a cache replay at one budget holds about {row['cache_memory_mib_in_memory']:,.0f} MiB (the cache verb, "
        f"in memory); {row['cache_memory_mib_streamed']:,.0f} MiB streamed part by part (cache --stream on)"
        + f"; estimates, beyond the program itself; cache --stream auto (the default) streams above {AUTO_STREAM_MIB:,} MiB "
        "in memory or a quarter of the memory available when it runs",
        f"complete   {_complete_text(row)}",
        f"source     {row['engine'] or 'unknown engine'}" + (f", {row['source']}" if row["source"] else ""),
    ]
    if row["rows"] == 0:
        lines.append("note       the trace holds no routings: every other verb has nothing to replay")
    elif row["tokens_decode"] == 0:
        lines.append(f"note       {NO_DECODE}")
    if row["moe_layers_absent"]:
        lines.append(f"absent     MoE layers {row['moe_layers_absent']} of the model are not in the log; "
                     "every figure covers only the layers the trace has")
    if row.get("warmup_tokens"):
        lines.append(f"warm-up    {row['warmup_tokens']:,} token(s) look like an engine's warm-up (profiling or dummy) "
                     f"pass: {row['warmup_at']}; they are replayed as routing (re-import with --drop-warmup to "
                     "leave them out)")
    for n in prov_notes(trace):
        lines.append(f"import     {n}")
    if row["recorded_budget_mib"] is not None:
        lines.append(
            f"recorded   engine cache budget {row['recorded_budget_mib']} MiB, "
            + (f"cumulative hit {row['recorded_hit_pct_cum']}% (prefill included)" if row["recorded_hit_pct_cum"] is not None
               else "no recorded hit rate")
        )
    return "\n".join(lines)


def _complete_text(row: dict[str, Any]) -> str:
    """'yes', or why not: the capture was interrupted, or routings are missing (both when both)."""
    from traces.format.completeness import sentence

    if row["complete"]:
        return "yes"
    why = [] if row.get("capture_complete", True) else ["capture was interrupted; the trace holds what was written"]
    missing = sentence(row, row["moe_layers"])
    if missing:
        why.append(missing)
    return "NO: " + "; ".join(why)


def _batches_text(row: dict[str, Any]) -> str:
    """Tokens per batch, decode and prefill: 'decode 120 batches of 1 token', or min/median/max."""
    parts = []
    for name in ("decode", "prefill"):
        n = row[f"batches_{name}"]
        if not n:
            continue
        lo, med, hi = row[f"{name}_batch_tokens_min"], row[f"{name}_batch_tokens_median"], row[f"{name}_batch_tokens_max"]
        size = f"{lo} token{'s' if lo != 1 else ''}" if lo == hi else f"{lo} / {med:g} / {hi} tokens (min / median / max)"
        parts.append(f"{name} {n:,} batch{'es' if n != 1 else ''} of {size}")
    return "; ".join(parts) if parts else "none"
