"""``info``: what a trace holds, in one flat row (DESIGN.md keys) and as text."""

from __future__ import annotations

from typing import Any

from traces.errors import UserError
from traces.reader import Trace
from traces.units import MIB

NO_DECODE = ("the trace has no decoded tokens (prefill only: a prompt-only run or a capture stopped during the prompt), "
             "so decode-only figures are null ('-'); the cumulative ones cover the prefill")


def require_routings(trace: Trace, what: str) -> None:
    """Refuse, in one sentence, a trace that holds no routing at all (nothing any verb can replay)."""
    if trace.n_rows == 0:
        why = " (trace.json says the capture did not complete)" if not trace.complete else ""
        raise UserError(f"{trace.path}: holds no routings{why}, so there is nothing to {what}.")


def info_rows(trace: Trace) -> list[dict[str, Any]]:
    """One flat row describing the trace. Token counts are distinct (turn, step) per phase."""
    m = trace.model
    counts = trace.token_counts()
    per_turn = (
        trace.routings(["turn", "phase", "step"]).unique().group_by("turn", "phase").len().sort("turn", "phase")
    )
    prov = trace.meta.get("provenance", {})
    eb = [int(trace.expert_bytes[l]) for l in trace.moe_layers]
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
        "complete": trace.complete,
        "has_logits": trace.has("logits"),
        "has_gate_input": trace.has("gate_input"),
        "has_router": trace.has_router,
        "has_residency": trace.has("residency"),
        "has_read_bytes": trace.has("read_bytes"),
        "has_dropped": trace.has("dropped"),
        "has_metrics": trace.has_metrics,
        "expert_bytes_min": min(eb),
        "expert_bytes_max": max(eb),
        "token_cycle_mib": trace.token_cycle_bytes / MIB,
        "activation": trace.gating.get("activation"),
        "recorded_budget_mib": trace.recorded.get("budget_mib"),
        "recorded_hit_pct_cum": trace.recorded.get("cache_hit_pct_cum"),
        "engine": prov.get("engine"),
        "source": prov.get("source_file"),
    }
    return [row]


