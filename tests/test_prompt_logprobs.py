"""Prompt logprobs (vLLM's `prompt_logprobs`) from the engine, against transformers on the same
weights: every prompt token's logprob given the ones before it, its rank and the top
alternatives — alone, with chunked prefill at a 7-token budget, after the prompt is in the
prefix cache (such requests never read it, as in vLLM), under recompute preemption (delivered
once), with n > 1, and over the whole vocabulary (-1). The server side (the OpenAI shape,
echo, refusals) is in tests/test_vllm_extras.py and, against vLLM itself,
tests/test_vllm_differential.py."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from scheduler.request import ParamError, SamplingParams

TOL = 1e-3       # GGUF blocks read by the kernels vs the same weights dequantized in float32


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 5),
            tokenizer.encode("def add(a, b):\n    return a + b\n\nprint(add(2, 3))"),
            tokenizer.encode("Hi")]


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    """transformers' float32 log-softmax at every position of each prompt."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        return [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1) for p in prompts]


def engine(**overrides) -> LLMEngine:
    cfg = dict(kv_cache_memory=0.25, max_model_len=1024, dtype="float32", device="cpu")
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg))


def run(eng: LLMEngine, prompts, params: SamplingParams) -> list[list]:
    """Each request's prompt logprobs, checking they arrive once, on its first output."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, params)
    got: dict[str, list] = {}
    seen: set[str] = set()
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.prompt_logprobs is not None:
                assert out.request_id not in got, "prompt logprobs delivered twice"
                assert out.request_id not in seen, "prompt logprobs after the first output"
                got[out.request_id] = out.prompt_logprobs
            seen.add(out.request_id)
    return [got[rid] for rid in ids]


def check(entries, prompt, ref, k) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        e, row = entries[p], ref[p - 1]
        assert e.token_id == prompt[p]
        assert abs(e.logprob - row[prompt[p]].item()) < TOL, p
        ref_rank = int((row >= row[prompt[p]]).sum())
        assert abs(e.rank - ref_rank) <= max(1, ref_rank // 100), (p, e.rank, ref_rank)
        vals, ids = row.topk(k)
        assert len(e.top) == k
        for (t, v), rv, rt in zip(e.top, vals.tolist(), ids.tolist()):
            assert abs(v - rv) < TOL
            assert t == rt or abs(row[t].item() - rv) < TOL      # a near-tie may swap


def test_alone_and_chunked_match_transformers(prompts, reference):
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    for eng in (engine(), engine(max_num_batched_tokens=7)):
        for entries, p, ref in zip(run(eng, prompts, params), prompts, reference):
            check(entries, p, ref, 3)


def test_prefix_cache_is_not_read_for_them(prompts, reference):
    """A prompt already in the prefix cache is computed again for a request that asks for
    prompt logprobs (every position is needed); a request that does not ask still hits."""
    eng = engine()
    eng.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0))
    hits = eng.scheduler.counters.prefix_cache_hits
    entries = run(eng, [prompts[0]], SamplingParams(max_tokens=2, temperature=0,
                                                    prompt_logprobs=1))[0]
    assert eng.scheduler.counters.prefix_cache_hits == hits
    check(entries, prompts[0], reference[0], 1)
    eng.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0))
    assert eng.scheduler.counters.prefix_cache_hits > hits


@pytest.mark.extended
def test_recompute_preemption_delivers_them_once(prompts, reference):
    eng = engine(num_gpu_blocks_override=12, max_model_len=192, preemption_mode="recompute",
                 max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, prompt_logprobs=0)
    batch = [prompts[0], prompts[1], prompts[0], prompts[1]]
    got = run(eng, batch, params)
    assert eng.scheduler.counters.num_preemptions_recompute > 0
    for entries, p in zip(got, batch):
        check(entries, p, reference[prompts.index(p)], 0)


@pytest.mark.extended
def test_n_choices_and_whole_vocabulary(prompts, reference, model_dir):
    params = SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=0, prompt_logprobs=-1)
    entries = run(engine(), [prompts[2]], params)[0]
    vocab = reference[2].shape[1]
    assert len(entries) == len(prompts[2])
    for e in entries[1:]:
        assert len(e.top) == vocab
        values = [v for _, v in e.top]
        assert values == sorted(values, reverse=True)
        assert abs(math.log(sum(math.exp(v) for v in values))) < 1e-3
    one_token = run(engine(), [prompts[2][:1]], SamplingParams(max_tokens=1,
                                                              prompt_logprobs=2))[0]
    assert one_token == [None]


@pytest.mark.parametrize("bad", [-2, 21])
def test_out_of_range_is_refused(bad):
    with pytest.raises(ParamError) as e:
        SamplingParams(prompt_logprobs=bad)
    assert e.value.param == "prompt_logprobs"
