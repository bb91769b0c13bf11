"""Compatibility name: the report's figures live in :mod:`replay.present.plots` (presentation)."""

from replay.present.plots import bars, heatmap, layer_ticks, lines, save  # noqa: F401
