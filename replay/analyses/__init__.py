"""What each verb computes, one module per question (accuracy, drop, prefetch, cost, compare,
popularity, info, sweeps, the report's composition): frames in, frames out."""
