"""Greedy references checked in teacher-forced passes instead of generated token by token.

transformers' float32 `generate` costs ~100 ms a token on a 2-core host; one forward pass over
prompt + candidate tokens gives every position's logits at once. Where the argmax at each
position is the candidate's next token, and the candidate ends as `generate` would end it, the
candidate is the model's greedy continuation (up to the order of float32 sums, which can turn
only a near tie). In: a transformers (or peft) causal LM and token-id lists; out: argmax lists
and the end-of-sequence ids. Used by test_engine_correctness, test_lora and test_quant."""

from __future__ import annotations

import torch


def eos_ids(model) -> set[int]:
    """The end-of-sequence token ids of `model`'s generation config (an int or a list there)."""
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def ends_as_generate_would(tokens: list[int], max_tokens: int, eos: set[int]) -> bool:
    """Whether `tokens` stops where greedy decoding may stop: at `max_tokens` tokens, or at an
    end-of-sequence id in `eos` as its last token."""
    return len(tokens) == max_tokens or tokens[-1] in eos


def teacher_forced_argmax(model, prompts: list[list[int]],
                          continuations: list[list[int]]) -> list[list[int]]:
    """For each prompt and its continuation (n >= 1 tokens), the model's argmax at the n
    positions that predict the continuation's tokens, from one forward pass over every
    prompt + continuation[:-1], right-padded with id 0 (positions stay 0..len-1, and causal
    attention never reads the padding behind a row's own tokens)."""
    rows = [p + c[:-1] for p, c in zip(prompts, continuations)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    with torch.inference_mode():
        argmax = model(ids, attention_mask=mask).logits.argmax(-1)
    return [row[len(p) - 1:len(p) - 1 + len(c)].tolist()
            for row, p, c in zip(argmax, prompts, continuations)]
