"""The held-out protocol: which routings a learned predictor may learn from, and which are scored.

A predictor that learns (``LEARNS = True``: static-hot, pair-table, request-match, learned-gate) is
fitted on a *training split* and scored on the *evaluated* routings, which never share a token:

- ``"50%"`` (token range, the default when a learner is asked for): in each request, the first 50%
  of its tokens of the scored phase (in (turn, step) order) are training, the rest evaluated; a
  trace without a request column is one request;
- ``"trace:50%"``: the first 50% of the trace's tokens of the scored phase, in trace order;
- ``"folds:K"``: k-fold by request (the trace must have at least K requests): the requests are
  dealt into K folds by a seeded permutation (``numpy.random.default_rng(seed)``); each fold is
  evaluated with a predictor fitted on the other K - 1, so every token is scored once, held out;
- ``train_trace``: fitted on another trace's routings of the scored phase (same model and shapes,
  else refused) and scored on every routing of this one;
- ``"in-sample"``: fitted on the very routings it is scored on. Allowed only when asked for by
  name; every figure it produces is marked in-sample (it has seen the answers).

A token is the unit: all MoE layers of one token fall on the same side. Predictors that do not learn
(prev-token, stale-gate, ctrl, static-hot-prompt) are scored on the same evaluated routings (one
table, one set of tokens); their inputs (the previous token, an earlier layer's gate input) may lie
in the training split: an input is not a training label.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from traces.format.errors import UserError

if TYPE_CHECKING:
    import numpy as np

DEFAULT_TRAIN = "50%"
IN_SAMPLE = "in-sample"
_HEAD = re.compile(r"^(trace:)?(\d+(?:\.\d+)?)%?$")
_FOLDS = re.compile(r"^folds?:(\d+)$")


@dataclass(frozen=True)
class Training:
    """What a learner is fitted on: ``rows`` (bool [R'] over ``arr``, the rows of ``trace``)."""

    trace: Any
    arr: Any
    rows: np.ndarray


@dataclass
class Split:
    """The folds of one protocol: for each, the training rows and the evaluated rows (bool over the
    scored trace's rows); ``evaluated`` is their union."""

    spec: str  # "50%", "trace:50%", "folds:5", "in-sample", "trace FILE", "none"
    text: str  # one phrase for the output: what was trained on and what scored
    folds: list[tuple[Training, np.ndarray]] = field(default_factory=list)
    evaluated: np.ndarray | None = None
    in_sample: bool = False
    learns: bool = True  # False: no learner asked for, so nothing was split ("none")


def parse_train(spec: str, option: str = "--train") -> tuple[str, float]:
    """``'50%'`` -> ('head', 50.0); ``'trace:30%'`` -> ('trace-head', 30.0); ``'folds:5'`` ->
    ('folds', 5); ``'in-sample'`` -> ('in-sample', 0)."""
    s = str(spec).strip().lower()
    if s == IN_SAMPLE:
        return IN_SAMPLE, 0.0
    m = _FOLDS.match(s)
    if m:
        k = int(m.group(1))
        if k < 2:
            raise UserError(f"{option} {spec}: k-fold needs at least 2 folds.")
        return "folds", float(k)
    m = _HEAD.match(s)
    if m:
        p = float(m.group(2))
        if not 0 < p < 100:
            raise UserError(f"{option} {spec}: the training share must lie strictly between 0% and 100% "
                            "(something must be learned from and something scored).")
        return ("trace-head" if m.group(1) else "head"), p
    raise UserError(f"{option} {spec!r}: not a training split (use 50% = the first half of each request's tokens, "
                    "trace:50% = of the trace's, folds:5 = 5-fold by request, or in-sample).")


def token_index(arr: Any) -> tuple[np.ndarray, np.ndarray]:
    """(token of each row [R], numbered 0.. in (request, turn, step) order; request of each token)."""
    import numpy as np

    req = arr.request_or_zero.astype(np.int64)
    keys = np.stack([req, arr.turn.astype(np.int64), arr.step.astype(np.int64)], axis=1)
    uniq, inv = np.unique(keys, axis=0, return_inverse=True)
    return inv.reshape(-1).astype(np.int64), uniq[:, 0]


def same_shapes(trace: Any, other: Any) -> str | None:
    """Why ``other`` cannot train a predictor scored on ``trace`` (one sentence), or None."""
    for what, a, b in (("model", trace.model.get("name"), other.model.get("name")),
                       ("n_expert", trace.n_expert, other.n_expert), ("top_k", trace.top_k, other.top_k),
                       ("MoE layers", list(trace.moe_layers), list(other.moe_layers)),
                       ("n_embd", trace.model.get("n_embd"), other.model.get("n_embd"))):
        if a != b:
            return (f"{other.path} cannot train predictors scored on {trace.path}: its {what} is {b!r}, "
                    f"the scored trace's is {a!r}.")
    return None


def make_split(trace: Any, arr: Any, in_phase: np.ndarray, *, train: str | None, learns: bool,
               train_trace: Any = None, phase_mask: Any = None, seed: int = 0, option: str = "--train") -> Split:
    """The folds for ``trace``'s rows ``in_phase``. ``train`` None: the default (:data:`DEFAULT_TRAIN`)
    when ``learns`` (a learner was asked for), else no split. ``train_trace``: an open trace to fit on
    instead (``phase_mask(arr)`` gives its rows of the scored phase)."""
    import numpy as np

    if train_trace is not None:
        if train is not None:
            raise UserError(f"{option} {train}: give a training split or a training trace, not both.")
        why = same_shapes(trace, train_trace)
        if why:
            raise UserError(why)
        tarr = train_trace.arrays(recorded=False)
        rows = phase_mask(tarr)
        return Split(f"trace {train_trace.path}", f"trained on {train_trace.path}, every token of this trace scored",
                     [(Training(train_trace, tarr, rows), in_phase.copy())], in_phase.copy())
    if train is None and not learns:
        return Split("none", "", [(Training(trace, arr, in_phase.copy()), in_phase.copy())], in_phase.copy(),
                     learns=False)
    kind, v = parse_train(train if train is not None else DEFAULT_TRAIN, option)
    if kind == IN_SAMPLE:
        return Split(IN_SAMPLE, "in-sample: learned from the very tokens it is scored on (has seen the answers)",
                     [(Training(trace, arr, in_phase.copy()), in_phase.copy())], in_phase.copy(), in_sample=True)
    tok, tok_req = token_index(arr)
    n_tok = tok_req.shape[0]
    scored_tok = np.zeros(n_tok, bool)
    scored_tok[tok[in_phase]] = True
    if kind in ("head", "trace-head"):
        train_tok = np.zeros(n_tok, bool)
        if kind == "head":
            for r in np.unique(tok_req[scored_tok]):
                ids = np.flatnonzero(scored_tok & (tok_req == r))  # (turn, step) order within the request
                train_tok[ids[: int(ids.size * v / 100.0)]] = True
            text = f"held out: the first {v:g}% of each request's tokens trained on, the rest scored"
        else:
            first = np.full(n_tok, np.iinfo(np.int64).max)
            np.minimum.at(first, tok[in_phase], np.flatnonzero(in_phase))  # trace order = first row of each token
            ids = np.flatnonzero(scored_tok)
            ids = ids[np.argsort(first[ids], kind="stable")]
            train_tok[ids[: int(ids.size * v / 100.0)]] = True
            text = f"held out: the first {v:g}% of the trace's tokens trained on, the rest scored"
        tr = in_phase & train_tok[tok]
        ev = in_phase & ~train_tok[tok]
        spec = f"{v:g}%" if kind == "head" else f"trace:{v:g}%"
        return Split(spec, text, [(Training(trace, arr, tr), ev)], ev.copy())
    k = int(v)
    reqs = np.unique(tok_req[scored_tok])
    if arr.request is None or reqs.size < k:
        raise UserError(f"{option} folds:{k}: {trace.path} has {reqs.size} request(s) with routings of the scored phase; "
                        f"k-fold by request needs at least {k} (use a token range such as 50%).")
    fold_of = np.empty(reqs.size, np.int64)
    fold_of[np.random.default_rng(seed).permutation(reqs.size)] = np.arange(reqs.size) % k
    row_fold = fold_of[np.minimum(np.searchsorted(reqs, arr.request_or_zero), reqs.size - 1)]
    folds = []
    for f in range(k):
        ev = in_phase & (row_fold == f) & np.isin(arr.request_or_zero, reqs)
        folds.append((Training(trace, arr, in_phase & ~ev), ev))
    return Split(f"folds:{k}", f"held out: {k}-fold by request (seed {seed}), each request scored by a fit on the others",
                 folds, in_phase.copy())
