"""Prompt logprobs: the log-probability of each prompt token given the ones before it, scored
from the hidden states of the step that computes its prefill chunk (vLLM's `prompt_logprobs`).

Owns the arithmetic only. In: the model, the step's hidden states `[T, hidden]`, and per
request that asked (`SamplingParams.prompt_logprobs`) the rows of its chunk whose next token is
still a prompt token. Out: per request (index of the first prompt token scored, a
`PromptLogprob` per scored token).

Row p of a chunk predicts token p + 1, so the first prompt token is never scored and the last
prompt position (it predicts the first output token) is not a prompt logprob. A chunked prompt
is scored chunk by chunk; the scheduler never reads the prefix cache for such a request (every
position's hidden state is needed, as in vLLM), and a request recomputed after preemption is
scored again (the output processor keeps the first delivery).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import PromptLogprob

ROWS_PER_SLICE = 128          # logits rows at once: 128 x vocab x 4 bytes (25 MB at 49k vocab)


@dataclass(slots=True)
class ScoredChunk:
    """One request's scored rows in a step: hidden rows [offset, offset + len(targets)) predict
    `targets` (token ids), prompt tokens from index `first` on; `k` top alternatives per token
    (-1: the whole vocabulary)."""

    request_id: str
    offset: int
    first: int
    targets: list[int]
    k: int


def score(model, hidden: torch.Tensor, chunks: list[ScoredChunk]
          ) -> dict[str, tuple[int, list[PromptLogprob]]]:
    """Score each chunk's rows: float32 log-softmax of the model's logits (`compute_logits`,
    which every tensor-parallel rank runs alike). Rank = the number of tokens at least as
    likely as the prompt token (vLLM's count); top alternatives most likely first."""
    out = {}
    for c in chunks:
        entries: list[PromptLogprob] = []
        for a in range(0, len(c.targets), ROWS_PER_SLICE):
            targets = c.targets[a:a + ROWS_PER_SLICE]
            rows = hidden[c.offset + a:c.offset + a + len(targets)]
            lp = torch.log_softmax(model.compute_logits(rows), dim=-1)
            tgt = torch.tensor(targets, dtype=torch.long, device=lp.device)[:, None]
            tok_lp = lp.gather(1, tgt)
            ranks = (lp >= tok_lp).sum(dim=1).tolist()
            k = lp.shape[1] if c.k == -1 else c.k
            top_vals, top_ids = (lp.topk(k, dim=1) if k else (lp[:, :0], tgt[:, :0]))
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            for j, (t, v) in enumerate(zip(targets, tok_lp[:, 0].tolist())):
                entries.append(PromptLogprob(t, v, ranks[j], list(zip(top_ids[j], top_vals[j]))))
        out[c.request_id] = (c.first, entries)
    return out


def chunks_to_score(ordered, states, num_decodes: int) -> list[ScoredChunk]:
    """The `ScoredChunk` of each prefill chunk in the step (`ordered` scheduled requests, decodes
    first, with their runner `states`) whose request asked for prompt logprobs and whose rows
    still predict prompt tokens."""
    chunks = []
    offset = num_decodes
    for s, st in zip(ordered[num_decodes:], states[num_decodes:]):
        n = len(s.token_ids)
        k = st.row.params.prompt_logprobs
        prompt = st.row.prompt_token_ids
        m = min(n, len(prompt) - 1 - s.start_position)
        if k is not None and m > 0:
            start = s.start_position
            chunks.append(ScoredChunk(s.request_id, offset, start + 1,
                                      prompt[start + 1:start + 1 + m], k))
        offset += n
    return chunks
