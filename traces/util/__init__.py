"""Helpers every layer uses and none of which is about the trace format: lazy njit, memory, signals, units, rounding."""
