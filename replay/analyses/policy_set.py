"""Which policies a report or verb ranks, and which it leaves out and why: one rule for every
"best" (docs/design.md, "Paired comparisons").

The report ranks every registered online policy by default (built-ins and registered plugins),
in its verdict, its tables and its plots alike, beside the bounds ``belady`` and ``infinite``;
``--policies`` narrows that set everywhere in the report at once. ``cache``'s compact default
list stays (:data:`CACHE_DEFAULT`). Every "best" among them is chosen by
:func:`replay.analyses.paired.decide` (:func:`replay.core.simulate.pick_best` on the within-budget cells, then the
paired interval against LRU)."""

from __future__ import annotations

CACHE_DEFAULT = ("lru", "lfu", "layer", "lfru", "belady", "infinite")
SHOWN_BOUNDS = ("belady", "infinite")


def online_policies(given: list[str] | tuple[str, ...] | None = None) -> list[str]:
    """The online (not bound) policies: those ``given``, else every registered one, in registry order."""
    from replay.policies import bound_policies, names

    bounds = set(bound_policies())
    return [p for p in (given or names()) if p not in bounds]


def report_policies(given: list[str] | tuple[str, ...] | None = None) -> tuple[list[str], list[tuple[str, str]]]:
    """(the policies a report replays: the online ones of :func:`online_policies` then the bounds
    belady and infinite; the registered policies it leaves out, each with why)."""
    from replay.policies import bound_policies, names

    online = online_policies(given)
    shown = [*online, *[b for b in SHOWN_BOUNDS if b in names()]]
    if given:
        shown += [p for p in given if p not in shown]
    left = []
    for p in names():
        if p in shown:
            continue
        if p in bound_policies():
            left.append((p, "an offline bound, not an online candidate (replay it with 'cache --policies')"))
        else:
            left.append((p, "not in --policies"))
    return shown, left


def left_out_text(left: list[tuple[str, str]]) -> str:
    """"Left out: a (why); b (why)." or ""."""
    return ("Left out of the ranking: " + "; ".join(f"{p} ({why})" for p, why in left) + ".") if left else ""
