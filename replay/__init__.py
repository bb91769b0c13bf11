"""Offline replay of expert-cache policies, predictors, drop and prefetch over v1 traces."""

__version__ = "0.1.0"
