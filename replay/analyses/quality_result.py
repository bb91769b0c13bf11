"""Quality results (``moe-replay quality``'s ``quality.json``) read for the report: validated in
full before anything is written, matched against the report's trace, and each setting's expert
bytes read per token priced by a cost model.

A quality result is a directory written by ``moe-replay quality`` (``quality.json``, ``plain/``
and one trace per setting) or its ``quality.json`` alone; the undropped run's trace ``plain/``
beside it, when present, says which model was run (the JSON does not record it).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from traces.format.errors import UserError
from traces.io.reader import Trace
from traces.util.units import MIB

# Keys of every row (docs/design.md "quality"); None allowed only where the verb writes None (reads
# avoided when the undropped run read nothing).
ROW_NUMBERS = ("ppl", "ppl_delta_pct", "kl_mean", "kl_p95", "top1_agree_pct", "routings_dropped_pct", "mass_lost_pct",
               "routings_dropped_pct_replay", "mass_lost_pct_replay", "read_mib", "read_mib_plain")
ROW_OPTIONAL = ("io_saved_pct", "io_saved_pct_replay", "experts_dropped_pct", "experts_dropped_pct_replay")
SHARES = ("top1_agree_pct", "routings_dropped_pct", "mass_lost_pct", "routings_dropped_pct_replay", "mass_lost_pct_replay",
          "experts_dropped_pct", "experts_dropped_pct_replay")
# engine_bridge.tinymodel names its random-weight GGUFs tiny-<arch>-L<n>-E<n>-k<n>-d<n>-seed<n>.
TINY_GGUF = re.compile(r"^tiny-.+-seed\d+$")
WHAT = "give a 'moe-replay quality' output directory or its quality.json"


@dataclass
class QualityResult:
    """One validated quality result: ``obj`` is quality.json as written, ``plain`` the undropped
    run's trace when it lies beside the file (None otherwise), ``name`` how the report names it."""

    path: Path  # the quality.json file
    name: str
    obj: dict[str, Any]
    plain: Trace | None
    warnings: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        """Tokens run teacher-forced, one per forward: each is one load per MoE layer."""
        return int(self.obj["plain"]["tokens"])

    @property
    def random_weights(self) -> bool:
        """True when the model is recognisably one of moe-replay's random-weight tiny models."""
        return self.plain is not None and bool(TINY_GGUF.match(str(self.plain.model.get("name") or "")))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_row(p: Path, i: int, r: Any) -> None:
    if not isinstance(r, dict):
        raise UserError(f"{p}: setting {i + 1} is not a JSON object.")
    label = r.get("setting")
    if not isinstance(label, str) or not label:
        raise UserError(f"{p}: setting {i + 1} has no \"setting\" label.")
    where = f"{p}: setting {label!r}"
    for key in (*ROW_NUMBERS, *ROW_OPTIONAL):
        if key not in r:
            if key in ROW_OPTIONAL[2:]:
                continue
            raise UserError(f"{where} lacks {key!r} (is it a quality.json of this version?).")
        v = r[key]
        if v is None and key in ROW_OPTIONAL:
            continue
        if not _number(v):
            raise UserError(f"{where} has {key} = {v!r}, not a finite number.")
    if r["ppl"] <= 0 or min(r["kl_mean"], r["kl_p95"], r["read_mib"], r["read_mib_plain"]) < 0:
        raise UserError(f"{where} has a negative (or zero perplexity) figure where none can be.")
    for key in SHARES:
        if r.get(key) is not None and not 0 <= r[key] <= 100:
            raise UserError(f"{where} has {key} = {r[key]!r}, not a percentage in 0..100.")
    frac, keep_k = r.get("frac"), r.get("keep_k")
    if (frac is None) == (keep_k is None):
        raise UserError(f"{where} must name exactly one of frac (drop-cold F) and keep_k (top-k cut).")
    if frac is not None:
        from replay.analyses.drop_cold import check_drop_frac

        check_drop_frac(frac, f"{where} frac")  # the one check of F
    if keep_k is not None and (isinstance(keep_k, bool) or not isinstance(keep_k, int) or keep_k < 1):
        raise UserError(f"{where} has keep_k = {keep_k!r}, not a positive integer.")


GEN_SHARES = ("routings_dropped_pct", "mass_lost_pct", "routings_dropped_pct_replay", "mass_lost_pct_replay")
GEN_OPTIONAL = ("io_saved_pct", "io_saved_pct_replay")


def _check_generation(p: Path, gen: Any) -> None:
    """quality.json's ``generation`` (written with ``--prompt``): per setting the first diverging
    token (or null) and the run's drops beside the replay's."""
    if not isinstance(gen, dict) or not isinstance(gen.get("rows"), list) or not gen["rows"]:
        raise UserError(f"{p}: \"generation\" must hold a non-empty list of settings under \"rows\".")
    for i, r in enumerate(gen["rows"]):
        if not isinstance(r, dict) or not isinstance(r.get("setting"), str) or not r["setting"]:
            raise UserError(f"{p}: generation setting {i + 1} is not an object with a \"setting\" label.")
        where = f"{p}: generation setting {r['setting']!r}"
        d, n = r.get("diverges_at"), r.get("tokens_generated")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise UserError(f"{where} has tokens_generated = {n!r}, not a count.")
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 0):
            raise UserError(f"{where} has diverges_at = {d!r}, not a token index or null.")
        for key in (*GEN_SHARES, *GEN_OPTIONAL):
            v = r.get(key)
            if v is None and key in GEN_OPTIONAL:
                continue
            if not _number(v) or (key in GEN_SHARES and not 0 <= v <= 100):
                raise UserError(f"{where} has {key} = {v!r}, not a percentage in 0..100.")


def generation_frame(results: list[QualityResult]) -> pl.DataFrame | None:
    """One row per (result, generation setting): where greedy generation first differs from the
    undropped run's (null: identical), tokens generated, and the run's drops beside the offline
    replay's; None when no result holds a generation."""
    rows = []
    for res in results:
        for r in (res.obj.get("generation") or {}).get("rows", []):
            rows.append({"quality": res.name, "setting": r["setting"], "frac": r.get("frac"), "keep_k": r.get("keep_k"),
                         "diverges_at": r["diverges_at"], "tokens_generated": r["tokens_generated"],
                         **{k: r.get(k) for k in ("routings_dropped_pct", "routings_dropped_pct_replay", "io_saved_pct",
                                                  "io_saved_pct_replay", "mass_lost_pct", "mass_lost_pct_replay")},
                         "text": r.get("text")})
    if not rows:
        return None
    schema = {"frac": pl.Float64, "keep_k": pl.Int64, "diverges_at": pl.Int64, "io_saved_pct": pl.Float64,
              "io_saved_pct_replay": pl.Float64, "text": pl.String}
    return pl.DataFrame(rows, schema_overrides=schema, infer_schema_length=None)


def load_quality(path: str | Path, option: str = "--quality") -> QualityResult:
    """Read and validate a quality result (directory or quality.json); one sentence on any problem."""
    from traces.io.atomic import note_input

    p = Path(path)
    note_input(p)  # an input of the command: no output of it may replace it
    if p.is_dir():
        p = p / "quality.json"
        if not p.is_file():
            raise UserError(f"{option} {str(path)!r}: the directory holds no quality.json ({WHAT}).")
    elif not p.is_file():
        raise UserError(f"{option} {str(path)!r}: no such quality result ({WHAT}).")
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        what = f"line {e.lineno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else e.__class__.__name__
        raise UserError(f"{p}: is not a JSON quality result ({what}).") from None
    if not isinstance(obj, dict) or obj.get("command") != "quality":
        got = obj.get("command") if isinstance(obj, dict) else type(obj).__name__
        raise UserError(f"{p}: is not a 'moe-replay quality' result (its command is {got!r}, not 'quality').")
    rows = obj.get("rows")
    if not isinstance(rows, list) or not rows:
        raise UserError(f"{p}: holds no settings (\"rows\" is missing or empty).")
    for i, r in enumerate(rows):
        _check_row(p, i, r)
    labels = [r["setting"] for r in rows]
    if len(set(labels)) != len(labels):
        raise UserError(f"{p}: a setting appears twice in \"rows\".")
    plain = obj.get("plain")
    if not (isinstance(plain, dict) and _number(plain.get("ppl")) and plain["ppl"] > 0
            and isinstance(plain.get("tokens"), int) and not isinstance(plain["tokens"], bool) and plain["tokens"] >= 2):
        raise UserError(f"{p}: \"plain\" must hold the undropped run's ppl (> 0) and tokens (an integer >= 2).")
    if not (_number(obj.get("budget_mib")) and obj["budget_mib"] >= 0):
        raise UserError(f"{p}: budget_mib {obj.get('budget_mib')!r} is not a non-negative number of MiB.")
    for key in ("policy", "engine"):
        if not isinstance(obj.get(key), str):
            raise UserError(f"{p}: {key} {obj.get(key)!r} is not a name.")
    if "generation" in obj:
        _check_generation(p, obj["generation"])
    res = QualityResult(p, p.parent.resolve().name, obj, None)
    plain_dir = p.parent / "plain"
    if plain_dir.is_dir():
        from traces import open_trace

        try:
            res.plain = open_trace(plain_dir)
        except UserError as e:
            res.warnings.append(f"its undropped trace {plain_dir} does not open ({str(e).rstrip('.')}), so its model is not "
                                "known and cannot be checked against the trace's")
    else:
        res.warnings.append(f"no undropped trace plain/ lies beside {p.name}, so its model is not known and cannot be "
                            "checked against the report's trace")
    return res


def _shape(t: Trace) -> str:
    return f"{len(t.moe_layers)} MoE layers x {t.n_expert} experts, top-{t.top_k}"


def match_trace(res: QualityResult, trace: Trace, trace_name: str) -> None:
    """Refuse a result of a differently shaped model; note a different name or expert size."""
    q = res.plain
    if q is None:
        return
    if (len(q.moe_layers), q.n_expert, q.top_k) != (len(trace.moe_layers), trace.n_expert, trace.top_k):
        raise UserError(f"{res.path}: its model ({q.model.get('name')}: {_shape(q)}) is not the trace {trace_name}'s "
                        f"({trace.model.get('name')}: {_shape(trace)}); give a quality result of the trace's model.")
    if q.model.get("name") != trace.model.get("name"):
        res.warnings.append(f"its model is named {q.model.get('name')!r}, the trace's {trace.model.get('name')!r} (the same "
                            "shape, so taken as the same model: check it)")
    if q.expert_bytes.tolist() != trace.expert_bytes.tolist():
        res.warnings.append("its experts are sized differently from the trace's (another dtype or quantization), so its "
                            "MiB per token and times are for its own sizes, not the trace's engine")


def load_all(paths: list[str | Path], trace: Trace, trace_name: str) -> list[QualityResult]:
    """Every result validated and matched before the report writes anything; names made unique."""
    out = [load_quality(p) for p in paths]
    seen: dict[str, int] = {}
    for r in out:
        match_trace(r, trace, trace_name)
        n = seen.get(r.name, 0) + 1
        seen[r.name] = n
        if n > 1:
            r.name = f"{r.name}#{n}"
    return out


def misses_per_token(res: QualityResult, read_mib: float) -> float | None:
    """Expert reads per token, from the bytes read when every MoE layer's experts weigh the same
    (the run's simulated cache counts bytes, not misses); None when that cannot be known."""
    if res.plain is None or len(set(res.plain.expert_bytes)) != 1 or res.plain.expert_bytes[0] <= 0:
        return None
    return read_mib * MIB / int(res.plain.expert_bytes[0]) / res.tokens


def price(res: QualityResult, read_mib: float, model: Any) -> tuple[float | None, float | None]:
    """(ms per token, misses per token) under ``model`` for ``read_mib`` read over the run's tokens:
    ``model.predict_ms(bytes per token, misses per token)``. The misses term is used only when the
    model has one (a manual model has none); ms is None when it is needed and unknown."""
    misses = misses_per_token(res, read_mib)
    if model.ms_per_miss and misses is None:
        return None, None
    return float(model.predict_ms(read_mib * MIB / res.tokens, misses or 0.0)), misses


def quality_frame(results: list[QualityResult], model: Any = None) -> pl.DataFrame:
    """One row per (result, setting): quality.json's figures as written, the run's reads avoided
    beside the offline replay's prediction and their gap (run - replay, percentage points), MiB
    read per token, and with a cost model ``ms_per_token`` / ``tok_s`` for that setting."""
    rows = []
    for res in results:
        for r in res.obj["rows"]:
            gap = (None if r["io_saved_pct"] is None or r["io_saved_pct_replay"] is None
                   else r["io_saved_pct"] - r["io_saved_pct_replay"])
            row = {"quality": res.name, "setting": r["setting"], "frac": r.get("frac"), "keep_k": r.get("keep_k")}
            row.update({k: r[k] for k in ("ppl", "ppl_delta_pct", "kl_mean", "kl_p95", "top1_agree_pct", "io_saved_pct",
                                          "io_saved_pct_replay")})
            row["io_saved_gap_pp"] = gap
            row.update({k: r.get(k) for k in ("routings_dropped_pct", "routings_dropped_pct_replay", "experts_dropped_pct",
                                              "experts_dropped_pct_replay", "mass_lost_pct", "mass_lost_pct_replay",
                                              "read_mib")})
            row["tokens"] = res.tokens
            row["read_mib_per_token"] = r["read_mib"] / res.tokens
            if model is not None:
                ms, _ = price(res, r["read_mib"], model)
                if ms is not None:  # a time, or a refusal naming the setting (replay.analyses.cost_sense)
                    from replay.analyses.cost_sense import check_times

                    check_times(model, [ms], [f"for quality setting {r['setting']} of {res.name}"])
                row["ms_per_token"] = ms
                row["tok_s"] = 1000.0 / ms if ms is not None and ms > 0 else None
                if getattr(model, "foreign", False):
                    row["cost_model_foreign"] = True
            rows.append(row)
    schema = {"frac": pl.Float64, "keep_k": pl.Int64, "io_saved_pct": pl.Float64, "io_saved_pct_replay": pl.Float64,
              "io_saved_gap_pp": pl.Float64, "experts_dropped_pct": pl.Float64, "experts_dropped_pct_replay": pl.Float64,
              "ms_per_token": pl.Float64, "tok_s": pl.Float64}
    return pl.DataFrame(rows, schema_overrides={k: v for k, v in schema.items() if rows and k in rows[0]},
                        infer_schema_length=None)
