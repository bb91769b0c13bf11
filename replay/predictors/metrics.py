"""Scoring a ranked prediction against the routing the router chose (DESIGN.md, "Predictors and
accuracy").

Per scored routing (k routed experts, a ranked prediction):

- slot hits = |top-k of the prediction ∩ routed|; slot accuracy = sum(hits) / (k x scored);
- whole-routing hit = the top-k of the prediction is exactly the routed set; whole accuracy =
  hits / scored;
- at a width w (default k): recall = sum |top-w ∩ routed| / (k x scored), precision = the same
  sum / the number of experts the predictor actually named (prev-token names at most k);
- weight mass covered = sum of the router weights of the routed experts that the top-w named /
  sum of the router weights of all routed experts, over scored routings whose weights are known
  (a NaN-weight routing is left out of this ratio only). Weight mass is not quality: it says
  how much of the mixture the prediction covered, not how the output would have changed.

Slot and whole accuracy are always at k (the DESIGN definition); recall, precision and mass at w.
A routing the predictor could not rank is unscored: counted apart, never in a denominator. A
layer with nothing scored gets None (printed '-'), never 0.0.

Sums of weights run in a fixed order (slots in rank order within a routing, routings in trace
order), so results are reproducible bit for bit.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from replay.predictors.base import NONE, Prediction

CHUNK = 1 << 16  # rows per boolean scatter (bounds the [rows, n_expert] mask)

FRAME_SCHEMA = {
    "predictor": pl.String,
    "layer": pl.Int64,
    "phase": pl.String,
    "width": pl.Int64,
    "slot_acc_pct": pl.Float64,
    "whole_acc_pct": pl.Float64,
    "recall_pct": pl.Float64,
    "precision_pct": pl.Float64,
    "mass_pct": pl.Float64,
    "scored": pl.Int64,
    "unscored": pl.Int64,
    "mass_scored": pl.Int64,
}


def row_scores(pred: Prediction, experts: np.ndarray, weights: np.ndarray, rows: np.ndarray, n_expert: int,
               width: int) -> dict[str, np.ndarray]:
    """Per-row hits for ``rows`` (which must be scored): hits_k, exact, hits_w, named_w, mass_named, mass_total."""
    k = experts.shape[1]
    out = {
        "hits_k": np.zeros(rows.size, np.int64), "exact": np.zeros(rows.size, bool),
        "hits_w": np.zeros(rows.size, np.int64), "named_w": np.zeros(rows.size, np.int64),
        "mass_named": np.zeros(rows.size, np.float64), "mass_total": np.zeros(rows.size, np.float64),
    }
    for a in range(0, rows.size, CHUNK):
        r = rows[a:a + CHUNK]
        m = r.size
        idx = np.arange(m)[:, None]
        ranked = pred.ranked[r]
        valid = ranked != NONE
        # Boolean scatter: which experts the prediction named at width k and at width w.
        named_k = np.zeros((m, n_expert + 1), dtype=bool)  # the extra column swallows NONE (-1)
        named_k[idx, np.where(valid[:, :k], ranked[:, :k], n_expert)] = True
        named_w = np.zeros((m, n_expert + 1), dtype=bool)
        named_w[idx, np.where(valid[:, :width], ranked[:, :width], n_expert)] = True
        routed = experts[r]
        in_k = named_k[idx, routed]  # [m, k]: routed slot j was named in the top-k
        in_w = named_w[idx, routed]
        hk = in_k.sum(axis=1)
        out["hits_k"][a:a + m] = hk
        out["exact"][a:a + m] = (hk == k) & (valid[:, :k].sum(axis=1) == k)
        out["hits_w"][a:a + m] = in_w.sum(axis=1)
        out["named_w"][a:a + m] = valid[:, :width].sum(axis=1)
        w = weights[r].astype(np.float64)
        mn = np.zeros(m)
        mt = np.zeros(m)
        for j in range(k):  # slot order, one add at a time: a fixed summation order
            mn += np.where(in_w[:, j], w[:, j], 0.0)
            mt += w[:, j]
        out["mass_named"][a:a + m] = mn
        out["mass_total"][a:a + m] = mt
    return out


def _pct(num: float, den: float) -> float | None:
    return None if den == 0 else 100.0 * num / den


def score(pred: Prediction, experts: np.ndarray, weights: np.ndarray, layer: np.ndarray, in_phase: np.ndarray,
          moe_layers: list[int], n_expert: int, width: int, phase: str) -> pl.DataFrame:
    """One row per MoE layer plus an overall row (``layer`` null), DESIGN.md ``predict`` keys."""
    k = experts.shape[1]
    scored_rows = np.flatnonzero(in_phase & pred.scored)
    unscored_rows = np.flatnonzero(in_phase & ~pred.scored)
    s = row_scores(pred, experts, weights, scored_rows, n_expert, width)
    has_mass = np.isfinite(s["mass_total"])  # a NaN-weight routing is left out of the mass ratio only
    pos = {l: i for i, l in enumerate(moe_layers)}
    n_l = len(moe_layers)
    lut = np.full(int(max(moe_layers)) + 1, n_l, dtype=np.int64)
    lut[list(pos)] = list(pos.values())
    li = lut[layer[scored_rows]]
    ui = lut[layer[unscored_rows]]
    groups = [(l, li == i, ui == i) for i, l in enumerate(moe_layers)]
    groups.append((None, np.ones(li.size, bool), np.ones(ui.size, bool)))
    rows = []
    for l, sel, usel in groups:
        n = int(sel.sum())
        mass = sel & has_mass
        # Sequential sums in row order (np.add.reduce would pair them up: another rounding order).
        mn = float(np.bincount(np.zeros(int(mass.sum()), np.int64), weights=s["mass_named"][mass], minlength=1)[0])
        mt = float(np.bincount(np.zeros(int(mass.sum()), np.int64), weights=s["mass_total"][mass], minlength=1)[0])
        hits_w = int(s["hits_w"][sel].sum())
        rows.append({
            "predictor": pred.name, "layer": l, "phase": phase, "width": width,
            "slot_acc_pct": _pct(int(s["hits_k"][sel].sum()), k * n),
            "whole_acc_pct": _pct(int(s["exact"][sel].sum()), n),
            "recall_pct": _pct(hits_w, k * n),
            "precision_pct": _pct(hits_w, int(s["named_w"][sel].sum())),
            "mass_pct": _pct(mn, mt) if mass.any() else None,
            "scored": n, "unscored": int(usel.sum()), "mass_scored": int(mass.sum()),
        })
    return pl.DataFrame(rows, schema=FRAME_SCHEMA)
