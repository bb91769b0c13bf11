"""Offline replay of expert-cache policies, predictors, drop and prefetch over v1 traces."""

from traces.version import __version__

__all__ = ["__version__"]
