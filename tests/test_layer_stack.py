"""Every decoder layer in one C call (engine/kernels/layer_stack.c) against the per-op forward
pass it replaces: the same kernels in the same order, so every step's logits must be equal, bit
for bit, over decodes, a chunked prefill beside decodes, and batches of several requests — with
the LM head folded into the call (steps that sample every row) and as its own call, and the
greedy tokens the call hands the sampler equal to its own argmax."""

import random
from types import SimpleNamespace

import pytest
import torch

from engine import kernels
from engine.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.cpu_step import DecodeInputs
from engine.llm_engine import LLMEngine
from scheduler.request import SamplingParams

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="no C compiler: no CPU kernels")


def step_logits(eng: LLMEngine, prompts: list[list[int]], handed: list | None = None
                ) -> list[torch.Tensor]:
    """Every step's logits, as the sampler receives them, of greedy runs of `prompts` (6
    tokens each, all at once). `handed` collects, per step, the tokens the sampler returned
    and the argmax the forward pass handed it (None where it handed none)."""
    seen: list[torch.Tensor] = []
    runner = eng.runner
    original = runner.sampler

    def record(logits, *args, **kwargs):
        seen.append(logits.clone())
        result = original(logits, *args, **kwargs)
        if handed is not None:
            handed.append((result.token_ids, kwargs.get("greedy")))
        return result

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
    folded_tokens, separate_tokens = [], []
    folded = step_logits(eng, prompts, folded_tokens)
    stack.has_head = False                        # the LM head as its own call
    separate = step_logits(eng, prompts, separate_tokens)
    stack.embeds = False                          # the ids looked up in Python
    looked_up = step_logits(eng, prompts)
    eng.model.stack = None                        # every op from Python
    slow = step_logits(eng, prompts)
    eng.model.stack, stack.has_head, stack.embeds = stack, True, True
    assert len(folded) == len(separate) == len(looked_up) == len(slow) > 6
    for a, b, c, d in zip(folded, separate, looked_up, slow):
        assert torch.equal(a, b) and torch.equal(b, c) and torch.equal(c, d)
    # Decode steps took their greedy tokens from the layers' call: the same as the sampler's
    # own argmax over the same logits, and as every token of the separate run.
    handed = [(tokens, greedy) for tokens, greedy in folded_tokens if greedy is not None]
    assert len(handed) >= 5
    for (tokens, greedy), logits in zip(folded_tokens, folded):
        assert tokens == logits.argmax(dim=-1).tolist()
    assert [t for t, _ in folded_tokens] == [t for t, _ in separate_tokens]
    assert all(greedy is None for _, greedy in separate_tokens)


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


def test_a_token_id_outside_the_embedding_table_is_refused_by_the_call():
    """The call looks the ids up itself: an id past the table raises IndexError (error -5)
    before any layer runs, and the engine serves the next request."""
    eng = LLMEngine(EngineConfig(device="cpu", dtype="bfloat16", kv_cache_memory=0.1,
                                 max_model_len=128))
    stack, runner = eng.model.stack, eng.runner
    assert stack.embeds
    step = SimpleNamespace(start_position=0, token_ids=[eng.model.cfg.vocab_size + 3],
                           sample=True)
    ids, positions, slots, tables, ctx_lens, _ = DecodeInputs(1, 8).fill(
        [step], [SimpleNamespace(block_table=[0], table_edits=0)], runner.block_size)
    meta = AttentionMetadata(slot_mapping=slots, kernels=runner.kernels,
                             kernel_block_tables=tables, kernel_ctx_lens=ctx_lens)
    with pytest.raises(IndexError, match="outside the vocabulary"):
        stack.run(ids, positions, meta, runner.kv_cache)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    assert len(eng.generate([[100, 200, 300]], params)[0][0]) == 3
