"""``info``: what a trace holds, in one flat row (docs/design.md keys) and as text."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from traces.format.errors import UserError
from traces.util.units import MIB

if TYPE_CHECKING:
    from traces.io.reader import Trace



def require_routings(trace: Trace, what: str) -> None:
    """Refuse, in one sentence, a trace that holds no routing at all (nothing any verb can replay)."""
    if trace.n_rows == 0:
        why = " (trace.json says the capture did not complete)" if not trace.complete else ""
        raise UserError(f"{trace.path}: holds no routings{why}, so there is nothing to {what}.")


def batch_sizes(trace: Trace) -> dict[str, Any]:
    """Tokens per engine batch, by phase: ``batches_decode``/``batches_prefill`` and the
    ``{decode,prefill}_batch_tokens_{min,median,max}`` (None without such batches). A token is a
    distinct (request, turn, step); one decode token per batch unless many requests share one."""
    import polars as pl

    key = (["request"] if trace.has("request") else []) + ["turn", "step"]
    sizes = trace.distinct(["batch", "phase", *key]).group_by("batch", "phase").len()
    out: dict[str, Any] = {}
    for code, name in ((1, "decode"), (0, "prefill")):
        n = sizes.filter(pl.col("phase") == code)["len"]
        out[f"batches_{name}"] = int(n.len())
        out[f"{name}_batch_tokens_min"] = int(n.min()) if n.len() else None  # type: ignore[arg-type]
        out[f"{name}_batch_tokens_median"] = float(n.median()) if n.len() else None  # type: ignore[arg-type]
        out[f"{name}_batch_tokens_max"] = int(n.max()) if n.len() else None  # type: ignore[arg-type]
    return out


def info_rows(trace: Trace) -> list[dict[str, Any]]:
    """One flat row describing the trace. Token counts are distinct (request, turn, step) per
    phase; ``requests`` is the number of requests (1 for a trace without a request column)."""
    from traces.format.completeness import compact_ranges

    m = trace.model
    counts = trace.token_counts()
    per_turn = (
        trace.distinct(["turn", "phase", "step"]).group_by("turn", "phase").len().sort("turn", "phase")
    )
    if trace.has("request"):
        n_requests = trace.distinct(["request"]).height
    else:
        n_requests = 1 if trace.n_rows else 0
    prov = trace.meta.get("provenance", {})
    eb = [int(trace.expert_bytes[l]) for l in trace.moe_layers]
    from traces.format.completeness import of_trace

    # Measured from the rows, not taken from trace.json: a log that lost some (token, layer)
    # routings is not complete, whatever its writer said (docs/design.md, "Completeness").
    gaps = of_trace(trace)
    row: dict[str, Any] = {
        "model": m["name"],
        "arch": m["arch"],
        "n_layer": m["n_layer"],
        "moe_layers": len(trace.moe_layers),
        "n_expert": m["n_expert"],
        "top_k": m["top_k"],
        "top_k_native": m.get("top_k_native"),
        "n_embd": m.get("n_embd"),
        **counts,
        "turns": int(per_turn["turn"].n_unique()) if per_turn.height else 0,
        "rows": trace.n_rows,
        "complete": trace.complete and gaps["routings_missing"] == 0,
        "has_logits": trace.has("logits"),
        "has_gate_input": trace.has("gate_input"),
        "has_router": trace.has_router,
        "has_residency": trace.has("residency"),
        "has_read_bytes": trace.has("read_bytes"),
        "has_dropped": trace.has("dropped"),
        "has_metrics": trace.has_metrics,
        "has_request": trace.has("request"),
        "has_token": trace.has("token"),
        "requests": n_requests,
        **batch_sizes(trace),
        "expert_bytes_min": min(eb),
        "expert_bytes_max": max(eb),
        "token_cycle_mib": trace.token_cycle_bytes / MIB,
        "activation": trace.gating.get("activation"),
        "recorded_budget_mib": trace.recorded.get("budget_mib"),
        "recorded_hit_pct_cum": trace.recorded.get("cache_hit_pct_cum"),
        "engine": prov.get("engine"),
        "source": prov.get("source_file"),
        # MoE layers of the model the log does not hold (an import of some layers only), as ranges
        # ("0-2, 5"; null when none): every figure covers the layers the trace has, nothing is
        # extrapolated to the others. A string, so the row stays flat (JSON, CSV tables).
        "moe_layers_absent": compact_ranges(m["moe_layers_absent"]) if m.get("moe_layers_absent") else None,
    }
    # Bytes a one-budget `cache` replay holds beyond the program itself (an estimate from the
    # metadata: replay.core.streaming.stream_memory_bytes), in memory and streamed part by part.
    from replay.core.streaming import stream_memory_bytes

    mem = stream_memory_bytes(trace)
    row["cache_memory_mib_in_memory"] = mem["in_memory"] / MIB
    row["cache_memory_mib_streamed"] = mem["streamed"] / MIB
    row["capture_complete"] = trace.complete
    row.update(gaps)
    # Engine warm-up rows (a profiling or dummy pass) still in the trace: docs/design.md, "Warm-up rows".
    runs = warmup_runs(trace)
    row["warmup_tokens"] = sum(r["tokens"] for r in runs)
    from traces.format.warmup import describe

    row["warmup_at"] = describe(runs, label="trace rows") if runs else None
    return [row]


def warmup_runs(trace: Trace) -> list[dict[str, Any]]:
    """:func:`traces.format.warmup.find_runs` over a trace's rows (rows numbered in trace order)."""
    from traces.format.warmup import find_runs
    from traces.io.reader import fixed_list_to_numpy

    cols = ["turn", "step", "layer", "experts", "weights"] + (["request"] if trace.has("request") else [])
    t = trace.table(cols)
    runs, _ = find_runs(turn=t.column("turn").to_numpy(), step=t.column("step").to_numpy(),
                        layer=t.column("layer").to_numpy(), experts=fixed_list_to_numpy(t.column("experts")),
                        weights=fixed_list_to_numpy(t.column("weights")),
                        request=t.column("request").to_numpy() if trace.has("request") else None,
                        moe_layers=len(trace.moe_layers))
    return runs


def prov_notes(trace: Trace) -> list[str]:
    """What an importer inferred (token order, batches, phase), as trace.json's provenance says."""
    notes = trace.meta.get("provenance", {}).get("notes")
    return [str(n) for n in notes] if isinstance(notes, list) else []
