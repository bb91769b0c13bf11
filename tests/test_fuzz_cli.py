"""Hostile input, generated (issue 14, "Done when"): every verb, driven in-process, with bad options
and with mutated trace files, must either answer (exit 0; JSON that parses under --json) or refuse
with exactly one line ``moe-replay: error: ...`` naming the option or the file (exit 2). Never exit 3
(a bug), never a traceback, never a changed input, never a half-written destination.

The valid trace is tiny (3 MoE layers x 8 experts, top-2, 16 tokens, with logits, gate inputs and
router.parquet so every predictor runs) and made once per session; each mutation works on a copy.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.helpers import rewrite_part, run_cli

# No shrinking: a failing input is reported as drawn (shrinking a CLI run took 5 minutes per failure),
# and the example counts keep the whole file near two minutes on the project's 2-core machine.
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)
FUZZ = settings(max_examples=50, deadline=None, phases=NO_SHRINK,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="session")
def base_trace(tmp_path_factory) -> Path:
    from traces.synth.generator import SynthConfig, write_synthetic

    out = tmp_path_factory.mktemp("fuzz-base") / "trace"
    write_synthetic(out, SynthConfig(layers=3, experts=8, top_k=2, embd=8, tokens=12, prompt_tokens=4))
    return out


def tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def check(res, args: list[str], names: list[str]) -> None:
    """The contract: exit 0 (valid JSON under --json) or exit 2 with one line naming one of ``names``."""
    from replay.core.progress import COMPILE_NOTICE

    where = f"moe-replay {' '.join(map(str, args))}"
    assert "Traceback" not in res.err, f"{where}: traceback\n{res.err}"
    # the first-run compile notice (one line on stderr when a kernel compiles) is not an error
    err = "\n".join(ln for ln in res.err.splitlines() if ln != COMPILE_NOTICE)
    assert res.code in (0, 2), f"{where}: exit {res.code}: {res.err.strip()}"
    if res.code == 0:
        if "--json" in args:
            json.loads(res.out)
        assert not err.strip(), f"{where}: exit 0 but stderr {res.err!r}"
        return
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"{where}: expected one line on stderr, got {res.err!r}"
    assert lines[0].startswith("moe-replay: error: "), f"{where}: {lines[0]!r}"
    assert any(n in lines[0] for n in names), f"{where}: the error names none of {names}: {lines[0]!r}"


# -- bad options ---------------------------------------------------------------------------------

BAD_NUMBERS = ["nan", "inf", "-inf", "-1", "0", "-0", "1e300", "-1e300", "1e-300", "abc", "", " ", ",", "1,,2",
               "99999999999999999999999", "-99999999999999999999999", "0x10", "1_000", "١", "1e", "--", "10,nan",
               "5,5", "1..0", "0..3", "2..1", "1..99999", "3", "2", "1"]
bad_value = st.one_of(
    st.sampled_from(BAD_NUMBERS),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=6),
    st.lists(st.sampled_from(["lru", "nope", "", "belady", "stale-gate[9]", "stale-gate[0]", "ctrl", "-1", "1"]),
             max_size=3).map(",".join),
)

# verb -> (fixed arguments after TRACE, options that take a value)
VERBS: dict[str, tuple[list[str], list[str]]] = {
    "cache": (["--json", "--budgets", "10"], ["--budgets", "--policies", "--phase", "--seed", "--budget-mib",
                                              "--flash-mib-s", "--compute-ms", "--cost-model"]),
    "cache --retain": (["--retain", "--json", "--budgets", "10"], ["--predictor", "--policies", "--budgets", "--mix"]),
    "cache --validate": (["--validate", "--json"], ["--budget-mib"]),
    "predict": (["--json"], ["--predictors", "--horizon", "--horizon-curve", "--width", "--phase"]),
    "drop": (["--json", "--mode", "closed", "--budget-mib", "10"], ["--fracs", "--mode", "--phase", "--budget-mib",
                                                                     "--policy", "--cost-model"]),
    "prefetch": (["--json", "--budget-mib", "10"], ["--predictor", "--budget-mib", "--policy", "--cap", "--drop",
                                                     "--cost-model", "--mix"]),
    "cost check": (["--json", "--budget-mib", "10"], ["--budget-mib", "--cost-model"]),
    "cost fit": (["--json"], ["--metrics"]),
}


# Cases that fail only for want of another helper's fix on its own branch (issue 14): the
# coordinator removes these marks after merging.
PENDING: dict[str, str] = {}


def _verb_params():
    return [pytest.param(v, marks=pytest.mark.xfail(reason=PENDING[v], strict=False)) if v in PENDING else v
            for v in sorted(VERBS)]


@settings(FUZZ, max_examples=7)  # 7 per verb: room for the multi-trace verbs below at the same file time
@pytest.mark.parametrize("verb", _verb_params())
@given(data=st.data())
def test_bad_options(base_trace, verb, data):
    fixed, opts = VERBS[verb]
    picked = data.draw(st.lists(st.sampled_from(opts), min_size=1, max_size=2, unique=True))
    values = [data.draw(bad_value) for _ in picked]
    before = tree_hash(base_trace)
    head = verb.split()
    args = head[:1] + (head[1:] if head[0] == "cost" else []) + [str(base_trace)]
    i = 0
    while i < len(fixed):  # the fixed options, less those being fuzzed (and their values)
        takes_value = i + 1 < len(fixed) and not fixed[i + 1].startswith("--")
        if fixed[i] not in picked:
            args += fixed[i: i + 1 + takes_value]
        i += 1 + takes_value
    for o, v in zip(picked, values):
        args += [o, v]
    res = run_cli(*args)
    # a refusal names the option at fault, the file a path option names, or the trace
    check(res, args, [*picked, *(str(Path(v)) for v in values if v.strip() or v == ""), str(base_trace)])
    assert tree_hash(base_trace) == before, f"{args}: the input trace changed"


# Verbs that read or write more than one trace (merged from the requests, importers, compare and
# sweep branches): verb -> (the command line, with {trace} the base trace, {rtrace} one with a request
# column, {csv} a routing table, {grid} a sweep grid and {out} a fresh destination; the options that
# take a value, or OUT / RESULTS for the positional argument itself).
MULTI_VERBS: dict[str, tuple[list[str], list[str]]] = {
    "import table": (["import", "table", "{csv}", "{out}", "--map", "layer=layer,experts=experts,token=token",
                      "--expert-bytes", "1000", "--json"], ["--map", "--where", "--expert-bytes", "--engine"]),
    "import auto": (["import", "auto", "{csv}", "{out}", "--expert-bytes", "1000", "--json"],
                    ["--expert-bytes", "--sizes-from", "--dtype"]),
    "export libcachesim": (["export", "libcachesim", "{trace}", "{out}", "--json"], ["OUT"]),
    "export bigmoe": (["export", "bigmoe", "{trace}", "{out}", "--json"], ["OUT"]),
    "schedule": (["schedule", "{rtrace}", "{out}", "--schedule", "continuous", "--max-batch", "2", "--json"],
                 ["--schedule", "--max-batch", "--prefill-chunk"]),
    "compare": (["compare", "{trace}", "{trace}", "--json"], ["--tol", "--align", "--phase", "--show"]),
    "sweep": (["sweep", "{grid}", "-o", "{out}", "--workers", "1", "--json"], ["--workers", "--engine", "--address"]),
    "sweep-report": (["sweep-report", "--json", "--", "RESULTS"], ["RESULTS"]),  # after --: a path may start with -
}


@pytest.fixture(scope="module")
def multi_inputs(base_trace, tmp_path_factory) -> dict[str, Path]:
    from traces.synth.generator import SynthConfig, write_synthetic

    d = tmp_path_factory.mktemp("fuzz-multi")
    write_synthetic(d / "rtrace", SynthConfig(layers=2, experts=8, top_k=2, embd=8, tokens=3, prompt_tokens=2, requests=3))
    (d / "routes.csv").write_text("token,layer,experts\n" + "".join(f"{t},{layer},{t % 4}|{4 + layer}\n" for t in range(6)
                                                                    for layer in range(2)))
    (d / "grid.toml").write_text(f'traces = ["{base_trace}"]\n[cache]\npolicies = ["lru"]\nbudgets_mib = [10]\n')
    return {"trace": base_trace, "rtrace": d / "rtrace", "csv": d / "routes.csv", "grid": d / "grid.toml"}


def _in(d: Path, v: str) -> str:
    """A fuzzed positional path kept inside ``d`` (no separators: nothing outside it is written)."""
    return str(d / v.replace("/", "_").replace("\\", "_").replace("\0", "_"))


def test_multi_verbs_answer_unfuzzed(multi_inputs, tmp_path):
    # each command line above answers as written (else the fuzz would only ever see its own refusal);
    # export bigmoe needs recorded residency, which a synthetic trace lacks: refused naming the trace
    for verb, (template, _) in MULTI_VERBS.items():
        out = tmp_path / verb.replace(" ", "-")
        # RESULTS: what the sweep line (run before it, in table order) wrote
        fill = {f"{{{k}}}": str(p) for k, p in multi_inputs.items()} | {"{out}": str(out), "RESULTS": str(tmp_path / "sweep")}
        args = [fill.get(a, a) for a in template]
        res = run_cli(*args)
        if verb == "export bigmoe":
            check(res, args, [str(multi_inputs["trace"])])
            assert res.code == 2
        else:
            assert res.code == 0, f"{args}: {res.err}"
            json.loads(res.out)


@settings(FUZZ, max_examples=6)
@pytest.mark.parametrize("verb", sorted(MULTI_VERBS))
@given(data=st.data())
def test_bad_options_multi(multi_inputs, verb, data):
    template, opts = MULTI_VERBS[verb]
    picked = data.draw(st.lists(st.sampled_from(opts), min_size=1, max_size=2, unique=True))
    values = {o: data.draw(bad_value) for o in picked}
    inputs = [p for k, p in multi_inputs.items() if k != "grid"]
    before = [tree_hash(p) if p.is_dir() else p.read_bytes() for p in inputs]
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out"
        fill = {f"{{{k}}}": str(p) for k, p in multi_inputs.items()} | {"{out}": str(out)}
        if "OUT" in values:
            out = Path(_in(Path(d), values["OUT"]))
            fill["{out}"] = str(out)
        fill["RESULTS"] = values.get("RESULTS", "RESULTS")  # read only: any path, as typed
        existed = out.exists()
        args, i = [], 0
        while i < len(template):  # the template, less the options being fuzzed (and their values)
            takes_value = template[i].startswith("-") and i + 1 < len(template) and not template[i + 1].startswith("-")
            if not (template[i].startswith("-") and template[i] in picked):  # a fuzzed positional is filled in
                args += [fill.get(a, a) for a in template[i: i + 1 + takes_value]]
            i += 1 + takes_value
        for o in picked:
            if o.startswith("-"):
                args += [o, values[o]]
        res = run_cli(*args)
        names = [*picked, *fill.values(), *(str(Path(v)) for v in values.values() if v.strip() or v == "")]
        check(res, args, names)
        if not existed and "{out}" in template:  # whole or absent, no staging left beside it
            assert out.exists() == (res.code == 0), f"{args}: exit {res.code} but {out} {'exists' if out.exists() else 'is absent'}"
            assert not [p.name for p in out.parent.iterdir() if p.name.startswith(".")], f"{args}: staging left beside {out}"
    assert [tree_hash(p) if p.is_dir() else p.read_bytes() for p in inputs] == before, f"{args}: an input changed"


@settings(max_examples=8, deadline=None, phases=NO_SHRINK, suppress_health_check=list(HealthCheck))
@given(opt=st.sampled_from(["--budgets", "--policies", "--flash-mib-s", "--compute-ms", "--cost-model"]), value=bad_value)
def test_bad_options_report(base_trace, opt, value):
    before = tree_hash(base_trace)
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "rep"
        args = ["report", str(base_trace), "-o", str(out), opt, value]
        if opt in ("--flash-mib-s", "--compute-ms"):
            args += ["--compute-ms" if opt == "--flash-mib-s" else "--flash-mib-s", "5"]
        res = run_cli(*args)
        check(res, args, [opt, "--flash-mib-s", "--compute-ms", str(Path(value)), str(base_trace)])
        assert_destination_whole(out, res.code)
    assert tree_hash(base_trace) == before


@settings(max_examples=15, deadline=None, phases=NO_SHRINK, suppress_health_check=list(HealthCheck))
@given(opt=st.sampled_from(["--layers", "--experts", "--top-k", "--embd", "--prompt-tokens", "--seed", "--gating",
                            "--drift", "--reuse", "--skew", "--expert-bytes", "--rank"]), value=bad_value)
def test_bad_options_synth(opt, value):
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "syn"
        small = {"--layers": "2", "--experts": "4", "--top-k": "2", "--embd": "4", "--tokens": "2", "--prompt-tokens": "1"}
        args = ["synth", str(out), opt, value] + [x for k, v in small.items() if k != opt for x in (k, v)]
        res = run_cli(*args)
        check(res, args, [opt, "--top-k", "--experts", "--tokens", "--prompt-tokens", "--layers", "--embd"])
        assert_destination_whole(out, res.code, marker="trace.json")


def assert_destination_whole(out: Path, code: int, marker: str = "index.html") -> None:
    """Either the complete output (exit 0) or nothing at all, and no staging leftovers beside it."""
    if code == 0:
        assert (out / marker).is_file(), f"exit 0 but {out / marker} is missing"
    else:
        assert not out.exists(), f"refused, yet {out} exists"
    left = [p.name for p in out.parent.iterdir() if p.name.startswith(".")]
    assert not left, f"staging left beside {out}: {left}"


# -- bad trace files -------------------------------------------------------------------------------

JSON_VALUES = ["str", -1, 0, 1, 10**12, 10**30, 1.5, -0.5, None, [], {}, True, float("nan"), float("inf"), [1, 2], "4000MiB"]
JSON_FIELDS = [("model", "n_expert"), ("model", "top_k"), ("model", "n_layer"), ("model", "moe_layers"), ("model", "n_embd"),
               ("model", "top_k_native"), ("model", "name"), ("expert_bytes",), ("dense_bytes",), ("gating", "activation"),
               ("gating", "norm_topk"), ("gating", "selection_bias"), ("gating", "n_group"), ("gating", "scale"),
               ("complete",), ("columns",), ("rows",), ("recorded",), ("recorded", "budget_mib"),
               ("recorded", "cache_hit_pct_cum"), ("provenance",), ("format",), ("version",), ("expert_bytes", 0),
               ("model", "moe_layers", 0)]
PART_COLUMNS = ["turn", "batch", "phase", "step", "layer", "experts", "weights"]
PART_VALUES = [-1, 0, 1, 2, 3, 7, 8, 9, 127, 32767, -32768, 2**31 - 1, float("nan"), float("inf"), -float("inf"), -1.0, 1e30]

MUTATIONS = {
    "truncate-part": st.tuples(st.just("truncate-part"), st.floats(0.0, 0.999)),
    "truncate-json": st.tuples(st.just("truncate-json"), st.floats(0.0, 0.999)),
    "truncate-router": st.tuples(st.just("truncate-router"), st.floats(0.0, 0.999)),
    "truncate-wide": st.tuples(st.just("truncate-wide"), st.sampled_from(["logits", "gate_input"]), st.floats(0.0, 0.999)),
    "json-field": st.tuples(st.just("json-field"), st.sampled_from(JSON_FIELDS), st.sampled_from(JSON_VALUES)),
    "part-value": st.tuples(st.just("part-value"), st.sampled_from(PART_COLUMNS), st.integers(0, 10**6),
                            st.sampled_from(PART_VALUES)),
    "flip-part": st.tuples(st.just("flip-part"), st.floats(0.0, 1.0), st.integers(1, 255)),
    "flip-router": st.tuples(st.just("flip-router"), st.floats(0.0, 1.0), st.integers(1, 255)),
    "delete": st.tuples(st.just("delete"), st.sampled_from(["trace.json", "routings/part-00000.parquet", "routings",
                                                            "router.parquet", "routings/part-00000.gate_input.arrow"])),
}
mutation = st.one_of(*MUTATIONS.values())
# Mutation classes that fail only for want of helper E1's reader validation (issue 14 item 8: data
# pages of a part whose footer is intact are read without naming the file): remove after merging.
PENDING_TRACE: dict[str, str] = {}


TRACE_VERBS = [["info", "--json"], ["cache", "--json", "--budgets", "10,40"], ["cache", "--json", "--retain", "--budgets", "10"],
               ["cache", "--validate", "--budget-mib", "10", "--json"], ["predict", "--json"],
               ["predict", "--json", "--horizon-curve", "2"], ["drop", "--json", "--mode", "closed", "--budget-mib", "10"],
               ["prefetch", "--json", "--budget-mib", "10"], ["prefetch", "--json", "--budget-mib", "10", "--predictor",
                                                              "stale-gate[1]"]]


def _truncate(path: Path, frac: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * frac)])


def _flip(path: Path, frac: float, xor: int) -> None:
    """Flip bits of one byte inside the data pages (before the footer, after the magic)."""
    data = bytearray(path.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little") + 8
    hi = max(5, len(data) - footer)
    i = 4 + int((hi - 4) * frac) % max(1, hi - 4)
    data[i] ^= xor
    path.write_bytes(bytes(data))


def _set_json(meta: dict, field: tuple, value) -> None:
    obj = meta
    for key in field[:-1]:
        if isinstance(obj, dict):
            obj = obj.setdefault(key, {})
        elif isinstance(obj, list) and isinstance(key, int) and key < len(obj):
            obj = obj[key]
        else:
            return
    last = field[-1]
    if isinstance(obj, dict):
        obj[last] = value
    elif isinstance(obj, list) and isinstance(last, int) and last < len(obj):
        obj[last] = value


def _set_part_value(part: Path, column: str, row: int, value) -> None:
    """Write ``value`` into one cell of a part (cast to the column's type where it fits, else clipped)."""
    rewrite_part(part, lambda t: _with_value(t, column, row, value))


def _with_value(t: pa.Table, column: str, row: int, value) -> pa.Table:
    col = t.column(column).combine_chunks()
    n = t.num_rows
    if n == 0:
        return t
    row %= n
    if pa.types.is_fixed_size_list(col.type):
        vals = np.array(col.flatten().to_numpy(zero_copy_only=False)).reshape(n, -1).copy()
        vals[row, row % vals.shape[1]] = _fit(value, vals.dtype)
        new = pa.FixedSizeListArray.from_arrays(pa.array(vals.reshape(-1), type=col.type.value_type), col.type.list_size)
    else:
        vals = np.array(col.to_numpy(zero_copy_only=False)).copy()
        vals[row] = _fit(value, vals.dtype)
        new = pa.array(vals, type=col.type)
    return t.set_column(t.schema.get_field_index(column), t.schema.field(column), new)


def _fit(value, dtype):
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        v = 0 if isinstance(value, float) and not math.isfinite(value) else int(value)
        return min(max(v, info.min), info.max)
    return value


def mutate(trace: Path, m: tuple) -> None:
    kind = m[0]
    part = trace / "routings" / "part-00000.parquet"
    if kind == "truncate-part":
        _truncate(part, m[1])
    elif kind == "truncate-json":
        _truncate(trace / "trace.json", m[1])
    elif kind == "truncate-router":
        _truncate(trace / "router.parquet", m[1])
    elif kind == "truncate-wide":
        _truncate(trace / "routings" / f"part-00000.{m[1]}.arrow", m[2])
    elif kind == "json-field":
        meta = json.loads((trace / "trace.json").read_text())
        _set_json(meta, m[1], m[2])
        (trace / "trace.json").write_text(json.dumps(meta))
    elif kind == "part-value":
        _set_part_value(part, m[1], m[2], m[3])
    elif kind == "flip-part":
        _flip(part, m[1], m[2])
    elif kind == "flip-router":
        _flip(trace / "router.parquet", m[1], m[2])
    elif kind == "delete":
        p = trace / m[1]
        shutil.rmtree(p) if p.is_dir() else p.unlink()


@settings(FUZZ, max_examples=6)
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.xfail(reason=PENDING_TRACE[k], strict=False))
                                  if k in PENDING_TRACE else k for k in MUTATIONS])
@given(data=st.data())
def test_bad_trace_files(base_trace, kind, data):
    m = data.draw(MUTATIONS[kind])
    verb = data.draw(st.sampled_from(TRACE_VERBS))
    with tempfile.TemporaryDirectory() as d:
        trace = Path(d) / "trace"
        shutil.copytree(base_trace, trace)
        mutate(trace, m)
        before = tree_hash(trace)
        args = [verb[0], str(trace), *verb[1:]]
        res = run_cli(*args)
        check(res, [*args, f"[mutation {m}]"], [str(trace)])
        assert tree_hash(trace) == before, f"{args} with {m}: the input trace changed"


@settings(max_examples=6, deadline=None, phases=NO_SHRINK, suppress_health_check=list(HealthCheck))
@given(m=st.one_of(*(v for k, v in MUTATIONS.items() if k not in PENDING_TRACE)))  # all of them once PENDING_TRACE is empty
def test_bad_trace_files_report(base_trace, m):
    with tempfile.TemporaryDirectory() as d:
        trace = Path(d) / "trace"
        shutil.copytree(base_trace, trace)
        mutate(trace, m)
        before = tree_hash(trace)
        out = Path(d) / "out" / "rep"
        out.parent.mkdir()
        args = ["report", str(trace), "-o", str(out)]
        res = run_cli(*args)
        check(res, [*args, f"[mutation {m}]"], [str(trace)])
        assert_destination_whole(out, res.code)
        assert tree_hash(trace) == before
