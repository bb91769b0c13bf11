"""The native path of ``moe-replay cache --json``: a plain LRU replay of a simple trace without
importing NumPy or Arrow.

Why: importing NumPy and pyarrow costs about 0.25-0.3 s on this project's 2-core machine, about
half of a whole ``cache`` run on a 4.8 M-routing trace (issue 18 asks for that run, whole process,
to be at least as fast as libCacheSim's ``process_trace`` plus Python's start-up). Here the part
files' footers are parsed in Python (:mod:`traces.footer`), their column chunks read and decoded
in C (:mod:`traces.pq_native`, ``traces._pq``), and the rows checked (``rows_ok``), cut into
loads and replayed (``replay_lru_rows``: both in one pass) by the compiled kernels
(:mod:`replay.aot`, ``replay._aot``), on buffers the standard library makes
(``memoryview(bytearray).cast``). The next part is read and checked on a second thread while this
one is replayed (the C calls release the GIL).

It takes only what it understands completely, and answers None for anything else, so the caller
(:mod:`replay.fastcli`) runs the ordinary path, which prints the same JSON or the same refusal:

- options: ``--budgets`` or ``--budget-mib`` given (the default budgets need the working set
  first), policies among ``lru`` and ``layer`` with no policy plugin installed, every value one the
  ordinary path accepts;
- the trace: a valid ``trace.json``; no ``request``, ``token`` or recorded column (their row
  checks are the ordinary path's); no router or metrics file; part files written as this
  package's writer writes them (each footer's Arrow schema equal to the format's, the columns it
  reads required scalars or non-null fixed-size lists, PLAIN pages, uncompressed or zstd, no
  dictionary); every row valid (the gate that :func:`replay.cache.iter_load_parts` uses).

A trace it gives up on part way (a bad row in the last part) costs that much reading twice; a
valid one is read once. A run it takes holds two parts' columns and one cell state per (policy,
budget), not the trace (:func:`memory_bytes`, which ``info`` prints): 22-23 MiB for the whole
process on the 4.8 M-routing benchmark trace. ``tests/test_native.py`` holds its JSON to the
ordinary path's, byte for byte, on random traces, and checks what it gives up on and what it
imports. ``MOE_REPLAY_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import json
import os
import threading
from array import array
from typing import Any

ENV = "MOE_REPLAY_NATIVE"
POLICIES = ("lru", "layer")
# The columns a replay reads and the gate checks, with the buffer format each is decoded into.
READ = (("turn", "i"), ("batch", "i"), ("phase", "b"), ("step", "i"), ("layer", "h"), ("experts", "i"), ("weights", "f"))
_ITEMSIZE = {"b": 1, "h": 2, "i": 4, "q": 8, "f": 4}
# replay.cache_state fields and replay.cache_kernel slots (tests check they match)
RESIDENT, LAST_TICK, LAST_LOAD, NEXT_USE, PIN, GROUP, BYTES, RES_POS, PRED_MARK, N_ENT = 0, 1, 2, 4, 7, 8, 9, 11, 13, 14
BASE, BUDGET, BATCH_LOAD, N_GRP = 0, 1, 4, 5
NEVER = (1 << 31) - 1
N_ACC, ACC_LOOKUPS, ACC_HITS, ACC_READ = 7, 0, 1, 2
N_STATS, STAT_EVICTIONS, STAT_OVERFLOW, STAT_TICKS, STAT_PEAK_BYTES = 12, 0, 1, 3, 11
N_OPTS, OPT_AHEAD, OPT_CAP, OPT_TICK0, OPT_LOAD0, OPT_BATCH0 = 8, 0, 1, 5, 6, 7
STATE_BYTES_PER_ENTRY = 2 * 96  # replay.cache.STATE_BYTES_PER_ENTRY
MAX_SLOTS = (1 << 31) - 2


class NotMine(Exception):
    """The native path does not take this run (the ordinary path runs it)."""


def _filled(fmt: str, n: int, value: int) -> array:
    return array(fmt, [value]) * n


def cache_rows(trace: str, budgets: str | None, budget_mib: str | None, policies: str, phase: str, seed: int, stream: str,
               per_layer: bool) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
    """``cache --json``'s rows and summary (:func:`replay.rows.cache_summary`), what
    :func:`replay.fastcli.cache_json` prints for the same options, or None when the native path
    does not take this run."""
    if os.environ.get(ENV, "").strip() == "0":
        return None
    from replay import aot
    from traces import pq_native
    from traces.errors import UserError

    kern, pq = aot.load(), pq_native.load()
    if kern is None or pq is None:
        return None
    try:
        return _cache_rows(kern, pq, trace, budgets, budget_mib, policies, phase, seed, stream, per_layer)
    except (NotMine, UserError):  # a refusal is the ordinary path's to word
        return None


def _options(budgets: str | None, budget_mib: str | None, policies: str, phase: str, seed: int,
             stream: str) -> tuple[list[float], list[str]]:
    from replay.phases import check_phase
    from replay.plugins import _may_have_entry_points
    from replay.policies import ENTRY_POINT_GROUP
    from traces.errors import UserError
    from traces.units import parse_budget_mib, parse_budgets_mib

    pols: list[str] = []
    for p in policies.split(","):
        p = p.strip()
        if p and p not in pols:
            pols.append(p)
    if not pols or any(p not in POLICIES for p in pols) or _may_have_entry_points(ENTRY_POINT_GROUP):
        raise NotMine
    if stream not in ("auto", "on", "off") or not 0 <= seed < 1 << 63 or (budgets is None) == (budget_mib is None):
        raise NotMine
    try:
        check_phase(phase)
        blist = parse_budgets_mib(budgets, "--budgets") if budgets is not None else [parse_budget_mib(budget_mib, "--budget-mib")]
    except UserError:
        raise NotMine from None
    return [float(b) for b in blist], pols


class _Trace:
    """What the native path knows of an opened trace (the attributes :func:`replay.rows.cache_summary` reads)."""

    def __init__(self, path: str, meta: dict[str, Any], parts: list[str], footers: list[Any]) -> None:
        self.path, self.meta, self.parts, self.footers = path, meta, parts, footers
        model = meta["model"]
        self.n_layer, self.n_expert, self.top_k = int(model["n_layer"]), int(model["n_expert"]), int(model["top_k"])
        self.moe_layers = list(model["moe_layers"])
        self.expert_bytes = [int(v or 0) for v in meta["expert_bytes"]]
        self.recorded = dict(meta.get("recorded") or {})
        self.token_cycle_bytes = sum(self.top_k * self.expert_bytes[layer] for layer in self.moe_layers)
        self.n_rows = sum(f.num_rows for f in footers)


def _open(path: str) -> _Trace:
    """The checks of :func:`traces.open_trace` (with deferred rows) on what the native path takes;
    NotMine for anything it would refuse or that the native path does not read."""
    from traces.footer import FooterError, arrow_schema, read_footer
    from traces.meta import METRICS_FILE, REQUEST_NAMES, ROUTER_FILE, ROUTINGS_DIR, TRACE_JSON, routing_fields, validate_meta

    meta_path = os.path.join(path, TRACE_JSON)
    rdir = os.path.join(path, ROUTINGS_DIR)
    if not os.path.isfile(meta_path) or not os.path.isdir(rdir):
        raise NotMine
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.loads(f.read())
    except (OSError, UnicodeDecodeError, ValueError):
        raise NotMine from None
    if validate_meta(meta, TRACE_JSON):
        raise NotMine
    columns = tuple(meta.get("columns", []))
    if any(c in REQUEST_NAMES or c in ("residency", "read_bytes", "dropped") for c in columns):
        raise NotMine  # the row checks of these columns are the ordinary path's (RowChecker.simple)
    if os.path.isfile(os.path.join(path, ROUTER_FILE)) or os.path.isfile(os.path.join(path, METRICS_FILE)):
        raise NotMine
    names = sorted(n for n in os.listdir(rdir) if n.startswith("part-") and n.endswith(".parquet"))
    if names != [f"part-{i:05d}.parquet" for i in range(len(names))]:
        raise NotMine
    try:
        want = [_arrow_field(name, typ) for name, typ in routing_fields(meta, columns, meta.get("gate_input_dtype", "float32"))]
    except (KeyError, ValueError):
        raise NotMine from None
    parts = [os.path.join(rdir, n) for n in names]
    footers = []
    for part in parts:
        try:
            ft = read_footer(part)
            got = arrow_schema(ft)
        except (FooterError, OSError):
            raise NotMine from None
        if got != want:  # pyarrow's Schema.equals on what it would present
            raise NotMine
        footers.append(ft)
    t = _Trace(path, meta, parts, footers)
    if (meta["complete"] and not parts) or ("rows" in meta and meta["complete"] and meta["rows"] != t.n_rows) or t.n_rows == 0:
        raise NotMine
    return t


def _arrow_field(name: str, typ: tuple, nullable: bool = False) -> Any:
    """A :mod:`traces.meta` field as :class:`traces.footer.ArrowField` (a list's items nullable, as
    Arrow's default item field): compared with ``==``, which ignores a list child's name as Arrow does."""
    from traces.footer import ArrowField

    if typ[0] == "fixed_size_list":
        typ = ("fixed_size_list", typ[1], _arrow_field("element", typ[2], nullable=True))
    return ArrowField(name, nullable, typ)


def _elements(ft: Any) -> dict[tuple[str, ...], Any]:
    """Every schema element of a footer by its path (the schema is stored pre-order, each group
    followed by its ``num_children`` subtrees)."""
    out = {}
    stack = [[ft.schema[0].num_children or 0, ()]]
    for e in ft.schema[1:]:
        while stack and stack[-1][0] == 0:
            stack.pop()
        if not stack:
            raise NotMine
        stack[-1][0] -= 1
        path = stack[-1][1] + (e.name,)
        out[path] = e
        if e.num_children:
            stack.append([e.num_children, path])
    return out


def _layout(t: _Trace, i: int) -> list[list[tuple]]:
    """Per row group, per column of :data:`READ`: the arguments of ``traces._pq.read_chunk``
    after ``fd`` (NotMine unless each column is laid out as this package's writer lays it out: a
    required scalar, or a required LIST group > repeated ``list`` > optional ``element``)."""
    ft = t.footers[i]
    leaves = {lf.path: (j, lf) for j, lf in enumerate(ft.leaves)}
    el = _elements(ft)
    for name, _ in READ:
        if name in ("experts", "weights"):
            top, mid, leaf = el.get((name,)), el.get((name, "list")), el.get((name, "list", "element"))
            if top is None or mid is None or leaf is None or (top.repetition, mid.repetition, leaf.repetition) != (0, 2, 1) \
                    or top.logical != ("LIST",) or mid.logical is not None or top.num_children != 1 or mid.num_children != 1:
                raise NotMine
        elif el.get((name,)) is None or el[(name,)].repetition != 0:
            raise NotMine
    k = t.top_k
    plan = []
    want_rows = 0
    for rg in ft.row_groups:
        cols = []
        for name, fmt in READ:
            is_list = name in ("experts", "weights")
            found = leaves.get((name, "list", "element") if is_list else (name,))
            if found is None:
                raise NotMine
            j, lf = found
            ch = rg.chunks[j]
            physical = 4 if fmt == "f" else 1  # FLOAT, INT32
            if lf.element.type != physical or ch.physical != physical or ch.dictionary_page_offset is not None:
                raise NotMine
            if (lf.max_rep, lf.max_def) != ((1, 2) if is_list else (0, 0)) or ch.codec not in (0, 6):
                raise NotMine
            logical = lf.element.logical
            bits = {"b": 8, "h": 16, "i": 32}.get(fmt)
            if fmt == "f":
                if logical is not None:
                    raise NotMine
            elif not (logical == ("INTEGER", bits, True) or (bits == 32 and logical is None)):
                raise NotMine
            cols.append((ch.data_page_offset, ch.total_compressed_size, ch.codec, physical, lf.max_rep, lf.max_def,
                         k if is_list else 0, rg.num_rows))
        plan.append(cols)
        want_rows += rg.num_rows
    if want_rows != ft.num_rows:
        raise NotMine
    return plan


def _read_part(pq: Any, t: _Trace, i: int, store: dict[str, bytearray]) -> dict[str, memoryview]:
    """Part ``i``'s :data:`READ` columns as flat typed buffers (NotMine when a chunk is not one the
    C reader takes), decoded into ``store``'s bytearrays (grown when too small, else reused: a new
    zeroed bytearray per part costs as much as decoding it; the reader writes every element)."""
    plan = _layout(t, i)
    n = t.footers[i].num_rows
    k = t.top_k
    out = {}
    for name, fmt in READ:
        nbytes = n * (k if name in ("experts", "weights") else 1) * _ITEMSIZE[fmt]
        if len(store.get(name, b"")) < nbytes:
            store[name] = bytearray(nbytes)
        out[name] = memoryview(store[name])[:nbytes].cast(fmt)
    fd = os.open(t.parts[i], os.O_RDONLY)
    try:
        row = 0
        for cols in plan:
            for (name, _), (offset, size, codec, physical, max_rep, max_def, width, rows) in zip(READ, cols):
                w = max(width, 1)
                dst = out[name][row * w:(row + rows) * w]
                if pq.read_chunk(fd, offset, size, codec, physical, max_rep, max_def, width, rows, dst) != 0:
                    raise NotMine
            row += cols[0][7]
    finally:
        os.close(fd)
    return out


class _Reader:
    """Reads and checks part i + 1 on a thread while the caller replays part i: two sets of
    buffers, used in turn (the caller must be done with a part's buffers before it asks for the
    part after next). Each part's rows go through the row gate (``replay._aot.rows_ok``, the check
    :func:`replay.cache.iter_load_parts` makes) here, in order, with the previous part's last row;
    a part that fails it, or a chunk the C reader does not take, raises NotMine in the caller."""

    def __init__(self, pq: Any, kern: Any, t: _Trace) -> None:
        self.pq, self.kern, self.t = pq, kern, t
        self.stores: list[dict[str, bytearray]] = [{}, {}]
        self.result: dict[str, memoryview] | None = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.moe = bytearray(t.n_layer)
        for layer in t.moe_layers:
            self.moe[layer] = 1
        self.by_rank = not t.meta["gating"].get("selection_bias")
        self.last = array("q", [0, 0, 0, 0])
        self.has_last = False

    def _run(self, i: int) -> None:
        try:
            cols = _read_part(self.pq, self.t, i, self.stores[i % 2])
            R, k = len(cols["batch"]), self.t.top_k
            if R:
                b, lay, s, p = cols["batch"], cols["layer"], cols["step"], cols["phase"]
                ex2 = cols["experts"].cast("B").cast("i", [R, k])
                wt2 = cols["weights"].cast("B").cast("f", [R, k])
                if not self.kern.rows_ok(b, lay, s, p, ex2, wt2, memoryview(self.moe).cast("?"), self.t.n_expert, self.by_rank,
                                         self.has_last, self.last):
                    raise NotMine  # the ordinary path names the row
                self.last[0], self.last[1], self.last[2], self.last[3] = b[R - 1], lay[R - 1], s[R - 1], p[R - 1]
                self.has_last = True
            self.result = cols
        except BaseException as e:  # handed to the caller's thread
            self.error = e

    def start(self, i: int) -> None:
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(i,), name="moe-replay-native-read", daemon=True)
        self.thread.start()

    def get(self) -> dict[str, memoryview]:
        assert self.thread is not None
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def _row_length(n: int) -> int:
    lines = -(-max(n, 1) // 16)  # replay.cache_state.row_length
    return 16 * (lines | 1)


class _Cell:
    """One (policy, budget) replay's state: replay.cache_state.new_state and replay.policies.lru.init, as buffers."""

    def __init__(self, t: _Trace, policy: str, budget_mib: float) -> None:
        from traces.units import budget_bytes

        L, n = len(t.moe_layers), t.n_expert
        C = L * n
        RL = _row_length(C)
        self.policy, self.budget_mib = policy, budget_mib
        budget = budget_bytes(budget_mib)
        by_layer = policy == "layer"
        G = L if by_layer else 1
        ent = array("i")
        for field in range(N_ENT):
            if field in (LAST_TICK, LAST_LOAD, PIN, RES_POS, PRED_MARK):
                ent.extend(_filled("i", RL, -1))
            elif field == NEXT_USE:
                ent.extend(_filled("i", RL, NEVER))
            elif field == GROUP:
                row = array("i")
                for li in range(L):
                    row.extend(_filled("i", n, li if by_layer else 0))
                row.extend(_filled("i", RL - C, 0))
                ent.extend(row)
            elif field == BYTES:
                row = array("i")
                for layer in t.moe_layers:
                    row.extend(_filled("i", n, t.expert_bytes[layer]))
                row.extend(_filled("i", RL - C, 0))
                ent.extend(row)
            else:
                ent.extend(_filled("i", RL, 0))
        grp = array("q", [0]) * (G * N_GRP)
        for g in range(G):
            grp[g * N_GRP + BASE] = g * n if by_layer else 0
            grp[g * N_GRP + BUDGET] = budget // L if by_layer else budget
            grp[g * N_GRP + BATCH_LOAD] = -1
        self.RL, self.C = RL, C
        self.ent_flat = ent
        self.ent = memoryview(ent).cast("B").cast("i", [N_ENT, RL])
        self.grp = memoryview(grp).cast("B").cast("q", [G, N_GRP])
        self.ps = _filled("i", 2 * (RL + G), -1)
        info = array("q")
        for li, layer in enumerate(t.moe_layers):
            info.extend((li if by_layer else 0, t.expert_bytes[layer]))
        self.layer_info = memoryview(info).cast("B").cast("q", [L, 2])
        self.acc_flat = array("q", [0]) * (2 * L * N_ACC)
        self.acc = memoryview(self.acc_flat).cast("B").cast("q", [2, L, N_ACC])
        self.tick = self.evictions = self.overflow = self.peak = 0

    def replay(self, kern: Any, v: dict[str, memoryview], experts: memoryview, lidx_of: array, n_expert: int, load0: int) -> int:
        """Replay whole loads (rows ``v``, ``experts`` [rows, k]) from load number ``load0``; returns their number."""
        stats = array("q", [0]) * N_STATS
        opts = array("q", [0]) * N_OPTS
        opts[OPT_AHEAD], opts[OPT_CAP], opts[OPT_BATCH0] = 1, -1, -1
        opts[OPT_TICK0], opts[OPT_LOAD0] = self.tick, load0
        n_loads = kern.replay_lru_rows(v["batch"], v["phase"], v["layer"], experts, lidx_of, n_expert, self.layer_info, self.ent,
                                       self.grp, self.ps, self.acc, stats, opts)
        self.tick = stats[STAT_TICKS]
        self.evictions += stats[STAT_EVICTIONS]
        self.overflow += stats[STAT_OVERFLOW]
        self.peak = max(self.peak, stats[STAT_PEAK_BYTES])
        return n_loads

    def rows(self, t: _Trace, per_layer: bool) -> list[dict[str, Any]]:
        from replay.rows import cache_row

        L = len(t.moe_layers)
        acc = self.acc_flat

        def totals(lis: range) -> tuple[list[int], list[int], list[int]]:
            return tuple([sum(acc[(ph * L + li) * N_ACC + f] for li in lis) for ph in (0, 1)]  # type: ignore[return-value]
                         for f in (ACC_LOOKUPS, ACC_HITS, ACC_READ))

        out = [cache_row(self.policy, self.budget_mib, None, *totals(range(L)), evictions=self.evictions,
                         overflow_loads=self.overflow, peak_resident_bytes=self.peak, over_budget=self.overflow > 0)]
        if per_layer:
            for li, layer in enumerate(t.moe_layers):
                out.append(cache_row(self.policy, self.budget_mib, layer, *totals(range(li, li + 1)), evictions=None,
                                     overflow_loads=None, peak_resident_bytes=None, over_budget=None))
        return out

    def working_set_bytes(self, t: _Trace) -> int:
        """Bytes of every entry a load looked up (its PIN stamp is a load index, never -1 again)."""
        pin = self.ent_flat[PIN * self.RL:PIN * self.RL + self.C]
        n = t.n_expert
        return sum(t.expert_bytes[t.moe_layers[e // n]] for e, p in enumerate(pin) if p != -1)


def row_bytes(k: int) -> int:
    """Bytes of one row of :data:`READ` as the native path holds it (k slots)."""
    return sum(_ITEMSIZE[fmt] * (k if name in ("experts", "weights") else 1) for name, fmt in READ)


def cell_bytes(n_moe_layers: int, n_expert: int) -> int:
    """Bytes of one cell's state (:class:`_Cell`: ent, ps, grp, layer_info, acc), one group per
    MoE layer at most (``layer``)."""
    L = n_moe_layers
    RL = _row_length(L * n_expert)
    return N_ENT * 4 * RL + 4 * 2 * (RL + L) + 8 * (N_GRP * L + 2 * L + 2 * L * N_ACC)


def memory_bytes(trace: Any, n_cells: int = 1) -> int | None:
    """Bytes a native-path ``cache`` run holds beyond the program, estimated from the metadata
    (``trace``: an opened :class:`traces.reader.Trace`): two parts' columns (:class:`_Reader`'s
    buffers, used in turn), the C reader's transient page and chunk buffers (bounded by the
    largest part's list column, twice), and ``n_cells`` cell states. None when the native path
    does not take the trace (a request, token or recorded column, a router or metrics file)."""
    if any(c in ("request", "token", "residency", "read_bytes", "dropped") for c in trace.columns) \
            or trace.has_router or trace.has_metrics:
        return None
    rows = max(trace.part_rows, default=0)
    k = trace.top_k
    return 2 * rows * row_bytes(k) + 2 * rows * 4 * k + n_cells * cell_bytes(len(trace.moe_layers), trace.n_expert)


def _cache_rows(kern: Any, pq: Any, trace: str, budgets: str | None, budget_mib: str | None, policies: str, phase: str,
                seed: int, stream: str, per_layer: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from replay.progress import progress
    from replay.rows import cache_summary, column_types, plain_rows
    from traces.errors import UserError
    from traces.memory import check_fits

    blist, pols = _options(budgets, budget_mib, policies, phase, seed, stream)
    t = _open(trace)
    L, n, k = len(t.moe_layers), t.n_expert, t.top_k
    try:
        check_fits(L * n * STATE_BYTES_PER_ENTRY, "state")
    except UserError:
        raise NotMine from None
    if L * n > (1 << 31) - 1 or t.n_rows * k > MAX_SLOTS:
        raise NotMine
    cells: dict[tuple[str, float], _Cell] = {}
    for p in pols:
        for b in blist:
            if (p, b) not in cells:
                cells[(p, b)] = _Cell(t, p, b)
    lidx_of = array("i", [-1]) * (max(t.moe_layers) + 1)
    for li, layer in enumerate(t.moe_layers):
        lidx_of[layer] = li
    has_decode = False
    carry: dict[str, bytes] | None = None
    names = ["batch", "phase", "layer", "experts"]  # what the replay reads (turn and step: read and checked, not replayed)
    size = {name: _ITEMSIZE[fmt] * (k if name == "experts" else 1) for name, fmt in READ}
    fmts = dict(READ)
    state = {"load0": 0}

    def replay_piece(data: dict[str, Any]) -> None:
        """Replay rows holding whole loads (raw bytes per column) in every cell (``replay._aot.replay_lru_rows``:
        cut into loads and replayed in one pass; a row it refuses raises ValueError)."""
        rows = len(data["batch"]) // 4
        if rows == 0:
            return
        v = {name: memoryview(data[name]).cast("B").cast(fmts[name]) for name in names}
        experts = memoryview(data["experts"]).cast("B").cast("i", [rows, k])
        try:
            for cell in cells.values():
                n_loads = cell.replay(kern, v, experts, lidx_of, n, state["load0"])  # the same loads in every cell
        except ValueError:
            raise NotMine from None
        state["load0"] += n_loads

    reader = _Reader(pq, kern, t)
    n_parts = len(t.parts)
    reader.start(0)
    bar = progress(t.n_rows, "cache replay (native)", unit="row")  # on a terminal only
    try:
        for i in range(n_parts):
            cols = reader.get()
            if i + 1 < n_parts:
                reader.start(i + 1)
            R = len(cols["batch"])
            bar.update(R)
            if R == 0:
                continue
            b_, l_, p_ = cols["batch"], cols["layer"], cols["phase"]
            has_decode = has_decode or 1 in p_.tobytes()
            raw = {name: cols[name].cast("B") for name in names}
            start = 0
            if carry is not None:  # the load held back from the previous part, finished by this part's first rows
                cb, cl = memoryview(carry["batch"]).cast("i")[-1], memoryview(carry["layer"]).cast("h")[-1]
                while start < R and b_[start] == cb and l_[start] == cl:
                    start += 1
                carry = {name: carry[name] + bytes(raw[name][:start * size[name]]) for name in names}
                if start == R and i + 1 < n_parts:
                    continue  # the whole part continues the held-back load
                replay_piece(carry)
                carry = None
            # Hold back this part's last (batch, layer) run unless it is the last part: a load is replayed whole.
            end = R
            if i + 1 < n_parts:
                bl, ll = b_[R - 1], l_[R - 1]
                while end > start and b_[end - 1] == bl and l_[end - 1] == ll:
                    end -= 1
                carry = {name: bytes(raw[name][end * size[name]:]) for name in names}
            replay_piece({name: raw[name][start * size[name]:end * size[name]] for name in names})
        if carry is not None:
            replay_piece(carry)
    finally:
        bar.close()
        if reader.thread is not None:
            reader.thread.join()
    raw_rows = []
    for p in pols:
        for b in blist:
            raw_rows.extend(cells[(p, b)].rows(t, per_layer))
    rows = plain_rows(raw_rows, column_types(False))
    W = next(iter(cells.values())).working_set_bytes(t)
    return rows, cache_summary(t, rows, blist, True, W, has_decode)

