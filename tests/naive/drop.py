"""Naive twin of static drop-cold, written from docs/design.md and the drop issue: plain loops.

A slot is skipped when the engine recorded it as a miss (residency 0), its weight is below
F / k, and it is not the routing's top-weighted slot (first slot among equal maxima). Bytes of an
expert in a load are saved only if every slot routing that expert in that load is skipped.
"""

from __future__ import annotations

from collections import defaultdict


def naive_static_drop(rows, k, frac):
    """rows: list of dicts with batch, layer, experts, weights, residency, read_bytes (lists of k).

    Returns (saved_bytes, total_read_bytes, mass_lost, total_mass, routings_dropped, survivors,
    experts_dropped): routings_dropped counts routings with at least one slot skipped,
    experts_dropped counts skipped slots (routed experts), the engine's "routings dropped"."""
    per_load_expert = defaultdict(lambda: [0, 0.0])  # (batch, layer, expert) -> [kept slots, bytes]
    mass_lost = total_mass = 0.0
    routings_dropped = 0
    experts_dropped = 0
    survivors = []
    total_read = 0.0
    for r in rows:
        top = 0
        for s in range(k):
            if r["weights"][s] > r["weights"][top]:
                top = s
        dropped_any = False
        alive = 0
        for s in range(k):
            w = float(r["weights"][s])
            total_mass += w
            total_read += r["read_bytes"][s]
            skip = r["residency"][s] == 0 and w < frac / k and s != top
            key = (r["batch"], r["layer"], r["experts"][s])
            per_load_expert[key][1] += r["read_bytes"][s]
            if skip:
                mass_lost += w
                dropped_any = True
                experts_dropped += 1
            else:
                per_load_expert[key][0] += 1
                alive += 1
        routings_dropped += dropped_any
        survivors.append(alive)
    saved = sum(b for kept, b in per_load_expert.values() if kept == 0)
    return saved, total_read, mass_lost, total_mass, routings_dropped, survivors, experts_dropped
