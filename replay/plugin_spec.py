"""The plugin contract: every name a policy or predictor module may or must define, and what it means.

One place, the way datasette's ``hookspecs.py`` states its hooks. The registries
(:mod:`replay.plugins`, :mod:`replay.policies`, :mod:`replay.predictors`) load a module, run their own
validator (which checks the hooks' shapes: Numba-compiled, the right constants' values) and then
:func:`check` against the tables below; a module that breaks the contract is refused in one
sentence naming its file and the name. A name not listed here is the module's own business,
except one that looks like a contract flag (``NEEDS_*``, ``REPORT*``): a misspelt flag would
otherwise be ignored in silence.

Kinds: ``hook`` (a function compiled with ``@njit(inline="always")``, called from the replay
driver), ``function`` (plain Python), ``str``/``bool``/``int``/``tuple``: a module constant of that
type; ``int|bool`` either. ``required``: the module must define it.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

from traces.format.errors import UserError


class Name(NamedTuple):
    kind: str  # hook, function, str, bool, int, tuple, int|bool
    required: bool
    meaning: str


POLICY: dict[str, Name] = {
    "NAME": Name("str", False, "the policy's name on the command line (a built-in's is its registry key); letters, digits, _ . + -"),
    "PARTITION": Name("str", True, '"global": one cache over all layers, or "layer": one eviction group per MoE layer'),
    "UNBOUNDED": Name("bool", True, "True: never evicts (the infinite cache); the budget is ignored"),
    "NEEDS_NEXT_USE": Name("bool", True, "True: the driver computes each visit's next use (Belady-like policies)"),
    "NEEDS_TICK": Name("bool", False, "False: the policy reads no entry's last-visit tick (the driver may skip keeping it)"),
    "NEEDS_FREQ": Name("bool", False, "False: the policy reads no entry's visit count"),
    "NEEDS_LAST_LOAD": Name("bool", False, "False: the policy reads no entry's last load index"),
    "NEEDS_RESIDENT_LIST": Name("bool", False, "True: the driver keeps each group's resident entries in a list (scan victims)"),
    "NEEDS_BATCH": Name("bool", False, "True: the driver writes the current batch into the state before each load"),
    "FREQ_SINCE": Name("str", False, '"admission" (default): counts restart when an entry is admitted; "run": over the whole run'),
    "BOUND": Name("bool", False, "True: an offline bound that sees the whole trace; never picked as the best online policy"),
    "OPTIONS": Name("tuple", False, "the keyword options the policy takes (policy_options={name: {...}}, --<name>-<option>)"),
    "init": Name("function", True, "init(ent, grp, seed) -> ps: the policy's own state array (plain Python)"),
    "state_shape": Name("function", False, "state_shape(ent, grp) -> tuple: the shape init (and setup) must return; a state of "
                        "another shape is refused before the replay (a hook indexing past a short state would crash)"),
    "on_admit": Name("hook", True, "on_admit(ps, ent, grp, g, e): entry e entered group g"),
    "on_touch": Name("hook", True, "on_touch(ps, ent, grp, g, e): a hit on resident entry e"),
    "pick_victim": Name("hook", True, "pick_victim(ps, ent, grp, g, load) -> e: an evictable entry of group g, or -1"),
    "on_evict": Name("hook", True, "on_evict(ps, ent, grp, g, e): entry e left group g"),
    "prepare_options": Name("function", False, "prepare_options(loads, options) -> options: resolved once per replay"),
    "setup": Name("function", False, "setup(ps, ent, grp, loads, budget_bytes, options): fill the state before the replay (preloads)"),
    "group_budgets": Name("function", False, "group_budgets(...): per-group byte budgets for a layer-partitioned policy"),
    "describe": Name("function", False, "describe(loads, budgets_bytes, options) -> str: one line the cache text prints"),
    "solve": Name("function", False, "solve(loads, policy, budget_mib, budget_bytes, options) -> ReplayResult: a bound computed "
                  "instead of replayed (opt-bound); the driver never runs it and no what-if applies"),
}

PREDICTOR: dict[str, Name] = {
    "NAME": Name("str", True, "the name users type (stale-gate); letters, digits, _ . + -"),
    "DESCRIPTION": Name("str", True, "what its figure measures, one line ({d}: the parameter of a parametrised predictor)"),
    "predict": Name("function", False, "predict(trace, arr, in_phase, width) -> int32 [routings, width] best first, -1 = no guess "
                    "(or (ranked, weights)); required unless predict_many is defined"),
    "predict_many": Name("function", False, "predict_many(...): several names computed in one pass (see replay/predictors/gate.py)"),
    "PARAM": Name("str", False, 'the name takes [int] (stale-gate[2]) and predict gets param=; the string names it ("d")'),
    "unavailable": Name("function", False, "unavailable(trace) -> str | None: why it cannot run on this trace"),
    "param_problem": Name("function", False, "param_problem(value) -> str | None: why a parameter value is refused"),
    "check": Name("function", False, "check(trace, value) -> str | None: why it cannot run on this trace with this parameter"),
    "ahead": Name("function", False, "ahead(value) -> int: MoE layers ahead its guess exists (default 1)"),
    "note": Name("function", False, "note(trace, arr, in_phase) -> str | None: a note printed beside its figures"),
    "ISSUE": Name("str", False, '"token" (default): its guesses for a token exist at the token\'s start; "layer": the guess '
                  "for layer l exists once layer l - ahead's router has run (replay/analyses/timeline.py)"),
    "PREFETCH": Name("bool", False, "False: not usable by prefetch or retention"),
    "REPORT": Name("bool", False, "False: left out of the report's accuracy section"),
    "REPORT_PREFETCH": Name("int|bool", False, "True (or the parameter to show): a row of the report's prefetch section"),
    "ORACLE": Name("bool", False, "True: it has seen the answers; never the report's best predictor"),
    "LEARNS": Name("bool", False, "True: fitted on a training split; predict gets training= (rows it may learn from) and "
                   "in_phase = the rows it is scored on, which never share a token with them (replay/predictors/training.py)"),
    "SPLIT": Name("bool", False, "True: a composite (mix) whose predict gets split=, the whole held-out protocol, to run its parts"),
    "WEIGHTS": Name("bool", False, "True: predict accepts with_weights= and returns predicted routing weights"),
}

SPECS = {"policy": POLICY, "predictor": PREDICTOR}
# Names with these prefixes belong to the contract: one that is not listed is a misspelling.
FLAG_PREFIXES = {"policy": ("NEEDS_",), "predictor": ("REPORT",)}
_TYPES = {"str": (str,), "bool": (bool,), "int": (int,), "tuple": (tuple, list), "int|bool": (int, bool)}


def check(mod: ModuleType, kind: str, where: str) -> None:
    """Refuse, in one sentence naming ``where`` (the module's file) and the name, a ``kind`` module
    ("policy" or "predictor") that lacks a required name, gives a listed name the wrong kind, or
    defines a contract-like name the contract does not know."""
    spec = SPECS[kind]
    for name, s in spec.items():
        if not hasattr(mod, name):
            if s.required:
                raise UserError(f"{where}: a {kind} module must define {name} ({s.meaning}; see replay/plugin_spec.py).")
            continue
        value = getattr(mod, name)
        if s.kind in ("hook", "function"):
            ok = callable(value)
        else:
            ok = isinstance(value, _TYPES[s.kind]) and (s.kind == "bool" or not isinstance(value, bool) or "bool" in s.kind)
        if not ok:
            want = "a function" if s.kind in ("hook", "function") else f"a {s.kind.replace('|', ' or ')}"
            raise UserError(f"{where}: {name} must be {want} ({s.meaning}; see replay/plugin_spec.py), not {type(value).__name__}.")
    for name in vars(mod):
        if name.startswith(FLAG_PREFIXES[kind]) and name not in spec:
            raise UserError(f"{where}: {name} is no name of the {kind} contract (known: "
                            f"{', '.join(n for n in spec if n.startswith(FLAG_PREFIXES[kind]))}; see replay/plugin_spec.py).")


def contract_text(kind: str) -> str:
    """The contract as lines ``NAME (kind, required): meaning`` (docs and tests)."""
    return "\n".join(f"{n} ({s.kind}{', required' if s.required else ''}): {s.meaning}" for n, s in SPECS[kind].items())
