"""Every decoder layer in one C call (engine/kernels/layer_stack.c) against the per-op forward
pass it replaces: the same kernels in the same order, so every step's logits must be equal, bit
for bit, over decodes, a chunked prefill beside decodes, and batches of several requests."""

import random

import pytest
import torch

from engine import kernels
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from scheduler.request import SamplingParams

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="no C compiler: no CPU kernels")


def step_logits(eng: LLMEngine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Every step's logits of greedy runs of `prompts` (6 tokens each, all at once)."""
    seen: list[torch.Tensor] = []
    model = eng.model
    original = model.compute_logits

    def record(hidden, **kw):
        logits = original(hidden, **kw)
        seen.append(logits.clone())
        return logits

    model.compute_logits = record
    try:
        eng.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0))
    finally:
        model.compute_logits = original
    return seen


@pytest.mark.parametrize("dtype, activations", [("float32", "none"), ("bfloat16", "none"),
                                                ("float32", "int8")])
def test_stack_equals_the_per_op_forward(dtype, activations):
    eng = LLMEngine(EngineConfig(device="cpu", dtype=dtype, kv_cache_memory=0.25,
                                 max_model_len=256, enable_prefix_caching=False,
                                 max_num_batched_tokens=24,
                                 activation_quantization=activations))
    assert eng.model.stack is not None           # the embedded GGUF, served as its blocks
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 17, 40)]
    fast = step_logits(eng, prompts)
    stack, eng.model.stack = eng.model.stack, None
    slow = step_logits(eng, prompts)
    eng.model.stack = stack
    assert len(fast) == len(slow) > 6
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


def test_no_stack_where_the_loop_does_not_apply(tmp_path):
    """Dense float32 weights keep torch's ops (no fused kernels, so no stack)."""
    eng = LLMEngine(EngineConfig(device="cpu", dtype="float32", quantization="none",
                                 kv_cache_memory=0.1, max_model_len=128))
    assert eng.model.fused is None and eng.model.stack is None
