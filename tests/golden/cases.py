"""Golden outputs (issue 27): every verb's ``--json`` output, the demo report and a report of each
real trace, recorded by the code *before* the one-body change and held byte for byte afterwards.

``python -m tests.golden.regen`` writes ``tests/golden/expected/``; ``tests/test_golden.py`` runs the
same cases and compares. Only the tool's version string is masked (it may change); every figure,
key and byte of layout is compared as written.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = Path(__file__).resolve().parent / "expected"
SHARED_DATA = Path(os.environ.get("MOE_REPLAY_SHARED", ROOT.parent / "shared")) / "data" / "bigmoeonedge-2026-07-15"
REAL = ("qwen", "gemma", "gptoss")

# The synthetic traces every case runs on: small, with requests, and with the wide columns.
SYNTH = {
    "syn": ["--layers", "6", "--experts", "24", "--top-k", "4", "--embd", "32", "--tokens", "80", "--prompt-tokens", "12",
            "--seed", "3"],
    "srv": ["--layers", "4", "--experts", "16", "--top-k", "2", "--embd", "16", "--tokens", "24", "--prompt-tokens", "6",
            "--requests", "5", "--max-batch", "3", "--seed", "5", "--routing-only"],
}

# (case name, argv after `moe-replay`): {T} is the synthetic trace, {S} the served one, {Q}/{G}/{O} the
# real traces, {W} a scratch folder. Every analysis verb's --json, on several option sets.
SYNTH_CASES: list[tuple[str, list[str]]] = [
    ("info_syn", ["info", "{T}", "--json"]),
    ("info_srv", ["info", "{S}", "--json"]),
    ("cache_syn_default", ["cache", "{T}", "--json"]),
    ("cache_syn_all", ["cache", "{T}", "--json", "--policies", "lru,lfu,lfu-incache,random,layer,layerlfu,lfru,belady,infinite",
                       "--budgets", "40,100,200,300", "--per-layer"]),
    ("cache_syn_stream", ["cache", "{T}", "--json", "--policies", "lru,layer", "--budgets", "70,150", "--stream", "on"]),
    ("cache_syn_prefill", ["cache", "{T}", "--json", "--phase", "all", "--policies", "lru,s3fifo,sieve", "--budgets", "100,200"]),
    ("cache_srv", ["cache", "{S}", "--json", "--policies", "lru,lfu,belady", "--budgets", "30,60"]),
    ("cache_syn_retain", ["cache", "{T}", "--json", "--retain", "--predictor", "prev-token", "--budgets", "100,200"]),
    ("predict_syn", ["predict", "{T}", "--json", "--horizon", "1..2"]),
    ("predict_syn_layers", ["predict", "{T}", "--json", "--per-layer"]),
    ("predict_srv", ["predict", "{S}", "--json"]),
    ("drop_syn_static", ["drop", "{T}", "--json"]),
    ("drop_syn_closed", ["drop", "{T}", "--json", "--mode", "closed", "--budget-mib", "150", "--fracs", "0.5,1"]),
    ("prefetch_syn", ["prefetch", "{T}", "--json", "--budget-mib", "150"]),
    ("prefetch_syn_gate", ["prefetch", "{T}", "--json", "--budget-mib", "150", "--predictor", "stale-gate[1]", "--cap", "2",
                           "--policy", "lfru", "--guard"]),
    ("compare_syn", ["compare", "{T}", "{T}", "--json"]),
    ("curve_syn", ["curve", "{T}", "--json", "--policies", "lru,layer,layer-opt", "--budgets", "100,200"]),
]
# Cases that write a file or a directory ({W}/NAME): the file's bytes (or a Parquet table's rows) are compared.
FILE_CASES: list[tuple[str, list[str], str]] = [
    ("export_lcs_syn", ["export", "libcachesim", "{T}", "{W}/syn.oracleGeneral"], "syn.oracleGeneral"),
    ("export_bigmoe_gptoss", ["export", "bigmoe", "{gptoss}", "{W}/gptoss.route.csv"], "gptoss.route.csv"),
    ("schedule_srv", ["schedule", "{S}", "{W}/srv-seq", "--schedule", "sequential"], "srv-seq/"),
    ("sweep_syn", ["sweep", "{W}/grid.toml", "-o", "{W}/sweep", "--workers", "1"], "sweep"),
    ("cache_syn_csv", ["cache", "{T}", "--policies", "lru,lfu", "--budgets", "100,200", "--csv", "{W}/cache.csv"], "cache.csv"),
]
GRID = """traces = ["{T}"]
[cache]
policies = ["lru", "lfu", "belady"]
budgets_mib = [100, 200]
[predict]
predictors = ["prev-token", "stale-gate"]
horizons = [1, 2]
[drop]
modes = ["closed"]
fracs = [0.5, 1.0]
policies = ["lru"]
budgets_mib = [150]
"""

REAL_CASES: list[tuple[str, list[str]]] = [
    ("info_{n}", ["info", "{R}", "--json"]),
    ("cache_{n}", ["cache", "{R}", "--json"]),
    ("cache_{n}_more", ["cache", "{R}", "--json", "--policies", "lru,s3fifo,layer-opt,colibri", "--budgets", "1000,4000",
                        "--per-layer"]),
    ("predict_{n}", ["predict", "{R}", "--json"]),
    ("drop_{n}", ["drop", "{R}", "--json"]),
    ("drop_{n}_closed", ["drop", "{R}", "--json", "--mode", "closed"]),
    ("prefetch_{n}", ["prefetch", "{R}", "--json"]),
    ("costfit_{n}", ["cost", "fit", "{R}", "--json"]),
    ("costcheck_{n}", ["cost", "check", "{R}", "--json"]),
]

_VERSION = re.compile(r'("(?:tool_version|version|moe_replay_version)"\s*:\s*)"[^"]*"')
# Cache keys of sweep cells hash the tool version and the trace's bytes: not figures (masked).
_KEYS = re.compile(r'("(?:cell_key|key|trace_id)"\s*:\s*)"[0-9a-f]+"')
# A sweep's run record says how long it took: wall-clock, not a figure of the trace (masked).
_TIMES = re.compile(r'("(?:seconds|cells_per_s)"\s*:\s*)[0-9.e+-]+')


def mask(text: str) -> str:
    """The output with the tool's version string masked (the only thing allowed to change)."""
    from traces.format.version import __version__

    text = _TIMES.sub(r"\1<time>", _KEYS.sub(r'\1"<key>"', _VERSION.sub(r'\1"<v>"', text)))
    return text.replace(__version__, "<version>")


def cli(*args: str) -> subprocess.CompletedProcess:
    """``moe-replay ARGS`` run in this process (tests.helpers.run_cli: the console script's own
    ``main``), as a CompletedProcess. In-process: each case would otherwise pay a fresh interpreter,
    Numba's import and its cached kernels' load (about a second), sixty times over."""
    from tests.helpers import run_cli

    r = run_cli(*args)
    return subprocess.CompletedProcess(["moe-replay", *args], r.code, r.out, r.err)


def build_traces(work: Path) -> dict[str, str]:
    """Synthetic traces (and the real ones, imported, when ../shared/data is there) under ``work``."""
    paths: dict[str, str] = {}
    for key, args in SYNTH.items():
        out = work / key
        r = cli("synth", str(out), *args, "--force")
        assert r.returncode == 0, r.stderr
        paths[key] = str(out)
    for name in REAL:
        csv = SHARED_DATA / f"{name}.route.csv"
        if csv.is_file():
            out = work / name
            r = cli("import", "bigmoe", str(csv), str(out), "--metrics", str(SHARED_DATA / f"{name}.metrics"), "--force")
            assert r.returncode == 0, r.stderr
            paths[name] = str(out)
    return paths


def cases(paths: dict[str, str]) -> list[tuple[str, list[str]]]:
    out = []
    for name, argv in SYNTH_CASES:
        out.append((name, [a.replace("{T}", paths["syn"]).replace("{S}", paths["srv"]) for a in argv]))
    for n in REAL:
        if n in paths:
            for name, argv in REAL_CASES:
                out.append((name.format(n=n), [a.replace("{R}", paths[n]) for a in argv]))
    return out


def run_case(argv: list[str], paths: dict[str, str]) -> str:
    r = cli(*argv)
    text = r.stdout
    for key, p in sorted(paths.items(), key=lambda kv: -len(kv[1])):
        text = text.replace(p, "{" + key + "}")
    err = "" if r.returncode == 0 else r.stderr
    for key, p in sorted(paths.items(), key=lambda kv: -len(kv[1])):
        err = err.replace(p, "{" + key + "}")
    return mask(f"exit {r.returncode}\n{text}{err}")


def file_digest(path: Path, paths: dict[str, str]) -> str:
    """A written file or directory as one text: Parquet tables as their rows (masked), text in full,
    other bytes by SHA-256."""
    import pyarrow.parquet as pq

    lines = []
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
    for f in files:
        rel = f.relative_to(path.parent).as_posix()
        if f.suffix == ".parquet":
            rows = pq.read_table(f).to_pylist()
            if f.parent.name == "chunks" and rows and "key" in rows[0]:
                # A sweep's cell cache holds its cells in the order of their (masked) keys, hashes of
                # the tool version and the trace's bytes: not a figure, and it moves with either.
                rows = sorted(rows, key=lambda r: json.dumps({**r, "key": None}, sort_keys=True, default=str))
            text = json.dumps(rows, sort_keys=True, default=str, indent=0)
        elif f.suffix in (".csv", ".json", ".md", ".txt", ".toml"):
            text = f.read_text()
        else:
            lines.append(f"== {rel} sha256={hashlib.sha256(f.read_bytes()).hexdigest()}")
            continue
        for key, p in sorted(paths.items(), key=lambda kv: -len(kv[1])):
            text = text.replace(p, "{" + key + "}")
        lines.append(f"== {rel}")
        lines.append(mask(text))
    return "\n".join(lines) + "\n"


def file_cases(paths: dict[str, str], work: Path) -> dict[str, str]:
    got = {}
    w = work / "files"
    w.mkdir()
    (w / "grid.toml").write_text(GRID.replace("{T}", paths["syn"]))
    for name, argv, target in FILE_CASES:
        if any(f"{{{n}}}" in a and n not in paths for a in argv for n in REAL):
            continue  # a real trace the case needs is absent
        argv = [a.replace("{T}", paths["syn"]).replace("{S}", paths["srv"]).replace("{W}", str(w)) for a in argv]
        for n in REAL:
            if n in paths:
                argv = [a.replace(f"{{{n}}}", paths[n]) for a in argv]
        r = cli(*argv)
        assert r.returncode == 0, (name, r.stderr)
        if target.endswith("/"):  # a trace: judged by its figures, not its bytes (the format may change)
            out = str(w / target.rstrip("/"))
            pw = {**paths, "W": str(w)}
            got[name] = run_case(["info", out, "--json"], pw) + run_case(
                ["cache", out, "--json", "--policies", "lru,belady", "--budgets", "30,60"], pw)
        else:
            got[name] = file_digest(w / target, {**paths, "W": str(w)})
    return got


def report_digest(out: Path, paths: dict[str, str]) -> str:
    """A report directory as one text: its text files in full (masked), its images by SHA-256."""
    lines = []
    for f in sorted(out.rglob("*")):
        if not f.is_file():
            continue
        rel = f.relative_to(out).as_posix()
        if f.suffix in (".md", ".json", ".csv", ".html", ".txt"):
            text = f.read_text()
            for key, p in sorted(paths.items(), key=lambda kv: -len(kv[1])):
                text = text.replace(p, "{" + key + "}")
            text = mask(text)
            lines.append(f"== {rel} sha256={hashlib.sha256(text.encode()).hexdigest()}")
            if f.suffix != ".html":
                lines.append(text)
        else:
            lines.append(f"== {rel} sha256={hashlib.sha256(f.read_bytes()).hexdigest()}")
    return "\n".join(lines) + "\n"


def reports(paths: dict[str, str], work: Path) -> dict[str, str]:
    got = {}
    for key in ("syn", *REAL):
        if key not in paths:
            continue
        out = work / f"report-{key}"
        r = cli("report", paths[key], "-o", str(out), "--force")
        assert r.returncode == 0, r.stderr
        got[f"report_{key}"] = report_digest(out, paths)
    return got


def everything(work: Path) -> dict[str, str]:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    paths = build_traces(work)
    got = {name: run_case(argv, paths) for name, argv in cases(paths)}
    got.update(file_cases(paths, work))
    got.update(reports(paths, work))
    return got
