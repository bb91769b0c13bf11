"""Per-decode-batch series of a replay (lookups, hits, bytes read, tokens): what a paired
comparison of two settings resamples (replay.analyses.paired). Core-level: the replay drivers
(replay.core.simulate, replay.core.streaming) collect them while they run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class DecodeSeries:
    """One setting's decode batches, in trace order: lookups, hits, bytes read by misses, tokens."""

    lookups: np.ndarray
    hits: np.ndarray
    read_bytes: np.ndarray
    tokens: np.ndarray
    requests: np.ndarray | None = None  # int [units]: the request of each decode batch (resampled whole), or None

    def __len__(self) -> int:
        return int(self.lookups.shape[0])


def series_of(loads: Any, res: Any) -> DecodeSeries:
    """The decode batches of a :class:`replay.core.simulate.ReplayResult` (its ``bacc``) as a series."""
    from replay.core.driver import ACC_HITS, ACC_LOOKUPS, ACC_READ

    dec = np.asarray(loads.batch_phase) == 1
    b = res.bacc[dec]
    tok = (np.ones(int(dec.sum()), np.int64) if loads.batch_tokens is None
           else np.asarray(loads.batch_tokens)[dec].astype(np.int64))
    return DecodeSeries(b[:, ACC_LOOKUPS].astype(np.int64), b[:, ACC_HITS].astype(np.int64),
                        b[:, ACC_READ].astype(np.int64), tok)


def whatif_series(loads: Any, res: Any) -> DecodeSeries:
    """:func:`series_of` with the speculative reads counted in the bytes (a prefetch's cost)."""
    from replay.core.driver import ACC_SPEC_READ

    s = series_of(loads, res)
    spec = res.bacc[np.asarray(loads.batch_phase) == 1, ACC_SPEC_READ].astype(np.int64)
    return DecodeSeries(s.lookups, s.hits, s.read_bytes + spec, s.tokens, s.requests)
