"""Token masks from grammar matchers: fill a bitmask for the constrained rows, apply it to logits.

Owns: the bitmask layout (llguidance's: `[rows, ceil(vocab / 32)]` int32, bit `t % 32` of word
`t // 32` set when token `t` is allowed) and its application to `[N, vocab]` float32 logits,
only on the rows that carry a grammar. Filling runs on llguidance's own thread pool
(`LLExecutor`), which computes the rows in parallel outside the GIL.

In: matchers (`llguidance.LLMatcher`) positioned after the sequence's last token. Out: logits
with every disallowed token at -inf.
"""

from __future__ import annotations

import llguidance
import llguidance.torch
import torch

_BITS = torch.arange(32, dtype=torch.int32)
_executor: llguidance.LLExecutor | None = None


def fill_bitmask(matchers: list, vocab_size: int) -> torch.Tensor:
    """The allowed-token bitmask of each matcher: `[len(matchers), ceil(vocab_size / 32)]`
    int32, on the CPU. A matcher that has stopped allows only EOS (llguidance's rule)."""
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    bitmask = llguidance.torch.allocate_token_bitmask(len(matchers), vocab_size)
    llguidance.torch.fill_next_token_bitmask_par(
        _executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
    return bitmask


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set `logits[rows[i], t] = -inf` for every token `t` that `bitmask[i]` disallows
    (`logits` `[N, vocab]` float, modified in place; tokens beyond the mask's width are
    disallowed). Eager torch: llguidance's own `apply_token_bitmask_inplace` goes through
    `torch.compile`, which costs ~20 s on the first call on a CPU."""
    vocab = logits.shape[1]
    allowed = ((bitmask.to(logits.device)[:, :, None] >> _BITS.to(logits.device)) & 1).bool()
    allowed = allowed.view(len(rows), -1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed[:, :vocab], float("-inf"))
