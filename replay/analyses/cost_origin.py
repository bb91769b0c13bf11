"""Where a fitted cost model came from, and whether it may be applied to a trace (docs/design.md,
"Cost model").

A fitted model's coefficients are one device's time for one model's bytes: applied to another
model (other expert sizes) or another engine or device they give plausible-looking times that
measure nothing. So a fitted model records its ``origin`` (the model, arch, per-layer expert
bytes, the engine and device fields of the trace's provenance, the trace's content hash), and
applying it to a trace whose model or device differs is refused unless the caller says
``foreign`` (``--foreign-cost-model``, ``foreign_cost_model=True``); then the applied model is a
copy marked ``foreign`` and every time figure computed from it carries the mark. A fitted model
with no origin (a file written before origins were recorded) is treated as foreign: refused
unless foreign is allowed. A manual model is an assumption about no particular trace: it applies
anywhere and is never marked.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from traces.format.errors import UserError

FOREIGN_HOW = "pass --foreign-cost-model to apply it anyway, every time figure then marked"
# Fields compared between the model's origin and the trace: any difference is another model or
# device. ``engine_version`` and ``device`` count only where both sides record one.
COMPARED = ("model", "arch", "expert_bytes", "engine")
COMPARED_IF_BOTH = ("engine_version", "device")


def trace_origin(trace: Any, content_id: str | None = None) -> dict[str, Any]:
    """What a model fitted on ``trace`` was fitted on. ``content_id``: the trace's content hash
    (computed here when not given: sha256 over every file of the trace directory)."""
    prov = dict(trace.meta.get("provenance") or {})
    rec = trace.recorded
    if content_id is None:
        from traces.io.digest import trace_content_id

        content_id = "sha256:" + trace_content_id(trace.path)
    return {
        "model": trace.model.get("name"), "arch": trace.model.get("arch"),
        "expert_bytes": [int(b) for b in trace.expert_bytes.tolist()],
        "engine": prov.get("engine"), "engine_version": prov.get("engine_version"),
        "device": prov.get("device") or rec.get("device"),
        "trace_content_sha256": content_id,
    }


def _differences(origin: dict[str, Any], here: dict[str, Any]) -> list[str]:
    out = []
    for k in COMPARED:
        if origin.get(k) != here.get(k):
            out.append(k)
    for k in COMPARED_IF_BOTH:
        if origin.get(k) is not None and here.get(k) is not None and origin[k] != here[k]:
            out.append(k)
    return out


def _said(o: dict[str, Any]) -> str:
    bits = [str(o.get("model")), str(o.get("arch"))]
    if o.get("engine"):
        bits.append(f"engine {o['engine']}" + (f" {o['engine_version']}" if o.get("engine_version") else ""))
    if o.get("device"):
        bits.append(f"device {o['device']}")
    return ", ".join(bits)


def apply_to(model: Any, trace: Any, *, foreign: bool = False) -> Any:
    """``model`` as it may be applied to ``trace``: itself when it was fitted on the same model and
    device (or is manual); a copy marked ``foreign`` when it was not (or records no origin) and
    ``foreign`` is allowed; otherwise a :class:`UserError` in one sentence."""
    if model is None or model.kind == "manual" or model.foreign:  # foreign: already applied with leave
        return model
    from replay.analyses.cost_sense import model_name

    name = model_name(model)
    if model.origin is None:
        if not foreign:
            raise UserError(f"{name}: the cost model records no origin (it predates moe-replay recording what a model was "
                            f"fitted on), so nothing says it fits {trace.path}; refit it with 'moe-replay cost fit --json', or "
                            f"{FOREIGN_HOW}.")
        return dataclasses.replace(model, foreign=True)
    here = trace_origin(trace, content_id="-")
    diff = _differences(model.origin, here)
    if not diff:
        return model
    if not foreign:
        raise UserError(f"{name}: the cost model was fitted on {_said(model.origin)} but {trace.path} is {_said(here)} "
                        f"(differs in {', '.join(d.replace('_', ' ') for d in diff)}): its times would be another model's or "
                        f"device's; {FOREIGN_HOW}.")
    return dataclasses.replace(model, foreign=True)
