"""``compare``: do two traces of the same prompt route alike (two engines, two quantisations, CPU vs GPU)?

Rows are matched by position, never by file order: (request, turn, step, layer). Two traces are
comparable when they describe the same model shape (layers, MoE layers, experts, top-k) and the same
token positions, with the same token ids where both recorded them. Anything else is refused in one
sentence saying what differs; ``align="step"`` compares the overlap instead: the positions both
traces hold, up to the first position whose token ids differ (from there on the two runs saw
different contexts, so a routing difference says nothing about the engines).

Per MoE layer (and over all layers, ``layer`` null):

- ``set_agree_pct``: share of routings whose expert SET is the same (order ignored);
- ``top1_agree_pct``: share whose first (highest-ranked) expert is the same;
- ``weight_max_abs_diff`` / ``weight_mean_abs_diff``: applied routing weights, matched by expert id,
  over the routings whose sets agree and where both engines exposed weights;
- ``logit_max_abs_diff`` / ``logit_mean_abs_diff``: router logits (every expert), when both have them;
- ``disagreements`` / ``explained`` / ``unexplained``: routings whose sets differ, and how many of
  them lie on a near-tie of the router (``margin < tol``).

The margin of a disagreement is measured on the values the router ranks: the raw logits where the
selection is monotone in them (softmax or sigmoid, no selection bias, no expert groups), otherwise
the selection scores (probabilities plus the selection bias, groups masked). It is the spread of
those values over the experts the two traces disagree on: for the usual case, one expert swapped at
the k-th place, exactly the gap between the k-th and (k+1)-th value. Where both traces hold logits
the larger of the two margins is taken (a disagreement is a near-tie only if every engine that
recorded logits saw one). A disagreement with no logits in either trace has no margin and is never
explained: a near-tie that cannot be shown is not assumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from replay.core.phases import PHASE_CODES, check_phase
from traces.format.errors import UserError
from traces.format.gating import selection_scores
from traces.io.reader import Trace, fixed_list_to_numpy

ALIGNS = ("none", "step")
DEFAULT_TOL = 1e-3  # logit units: float32 engines on the same weights differ by ~1e-6..1e-4 per logit
POS = ["request", "turn", "step"]
KEY = [*POS, "layer"]


@dataclass
class CompareResult:
    """What :func:`compare` found. ``per_layer``: one row per MoE layer plus the overall row
    (``layer`` null, last); ``disagreements``: one row per routing whose expert sets differ."""

    per_layer: pl.DataFrame
    disagreements: pl.DataFrame
    tol: float
    align: str
    phase: str
    margin_unit: str  # "logit" or "selection score"
    margin_source: str  # "A", "B", "A and B (the larger margin)" or "none"
    positions: int  # token positions compared
    tokens_checked: bool  # both traces recorded token ids and they agree on every compared position
    left_out: dict[str, int] = field(default_factory=dict)  # routings of A ("a") / B ("b") not compared (align="step")
    notes: list[str] = field(default_factory=list)

    def overall(self) -> dict[str, Any]:
        return self.per_layer.filter(pl.col("layer").is_null()).to_dicts()[0]


def _shape(t: Trace) -> dict[str, Any]:
    return {"n_layer": t.n_layer, "moe_layers": t.moe_layers, "n_expert": t.n_expert, "top_k": t.top_k}


_SHAPE_WORDS = {"n_layer": "layers", "moe_layers": "MoE layers", "n_expert": "experts per layer", "top_k": "top-k"}


def _check_shapes(a: Trace, b: Trace) -> None:
    sa, sb = _shape(a), _shape(b)
    diff = [k for k in sa if sa[k] != sb[k]]
    if diff:
        what = ", ".join(f"{_SHAPE_WORDS[k]} {sa[k]} vs {sb[k]}" for k in diff)
        raise UserError(f"{a.path} and {b.path} are not comparable: they describe different models ({what}).")


def _load(t: Trace) -> dict[str, np.ndarray]:
    """The columns compare needs, as numpy arrays (request 0 where the trace has no request column)."""
    cols = ["turn", "phase", "step", "layer", "experts", "weights"]
    cols += [c for c in ("request", "token", "logits") if t.has(c)]
    tab = t.table(cols)
    out: dict[str, np.ndarray] = {}
    for c in ("turn", "phase", "step", "layer", "request", "token"):
        if c in cols:
            out[c] = tab.column(c).to_numpy().astype(np.int64)
    if "request" not in out:
        out["request"] = np.zeros(tab.num_rows, dtype=np.int64)
    for c in ("experts", "weights", "logits"):
        if c in cols:
            out[c] = fixed_list_to_numpy(tab.column(c))
    return out


def _positions(d: dict[str, np.ndarray], suffix: str) -> pl.DataFrame:
    """One row per (request, turn, step): its phase and token (null when not recorded)."""
    df = pl.DataFrame({c: d[c] for c in (*POS, "phase")})
    df = df.with_columns(pl.Series("token", d["token"]) if "token" in d else pl.lit(None, dtype=pl.Int64).alias("token"))
    return df.unique(POS, keep="first").rename({"phase": f"phase_{suffix}", "token": f"token_{suffix}"})


def _where(r: dict[str, Any]) -> str:
    req = f"request {r['request']}, " if r["request"] else ""
    return f"{req}turn {r['turn']} step {r['step']}"


def _align_positions(a: Trace, b: Trace, da: dict, db: dict, align: str) -> tuple[pl.DataFrame, bool, list[str]]:
    """The (request, turn, step) positions to compare, whether token ids were checked, and notes.
    Raises UserError when the positions differ and ``align`` is "none"."""
    pa_, pb_ = _positions(da, "a"), _positions(db, "b")
    both_tokens = "token" in da and "token" in db
    j = pa_.join(pb_, on=POS, how="full", coalesce=True).sort(POS)
    only_a = j.filter(pl.col("phase_b").is_null())
    only_b = j.filter(pl.col("phase_a").is_null())
    common = j.filter(pl.col("phase_a").is_not_null() & pl.col("phase_b").is_not_null())
    tok_diff = common.filter(pl.col("token_a") != pl.col("token_b")) if both_tokens else common.clear()
    phase_diff = common.filter(pl.col("phase_a") != pl.col("phase_b"))
    notes: list[str] = []
    if not both_tokens:
        which = " and ".join(n for n, d in (("A", da), ("B", db)) if "token" not in d)
        notes.append(f"{which} recorded no token ids: that both saw the same tokens is assumed, not checked.")
    problems: list[str] = []
    prompts = [t.meta.get("provenance", {}).get("prompts") for t in (a, b)]
    if not both_tokens and all(isinstance(p, list) and p for p in prompts) and prompts[0] != prompts[1]:
        # Without token ids on both sides, the recorded prompts are the only witness of "same prompt".
        problems.append("their recorded prompts differ (provenance.prompts) and the token ids cannot be checked")
    if tok_diff.height:
        r = tok_diff.row(0, named=True)
        problems.append(f"their token ids differ from {_where(r)} on (A {r['token_a']}, B {r['token_b']}; "
                        f"{tok_diff.height} of {common.height} shared positions differ)")
    if only_a.height or only_b.height:
        na, nb = pa_.height, pb_.height
        first = (only_a if only_a.height else only_b).row(0, named=True)
        lacks = "B" if only_a.height else "A"
        problems.append(f"A holds {na} token positions, B {nb} ({lacks} lacks {_where(first)}"
                        + (f" and {max(only_a.height, only_b.height) - 1} more" if max(only_a.height, only_b.height) > 1 else "")
                        + ")")
    if phase_diff.height:
        r = phase_diff.row(0, named=True)
        problems.append(f"{phase_diff.height} shared positions are prefill in one and decode in the other "
                        f"(first: {_where(r)})")
    if problems and align == "none":
        raise UserError(f"{a.path} and {b.path} are not comparable: {'; '.join(problems)}; "
                        "--align step compares the positions both hold, up to the first differing token.")
    if problems:
        notes.append("--align step: " + "; ".join(problems) + ".")
    keep = common
    if tok_diff.height:
        # Everything from a request's first differing token on saw a different context: cut it.
        cut = tok_diff.sort(POS).group_by("request", maintain_order=True).first().select(
            "request", pl.col("turn").alias("cut_turn"), pl.col("step").alias("cut_step"))
        keep = keep.join(cut, on="request", how="left").filter(
            pl.col("cut_turn").is_null()
            | (pl.col("turn") < pl.col("cut_turn"))
            | ((pl.col("turn") == pl.col("cut_turn")) & (pl.col("step") < pl.col("cut_step")))
        ).drop("cut_turn", "cut_step")
    return keep.select(POS), both_tokens, notes


def _ranking(t: Trace) -> tuple[str, dict[int, np.ndarray] | None]:
    """("logit", None) where the router ranks its raw logits (softmax/sigmoid, no bias, no groups);
    else ("selection score", {layer: selection bias}) for :func:`traces.format.gating.selection_scores`."""
    g = t.gating
    if not g.get("selection_bias") and int(g.get("n_group", 1) or 1) <= 1:
        return "logit", None
    bias = {l: b for l, (_, b) in t.router_matrices().items()} if t.has_router else {}
    return "selection score", bias


def _margins(t: Trace, logits: np.ndarray, layer: np.ndarray, sym: np.ndarray) -> np.ndarray:
    """Per disagreeing routing: the spread of the ranked values over the experts in ``sym``
    (bool [D, n_expert], the symmetric difference of the two sets); NaN where not measurable."""
    unit, bias = _ranking(t)
    out = np.full(logits.shape[0], np.nan)
    if unit == "logit":
        scores = logits.astype(np.float64)
    else:
        scores = np.full(logits.shape, np.nan)
        for l in np.unique(layer):
            m = layer == l
            if t.gating.get("selection_bias") and l not in (bias or {}):
                continue  # the bias is unknown: no margin rather than a wrong one
            scores[m] = selection_scores(logits[m], t.gating, (bias or {}).get(int(l)))
    with np.errstate(invalid="ignore"):
        hi = np.where(sym, scores, -np.inf).max(axis=1)
        lo = np.where(sym, scores, np.inf).min(axis=1)
        spread = hi - lo
    ok = np.isfinite(spread)
    out[ok] = spread[ok]
    return out


def _sorted_by_expert(ex: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(ex, axis=1, kind="stable")
    return np.take_along_axis(ex, order, axis=1), np.take_along_axis(w, order, axis=1)


def compare(a: Trace, b: Trace, *, tol: float = DEFAULT_TOL, align: str = "none", phase: str = "all") -> CompareResult:
    """Compare the routings of traces ``a`` and ``b`` of the same prompt (see the module docstring).

    ``tol``: a disagreement whose margin is below it is explained as a near-tie (in the margin's
    unit, logits for softmax/sigmoid routers); ``align``: "none" refuses traces whose positions or
    token ids differ, "step" compares the overlap; ``phase``: "all" (default), "prefill" or "decode"."""
    if align not in ALIGNS:
        raise UserError(f"--align {align!r} is not one of none (refuse traces whose positions differ), "
                        "step (compare the positions both hold, up to the first differing token).")
    if not (isinstance(tol, (int, float)) and np.isfinite(tol) and tol >= 0):
        raise UserError(f"--tol {tol!r} must be a finite margin >= 0 (in logits).")
    check_phase(phase)
    _check_shapes(a, b)
    for t in (a, b):
        if t.n_rows == 0:
            raise UserError(f"{t.path}: holds no routings, so there is nothing to compare.")
    da, db = _load(a), _load(b)
    keep, tokens_checked, notes = _align_positions(a, b, da, db, align)
    fa = pl.DataFrame({c: da[c] for c in (*KEY, "phase")}).with_row_index("ia")
    fb = pl.DataFrame({c: db[c] for c in KEY}).with_row_index("ib")
    fa, fb = fa.join(keep, on=POS, how="semi"), fb.join(keep, on=POS, how="semi")
    pairs = fa.join(fb, on=KEY, how="full", coalesce=True)
    missing = pairs.filter(pl.col("ia").is_null() | pl.col("ib").is_null())
    if missing.height:
        r = missing.sort(KEY).row(0, named=True)
        lacks = "B" if r["ib"] is None else "A"
        msg = (f"{missing.height} routings at shared positions are in one trace only (first: {lacks} has no routing at "
               f"{_where(r)} layer {r['layer']})")
        if align == "none":
            raise UserError(f"{a.path} and {b.path} are not comparable: {msg}; --align step compares the routings both hold.")
        notes.append(f"--align step: {msg}.")
    pairs = pairs.drop_nulls(["ia", "ib"]).sort(KEY)
    pairs = pairs.filter(pl.col("phase").is_in(PHASE_CODES[phase]))
    if pairs.height == 0:
        what = "routings" if phase == "all" else f"{phase} routings"
        raise UserError(f"{a.path} and {b.path} share no {what} to compare.")
    ia, ib = pairs["ia"].to_numpy(), pairs["ib"].to_numpy()
    layer = pairs["layer"].to_numpy()
    ea, eb = da["experts"][ia].astype(np.int64), db["experts"][ib].astype(np.int64)
    wa, wb = da["weights"][ia].astype(np.float64), db["weights"][ib].astype(np.float64)
    sa, swa = _sorted_by_expert(ea, wa)
    sb, swb = _sorted_by_expert(eb, wb)
    set_agree = (sa == sb).all(axis=1)
    top1 = ea[:, 0] == eb[:, 0]
    wvalid = set_agree & ~np.isnan(wa).any(axis=1) & ~np.isnan(wb).any(axis=1)
    wdiff = np.abs(swa - swb)
    la = da["logits"][ia] if "logits" in da else None
    lb = db["logits"][ib] if "logits" in db else None
    ldiff = np.abs(la.astype(np.float64) - lb.astype(np.float64)) if la is not None and lb is not None else None

    # Disagreements: the margin from every trace that holds logits, the larger one taken.
    dis = np.flatnonzero(~set_agree)
    n_expert = a.n_expert
    rows_d = np.arange(dis.size)[:, None]
    ina = np.zeros((dis.size, n_expert), dtype=bool)
    inb = np.zeros((dis.size, n_expert), dtype=bool)
    ina[rows_d, ea[dis]] = True
    inb[rows_d, eb[dis]] = True
    sym = ina ^ inb
    margins = []
    units = set()
    for t, lg in ((a, la), (b, lb)):
        if lg is not None:
            margins.append(_margins(t, lg[dis], layer[dis], sym))
            units.add(_ranking(t)[0])
    sources = [n for n, lg in (("A", la), ("B", lb)) if lg is not None]
    margin = np.fmax.reduce(margins) if margins else np.full(dis.size, np.nan)
    if len(margins) == 2:
        # A margin one trace could not measure is not known to be small.
        margin = np.where(np.isnan(margins[0]) | np.isnan(margins[1]), np.nan, margin)
    explained = ~np.isnan(margin) & (margin < tol)
    if not sources and dis.size:
        notes.append("neither trace holds router logits: no disagreement's margin can be measured, none is explained.")
    if ldiff is not None and dis.size:
        # Two engines whose logits differ by up to d per expert can order two experts either way when
        # their margin is below 2d: such a flip is within the engines' own difference, say so.
        noise = 2.0 * ldiff[dis].max(axis=1)
        within = ~explained & ~np.isnan(margin) & (margin < noise)
        if within.any():
            notes.append(f"{int(within.sum())} unexplained disagreement(s) have a margin below twice the two traces' own "
                         f"logit difference at that routing (up to {float(noise[within].max()):.2e}): a --tol of that "
                         "size would count them as near-ties.")

    per: list[dict[str, Any]] = []
    d_layer = layer[dis]
    for l in [*sorted(set(int(x) for x in np.unique(layer))), None]:
        m = np.ones(layer.size, bool) if l is None else layer == l
        md = np.ones(dis.size, bool) if l is None else d_layer == l
        n = int(m.sum())
        wv = wdiff[m & wvalid]
        per.append({
            "layer": l,
            "routings": n,
            "set_agree_pct": 100.0 * float(set_agree[m].sum()) / n,
            "top1_agree_pct": 100.0 * float(top1[m].sum()) / n,
            "disagreements": int(md.sum()),
            "explained": int(explained[md].sum()),
            "unexplained": int((~explained[md]).sum()),
            "weight_max_abs_diff": float(wv.max()) if wv.size else None,
            "weight_mean_abs_diff": float(wv.mean()) if wv.size else None,
            "logit_max_abs_diff": float(ldiff[m].max()) if ldiff is not None else None,
            "logit_mean_abs_diff": float(ldiff[m].mean()) if ldiff is not None else None,
        })
    schema = {"layer": pl.Int64, "routings": pl.Int64, "set_agree_pct": pl.Float64, "top1_agree_pct": pl.Float64,
              "disagreements": pl.Int64, "explained": pl.Int64, "unexplained": pl.Int64,
              "weight_max_abs_diff": pl.Float64, "weight_mean_abs_diff": pl.Float64,
              "logit_max_abs_diff": pl.Float64, "logit_mean_abs_diff": pl.Float64}
    per_layer = pl.DataFrame(per, schema=schema)
    sel = pairs.filter(pl.Series(~set_agree))
    disagreements = pl.DataFrame({
        "request": sel["request"], "turn": sel["turn"], "phase": sel["phase"], "step": sel["step"], "layer": sel["layer"],
        "experts_a": ea[dis].tolist(), "experts_b": eb[dis].tolist(),
        "margin": pl.Series(margin, dtype=pl.Float64).fill_nan(None), "explained": explained,
    }, schema={"request": pl.Int64, "turn": pl.Int64, "phase": pl.Int8, "step": pl.Int64, "layer": pl.Int64,
               "experts_a": pl.List(pl.Int64), "experts_b": pl.List(pl.Int64), "margin": pl.Float64, "explained": pl.Boolean})
    unit = "logit" if units <= {"logit"} else ("selection score" if units == {"selection score"} else "logit / selection score")
    source = {0: "none", 1: sources[0] if sources else "none", 2: "A and B (the larger margin)"}[len(sources)]
    # snake_case keys in --json (docs/design.md): "a" / "b", the traces A and B
    left_out = {"a": int(da["step"].size - pairs.height), "b": int(db["step"].size - pairs.height)} if phase == "all" else {}
    return CompareResult(per_layer=per_layer, disagreements=disagreements, tol=float(tol), align=align, phase=phase,
                         margin_unit=unit, margin_source=source, positions=int(pairs.select(POS).unique().height),
                         tokens_checked=tokens_checked, left_out=left_out, notes=notes)
