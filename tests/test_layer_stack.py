"""Every decoder layer in one C call (engine/kernels/layer_stack.c) against the per-op forward
pass it replaces: the same kernels in the same order, so every step's logits must be equal, bit
for bit, over decodes, a chunked prefill beside decodes, and batches of several requests — with
the LM head folded into the call (steps that sample every row) and as its own call."""

import random

import pytest
import torch

from engine import kernels
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from scheduler.request import SamplingParams

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="no C compiler: no CPU kernels")


def step_logits(eng: LLMEngine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Every step's logits, as the sampler receives them, of greedy runs of `prompts` (6
    tokens each, all at once)."""
    seen: list[torch.Tensor] = []
    runner = eng.runner
    original = runner.sampler

    def record(logits, *args):
        seen.append(logits.clone())
        return original(logits, *args)

    runner.sampler = record
    try:
        eng.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0))
    finally:
        runner.sampler = original
    return seen


@pytest.mark.parametrize("dtype, activations", [("float32", "none"), ("bfloat16", "none"),
                                                ("float32", "int8")])
def test_stack_equals_the_per_op_forward(dtype, activations):
    eng = LLMEngine(EngineConfig(device="cpu", dtype=dtype, kv_cache_memory=0.25,
                                 max_model_len=256, enable_prefix_caching=False,
                                 max_num_batched_tokens=24,
                                 activation_quantization=activations))
    stack = eng.model.stack
    assert stack is not None and stack.has_head   # the embedded GGUF, served as its blocks
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 17, 40)]
    folded = step_logits(eng, prompts)
    stack.has_head = False                        # the LM head as its own call
    separate = step_logits(eng, prompts)
    eng.model.stack = None                        # every op from Python
    slow = step_logits(eng, prompts)
    eng.model.stack, stack.has_head = stack, True
    assert len(folded) == len(separate) == len(slow) > 6
    for a, b, c in zip(folded, separate, slow):
        assert torch.equal(a, b) and torch.equal(b, c)


def test_logits_asked_of_a_stack_without_the_head_are_refused():
    """The C call refuses a logits buffer when its struct has no LM head (error -4), rather
    than writing through a null weight: the step's request fails with that error alone and
    the engine serves the next one."""
    eng = LLMEngine(EngineConfig(device="cpu", dtype="bfloat16", kv_cache_memory=0.1,
                                 max_model_len=128))
    stack = eng.model.stack
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    head, stack._head = stack._head, type(stack._head)()     # a struct without the head
    stack._stack = None                                      # rebound at the next call
    try:
        eng.add_request("broken", [100, 200, 300], params)
        errors = []
        while eng.has_unfinished_requests():
            errors += [out.error for out in eng.step() if out.error]
    finally:
        stack._head, stack._stack = head, None
    assert len(errors) == 1 and "logits without the LM head" in errors[0]
    assert len(eng.generate([[100, 200, 300]], params)[0][0]) == 3
