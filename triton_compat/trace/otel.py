"""OpenTelemetry for both faces: one tracer provider with an OTLP exporter per endpoint
(`otlp_tracer`), Triton's opentelemetry trace mode (`OtelExporter`: a finished v2 trace as
spans), used by the OpenAI routes' `--otlp-traces-endpoint` too (`api/tracing.py`).

Triton's spans (tritonserver 2.51, `tracer.cc`): a root span "InferRequest" from the front
end's first activity to its last, a span named after the model from REQUEST_START to
REQUEST_END, and a span "compute" from COMPUTE_START to COMPUTE_END; every activity is an event
of the innermost span open at its time. A `traceparent` header (W3C trace context) makes the
root span its child. Times: the monotonic clock of the marks, moved to the epoch once.
In: finished `Trace`s. Out: spans to the OTLP endpoint (HTTP `url`, as Triton's exporter;
gRPC for `--otlp-traces-endpoint`, as vLLM's), batched in a background thread.
"""

from __future__ import annotations

import time

from triton_compat.trace.record import Trace

TRITON_URL = "http://localhost:4318/v1/traces"       # tritonserver's default endpoint


def otlp_tracer(endpoint: str, protocol: str, service_name: str, resource: list[str] = (),
                name: str = "continuum", batch_options: dict | None = None):
    """(tracer, provider) exporting over OTLP to `endpoint`; `protocol` "grpc" or
    "http/protobuf"; `resource`: extra "key=value" resource attributes. Raises ValueError for
    another protocol or a resource entry without '='."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attrs = {"service.name": service_name}
    for entry in resource:
        key, eq, value = entry.partition("=")
        if not eq:
            raise ValueError(f"resource attribute {entry!r}: expected key=value")
        attrs[key] = value
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https"))
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        exporter = OTLPSpanExporter(endpoint=endpoint)
    else:
        raise ValueError(f"OTLP protocol {protocol!r}: expected grpc or http/protobuf")
    provider = TracerProvider(resource=Resource.create(attrs))
    provider.add_span_processor(BatchSpanProcessor(exporter, **(batch_options or {})))
    return provider.get_tracer(name), provider


class OtelExporter:
    """Triton's opentelemetry mode: `export(trace)` for each finished trace; `shutdown()`
    sends what is left. `options`: the mode's --trace-config keys (url, bsp_*)."""

    def __init__(self, options: dict, resource: list[str] = ()) -> None:
        batch = {k: int(options[f"bsp_{k}"]) for k in ("max_queue_size",
                                                        "max_export_batch_size")
                 if f"bsp_{k}" in options}
        if "bsp_schedule_delay" in options:
            batch["schedule_delay_millis"] = int(options["bsp_schedule_delay"])
        self.tracer, self.provider = otlp_tracer(
            options.get("url", TRITON_URL), "http/protobuf", "triton-inference-server",
            resource, "triton-server", batch)
        self.offset = time.time_ns() - time.perf_counter_ns()   # monotonic -> epoch

    def export(self, trace: Trace) -> None:
        """The trace's spans (see the module docstring)."""
        from opentelemetry.trace import SpanKind
        events = sorted(trace.events, key=lambda e: e[1])
        if not events:
            return
        at = {name: ns + self.offset for name, ns in events}
        root = self.tracer.start_span("InferRequest", context=trace.context,
                                      kind=SpanKind.SERVER, start_time=events[0][1] + self.offset)
        spans = [(root, None)]
        model = trace.info.get("model_name", "")
        if "REQUEST_START" in at:
            ctx = _context(root)
            spans.append((self.tracer.start_span(model, context=ctx,
                                                 start_time=at["REQUEST_START"]),
                          at.get("REQUEST_END")))
            if "COMPUTE_START" in at:
                spans.append((self.tracer.start_span("compute", context=_context(spans[1][0]),
                                                     start_time=at["COMPUTE_START"]),
                              at.get("COMPUTE_END")))
        for name, ns in events:
            t = ns + self.offset
            inner = next(s for s, end in reversed(spans)
                         if (end is None or t <= end) and s.start_time <= t)
            inner.add_event(name, timestamp=t)
        for span, end in reversed(spans[1:]):
            span.end(end_time=end)
        root.end(end_time=events[-1][1] + self.offset)

    def shutdown(self) -> None:
        """Send the spans not sent yet, then stop the exporter."""
        self.provider.shutdown()


def _context(span):
    from opentelemetry import trace as otel_trace
    return otel_trace.set_span_in_context(span)
