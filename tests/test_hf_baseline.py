"""The transformers static-batching baseline that `continuum bench compare` measures against:
it serves the OpenAI routes, batches concurrent requests statically, honours each request's
max_tokens, and its greedy text equals transformers' own generate."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from benchmarks.servebench.hf_baseline_server import build_app


@pytest.fixture(scope="module")
def baseline(model_dir):
    with TestClient(build_app(str(model_dir), "float32", batch_size=4, wait_ms=200,
                              name="hf-baseline")) as client:
        yield client


def test_concurrent_requests_with_their_own_lengths(baseline, tokenizer, model_dir):
    def ask(n):
        return baseline.post("/v1/completions", json={"model": "hf-baseline", "prompt": "The sky is",
                                                      "max_tokens": n, "temperature": 0,
                                                      "ignore_eos": True}).json()

    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(ask, [3, 6, 9]))
    assert [o["usage"]["completion_tokens"] for o in outs] == [3, 6, 9]
    texts = [o["choices"][0]["text"] for o in outs]
    assert texts[2].startswith(texts[1]) and texts[1].startswith(texts[0])   # same greedy path
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = tokenizer.encode("The sky is")
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=9, do_sample=False,
                      pad_token_id=hf.config.eos_token_id)[0, len(ids):]
    assert texts[2] == tokenizer.decode(ref, skip_special_tokens=True)


def test_streaming_with_usage(baseline):
    with baseline.stream("POST", "/v1/chat/completions", json={
            "model": "hf-baseline", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    assert '"completion_tokens": 4' in lines[-2]
