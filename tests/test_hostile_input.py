"""Hostile input against a real server process: each request below gets a 4xx in the OpenAI
error shape naming the field (where there is one), and afterwards the server is live and its
greedy output is what it was before. The generated-case half (schemathesis over every route of
`/openapi.json`) is in test_fuzz.py."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import KEY, MAX_LEN, MODEL, greedy

AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 64 << 20            # --http-max-input-size's default (bytes)
CHAT = [{"role": "user", "content": "Say hi."}]


def _post(server: str, path: str, body=None, content: bytes | None = None, **kw):
    if content is not None:
        return httpx.post(f"{server}{path}", content=content, timeout=120,
                          headers={**AUTH, "Content-Type": "application/json"}, **kw)
    return httpx.post(f"{server}{path}", json=body, headers=AUTH, timeout=120, **kw)


def _greedy(server: str) -> str:
    return greedy(server, KEY, max_tokens=12)


@pytest.fixture(scope="module")
def reference(server):
    return _greedy(server)


CASES = {   # name: (path, JSON body or raw bytes, status, param, words in the message)
    "prompt past max_model_len": (
        "/v1/completions", {"model": MODEL, "prompt": "hello " * (MAX_LEN + 10)}, 400,
        "prompt", "maximum context length"),
    "token-id prompt of 10^6 ids": (
        "/v1/completions", {"model": MODEL, "prompt": [1] * 10**6}, 400, "prompt",
        "1000000 tokens"),
    "token id outside the vocabulary": (
        "/v1/completions", {"model": MODEL, "prompt": [10**30]}, 400, "prompt", "vocabulary"),
    "JSON nested 10,000 deep": (
        "/v1/chat/completions", b"[" * 10_000 + b"]" * 10_000, 400, None, "not valid JSON"),
    "invalid UTF-8": (
        "/v1/chat/completions", b'{"model": "\xff\xfe", "messages": []}', 400, None,
        "not valid JSON"),
    "huge n": (
        "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "n": 10**9}, 400, "n", ""),
    "huge logprobs": (
        "/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 10**9}, 400,
        "logprobs", ""),
    "huge top_logprobs": (
        "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "logprobs": True,
                                 "top_logprobs": 10**9}, 400, "top_logprobs", ""),
    "huge max_tokens": (
        "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 10**12}, 400,
        "max_tokens", "maximum context length"),
    "10,000 stop strings": (
        "/v1/completions", {"model": MODEL, "prompt": "hi",
                            "stop": [f"s{i}" for i in range(10_000)]}, 400, "stop", "at most"),
    "10,000 stop token ids": (
        "/v1/completions", {"model": MODEL, "prompt": "hi", "stop_token_ids": [7] * 10_000},
        400, "stop_token_ids", "at most"),
    "logit_bias with 100,000 keys": (
        "/v1/completions", {"model": MODEL, "prompt": "hi",
                            "logit_bias": {str(i): 1 for i in range(100_000)}}, 400,
        "logit_bias", "at most"),
    "logit_bias key outside the vocabulary": (
        "/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"999999": 5}}, 400,
        "logit_bias", "maximum value"),
    "NaN temperature": (
        "/v1/completions", b'{"model": "%s", "prompt": "hi", "temperature": NaN}' % MODEL.encode(),
        400, "temperature", ""),
    "10,000 prompts": (
        "/v1/completions", {"model": MODEL, "prompt": [[1, 2]] * 10_000}, 400, "prompt",
        "--max-num-seqs + --max-waiting-requests"),
    "min_tokens above max_tokens": (
        "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "min_tokens": 5},
        400, "min_tokens", ""),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_request_is_4xx_naming_the_field(server, reference, case):
    path, body, status, param, words = CASES[case]
    if isinstance(body, bytes):
        r = _post(server, path, content=body)
    else:
        r = _post(server, path, body)
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert _greedy(server) == reference


def test_bodies_over_the_size_limit_are_413(server, reference):
    big = b'{"model": "%s", "prompt": "' % MODEL.encode() + b"a" * LIMIT + b'"}'
    r = _post(server, "/v1/completions", content=big)                 # Content-Length
    assert r.status_code == 413 and "--http-max-input-size" in r.json()["error"]["message"]

    def chunked():                                                    # no Content-Length
        for _ in range(LIMIT // (1 << 20) + 2):
            yield b" " * (1 << 20)

    r = httpx.post(f"{server}/v1/completions", content=chunked(), timeout=120,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413
    assert _greedy(server) == reference
