"""The hostile run (issue 29, "Done when"): every verb of moe-replay, as a separate process, fed what
the tests' own fuzzers draw (tests/test_fuzz_cli.py: bad options of every verb, mutated trace
files) and the issue's cases (broken plugins, signals at random moments, SIGKILL of any verb, a
full disk, concurrent writers, special files and inputs as destinations), recording for each run:

- the exit code, and whether it is a crash (SIGSEGV, SIGABRT, SIGBUS, SIGILL, SIGFPE), an exit 3
  ("internal error ... this is a bug"), a traceback, or a signal's default action (a SIGINT,
  SIGTERM or SIGHUP that did not end in the tool's message and 128 + N);
- a sha256 of every input (trace directories, plugins, cost models, grids, configs, routing
  tables) before and after: any change is counted;
- every special file offered as a destination (a FIFO, a symbolic link to a FIFO, a symbolic link
  to /dev/null): still what it was afterwards (never is /dev/null itself a destination);
- the processes of the run's session still alive after it ended (after SIGKILL of the verb too).

A signal sent before the process catches SIGTERM (read from /proc/PID/status as it is sent: the
interpreter still starting, before the first line of the tool's code) is counted apart: no Python
program can handle a signal then; from that line on, every signal must end in the tool's message.

Not part of ``make test`` (a few hundred processes, ~15 minutes on two shared cores); seeded, so the
same --seed draws the same cases (timings, and so some outcomes of the signal cases, vary)::

    PYTHONPATH=. python -m tests.hostile.run --runs 300 --seed 29 [--jobs 2] [--log runs.jsonl]

It prints a summary table (counts of each outcome and of each broken invariant) and exits 1 if an
invariant broke (exit 3, crash, traceback, default action, input changed, special file replaced,
leftover process, hang). tests/test_hostile_smoke.py runs a few cases of each family.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import os
import random
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.test_fuzz_cli import (  # noqa: E402 - the fuzzers' own tables and mutations
    BAD_NUMBERS,
    JSON_FIELDS,
    JSON_VALUES,
    MULTI_VERBS,
    PART_COLUMNS,
    PART_VALUES,
    TRACE_VERBS,
    VERBS,
    mutate,
)

CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE}
USER_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
FAMILIES = {  # family -> weight (share of the runs)
    "fuzz-options": 22, "fuzz-multi": 10, "corrupt-trace": 18, "plugin": 10, "signal": 12, "sigkill": 8,
    "full-disk": 8, "race": 5, "special-dest": 4, "input-dest": 3, "import-garbage": 8,
}
IMPORTERS = ("bigmoe", "colibri", "llamacpp-moetrace", "megatron", "sglang", "table", "vllm", "auto")
# file name -> content drawn for the importers: garbage, and near misses of each format
GARBAGE = {
    "random.bin": lambda rng: bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4000))),
    "empty.csv": lambda rng: b"",
    "nested.json": lambda rng: b"[" * 100000 + b"]" * 100000,
    "nested.jsonl": lambda rng: b'{"a":' * 50000 + b"1" + b"}" * 50000 + b"\n",
    "huge.jsonl": lambda rng: json.dumps({"prompt_routed_experts": [[[10**40, 1]]], "routed_experts": [[[2**64, -5]]],
                                          "meta_info": {"cached_tokens": -3}}).encode() + b"\n",
    "moetrace.csv": lambda rng: "\n".join(f"{rng.choice(['0', '1', '-1', '1.5', '99999999999999999999', 'x'])},"
                                          f"{rng.choice(['0', '3', '-5', '2.5', '1e9', ''])}" for _ in range(20)).encode(),
    "route.csv": lambda rng: ("# route_trace v1\n" + "\n".join(f"{rng.randint(-2, 3)},{rng.randint(-2, 3)},"
                                                                 f"{rng.choice(['0|1', '1.5', '-3', '99999999999'])}"
                                                                 for _ in range(10))).encode(),
    "colibri.txt": lambda rng: "\n".join(f"{rng.randint(-1, 2)} {rng.randint(-1, 2)} {rng.randint(-1, 2)} "
                                         f"{rng.choice(['3:0.5', '-1:0.2', '1.5:1', 'x:y', '99999999999:1'])}"
                                         for _ in range(10)).encode(),
    "router_trace_rank0.jsonl": lambda rng: b"\n".join(json.dumps({"layer": rng.choice([0, 10**6, -1]), "iteration": 0,
                                                                   "top_indices": [[rng.choice([1, 1.5, -2, 10**30])]]}
                                                                  ).encode() for _ in range(5)),
}


@dataclasses.dataclass
class Case:
    family: str
    argv: list[str]
    inputs: list[str]
    specials: list[str] = dataclasses.field(default_factory=list)  # destinations that are special files
    send: tuple[int, float] | None = None  # (signal, seconds after start) sent to the verb's process
    fsize: int | None = None  # RLIMIT_FSIZE in bytes (a full disk as the process sees it)
    twin: list[str] | None = None  # a second writer started at once (a race)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    note: str = ""
    timeout: float = 180.0


# --- inputs -------------------------------------------------------------------------------------


def digest(p: str | Path) -> str:
    """sha256 of what is at ``p``: a file's bytes, a directory's tree (names, kinds, bytes), a
    link's target, a special file's kind; "absent" if nothing."""
    p = Path(p)
    h = hashlib.sha256()

    def one(q: Path, rel: str) -> None:
        try:
            st = os.lstat(q)
        except FileNotFoundError:
            h.update(f"{rel}:absent".encode())
            return
        if stat.S_ISLNK(st.st_mode):
            h.update(f"{rel}:link:{os.readlink(q)}".encode())
        elif stat.S_ISDIR(st.st_mode):
            h.update(f"{rel}:dir".encode())
            for c in sorted(q.iterdir()):
                one(c, f"{rel}/{c.name}")
        elif stat.S_ISREG(st.st_mode):
            h.update(f"{rel}:file:".encode())
            h.update(q.read_bytes())
        else:
            h.update(f"{rel}:special:{stat.S_IFMT(st.st_mode)}".encode())

    one(p, ".")
    return h.hexdigest()


def special_intact(p: str) -> bool:
    """The special destination is what the run found: a FIFO, or a link to a FIFO or /dev/null."""
    q = Path(p)
    if q.name.startswith("link-to-null"):
        return q.is_symlink() and os.readlink(q) == "/dev/null" and stat.S_ISCHR(os.stat(q).st_mode)
    if q.name.startswith("link-to-fifo"):
        return q.is_symlink() and stat.S_ISFIFO(os.stat(q).st_mode)
    return stat.S_ISFIFO(os.lstat(q).st_mode)


FIFO_SRC = (ROOT / "examples" / "fifo_policy.py").read_text()
PRED_SRC = '''\
import numpy as np

NAME = "{name}"
DESCRIPTION = "a broken predictor (hostile run)"


def predict(trace, arr, in_phase, width):
{body}
'''
_SHAPE_DEF = ("def state_shape(ent: np.ndarray, grp: np.ndarray) -> tuple[int, ...]:\n"
              "    # what init returns; the driver refuses another shape before the replay (a short state would\n"
              "    # let the hooks write past its end)\n    return (2 * ent.shape[1] + 2,)\n")
_INIT = "return np.full(state_shape(ent, grp), -1, np.int32)"
_VICTIM = "    e = ps[ps.shape[0] - 2]\n    while e >= 0 and not evictable(ent, e, load):\n        e = ps[2 * e + 1]\n    return e\n"
# name -> edits of examples/fifo_policy.py: each broken the way issue 29 item 3 lists
POLICY_BREAKS = {
    "victim-out-of-range": [(_VICTIM, "    return 1_000_000\n")],
    "victim-not-resident": [(_VICTIM, "    return ent.shape[1] - 1\n")],
    "short-state-declared": [(_INIT, "return np.full(3, -1, np.int32)")],
    "short-state-undeclared": [(_SHAPE_DEF, ""), (_INIT, "return np.full(3, -1, np.int32)")],
    "empty-state-undeclared": [(_SHAPE_DEF, ""), (_INIT, "return np.zeros(0, np.int32)")],
    "list-state": [(_INIT, "return [0, 1]")],
    "init-sys-exit": [(_INIT, "import sys; sys.exit(5)")],
    "init-raises": [(_INIT, "raise RuntimeError('boom')")],
    "import-sys-exit": [("import numpy as np\n", "import sys\nsys.exit(3)\nimport numpy as np\n")],
    "import-raises": [("import numpy as np\n", "import numpy as np\nraise ValueError('at import')\n")],
    "not-numba": [("@njit(inline=\"always\")\ndef on_touch", "def on_touch")],
    "typing-error": [("    head = ps.shape[0] - 2\n    t = ps[head + 1]", "    head = ps.shape[0] - 2\n    t = ps['x']")],
    "loops-forever": [(_VICTIM, "    while True:\n        e = 0\n    return e\n")],
    "no-name": [('NAME = "fifo"\n', "")],
}
PREDICTOR_BREAKS = {
    "sys-exit-0": "    import sys\n    sys.exit(0)",
    "keyboard-interrupt": "    raise KeyboardInterrupt",
    "wrong-shape": "    return np.zeros((3, 1), np.int32)",
    "wrong-dtype": "    return np.zeros((arr.experts.shape[0], width), np.float64) + 0.5",
    "out-of-range": "    return np.full((arr.experts.shape[0], width), 10**6, np.int32)",
    "not-array": "    return 'nope'",
    "loops-forever": "    while True:\n        pass",
    "raises": "    raise RuntimeError('boom')",
}


def _moetrace_plain(path: Path, layers=2, experts=4, k=2, tokens=6) -> Path:
    path.write_text("\n".join(f"{il},{(t + j + il) % experts}" for t in range(tokens) for il in range(layers)
                              for j in range(k)) + "\n")
    return path


def _hf_config(path: Path) -> Path:
    path.write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_experts": 4,
                                "moe_intermediate_size": 32, "num_experts_per_tok": 2}))
    return path


class World:
    """The fixtures every case reads (built once, in-process): never written by a case; each case
    that mutates or writes works in its own folder."""

    def __init__(self, root: Path) -> None:
        import replay
        from traces.synth.generator import SynthConfig, write_synthetic

        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.trace = root / "trace"
        write_synthetic(self.trace, SynthConfig(layers=3, experts=8, top_k=2, embd=8, tokens=12, prompt_tokens=4))
        self.rtrace = root / "rtrace"
        write_synthetic(self.rtrace, SynthConfig(layers=2, experts=8, top_k=2, embd=8, tokens=3, prompt_tokens=2, requests=3))
        self.big = root / "big"  # long enough that a signal lands inside the work
        write_synthetic(self.big, SynthConfig(layers=8, experts=32, top_k=4, embd=16, tokens=400, prompt_tokens=16))
        self.csv = root / "routes.csv"
        self.csv.write_text("token,layer,experts\n" + "".join(f"{t},{la},{t % 4}|{4 + la}\n" for t in range(6)
                                                              for la in range(2)))
        self.moetrace = _moetrace_plain(root / "moetrace.csv")
        self.config = _hf_config(root / "config.json")
        self.cost = root / "cost.json"
        self.cost.write_text(json.dumps(replay.manual_cost_model(flash_mib_s=2000, compute_ms=50).row()))
        self.grid = root / "grid.toml"
        self.grid.write_text(f'traces = ["{self.trace}"]\n[cache]\npolicies = ["lru"]\nbudgets_mib = [10]\n')
        self.big_grid = root / "big-grid.toml"
        self.big_grid.write_text(f'traces = ["{self.big}", "{self.trace}"]\n[cache]\npolicies = ["lru", "lfu", "belady"]\n'
                                 'budgets_mib = [4, 8, 16, 32]\n[predict]\npredictors = ["prev-token"]\n')
        self.fifo_policy = root / "fifo_policy.py"
        self.fifo_policy.write_text(FIFO_SRC)
        self.policies: dict[str, Path] = {}
        for name, edits in POLICY_BREAKS.items():
            pname = "bad_" + name.replace("-", "_")
            src = FIFO_SRC
            for old, new in edits:
                assert old in src, (name, old)
                src = src.replace(old, new)
            src = src.replace('NAME = "fifo"', f'NAME = "{pname}"')
            self.policies[name] = root / f"{pname}.py"
            self.policies[name].write_text(src)
        self.predictors: dict[str, Path] = {}
        for name, body in PREDICTOR_BREAKS.items():
            pname = "badpred_" + name.replace("-", "_")
            self.predictors[name] = root / f"{pname}.py"
            self.predictors[name].write_text(PRED_SRC.format(name=pname, body=body))
        self.sweep_results = root / "sweep-results"
        subprocess.run([sys.executable, "-m", "replay.cli", "sweep", str(self.grid), "-o", str(self.sweep_results),
                        "--workers", "1"], check=True, cwd=ROOT, env=_env(), capture_output=True)
        self.readonly = [self.trace, self.rtrace, self.big, self.csv, self.moetrace, self.config, self.cost, self.grid,
                         self.big_grid, self.fifo_policy, *self.policies.values(), *self.predictors.values()]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(extra or {})}


# --- drawing cases -------------------------------------------------------------------------------


def bad_value(rng: random.Random) -> str:
    k = rng.randrange(5)
    if k == 0:
        return rng.choice(BAD_NUMBERS)
    if k == 1:
        return repr(rng.choice([float("nan"), float("inf"), -0.0, 1e-320, 1.5, -2.5, 1e308, rng.uniform(-1e6, 1e6)]))
    if k == 2:
        return str(rng.randint(-(10**30), 10**30))
    if k == 3:
        return "".join(rng.choice("ab-_,.:;[]{}()0123456789 é√\t/") for _ in range(rng.randrange(7)))
    return ",".join(rng.choice(["lru", "nope", "", "belady", "stale-gate[9]", "stale-gate[0]", "ctrl", "-1", "1"])
                    for _ in range(rng.randrange(4)))


def draw_mutation(rng: random.Random) -> tuple:
    kind = rng.choice(["truncate-part", "truncate-json", "truncate-router", "truncate-wide", "json-field", "part-value",
                       "flip-part", "flip-router", "delete", "nested-json", "huge-int"])
    if kind in ("truncate-part", "truncate-json", "truncate-router"):
        return (kind, rng.random())
    if kind == "truncate-wide":
        return (kind, rng.choice(["logits", "gate_input"]), rng.random())
    if kind == "json-field":
        return (kind, rng.choice(JSON_FIELDS), rng.choice(JSON_VALUES))
    if kind == "part-value":
        return (kind, rng.choice(PART_COLUMNS), rng.randint(0, 10**6), rng.choice(PART_VALUES))
    if kind in ("flip-part", "flip-router"):
        return (kind, rng.random(), rng.randint(1, 255))
    if kind == "delete":
        return (kind, rng.choice(["trace.json", "routings/part-00000.parquet", "routings", "router.parquet",
                                  "routings/part-00000.gate_input.arrow"]))
    if kind == "nested-json":  # issue 29 item 4: deeply nested JSON
        return (kind, rng.choice([200, 5000, 100000]))
    return (kind, rng.choice(JSON_FIELDS[:6]), rng.choice([10**40, -(10**40), 2**63, 2**64 + 1]))


def apply_mutation(trace: Path, m: tuple) -> None:
    if m[0] == "nested-json":
        (trace / "trace.json").write_text("[" * m[1] + "]" * m[1])
    elif m[0] == "huge-int":
        mutate(trace, ("json-field", m[1], m[2]))
    else:
        mutate(trace, m)


def _fixed_and_picked(fixed: list[str], picked: list[str]) -> list[str]:
    """test_fuzz_cli's rule: the fixed options, less those being fuzzed (and their values)."""
    out, i = [], 0
    while i < len(fixed):
        takes_value = i + 1 < len(fixed) and not fixed[i + 1].startswith("--")
        if fixed[i] not in picked:
            out += fixed[i: i + 1 + takes_value]
        i += 1 + takes_value
    return out


def draw(family: str, rng: random.Random, w: World, work: Path) -> Case:
    t = str(w.trace)
    ro = [str(p) for p in w.readonly]
    if family == "fuzz-options":
        verb = rng.choice(sorted(VERBS))
        fixed, opts = VERBS[verb]
        picked = rng.sample(opts, rng.randint(1, min(2, len(opts))))
        head = verb.split()
        argv = head[:1] + (head[1:] if head[0] == "cost" else []) + [t] + _fixed_and_picked(fixed, picked)
        for o in picked:
            argv += [o, bad_value(rng)]
        if rng.random() < 0.3:  # the options every verb shares, fuzzed too
            argv += rng.choice([["--csv", str(work / bad_value(rng).replace("/", "_"))], ["--format", bad_value(rng)],
                                ["--policy-file", bad_value(rng)], ["--predictor-file", bad_value(rng)]])
        return Case(family, argv, ro, note=verb)
    if family == "fuzz-multi":
        verb = rng.choice(sorted(MULTI_VERBS))
        template, opts = MULTI_VERBS[verb]
        picked = rng.sample(opts, rng.randint(1, min(2, len(opts))))
        values = {o: bad_value(rng) for o in picked}
        out = work / "out"
        fill = {"{trace}": t, "{rtrace}": str(w.rtrace), "{csv}": str(w.csv), "{grid}": str(w.grid), "{out}": str(out),
                "RESULTS": str(w.sweep_results)}
        if "OUT" in values:
            fill["{out}"] = str(work / (values["OUT"].replace("/", "_").replace("\0", "_") or "_"))
        if "RESULTS" in values:
            fill["RESULTS"] = values["RESULTS"]
        argv, i = [], 0
        while i < len(template):
            takes_value = template[i].startswith("-") and i + 1 < len(template) and not template[i + 1].startswith("-")
            if not (template[i].startswith("-") and template[i] in picked):
                argv += [fill.get(a, a) for a in template[i: i + 1 + takes_value]]
            i += 1 + takes_value
        for o in picked:
            if o.startswith("-"):
                argv += [o, values[o]]
        return Case(family, argv, ro, note=verb)
    if family == "corrupt-trace":
        trace = work / "trace"
        shutil.copytree(w.trace, trace)
        m = draw_mutation(rng)
        apply_mutation(trace, m)
        verb = rng.choice([*TRACE_VERBS, ["report", "-o", str(work / "rep")], ["export", "libcachesim"],
                           ["upgrade"], ["compare", t, "--json"], ["schedule"]])
        if verb[0] == "export":
            argv = ["export", "libcachesim", str(trace), str(work / "x.bin")]
        elif verb[0] == "upgrade":
            argv = ["upgrade", str(trace), str(work / "v2")]
        elif verb[0] == "schedule":
            argv = ["schedule", str(trace), str(work / "sched"), "--schedule", "continuous", "--max-batch", "2"]
        else:
            argv = [verb[0], str(trace), *verb[1:]]
        return Case(family, argv, [*ro, str(trace)], note=f"{verb[0]} {m[0]}")
    if family == "plugin":
        if rng.random() < 0.65:
            brk = rng.choice(sorted(POLICY_BREAKS))
            p = w.policies[brk]
            name = "bad_" + brk.replace("-", "_")
            how = rng.choice(["cache", "report", "drop", "prefetch", "sweep"])
            if how == "cache":
                argv = ["cache", t, "--policy-file", str(p), "--policies", f"lru,{name}", "--budgets", "1"]
            elif how == "report":
                argv = ["report", t, "-o", str(work / "rep"), "--policy-file", str(p), "--policies", f"lru,{name}",
                        "--budgets", "1", "--budget-mib", "1"]
            elif how == "drop":
                argv = ["drop", t, "--policy-file", str(p), "--policy", name, "--budget-mib", "1", "--mode", "closed"]
            elif how == "prefetch":
                argv = ["prefetch", t, "--policy-file", str(p), "--policy", name, "--budget-mib", "1"]
            else:
                g = work / "grid.toml"
                g.write_text(f'traces = ["{t}"]\n[cache]\npolicy_file = "{p}"\npolicies = ["{name}"]\nbudgets_mib = [1, 2]\n')
                argv = ["sweep", str(g), "-o", str(work / "R"), "--workers", "1"]
        else:
            brk = rng.choice(sorted(PREDICTOR_BREAKS))
            p = w.predictors[brk]
            name = "badpred_" + brk.replace("-", "_")
            how = rng.choice(["predict", "prefetch", "cache --retain", "report"])
            if how == "predict":
                argv = ["predict", t, "--predictor-file", str(p), "--predictors", name]
            elif how == "prefetch":
                argv = ["prefetch", t, "--predictor-file", str(p), "--predictor", name, "--budget-mib", "1"]
            elif how == "cache --retain":
                argv = ["cache", t, "--predictor-file", str(p), "--retain", "--predictor", name, "--budgets", "1"]
            else:
                argv = ["report", t, "-o", str(work / "rep"), "--predictor-file", str(p), "--budgets", "1",
                        "--budget-mib", "1"]
        send = (rng.choice(USER_SIGNALS), rng.uniform(3, 8)) if "loops-forever" in brk else None
        return Case(family, argv, ro, send=send, note=f"{brk} via {how}", timeout=120)
    if family in ("signal", "sigkill"):
        argv = rng.choice(_long_verbs(w, work))
        sig = signal.SIGKILL if family == "sigkill" else rng.choice(USER_SIGNALS)
        return Case(family, argv, ro, send=(sig, rng.uniform(0.0, 4.0)), note=f"{argv[0]} {signal.Signals(sig).name}")
    if family == "full-disk":
        argv = rng.choice(_writers(w, work, rng))
        return Case(family, argv, ro, fsize=rng.choice([0, 256, 4096, 65536]), note=argv[0] + " " + argv[1])
    if family == "race":
        d = work / "same"
        pick = rng.choice(["csv", "export", "report", "sweep", "synth"])
        if pick == "csv":
            a = ["cache", t, "--budgets", "1", "--csv", str(d)]
            b = ["cache", t, "--budgets", "2", "--csv", str(d)]
        elif pick == "export":
            a = ["export", "libcachesim", t, str(d)]
            b = ["export", "libcachesim", str(w.big), str(d)]
        elif pick == "report":
            a = ["report", t, "-o", str(d), "--budgets", "1", "--budget-mib", "1"]
            b = a[:] + (["--force"] if rng.random() < 0.5 else [])
        elif pick == "sweep":
            a = ["sweep", str(w.grid), "-o", str(d), "--workers", "1"]
            b = a[:]
        else:
            a = ["synth", str(d), "--tokens", "20", "--layers", "2"]
            b = a[:] + ["--seed", "2"]
        return Case(family, a, ro, twin=b, note=pick)
    if family == "special-dest":
        os.mkfifo(work / "fifo")
        (work / "link-to-fifo").symlink_to(work / "fifo")
        (work / "link-to-null").symlink_to("/dev/null")  # only the link is a destination; /dev/null is never opened
        dest = str(work / rng.choice(["fifo", "link-to-fifo", "link-to-null"]))
        argv = rng.choice([["cache", t, "--budgets", "1", "--csv", dest], ["export", "libcachesim", t, dest],
                           ["export", "bigmoe", t, dest], ["report", t, "-o", dest, "--force"],
                           ["synth", dest, "--tokens", "4", "--force"], ["sweep", str(w.grid), "-o", dest],
                           ["upgrade", t, dest],
                           ["schedule", str(w.rtrace), dest, "--schedule", "continuous", "--max-batch", "2"],
                           ["import", "llamacpp-moetrace", str(w.moetrace), dest, "--top-k", "2", "--prompt-tokens", "2",
                            "--expert-bytes", "1000", "--force"]])
        return Case(family, argv, ro, specials=[dest], note=f"{argv[0]} onto {Path(dest).name}")
    if family == "input-dest":
        d = work / "D"
        d.mkdir()
        shutil.copy(w.fifo_policy, d / "fifo_policy.py")
        shutil.copy(w.config, d / "config.json")
        tcopy = work / "T"
        shutil.copytree(w.trace, tcopy)
        choices = [
            ["report", t, "-o", str(d), "--force", "--policy-file", str(d / "fifo_policy.py"), "--budgets", "1"],
            ["cache", t, "--policy-file", str(d / "fifo_policy.py"), "--policies", "fifo", "--budgets", "1", "--csv",
             str(d / "fifo_policy.py")],
            ["cache", t, "--policies", "pin", "--pin-profile", str(tcopy), "--budgets", "1", "--csv", str(tcopy / "trace.json")],
            ["import", "llamacpp-moetrace", str(w.moetrace), str(d), "--sizes-from", str(d / "config.json"), "--force",
             "--top-k", "2", "--prompt-tokens", "2"],
            ["export", "libcachesim", str(tcopy), str(tcopy / "trace.json")],
            ["cache", str(tcopy), "--budgets", "1", "--csv", str(tcopy / "routings" / "part-00000.parquet")],
            ["cache", t, "--cost-model", str(d / "config.json"), "--budgets", "1", "--csv", str(d / "config.json")],
            ["sweep", str(w.grid), "-o", str(w.root)],
            ["report", str(tcopy), "-o", str(tcopy), "--force"],
        ]
        return Case(family, rng.choice(choices), [*ro, str(d), str(tcopy)], note="input as destination")
    if family == "import-garbage":
        name = rng.choice(sorted(GARBAGE))
        src = work / name
        src.write_bytes(GARBAGE[name](rng))
        fmt = rng.choice(IMPORTERS)
        extra = rng.choice([["--expert-bytes", "1000"], ["--sizes-from", str(w.config)], [],
                            ["--expert-bytes", "1000", "--top-k", "2", "--prompt-tokens", "2"]])
        return Case(family, ["import", fmt, str(src), str(work / "imp"), *extra], [*ro, str(src)], note=f"{fmt} {name}")
    raise AssertionError(family)


def _long_verbs(w: World, work: Path) -> list[list[str]]:
    b = str(w.big)
    return [
        ["info", b], ["cache", b, "--budgets", "4,8,16", "--csv", str(work / "c.csv")], ["predict", b],
        ["drop", b, "--mode", "closed", "--budget-mib", "8"], ["prefetch", b, "--budget-mib", "8"],
        ["report", b, "-o", str(work / "rep"), "--budgets", "4,8", "--budget-mib", "8"],
        ["synth", str(work / "syn"), "--tokens", "600", "--layers", "8", "--experts", "32", "--top-k", "4"],
        ["sweep", str(w.big_grid), "-o", str(work / "R"), "--workers", "2"],
        ["import", "llamacpp-moetrace", str(w.moetrace), str(work / "imp"), "--top-k", "2", "--prompt-tokens", "2",
         "--expert-bytes", "1000"],
        ["export", "libcachesim", b, str(work / "x.bin")], ["upgrade", b, str(work / "v2")],
        ["schedule", str(w.rtrace), str(work / "sched"), "--schedule", "continuous", "--max-batch", "2"],
        ["compare", b, b],
        ["cache", b, "--retain", "--predictor", "prev-token", "--budgets", "8"], ["sweep-report", str(w.sweep_results)],
        ["cost", "check", b, "--cost-model", str(w.cost), "--budget-mib", "8"],
    ]


def _writers(w: World, work: Path, rng: random.Random) -> list[list[str]]:
    t = str(w.trace)
    return [
        ["cache", t, "--budgets", "1,2", "--csv", str(work / "c.csv")],
        ["report", t, "-o", str(work / "rep"), "--budgets", "1", "--budget-mib", "1"],
        ["synth", str(work / "syn"), "--tokens", "40", "--layers", "4"],
        ["export", "libcachesim", t, str(work / "x.bin")],
        ["upgrade", t, str(work / "v2")],
        ["schedule", str(w.rtrace), str(work / "sched"), "--schedule", "continuous", "--max-batch", "2"],
        ["import", "llamacpp-moetrace", str(w.moetrace), str(work / "imp"), "--top-k", "2", "--prompt-tokens", "2",
         "--expert-bytes", "1000"],
        ["sweep", str(w.grid), "-o", str(work / "R"), "--workers", "1"],
        ["predict", t, "--csv", str(work / "p.csv")],
    ]


# --- running one case -----------------------------------------------------------------------------


def session_pids(sid: int) -> list[int]:
    """Live processes (zombies left out) of session ``sid``, from /proc (tests/test_recover.py too)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            s = (d / "stat").read_text()
        except OSError:
            continue
        f = s[s.rindex(")") + 2:].split()
        if int(f[3]) == sid and f[0] != "Z":
            out.append(int(d.name))
    return out


def _start(argv: list[str], case: Case, work: Path, tag: str) -> subprocess.Popen:
    def limits() -> None:
        if case.fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (case.fsize, case.fsize))

    # stdout and stderr are pipes, drained by threads: a file would fall under RLIMIT_FSIZE too (the
    # tool's one line could not be written), and a pipe shows who still holds it
    p = subprocess.Popen([sys.executable, "-m", "replay.cli", *argv], cwd=work, env=_env(case.env),
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True, preexec_fn=limits)
    p.drained = {}  # type: ignore[attr-defined]
    p.drains = []  # type: ignore[attr-defined]
    for name, stream in (("out", p.stdout), ("err", p.stderr)):
        def drain(name: str = name, stream=stream) -> None:
            p.drained[name] = stream.read()  # type: ignore[attr-defined]

        th = threading.Thread(target=drain, daemon=True)
        th.start()
        p.drains.append(th)  # type: ignore[attr-defined]
    return p


def _handles_sigterm(pid: int) -> bool:
    """The process catches SIGTERM: the tool's handler is in place (it installs SIGINT, SIGTERM
    and SIGHUP at once, as the first thing replay.cli does; Python itself catches only SIGINT)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool((int(line.split()[1], 16) >> (signal.SIGTERM - 1)) & 1)
    except OSError:
        pass
    return False


def classify(rc: int | None, err: str, sent: int | None, out: str = "", early: bool = False) -> str:
    if rc is None:
        return "hung (killed after the time limit)"
    if early and sent in USER_SIGNALS and (rc == -sent or "KeyboardInterrupt" in err):
        # sent while the interpreter was still starting, before the first line of the tool's code
        # could install a handler (site, the editable install's finder: ~70-180 ms here)
        return "signal before the tool's first line (interpreter start): default action"
    if rc < 0:
        s = -rc
        if s in CRASH_SIGNALS:
            return f"crash ({signal.Signals(s).name})"
        if s == signal.SIGKILL and sent == signal.SIGKILL:
            return "killed by our SIGKILL"
        return f"default action of {signal.Signals(s).name}"
    if rc == 3 or "internal error" in err:
        return "exit 3 (a bug)"
    if "Traceback (most recent call last)" in err:
        return "traceback"
    if sent is not None and rc == 128 + sent:
        return "interrupted: own message" if "moe-replay: interrupted by" in err else "interrupted: no message"
    if rc == 0:
        return "exit 0"
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("moe-replay: warning:")]
    if rc == 2:
        one = len(lines) == 1 and lines[0].startswith("moe-replay: error: ")
        return "exit 2: one sentence" if one else "exit 2: not one sentence"
    if rc == 1:  # a check ran and failed: it says so (its table on stdout, or a line on stderr)
        return "exit 1: a check failed" if out.strip() or lines else "exit 1: not one sentence (nothing said)"
    return f"exit {rc}"


BAD = ("crash", "exit 3", "traceback", "default action", "hung", "interrupted: no message")


def run_case(i: int, case: Case, base: Path) -> dict:
    work = base / f"run-{i:04d}"
    work.mkdir(exist_ok=True)
    before = {p: digest(p) for p in case.inputs}
    t0 = time.monotonic()
    procs = [("a", case.argv)] + ([("b", case.twin)] if case.twin else [])
    started = [(tag, _start(argv, case, work, tag)) for tag, argv in procs]
    sent, early = None, False
    if case.send is not None:
        sig, delay = case.send
        time.sleep(delay)
        if started[0][1].poll() is None:
            early = not _handles_sigterm(started[0][1].pid)
            os.kill(started[0][1].pid, sig)  # the verb's process only (kill PID), never its group
            sent = sig
    rcs = []
    for _, p in started:
        try:
            rcs.append(p.wait(timeout=max(1.0, case.timeout - (time.monotonic() - t0))))
        except subprocess.TimeoutExpired:
            rcs.append(None)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    seconds = time.monotonic() - t0
    # what still runs in the run's sessions: given up to 15 s to go (a worker finishing its batch)
    deadline = time.monotonic() + 15
    left = [q for _, p in started for q in session_pids(p.pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [q for _, p in started for q in session_pids(p.pid)]
    leftover = []
    for q in left:
        with contextlib.suppress(OSError):
            leftover.append(Path(f"/proc/{q}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
        with contextlib.suppress(ProcessLookupError):
            os.kill(q, signal.SIGKILL)
    for _, p in started:
        for th in p.drains:  # type: ignore[attr-defined]
            th.join(10)
    errs = [p.drained.get("err", b"").decode(errors="replace") for _, p in started]  # type: ignore[attr-defined]
    outs = [p.drained.get("out", b"").decode(errors="replace") for _, p in started]  # type: ignore[attr-defined]
    outcomes = [classify(rc, e, sent if j == 0 else None, o, early and j == 0)
                for j, (rc, e, o) in enumerate(zip(rcs, errs, outs))]
    changed = [p for p in case.inputs if digest(p) != before[p]]
    replaced = [p for p in case.specials if not special_intact(p)]
    rec = {"run": i, "family": case.family, "note": case.note, "argv": case.argv, "twin": case.twin,
           "send": [signal.Signals(case.send[0]).name, round(case.send[1], 2)] if case.send else None,
           "sent_before_handler": early, "fsize": case.fsize, "rc": rcs, "outcome": outcomes,
           "inputs_changed": changed, "specials_replaced": replaced, "leftover": leftover,
           "seconds": round(seconds, 2), "stderr": [e[-600:] for e in errs]}
    shutil.rmtree(work, ignore_errors=True)
    return rec


# --- the run --------------------------------------------------------------------------------------


def summary(records: list[dict]) -> str:
    outcomes = collections.Counter(o for r in records for o in r["outcome"])
    fam = collections.Counter(r["family"] for r in records)
    inv = {
        "exit 3 (a bug)": sum(o.startswith("exit 3") for r in records for o in r["outcome"]),
        "crash (SIGSEGV, SIGABRT, ...)": sum(o.startswith("crash") for r in records for o in r["outcome"]),
        "traceback": sum(o == "traceback" for r in records for o in r["outcome"]),
        "signal's default action once the tool's code runs (no message)": sum(
            o.startswith("default action") or o == "interrupted: no message" for r in records for o in r["outcome"]),
        "hung past the time limit": sum(o.startswith("hung") for r in records for o in r["outcome"]),
        "refusal not one sentence": sum(o.endswith("not one sentence") for r in records for o in r["outcome"]),
        "inputs changed": sum(len(r["inputs_changed"]) for r in records),
        "special files replaced": sum(len(r["specials_replaced"]) for r in records),
        "leftover processes": sum(len(r["leftover"]) for r in records),
    }
    lines = [f"runs: {len(records)} cases, {sum(len(r['outcome']) for r in records)} processes "
             f"({', '.join(f'{k} {v}' for k, v in sorted(fam.items()))})", "",
             "| outcome | processes |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(outcomes.items(), key=lambda kv: (-kv[1], kv[0]))]
    lines += ["", "| invariant broken | count |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in inv.items()]
    return "\n".join(lines)


def broken(r: dict) -> bool:
    return (any(o.startswith(BAD) for o in r["outcome"]) or r["inputs_changed"] or r["specials_replaced"]
            or r["leftover"] or any(o.endswith("not one sentence") for o in r["outcome"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset")
    ap.add_argument("--log", type=Path, default=None, help="one JSON line per run")
    ap.add_argument("--minutes", type=float, default=None, help="stop drawing new cases after this long")
    a = ap.parse_args(argv)
    fams = [f for f in a.families.split(",") if f]
    rng = random.Random(a.seed)
    t0 = time.monotonic()
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="moe-replay-hostile-") as d:
        base = Path(d)
        world = World(base / "world")
        cases = []
        for i in range(a.runs):
            fam = rng.choices(fams, weights=[FAMILIES[f] for f in fams])[0]
            work = base / f"run-{i:04d}"
            work.mkdir()
            cases.append((i, draw(fam, random.Random(rng.random()), world, work)))
        before = {str(p): digest(p) for p in world.readonly}
        log = open(a.log, "w") if a.log else None
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
            futs = []
            for i, c in cases:
                futs.append(pool.submit(lambda i=i, c=c: None if a.minutes and time.monotonic() - t0 > 60 * a.minutes
                                        else run_case(i, c, base)))
            for f in futs:
                r = f.result()
                if r is None:
                    continue
                records.append(r)
                if log:
                    log.write(json.dumps(r) + "\n")
                    log.flush()
                if broken(r):
                    print(f"BROKEN run {r['run']} [{r['family']}: {r['note']}] {' '.join(r['argv'])[:300]} -> "
                          f"{r['outcome']} changed={r['inputs_changed']} replaced={r['specials_replaced']} "
                          f"leftover={r['leftover']}\n  {r['stderr'][0][-400:]!r}", flush=True)
        assert all(digest(p) == before[p] for p in before), "a fixture changed"
    print(summary(records))
    print(f"wall: {time.monotonic() - t0:.0f} s, seed {a.seed}, jobs {a.jobs}")
    return 1 if any(broken(r) for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
