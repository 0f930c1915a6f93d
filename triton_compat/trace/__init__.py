"""Triton's trace extension: per-request traces of v2 inferences, written as Triton's JSON
trace files or exported as OpenTelemetry spans.

`settings.py` owns the settings (flags, the global and per-model settings API with tritonserver
2.51's rules and texts) and the sampling; `record.py` a trace in flight (its timestamps) and the
trace files; `otel.py` the OpenTelemetry export. Hooks: the HTTP and gRPC front ends sample a
trace and mark their receive / send times, `triton_compat/frontend/infer.py` the request's start, the
model runtime its queue and compute times (`BackendRequest.trace`).
"""

from triton_compat.trace.record import Trace
from triton_compat.trace.settings import TraceManager, parse_trace_config

__all__ = ["Trace", "TraceManager", "parse_trace_config"]
