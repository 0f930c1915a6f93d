"""Speculative decoding with the real model: greedy and seeded outputs are token-identical to the
same engine without speculation (which test_engine_correctness holds to transformers in float32)
— alone, all at once, with chunked prefill, prefix-cache hits, swap and recompute preemption, n
> 1, max_tokens and stop strings — while drafts really are verified and accepted; blocks all come
back. Then the server as a user runs it: `--speculative-config` with the OpenAI SDK, its metrics,
and one-line start errors."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from engine.config import EngineConfig
from engine.kernels import AMX_MIN_ROWS
from engine.llm_engine import LLMEngine
from scheduler.request import SamplingParams
from tests.conftest import KEY, MODEL, greedy, metric, start_server, stop_server

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
GREEDY = SamplingParams(max_tokens=40, temperature=0)
PARAGRAPH = ("The scheduler decides, every engine step, which requests run and how many tokens "
             "each computes. Decodes go first, then continuing prefill chunks, then new "
             "requests, so running decodes are never stalled behind a long prompt.")
SYSTEM = ("You are Continuum's test assistant. You answer briefly and precisely, you never "
          "invent facts, and when you are unsure you say so. Keep every answer under three "
          "sentences and prefer plain words over jargon.")


def chat(tokenizer, user, system=None):
    msgs = ([{"role": "system", "content": system}] if system else []) + \
           [{"role": "user", "content": user}]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return {
        "copy": chat(tokenizer, "Repeat this paragraph exactly:\n\n" + PARAGRAPH),
        "code": tokenizer.encode('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
        "capital": chat(tokenizer, "What is the capital of France?"),
        "shared0": chat(tokenizer, "Name a primary colour.", SYSTEM),
        "shared1": chat(tokenizer, "Repeat after me: the sea is calm tonight.", SYSTEM),
    }


def engine(**overrides):
    cfg = dict(kv_cache_memory=0.5, max_model_len=1100, dtype="float32", device="cpu")
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg))


def run(eng, prompts, params=GREEDY):
    return [choices if params.n > 1 else choices[0]
            for choices in eng.generate(list(prompts), params)]


@pytest.fixture(scope="module")
def expected(prompts):
    base = engine()
    return {name: run(base, [p])[0] for name, p in prompts.items()}


def assert_drained(eng):
    kv = eng.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks and not kv.block_tables


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_alone_and_concurrent_match_no_speculation(prompts, expected, adaptive):
    eng = engine(speculative_config=dict(SPEC, adaptive=adaptive))
    assert run(eng, [prompts["copy"]]) == [expected["copy"]]
    counters = eng.scheduler.spec_counters
    assert counters.num_accepted_tokens >= 10, counters      # the copy prompt speculates
    assert run(eng, prompts.values()) == list(expected.values())
    assert_drained(eng)


def test_chunked_prefill_and_prefix_hits_match(prompts, expected):
    eng = engine(speculative_config=SPEC, max_num_batched_tokens=7)
    names = ["shared0", "copy", "shared1"]
    assert run(eng, [prompts["shared0"]]) + run(eng, [prompts[n] for n in names[1:]]) \
        == [expected[n] for n in names]
    assert eng.scheduler.counters.prefix_cache_hits >= 3 * 16
    assert eng.scheduler.spec_counters.num_accepted_tokens > 0
    assert_drained(eng)


@pytest.mark.extended          # ~10 s a mode; the engine-correctness preemption tests stay
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_matches(mode, prompts, expected, tokenizer):
    """A ~300-token copy prompt first (it runs throughout), then the others, on 26 blocks (416
    slots): later arrivals are preempted while drafts come and go."""
    long_copy = chat(tokenizer, "Repeat this text exactly:\n\n" + " ".join([PARAGRAPH] * 6))
    eng = engine(speculative_config=SPEC, num_gpu_blocks_override=26, preemption_mode=mode,
                 max_model_len=400,
                 swap_space=0.25, max_num_batched_tokens=256)
    base = engine(num_gpu_blocks_override=26, preemption_mode=mode, swap_space=0.25, max_model_len=400,
                  max_num_batched_tokens=256)
    batch = [long_copy] + list(prompts.values())
    assert run(eng, batch) == run(base, batch)
    assert eng.scheduler.counters.num_preemptions > 0
    assert eng.scheduler.spec_counters.num_accepted_tokens > 0
    assert_drained(eng)


def test_limits_and_seeded_sampling_match(prompts):
    """max_tokens, a stop string, n = 2 and seeded random sampling: the same tokens with and
    without speculation, run to run."""
    spec, base = engine(speculative_config=SPEC), engine()
    cases = [SamplingParams(max_tokens=5, temperature=0),
             SamplingParams(max_tokens=40, temperature=0, stop=("never stalled",)),
             SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=42, n=2),
             SamplingParams(max_tokens=30, temperature=1.0, seed=7, frequency_penalty=0.5,
                            min_tokens=20)]
    for params in cases:
        want = run(base, [prompts["copy"]], params)
        assert run(spec, [prompts["copy"]], params) == want, params
        assert run(spec, [prompts["copy"]], params) == want, params
    assert len(run(spec, [prompts["copy"]], cases[0])[0]) == 5
    assert spec.scheduler.spec_counters.num_accepted_tokens > 0
    assert_drained(spec)


# ----------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    """A served draft of k tokens is verified as k + 1 rows of one sequence; k stays below the
    row count from which an AMX host runs the quantized linears on bfloat16 tiles, so that
    verification and plain decode (1 row) run the same kernels and their logprobs agree to
    float rounding (on tiles they differ by up to ~0.04: docs/cpu.md, "batch invariance")."""
    log = tmp_path_factory.mktemp("spec") / "server.log"
    k = AMX_MIN_ROWS - 2
    proc, base = start_server(["--speculative-config",
                               f'{{"method": "ngram", "num_speculative_tokens": {k}}}'],
                              "/health/ready", log)
    yield base
    stop_server(proc)


@pytest.mark.extended          # its own server (~15 s to start); the engine tests stay
def test_server_streams_with_speculation_and_reports_it(spec_server, server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{spec_server}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Repeat this paragraph exactly:\n\n" + PARAGRAPH}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48,
                                           temperature=0, extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    assert text == whole.choices[0].message.content
    assert usage.completion_tokens == whole.usage.completion_tokens == 48
    drafts = metric(spec_server, "continuum_spec_decode_num_draft_tokens_total")
    accepted = metric(spec_server, "continuum_spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= drafts
    body = httpx.get(f"{spec_server}/metrics", timeout=5).text
    assert 'continuum_spec_decode_num_accepted_tokens_per_pos_total{model_name=' in body
    assert "continuum_spec_decode_mean_k" in body
    assert greedy(spec_server) == greedy(server, KEY)        # same tokens as without
    # Logprobs are the target's: the same as without speculation (up to float rounding).
    plain = OpenAI(base_url=f"{server}/v1", api_key=KEY)
    got = [client.completions.create(model=MODEL, prompt=PARAGRAPH + " " + PARAGRAPH,
                                     max_tokens=24, temperature=0, logprobs=2).choices[0].logprobs
           for client in (client, plain)]
    assert got[0].tokens == got[1].tokens
    assert got[0].token_logprobs == pytest.approx(got[1].token_logprobs, abs=1e-3)
    assert [sorted(t) for t in got[0].top_logprobs] == [sorted(t) for t in got[1].top_logprobs]


@pytest.mark.parametrize("value,words", [   # ~0.2 s a refusal (no torch loaded)
    ('{"method": "eagle"}', "--speculative-config: method must be one of"),
    ('{"num_speculative_tokens": -1}',
     "num_speculative_tokens must be a positive integer"),
    ('{"k": 3}', "unknown key 'k'"),
])
def test_bad_speculative_config_is_one_line_at_start(value, words):
    proc = subprocess.run([sys.executable, "-m", "api", "serve", "--speculative-config", value],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert words in proc.stderr and "Traceback" not in proc.stderr
