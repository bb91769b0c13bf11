"""Importers from other engines' route logs into trace format v1: one module per format, one registry.

The contract of an importer module (``traces/importers/<name>.py``; a new format is one new module
found by :func:`importer_modules`: nothing else to edit):

``NAME: str``
    The format's name on the command line (``moe-replay import NAME SRC... OUT``).
``SUMMARY: str``
    One line for ``moe-replay import --list``: the engine and the file it writes.
``ENGINE: str``
    The engine that writes the format (provenance).
``TAKES_SIZES: bool``
    True when the format carries no expert sizes, so the command takes ``--expert-bytes N`` /
    ``--sizes-from MODEL.gguf`` / ``--sizes-from config.json --dtype D`` (:mod:`traces.importers._sizes`) and
    the importer refuses to write without one of them. False when the file states its sizes.
``MAX_SOURCES: int | None``
    How many source files one import reads (None: any number, e.g. one file per layer or rank).
``OPTIONS: tuple[ImportOption, ...]``
    The format's own options. The CLI derives its flags, help and types from them; the library
    receives them as keyword arguments named :attr:`ImportOption.name`.
``sniff(paths: list[Path]) -> bool``
    Cheap recognition for ``import auto``: reads at most a few kilobytes of each file, never raises
    for a file of another format (a missing or unreadable file is simply not recognised).
``GENERIC: bool`` (optional)
    True for an importer of any table (``table``): where a dedicated importer also recognises the
    files, ``import auto`` chooses the dedicated one.
``auto_refusal(paths: list[Path]) -> str | None`` (optional)
    For a file the importer would read with one more option: a clause naming what is missing and
    the option (``import auto`` refuses with it); None otherwise.
``import_(sources: list[Path], out_dir: Path, *, sizes: ExpertSizes | None, force: bool, **options) -> Path``
    Read ``sources`` exactly as the engine writes them and write one trace at ``out_dir`` through
    :func:`write_trace` (staged: nothing half-written), or raise :class:`~traces.format.errors.UserError`
    with one sentence naming the file and the problem. What the importer had to infer (token order
    from file order, batches, n_expert from the largest id) goes into ``provenance.notes``, which
    the CLI prints after the import.

Every importer records provenance through :func:`provenance`: the format, each source file with
its sha256 and size, the engine and its version when the file says it, the tool version, and the
sizes' origin.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from traces.format.completeness import compact_ranges
from traces.format.errors import TraceError, UserError
from traces.io.digest import sha256_file
from traces.util.bounded_json import BoundsError, parse_bounded


def importer_modules() -> list[str]:
    """Every importer module: each public module of this package (``_name`` modules are helpers),
    in name order -- the order ``import --list`` shows. A new format is one new file, nothing else."""
    import pkgutil

    return sorted(f"{__name__}.{m.name}" for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


@dataclass(frozen=True)
class ImportOption:
    """One format-specific option: ``name`` is the keyword ``import_`` receives, ``flag`` the CLI's
    spelling, ``type`` one of ``Path``, ``int``, ``float``, ``str``, ``bool`` (a bool is an on/off flag)."""

    name: str
    flag: str
    type: type
    help: str
    default: Any = None


# Every format takes --drop-warmup (issue 30 item 4): the check runs in write_trace, the one write path.
DROP_WARMUP = ImportOption("drop_warmup", "--drop-warmup", bool, "Leave out rows that look like an engine's warm-up "
                           "(profiling or dummy) pass: runs of tokens routed alike at every layer or with exactly "
                           "uniform weights (default: keep them and say so).", False)


def _load(modname: str) -> ModuleType:
    mod = importlib.import_module(modname)
    for attr in ("NAME", "SUMMARY", "ENGINE", "TAKES_SIZES", "MAX_SOURCES", "OPTIONS", "sniff", "import_"):
        if not hasattr(mod, attr):
            raise TypeError(f"importer module {modname} lacks {attr} (see traces/importers/__init__.py)")
    return mod


def registry() -> dict[str, ModuleType]:
    """Every importer by its NAME, in :func:`importer_modules` order."""
    mods = [_load(m) for m in importer_modules()]
    return {m.NAME: m for m in mods}


def get(name: str) -> ModuleType:
    reg = registry()
    if name not in reg:
        raise UserError(f"unknown import format {name!r}; known: {', '.join(reg)} (or auto).")
    return reg[name]


def sniff_formats(paths: Sequence[Path]) -> list[str]:
    """The formats whose ``sniff`` recognises ``paths`` (a sniffer that fails counts as no)."""
    out = []
    for name, mod in registry().items():
        try:
            ok = bool(mod.sniff(list(paths)))
        except Exception:  # noqa: BLE001 - a sniffer must not decide for another format by crashing
            ok = False
        if ok:
            out.append(name)
    return out


def choose_format(paths: Sequence[Path]) -> str:
    """The one format that recognises ``paths``, or a one-sentence refusal. A generic importer
    (``GENERIC = True``: ``table``) also reads what some engines write as tables (vLLM's
    routed_experts arrays): where one dedicated importer recognises the files too, it is chosen (and
    said by the CLI). Where a generic importer would read the files but needs an option to (its
    ``auto_refusal`` says what is missing: the layer, which column family), the refusal names it
    and that option."""
    srcs = ", ".join(str(p) for p in paths)
    for p in paths:
        check_source(p)
    reg = registry()
    found = sniff_formats(paths)
    dedicated = [f for f in found if not getattr(reg[f], "GENERIC", False)]
    if len(dedicated) == 1:
        found = dedicated
    if not found:
        for name, mod in reg.items():
            why = mod.auto_refusal(list(paths)) if hasattr(mod, "auto_refusal") else None
            if why is not None:
                raise UserError(f"{srcs}: reads as a table of routings, but {why}: 'moe-replay import {name} SRC... "
                                "OUT' with that option imports it.")
        raise UserError(f"{srcs}: no importer recognises it (tried {', '.join(reg)}); name the format "
                        "with 'moe-replay import FORMAT SRC... OUT'.")
    if len(found) > 1:
        raise UserError(f"{srcs}: matches several formats ({', '.join(found)}); name one with "
                        "'moe-replay import FORMAT SRC... OUT'.")
    return found[0]


# -- shared helpers -------------------------------------------------------------------------------

def check_source(path: Path) -> Path:
    """Refuse a missing source or a directory in one sentence."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p}: no such file.")
    if not p.is_file():
        raise UserError(f"{p}: is not a file.")
    return p


def head_bytes(path: Path, n: int = 4096) -> bytes:
    """The first ``n`` bytes of ``path`` (b"" when it cannot be read): what a sniffer looks at."""
    try:
        with open(path, "rb") as fh:
            return fh.read(n)
    except OSError:
        return b""


def head_lines(path: Path, n: int = 4096) -> list[str]:
    """The complete text lines in the first ``n`` bytes of ``path`` ([] for a non-text file)."""
    raw = head_bytes(path, n)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        return []
    lines = text.splitlines()
    if len(raw) == n and lines and not text.endswith("\n"):
        lines = lines[:-1]  # the last line may be cut
    return lines


def read_text(path: Path) -> str:
    check_source(path)
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise UserError(f"{path}: is not a text file (not UTF-8).") from None


def json_objects(path: Path) -> list[tuple[str, Any]]:
    """The JSON values of a .jsonl file (one a non-blank line) or of a .json file (its list's items,
    or its one value), each with where it stands ("<path>: line N", "<path>: item I" or "<path>")."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise UserError(f"{path}: is not a text file (not UTF-8).") from None
    if path.suffix.lower() == ".jsonl":
        objs: list[tuple[str, Any]] = []
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                objs.append((f"{path}: line {n}", parse_bounded(line)))
            except json.JSONDecodeError as e:
                raise UserError(f"{path}: line {n}: is not valid JSON ({e.msg}; a truncated file?).") from None
            except BoundsError as e:
                raise UserError(f"{path}: line {n}: {e}.") from None
        return objs
    try:
        data = parse_bounded(text)  # nesting and integers bounded before they reach the importer
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: is not valid JSON ({e.msg} at line {e.lineno}; a truncated file?).") from None
    except BoundsError as e:
        raise UserError(f"{path}: {e}.") from None
    items = data if isinstance(data, list) else [data]
    return [(f"{path}: item {i}" if isinstance(data, list) else str(path), o) for i, o in enumerate(items)]


def provenance(fmt: str, sources: Iterable[Path], *, engine: str, engine_version: str | None = None,
               notes: Iterable[str] = (), sizes: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """trace.json's ``provenance`` for an import: format, each source (file name, sha256, bytes),
    the engine and its version when the file states it, the tool version, the sizes' origin and
    the notes (what was inferred and how). File names only, never absolute paths: the same files
    imported from another folder give a byte-identical trace."""
    from traces.format.version import __version__ as tool_version

    srcs = [Path(s) for s in sources]
    files = [{"file": s.name, "sha256": sha256_file(s), "bytes": s.stat().st_size} for s in srcs]
    prov: dict[str, Any] = {
        "engine": engine, "engine_version": engine_version, "tool": "moe-replay", "tool_version": tool_version,
        "importer": fmt, "source_file": files[0]["file"] if files else None,
        "source_sha256": files[0]["sha256"] if files else None, "sources": files, "prompts": None,
        "notes": list(notes),
    }
    if sizes is not None:
        prov["sizes"] = sizes
    prov.update(extra)
    return prov


def field_notes(read: dict[str, str], seen: Iterable[str], what: str = "fields") -> list[str]:
    """Two notes accounting for every source field (issue 30): which became which trace column or
    provenance entry (``read``: source field -> what it became; only those the log has are named)
    and every field the log has that the import did not use."""
    seen = list(dict.fromkeys(seen))
    got = [f"{src} -> {dst}" for src, dst in read.items() if src in seen]
    unused = [f for f in seen if f not in read]
    return [f"source {what} read: {', '.join(got) if got else 'none'}",
            f"source {what} not used: {', '.join(unused)}" if unused else f"every source {what[:-1]} was used"]


def infer_shape(what: Path | str, layers: np.ndarray, experts: np.ndarray, sizes: Any, *, n_layer: int | None = None,
                n_expert: int | None = None, notes: list[str]) -> tuple[int, int]:
    """(n_layer, n_expert) of an imported log: from the log when it says, else from the model the sizes
    came from, else the largest id + 1 (said in ``notes``). An id beyond the model's range is refused."""
    max_layer = int(layers.max()) if layers.size else -1
    max_expert = int(experts.max()) if experts.size else -1
    if experts.size and int(experts.min()) < 0:
        raise UserError(f"{what}: holds a negative expert id ({int(experts.min())}).")
    if layers.size and int(layers.min()) < 0:
        raise UserError(f"{what}: holds a negative layer index ({int(layers.min())}).")
    if n_layer is None and sizes is not None and sizes.n_layer is not None:
        n_layer = sizes.n_layer
    if n_expert is None and sizes is not None and sizes.n_expert is not None:
        n_expert = sizes.n_expert
    if n_layer is None:
        n_layer = max_layer + 1
        notes.append(f"the log does not state the layer count: n_layer = largest layer index + 1 = {n_layer}")
    if n_expert is None:
        n_expert = max_expert + 1
        notes.append(f"the log does not state the expert count: n_expert = largest expert id + 1 = {n_expert} "
                     "(add --sizes-from MODEL to take it from the model)")
    if max_layer >= n_layer:
        raise UserError(f"{what}: routes layer {max_layer}, but the model has {n_layer} layers (0..{n_layer - 1}).")
    if max_expert >= n_expert:
        raise UserError(f"{what}: routes expert {max_expert}, but the model has {n_expert} experts (ids 0..{n_expert - 1}).")
    return n_layer, n_expert


def make_meta(*, what: str | Path, name: str, arch: str, n_layer: int, layers: list[int], n_expert: int, top_k: int,
              sizes: Any, prov: dict[str, Any], n_embd: int | None = None, top_k_native: int | None = None,
              gating: dict[str, Any] | None = None) -> dict[str, Any]:
    """trace.json content for an imported log that routes ``layers``: expert and dense bytes from
    ``sizes``; where the sizes' model has MoE layers the log lacks, they are listed as
    ``model.moe_layers_absent`` and said in the notes (a report covers the layers the log has;
    nothing is extrapolated)."""
    from traces.format.gating import KNOWN_ARCH_GATING
    from traces.format.schema import default_gating
    from traces.importers._sizes import describe

    eb, db = sizes.for_layers(n_layer, layers, what)
    model: dict[str, Any] = {"name": name, "arch": arch, "n_layer": n_layer, "moe_layers": list(layers),
                             "n_expert": n_expert, "top_k": top_k, "top_k_native": top_k_native, "n_embd": n_embd}
    notes = prov.setdefault("notes", [])
    model_moe = sizes.model_moe_layers
    if model_moe is not None:
        absent = [l for l in model_moe if l not in set(layers)]
        if absent:
            model["moe_layers_absent"] = absent
            notes.append(f"the log holds {len(layers)} of the model's {len(model_moe)} MoE layers; layers "
                         f"{compact_ranges(absent)} are absent and every figure covers only the layers it has")
    elif sizes.uniform is not None and layers != list(range(layers[0], layers[-1] + 1)):
        notes.append(f"the log holds layers {compact_ranges(layers)} only; others are absent (--expert-bytes "
                     "does not say which layers of the model are MoE)")
    prov["sizes"] = describe(sizes)
    gating = gating or default_gating(*KNOWN_ARCH_GATING.get(arch, (None, None)))
    return {"model": model, "expert_bytes": eb, "dense_bytes": db, "gating": gating, "provenance": prov}


def batches_from_file_order(block_layers: np.ndarray, block_phase: np.ndarray | None = None) -> np.ndarray:
    """Batch index of each layer block of a log written in evaluation order (one block = the rows
    one MoE layer routed in one forward pass): a forward pass visits its layers in increasing
    order, so a block whose layer is not above the previous block's starts a new pass (as does a
    change of phase)."""
    n = block_layers.size
    new = np.ones(n, dtype=bool)
    if n > 1:
        new[1:] = block_layers[1:] <= block_layers[:-1]
        if block_phase is not None:
            new[1:] |= block_phase[1:] != block_phase[:-1]
    return (np.cumsum(new) - 1).astype(np.int64)


def prompt_passes(ntok: np.ndarray, prompt_tokens: int | None, what: str | Path, notes: list[str]) -> np.ndarray:
    """Which passes (forward passes of ``ntok`` tokens each, in order) are the prompt, for a log
    that does not say: exactly ``prompt_tokens`` tokens when given (it must end where a pass
    ends), else the passes before the first one-token pass (said in ``notes``)."""
    n = ntok.size
    ends = np.cumsum(ntok)
    if prompt_tokens is not None:
        if prompt_tokens < 0:
            raise UserError(f"--prompt-tokens {prompt_tokens} is negative.")
        if prompt_tokens and prompt_tokens not in set(ends.tolist()):
            raise UserError(f"--prompt-tokens {prompt_tokens}: {what}'s passes end at tokens "
                            f"{', '.join(str(int(e)) for e in ends[:8])}{' ...' if n > 8 else ''}; "
                            "the prompt must end where a pass ends.")
        notes.append(f"phase from --prompt-tokens {prompt_tokens}")
        return ends <= prompt_tokens
    single = np.flatnonzero(ntok == 1)
    first_decode = int(single[0]) if single.size else n
    notes.append(f"phase inferred: the {first_decode} pass(es) before the first one-token pass are the prompt "
                 f"({int(ntok[:first_decode].sum())} tokens), the rest decode (give --prompt-tokens N to set it)")
    return np.arange(n) < first_decode


def repeated_expert_rows(experts: np.ndarray) -> np.ndarray:
    """Indices of the routings (rows of ``experts`` [R, k]) that select some expert twice; empty when k < 2."""
    if experts.ndim != 2 or experts.shape[1] < 2:
        return np.array([], dtype=np.int64)
    srt = np.sort(experts, axis=1)
    return np.flatnonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))


def slots_by_weight(experts: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Each routing's slots put in descending-weight order (stable: ties keep the logged order; the
    selected set is unchanged). Returns (experts, weights, how many routings were reordered)."""
    order = np.argsort(-weights, axis=1, kind="stable")
    moved = int((order != np.arange(experts.shape[1])[None, :]).any(axis=1).sum())
    if moved:
        experts = np.take_along_axis(experts, order, axis=1)
        weights = np.take_along_axis(weights, order, axis=1)
    return experts, weights, moved


def meta_from_sizes(*, what: str | Path, stem: str, sizes: Any, n_layer: int, n_expert: int, layer: np.ndarray,
                    top_k: int, prov: dict[str, Any]) -> dict[str, Any]:
    """:func:`make_meta` for a log that names no model: name and arch from the sizes' model (else the
    source's ``stem`` and "unknown"), the layers ``layer`` routes, ``top_k_native`` the model's top-k
    where it routes at least ``top_k``."""
    layers = sorted(int(x) for x in np.unique(layer))
    return make_meta(what=what, name=sizes.name or stem, arch=sizes.arch or "unknown", n_layer=n_layer, layers=layers,
                     n_expert=n_expert, top_k=top_k, sizes=sizes, prov=prov, n_embd=sizes.n_embd,
                     top_k_native=sizes.top_k if sizes.top_k is not None and sizes.top_k >= top_k else None)


def write_trace(out_dir: Path, meta: dict[str, Any], *, batch: np.ndarray, phase: np.ndarray, step: np.ndarray,
                layer: np.ndarray, experts: np.ndarray, weights: np.ndarray, turn: np.ndarray | None = None,
                optional: dict[str, np.ndarray] | None = None, force: bool, inputs: Iterable[Path | None],
                tokens_per_part: int = 4096, what: str | Path = "the import", drop_warmup: bool = False,
                row_name: Any = None) -> Path:
    """The one write path of every importer: rows sorted into (batch, layer, step) order (stable, so
    equal keys keep file order), written through :class:`~traces.io.writer.TraceWriter` into a staged
    directory, checked by the reader, then renamed into place (nothing half-written)."""
    from traces.io.atomic import staged_dir
    from traces.io.reader import open_trace
    from traces.io.writer import TraceWriter

    optional = dict(optional or {})
    n = experts.shape[0]
    if n == 0:
        raise UserError(f"{what}: holds no routings; nothing to import.")
    turn = np.zeros(n, dtype=np.int64) if turn is None else turn
    keys = (step, optional["request"], layer, batch) if "request" in optional else (step, layer, batch)
    # Engine warm-up rows (a profiling or dummy pass: the same experts at every layer, exactly
    # uniform weights): found and said; dropped only when asked (docs/design.md, "Warm-up rows").
    from traces.format.warmup import describe, find_runs

    rank = np.empty(n, np.int64)
    rank[np.lexsort(keys)] = np.arange(n)
    runs, warm = find_runs(turn=turn, step=step, layer=layer, experts=experts, weights=weights, order=rank,
                           request=optional.get("request"), moe_layers=len(meta["model"]["moe_layers"]))
    if runs:
        prov = meta.setdefault("provenance", {})
        said = describe(runs, rows_of=row_name, label="rows" if row_name else "rows (0-based, in the log's order)")
        prov["warmup"] = {"tokens": sum(r["tokens"] for r in runs), "at": said, "dropped": bool(drop_warmup)}
        if drop_warmup:
            keep = ~warm
            if not keep.any():
                raise UserError(f"{what}: every routing looks like an engine warm-up pass ({said}); nothing is left "
                                "to import without --drop-warmup.")
            prov.setdefault("notes", []).append(f"engine warm-up rows dropped (--drop-warmup): {said}")
            turn, batch, phase, step, layer = turn[keep], batch[keep], phase[keep], step[keep], layer[keep]
            experts, weights = experts[keep], weights[keep]
            optional = {c: v[keep] for c, v in optional.items()}
            n = int(keep.sum())
        else:
            prov.setdefault("notes", []).append(
                f"rows that look like an engine warm-up (profiling or dummy) pass, kept and replayed as routing: "
                f"{said} (--drop-warmup leaves them out)")
    # Completeness measured, not assumed: tokens routed at fewer MoE layers than the trace holds are
    # counted and named in the provenance (and info says the trace is not complete).
    from traces.format.completeness import measure, sentence

    gaps = measure(turn=turn, phase=phase, step=step, layer=layer, moe_layers=list(meta["model"]["moe_layers"]),
                   request=optional.get("request"))
    said = sentence(gaps, len(meta["model"]["moe_layers"]))
    if said:
        prov = meta.setdefault("provenance", {})
        prov.setdefault("notes", []).append(said)
        prov["routings_missing"] = {k: gaps[k] for k in ("routings_missing", "tokens_missing_layers", "routings_missing_at")}
    # The format's row order: (batch, layer, step), with a request column (batch, layer, request, step).
    keys = (step, optional["request"], layer, batch) if "request" in optional else (step, layer, batch)
    order = np.lexsort(keys)
    with staged_dir(out_dir, force=force, inputs=list(inputs)) as stage:
        w = TraceWriter(stage, meta, columns=tuple(optional), tokens_per_part=tokens_per_part)
        w.append(turn=turn[order], batch=batch[order], phase=phase[order], step=step[order], layer=layer[order],
                 experts=experts[order], weights=weights[order], **{k: v[order] for k, v in optional.items()})
        w.close(complete=True)
        try:
            open_trace(stage)
        except TraceError as e:
            raise UserError(f"{what}: does not make a valid trace: {e.problem}") from None
    return Path(out_dir)
