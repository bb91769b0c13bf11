"""The tool version recorded in every trace's provenance (one place for the whole distribution)."""

__version__ = "0.1.0"
