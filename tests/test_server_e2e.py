"""End to end against a real server process on a loopback port, with the official `openai` client:
streamed and non-streamed chat and completions, n = 2, stop strings, usage, every error, auth,
and disconnect → blocks freed (read from /metrics). Each negative test ends with a liveness check."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.conftest import KEY, MAX_LEN, MODEL, metric


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def alive(server):
    assert httpx.get(f"{server}/health", timeout=5).status_code == 200
    r = httpx.post(f"{server}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Name three colours."}]}]


# ----------------------------------------------------------------------------- happy paths
def test_models_lists_the_served_model(client):
    # the LLM first, then the repository's embedding models (/v1/embeddings; api/embeddings.py)
    assert [m.id for m in client.models.list()] == [MODEL, "text_embedding"]


def test_chat_streamed_equals_non_streamed_with_exact_usage(client, server):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24,
                                          temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices
                and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]               # exactly once
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(httpx.get(f"{server}/v1/models", headers={
        "Authorization": f"Bearer {KEY}"}).json()["data"][0]["root"])
    ids = tok.apply_chat_template([{"role": "system", "content": "You are terse."},
                                   {"role": "user", "content": "Name three colours."}],
                                  add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    assert full.usage.prompt_tokens == len(ids)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


def test_completions_streamed_and_not_with_n2_and_token_prompts(client):
    prompts = ["The sky is", "Roses are"]
    # n > 1 is sampled (vLLM refuses greedy n > 1); seeded, so streamed == whole
    full = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=1.0,
                                     seed=7, n=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in full.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in full.choices}
    assert all(by_index.values())
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=8,
                                           temperature=1.0, seed=7, n=2, stream=True,
                                           extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == by_index
    assert full.usage.completion_tokens == 32
    ids = client.completions.create(model=MODEL, prompt=[[504, 3575, 282], [504, 3575]],
                                    max_tokens=3, temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5


def test_sampled_n2_gives_two_choices(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, n=2,
                                       temperature=1.0, seed=3)
    assert len(r.choices) == 2 and r.choices[0].message.content != r.choices[1].message.content


def test_echo_and_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4,
                                  temperature=0, echo=True, logprobs=3)
    c = r.choices[0]
    # vLLM's echo: the prompt's tokens first, scored by its prompt logprobs (the first has
    # none); each position lists its token and the top 3 (3 entries when it is among them)
    n_prompt = r.usage.prompt_tokens
    assert c.text.startswith("Once upon a time") and len(c.logprobs.tokens) == n_prompt + 4
    assert "".join(c.logprobs.tokens) == c.text and c.logprobs.token_logprobs[0] is None
    assert c.logprobs.top_logprobs[0] is None
    assert all(len(t) in (3, 4) for t in c.logprobs.top_logprobs[1:])
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) >= 1 and all(len(t.top_logprobs) == 2 for t in content)


def test_stop_strings_cut_the_output(client):
    base = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12,
                                     temperature=0).choices[0].text
    assert "6" in base, base
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12,
                                  temperature=0, stop=["6"])
    assert r.choices[0].text == base[:base.index("6")]
    assert r.choices[0].finish_reason == "stop"


def test_vllm_extras_are_accepted(client):
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0.7,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 5,
                    "ignore_eos": True, "stop_token_ids": [9999], "priority": 1})
    assert r.usage.completion_tokens == 5


def test_unknown_fields_are_ignored_with_vllm_warning(server, client):
    """As vLLM: a field the server does not define is dropped and named in one warning line;
    the request is served (chat, completions, embeddings alike)."""
    from tests.conftest import SESSION_LOG

    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                              "bogus_field": 1, "vllm_xargs": {"a": 1}})
    assert r.status_code == 200, r.text
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                         "another_unknown": [1]})
    assert r.status_code == 200, r.text
    logged = SESSION_LOG[-1].read_text()
    assert "The following fields were present in the request but ignored: " in logged
    assert "'bogus_field'" in logged and "'another_unknown'" in logged
    alive(server)


def test_stream_events_end_with_a_blank_line_as_vllm(server):
    """SSE events framed `data: ...\n\n` (vLLM's framing, what hand-written clients split on);
    compact JSON; `data: [DONE]` last."""
    import httpx
    with httpx.stream("POST", f"{server}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "prompt": "Hi", "max_tokens": 3,
                            "stream": True}) as r:
        raw = b"".join(r.iter_raw()).decode()
        head = r.headers
    assert head["content-type"] == "text/event-stream; charset=utf-8"       # as vLLM's
    assert head["cache-control"] == "no-store" and head["x-accel-buffering"] == "no"
    assert "\r" not in raw and raw.endswith("data: [DONE]\n\n")
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: {\"id\":") for e in events[:-1]), events[0]
    alive(server)


# ----------------------------------------------------------------------------- errors
def post(server, path, body, key=KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        headers["Content-Type"] = "application/json"
        return httpx.post(f"{server}{path}", content=raw, headers=headers, timeout=60)
    return httpx.post(f"{server}{path}", json=body, headers=headers, timeout=60)


def test_malformed_json_is_400(server):
    r = post(server, "/v1/chat/completions", None, raw=b'{"model": ')
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    alive(server)


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL, "messages": CHAT, "temperature": 5}, "temperature"),
    ({"model": MODEL, "messages": CHAT, "n": 0}, "n"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": CHAT, "tools": [{"type": "function"}]}, "tools.0.function"),
    ({"model": MODEL, "messages": CHAT, "n": 2, "temperature": 0}, "n"),
    ({"model": MODEL, "messages": CHAT, "chat_template": "{{ 1 }}"}, "chat_template"),
    ({"model": MODEL, "messages": CHAT, "stream_options": {"include_usage": True}},
     "stream_options"),
])
def test_bad_parameters_are_400_naming_the_parameter(server, body, param):
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    alive(server)


def test_too_long_is_400_naming_both_numbers(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hello " * 900, max_tokens=500)
    msg = e.value.response.json()["error"]["message"]
    assert str(MAX_LEN) in msg and "500" in msg
    alive(server)


def test_unknown_model_is_404(client, server):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=CHAT)
    alive(server)


def test_auth(server):
    assert post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT},
                key=None).status_code == 401
    r = post(server, "/v1/models", {}, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{server}{path}", timeout=5).status_code == 200
    alive(server)


def test_queue_full_is_503_with_retry_after(server):
    body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 300, "ignore_eos": True}

    def send(_):
        return post(server, "/v1/completions", body)

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(send, range(12)))
    codes = [r.status_code for r in results]
    assert 503 in codes and 200 in codes, codes
    refused = next(r for r in results if r.status_code == 503)
    assert refused.headers["Retry-After"] and "queue is full" in refused.json()["error"]["message"]
    alive(server)


# ----------------------------------------------------------------------------- disconnects
def wait_idle(server, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metric(server, "continuum_num_requests_running") == 0 \
                and metric(server, "continuum_kv_cache_usage_perc") == 0:
            return True
        time.sleep(0.1)
    return False


def test_streaming_disconnect_aborts_and_frees_blocks(server):
    body = {"model": MODEL, "prompt": "Write an essay", "max_tokens": 800, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert metric(server, "continuum_num_requests_running") >= 1
        assert metric(server, "continuum_kv_cache_usage_perc") > 0
    t0 = time.time()
    assert wait_idle(server), "blocks were not freed after the client went away"
    assert time.time() - t0 < 5
    alive(server)


def test_non_streaming_disconnect_aborts_and_frees_blocks(server):
    body = {"model": MODEL, "prompt": "Write an essay", "max_tokens": 800, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server}/v1/completions", json=body, timeout=1.5,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert wait_idle(server), "blocks were not freed after the client went away"
    alive(server)


def test_metrics_use_vllm_names_with_continuum_prefix(server):
    text = httpx.get(f"{server}/metrics", timeout=5).text
    from api.metrics import METRIC_NAMES
    missing = [n for n in METRIC_NAMES if n not in text]
    assert not missing, missing
    assert metric(server, "continuum_generation_tokens_total") > 0
    # The step-cost model the SLO scheduler budgets by, fitted on this server's own steps: a
    # decode step (base + per_decode) is no slower than 4x the mean step (decode steps are
    # the cheapest kind) and no faster than a quarter of the fastest steps the step-time
    # histogram holds (the mean itself depends on how much faster this host prefills than it
    # decodes: on an AMX host a decode step measured 0.22x the mean)
    costs = {term: float(v) for term, v in re.findall(
        r'^continuum_step_cost_seconds{[^}]*term="(\w+)"[^}]*} (\S+)$', text, re.M)}
    assert set(costs) == {"base", "per_decode", "per_prefill_token"}, costs
    step = metric(server, "continuum_step_duration_seconds_sum") \
        / metric(server, "continuum_step_duration_seconds_count")
    edges = [(float(le), float(n)) for le, n in re.findall(
        r'^continuum_step_duration_seconds_bucket{[^}]*le="([^"]+)"[^}]*} (\S+)$', text, re.M)]
    fastest_floor = max([le for le, n in edges if n == 0] or [0.0])
    decode = costs["base"] + costs["per_decode"]
    assert 0.25 * fastest_floor <= decode < 4 * step, (costs, step, fastest_floor)
    assert costs["per_prefill_token"] > 0
    assert json.loads(httpx.get(f"{server}/version", timeout=5).text)["version"]


def test_llm_and_triton_models_share_one_port(client, server):
    """OpenAI chat and a KServe v2 infer on the same server, at the same time."""
    import numpy as np
    import tritonclient.http as httpclient

    triton = httpclient.InferenceServerClient(server.removeprefix("http://"))
    assert triton.is_server_ready() and triton.is_model_ready("simple")
    in0 = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"),
              httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(in0)
    inputs[1].set_data_from_numpy(in0)
    with ThreadPoolExecutor(1) as pool:
        chat = pool.submit(client.chat.completions.create, model=MODEL, messages=CHAT,
                           max_tokens=8)
        result = triton.infer("simple", inputs)
        assert np.array_equal(result.as_numpy("OUTPUT0"), 2 * in0)
        assert chat.result().choices[0].message.content
    # the v2 routes need no API key; /v1 still does
    assert httpx.get(f"{server}/v1/models").status_code == 401
    triton.close()
