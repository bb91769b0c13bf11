"""Trace format (version 2; version 1 still read): ``trace.json``'s contract and the routing
columns' types, in plain Python.

Two views of the same routings: the *logical* columns (:func:`routing_fields`: ``experts``,
``weights`` and the recorded per-slot columns as ``[rows, top_k]`` lists, ``logits`` and
``gate_input`` as ``[rows, width]`` lists) that every reader hands out, whatever the version; and
how version 2 stores them (:func:`part_fields`: one primitive Parquet column per slot,
``expert_0 .. expert_{k-1}``; :func:`wide_fields`: the wide lists in Arrow IPC files beside each
part, read memory-mapped). Version 1 stored the logical columns as they are, in Parquet.
:mod:`traces.format.schema` builds the Arrow schemas and re-exports the rest; ``docs/format.md`` is the
format's description.
"""

from __future__ import annotations

import math
from typing import Any

from traces.util.units import MAX_BUDGET_MIB, PHASE_DECODE, PHASE_PREFILL  # noqa: F401 (re-exported: they live in traces.util.units)

FORMAT = "moe-route-trace"
VERSION = 2  # what the writer writes
READ_VERSIONS = (1, 2)  # what the reader reads (tests/fixtures/v1 holds version 1 traces)
TRACE_JSON = "trace.json"
ROUTINGS_DIR = "routings"
ROUTER_FILE = "router.parquet"
METRICS_FILE = "metrics.parquet"

PHASE_NAMES = {PHASE_PREFILL: "prefill", PHASE_DECODE: "decode"}

# Residency codes recorded by an engine's cache (column ``residency``).
RES_MISS, RES_HIT, RES_HIT_SPEC = 0, 1, 2

ACTIVATIONS = ("softmax", "sigmoid", "softmax_weight")

# Column names (their Arrow types: :func:`routing_fields`, and :mod:`traces.format.schema`'s dicts).
KEY_NAMES = ("turn", "batch", "phase", "step", "layer")  # narrow per-row columns: always present, always loaded
RECORDED_NAMES = ("residency", "read_bytes", "dropped")  # optional per-slot columns recorded by an engine (width top_k)
WIDE_COLUMNS = ("logits", "gate_input")  # optional wide columns: never loaded unless asked for
REQUEST_NAMES = ("request", "token")  # optional per-row scalars of server engines (see traces.format.schema)
OPTIONAL_COLUMNS = RECORDED_NAMES + WIDE_COLUMNS + REQUEST_NAMES

# Arrow types as plain tuples: ("int", bits, signed), ("float", bits), ("bool",), and
# ("fixed_size_list", size, item type) for a list whose items are nullable (Arrow's default item field).
KEY_TYPES = {"turn": ("int", 32, True), "batch": ("int", 32, True), "phase": ("int", 8, True),
             "step": ("int", 32, True), "layer": ("int", 16, True)}
RECORDED_TYPES = {"residency": ("int", 8, False), "read_bytes": ("int", 32, False), "dropped": ("bool",)}
REQUEST_TYPES = {"request": ("int", 64, True), "token": ("int", 32, True)}


def routing_fields(meta: dict[str, Any], columns: tuple[str, ...] = (), gate_input_dtype: str = "float32") -> list[tuple[str, tuple]]:
    """(name, type) of every ``routings/`` column, in order, for a trace with metadata ``meta`` and
    optional ``columns`` (every field non-nullable). :func:`traces.format.schema.routings_schema` is the
    same list as an Arrow schema."""
    model = meta["model"]
    k, n_expert, n_embd = model["top_k"], model["n_expert"], model["n_embd"]
    fields: list[tuple[str, tuple]] = list(KEY_TYPES.items())
    fields.append(("experts", ("fixed_size_list", k, ("int", 32, True))))
    fields.append(("weights", ("fixed_size_list", k, ("float", 32))))
    for name in columns:
        if name in RECORDED_TYPES:
            fields.append((name, ("fixed_size_list", k, RECORDED_TYPES[name])))
        elif name in REQUEST_TYPES:
            fields.append((name, REQUEST_TYPES[name]))
        elif name == "logits":
            fields.append((name, ("fixed_size_list", n_expert, ("float", 32))))
        elif name == "gate_input":
            if not n_embd:
                raise ValueError("gate_input needs model.n_embd")
            fields.append((name, ("fixed_size_list", n_embd, {"float32": ("float", 32), "float16": ("float", 16)}[gate_input_dtype])))
        else:
            raise ValueError(f"unknown optional column {name!r}")
    return fields


# Version 2: the stem of each per-slot column's Parquet columns (``expert_0``, ``weight_0``, ...).
SLOT_STEMS = {"experts": "expert", "weights": "weight", "residency": "residency", "read_bytes": "read_bytes",
              "dropped": "dropped"}


def slot_names(column: str, k: int) -> list[str]:
    """Version 2's Parquet columns of the logical per-slot column ``column`` (``experts`` ->
    ``expert_0 .. expert_{k-1}``)."""
    return [f"{SLOT_STEMS[column]}_{j}" for j in range(k)]


def part_fields(meta: dict[str, Any], columns: tuple[str, ...] = ()) -> list[tuple[str, tuple]]:
    """(name, type) of every column of a version 2 ``routings/part-NNNNN.parquet``, in order: the
    key scalars, ``expert_0..``, ``weight_0..``, then per optional column either its slots
    (``residency_0..``) or the scalar itself (``request``, ``token``); the wide columns are not in
    the Parquet part (:func:`wide_fields`)."""
    k = meta["model"]["top_k"]
    fields: list[tuple[str, tuple]] = []
    for name, t in routing_fields(meta, tuple(c for c in columns if c not in WIDE_COLUMNS)):
        if t[0] == "fixed_size_list":
            fields += [(s, t[2]) for s in slot_names(name, k)]
        else:
            fields.append((name, t))
    return fields


def wide_fields(meta: dict[str, Any], columns: tuple[str, ...] = (), gate_input_dtype: str = "float32") -> list[tuple[str, tuple]]:
    """(name, type) of each wide column a version 2 trace stores in ``part-NNNNN.<name>.arrow`` (an
    Arrow IPC file of one non-null column of that fixed_size_list type, one row per routing)."""
    wide = tuple(c for c in columns if c in WIDE_COLUMNS)
    return [(n, t) for n, t in routing_fields(meta, wide, gate_input_dtype) if n in wide]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# Upper bounds that keep every size inside the column types and int64 arithmetic: a layer index is
# int16, expert ids and steps int32; one expert (or one layer's dense weights) above 1 TiB is not a
# real model but a typo, and its bytes times k times the layers must still fit an int64.
MAX_LAYERS = 1 << 15
MAX_INT32 = (1 << 31) - 1
MAX_BYTES = 1 << 40
# Largest cache budget: traces.util.units.MAX_BUDGET_MIB (2^40 MiB, 1 EiB), beside the one budget parser.


def _recorded_problems(rec: Any) -> list[str]:
    """Problems with trace.json's optional ``recorded`` block (what the engine said about its run)."""
    if rec is None:
        return []
    if not isinstance(rec, dict):
        return ["'recorded' is not an object or null"]
    budget = rec.get("budget_mib")
    if budget is not None and not (_is_num(budget) and 0 < budget <= MAX_BUDGET_MIB):
        return [f"recorded.budget_mib {budget!r} is not null or a positive number of MiB"]
    hit = rec.get("cache_hit_pct_cum")
    if hit is not None and not (_is_num(hit) and 0 <= hit <= 100):
        return [f"recorded.cache_hit_pct_cum {hit!r} is not null or a percentage in 0..100"]
    policy = rec.get("policy")
    if policy is not None and not isinstance(policy, str):
        return [f"recorded.policy {policy!r} is not null or a string"]
    summary = rec.get("summary")
    if summary is not None and not isinstance(summary, dict):
        return ["recorded.summary is not an object or null"]
    return []


def validate_meta(meta: Any, where: str) -> list[str]:
    """Return the problems with a ``trace.json`` object (empty when it is valid).

    Each problem is a phrase; the reader reports the first one with the file name.
    """
    if not isinstance(meta, dict):
        return ["is not a JSON object"]
    if meta.get("format") != FORMAT:
        return [f"is not a moe-route-trace (format is {meta.get('format')!r})"]
    version = meta.get("version")
    if not _is_int(version) or version not in READ_VERSIONS:
        return [f"has schema version {version!r}; this tool reads versions {' and '.join(map(str, READ_VERSIONS))}"]
    problems: list[str] = []
    if not isinstance(meta.get("complete"), bool):
        problems.append("has no boolean 'complete'")
    model = meta.get("model")
    if not isinstance(model, dict):
        return problems + ["has no 'model' object"]
    for key in ("name", "arch"):
        if not isinstance(model.get(key), str):
            problems.append(f"model.{key} is missing or not a string")
    for key in ("n_layer", "n_expert", "top_k"):
        if not _is_int(model.get(key)) or model[key] <= 0:
            problems.append(f"model.{key} is missing or not a positive integer")
    if problems:
        return problems
    if model["n_layer"] > MAX_LAYERS:
        problems.append(f"model.n_layer {model['n_layer']} exceeds {MAX_LAYERS} (layer indices are int16)")
    if model["n_expert"] > MAX_INT32:
        problems.append(f"model.n_expert {model['n_expert']} exceeds {MAX_INT32} (expert ids are int32)")
    if problems:
        return problems
    n_layer, n_expert, k = model["n_layer"], model["n_expert"], model["top_k"]
    if k > n_expert:
        problems.append(f"model.top_k ({k}) exceeds model.n_expert ({n_expert})")
    native = model.get("top_k_native")
    if native is not None and (not _is_int(native) or not 0 < native <= n_expert):
        problems.append("model.top_k_native is not null or an integer in 1..n_expert")
    n_embd = model.get("n_embd")
    if n_embd is not None and (not _is_int(n_embd) or not 0 < n_embd <= MAX_INT32):
        problems.append("model.n_embd is not null or a positive integer (at most 2^31-1)")
    moe = model.get("moe_layers")
    if not isinstance(moe, list) or not moe or not all(_is_int(x) for x in moe):
        return problems + ["model.moe_layers is missing or not a non-empty list of integers"]
    if sorted(set(moe)) != moe or moe[0] < 0 or moe[-1] >= n_layer:
        problems.append(f"model.moe_layers must be strictly increasing layer indices in 0..{n_layer - 1}")
    for key in ("expert_bytes", "dense_bytes"):
        arr = meta.get(key)
        if not isinstance(arr, list) or len(arr) != n_layer:
            problems.append(f"'{key}' must be a list of {n_layer} entries (one per layer)")
            continue
        for i, v in enumerate(arr):
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_BYTES):
                problems.append(f"{key}[{i}] is not null or a byte count in 0..2^40")
                break
    if not problems:
        # A missing expert size must never default to 0: a layer that costs nothing is admitted
        # free and never evicted, and the replay reports ~100% hit for it -- a wrong answer
        # wearing the costume of a good one.
        for layer in moe:
            eb = meta["expert_bytes"][layer]
            if not _is_int(eb) or eb <= 0:
                problems.append(f"expert_bytes for MoE layer {layer} is missing or not > 0")
                break
    gating = meta.get("gating")
    if not isinstance(gating, dict):
        problems.append("has no 'gating' object")
    else:
        act = gating.get("activation")
        if act is not None and act not in ACTIVATIONS:
            problems.append(f"gating.activation {act!r} is not one of {', '.join(ACTIVATIONS)} or null")
        for key in ("selection_bias", "norm_topk"):
            v = gating.get(key)
            if v is not None and not isinstance(v, bool):
                problems.append(f"gating.{key} is not a boolean or null")
        for key in ("n_group", "topk_group"):
            v = gating.get(key, 1)
            if not _is_int(v) or v <= 0:
                problems.append(f"gating.{key} is not a positive integer")
        ng, tg = gating.get("n_group", 1), gating.get("topk_group", 1)
        if _is_int(ng) and _is_int(tg) and ng > 1 and (n_expert % ng or tg > ng):
            problems.append(f"gating.n_group {ng} does not divide n_expert {n_expert} or topk_group {tg} > n_group")
        scale = gating.get("scale", 1.0)
        if not _is_num(scale) or scale < 0:
            problems.append("gating.scale is not a non-negative finite number")
    if not isinstance(meta.get("provenance"), dict):
        problems.append("has no 'provenance' object")
    cols = meta.get("columns", [])
    if not isinstance(cols, list) or any(c not in OPTIONAL_COLUMNS for c in cols):
        problems.append(f"'columns' must list optional columns among {', '.join(OPTIONAL_COLUMNS)}")
    elif "gate_input" in cols and not n_embd:
        problems.append("lists a gate_input column but model.n_embd is null")
    if meta.get("gate_input_dtype", "float32") not in ("float32", "float16"):
        problems.append(f"gate_input_dtype {meta.get('gate_input_dtype')!r} is not float32 or float16")
    rows = meta.get("rows")
    if rows is not None and (not _is_int(rows) or rows < 0):
        problems.append(f"'rows' {rows!r} is not a non-negative integer")
    problems += _recorded_problems(meta.get("recorded"))
    return problems


def default_gating(activation: str | None = None, norm_topk: bool | None = None) -> dict[str, Any]:
    """Gating metadata for an architecture with no selection bias and no expert groups."""
    return {
        "activation": activation,
        "norm_topk": norm_topk,
        "selection_bias": False,
        "n_group": 1,
        "topk_group": 1,
        "scale": 1.0,
    }
