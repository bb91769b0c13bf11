"""synth's threads and in-memory checks (traces.synth.generator): the next chunk generated in a background
thread while the last is written, a chunk routed on two threads, the top-k kernel's threshold
filter under ties, the routings checked before they are written, and a fork after synth."""

from __future__ import annotations

import multiprocessing as mp
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traces.format.errors import UserError
from traces.synth.generator import SynthConfig, _ahead, _LowRankModel, _Model, write_synthetic
from traces.synth.kernels import softmax_route


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_softmax_route_ties_and_threshold(data):
    """Integer logits (many ties): the kernel's top-k equals a stable sort by (-logit, id)."""
    L, E = data.draw(st.integers(1, 3)), data.draw(st.integers(2, 40))
    k, R = data.draw(st.integers(1, E)), data.draw(st.integers(1, 3))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    n = 5
    W0 = rng.integers(-3, 4, size=(L, E)).astype(np.float64)
    MT = rng.integers(-2, 3, size=(L, R, E)).astype(np.float64)
    sn = rng.integers(-2, 3, size=(n, L, R)).astype(np.float64)
    ids, w = np.empty((n, L, k), np.int32), np.empty((n, L, k), np.float32)
    softmax_route(sn, MT, W0, k, 1.0, ids, w)
    for t in range(n):
        for l in range(L):
            x = W0[l] + sn[t, l] @ MT[l]  # small integers: exact in any order
            want = sorted(range(E), key=lambda e: (-x[e], e))[:k]
            assert ids[t, l].tolist() == want


def test_two_threads_route_the_same_bits():
    cfg = SynthConfig(layers=4, experts=32, top_k=4, embd=16, rank=5, seed=3, routing_only=True)
    one, two = _LowRankModel(cfg), _LowRankModel(cfg)
    with ThreadPoolExecutor(max_workers=2) as pool:
        for n in (200, 65, 64, 1):
            a, b = one.routes(n), two.routes_later(n, pool)()
            assert a["experts"].tobytes() == b["experts"].tobytes() and a["weights"].tobytes() == b["weights"].tobytes()


def test_ahead_keeps_order_and_raises_the_producers_error():
    assert list(_ahead(iter(range(50)), depth=2)) == list(range(50))

    def bad():
        yield 1
        raise ValueError("boom")

    it = _ahead(bad())
    assert next(it) == 1
    with pytest.raises(ValueError, match="boom"):
        next(it)


def test_ahead_consumer_stopping_early_stops_the_producer():
    made = []

    def items():
        for i in range(10_000):
            made.append(i)
            yield i

    before = threading.active_count()
    it = _ahead(items(), depth=2)
    assert next(it) == 0
    it.close()
    assert threading.active_count() == before and len(made) < 10


@pytest.mark.parametrize("rank", [None, 4])
@pytest.mark.parametrize("bad", ["duplicate", "range", "order"])
def test_bad_routings_refused_before_writing(tmp_path, monkeypatch, rank, bad):
    """The rows are checked in memory (not read back): a generator bug is refused, nothing written."""
    cls = _LowRankModel if rank else _Model
    real = cls.routes

    def broken(self, n):
        out = real(self, n)
        if n > 1:
            ex, w = out["experts"], out["weights"]
            if bad == "duplicate":
                ex[-1, 0, 1] = ex[-1, 0, 0]
            elif bad == "range":
                ex[-1, 0, 0] = self.cfg.experts
            else:
                w[-1, 0, 1] = w[-1, 0, 0] + 1.0
        return out

    def broken_later(self, n, pool):
        out = broken(self, n)
        return lambda: out

    monkeypatch.setattr(cls, "routes", broken)
    monkeypatch.setattr(cls, "routes_later", broken_later)
    out = tmp_path / "t"
    with pytest.raises(UserError, match="would be invalid"):
        write_synthetic(out, SynthConfig(layers=2, experts=8, top_k=2, embd=8, tokens=40, prompt_tokens=0, rank=rank, routing_only=True))
    assert not out.exists()


def _child(q):
    cfg = SynthConfig(layers=2, experts=8, top_k=2, embd=8, tokens=100, prompt_tokens=0, rank=3, routing_only=True)
    q.put(_LowRankModel(cfg).routes(100)["experts"].sum().item())


def test_fork_after_synth_does_not_hang(tmp_path):
    """No OpenMP threading layer: a child forked after synth ran its kernels runs them again."""
    cfg = SynthConfig(layers=2, experts=8, top_k=2, embd=8, tokens=300, prompt_tokens=0, rank=3, routing_only=True)
    write_synthetic(tmp_path / "t", cfg)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert isinstance(q.get(timeout=5), int)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_first_bad_routing_equals_naive_twin(data):
    """The one-pass check synth runs before writing agrees with its plain-Python twin on rows with
    injected faults (ids out of range or repeated, weights negative, NaN, infinite or increasing)."""
    from tests.naive.synth import naive_first_bad_routing
    from traces.synth.kernels import first_bad_routing

    E = data.draw(st.integers(2, 20))
    k = data.draw(st.integers(1, E))
    n = data.draw(st.integers(0, 12))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    ids = np.array([rng.permutation(E)[:k] for _ in range(n)], dtype=np.int32).reshape(n, k)
    w = -np.sort(-rng.random((n, k))).astype(np.float32)
    for _ in range(data.draw(st.integers(0, 3))):
        if n == 0:
            break
        r, i = data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, k - 1))
        fault = data.draw(st.sampled_from(["range", "neg", "dup", "nan", "inf", "up", "negid"]))
        if fault == "range":
            ids[r, i] = E
        elif fault == "negid":
            ids[r, i] = -1
        elif fault == "dup" and k > 1:
            ids[r, i] = ids[r, (i + 1) % k]
        elif fault == "neg":
            w[r, i] = -0.5
        elif fault == "nan":
            w[r, i] = np.nan
        elif fault == "inf":
            w[r, i] = np.inf
        elif fault == "up" and k > 1:
            w[r, i] = w[r, 0] + 1.0 if i else w[r, 0]
    for by_rank in (True, False):
        assert tuple(first_bad_routing(ids, w, E, by_rank)) == naive_first_bad_routing(ids, w, E, by_rank)


def test_writer_error_midway_stops_every_thread(tmp_path, monkeypatch):
    """An error while writing (here the third append) stops the generating threads and leaves
    nothing behind: no destination, no thread still running."""
    import traces.synth.generator as synth_mod
    from traces.io.writer import TraceWriter

    calls = []

    class Failing(TraceWriter):
        def append(self, **kw):
            calls.append(1)
            if len(calls) == 3:
                raise OSError("disk full")
            super().append(**kw)

    monkeypatch.setattr(synth_mod, "TraceWriter", Failing)
    before = threading.active_count()
    cfg = SynthConfig(layers=3, experts=16, top_k=4, embd=8, tokens=5000, prompt_tokens=0, rank=4, routing_only=True, chunk_tokens=64)
    with pytest.raises(OSError, match="disk full"):
        write_synthetic(tmp_path / "t", cfg)
    assert not (tmp_path / "t").exists()
    assert threading.active_count() == before


def test_generation_runs_a_part_ahead_of_a_stalled_writer(tmp_path, monkeypatch):
    """While the writer is busy (here: stalled in the progress callback after the first chunk), the
    generator keeps making chunks up to one part's worth, not two: a part's Parquet encoding on one
    core no longer leaves the other idle (2 chunks ahead left the cores ~80% busy at 100k x 48 x 128)."""
    made = []
    real = _LowRankModel.routes_later

    def counted(self, n, pool):
        made.append(n)
        return real(self, n, pool)

    monkeypatch.setattr(_LowRankModel, "routes_later", counted)
    ahead = threading.Event()
    seen = []

    def on_tokens(n):
        if not seen:
            ahead.wait(timeout=5)  # the generator must reach 12 chunks while this one is not consumed
        seen.append(len(made))
        if len(made) >= 12:
            ahead.set()

    def watch():
        while not ahead.is_set() and len(made) < 12:
            threading.Event().wait(0.01)
        ahead.set()

    threading.Thread(target=watch, daemon=True).start()
    cfg = SynthConfig(layers=4, experts=16, top_k=2, embd=16, rank=4, tokens=16 * 40, prompt_tokens=0, chunk_tokens=16,
                      routing_only=True)
    write_synthetic(tmp_path / "t", cfg, on_tokens=on_tokens)
    assert seen[0] >= 12, f"only {seen[0]} chunks generated while the first was held"


def test_synth_command_never_imports_polars(tmp_path):
    """synth writes and checks a trace without data frames: polars (about 0.1 s of its start-up) is
    imported only where the reader returns a frame."""
    import subprocess
    import sys

    code = ("import sys; from replay.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('polars' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, "synth", str(tmp_path / "t"), "--layers", "2", "--experts", "8", "--top-k", "2",
                          "--tokens", "8", "--prompt-tokens", "4", "--routing-only", "--rank", "4"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout + out.stderr
