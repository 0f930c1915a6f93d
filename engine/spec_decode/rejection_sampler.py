"""Verification of speculative drafts: which drafts a request keeps, and the token after them.

Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling", Algorithm 2; vLLM's `vllm/v1/sample/rejection_sampler.py` for the batched
form). With target distributions p_0..p_k at the k + 1 verified positions (after temperature,
top-k / top-p / min-p, penalties and logit_bias, exactly as without speculation) and drafts
x_1..x_k drawn from q_1..q_k:
- draft j is accepted with probability min(1, p_j(x_j) / q_j(x_j)), in order, until the first
  rejection; at the first rejected position the emitted token is drawn from
  norm(max(p_j - q_j, 0)); if every draft is accepted a bonus token is drawn from p_k.
  Every emitted token is then distributed exactly as p (Leviathan et al., Theorem 3.5 / App. A.1).
  `rejection_sample` is this rule, batched over requests.
- q one-hot (n-gram drafts, greedy drafts): min(1, p(x) / 1) = p(x), and norm(max(p - q, 0)) is
  p with x removed, renormalised. `accepted_prefix` realises the same law by coupling: the runner
  draws y_j ~ p_j exactly as non-speculative sampling would (same seeded uniform for the same
  output position), and draft j is accepted iff y_j == x_j. P(accept) = p_j(x_j), and on rejection
  y_j ~ p_j(. | y != x_j) = norm(max(p_j - q_j, 0)): the rule above. Because the emitted tokens
  are the draws non-speculative decoding makes, greedy and seeded outputs are identical with and
  without speculation, whatever k the scheduler picks. Greedy (temperature 0) is the case where
  y_j is the argmax: emit the target's argmax up to and including the first mismatch, plus the
  bonus when all drafts match.
"""

from __future__ import annotations

import torch


def accepted_prefix(draft_ids: list[int], target_ids: list[int]) -> list[int]:
    """Tokens to emit for one request under the coupled one-hot rule (module docstring).

    draft_ids: the k drafts; target_ids: the k + 1 tokens drawn from the target at the verified
    positions. Returns target_ids up to and including the first position whose draft differs
    (1 to k + 1 tokens). Raises ValueError if the lengths do not differ by one.
    """
    if len(target_ids) != len(draft_ids) + 1:
        raise ValueError(f"{len(draft_ids)} drafts need {len(draft_ids) + 1} target tokens, "
                         f"got {len(target_ids)}")
    for j, draft in enumerate(draft_ids):
        if target_ids[j] != draft:
            return target_ids[:j + 1]
    return list(target_ids)


def rejection_sample(target_probs: torch.Tensor, draft_ids: torch.Tensor,
                     draft_probs: torch.Tensor, num_drafts: torch.Tensor,
                     generator: torch.Generator | None = None) -> list[list[int]]:
    """Leviathan et al.'s rule, batched over B requests padded to K drafts.

    target_probs: [B, K + 1, V] float, p at each verified position (rows past a request's own
        k + 1 are ignored); draft_ids: [B, K] int64 (padding ignored); draft_probs: [B, K, V]
        float, q that each draft was drawn from; num_drafts: [B] int64, each request's k <= K.
    Returns per request the emitted tokens: its accepted drafts then one token drawn from the
    residual norm(max(p - q, 0)) at the first rejection, or from p_k when all were accepted.
    Raises ValueError on inconsistent shapes.
    """
    b, k_plus_1, vocab = target_probs.shape
    k = k_plus_1 - 1
    if draft_ids.shape != (b, k) or draft_probs.shape != (b, k, vocab) or num_drafts.shape != (b,):
        raise ValueError(f"shapes do not match: p {tuple(target_probs.shape)}, drafts "
                         f"{tuple(draft_ids.shape)}, q {tuple(draft_probs.shape)}, "
                         f"num_drafts {tuple(num_drafts.shape)}")
    device = target_probs.device
    valid = torch.arange(k, device=device)[None, :] < num_drafts[:, None]
    ids = draft_ids.clamp(0, vocab - 1)[..., None]
    p_x = target_probs[:, :k].gather(2, ids)[..., 0]
    q_x = draft_probs.gather(2, ids)[..., 0]
    u = torch.rand(b, k, generator=generator, device=device, dtype=target_probs.dtype)
    accept = (u * q_x < p_x) & valid                     # u < p / q without dividing by q = 0
    rejected = (~accept) & valid
    first = torch.where(rejected.any(1), rejected.int().argmax(1), num_drafts)   # [B]
    rows = torch.arange(b, device=device)
    p_at = target_probs[rows, first]                                              # [B, V]
    q_at = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], 1)[rows, first]
    residual = (p_at - q_at).clamp_(min=0)
    empty = residual.sum(1) <= 0                         # p == q up to rounding: use p itself
    residual[empty] = p_at[empty]
    cdf = residual.cumsum(1)
    v = torch.rand(b, 1, generator=generator, device=device, dtype=cdf.dtype)
    last = torch.searchsorted(cdf, v * cdf[:, -1:], right=True)[:, 0]
    for i in (last >= vocab).nonzero()[:, 0].tolist():    # v x total rounded up to total
        last[i] = residual[i].nonzero()[-1, 0]
    out = []
    for i, (n, tok) in enumerate(zip(first.tolist(), last.tolist())):
        out.append(draft_ids[i, :n].tolist() + [tok])
    return out
