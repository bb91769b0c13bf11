"""Exports: a trace written in other tools' formats.

- ``libcachesim``: libCacheSim's ``oracleGeneral`` binary trace (libCacheSim/traceReader/
  customizedReader/oracle/oracleGeneralBin.h): one packed 24-byte little-endian record per
  request, ``uint32 clock_time, uint64 obj_id, uint32 obj_size, int64 next_access_vtime``, where
  ``next_access_vtime`` is the 1-based index of the next request to the same object and -1 when
  there is none (what libCacheSim's own traceConv writes). The requests are the replay's lookups
  in the replay's order: loads ((batch, layer) groups) in trace order, and inside a load each
  unique expert once, token-major (step, then slot), in order of first appearance -- all phases,
  prefill included. ``obj_id = layer * n_expert + expert``, ``obj_size = expert_bytes[layer]``,
  ``clock_time`` the load's batch index.
- ``bigmoe``: BigMoeOnEdge's route_trace v1 CSV, the file the ``bigmoe`` importer reads (the
  model path, the weights at the engine's ``%g`` precision, residency and read bytes as recorded).
  Importing the CSV of a trace imported from such a CSV gives the same file, byte for byte.

Where libCacheSim and the replay agree, and where they cannot (README "Export to libCacheSim"):
on a top-1 trace whose experts all cost the same, every load is one lookup and LRU / Belady hit
counts are equal. With top-k > 1 a load holds several requests; the replay admits them all and
evicts after the load (never an expert the load touched), libCacheSim evicts before each insert
and may evict an expert the same load requested a moment before. Belady looks ahead per request
there, per load here.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np

from traces.format.errors import UserError
from traces.io.atomic import check_output_file, write_output_bytes
from traces.io.reader import Trace, open_trace

#: One oracleGeneral record: uint32 clock_time, uint64 obj_id, uint32 obj_size, int64 next_access_vtime.
ORACLE_GENERAL = np.dtype([("clock_time", "<u4"), ("obj_id", "<u8"), ("obj_size", "<u4"), ("next_access_vtime", "<i8")])
assert ORACLE_GENERAL.itemsize == 24


def lookups(trace: Trace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The replay's lookups in order: (batch, layer, expert) of each unique expert of each load,
    loads in trace order, experts token-major in order of first appearance."""
    a = trace.arrays(recorded=False)
    n, k = a.experts.shape
    if n == 0:
        return (np.zeros(0, np.int64),) * 3
    new_load = np.ones(n, dtype=bool)
    new_load[1:] = (a.batch[1:] != a.batch[:-1]) | (a.layer[1:] != a.layer[:-1])
    load = np.repeat(np.cumsum(new_load) - 1, k)
    ex = a.experts.reshape(-1).astype(np.int64)
    key = load * int(trace.model["n_expert"]) + ex
    _, first = np.unique(key, return_index=True)
    first.sort()  # keys grow with the load, so sorted first occurrences are in load order, then first appearance
    row = first // k
    return a.batch[row].astype(np.int64), a.layer[row].astype(np.int64), ex[first]


def oracle_general_records(trace: Trace) -> np.ndarray:
    """The oracleGeneral records of ``trace`` (see the module docstring)."""
    batch, layer, expert = lookups(trace)
    n_expert = int(trace.model["n_expert"])
    obj = layer * n_expert + expert
    size = trace.expert_bytes[layer]
    if size.size and int(size.max()) >= 1 << 32:
        raise UserError(f"{trace.path}: an expert of {int(size.max())} bytes does not fit libCacheSim's uint32 obj_size.")
    if batch.size and int(batch.max()) >= 1 << 32:
        raise UserError(f"{trace.path}: more than 2^32 batches do not fit libCacheSim's uint32 clock_time.")
    rec = np.empty(obj.size, dtype=ORACLE_GENERAL)
    rec["clock_time"], rec["obj_id"], rec["obj_size"] = batch, obj, size
    rec["next_access_vtime"] = next_access_vtime(obj)
    return rec


def next_access_vtime(obj: np.ndarray) -> np.ndarray:
    """oracleGeneral's ``next_access_vtime`` of each request to object ``obj[i]``: the 1-based index
    of the next request to the same object, -1 when there is none (int64)."""
    nxt = np.full(obj.size, -1, dtype=np.int64)
    order = np.argsort(obj, kind="stable")
    same = obj[order][1:] == obj[order][:-1]
    nxt[order[:-1][same]] = order[1:][same] + 1
    return nxt


def bigmoe_csv(trace: Trace) -> str:
    """The route_trace v1 CSV of ``trace`` (needs the recorded residency and read bytes)."""
    if not (trace.has("residency") and trace.has("read_bytes")):
        raise UserError(f"{trace.path}: has no recorded residency and read bytes, which every row of a BigMoeOnEdge "
                        "route CSV carries; only a trace with them can be exported as one.")
    m = trace.model
    prov = trace.meta.get("provenance", {})
    model_path = prov.get("model_path") or f"{m['name']}.gguf"
    out = io.StringIO()
    out.write("# route_trace v1\n")
    out.write(f"# model={model_path} arch={m['arch']} n_layer={m['n_layer']} n_expert={m['n_expert']} "
              f"n_expert_used={m['top_k']}\n")
    for layer in range(m["n_layer"]):
        eb, db = trace.meta["expert_bytes"][layer], trace.meta["dense_bytes"][layer]
        out.write(f"# layer={layer} expert_bytes={eb or 0} dense_bytes={db or 0}\n")
    a = trace.arrays()
    dropped = a.dropped
    out.write("turn,phase,step,layer,slot,expert,weight,residency,expert_bytes" + (",dropped" if dropped is not None else "") + "\n")
    k = a.experts.shape[1]
    for i in range(a.n_rows):
        head = f"{a.turn[i]},{a.phase[i]},{a.step[i]},{a.layer[i]},"
        for s in range(k):
            w = float(a.weights[i, s])
            line = (f"{head}{s},{a.experts[i, s]},{'nan' if math.isnan(w) else format(w, 'g')},"
                    f"{a.residency[i, s]},{a.read_bytes[i, s]}")
            out.write(line + (f",{int(dropped[i, s])}\n" if dropped is not None else "\n"))
    return out.getvalue()


EXPORTS = {
    "libcachesim": "libCacheSim's oracleGeneral binary trace (one request per unique (layer, expert) per load)",
    "bigmoe": "BigMoeOnEdge's route_trace v1 CSV (what 'import bigmoe' reads)",
}


def export(kind: str, trace_dir: str | Path, out: str | Path) -> Path:
    """Write ``trace_dir`` as ``kind`` to the file ``out`` (atomically: the old file or the new one)."""
    if kind not in EXPORTS:
        raise UserError(f"unknown export format {kind!r}; known: {', '.join(EXPORTS)}.")
    trace_dir, out = Path(trace_dir), Path(out)
    check_output_file(out, inputs=[trace_dir])  # before any work: an input, a device, a FIFO are refused
    trace = open_trace(trace_dir)
    if trace.n_rows == 0:  # an empty file with exit 0 would pass for an export of a trace
        why = " (trace.json says the capture did not complete)" if not trace.complete else ""
        raise UserError(f"{trace.path}: holds no routings{why}, so there is nothing to export.")
    data = oracle_general_records(trace).tobytes() if kind == "libcachesim" else bigmoe_csv(trace).encode("utf-8")
    return write_output_bytes(out, data, inputs=[trace_dir])
