"""``predict``: predictor accuracy per layer, as text tables or one JSON object.

The command only parses options and formats what :mod:`replay.analyses.accuracy` returns.
"""

from __future__ import annotations

import re
from pathlib import Path

import typer

from replay.cli.options import (
    JsonOpt,
    MixOpt,
    PredictorFileOpt,
    SplitSeedOpt,
    TraceArg,
    TrainOpt,
    TrainTraceOpt,
    example,
    learner_keywords,
)
from replay.predictors import REGISTRY as PREDICTOR_REGISTRY
from traces.format.errors import UserError

DEFAULT = ",".join(PREDICTOR_REGISTRY)
MAX_HORIZON = (1 << 15) - 1  # the layer column is int16; the trace's own MoE layers bound it further (evaluate)


def parse_horizons(text: str) -> list[int]:
    """``'1,2,3'`` or ``'1..4'`` (or a mix) -> sorted distinct horizons; bad -> UserError."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)\s*\.\.\s*(\d+)", part)
        if m:
            a, b = int(m.group(1)), int(m.group(2))
            if b > MAX_HORIZON:
                raise UserError(f"--horizon {text}: horizon {b} exceeds any trace (layers are int16: at most "
                                f"{MAX_HORIZON + 1:,} MoE layers, so a horizon below that).")
            if a > b:
                raise UserError(f"--horizon {text}: range {part} runs backwards.")
            out.update(range(a, b + 1))
        elif part.isdigit():
            if int(part) > MAX_HORIZON:
                raise UserError(f"--horizon {text}: horizon {part} exceeds any trace (layers are int16: at most "
                                f"{MAX_HORIZON + 1:,} MoE layers, so a horizon below that).")
            out.add(int(part))
        else:
            raise UserError(f"--horizon {text}: expected horizons like 1,2,3 or 1..8, got {part!r}.")
    if not out or min(out) < 1:
        raise UserError(f"--horizon {text}: a stale-gate horizon must be >= 1 (d=0 is ctrl).")
    return sorted(out)



def register(app: typer.Typer) -> None:
    @app.command(epilog=example("moe-replay predict traces/qwen --predictors prev-token,stale-gate --horizon 1..4"))
    def predict(
        trace: Path = TraceArg,
        predictors: str | None = typer.Option(None, "--predictors", help=f"Comma list of: {', '.join(PREDICTOR_REGISTRY)}; "
                                       "stale-gate alone means one per --horizon, stale-gate\\[d] one horizon "
                                       "[default: all of them and those of --predictor-file]."),
        horizon: str | None = typer.Option(None, "--horizon", help="Horizons in MoE layers for a bare stale-gate, "
                                           "pair-table or learned-gate, e.g. 1,2,3 or 1..8 [default: 1]."),
        horizon_curve: int | None = typer.Option(None, "--horizon-curve", help="Print stale-gate accuracy for "
                                                 "d = 1..D (overall and per layer) instead of the predictor table."),
        width: int | None = typer.Option(None, "--width", help="Experts each prediction names for recall, precision "
                                         "and mass [default: top-k]; slot/whole accuracy stay at top-k."),
        phase: str = typer.Option("decode", "--phase", help="Routings to score: decode | prefill | all (both)."),
        per_layer: bool = typer.Option(True, "--per-layer/--no-per-layer", help="Add the per-layer table (JSON: rows)."),
        train: str | None = TrainOpt,
        train_trace: Path | None = TrainTraceOpt,
        seed: int = SplitSeedOpt,
        byte_budget_mib: float | None = typer.Option(None, "--byte-budget-mib", help="MiB of guesses read per "
                                                     "routing: adds recall at that byte budget (guesses capped by "
                                                     "bytes, not by count)."),
        mix: str | None = MixOpt,
        predictor_file: list[Path] | None = PredictorFileOpt,
        json_out: bool = JsonOpt,
    ) -> None:
        """Predictor accuracy per layer: prev-token, stale-gate\\[d], ctrl, static hot lists, learned predictors
        (pair-table\\[d], request-match, mix) scored on tokens they never saw."""
        from replay.analyses.accuracy import check_horizon
        from replay.analyses.info import require_routings
        from replay.api import predict_run
        from replay.core.frames import rows_of
        from replay.core.phases import check_phase
        from replay.core.progress import progress
        from replay.plugin_files import register_files
        from replay.predictors import parse_predictor
        from replay.present.format import json_object
        from replay.present.predict import curve_text, predict_text
        from traces import open_trace

        register_files(None, predictor_file)
        check_phase(phase)
        if horizon_curve is not None and horizon is not None:
            raise UserError("--horizon and --horizon-curve: give one or the other.")
        # default: every registered predictor (with those of --predictor-file)
        names = [p for p in (s.strip() for s in (predictors if predictors is not None else DEFAULT).split(",")) if p]
        horizons = parse_horizons(horizon) if horizon is not None else [1]
        explicit = [(f, d) for f, d in (parse_predictor(n) for n in names) if d is not None]  # also validates the names
        from replay.predictors import module
        from replay.predictors import names as families

        bare = [n for n in names if n in families() and getattr(module(n), "PARAM", None)]
        if horizon is not None and not bare:
            raise UserError("--horizon is given but --predictors names no bare stale-gate (or pair-table, learned-gate) "
                            "to apply it to.")
        t = open_trace(trace)
        require_routings(t, "score")
        # Horizons the user asked for that reach beyond the trace's MoE layers are refused now, not
        # after a pass over the gate inputs that can score nothing (the default horizon 1 on a
        # one-layer trace is left to report itself unscored).
        if horizon is not None:
            for fam in dict.fromkeys(bare):
                check_horizon(t, horizons[-1], "--horizon", fam)
        if horizon_curve is not None and horizon_curve >= 1:
            check_horizon(t, horizon_curve, "--horizon-curve")
        for fam, d in explicit:  # each family's own check (a plugin's too), not stale-gate's for every name
            check_horizon(t, d, "--predictors", fam)
        with progress(len(t.parts), "gate inputs", unit="part") as bar:
            res = predict_run(t, predictors=names if predictors is not None else None, horizons=horizons, width=width,
                              phase=phase, max_horizon=horizon_curve, progress=bar, predictor_file=predictor_file,
                              byte_budget_mib=byte_budget_mib, seed=seed,
                              **learner_keywords(train, train_trace, mix))
        if json_out:
            frame = res.frame if per_layer else res.overall()
            typer.echo(json_object(
                "predict", str(trace), rows_of(frame), k=res.k, width=res.width, phase=res.phase,
                predictors=res.predictors, unavailable=res.unavailable, warnings=res.warnings, notes=res.notes,
                ctrl_ok=None if res.ctrl_failing_layers is None else not res.ctrl_failing_layers,
                ctrl_failing_layers=res.ctrl_failing_layers,
                horizon_curve=horizon_curve, train=res.train, train_text=res.train_text, in_sample=res.in_sample,
                evaluated_routings=res.evaluated,
            ))
        elif horizon_curve is not None:
            typer.echo(curve_text(trace, t, res, per_layer))
        else:
            typer.echo(predict_text(trace, t, res, per_layer))
