"""Batched sampler: one call turns `[N, vocab]` float32 logits into N token ids (+ logprobs).

Owns: the order of logits processing, which follows vLLM v1's sampler —
logit_bias and min_tokens masking → repetition / frequency / presence penalties → greedy argmax,
or temperature → min_p → top_k / top_p → sampling — and per-request randomness.

Structured outputs: rows with a grammar get its token mask first (`engine.structured.mask`), so
every later step — penalties, filters, sampling — only sees allowed tokens.

Sampling is inverse-CDF: one uniform draw per row, located in the row's cumulative
distribution with `searchsorted` (inverse transform sampling; Devroye, "Non-Uniform Random
Variate Generation", 1986, ch. III.2). Not `torch.multinomial`: for one sample it runs the
exponential race, a vocabulary-sized Exp(1) draw per row — measured 67 ms of a 188 ms bfloat16
decode step at batch 64 (vocab 49152), against ~3 ms for cumsum + searchsorted. Each seeded
request draws from its own generator seeded by (seed, choice index, output index), so its
tokens do not depend on what else is in the batch, nor on preemption. Unseeded requests share
the engine's generator (`--seed`). Only the rows that sample go through temperature /
filtering / softmax, and only greedy rows through argmax.

Logprobs (OpenAI semantics as served by vLLM): log-softmax of the model's raw logits, for the
sampled token and the top `k <= 20` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.structured.mask import apply_bitmask
from scheduler.request import SamplingParams

_MASK = float("-inf")


@dataclass
class SamplingRow:
    """One request's row: its parameters and the context the penalties look at."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    choice_index: int
    stop_ids_for_min_tokens: tuple[int, ...]   # EOS + stop_token_ids, masked until min_tokens
    matcher: object = None          # llguidance.LLMatcher of a structured-output request


@dataclass
class SampleResult:
    """`token_ids [N] int64`; `logprobs[i]` is None or (sampled logprob, [(token, logprob)...])."""

    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def _seed_for(seed: int, choice_index: int, output_index: int) -> int:
    return (seed * 1_000_003 + choice_index * 7_919 + output_index) & 0x7FFF_FFFF_FFFF_FFFF


class Sampler:
    """Stateless apart from the shared generator for unseeded requests and the device buffers
    the per-row parameters (temperature, min_p, top_k, top_p) are copied into each step
    (`_row_tensor`: allocated once per name, regrown only past the largest batch seen)."""

    def __init__(self, device: torch.device, seed: int = 0, kernels=None) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._rows: dict[str, torch.Tensor] = {}
        self._kernels = kernels   # engine.kernels.CpuKernels (its argmax), or None: torch's

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits.argmax(dim=-1)` as int64 `[N]`; on the CPU kernels' vectorized loop where
        they are loaded (8x torch's at 64 x 49,152 on an AMX Xeon; the same indices)."""
        if (self._kernels is not None and logits.device.type == "cpu"
                and logits.dtype == torch.float32 and logits.dim() == 2
                and logits.stride(1) == 1):
            return self._kernels.argmax(logits)
        return logits.argmax(dim=-1)

    def _row_tensor(self, name: str, values: list, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
        """`values` as a `[len(values)]` view of the persistent device buffer `name`."""
        buf = self._rows.get(name)
        if buf is None or buf.numel() < len(values) or buf.dtype != dtype:
            buf = self._rows[name] = torch.empty(max(256, len(values)), dtype=dtype,
                                                 device=device)
        return buf[:len(values)].copy_(torch.tensor(values, dtype=dtype), non_blocking=True)

    @staticmethod
    def plain_greedy(rows: list[SamplingRow]) -> bool:
        """Whether every row's token is the argmax of its raw logits: greedy, and nothing
        (grammar, logit_bias, allowed / bad words, min_tokens still unmet, penalties) changes
        a logit first. Then a forward pass may hand the argmax in (`__call__`'s `greedy`)."""
        for r in rows:
            p = r.params
            if (p.temperature != 0.0 or r.matcher is not None or p.logit_bias
                    or p.allowed_token_ids is not None or p.bad_words_token_ids
                    or (p.min_tokens and len(r.output_token_ids) < p.min_tokens)
                    or p.repetition_penalty != 1.0 or p.frequency_penalty
                    or p.presence_penalty):
                return False
        return True

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 grammar: tuple[list[int], torch.Tensor] | None = None,
                 greedy: list[int] | None = None) -> SampleResult:
        """Sample one token per row of `logits` `[N, vocab]` float32 (modified in place).
        `grammar` = (row indices, their bitmask `[R, ceil(vocab / 32)]` int32) masks the rows of
        structured-output requests; logprobs stay the model's own (before the mask). `greedy`:
        each row's argmax of `logits` as given, computed by the forward pass (only for rows
        that are all `plain_greedy`; the tokens then are those)."""
        want_logprobs = [r.params.logprobs for r in rows]
        raw_logprobs = (torch.log_softmax(logits, dim=-1)
                        if any(k is not None for k in want_logprobs) else None)
        if greedy is not None:
            return SampleResult(greedy, self._logprobs(raw_logprobs, greedy, want_logprobs))
        if grammar is not None:
            apply_bitmask(logits, *grammar)
        self._apply_bias_and_min_tokens(logits, rows)
        self._apply_penalties(logits, rows)

        random_rows = [i for i, r in enumerate(rows) if r.params.temperature != 0.0]
        if random_rows and len(random_rows) == len(rows):   # all sample: no [R, vocab] gather
            tokens = self._sample(logits, rows)
        else:
            tokens = self._argmax(logits)
            if random_rows:
                tokens[random_rows] = self._sample(logits[random_rows],
                                                   [rows[i] for i in random_rows])
        token_list = tokens.tolist()
        return SampleResult(token_list, self._logprobs(raw_logprobs, token_list, want_logprobs))

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, filters, softmax and one draw per row of `logits [R, vocab]` (scaled
        in place)."""
        temps = self._row_tensor("temperature", [r.params.temperature for r in rows],
                                 logits.dtype, logits.device)
        return self._draw(self._filtered_probs(logits.div_(temps[:, None]), rows), rows)

    def _draw(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """One token per row of `probs [R, vocab]` by inverse-CDF sampling: a uniform u per row
        (seeded rows from their own generator, the rest from the shared one), then the first
        token whose cumulative probability exceeds u × the row's total. A token of probability
        0 is never chosen (its cumulative value equals its predecessor's)."""
        uniforms = torch.empty(len(rows), 1, dtype=probs.dtype, device=probs.device)
        shared = [i for i, r in enumerate(rows) if r.params.seed is None]
        if shared:
            uniforms[shared] = torch.rand(len(shared), 1, generator=self.generator,
                                          dtype=probs.dtype, device=probs.device)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                g = torch.Generator(device=probs.device)
                g.manual_seed(_seed_for(r.params.seed, r.choice_index, len(r.output_token_ids)))
                uniforms[i] = torch.rand(1, generator=g, dtype=probs.dtype, device=probs.device)
        cdf = probs.cumsum(dim=-1)
        out = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True)[:, 0]
        overflow = (out >= probs.shape[1]).nonzero()[:, 0].tolist()
        for i in overflow:                  # u x total rounded up to total: last possible token
            out[i] = probs[i].nonzero()[-1, 0]
        return out

    @staticmethod
    def _apply_bias_and_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        vocab = logits.shape[1]
        for i, r in enumerate(rows):
            p = r.params
            if p.allowed_token_ids is not None:       # vLLM's allowed_token_ids: a mask
                allowed = list(p.allowed_token_ids)
                keep = logits[i, allowed]
                logits[i] = _MASK
                logits[i, allowed] = keep
            for word in p.bad_words_token_ids or ():   # vLLM's bad_words: a sequence's last
                out = r.output_token_ids                  # token, once the rest was generated
                if len(word) <= len(out) + 1 and list(word[:-1]) == out[len(out) - len(word) + 1:]:
                    logits[i, word[-1]] = _MASK
            if p.logit_bias:
                ids = [t for t in p.logit_bias if 0 <= t < vocab]
                logits[i, ids] += torch.tensor([p.logit_bias[t] for t in ids],
                                               dtype=logits.dtype, device=logits.device)
            if p.min_tokens and len(r.output_token_ids) < p.min_tokens:
                ids = [t for t in r.stop_ids_for_min_tokens if 0 <= t < vocab]
                if ids:
                    logits[i, ids] = _MASK

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Repetition penalty over prompt + output (CTRL, Keskar et al. 2019, as in HF);
        frequency / presence penalties over the output (OpenAI's definition)."""
        vocab = logits.shape[1]
        for i, r in enumerate(rows):
            p = r.params
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)),
                                    dtype=torch.long, device=logits.device)
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                              vals * p.repetition_penalty)
            if (p.frequency_penalty or p.presence_penalty) and r.output_token_ids:
                out = torch.tensor(r.output_token_ids, dtype=torch.long, device=logits.device)
                counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)

    def _filtered_probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """min_p, then top_k / top_p masking (vLLM's order), then softmax."""
        min_ps = [r.params.min_p for r in rows]
        if any(min_ps):
            probs = logits.softmax(dim=-1)
            min_p = self._row_tensor("min_p", min_ps, logits.dtype, logits.device)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
            logits = logits.masked_fill(probs < threshold, _MASK)
        top_ks = [r.params.top_k if r.params.top_k > 0 else logits.shape[1] for r in rows]
        top_ps = [r.params.top_p for r in rows]
        if any(k < logits.shape[1] for k in top_ks) or any(p < 1.0 for p in top_ps):
            sorted_logits, order = logits.sort(dim=-1, descending=False)
            vocab = logits.shape[1]
            k = self._row_tensor("top_k", top_ks, torch.long, logits.device)
            kth = sorted_logits.gather(1, (vocab - k).clamp(min=0)[:, None])
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _MASK)
            top_p = self._row_tensor("top_p", top_ps, logits.dtype, logits.device)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop = cum <= (1 - top_p)[:, None]
            drop[:, -1] = False                      # always keep the most likely token
            sorted_logits = sorted_logits.masked_fill(drop, _MASK)
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        return logits.softmax(dim=-1)

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, tokens: list[int],
                  want: list[int | None]) -> list[tuple[float, list[tuple[int, float]]] | None]:
        if raw is None:
            return [None] * len(tokens)
        out: list[tuple[float, list[tuple[int, float]]] | None] = []
        for i, k in enumerate(want):
            if k is None:
                out.append(None)
                continue
            top: list[tuple[int, float]] = []
            if k:
                vals, ids = raw[i].topk(k)
                top = list(zip(ids.tolist(), vals.tolist()))
            out.append((raw[i, tokens[i]].item(), top))
        return out
