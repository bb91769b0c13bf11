"""The naive twin of replay.analyses.timeline: an event-by-event simulator in plain Python, written
from that module's docstring. Every read is a record (issued, started, arrived, on which lane); every
lane keeps the list of its reads; every layer boundary is an event with its time. Slow and obvious.

Inputs: ``loads``, in replay order, each a dict ``batch``, ``phase`` (0 prefill, 1 decode),
``pos`` (MoE layer position), ``rows``: per routing row a list of (entry, residency code) and a
list of (predicted entry, fill code); ``layer_bytes`` per position; ``par`` the five kernel
parameters (latency ms, ms per byte, compute ms per layer, token overhead ms, serial ms per byte,
compute before the router, expert compute),
taken as numbers so that both sides do the same arithmetic.
"""

from __future__ import annotations

import math

FILL_READ = 2


class Lane:
    def __init__(self) -> None:
        self.reads: list[dict] = []

    @property
    def free_at(self) -> float:
        return self.reads[-1]["arrive"] if self.reads else 0.0


def naive_timeline(loads, layer_bytes, par, issue_ahead, n_lanes, overlap):
    lat, per_byte, comp, overhead, serial_per_byte, pre, post = par
    lanes = [Lane() for _ in range(n_lanes)]
    floor = [0.0] * n_lanes  # with overlap off, a lane may not start a read before this (compute ran)
    events = []  # (time, what): layer starts, layer ends, token ends; for reading, not needed to compute
    fills = []  # every speculative read, in issue order: dict(entry, bytes, arrive, status, lead)
    pending = {}  # entry -> index in fills of the guess read for it and not yet demanded
    tokens = []

    def issue(at, nbytes, kind, entry):
        # the lane that frees first; the lowest lane on a tie
        best = None
        for i, ln in enumerate(lanes):
            f = max(ln.free_at, floor[i])
            if best is None or f < best[0]:
                best = (f, i)
        f, i = best
        start = f if f > at else at
        d = lat + nbytes * per_byte
        read = {"issue": at, "start": start, "arrive": start + d, "dur": d, "kind": kind, "entry": entry}
        lanes[i].reads.append(read)
        return read

    by_batch = []
    for ld in loads:
        if by_batch and by_batch[-1][0]["batch"] == ld["batch"]:
            by_batch[-1].append(ld)
        else:
            by_batch.append([ld])
    now = 0.0
    for batch in by_batch:
        timed = batch[0]["phase"] == 1
        tok = {"start": now, "io": 0.0, "dem": 0, "spec": 0, "stall": 0.0, "compute": 0.0}

        def spec_reads(ld, at, timed=timed, tok=tok):
            nb = layer_bytes[ld["pos"]]
            for _slots, preds in ld["rows"]:
                for e, code in preds:
                    if code == FILL_READ:
                        arrive = 0.0  # a guess read in prefill: no lane time, arrived when the decode timeline starts
                        if timed:
                            rd = issue(at, nb, "spec", e)
                            tok["io"] += rd["dur"]
                            tok["spec"] += nb
                            arrive = rd["arrive"]
                        pending[e] = len(fills)
                        fills.append({"entry": e, "bytes": nb, "arrive": arrive, "status": "wasted", "lead": math.nan})

        if issue_ahead == 0:
            for ld in batch:
                spec_reads(ld, tok["start"])
        for idx, ld in enumerate(batch):
            start = now
            events.append((start, "layer start"))
            s2 = a = start
            if timed:
                if not overlap:  # serial: wait for every lane to be idle
                    s2 = max([start] + [max(ln.free_at, floor[i]) for i, ln in enumerate(lanes)])
                a = s2 + pre  # the router has run
                events.append((a, "router"))
                if not overlap:
                    floor[:] = [max(fl, a) for fl in floor]
            waits = [a]
            done = set()
            for slots, _preds in ld["rows"]:
                for e, code in slots:
                    if code == 3 or e in done:
                        continue
                    done.add(e)
                    f = pending.pop(e, None)
                    if code == 2 and f is not None:
                        if not timed:
                            fills[f]["status"] = "untimed"
                            continue
                        fills[f]["lead"] = a - fills[f]["arrive"]
                        if fills[f]["arrive"] > a:
                            fills[f]["status"] = "late"
                            waits.append(fills[f]["arrive"])
                        else:
                            fills[f]["status"] = "useful"
                        continue
                    if code == 0 and timed:
                        rd = issue(a, layer_bytes[ld["pos"]], "demand", e)
                        tok["io"] += rd["dur"]
                        tok["dem"] += layer_bytes[ld["pos"]]
                        waits.append(rd["arrive"])
            if issue_ahead > 0 and idx + issue_ahead < len(batch) and \
                    batch[idx + issue_ahead]["pos"] == ld["pos"] + issue_ahead:
                spec_reads(batch[idx + issue_ahead], a)
            if not timed:
                continue
            if overlap:
                x0 = a + post
                end = max(x0, max(waits))
                tok["stall"] += end - x0
            else:
                ready = max([max(waits)] + [max(ln.free_at, floor[i]) for i, ln in enumerate(lanes)])
                tok["stall"] += (s2 - start) + (ready - a)
                end = ready + post
                floor[:] = [max(fl, end) for fl in floor]
            now = end
            tok["compute"] += comp
            events.append((now, "layer end"))
        if timed:
            now = now + (overhead + (tok["dem"] + tok["spec"]) * serial_per_byte)
            if not overlap:
                floor[:] = [max(fl, now) for fl in floor]
            events.append((now, "token end"))
            tokens.append([now - tok["start"], tok["stall"], tok["compute"], tok["io"], float(tok["dem"]), float(tok["spec"]),
                           tok["start"]])
    read_total = sum(t[3] for t in tokens)
    return {"tok": tokens, "fills": fills, "read_ms_total": read_total, "events": events}
