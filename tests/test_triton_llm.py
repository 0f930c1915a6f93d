"""The served LLM as a Triton model (decoupled, Triton's vLLM-backend schema) and the generate
extension, against the session server (LLM + example repository) with `httpx` and
`tritonclient.grpc`: greedy text equal to /v1/completions, streaming over SSE and a gRPC stream,
Triton's refusals for decoupled models on unary infer, errors inside streams. Every negative
test ends with a liveness check.
"""

from __future__ import annotations

import json
import queue

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.conftest import KEY

pytestmark = pytest.mark.slow
LLM = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


def completion(base: str, max_tokens: int = 8) -> str:
    r = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": LLM, "prompt": PROMPT, "max_tokens": max_tokens,
                         "temperature": 0}, timeout=120)
    return r.json()["choices"][0]["text"]


def alive(base: str) -> None:
    r = httpx.post(f"{base}/v2/models/{LLM}/generate", timeout=120, json={
        "text_input": PROMPT, "max_tokens": 2, "exclude_input_in_output": True,
        "sampling_parameters": json.dumps({"temperature": 0})})
    assert r.status_code == 200 and r.json()["text_output"]


def sse(base: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", f"{base}/v2/models/{LLM}/generate_stream", json=body,
                      timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events


def test_llm_is_a_decoupled_model_in_the_repository(server):
    index = httpx.post(f"{server}/v2/repository/index").json()
    assert {"name": LLM, "version": "1", "state": "READY"} in index
    config = httpx.get(f"{server}/v2/models/{LLM}/config").json()
    assert config["model_transaction_policy"]["decoupled"] is True
    meta = httpx.get(f"{server}/v2/models/{LLM}").json()
    assert [i["name"] for i in meta["inputs"]][:2] == ["text_input", "stream"]
    assert [o["name"] for o in meta["outputs"]][0] == "text_output"


def test_generate_and_generate_stream_equal_the_completions_text(server):
    expected = completion(server)
    r = httpx.post(f"{server}/v2/models/{LLM}/generate", timeout=120, json={
        "text_input": PROMPT, "sampling_parameters": json.dumps({"temperature": 0,
                                                                 "max_tokens": 8}),
        "return_num_input_tokens": True, "return_num_output_tokens": True,
        "return_finish_reason": True})
    body = r.json()
    assert body["text_output"] == PROMPT + expected        # the prompt first, as vLLM's backend
    assert body["num_output_tokens"] == 8 and body["num_input_tokens"] > 0
    assert body["finish_reason"] == "length"
    events = sse(server, {"text_input": PROMPT, "stream": True, "max_tokens": 8,
                          "sampling_parameters": json.dumps({"temperature": 0})})
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == expected
    assert all(e["model_name"] == LLM for e in events)


def test_generate_refusals(server):
    r = httpx.post(f"{server}/v2/models/{LLM}/generate", timeout=120, json={
        "text_input": PROMPT, "stream": True, "max_tokens": 3})
    assert (r.status_code, r.json()["error"]) == (400, (
        "generate expects model to produce exactly 1 response, use generate stream for model "
        "that generates various number of responses"))
    r = httpx.post(f"{server}/v2/models/{LLM}/generate", json={"stream": False})
    assert r.status_code == 400 and r.json()["error"].startswith(
        "[request id: <id_unknown>] expected number of inputs between 1 and 8 but got 1 "
        f"inputs for model '{LLM}'. Got input(s) ['stream'], but missing required input(s) "
        "['text_input']")                              # Triton core's text
    r = httpx.post(f"{server}/v2/models/{LLM}/generate",
                   content=b'{"text_input": "a", "text_input": "b"}')
    assert (r.status_code, r.json()["error"]) == (
        400, "[request id: <id_unknown>] input 'text_input' already exists in request")
    r = httpx.post(f"{server}/v2/models/{LLM}/generate", json={"text_input": 7})
    assert (r.status_code, r.json()["error"]) == (
        400, "Unable to parse JSON bytes array: attempt to access JSON non-string as string")
    r = httpx.post(f"{server}/v2/models/{LLM}/generate", json={
        "text_input": "a", "sampling_parameters": json.dumps({"bogus": 1})})
    assert r.status_code == 400 and "unsupported key 'bogus'" in r.json()["error"]
    r = httpx.post(f"{server}/v2/models/{LLM}/infer", json={"inputs": []})
    assert (r.status_code, r.json()["error"]) == (
        501, "HTTP end point doesn't support models with decoupled transaction policy")
    alive(server)


def test_generate_on_a_plain_model(server):
    r = httpx.post(f"{server}/v2/models/simple/generate",
                   json={"INPUT0": list(range(16)), "INPUT1": [1] * 16})
    assert r.json()["OUTPUT0"] == [i + 1 for i in range(16)]
    with httpx.stream("POST", f"{server}/v2/models/simple/generate_stream",
                      json={"INPUT0": list(range(16)), "INPUT1": [1] * 16}) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: ")]
    assert len(events) == 1 and events[0]["OUTPUT1"] == [i - 1 for i in range(16)]


def llm_inputs(text: str, stream: bool, params: dict):
    t = grpcclient.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    s = grpcclient.InferInput("stream", [1], "BOOL")
    s.set_data_from_numpy(np.array([stream]))
    p = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    p.set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=np.object_))
    return [t, s, p]


def test_grpc_stream_of_the_llm(server, server_grpc):
    expected = completion(server)
    c = grpcclient.InferenceServerClient(server_grpc)
    try:
        with pytest.raises(InferenceServerException) as info:
            c.infer(LLM, llm_inputs(PROMPT, False, {}))
        assert (info.value.status(), info.value.message()) == (
            "StatusCode.UNIMPLEMENTED",
            "ModelInfer RPC doesn't support models with decoupled transaction policy")
        got: queue.Queue = queue.Queue()
        c.start_stream(callback=lambda result, error: got.put((result, error)))
        greedy = {"temperature": 0, "max_tokens": 8}
        c.async_stream_infer(LLM, llm_inputs(PROMPT, True, greedy), request_id="s")
        c.async_stream_infer(LLM, llm_inputs(PROMPT, False, {"bogus": 1}), request_id="bad")
        c.async_stream_infer(LLM, llm_inputs(PROMPT, False, greedy), request_id="whole")
        pieces, finals, errors, whole = [], [], [], None
        while whole is None:
            result, error = got.get(timeout=120)
            if error is not None:
                errors.append(error.message())
                continue
            r = result.get_response()
            text = result.as_numpy("text_output")[0].decode()
            if r.id == "s":
                pieces.append(text)
                finals.append(r.parameters["triton_final_response"].bool_param)
            else:
                whole = text
        c.stop_stream()
        assert "".join(pieces) == expected and finals[-1] and not any(finals[:-1])
        assert whole == PROMPT + expected
        assert len(errors) == 1 and "unsupported key 'bogus'" in errors[0]
    finally:
        c.close()
    alive(server)


def test_a_cancelled_grpc_stream_aborts_the_generation(server, server_grpc):
    """The client cancels a gRPC stream mid-generation (900 tokens asked, 9 s or more here):
    the engine drops the request within 4 s instead of generating to the end."""
    import time

    from tests.conftest import metric
    c = grpcclient.InferenceServerClient(server_grpc)
    got: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: got.put((result, error)))
    c.async_stream_infer(LLM, llm_inputs(PROMPT, True, {"max_tokens": 900, "ignore_eos": True,
                                                         "temperature": 0}))
    for _ in range(2):
        assert got.get(timeout=120)[1] is None
    c.stop_stream(cancel_requests=True)
    c.close()
    deadline = time.time() + 4
    while time.time() < deadline and metric(server, "continuum_num_requests_running") > 0:
        time.sleep(0.2)
    assert metric(server, "continuum_num_requests_running") == 0
    alive(server)


@pytest.mark.extended          # a server of its own: the stress tier (make test-stress)
def test_the_llm_is_a_v2_model_without_a_repository(tmp_path):
    """`continuum serve --grpc-port P` with no model repository: the LLM answers every v2 route
    a Triton client uses for a vLLM-backend model, over HTTP and gRPC (index, metadata, config,
    ready, statistics, generate, generate_stream, stream infer)."""
    from tests.conftest import free_port, start_server, stop_server

    grpc_port = free_port()
    proc, base = start_server(["--max-model-len", "512", "--kv-cache-memory", "0.1",
                               "--grpc-port", str(grpc_port), "--uvicorn-log-level", "warning"],
                              "/v2/health/ready", tmp_path / "server.log")
    try:
        assert httpx.post(f"{base}/v2/repository/index").json() == [
            {"name": LLM, "version": "1", "state": "READY"}]
        assert httpx.get(f"{base}/v2/models/{LLM}/ready").status_code == 200
        assert httpx.get(f"{base}/v2/models/{LLM}").json()["platform"] == "vllm"
        config = httpx.get(f"{base}/v2/models/{LLM}/config").json()
        assert config["model_transaction_policy"]["decoupled"] is True
        # the vLLM backend's generate example: sampling parameters as request parameters
        r = httpx.post(f"{base}/v2/models/{LLM}/generate", timeout=120, json={
            "text_input": PROMPT, "exclude_input_in_output": True, "id": "g1",
            "parameters": {"stream": False, "temperature": 0, "max_tokens": 4}})
        assert r.status_code == 200, r.text
        assert r.json()["text_output"] and r.json()["id"] == "g1"
        events = sse(base, {"text_input": PROMPT, "stream": True, "max_tokens": 4})
        assert len(events) >= 1 and all("text_output" in e for e in events)
        stats = httpx.get(f"{base}/v2/models/{LLM}/stats").json()["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] == 2
        c = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        try:
            assert c.is_server_ready() and c.is_model_ready(LLM)
            assert c.get_model_metadata(LLM).platform == "vllm"
            got: queue.Queue = queue.Queue()
            c.start_stream(callback=lambda result, error: got.put((result, error)))
            c.async_stream_infer(LLM, llm_inputs(PROMPT, False, {"temperature": 0,
                                                                 "max_tokens": 4}))
            result, error = got.get(timeout=120)
            c.stop_stream()
            assert error is None and result.as_numpy("text_output")[0].decode().startswith(
                PROMPT)
        finally:
            c.close()
        alive(base)
    finally:
        stop_server(proc)
