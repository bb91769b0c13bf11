"""``mix``: a weighted union of two predictors' guesses under a width cap.

``mix`` runs predictors A and B (default ``prev-token`` and ``pair-table[1]``, weight 0.5; set with
``mix=("A", "B", w)`` in the API or ``--mix A,B,W``) under the same held-out protocol, and ranks
each expert e by

    score(e) = w / (1 + rank_A(e)) + (1 - w) / (1 + rank_B(e))

(rank 0 = a predictor's first guess; only each part's first k guesses count, so the mix does not
depend on how wide a list was asked for; a predictor that does not name e, or does not score the
routing, adds nothing), ties broken by e's best rank in A, then in B, then expert id; the list is
cut at the width (the cap). Scored where A or B is. Its guess exists as early as the later of the
two (lead = the smaller of their leads).
"""

from __future__ import annotations

import contextvars

import numpy as np

from replay.predictors.base import NONE, Prediction
from traces.format.errors import UserError

NAME = "mix"
DESCRIPTION = "a weighted union of two predictors' guesses cut at the width"
SPLIT = True  # runs its parts under the call's held-out protocol
DEFAULT = ("prev-token", "pair-table[1]", 0.5)
spec: contextvars.ContextVar[tuple[str, str, float]] = contextvars.ContextVar("moe_replay_mix", default=DEFAULT)


def parse_mix(text: str | tuple | list, option: str = "--mix") -> tuple[str, str, float]:
    """``'prev-token,pair-table[1],0.7'`` or a tuple -> (A, B, w); bad -> one sentence."""
    from replay import predictors as registry

    parts = [p.strip() for p in (text.split(",") if isinstance(text, str) else map(str, text))]
    if len(parts) not in (2, 3):
        raise UserError(f"{option} {text!r}: give two predictors and an optional weight (A,B[,W]).")
    w = 0.5
    if len(parts) == 3:
        try:
            w = float(parts[2])
        except ValueError:
            raise UserError(f"{option} {text!r}: the weight {parts[2]!r} is not a number.") from None
        if not 0.0 <= w <= 1.0:
            raise UserError(f"{option} {text!r}: the weight must lie in 0..1 (A's share).")
    for p in parts[:2]:
        fam, _ = registry.parse_predictor(p, option)
        if fam == NAME:
            raise UserError(f"{option} {text!r}: a mix cannot hold another mix.")
        if not getattr(registry.module(fam), "PREFETCH", True):
            raise UserError(f"{option} {text!r}: {p} is a check, not a predictor.")
    return parts[0], parts[1], w


def ahead(value=None) -> int:
    from replay import predictors as registry

    a, b, _ = spec.get()
    return min(registry.ahead(*registry.parse_predictor(a)), registry.ahead(*registry.parse_predictor(b)))


def unavailable(trace) -> str | None:
    from replay import predictors as registry

    for p in spec.get()[:2]:
        fam, _ = registry.parse_predictor(p, "--mix")
        why = registry.unavailable(fam, trace)
        if why:
            return f"its part {p} cannot run: {why}"
    return None


def combine(ra: np.ndarray, sa: np.ndarray, rb: np.ndarray, sb: np.ndarray, w: float, width: int,
            n_expert: int) -> tuple[np.ndarray, np.ndarray]:
    """The mixed ranking [R, width] and where it is scored."""
    n = ra.shape[0]
    score = np.zeros((n, n_expert), np.float64)
    best_a = np.full((n, n_expert), ra.shape[1], np.int64)
    best_b = np.full((n, n_expert), rb.shape[1], np.int64)
    rows = np.arange(n)
    for j in range(ra.shape[1]):  # A's ranks then B's, in rank order: the fixed summation order
        e = ra[:, j]
        ok = sa & (e != NONE) & (best_a[rows, np.maximum(e, 0)] > j)
        score[rows[ok], e[ok]] += w / (1 + j)
        best_a[rows[ok], e[ok]] = j
    for j in range(rb.shape[1]):
        e = rb[:, j]
        ok = sb & (e != NONE) & (best_b[rows, np.maximum(e, 0)] > j)
        score[rows[ok], e[ok]] += (1.0 - w) / (1 + j)
        best_b[rows[ok], e[ok]] = j
    ids = np.broadcast_to(np.arange(n_expert), score.shape)
    order = np.lexsort((ids, best_b, best_a, -score), axis=-1)[:, :width]
    named = np.take_along_axis(score, order, axis=1) > 0
    ranked = np.where(named, order, NONE).astype(np.int32)
    return ranked, (sa | sb) & named[:, 0]


def predict(trace, arr, in_phase: np.ndarray, width: int, split=None) -> Prediction:
    from replay import predictors as registry

    a, b, w = spec.get()
    req = [registry.parse_predictor(a, "--mix"), registry.parse_predictor(b, "--mix")]
    got = registry.run(trace, arr, in_phase, width, req, split=split)
    pa, pb = got[registry.full_name(*req[0])], got[registry.full_name(*req[1])]
    k = min(trace.top_k, width)
    ranked, scored = combine(pa.ranked[:, :k], pa.scored, pb.ranked[:, :k], pb.scored, w, width, trace.n_expert)
    return Prediction(NAME, ranked, scored)
