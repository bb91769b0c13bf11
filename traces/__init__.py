"""The moe-route-trace format, version 1: schema, writer, validating reader, importers, synthetic traces."""

from traces.errors import TraceError, UserError
from traces.reader import RoutingArrays, Trace, open_trace
from traces.writer import TraceWriter

__all__ = ["Trace", "TraceError", "TraceWriter", "RoutingArrays", "UserError", "open_trace"]
