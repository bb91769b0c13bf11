"""Scoring a ranked prediction against the routing the router chose (docs/design.md, "Predictors and
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

import numba
import numpy as np
import polars as pl

from replay.predictors.base import NONE, Prediction
from traces.util.jit import resolve

resolve()  # this module compiles with Numba itself: the lazy stand-ins (traces.util.jit) become dispatchers, the compile notice listens

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


@numba.njit(cache=True)
def _row_scores_kernel(ranked, experts, weights, rows, k, width, hits_k, exact, hits_w, named_w, mass_named,
                       mass_total):
    n_rank = ranked.shape[1]
    for a in range(rows.shape[0]):
        r = rows[a]
        valid_k = 0
        nw = 0
        for j in range(n_rank):
            if ranked[r, j] != NONE:
                if j < k:
                    valid_k += 1
                if j < width:
                    nw += 1
        hk = 0
        hw = 0
        mn = 0.0
        mt = 0.0
        for s in range(k):  # slot order, one add at a time: a fixed summation order
            e = experts[r, s]
            in_k = False
            in_w = False
            for j in range(n_rank):
                if ranked[r, j] == e and e != NONE:
                    if j < k:
                        in_k = True
                    if j < width:
                        in_w = True
            hk += in_k
            hw += in_w
            w = np.float64(weights[r, s])
            if in_w:
                mn += w
            mt += w
        hits_k[a] = hk
        exact[a] = hk == k and valid_k == k
        hits_w[a] = hw
        named_w[a] = nw
        mass_named[a] = mn
        mass_total[a] = mt


def warm_up() -> None:
    """Compile (or load from cache) the scoring kernel, so its compile time stays out of timings."""
    z = np.zeros((1, 1), np.int32)
    _row_scores_kernel(z, z, np.zeros((1, 1), np.float32), np.zeros(1, np.int64), 1, 1, np.zeros(1, np.int64),
                       np.zeros(1, bool), np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1), np.zeros(1))


def row_scores(pred: Prediction, experts: np.ndarray, weights: np.ndarray, rows: np.ndarray,
               width: int) -> dict[str, np.ndarray]:
    """Per-row hits for ``rows`` (which must be scored): hits_k, exact, hits_w, named_w, mass_named, mass_total.

    A routed slot counts as named at k (at w) when its expert is among the first k (w) entries of
    the ranking; ``NONE`` entries name nothing."""
    k = experts.shape[1]
    out = {
        "hits_k": np.zeros(rows.size, np.int64), "exact": np.zeros(rows.size, bool),
        "hits_w": np.zeros(rows.size, np.int64), "named_w": np.zeros(rows.size, np.int64),
        "mass_named": np.zeros(rows.size, np.float64), "mass_total": np.zeros(rows.size, np.float64),
    }
    _row_scores_kernel(pred.ranked, experts, weights, rows.astype(np.int64, copy=False), k, width, out["hits_k"],
                       out["exact"], out["hits_w"], out["named_w"], out["mass_named"], out["mass_total"])
    return out


def _pct(num: float, den: float) -> float | None:
    return None if den == 0 else 100.0 * num / den


def score(pred: Prediction, experts: np.ndarray, weights: np.ndarray, layer: np.ndarray, in_phase: np.ndarray,
          moe_layers: list[int], n_expert: int, width: int, phase: str) -> pl.DataFrame:
    """One row per MoE layer plus an overall row (``layer`` null), docs/design.md ``predict`` keys."""
    k = experts.shape[1]
    scored_rows = np.flatnonzero(in_phase & pred.scored)
    unscored_rows = np.flatnonzero(in_phase & ~pred.scored)
    s = row_scores(pred, experts, weights, scored_rows, width)
    has_mass = np.isfinite(s["mass_total"])  # a NaN-weight routing is left out of the mass ratio only
    pos = {l: i for i, l in enumerate(moe_layers)}
    n_l = len(moe_layers)
    lut = np.full(int(max(moe_layers)) + 1, n_l, dtype=np.int64)
    lut[list(pos)] = list(pos.values())
    li = lut[layer[scored_rows]]
    ui = lut[layer[unscored_rows]]
    # Per layer (index n_l: the overall row) by bincount: weighted bincount adds each bin's values
    # one at a time in row order, the fixed summation order the mass figures promise.
    def per_layer(values: np.ndarray | None, idx: np.ndarray) -> np.ndarray:
        v = np.bincount(idx, weights=values, minlength=n_l)[:n_l]
        total = np.bincount(np.zeros(idx.size, np.int64), weights=values, minlength=1)[:1]
        return np.concatenate([v, total])

    n = per_layer(None, li).astype(np.int64)
    un = per_layer(None, ui).astype(np.int64)
    hk = per_layer(s["hits_k"].astype(np.float64), li)
    ex = per_layer(s["exact"].astype(np.float64), li)
    hw = per_layer(s["hits_w"].astype(np.float64), li)
    nw = per_layer(s["named_w"].astype(np.float64), li)
    mn = per_layer(s["mass_named"][has_mass], li[has_mass])
    mt = per_layer(s["mass_total"][has_mass], li[has_mass])
    nm = per_layer(None, li[has_mass]).astype(np.int64)
    rows = []
    for i, l in enumerate([*moe_layers, None]):
        rows.append({
            "predictor": pred.name, "layer": l, "phase": phase, "width": width,
            "slot_acc_pct": _pct(int(hk[i]), k * int(n[i])),
            "whole_acc_pct": _pct(int(ex[i]), int(n[i])),
            "recall_pct": _pct(int(hw[i]), k * int(n[i])),
            "precision_pct": _pct(int(hw[i]), int(nw[i])),
            "mass_pct": _pct(float(mn[i]), float(mt[i])) if nm[i] else None,
            "scored": int(n[i]), "unscored": int(un[i]), "mass_scored": int(nm[i]),
        })
    return pl.DataFrame(rows, schema=FRAME_SCHEMA)
