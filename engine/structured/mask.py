"""Token masks from grammar matchers: fill a bitmask for the constrained rows, apply it to logits.

Owns: the bitmask layout (llguidance's: `[rows, ceil(vocab / 32)]` int32, bit `t % 32` of word
`t // 32` set when token `t` is allowed) and its application to `[N, vocab]` float32 logits,
only on the rows that carry a grammar.

In: matchers (`llguidance.LLMatcher`) positioned after the sequence's last token. Out: logits
with every disallowed token at -inf.
"""

from __future__ import annotations

import llguidance
import llguidance.numpy
import numpy as np
import torch

def fill_bitmask(matchers: list, vocab_size: int) -> torch.Tensor:
    """The allowed-token bitmask of each matcher: `[len(matchers), ceil(vocab_size / 32)]`
    int32, on the CPU. A matcher that has stopped allows only EOS (llguidance's rule). One row
    after the other on this thread: llguidance's parallel `LLExecutor` was no faster here and
    its worker threads compete with the forward pass for the cores. Through `llguidance.numpy`:
    `llguidance.torch` applies `torch.compile` when imported, which loads torch._dynamo (1 s of
    every start) and Triton where it is installed."""
    bitmask = llguidance.numpy.allocate_token_bitmask(len(matchers), vocab_size)
    for i, m in enumerate(matchers):
        llguidance.numpy.fill_next_token_bitmask(m, bitmask, i)
    return torch.from_numpy(bitmask)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set `logits[rows[i], t] = -inf` for every token `t` that `bitmask[i]` disallows
    (`logits` `[N, vocab]` float, modified in place; tokens beyond the mask's width are
    disallowed). The bits are unpacked with numpy (little-endian words, so byte order and bit
    order agree); llguidance's own `apply_token_bitmask_inplace` goes through `torch.compile`,
    which costs ~20 s on the first call on a CPU."""
    vocab = logits.shape[1]
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    disallowed = torch.from_numpy(bits[:, :vocab] == 0).to(logits.device)
    if disallowed.shape[1] < vocab:
        disallowed = torch.nn.functional.pad(disallowed, (0, vocab - disallowed.shape[1]),
                                             value=True)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(disallowed, float("-inf"))
        return
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(disallowed, float("-inf"))
