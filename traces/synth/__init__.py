"""Synthetic traces (a small residual-stream model) and the schedule that batches per-request logs."""
