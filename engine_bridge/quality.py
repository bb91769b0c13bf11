"""``moe-replay quality``: drop-cold's price in output quality, measured by running the model with
the drop applied inside the forward pass, next to what the offline closed-loop replay predicted.

Per setting (drop-cold F, or the static top-k cut ``keep-k K``) the text is run teacher-forced,
**one token per forward** (each token is its own batch, so one load = one (token, MoE layer)
routing, exactly the decode-style loads the offline closed-loop replay of the run's trace replays).
At every MoE layer a simulated expert cache (:class:`KernelStep`: the replay's own kernel for the
policy, stepped one load at a time, its state carried from token to token; :class:`LruStep` is its
plain-Python LRU twin) is visited in rank order: a slot is
dropped iff its entry is not resident, its router weight is below F / k and it is not the routing's
top-weighted slot (the top-k cut drops every slot at rank >= K, resident or not). A dropped slot is
neither looked up, nor read, nor admitted; its weight is set to zero without renormalising the
others (``renormalize``: the survivors are rescaled to the sum the router gave the whole set).

Each run writes its trace (the router's routing, with a ``dropped`` column marking what the run
dropped) under OUT; the offline closed-loop replay of that trace (:func:`replay.analyses.drop_cold.closed_drop`'s
flags through :func:`replay.core.simulate.replay`) drops exactly the same slots (tests/test_quality.py).

Figures per setting: perplexity over the text and its change from the undropped (plain) run; KL
(undropped || run) of the next-token distribution (nats; mean and p95 over positions), top-1
agreement; routings dropped, reads avoided, weight mass discarded as they happened in the run,
and beside them (``*_replay``) the closed-loop replay's prediction from the undropped run's trace.
Quality figures of a random-weight model say nothing about a real model's quality.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from traces.format.errors import UserError
from traces.util.units import exact


@dataclass(frozen=True)
class Setting:
    """One run: drop-cold at ``frac`` or the top-k cut at ``keep_k``."""

    frac: float | None = None
    keep_k: int | None = None

    @property
    def label(self) -> str:
        return f"drop F={self.frac:g}" if self.frac is not None else f"keep-k {self.keep_k}"

    @property
    def dirname(self) -> str:
        return f"drop-F{self.frac:g}" if self.frac is not None else f"keep-k{self.keep_k}"


_NO_FILLS = np.zeros((0, 1), np.int8)  # the driver's fill record (replay.analyses.timeline), not kept here


class LruStep:
    """Plain-Python twin of :class:`KernelStep` for ``lru`` (tests hold both to the kernel): the replay's
    global LRU (replay/policies/lru.py with the driver's rules), stepped one load at a time: entries
    are (MoE layer index, expert); a load visits its slots token-major in rank order; a repeat
    inside the load is only promoted; misses are admitted, then, once after the load, least-recent
    entries not touched by the load are evicted until the bytes fit (an overflow if none is left). A
    slot flagged 1 is skipped iff its entry is not resident at that moment, 2 always; a skipped slot
    leaves no trace in the cache."""

    def __init__(self, entry_bytes: np.ndarray, n_expert: int, budget: int) -> None:
        self.entry_bytes, self.n_expert, self.budget = entry_bytes, n_expert, budget
        self.order: OrderedDict[int, int] = OrderedDict()  # resident entry -> last load touching it; head = least recent
        self.used = 0
        self.load = -1
        self.lookups = self.hits = self.read_bytes = self.skipped = self.overflow_loads = 0

    def step(self, lidx: int, ids: np.ndarray, flags: np.ndarray) -> np.ndarray:
        """One load of layer index ``lidx``: ``ids`` [T, k] in rank order, ``flags`` [T, k] uint8;
        returns the bool [T, k] of skipped slots."""
        self.load += 1
        load, order = self.load, self.order
        nbytes = int(self.entry_bytes[lidx])
        skipped = np.zeros(ids.shape, dtype=bool)
        n_miss = 0
        base = lidx * self.n_expert
        for r, (row, frow) in enumerate(zip(ids.tolist(), flags.tolist())):  # lists: no numpy scalar per slot
            for j, (x, f) in enumerate(zip(row, frow)):
                e = base + x
                if f and (f == 2 or e not in order):
                    skipped[r, j] = True
                    continue
                last = order.get(e)
                if last == load:  # a repeat inside this load: promoted only
                    order.move_to_end(e)
                    continue
                self.lookups += 1
                if last is not None:
                    self.hits += 1
                else:
                    n_miss += 1
                order[e] = load
                order.move_to_end(e)
        self.skipped += int(skipped.sum())
        self.read_bytes += n_miss * nbytes
        used = self.used + n_miss * nbytes
        while used > self.budget:
            victim = next((e for e, last in order.items() if last != load), None)
            if victim is None:
                self.overflow_loads += 1
                break
            del order[victim]
            used -= int(self.entry_bytes[victim // self.n_expert])
        self.used = used
        return skipped


class KernelStep:
    """Any policy the replay can step: the replay kernel itself (:func:`replay.core.simulate.kernel_for`'s
    what-if driver for ``policy``, drop flags on), called once per load with its state (``ent``,
    ``grp``, the policy's ``ps``) and its clocks (tick, load number, current batch; as
    :func:`replay.core.streaming.replay_stream` carries them from part to part) carried from call to
    call. One token per forward: a load whose layer index is not above the previous load's starts a
    new batch (the next token). Same interface and counters as :class:`LruStep`; the calls together
    equal one replay of all the loads (tests/test_quality_step.py, every steppable policy)."""

    def __init__(self, policy: str, entry_bytes: np.ndarray, n_expert: int, budget: int, seed: int = 0) -> None:
        from replay.core.driver import N_ACC, N_STATS, no_options
        from replay.core.simulate import Loads, _groups, kernel_for
        from replay.core.state import new_state
        from replay.policies import policy_module

        check_steppable(policy)
        pm = policy_module(policy)
        L = int(entry_bytes.shape[0])
        z32, z8 = np.zeros(0, np.int32), np.zeros(0, np.int8)
        shell = Loads(entries=np.zeros((0, 1), np.int32), load_start=np.zeros(1, np.int64), load_lidx=np.zeros(0, np.int16),
                      batch_start=np.zeros(1, np.int64), moe_layers=tuple(range(L)), n_expert=n_expert,
                      layer_expert_bytes=np.asarray(entry_bytes, np.int64), batch_turn=z32, batch_step=z32, batch_phase=z8)
        group, gbud = _groups(shell, pm, int(budget))
        self.ent, self.grp = new_state(shell.entry_bytes, group, gbud)
        self.ps = pm.init(self.ent, self.grp, int(seed))
        self.kern = kernel_for(policy, whatif=True)
        self.layer_info = np.stack([group[::n_expert], shell.layer_expert_bytes]).T.astype(np.int64).copy()
        self.n_expert, self.budget = n_expert, budget
        self.acc = np.zeros((2, L, N_ACC), np.int64)
        self.stats = np.zeros(N_STATS, np.int64)
        self.opts = no_options()
        self.bacc = np.zeros((1, N_ACC), np.int64)
        # one load, one batch (batch loads 0:1), phase 0, per kernel call
        self.lidx_a, self.bstart_a, self.phase_a = np.zeros(1, np.int16), np.array([0, 1], np.int64), np.zeros(1, np.int8)
        self.next_load, self.pred = np.zeros((0, 1), np.int32), np.zeros((0, 1), np.int32)
        self.starts: dict[int, np.ndarray] = {}
        self.load = -1
        self.tick = 0
        self.last_lidx = L  # the first load starts a batch
        self.overflow_loads = self.evictions = 0

    def step(self, lidx: int, ids: np.ndarray, flags: np.ndarray) -> np.ndarray:
        """One load of layer index ``lidx``: ``ids`` [T, k] in rank order, ``flags`` [T, k] uint8
        (1 skip if not resident, 2 always); returns the bool [T, k] of skipped slots."""
        from replay.core.driver import OPT_BATCH0, OPT_LOAD0, OPT_TICK0, STAT_EVICTIONS, STAT_OVERFLOW, STAT_TICKS

        self.load += 1
        T, k = ids.shape
        entries = np.asarray(ids, np.int32) + np.int32(lidx * self.n_expert)
        slots = np.empty((T, k), np.uint8)  # the kernel writes every slot's code
        start = self.starts.get(T)
        if start is None:
            start = self.starts[T] = np.array([0, T], np.int64)
        self.lidx_a[0] = lidx
        o, st = self.opts, self.stats
        o[OPT_TICK0], o[OPT_LOAD0] = self.tick, self.load
        o[OPT_BATCH0] = 0 if lidx > self.last_lidx else -1  # same token: the batch continues
        self.last_lidx = lidx
        st[:] = 0
        self.kern(entries, start, self.lidx_a, self.bstart_a, self.phase_a, self.layer_info,
                  self.next_load, self.ent, self.grp, self.ps, self.acc, self.bacc, st, slots,
                  np.ascontiguousarray(flags, np.uint8), self.pred, o, _NO_FILLS)
        self.tick = int(st[STAT_TICKS])
        self.overflow_loads += int(st[STAT_OVERFLOW])
        self.evictions += int(st[STAT_EVICTIONS])
        return slots == 3

    @property
    def lookups(self) -> int:
        from replay.core.driver import ACC_LOOKUPS

        return int(self.acc[:, :, ACC_LOOKUPS].sum())

    @property
    def hits(self) -> int:
        from replay.core.driver import ACC_HITS

        return int(self.acc[:, :, ACC_HITS].sum())

    @property
    def read_bytes(self) -> int:
        from replay.core.driver import ACC_READ

        return int(self.acc[:, :, ACC_READ].sum())

    @property
    def skipped(self) -> int:
        from replay.core.driver import ACC_SKIPPED

        return int(self.acc[:, :, ACC_SKIPPED].sum())


def check_steppable(policy: str) -> None:
    """Refuse, in one sentence naming it, a policy the forward pass cannot step load by load."""
    from replay.policies import policy_module

    pm = policy_module(policy)
    if pm.NEEDS_NEXT_USE:
        raise UserError(f"--policy {policy}: quality cannot simulate it inside the forward pass, because it evicts by each "
                        "entry's next use, which lies in tokens not yet computed (it is an offline bound).")
    plans = [h for h in ("setup", "group_budgets", "prepare_options") if hasattr(pm, h)]
    if plans:
        raise UserError(f"--policy {policy}: quality cannot simulate it inside the forward pass, because it plans from the "
                        f"whole trace before its replay ({', '.join(plans)}), which a run has not produced yet.")


def new_cache(policy: str, entry_bytes: np.ndarray, n_expert: int, budget: int) -> KernelStep:
    """The stepped cache a run uses for ``policy``: the replay's kernel stepped (for lru too: it is
    exact by construction and faster than :class:`LruStep`, about 9 against 15 us per load)."""
    return KernelStep(policy, entry_bytes, n_expert, budget)


def parse_fracs(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--drop-frac {text!r}: give comma-separated fractions, e.g. 0,0.5,0.75,1.0.") from None
    from replay.analyses.drop_cold import check_drop_frac

    return [check_drop_frac(f, "--drop-frac") for f in vals]  # the one check of F


class DropCold:
    """One setting's decision at one load: ``decide(lidx, ids, weights)`` with ids and weights
    [T, k] in rank order returns the skipped slots, stepping the simulated cache."""

    def __init__(self, setting: Setting, cache: LruStep | KernelStep) -> None:
        self.setting, self.cache = setting, cache

    def decide(self, lidx: int, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        T, k = ids.shape
        if self.setting.frac is not None:
            w64 = weights.astype(np.float64)  # the replay compares float64 weights with F / k
            flags = (w64 < self.setting.frac / k).view(np.uint8)  # 1: drop if a miss
            flags[np.arange(T), np.argmax(w64, axis=1)] = 0  # never the routing's top-weighted slot
        else:
            flags = np.zeros((T, k), np.uint8)
            flags[:, self.setting.keep_k:] = 2
        return self.cache.step(lidx, ids, flags)


class _DropCold:
    """The routing override of one setting on transformers (engine_bridge.hf.Override): the slots
    are put in rank order (as the trace writes them), the simulated cache says which are misses,
    the rule drops them; the weights are rewritten inside the forward."""

    def __init__(self, setting: Setting, k: int, layers: list[int], gating: dict[str, Any], sel_bias: dict[int, np.ndarray],
                 logits: dict[int, np.ndarray], cache: LruStep | KernelStep, renormalize: bool) -> None:
        self.gating, self.sel_bias, self.logits = gating, sel_bias, logits
        self.lidx = {layer: i for i, layer in enumerate(layers)}
        self.rule, self.renormalize = DropCold(setting, cache), renormalize
        self.__name__ = setting.label + (", survivors renormalised" if renormalize else ", not renormalised")

    def __call__(self, layer: int, _positions: np.ndarray, ids: Any, weights: Any) -> Any:
        import torch

        from engine_bridge.hf import rank_order

        ids_np = ids.detach().cpu().numpy().astype(np.int32)
        w_np = weights.detach().float().cpu().numpy()
        T, k = ids_np.shape
        slot = np.broadcast_to(np.arange(k, dtype=np.int64), (T, k)).copy()
        ids_r, w_r, (slot_r,) = rank_order(ids_np, w_np, self.logits[layer], self.gating, self.sel_bias[layer], [slot])
        skipped = self.rule.decide(self.lidx[layer], ids_r, w_r)
        if not skipped.any():
            return None
        mask = np.zeros((T, k), dtype=bool)
        np.put_along_axis(mask, slot_r, skipped, axis=1)
        m = torch.from_numpy(mask).to(weights.device)
        new = weights.masked_fill(m, 0.0)
        if self.renormalize:
            new = new * (weights.sum(dim=1, keepdim=True) / new.sum(dim=1, keepdim=True))
        return new


class _DropColdGgml:
    """The same override on llama.cpp (engine_bridge.capture's ``override``): the eval callback
    hands ids already in rank order and the final weights as float32 numpy arrays."""

    def __init__(self, setting: Setting, layers: list[int], cache: LruStep | KernelStep, renormalize: bool) -> None:
        self.lidx = {layer: i for i, layer in enumerate(layers)}
        self.rule, self.renormalize = DropCold(setting, cache), renormalize

    def __call__(self, layer: int, ids: np.ndarray, weights: np.ndarray) -> np.ndarray | None:
        skipped = self.rule.decide(self.lidx[layer], ids, weights)
        if not skipped.any():
            return None
        new = weights.astype(np.float32)  # a copy
        new[skipped] = 0
        if self.renormalize:
            new = (new * (weights.sum(axis=1, keepdims=True) / new.sum(axis=1, keepdims=True))).astype(np.float32)
        return new


def _router_logit_hooks(blocks: list[Any], store: dict[int, np.ndarray]) -> list[Any]:
    def make(layer: int):
        def hook(_mod: Any, _args: tuple, output: Any) -> None:
            lg = output[0] if isinstance(output, tuple) else output
            store[layer] = lg.detach().float().reshape(-1, lg.shape[-1]).cpu().numpy()
        return hook
    return [b.router.register_forward_hook(make(b.layer)) for b in blocks]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def output_figures(base_logits: np.ndarray, logits: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """ppl over the positions that predict a token of the text; KL(base || run) in nats and top-1
    agreement over the same positions."""
    n = targets.shape[0]
    lp0, lp = _log_softmax(base_logits[:n]), _log_softmax(logits[:n])
    nll = -lp[np.arange(n), targets]
    kl = (np.exp(lp0) * (lp0 - lp)).sum(axis=1)
    kl = np.maximum(kl, 0.0)  # rounding can leave -1e-17 where the distributions are equal
    return {"ppl": float(np.exp(nll.mean())), "kl_mean": float(kl.mean()), "kl_p95": float(np.percentile(kl, 95)),
            "top1_agree_pct": float((base_logits[:n].argmax(axis=1) == logits[:n].argmax(axis=1)).mean() * 100.0)}


def run_figures(trace_dir: Path, read_bytes: int, base_read_bytes: int) -> dict[str, float | None]:
    """Routings dropped, reads avoided, mass discarded as they happened: from the run's trace (its
    ``dropped`` column and the router's weights) and its simulated cache's reads."""
    from traces import open_trace

    a = open_trace(trace_dir).arrays(recorded=True)
    w = a.weights.astype(np.float64)
    d = a.dropped if a.dropped is not None else np.zeros(w.shape, dtype=bool)
    return {
        "routings_dropped_pct": float(d.any(axis=1).mean() * 100.0),
        "experts_dropped_pct": float(d.mean() * 100.0),
        "mass_lost_pct": float(w[d].sum() / w.sum() * 100.0),
        "io_saved_pct": (base_read_bytes - read_bytes) / base_read_bytes * 100.0 if base_read_bytes > 0 else None,
    }


class _HfRunner:
    """Teacher-forced runs of a transformers model through capture_hf (one token per forward)."""

    def __init__(self, model: Any, tokenizer: Any, device: str, dtype: str, expert_dtype: str | None, text: str,
                 text_source: str | None) -> None:
        from engine_bridge import hf

        hf.require_hf_extra("quality")
        if isinstance(model, (str, Path)):
            self.model, self.tok = hf.load_model(str(model), dtype, device)
            self.where = str(model)
        else:
            if tokenizer is None:
                raise UserError("quality: a loaded model needs its tokenizer (tokenizer=...).")
            self.model, self.tok, self.where = model.to(device).eval(), tokenizer, type(model).__name__
        self.device, self.dtype, self.expert_dtype, self.text, self.text_source = device, dtype, expert_dtype, text, text_source
        fam = hf._family_of(self.model.config, self.where)
        self.blocks = hf.find_blocks(self.model, fam, self.where)
        self.gating, self.k = hf.gating_of(self.blocks, fam)
        self.n_expert = int(hf._tensor_at(self.blocks[0].block, self.blocks[0].router, fam.weight).shape[0])
        self.layers = [b.layer for b in self.blocks]
        self.sel_bias = {b.layer: (hf._tensor_at(b.block, b.router, fam.selection_bias).detach().float().cpu().numpy()
                                   .reshape(self.n_expert) if self.gating["selection_bias"]
                                   else np.zeros(self.n_expert, np.float32)) for b in self.blocks}
        expert_bytes = hf.sizes_of(self.model, self.blocks, self.n_expert, expert_dtype, self.where)[0]
        self.leb = np.array([expert_bytes[layer] for layer in self.layers], dtype=np.int64)
        self.targets = np.asarray(self.tok(text)["input_ids"][1:], dtype=np.int64)

    def _capture(self, out: Path, prompt: str, n_new: int, source: str | None, setting: Setting | None,
                 cache: LruStep | KernelStep | None, renormalize: bool) -> Any:
        from engine_bridge import hf

        store: dict[int, np.ndarray] = {}
        handles = _router_logit_hooks(self.blocks, store) if setting is not None else []
        ov = (_DropCold(setting, self.k, self.layers, self.gating, self.sel_bias, store, cache, renormalize)
              if setting is not None and cache is not None else None)
        try:
            res = hf.capture_hf(self.model, prompt, tokenizer=self.tok, n_predict=n_new, out=out, device=self.device,
                                dtype=self.dtype, expert_dtype=self.expert_dtype, override=ov, keep_output_logits=n_new == 0,
                                ubatch=1, gate_input=False, prompt_source=source)
        finally:
            for h in handles:
                h.remove()
        _check_passed(res, self.where, out)
        return res

    def run(self, out: Path, setting: Setting | None, cache: LruStep | KernelStep | None, renormalize: bool) -> np.ndarray:
        return self._capture(out, self.text, 0, self.text_source, setting, cache, renormalize).output_logits[0]

    def generate(self, out: Path, prompt: str, n_new: int, setting: Setting | None, cache: LruStep | KernelStep | None,
                 renormalize: bool) -> tuple[list[int], str]:
        """Greedy generation of up to ``n_new`` tokens after ``prompt`` (one token per forward, the
        prompt too): the generated token ids and their text."""
        res = self._capture(out, prompt, n_new, None, setting, cache, renormalize)
        gen = [int(t) for t in res.generated[0]]
        return gen, self.tok.decode(gen)


class _LlamaRunner:
    """Teacher-forced runs of a GGUF through llama.cpp's capture (ubatch 1: one token per decode);
    the override writes the final MoE weights node from the eval callback (CPU buffers)."""

    def __init__(self, model: str, text: str, text_source: str | None) -> None:
        from engine_bridge.capture import CaptureOptions, _plan
        from engine_bridge.engine import require_capture_extra
        from engine_bridge.gguf_static import read_static

        require_capture_extra("quality")
        if not Path(model).is_file():
            raise UserError(f"{model}: no such GGUF file (quality --engine llama.cpp takes a GGUF model file).")
        self.model, self.text, self.text_source, self.where = model, text, text_source, model
        self.plan = _plan(CaptureOptions(model=model, prompt=text, out="", n_decode=0, ubatch=1), read_static(model))
        st = self.plan.static
        self.layers = list(st.moe_layers)
        self.n_expert = int(st.n_expert)
        self.k = int(st.top_k_native)
        self.leb = np.array([st.expert_bytes[layer] for layer in self.layers], dtype=np.int64)
        self.targets = np.asarray(self.plan.tokens[1:], dtype=np.int64)

    def run(self, out: Path, setting: Setting | None, cache: LruStep | KernelStep | None, renormalize: bool) -> np.ndarray:
        logits: list[np.ndarray] = []
        self._capture(out, self.text, 0, self.text_source, setting, cache, renormalize, logits)
        return np.stack(logits)

    def _capture(self, out: Path, prompt: str, n_new: int, source: str | None, setting: Setting | None,
                 cache: LruStep | KernelStep | None, renormalize: bool, logits: list[np.ndarray] | None = None) -> Any:
        from engine_bridge.capture import CaptureOptions, capture, validate

        # Router logits only in the undropped run: its self-check (the trace's experts are the top-k of
        # the logits the engine computed) vouches for how this model's routing is read, which the
        # dropped runs read the same way; observing them costs a graph split per MoE layer per token.
        opts = CaptureOptions(model=self.model, prompt=prompt, out=str(out), n_decode=n_new, ubatch=1, gate_input=False,
                              logits=setting is None, prompt_source=source, kv_type="f32", flash_attn="off")
        ov = _DropColdGgml(setting, self.layers, cache, renormalize) if setting is not None and cache is not None else None
        res = capture(opts, validate(opts, self.plan.static), override=ov, output_logits=logits)
        _check_passed(res, self.where, out)
        return res

    def generate(self, out: Path, prompt: str, n_new: int, setting: Setting | None, cache: LruStep | KernelStep | None,
                 renormalize: bool) -> tuple[list[int], str]:
        """Greedy generation (llama.cpp's decode loop, temperature 0): the generated token ids (the
        trace's decode rows) and their text."""
        from traces import open_trace

        res = self._capture(out, prompt, n_new, None, setting, cache, renormalize)
        a = open_trace(out).arrays(recorded=True)
        first = (a.phase == 1) & (a.layer == self.layers[0])  # one row per decoded token at the first MoE layer
        return [int(t) for t in a.token[first]], str(res.meta["capture_summary"]["generated_text"])


def _check_passed(res: Any, where: str, out: Path) -> None:
    """A run the capture stopped early (it catches SIGINT / SIGTERM to keep a valid trace) is re-raised
    as that signal, so nothing is written; a failed self-check is an error."""
    if not res.complete:
        import signal

        signal.raise_signal(signal.SIGTERM if "SIGTERM" in res.stop_reason else signal.SIGINT)
        raise KeyboardInterrupt  # a handler that returned: stop anyway
    checks = res.checks
    if not checks["passed"]:
        raise UserError(f"{where}: a capture self-check failed in the {out.name} run: its trace does not reproduce the "
                        "model's routing, so the run's drops cannot be compared (a bug in the capture, please report it).")


def quality(model: str | Path | Any, text: str, *, fracs: list[float], out: str | Path, budget_mib: float,
            policy: str = "lru", keep_ks: list[int] | None = None, renormalize: bool = False, tokenizer: Any = None,
            device: str = "cpu", dtype: str = "float32", expert_dtype: str | None = None, force: bool = False,
            text_source: str | None = None, engine: str = "transformers", prompt: str | None = None,
            max_new_tokens: int = 32) -> dict[str, Any]:
    """Run the settings (each F of ``fracs``, each K of ``keep_ks``) and the undropped run over
    ``text``; write OUT/quality.json, OUT/plain/ and one trace per setting; return the JSON object.

    With ``prompt``: also, once per setting and once undropped, generate up to ``max_new_tokens``
    tokens greedily after it with the drop applied (one token per forward, a fresh simulated cache
    per run, carried from the prompt into the generation); OUT/gen-plain/ and OUT/gen-<setting>/
    hold their traces, quality.json's ``generation`` the texts, the first generated token where each
    setting's output leaves the undropped one (``diverges_at``, null if identical) and the run's
    figures beside the closed-loop replay's of the undropped generation's trace."""
    from replay.core.simulate import budget_bytes, check_policies
    from replay.present.format import json_object
    from traces.io.atomic import staged_dir

    check_policies([policy], option="--policy")
    check_steppable(policy)
    from replay.analyses.drop_cold import check_drop_frac

    for f in fracs:
        check_drop_frac(f, "--drop-frac")  # the one check of F, as 'drop --fracs'
    if not fracs and not keep_ks:
        raise UserError("--drop-frac and --keep-k give no setting to run.")
    if len(set(fracs)) != len(fracs) or len(set(keep_ks or [])) != len(keep_ks or []):
        raise UserError("--drop-frac / --keep-k: a setting is given twice.")
    budget = budget_bytes(budget_mib)
    if not text or not text.strip():
        raise UserError(f"{text_source or '--text'}: the text is empty.")
    if prompt is not None and not prompt.strip():
        raise UserError("--prompt: the prompt is empty.")
    if prompt is not None and max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {max_new_tokens}: generate at least 1 token.")
    if engine == "transformers":
        runner: Any = _HfRunner(model, tokenizer, device, dtype, expert_dtype, text, text_source)
    elif engine == "llama.cpp":
        if not isinstance(model, (str, Path)):
            raise UserError("quality --engine llama.cpp takes a GGUF file path.")
        runner = _LlamaRunner(str(model), text, text_source)
    else:
        raise UserError(f"--engine {engine!r} is not transformers or llama.cpp.")
    k, targets, leb, n_expert = runner.k, runner.targets, runner.leb, runner.n_expert
    for kk in keep_ks or []:
        if not 1 <= kk < k:
            raise UserError(f"--keep-k {kk} must lie in 1..{k - 1} (the model routes top-{k}).")
    if targets.size == 0:
        raise UserError(f"{text_source or '--text'}: the text tokenizes to fewer than 2 tokens; nothing to predict.")
    settings = [Setting(frac=float(f)) for f in fracs] + [Setting(keep_k=int(kk)) for kk in keep_ks or []]

    with staged_dir(out, force=force, inputs=[str(model) if isinstance(model, (str, Path)) else None, text_source]) as stage:
        base_logits = runner.run(stage / "plain", None, None, renormalize)
        base_read, pred_rows = _predicted(stage / "plain", settings, policy, budget_mib)
        base_fig = output_figures(base_logits, base_logits, targets)
        rows = []
        for s in settings:
            cache = new_cache(policy, leb, n_expert, budget)
            logits = runner.run(stage / s.dirname, s, cache, renormalize)
            fig = output_figures(base_logits, logits, targets)
            row: dict[str, Any] = {"setting": s.label, "frac": s.frac, "keep_k": s.keep_k, "ppl": fig["ppl"],
                                   "ppl_delta_pct": (fig["ppl"] - base_fig["ppl"]) / base_fig["ppl"] * 100.0,
                                   "kl_mean": fig["kl_mean"], "kl_p95": fig["kl_p95"],
                                   "top1_agree_pct": fig["top1_agree_pct"]}
            row.update(_run_and_replay(stage / s.dirname, s, cache, base_read, pred_rows))
            row["trace"] = s.dirname
            rows.append(row)
        gen = None
        if prompt is not None:
            gen = _generation(runner, stage, prompt, max_new_tokens, settings, policy, budget_mib, leb, n_expert, budget,
                              renormalize)
        obj = json.loads(json_object("quality", str(Path(out) / "plain"), rows))
        obj.update(plain={"ppl": base_fig["ppl"], "tokens": int(targets.size + 1)}, budget_mib=float(budget_mib),
                   policy=policy, renormalize=renormalize, engine=engine, load="one token per forward (teacher-forced)")
        if gen is not None:
            obj["generation"] = gen
        (stage / "quality.json").write_text(json.dumps(obj, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    return obj


def _predicted(plain_dir: Path, settings: list[Setting], policy: str, budget_mib: float) -> tuple[int, list[dict[str, Any]]]:
    """The undropped run's reads in the replay at ``policy`` and the closed-loop replay's rows
    (every phase) of its trace for the settings."""
    from replay.analyses.drop_cold import closed_drop
    from replay.core.driver import ACC_READ
    from replay.core.simulate import prepare_loads, replay
    from traces import open_trace

    plain = open_trace(plain_dir)
    loads = prepare_loads(plain.arrays(recorded=False), plain.moe_layers, plain.n_expert, plain.expert_bytes)
    base_read = int(replay(loads, policy, float(budget_mib)).acc[:, :, ACC_READ].sum())
    pred = closed_drop(plain, [s.frac for s in settings if s.frac is not None], budget_mib=float(budget_mib),
                       policy=policy, phase="all", keep_ks=[s.keep_k for s in settings if s.keep_k is not None])
    return base_read, pred.to_dicts()


def _run_and_replay(trace_dir: Path, s: Setting, cache: LruStep | KernelStep, base_read: int,
                    pred_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's figures as they happened (its trace, its cache's reads) and the replay's beside them."""
    row: dict[str, Any] = dict(run_figures(trace_dir, cache.read_bytes, base_read))
    p = next(r for r in pred_rows if (r["mode"] == "closed" and r["frac"] == s.frac)
             or (r["mode"] == "closed-k" and r["keep_k"] == s.keep_k))
    for key in ("routings_dropped_pct", "io_saved_pct", "mass_lost_pct", "experts_dropped_pct"):
        row[f"{key}_replay"] = p[key]
    row.update(read_mib=cache.read_bytes / 2**20, read_mib_plain=base_read / 2**20, overflow_loads=cache.overflow_loads)
    return row


def diverges_at(base: list[int], gen: list[int]) -> int | None:
    """The index of the first generated token where ``gen`` differs from ``base`` (a shorter
    output diverges where it stops); None if they are identical."""
    for i, (a, b) in enumerate(zip(base, gen)):
        if a != b:
            return i
    return None if len(base) == len(gen) else min(len(base), len(gen))


def _generation(runner: Any, stage: Path, prompt: str, n_new: int, settings: list[Setting], policy: str, budget_mib: float,
                leb: np.ndarray, n_expert: int, budget: int, renormalize: bool) -> dict[str, Any]:
    base_toks, base_text = runner.generate(stage / "gen-plain", prompt, n_new, None, None, renormalize)
    base_read, pred_rows = _predicted(stage / "gen-plain", settings, policy, budget_mib)
    rows = []
    for s in settings:
        cache = new_cache(policy, leb, n_expert, budget)
        toks, text = runner.generate(stage / f"gen-{s.dirname}", prompt, n_new, s, cache, renormalize)
        row: dict[str, Any] = {"setting": s.label, "frac": s.frac, "keep_k": s.keep_k, "diverges_at": diverges_at(base_toks, toks),
                               "tokens_generated": len(toks), "text": text, "token_ids": toks}
        row.update(_run_and_replay(stage / f"gen-{s.dirname}", s, cache, base_read, pred_rows))
        row["trace"] = f"gen-{s.dirname}"
        rows.append(row)
    return {"prompt": prompt, "max_new_tokens": n_new, "load": "one token per forward (prompt and generation), greedy",
            "plain": {"text": base_text, "token_ids": base_toks, "tokens_generated": len(base_toks), "trace": "gen-plain"},
            "rows": rows}


def format_table(obj: dict[str, Any]) -> str:
    def f(v: Any, d: int = 1) -> str:
        return "-" if v is None else f"{v:.{d}f}"

    def e(v: Any) -> str:
        return "-" if v is None else ("0" if v == 0 else f"{v:.1e}")

    head = (f"{'setting':<14} {'ppl':>8} {'dppl %':>7} {'KL mean':>8} {'KL p95':>8} {'top1 %':>7} "
            f"{'routings dropped % run/replay':>30} {'reads avoided % run/replay':>27} {'mass lost % run/replay':>23}")
    lines = [f"plain (undropped): ppl {obj['plain']['ppl']:.3f} over {obj['plain']['tokens']} tokens; "
             f"policy {obj['policy']}, budget {exact(obj['budget_mib'])} MiB; KL in nats, KL(undropped || run)", head]
    for r in obj["rows"]:
        lines.append(f"{r['setting']:<14} {f(r['ppl'], 3):>8} {f(r['ppl_delta_pct'], 2):>7} {e(r['kl_mean']):>8} "
                     f"{e(r['kl_p95']):>8} {f(r['top1_agree_pct']):>7} "
                     f"{f(r['routings_dropped_pct']) + ' / ' + f(r['routings_dropped_pct_replay']):>30} "
                     f"{f(r['io_saved_pct']) + ' / ' + f(r['io_saved_pct_replay']):>27} "
                     f"{f(r['mass_lost_pct']) + ' / ' + f(r['mass_lost_pct_replay']):>23}")
    g = obj.get("generation")
    if g is not None:
        lines += ["", f"greedy generation, up to {g['max_new_tokens']} tokens after the prompt; undropped: "
                  f"{g['plain']['tokens_generated']} tokens, {_clip(g['plain']['text'])}",
                  f"{'setting':<14} {'diverges at':>11} {'routings dropped % run/replay':>30} "
                  f"{'reads avoided % run/replay':>27} {'mass lost % run/replay':>23}  text"]
        for r in g["rows"]:
            at = "identical" if r["diverges_at"] is None else f"token {r['diverges_at']}"
            lines.append(f"{r['setting']:<14} {at:>11} "
                         f"{f(r['routings_dropped_pct']) + ' / ' + f(r['routings_dropped_pct_replay']):>30} "
                         f"{f(r['io_saved_pct']) + ' / ' + f(r['io_saved_pct_replay']):>27} "
                         f"{f(r['mass_lost_pct']) + ' / ' + f(r['mass_lost_pct_replay']):>23}  {_clip(r['text'])}")
    return "\n".join(lines)


def _clip(text: str, n: int = 48) -> str:
    """The text as a Python literal, cut to ``n`` characters (the whole text is in quality.json)."""
    return repr(text if len(text) <= n else text[:n] + "...")
