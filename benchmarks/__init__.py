"""Side-by-side performance runs (``python -m benchmarks.<name>``), not timed tests."""
