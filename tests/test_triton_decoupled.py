"""Decoupled python models (`model_transaction_policy { decoupled: true }`, responses sent
through `request.get_response_sender()`) against a live server: any number of responses per
request over a gRPC stream (with `triton_final_response` and the empty final response when
asked) and over `generate_stream`; Triton's refusals on unary infer over both protocols; an
error response ends that request only. Every negative test ends with a liveness check.
"""

from __future__ import annotations

import json
import queue

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.v2_target import deviation

pytestmark = pytest.mark.slow


def repeat_input(values):
    x = grpcclient.InferInput("IN", [len(values)], "INT32")
    x.set_data_from_numpy(np.array(values, np.int32))
    return [x]


def stream(client, requests, empty_final=False, count=None):
    """Send (request id, values) pairs on one stream; collect responses until `count`."""
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        for rid, values in requests:
            client.async_stream_infer("repeat", repeat_input(values), request_id=rid,
                                      enable_empty_final_response=empty_final)
        return [got.get(timeout=30) for _ in range(count)]
    finally:
        client.stop_stream()


def test_responses_stream_with_the_final_flag(v2_servers):
    c = grpcclient.InferenceServerClient(v2_servers["main"][1])
    try:
        out = stream(c, [("a", [7, 8, 9])], empty_final=True, count=4)
        assert all(e is None for _, e in out)
        data = [(int(r.as_numpy("OUT")[0]), int(r.as_numpy("IDX")[0])) for r, _ in out[:3]]
        assert data == [(7, 0), (8, 1), (9, 2)]
        finals = [r.get_response().parameters["triton_final_response"].bool_param
                  for r, _ in out]
        assert finals == [False, False, False, True]
        last = out[3][0].get_response()
        assert last.id == "a" and len(last.outputs) == 0      # the empty final response
        # without the empty final response: just the three data responses
        out = stream(c, [("b", [1, 2, 3]), ("c", [5])], count=4)
        assert sorted((r.get_response().id, int(r.as_numpy("OUT")[0])) for r, _ in out) == \
            [("b", 1), ("b", 2), ("b", 3), ("c", 5)]
    finally:
        c.close()


def test_an_error_response_ends_only_its_request(v2_servers):
    c = grpcclient.InferenceServerClient(v2_servers["main"][1])
    try:
        out = stream(c, [("bad", [3, -1]), ("good", [4])], count=3)
        errors = [e.message() for _, e in out if e is not None]
        values = sorted((r.get_response().id, int(r.as_numpy("OUT")[0]))
                        for r, e in out if e is None)
        assert errors == ["element -1 refused on purpose"]
        assert values == [("bad", 3), ("good", 4)]
        with pytest.raises(InferenceServerException) as info:
            c.infer("repeat", repeat_input([1]))
        assert (info.value.status(), info.value.message()) == (
            "StatusCode.UNIMPLEMENTED",
            "ModelInfer RPC doesn't support models with decoupled transaction policy")
        assert len(stream(c, [("again", [2])], count=1)) == 1       # still serving
    finally:
        c.close()


def test_decoupled_over_http(v2_servers):
    base = v2_servers["main"][0]
    r = httpx.post(f"{base}/v2/models/repeat/infer", json={"inputs": [
        {"name": "IN", "datatype": "INT32", "shape": [1], "data": [1]}]})
    assert (r.status_code, r.json()) == (501, {"error": "HTTP end point doesn't support models "
                                                        "with decoupled transaction policy"})
    with httpx.stream("POST", f"{base}/v2/models/repeat/generate_stream",
                      json={"IN": [4, 5, 6]}) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: ")]
    assert [(e["OUT"], e["IDX"]) for e in events] == [(4, 0), (5, 1), (6, 2)]
    r = httpx.post(f"{base}/v2/models/repeat/generate", json={"IN": [4, 5]})
    assert r.status_code == deviation("generate-one-response", continuum=400, triton=200)
    assert r.json() == {"error": "generate expects model to produce exactly 1 response, use "
                                 "generate stream for model that generates various number of "
                                 "responses"}
    assert httpx.post(f"{base}/v2/models/repeat/generate", json={"IN": [9], "id": "x7"}).json() \
        == {"IDX": 0, "OUT": 9, "id": "x7", "model_name": "repeat", "model_version": "1"}
    with httpx.stream("POST", f"{base}/v2/models/repeat/generate_stream",
                      json={"IN": [2, -1]}) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: ")]
    assert events == [{"model_name": "repeat", "model_version": "1", "OUT": 2, "IDX": 0},
                      {"error": "element -1 refused on purpose"}]
    # a model's error as the first response: an SSE event; its status is the first response's
    r = httpx.post(f"{base}/v2/models/repeat/generate_stream", json={"IN": [-1]})
    assert r.status_code == deviation("generate-error-status", continuum=500, triton=400)
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert r.text == 'data: {"error":"element -1 refused on purpose"}\n\n'
    # refused before the model runs: plain JSON
    r = httpx.post(f"{base}/v2/models/repeat/generate_stream", json={"IN": "x"})
    assert r.status_code == deviation("client-error-4xx", continuum=400, triton=500)
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"error": "Unable to parse 'data': attempt to access JSON "
                                 "non-signed-integer as signed-integer"}


@pytest.mark.parametrize("model,scale", [("repeat_ens", 1), ("repeat_double", 2)])
def test_an_ensemble_over_a_decoupled_model_streams_its_responses(v2_servers, model, scale):
    """An ensemble with a decoupled step is decoupled: each of the step's responses goes on
    through the steps after it (`repeat_double` doubles each) and is one response of the
    ensemble, over a gRPC stream and generate_stream; one-response infer is refused as for
    any decoupled model."""
    c = grpcclient.InferenceServerClient(v2_servers["main"][1])
    try:
        assert c.get_model_config(model).config.model_transaction_policy.decoupled
        got: queue.Queue = queue.Queue()
        c.start_stream(callback=lambda result, error: got.put((result, error)))
        c.async_stream_infer(model, repeat_input([4, 5, 6]), request_id="e",
                             enable_empty_final_response=True)
        out = [got.get(timeout=30)]
        while out[-1][1] is None and not \
                out[-1][0].get_response().parameters["triton_final_response"].bool_param:
            out.append(got.get(timeout=30))
        c.stop_stream()
    finally:
        c.close()
    assert all(e is None for _, e in out)
    # the final flag rides on the last data response when the decoupled step's final flag
    # came before it (Triton does this by timing too), or comes alone and empty
    data = sorted((int(r.as_numpy("OUT")[0]), int(r.as_numpy("IDX")[0]))
                  for r, _ in out if r.get_response().outputs)
    assert data == [(4 * scale, 0), (5 * scale, 1), (6 * scale, 2)]
    assert len(out) in (3, 4)
    base = v2_servers["main"][0]
    with httpx.stream("POST", f"{base}/v2/models/{model}/generate_stream",
                      json={"IN": [7, 8]}) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: ")]
    assert sorted(e["OUT"] for e in events) == [7 * scale, 8 * scale]
    r = httpx.post(f"{base}/v2/models/{model}/infer", json={"inputs": [
        {"name": "IN", "datatype": "INT32", "shape": [1], "data": [1]}]})
    assert (r.status_code, r.json()) == (501, {"error": "HTTP end point doesn't support models "
                                                        "with decoupled transaction policy"})
