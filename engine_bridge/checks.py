"""Self-checks run on every capture, from the trace as written (so they check what a reader sees).

1. ``topk_of_logits``: the architecture's selection rule (:func:`traces.format.gating.select`) applied to
   the captured logits picks exactly the captured ids, in rank order; the captured weights agree
   with the rule's weights. A routing that differs only among exactly tied selection scores
   (``ties``: bf16 / f16 logits tie often, and the rule's lower-id choice is a convention)
   passes. Fails if the hook read the wrong node, the wrong rows or misread the gating.
2. ``fresh_gate``: the router matrix stored in router.parquet applied to the captured gate input
   reproduces the captured logits (relative tolerance) and the captured routing. This is the
   ``ctrl`` predictor's 100% in miniature; it fails if gate inputs or router matrices are wrong.

The engine rounds the router input to the weight's dot-product type before the matmul (F16
weights: the input is converted to f16; quantized weights: to Q8_0 / Q8_K blocks). Recomputing
in f32 without that rounding gives ~1e-3 logit error and flips near-ties, so it is emulated here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from traces.format.gating import select, selection_scores
from traces.io.reader import fixed_list_to_numpy, open_trace
from traces.util.rounding import round_input


def run_checks(trace_dir: str | Path, logit_bias: dict[int, np.ndarray] | None = None, rel_tol: float = 1e-4,
               output_rounding: str | None = None) -> dict[str, Any]:
    """Both checks over the whole trace, streamed one part file at a time. ``output_rounding``
    (bf16 / f16): the engine returns its logits in that type, so check 2 rounds the recomputed
    logits the same way before selecting, and exact ties count as in check 1."""
    t = open_trace(trace_dir, check_rows=False)
    gating, k = t.gating, t.top_k
    has_logits, has_gate = t.has("logits"), t.has("gate_input")
    routers = t.router_matrices()  # also the selection bias for check 1
    rounding = t.meta.get("router_input_rounding", "none")
    logit_bias = logit_bias or {}
    cols = ["layer", "experts", "weights"] + (["logits"] if has_logits else []) + (["gate_input"] if has_gate else [])
    a = {"rows": 0, "agree": 0, "weights_max_abs_err": 0.0}
    b = {"rows": 0, "agree": 0, "max_rel_logit_err": 0.0, "max_abs_logit_err": 0.0}
    for table in t.iter_tables(cols):
        layer = table.column("layer").to_numpy()
        experts = fixed_list_to_numpy(table.column("experts"))
        weights = fixed_list_to_numpy(table.column("weights"))
        logits = fixed_list_to_numpy(table.column("logits")) if has_logits else None
        gate = fixed_list_to_numpy(table.column("gate_input")) if has_gate else None
        for l in np.unique(layer):
            idx = np.flatnonzero(layer == l)
            ex = experts[idx]
            bias = routers[int(l)][1] if int(l) in routers else None
            if logits is not None:
                ids, w = select(logits[idx], gating, k, bias)
                a["rows"] += idx.size
                a["agree"] += int((ids == ex).all(axis=1).sum())
                same = (ids == ex).all(axis=1)
                if not same.all():
                    a["ties"] = a.get("ties", 0) + _tied(logits[idx][~same], ex[~same], ids[~same], gating, bias)
                if same.any():
                    err = float(np.abs(w[same] - weights[idx][same]).max())
                    a["weights_max_abs_err"] = max(a["weights_max_abs_err"], err)
            if gate is not None and int(l) in routers:
                W, sel_bias = routers[int(l)]
                x = round_input(gate[idx].astype(np.float32), rounding)
                fresh = x.astype(np.float64) @ W.astype(np.float64).T
                if int(l) in logit_bias:
                    fresh = fresh + logit_bias[int(l)].astype(np.float64)[None, :]
                if logits is not None:
                    ref = logits[idx].astype(np.float64)
                    diff = np.abs(fresh - ref)
                    scale = np.maximum(np.abs(ref).max(axis=1, keepdims=True), 1e-6)
                    b["max_abs_logit_err"] = max(b["max_abs_logit_err"], float(diff.max()))
                    b["max_rel_logit_err"] = max(b["max_rel_logit_err"], float((diff / scale).max()))
                if output_rounding:
                    fresh = round_input(fresh.astype(np.float32), output_rounding).astype(np.float64)
                ids, _ = select(fresh, gating, k, sel_bias)
                b["rows"] += idx.size
                same = (ids == ex).all(axis=1)
                b["agree"] += int(same.sum())
                if output_rounding and not same.all():
                    b["ties"] = b.get("ties", 0) + _tied(fresh[~same], ex[~same], ids[~same], gating, sel_bias)
    out: dict[str, Any] = {}
    if has_logits:
        out["topk_of_logits"] = _finish(a)
    else:
        out["topk_of_logits"] = {"skipped": "no logits column (--no-logits)"}
    if has_gate and routers:
        fin = _finish(b)
        fin["input_rounding"] = rounding
        if has_logits:
            fin["logits_within_tol"] = bool(fin["max_rel_logit_err"] <= rel_tol)
            fin["rel_tol"] = rel_tol
        else:
            fin.pop("max_rel_logit_err")
            fin.pop("max_abs_logit_err")
        out["fresh_gate"] = fin
    else:
        out["fresh_gate"] = {"skipped": "no gate_input column (--no-gate-input)" if not has_gate else "no router.parquet"}
    return out


def _tied(logits: np.ndarray, got: np.ndarray, rule: np.ndarray, gating: dict[str, Any], bias: np.ndarray | None) -> int:
    """Rows whose captured ids differ from the rule's only among exactly tied selection scores: the
    captured set holds every id scoring above the rule's k-th value and only ids scoring at least
    it (bf16 / f16 logits tie often; the rule sends a tie to the lower id, an engine may not)."""
    sel = selection_scores(logits, gating, bias)
    kth = np.take_along_axis(sel, rule[:, -1:].astype(np.int64), axis=1)
    s_got = np.take_along_axis(sel, got.astype(np.int64), axis=1)
    above = (sel > kth).sum(axis=1)
    ok = (s_got >= kth).all(axis=1) & ((s_got > kth).sum(axis=1) == above)
    return int(ok.sum())


def _finish(d: dict[str, Any]) -> dict[str, Any]:
    d = dict(d)
    d["agree_pct"] = 100.0 * d["agree"] / d["rows"] if d["rows"] else None
    return d


def checks_passed(checks: dict[str, Any]) -> bool:
    """True when every check that ran agreed on every row (and logits, and weights where judged, were within tolerance)."""
    ok = True
    for c in checks.values():
        if not isinstance(c, dict) or "skipped" in c:
            continue
        ok &= (c["rows"] > 0 and c["agree"] + c.get("ties", 0) == c["rows"] and c.get("logits_within_tol", True)
               and c.get("weights_within_tol", True))
    return bool(ok)


def summary_line(checks: dict[str, Any]) -> str:
    """One line for the terminal: what each check compared and how many routings agreed."""
    parts = []
    a = checks.get("topk_of_logits", {})
    if "skipped" in a:
        parts.append(f"ids = top-k(logits): skipped ({a['skipped']})")
    else:
        tie = f" + {a['ties']} exact ties broken the other way" if a.get("ties") else ""
        parts.append(f"ids = top-k(logits) {a['agree']}/{a['rows']} routings ({a['agree_pct']:.1f}%){tie}, "
                     f"weights max err {a['weights_max_abs_err']:.1e}")
    b = checks.get("fresh_gate", {})
    if "skipped" in b:
        parts.append(f"fresh-gate control: skipped ({b['skipped']})")
    else:
        s = f"fresh-gate control (router.parquet x gate_input, input rounding {b['input_rounding']}) {b['agree']}/{b['rows']}"
        s += f" ({b['agree_pct']:.1f}%)" + (f" + {b['ties']} exact ties" if b.get("ties") else "")
        if "max_rel_logit_err" in b:
            s += f", max rel logit err {b['max_rel_logit_err']:.1e}"
        parts.append(s)
    return "; ".join(parts)
