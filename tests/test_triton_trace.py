"""Triton's trace extension against a live server, over `tritonclient.http` / `.grpc` and the
raw routes: the settings API (global and per model, a model's unset fields following the global
ones, `null` clearing them; tritonserver 2.51's defaults, texts and statuses), the trace files
(Triton's JSON: per trace its model, version and request id, then one object per activity;
`log_frequency` writing `<file>.<n>`, `count` ending the sampling, the main file closed when the
server stops) and the OpenTelemetry mode, whose spans reach an in-process OTLP collector. Runs
against tritonserver 2.51 too (`CONTINUUM_V2_TARGET=triton`); every negative test ends with a
liveness check.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.test_triton_extensions import SCORES, build_models, inputs
from tests.v2_target import deviation, start_v2_server, stop_v2_server

pytestmark = pytest.mark.slow
OFF = {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1", "log_frequency": "0",
       "trace_file": "", "trace_mode": "triton"}
# the activities of one traced HTTP / gRPC inference, with the front end's own
CORE = {"REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END",
        "COMPUTE_OUTPUT_START", "COMPUTE_END", "INFER_RESPONSE_COMPLETE", "REQUEST_END"}
HTTP = {"HTTP_RECV_START", "HTTP_RECV_END", "HTTP_SEND_START", "HTTP_SEND_END"}
GRPC = {"GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "GRPC_SEND_START", "GRPC_SEND_END"}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A server started without --trace-config (tracing off, no trace file)."""
    root = tmp_path_factory.mktemp("trace_plain")
    build_models(root)
    s = start_v2_server(root, root / "server.log")
    yield s
    stop_v2_server(s)


def traced_server(tmp_path: Path, *config: str):
    root = tmp_path / "repo"
    build_models(root)
    args = [a for c in config for a in ("--trace-config", c)]
    return start_v2_server(root, tmp_path / "server.log", triton_args=args, continuum_args=args)


def traces(path: Path) -> dict[int, dict]:
    """A trace file's traces: id -> {"info": the model's object, "ts": {activity: ns}}."""
    out: dict[int, dict] = {}
    for entry in json.loads(path.read_text()):
        t = out.setdefault(entry["id"], {"info": None, "ts": {}})
        if "timestamps" in entry:
            for stamp in entry["timestamps"]:
                t["ts"][stamp["name"]] = stamp["ns"]
        elif "model_name" in entry:
            t["info"] = entry
    return out


def infer_http(server, request_id: str, model: str = "classes") -> None:
    client = httpclient.InferenceServerClient(server.http.removeprefix("http://"))
    client.infer(model, inputs(httpclient, SCORES), request_id=request_id)
    client.close()


# --- the settings API ----------------------------------------------------------------------------
def test_defaults_without_trace_config(plain):
    assert httpx.get(f"{plain.http}/v2/trace/setting").json() == OFF
    assert httpx.get(f"{plain.http}/v2/models/classes/trace/setting").json() == OFF
    r = httpx.post(f"{plain.http}/v2/trace/setting", json={"trace_level": ["TIMESTAMPS"]})
    assert (r.status_code, r.json()["error"]) == (
        400, "Attempting to set invalid trace setting :trace file name is not given")
    assert "trace" in httpx.get(f"{plain.http}/v2").json()["extensions"]


def test_model_settings_follow_the_global_ones_until_set(plain):
    base, model = f"{plain.http}/v2/trace/setting", f"{plain.http}/v2/models/classes/trace/setting"
    try:
        r = httpx.post(model, json={"trace_rate": "7"}).json()
        assert r == {**OFF, "trace_rate": "7"}
        assert httpx.post(base, json={"trace_count": "5", "trace_rate": "3"}).json() == \
            {**OFF, "trace_count": "5", "trace_rate": "3"}
        # the model's own rate stays, its count follows the global one
        assert httpx.get(model).json() == {**OFF, "trace_count": "5", "trace_rate": "7"}
        assert httpx.post(model, json={"trace_rate": None}).json() == \
            {**OFF, "trace_count": "5", "trace_rate": "3"}
        client = grpcclient.InferenceServerClient(plain.grpc)
        got = client.update_trace_settings(model_name="classes",
                                           settings={"log_frequency": "4"}, as_json=True)
        assert got["settings"]["log_frequency"] == {"value": ["4"]}
        assert got["settings"]["trace_rate"] == {"value": ["3"]}
        client.close()
    finally:
        httpx.post(model, json={"log_frequency": None, "trace_rate": None})
        httpx.post(base, json={"trace_count": "-1", "trace_rate": "1000"})
    assert httpx.get(model).json() == OFF


@pytest.mark.parametrize("body,status,text", [
    ({"trace_file": "elsewhere.json"}, 501,
     "trace file location can not be updated through network protocol"),
    ({"trace_level": ["OFF", "TIMESTAMPS"]}, 400,
     "Expect only one trace level 'OFF' is specified"),
    ({"trace_rate": "fast"}, 400, "Unable to parse 'trace_rate', got: fast"),
    ({"trace_count": "-2"}, 400, "Unable to parse 'trace_count'. Expecting value >= -1, got:-2"),
    ({"trace_count": "99999999999"}, 400, "Unable to parse 'trace_count', value is out of "
                                          "range [ -1, 2147483647 ], got: 99999999999"),
    ({"log_frequency": "often"}, 400, "Unable to parse 'log_frequency', got: often"),
    ({"trace_rate": 5}, deviation("client-error-4xx", continuum=400, triton=500),
     "attempt to access JSON non-string as string"),
])
def test_bad_updates_are_refused_with_tritons_texts(plain, body, status, text):
    r = httpx.post(f"{plain.http}/v2/trace/setting", json=body)
    assert (r.status_code, r.json()["error"]) == (status, text)
    assert httpx.get(f"{plain.http}/v2/trace/setting").json() == OFF
    r = httpx.get(f"{plain.http}/v2/models/nope/trace/setting")
    assert (r.status_code, r.json()["error"]) == (400, "Request for unknown model : nope")
    client = grpcclient.InferenceServerClient(plain.grpc)
    with pytest.raises(InferenceServerException, match="trace file location") as e:
        client.update_trace_settings(settings={"trace_file": "x.json"})
    assert e.value.status() == "StatusCode.UNIMPLEMENTED"
    assert client.is_server_live()
    client.close()


# --- trace files -------------------------------------------------------------------------------------
def test_trace_files_hold_each_request_and_its_activities(tmp_path):
    out = tmp_path / "trace.json"
    s = traced_server(tmp_path, f"triton,file={out}", "level=TIMESTAMPS", "rate=1")
    try:
        infer_http(s, "first")
        client = grpcclient.InferenceServerClient(s.grpc)
        client.infer("classes", inputs(grpcclient, SCORES), request_id="over-grpc")
        client.close()
        model = f"{s.http}/v2/models/classes/trace/setting"     # two per indexed file
        assert httpx.post(model, json={"log_frequency": "2"}).json()["log_frequency"] == "2"
        infer_http(s, "second")
        infer_http(s, "third")
    finally:
        stop_v2_server(s)
    main = traces(out)
    assert sorted(t["info"]["request_id"] for t in main.values()) == ["first", "over-grpc"]
    for t in main.values():
        assert t["info"]["model_name"] == "classes" and t["info"]["model_version"] == 1
        front = GRPC if t["info"]["request_id"] == "over-grpc" else HTTP
        assert set(t["ts"]) == CORE | front, set(t["ts"]) ^ (CORE | front)
        ts = t["ts"]
        assert ts["REQUEST_START"] <= ts["QUEUE_START"] <= ts["COMPUTE_START"] <= \
            ts["COMPUTE_INPUT_END"] <= ts["COMPUTE_OUTPUT_START"] <= ts["COMPUTE_END"] <= \
            ts["REQUEST_END"]
    indexed = traces(Path(f"{out}.0"))
    assert sorted(t["info"]["request_id"] for t in indexed.values()) == ["second", "third"]
    assert not Path(f"{out}.1").exists()


def test_rate_and_count_choose_the_requests(tmp_path):
    out = tmp_path / "trace.json"
    s = traced_server(tmp_path, f"triton,file={out}", "level=TIMESTAMPS", "rate=2", "count=2")
    try:
        for i in range(7):
            infer_http(s, f"r{i}")
        got = httpx.get(f"{s.http}/v2/trace/setting").json()
        assert (got["trace_count"], got["trace_rate"]) == ("0", "2")
    finally:
        stop_v2_server(s)
    # every 2nd request, 2 of them, in the main file when the server stops (tritonserver
    # writes an indexed file when the count runs out only once every request it saw was
    # traced: with rate 1)
    assert sorted(t["info"]["request_id"] for t in traces(out).values()) == ["r1", "r3"]
    assert not Path(f"{out}.0").exists()


# --- OpenTelemetry mode ---------------------------------------------------------------------------
class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: each POST body is an ExportTraceServiceRequest, in
    protobuf (Python's exporter) or JSON (tritonserver's, opentelemetry-cpp)."""

    spans: list = []

    def do_POST(self):           # noqa: N802 (http.server's name)
        from google.protobuf import json_format
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = trace_service_pb2.ExportTraceServiceRequest()
        if "json" in self.headers.get("Content-Type", ""):
            json_format.Parse(body, request, ignore_unknown_fields=True)
        else:
            request.ParseFromString(body)
        for rs in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for span in ss.spans:
                    type(self).spans.append((attrs, span))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_opentelemetry_mode_sends_the_request_spans(tmp_path):
    collector = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    _Collector.spans = []
    s = traced_server(tmp_path, "mode=opentelemetry", f"opentelemetry,url={url}",
                      "opentelemetry,resource=test.key=test-value", "level=TIMESTAMPS",
                      "rate=1")
    try:
        got = httpx.get(f"{s.http}/v2/trace/setting").json()
        assert got["trace_mode"] == "opentelemetry" and "trace_file" not in got
        infer_http(s, "otel-1")
    finally:
        stop_v2_server(s)                  # spans are sent at the latest when it stops
        collector.shutdown()
    by_name = {span.name: (attrs, span) for attrs, span in _Collector.spans}
    assert {"InferRequest", "classes", "compute"} <= set(by_name), list(by_name)
    attrs, root = by_name["InferRequest"]
    assert attrs["service.name"] == "triton-inference-server"
    assert attrs["test.key"] == "test-value"
    model, compute = by_name["classes"][1], by_name["compute"][1]
    assert model.parent_span_id == root.span_id and compute.parent_span_id == model.span_id
    assert model.trace_id == root.trace_id == compute.trace_id
    events = {e.name for _, span in by_name.values() for e in span.events}
    assert CORE | HTTP <= events, (CORE | HTTP) - events
    assert root.start_time_unix_nano <= model.start_time_unix_nano <= \
        compute.start_time_unix_nano <= compute.end_time_unix_nano <= model.end_time_unix_nano
