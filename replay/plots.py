"""Compatibility name: the report's figures live in :mod:`replay.present.plots` (presentation)."""

from replay.present.plots import (  # noqa: F401
    bars,
    budget_axis,
    budget_label,
    capture,
    color_for,
    heatmap,
    layer_ticks,
    lines,
    panels,
    prefetch,
    save,
    style_for,
)
