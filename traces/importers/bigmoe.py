"""Importer for BigMoeOnEdge's ``--route-trace`` CSV ("route_trace v1") and its ``.metrics`` file.

route.csv: ``#`` preamble (``# route_trace v1``; ``# model=... arch=... n_layer=... n_expert=...
n_expert_used=...``; one ``# layer=L expert_bytes=B dense_bytes=D`` per layer), a header
``turn,phase,step,layer,slot,expert,weight,residency,expert_bytes[,dropped]`` and one row per
routed expert. That engine evaluated each turn's prompt in one pass, so a turn's prefill is one
batch; each decoded token is its own batch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from traces.format.errors import TraceError, UserError
from traces.format.gating import KNOWN_ARCH_GATING
from traces.format.schema import MAX_BUDGET_MIB, MAX_BYTES, MAX_INT32, MAX_LAYERS, default_gating, metrics_first_problem
from traces.format.version import __version__ as tool_version
from traces.importers import read_text, repeated_expert_rows
from traces.io.atomic import staged_dir
from traces.io.digest import sha256_file
from traces.io.reader import open_trace
from traces.io.writer import TraceWriter

HEADER = ["turn", "phase", "step", "layer", "slot", "expert", "weight", "residency", "expert_bytes"]
METRICS_HEADER = ["step", "steps", "wall_ms", "io_ms", "compute_ms", "read_bytes", "cache_hit_pct",
                  "stall_ms", "mgmt_ms", "majflt", "cpu_ms"]
METRICS_INT = {"step", "steps", "read_bytes", "majflt"}


def _kv(line: str) -> dict[str, str]:
    out = {}
    for tok in line.lstrip("#").split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            out[k] = v
    return out


def _int(s: str, path: Path, lineno: int, what: str) -> int:
    try:
        return int(s)
    except ValueError:
        raise UserError(f"{path}: line {lineno}: {what} {s!r} is not an integer.") from None


def parse_route_csv(path: Path) -> dict[str, Any]:
    """Parse and check a route_trace v1 CSV; return the preamble and per-row numpy columns."""
    text = read_text(path)  # a byte-order mark (Windows editors) is not text
    lines = text.splitlines()
    if not lines or lines[0].strip() != "# route_trace v1":
        raise UserError(f"{path}: missing the '# route_trace v1' preamble line; not a BigMoeOnEdge route trace.")
    model: dict[str, str] = {}
    layer_bytes: dict[int, tuple[int, int]] = {}
    i = 1
    while i < len(lines) and lines[i].startswith("#"):
        kv = _kv(lines[i])
        if "model" in kv:
            model = kv
        elif "layer" in kv:
            layer = _int(kv["layer"], path, i + 1, "layer")
            eb = _int(kv.get("expert_bytes", "x"), path, i + 1, "expert_bytes")
            db = _int(kv.get("dense_bytes", "0"), path, i + 1, "dense_bytes")
            if not 0 <= eb <= MAX_BYTES or not 0 <= db <= MAX_BYTES:
                raise UserError(f"{path}: line {i + 1}: expert_bytes={eb} dense_bytes={db} is not a byte count in 0..2^40 "
                                "(1 TiB) per expert and per layer.")
            layer_bytes[layer] = (eb, db)
        i += 1
    for key in ("arch", "n_layer", "n_expert", "n_expert_used"):
        if key not in model:
            raise UserError(f"{path}: the '# model=...' preamble line is missing or has no {key}=.")
    n_layer = _int(model["n_layer"], path, 2, "n_layer")
    n_expert = _int(model["n_expert"], path, 2, "n_expert")
    k = _int(model["n_expert_used"], path, 2, "n_expert_used")
    if n_layer <= 0 or n_expert <= 0 or not 0 < k <= n_expert:
        raise UserError(f"{path}: preamble gives n_layer={n_layer}, n_expert={n_expert}, n_expert_used={k}, "
                        "which is not a MoE model (need n_expert >= n_expert_used > 0).")
    if n_layer > MAX_LAYERS or n_expert > MAX_INT32:
        raise UserError(f"{path}: preamble gives n_layer={n_layer}, n_expert={n_expert}; a trace holds at most "
                        f"{MAX_LAYERS} layers and {MAX_INT32} experts.")
    if i >= len(lines):
        raise UserError(f"{path}: has a preamble but no header line and no rows.")
    header = lines[i].strip().split(",")
    has_dropped = header == HEADER + ["dropped"]
    if header != HEADER and not has_dropped:
        raise UserError(f"{path}: line {i + 1}: header is {lines[i].strip()!r}, expected {','.join(HEADER)}[,dropped].")
    ncol = len(header)
    body = [(n + 1, ln) for n, ln in enumerate(lines[i + 1:], start=i + 1) if ln.strip() and not ln.startswith("#")]
    if not body:
        raise UserError(f"{path}: has a header but no rows.")
    n = len(body)
    # Columns in file order; weight (column 6) is parsed as a float, all others as integers.
    int_cols = [c for c in range(ncol) if c != 6]
    ints = np.empty((n, ncol), dtype=np.int64)
    weight = np.empty(n, dtype=np.float32)
    linenos = np.empty(n, dtype=np.int64)
    for r, (lineno, ln) in enumerate(body):
        f = ln.split(",")
        if len(f) != ncol:
            raise UserError(f"{path}: line {lineno}: has {len(f)} fields, expected {ncol}.")
        for c in int_cols:
            try:
                ints[r, c] = int(f[c])
            except (ValueError, OverflowError):
                raise UserError(f"{path}: line {lineno}: {header[c]} {f[c]!r} is not an integer.") from None
        try:
            w = float(f[6])
        except ValueError:
            raise UserError(f"{path}: line {lineno}: weight {f[6]!r} is not a number.") from None
        if math.isinf(w) or abs(w) > 3.0e38:
            raise UserError(f"{path}: line {lineno}: weight {f[6]} is infinite or beyond float32.")
        if w < 0:
            raise UserError(f"{path}: line {lineno}: weight {f[6]} is negative (the applied routing weight is >= 0).")
        weight[r] = w
        linenos[r] = lineno
    turn, phase, step, layer, slot, expert = (ints[:, c] for c in range(6))
    residency, read_bytes = ints[:, 7], ints[:, 8]
    dropped = ints[:, 9] if has_dropped else None

    def bad_row(mask: np.ndarray, what: str) -> None:
        idx = np.flatnonzero(mask)
        if idx.size:
            raise UserError(f"{path}: line {linenos[idx[0]]}: {what}.")

    bad_row((turn < 0) | (step < 0), "negative turn or step")
    bad_row((turn > MAX_INT32) | (step > MAX_INT32), f"turn or step above {MAX_INT32}")
    bad_row((phase != 0) & (phase != 1), "phase is not 0 (prefill) or 1 (decode)")
    bad_row((layer < 0) | (layer >= n_layer), f"layer outside 0..{n_layer - 1}")
    bad_row((slot < 0) | (slot >= k), f"slot outside 0..{k - 1} (n_expert_used={k})")
    bad_row((expert < 0) | (expert >= n_expert), f"expert id outside 0..{n_expert - 1}")
    bad_row((residency < 0) | (residency > 2), "residency is not 0 (miss), 1 (hit) or 2 (speculative hit)")
    bad_row((read_bytes < 0) | (read_bytes >= 1 << 32), "expert_bytes (bytes read) is negative or too large")
    if dropped is not None:
        bad_row((dropped != 0) & (dropped != 1), "dropped is not 0 or 1")
    for lay in np.unique(layer):
        eb = layer_bytes.get(int(lay), (0, 0))[0]
        if eb <= 0:
            # Never default a missing size: a free layer is never evicted and reports ~100% hit.
            raise UserError(f"{path}: layer {lay} routes but the preamble gives it no expert_bytes > 0.")

    # One routing = (turn, phase, step, layer) with every slot 0..k-1 exactly once.
    order = np.lexsort((slot, layer, step, phase, turn))
    key = np.stack([turn, phase, step, layer, slot], axis=1)[order]
    dup = np.flatnonzero((np.diff(key, axis=0) == 0).all(axis=1))
    if dup.size:
        raise UserError(f"{path}: line {linenos[order[dup[0] + 1]]}: duplicates an earlier row (same turn, phase, step, layer, slot).")
    rkey = key[:, :4]
    starts = np.flatnonzero(np.concatenate([[True], (np.diff(rkey, axis=0) != 0).any(axis=1)]))
    sizes = np.diff(np.concatenate([starts, [n]]))
    bad = np.flatnonzero(sizes != k)
    if bad.size:
        s = starts[bad[0]]
        raise UserError(f"{path}: line {linenos[order[s]]}: routing (turn {rkey[s, 0]}, step {rkey[s, 2]}, layer {rkey[s, 3]}) "
                        f"has {sizes[bad[0]]} slots, expected {k}.")
    R = starts.size

    def per_slot(col: np.ndarray) -> np.ndarray:
        return col[order].reshape(R, k)

    ex = per_slot(expert)
    twice = repeated_expert_rows(ex)
    if twice.size:
        raise UserError(f"{path}: line {linenos[order[starts[twice[0]]]]}: a routing selects the same expert twice.")
    w = per_slot(weight)
    nan = np.isnan(w)
    partial = np.flatnonzero(nan.any(axis=1) & ~nan.all(axis=1))
    if partial.size:
        raise UserError(f"{path}: line {linenos[order[starts[partial[0]]]]}: a routing has NaN weights on some slots "
                        "but not all (NaN is accepted only when the engine exposed no weights for the routing).")
    # Without a selection bias (this format carries none), the router's rank order is descending weight.
    unranked = np.flatnonzero((w[:, 1:] > w[:, :-1]).any(axis=1)) if k > 1 else np.array([], dtype=np.int64)
    if unranked.size:
        r = int(unranked[0])
        raise UserError(f"{path}: line {linenos[order[starts[r]]]}: the routing of layer {rkey[starts[r], 3]} at step "
                        f"{rkey[starts[r], 2]} has weights {', '.join(f'{x:g}' for x in w[r])} by slot, not in router "
                        "rank order (descending weight).")
    r_turn, r_phase, r_step, r_layer = (rkey[starts, c] for c in range(4))
    # A phase may not go back from decode to prefill inside one turn.
    return {
        "model": model, "n_layer": n_layer, "n_expert": n_expert, "k": k, "layer_bytes": layer_bytes,
        "turn": r_turn, "phase": r_phase, "step": r_step, "layer": r_layer, "experts": ex, "weights": w,
        "residency": per_slot(residency), "read_bytes": per_slot(read_bytes),
        "dropped": per_slot(dropped) if dropped is not None else None,
    }


def assign_batches(turn: np.ndarray, phase: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Batch index per routing: a turn's prefill is one batch, each decode step its own batch,
    numbered in (turn, phase, step) order."""
    bstep = np.where(phase == 0, -1, step)
    key = np.stack([turn, phase, bstep], axis=1)
    _, inv = np.unique(key, axis=0, return_inverse=True)
    return inv.reshape(-1).astype(np.int32)


def parse_metrics(path: Path) -> tuple[pa.Table, dict[str, Any]]:
    """Per-token engine metrics: a table (one row per decoded token) and the ``# summary`` values.

    Every value must be a plausible measurement (finite, >= 0, times under a day per token, hit
    rates <= 100, integer counts); the summary's cache budget and hit rate must be numbers."""
    if not path.exists():
        raise UserError(f"{path}: no such file.")
    if not path.is_file():
        raise UserError(f"{path}: is not a file.")
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError:
        raise UserError(f"{path}: is not a text file (not UTF-8).") from None
    rows = [(n + 1, ln) for n, ln in enumerate(lines) if ln.strip() and not ln.startswith("#")]
    summary: dict[str, Any] = {}
    for ln in lines:
        if ln.startswith("# summary"):
            for k, v in _kv(ln[len("# summary"):]).items():
                try:
                    x = float(v)
                except ValueError:
                    x = None
                summary[k] = x if x is not None and math.isfinite(x) else v  # trace.json holds no NaN/inf
    if not rows:
        raise UserError(f"{path}: has no header and no rows; not a .metrics file.")
    header = rows[0][1].strip().split(",")
    missing = [c for c in METRICS_HEADER if c not in header]
    if missing:
        raise UserError(f"{path}: line {rows[0][0]}: header lacks {', '.join(missing)}; not a BigMoeOnEdge .metrics file.")
    cols: dict[str, list[float]] = {c: [] for c in header}
    linenos = [lineno for lineno, _ in rows[1:]]
    for lineno, ln in rows[1:]:
        f = ln.split(",")
        if len(f) != len(header):
            raise UserError(f"{path}: line {lineno}: has {len(f)} fields, expected {len(header)}.")
        for c, v in zip(header, f):
            try:
                x = float(v)
            except ValueError:
                raise UserError(f"{path}: line {lineno}: {c} {v!r} is not a number.") from None
            if not math.isfinite(x):
                raise UserError(f"{path}: line {lineno}: {c} is not finite.")
            cols[c].append(x)
    if not cols["step"]:
        raise UserError(f"{path}: has a header but no per-token rows.")
    for c, v in cols.items():
        arr = np.array(v, dtype=np.float64)
        bad = metrics_first_problem(c, arr)
        if bad is None and c in METRICS_INT and (arr != np.floor(arr)).any():
            bad = (int(np.flatnonzero(arr != np.floor(arr))[0]), f"{c} is not an integer")
        if bad is not None:
            raise UserError(f"{path}: line {linenos[bad[0]]}: {bad[1]}.")
    if (np.array(cols["wall_ms"]) <= 0).any():
        raise UserError(f"{path}: line {linenos[int(np.argmax(np.array(cols['wall_ms']) <= 0))]}: wall_ms is not > 0.")
    if "cache_budget_MiB" not in summary or "cache_hit_pct" not in summary:
        raise UserError(f"{path}: the '# summary' line is missing or lacks cache_budget_MiB / cache_hit_pct.")
    budget, hit = summary["cache_budget_MiB"], summary["cache_hit_pct"]
    if not isinstance(budget, float) or not 0 < budget <= MAX_BUDGET_MIB:
        raise UserError(f"{path}: the '# summary' line gives cache_budget_MiB={budget}, not a positive number of MiB.")
    if not isinstance(hit, float) or not 0 <= hit <= 100:
        raise UserError(f"{path}: the '# summary' line gives cache_hit_pct={hit}, not a percentage in 0..100.")
    table = pa.table({
        c: pa.array(np.array(v, dtype=np.int64 if c in METRICS_INT else np.float64)) for c, v in cols.items()
    })
    return table, summary


def check_metrics_match(p: dict[str, Any], route_csv: Path, metrics: Path, table: pa.Table, summary: dict[str, Any]) -> None:
    """Refuse a .metrics file that belongs to another run: the token counts must agree, and every
    decoded token's recorded bytes read must cover the expert bytes the route CSV says it read."""
    dec = p["phase"] == 1
    keys = np.stack([p["turn"], p["step"]], axis=1)
    uniq, inv = np.unique(keys[dec], axis=0, return_inverse=True)
    n_decode = uniq.shape[0]
    n_prefill = len(np.unique(keys[~dec], axis=0))

    def refuse(what: str) -> None:
        raise UserError(f"{metrics}: {what}; not the metrics of the run in {route_csv}.")

    if table.num_rows != n_decode:
        refuse(f"has {table.num_rows} per-token rows but {route_csv.name} has {n_decode} decode tokens")
    if isinstance(summary.get("tokens"), float) and summary["tokens"] != n_decode:
        refuse(f"its summary says tokens={summary['tokens']:g} but {route_csv.name} has {n_decode} decode tokens")
    if len(np.unique(p["turn"])) == 1:  # one turn: the engine's counts are the run's (multi-turn runs: unknown)
        if isinstance(summary.get("n_prompt"), float) and summary["n_prompt"] != n_prefill:
            refuse(f"its summary says n_prompt={summary['n_prompt']:g} but {route_csv.name} has {n_prefill} prompt tokens")
        steps = table.column("steps").to_numpy()
        if (steps != n_decode).any():
            refuse(f"its steps column says {int(steps[np.argmax(steps != n_decode)])} decode steps, "
                   f"{route_csv.name} has {n_decode}")
        if not np.array_equal(table.column("step").to_numpy(), np.arange(1, n_decode + 1)):
            refuse(f"its step column does not count 1..{n_decode}")
    expert_read = np.bincount(inv.reshape(-1), weights=p["read_bytes"][dec].sum(axis=1).astype(np.float64),
                              minlength=n_decode)
    recorded = table.column("read_bytes").to_numpy().astype(np.float64)
    short = np.flatnonzero(recorded < expert_read)
    if short.size:
        t = int(short[0])
        refuse(f"decode token {t + 1} read {recorded[t]:.0f} bytes in all, fewer than the {expert_read[t]:.0f} "
               f"bytes of expert reads {route_csv.name} records for it")


def import_bigmoe(route_csv: str | Path, out_dir: str | Path, metrics: str | Path | None = None,
                  top_k_native: int | None = None, force: bool = False, tokens_per_part: int = 4096) -> Path:
    """Import a route_trace v1 CSV (plus optional .metrics) into a new v1 trace at ``out_dir``."""
    route_csv, out_dir = Path(route_csv), Path(out_dir)
    p = parse_route_csv(route_csv)
    k, n_expert, n_layer = p["k"], p["n_expert"], p["n_layer"]
    if top_k_native is not None and not k <= top_k_native <= n_expert:
        raise UserError(f"--top-k-native {top_k_native} must lie in {k}..{n_expert} (the run routed top-{k}).")
    mtable, summary = (None, None)
    if metrics is not None:
        mtable, summary = parse_metrics(Path(metrics))
        check_metrics_match(p, route_csv, Path(metrics), mtable, summary)
    batch = assign_batches(p["turn"], p["phase"], p["step"])
    order = np.lexsort((p["step"], p["layer"], batch))
    routed = sorted(set(int(x) for x in np.unique(p["layer"])))
    with_bytes = sorted(l for l, (eb, _) in p["layer_bytes"].items() if eb > 0 and 0 <= l < n_layer)
    moe_layers = sorted(set(routed) | set(with_bytes))
    expert_bytes: list[int | None] = [None] * n_layer
    dense_bytes: list[int | None] = [None] * n_layer
    for l, (eb, db) in p["layer_bytes"].items():
        if 0 <= l < n_layer:
            expert_bytes[l] = eb if eb > 0 else None
            dense_bytes[l] = db
    arch = p["model"]["arch"]
    act, norm = KNOWN_ARCH_GATING.get(arch, (None, None))
    name = Path(p["model"].get("model", "unknown")).name
    meta: dict[str, Any] = {
        "model": {
            "name": name.removesuffix(".gguf"), "arch": arch, "n_layer": n_layer, "moe_layers": moe_layers,
            "n_expert": n_expert, "top_k": k, "top_k_native": top_k_native, "n_embd": None,
        },
        "expert_bytes": expert_bytes,
        "dense_bytes": dense_bytes,
        "gating": default_gating(act, norm),
        "provenance": {
            "engine": "BigMoeOnEdge", "engine_version": None, "tool": "moe-replay", "tool_version": tool_version,
            "importer": "bigmoe", "source_file": route_csv.name, "source_sha256": sha256_file(route_csv),
            "metrics_file": Path(metrics).name if metrics is not None else None,
            "metrics_sha256": sha256_file(Path(metrics)) if metrics is not None else None,
            "prompts": None, "batching": "prefill of a turn = one batch; each decode step = one batch",
            # The preamble's model path as written: 'export bigmoe' writes it back (a byte-identical round trip).
            "model_path": p["model"].get("model"),
        },
    }
    if summary is not None:
        meta["recorded"] = {
            "policy": "lru",
            "budget_mib": summary["cache_budget_MiB"],
            "cache_hit_pct_cum": summary["cache_hit_pct"],
            "summary": summary,
        }
    columns = ("residency", "read_bytes") + (("dropped",) if p["dropped"] is not None else ())
    with staged_dir(out_dir, force=force, inputs=[route_csv, metrics]) as stage:
        w = TraceWriter(stage, meta, columns=columns, tokens_per_part=tokens_per_part)
        opt = {"residency": p["residency"][order], "read_bytes": p["read_bytes"][order]}
        if p["dropped"] is not None:
            opt["dropped"] = p["dropped"][order].astype(bool)
        w.append(turn=p["turn"][order], batch=batch[order], phase=p["phase"][order], step=p["step"][order],
                 layer=p["layer"][order], experts=p["experts"][order], weights=p["weights"][order], **opt)
        if mtable is not None:
            w.write_metrics(mtable)
        w.close(complete=True)
        try:
            open_trace(stage)
        except TraceError as e:
            raise UserError(f"{route_csv}: does not make a valid trace: {e.problem}") from None
    return out_dir


# -- registry entry (traces/importers/__init__.py) ------------------------------------------------

NAME = "bigmoe"
SUMMARY = "BigMoeOnEdge --route-trace CSV ('# route_trace v1'), optionally with its .metrics file"
ENGINE = "BigMoeOnEdge"
TAKES_SIZES = False  # the preamble states each layer's expert_bytes
MAX_SOURCES = 1


def _options() -> tuple:
    from traces.importers import ImportOption

    return (
        ImportOption("metrics", "--metrics", Path, "The run's per-token .metrics file."),
        ImportOption("top_k_native", "--top-k-native", int, "The model's native top-k, if the run overrode it."),
    )


OPTIONS = _options()


def sniff(paths: list[Path]) -> bool:
    from traces.importers import head_lines

    return len(paths) == 1 and head_lines(paths[0], 64)[:1] == ["# route_trace v1"]


def import_(sources: list[Path], out_dir: Path, *, sizes: Any = None, force: bool = False,
            metrics: Path | None = None, top_k_native: int | None = None) -> Path:
    return import_bigmoe(sources[0], out_dir, metrics=metrics, top_k_native=top_k_native, force=force)
