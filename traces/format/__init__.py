"""What a trace is: trace.json's contract, the Parquet schemas, the version, router gating, errors."""
