"""OpenTelemetry spans of the OpenAI routes (`--otlp-traces-endpoint`, vLLM's flag): one span
"llm_request" (kind SERVER) per engine request, from its arrival to its last output, with
vLLM's attributes (`vllm/tracing.py` SpanAttributes: gen_ai.request.*, gen_ai.usage.*,
gen_ai.latency.*), the child of the W3C trace context (`traceparent`, `tracestate`) of the
HTTP request when it has one.

Owns: the tracer (the OTLP exporter of `triton_compat/trace/otel.py:otlp_tracer`: gRPC by
default, `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf` for OTLP over HTTP, as vLLM;
`OTEL_SERVICE_NAME` names the service, default "continuum"). In: the request's headers and
sampling parameters, then its final `RequestOutput` (times from `RequestMetrics`, monotonic
seconds). Out: the span, exported in a background thread.
"""

from __future__ import annotations

import os
import time

from engine.outputs import RequestOutput


class RequestTracer:
    """Spans for the OpenAI routes (see the module docstring). Raises ValueError for an
    unknown OTLP protocol."""

    def __init__(self, endpoint: str) -> None:
        from triton_compat.trace.otel import otlp_tracer
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                                  os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"))
        self.tracer, self.provider = otlp_tracer(
            endpoint, protocol, os.environ.get("OTEL_SERVICE_NAME", "continuum"),
            name="continuum.entrypoints.openai")
        self.offset = time.time_ns() - time.monotonic_ns()      # monotonic -> epoch

    def context(self, headers):
        """The W3C trace context of the request's `headers` (None when it has none)."""
        carrier = {k: headers[k] for k in ("traceparent", "tracestate") if k in headers}
        if not carrier:
            return None
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        return TraceContextTextMapPropagator().extract(carrier)

    def record(self, out: RequestOutput, params, model: str, context=None) -> None:
        """The "llm_request" span of a finished engine request `out` (its `SamplingParams`
        `params`, the served `model` name)."""
        from opentelemetry.trace import SpanKind
        m = out.metrics
        start = int(m.arrival_time * 1e9) + self.offset
        end_s = m.finished_time or time.monotonic()
        attrs = {"gen_ai.response.model": model, "gen_ai.request.id": out.request_id,
                 "gen_ai.request.n": params.n, "gen_ai.request.max_tokens": params.max_tokens,
                 "gen_ai.request.temperature": params.temperature,
                 "gen_ai.request.top_p": params.top_p,
                 "gen_ai.usage.prompt_tokens": out.num_prompt_tokens,
                 "gen_ai.usage.completion_tokens": sum(c.num_output_tokens
                                                       for c in out.outputs),
                 "gen_ai.latency.e2e": end_s - m.arrival_time}
        if m.first_scheduled_time is not None:
            attrs["gen_ai.latency.time_in_queue"] = m.first_scheduled_time - m.arrival_time
        if m.first_token_time is not None:
            attrs["gen_ai.latency.time_to_first_token"] = m.first_token_time - m.arrival_time
            if m.first_scheduled_time is not None:
                attrs["gen_ai.latency.time_in_model_prefill"] = \
                    m.first_token_time - m.first_scheduled_time
            if m.last_token_time is not None:
                attrs["gen_ai.latency.time_in_model_decode"] = \
                    m.last_token_time - m.first_token_time
        if m.first_scheduled_time is not None and m.last_token_time is not None:
            attrs["gen_ai.latency.time_in_model_inference"] = \
                m.last_token_time - m.first_scheduled_time
        span = self.tracer.start_span("llm_request", context=context, kind=SpanKind.SERVER,
                                      start_time=start,
                                      attributes={k: v for k, v in attrs.items()
                                                  if v is not None})
        span.end(end_time=int(end_s * 1e9) + self.offset)

    def shutdown(self) -> None:
        """Send the spans not sent yet."""
        self.provider.shutdown()
