"""OpenTelemetry on both faces of one server, received by an in-process OTLP collector (a gRPC
`TraceService` and an OTLP/HTTP endpoint; never a remote one): a chat completion through the
official `openai` SDK with a W3C `traceparent` arrives as vLLM's "llm_request" span
(`--otlp-traces-endpoint`, OTLP gRPC) in the caller's trace, with vLLM's gen_ai attributes;
a v2 infer arrives as Triton's InferRequest / <model> / compute spans (`--trace-config
mode=opentelemetry`, OTLP HTTP).
"""

from __future__ import annotations

import threading
from concurrent import futures
from http.server import ThreadingHTTPServer

import grpc
import openai
import pytest
import tritonclient.http as httpclient

from tests.conftest import MODEL, free_port, start_server, stop_server
from tests.test_triton_extensions import SCORES, build_models, inputs
from tests.test_triton_trace import _Collector

pytestmark = pytest.mark.slow
TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def grpc_collector(spans: list):
    """An OTLP gRPC trace receiver on a free port: (server, "http://127.0.0.1:PORT")."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):      # noqa: N802 (the service's name)
            for rs in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    spans.extend((attrs, s) for s in ss.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"http://127.0.0.1:{port}"


def attributes(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = getattr(v, v.WhichOneof("value"))
    return out


def test_a_chat_completion_and_a_v2_infer_arrive_as_spans(tmp_path):
    spans: list = []
    rpc, rpc_url = grpc_collector(spans)
    _Collector.spans = spans
    http = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    repo = tmp_path / "repo"
    build_models(repo)
    proc, base = start_server(
        ["--max-model-len", "512", "--kv-cache-memory", "0.1", "--model-repository", str(repo),
         "--otlp-traces-endpoint", rpc_url, "--trace-config", "mode=opentelemetry",
         "--trace-config", f"opentelemetry,url=http://127.0.0.1:{http.server_address[1]}"
         "/v1/traces", "--trace-config", "level=TIMESTAMPS", "--trace-config", "rate=1",
         "--grpc-port", str(free_port())], "/health/ready", tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=5,
            temperature=0, extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
        v2 = httpclient.InferenceServerClient(base.removeprefix("http://"))
        v2.infer("classes", inputs(httpclient, SCORES), request_id="v2-traced")
        v2.close()
    finally:
        stop_server(proc)                  # the exporters send what is left as it stops
        rpc.stop(0)
        http.shutdown()
    llm = [s for _, s in spans if s.name == "llm_request"]
    assert len(llm) == 1, [s.name for _, s in spans]
    span = llm[0]
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    assert span.kind == 2                                      # SPAN_KIND_SERVER
    attrs = attributes(span)
    assert attrs["gen_ai.response.model"] == MODEL
    assert attrs["gen_ai.usage.completion_tokens"] == r.usage.completion_tokens
    assert attrs["gen_ai.usage.prompt_tokens"] == r.usage.prompt_tokens
    assert attrs["gen_ai.request.max_tokens"] == 5 and attrs["gen_ai.request.n"] == 1
    assert 0 < attrs["gen_ai.latency.time_to_first_token"] <= attrs["gen_ai.latency.e2e"]
    assert attrs["gen_ai.latency.time_in_queue"] >= 0
    names = {s.name for _, s in spans}
    assert {"InferRequest", "classes", "compute"} <= names, names
