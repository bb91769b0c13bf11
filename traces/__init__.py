"""The moe-route-trace format (version 2; version 1 still read): schema, writer, validating reader, upgrade, importers, synthetic traces."""

from traces.format.errors import TraceError, UserError

__all__ = ["Trace", "TraceError", "TraceWriter", "RoutingArrays", "UserError", "open_trace"]
# Imported on first use (PEP 562): the errors are light, the reader and writer pull in Arrow and Polars,
# which ``moe-replay --help`` must not wait for.
_LAZY = {"Trace": "traces.io.reader", "RoutingArrays": "traces.io.reader", "open_trace": "traces.io.reader",
         "TraceWriter": "traces.io.writer"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'traces' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
