"""The notes ``cache`` prints and its ``--json`` object carries (the text tables and the fast path alike)."""

from __future__ import annotations

NO_DECODE = ("the trace has no decoded tokens (prefill only: a prompt-only run or a capture stopped during the prompt), "
             "so decode-only figures are null ('-'); the cumulative ones cover the prefill")

# The cache table's note when global LRU collapses below one token cycle (a cache verb's, kept here
# with NO_DECODE so that ``cache --json`` reads both without the text tables' module).
COLLAPSE = ("global LRU collapses toward 0% hit below one token cycle T: each token sweeps all MoE layers, so "
            "by the time a layer comes round again the cycle has evicted exactly the experts it needs next")
