"""The expert-cache simulator: cache state, the replay driver and its kernels, loads, streamed replay."""
