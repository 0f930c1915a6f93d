"""Beam search on the OpenAI server (`use_beam_search`), as vLLM's server runs it: outside the
engine, one engine request per beam and step.

Algorithm (vLLM's `BeamSearchOnlineMixin.beam_search`, itself after transformers' beam
scorer): each step asks the engine for one token of every live beam with `2 x width` logprobs;
every listed token (the sampled one and the top alternatives) extends its beam as a candidate
scored by the cumulative logprob; an EOS candidate ends a beam (unless `ignore_eos`); the
`width` best other candidates go on. After `max_tokens` steps the ended and live beams are
ranked by cumulative logprob / length^length_penalty and the best `width` are the choices.
Each step re-reads the beams' shared prompt from the prefix cache, so a step costs about one
decode per beam.

In: the server's engine client (`generate`), the prompt's token ids and `BeamParams`. Out: one
final `RequestOutput` (a choice per beam, finish_reason "stop" for a beam that ended at EOS,
"length" otherwise). Errors: whatever the engine raises for a step's request (the step's other
requests are aborted).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from scheduler.request import SamplingParams


@dataclass
class BeamParams:
    """A beam search request: `width` beams (the request's n), `max_tokens` steps (tokens),
    `temperature` of each step's draw (the drawn token is one more candidate), vLLM's
    `length_penalty` exponent, and the output options beam search keeps."""

    width: int
    max_tokens: int
    temperature: float = 1.0
    length_penalty: float = 1.0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None


@dataclass
class _Beam:
    tokens: list[int]                          # prompt + generated
    cum_logprob: float = 0.0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False


def score(beam: _Beam, eos_token_id: int, length_penalty: float) -> float:
    """Cumulative logprob / length^length_penalty, an EOS at the end not counted (vLLM's
    `get_beam_search_score`)."""
    n = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] == eos_token_id else 0)
    return beam.cum_logprob / (max(n, 1) ** length_penalty)


async def _last_output(llm, request_id: str, prompt: list[int], params: SamplingParams,
                       priority: int) -> RequestOutput:
    stream = llm.generate(request_id, prompt, params, priority)
    last = None
    try:
        async for out in stream:
            last = out
    finally:
        await stream.aclose()
    return last


async def _step(llm, request_id: str, beams: list[_Beam], params: SamplingParams,
                priority: int) -> list[RequestOutput]:
    """One token of every beam, concurrently; the others are aborted if one fails."""
    tasks = [asyncio.create_task(_last_output(llm, f"{request_id}-beam-{i}", b.tokens, params,
                                              priority)) for i, b in enumerate(beams)]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def beam_search(llm, beam: BeamParams, tokenizer, eos_token_id: int, request_id: str,
                      prompt: list[int], priority: int = 0) -> AsyncIterator[RequestOutput]:
    """Yield the one final `RequestOutput` of a beam search over `prompt` (module docstring)."""
    metrics = RequestMetrics(time.monotonic())
    step_params = SamplingParams(max_tokens=1, temperature=beam.temperature,
                                 logprobs=2 * beam.width)
    live, done = [_Beam(list(prompt))], []
    for step in range(beam.max_tokens):
        outputs = await _step(llm, f"{request_id}-{step}", live, step_params, priority)
        candidates = []
        for b, out in zip(live, outputs):
            lp = out.outputs[0].logprobs[0]
            alternatives = {lp.token_id: lp.logprob}
            for t, v in lp.top:
                alternatives.setdefault(t, v)
            for token, value in alternatives.items():
                chosen = TokenLogprob(token, value, lp.top)
                if token == eos_token_id and not beam.ignore_eos:
                    tokens = b.tokens + [token] if beam.include_stop_str_in_output else b.tokens
                    done.append(_Beam(tokens, b.cum_logprob + value,
                                      b.logprobs + [chosen], finished=True))
                else:
                    candidates.append(_Beam(b.tokens + [token], b.cum_logprob + value,
                                            b.logprobs + [chosen]))
        live = sorted(candidates, key=lambda c: -c.cum_logprob)[:beam.width]
        if not live:
            break
    best = sorted(done + live, key=lambda b: score(b, eos_token_id, beam.length_penalty),
                  reverse=True)[:beam.width]
    metrics.finished_time = time.monotonic()
    yield RequestOutput(request_id, [_choice(i, b, len(prompt), beam, tokenizer, eos_token_id)
                                     for i, b in enumerate(best)],
                        len(prompt), True, metrics)


def _choice(index: int, b: _Beam, num_prompt: int, beam: BeamParams, tokenizer,
            eos_token_id: int) -> CompletionOutput:
    """A beam as a choice: its text without a final EOS, its token ids, logprobs if asked."""
    ids = b.tokens[num_prompt:]
    text_ids = ids[:-1] if ids and ids[-1] == eos_token_id and not beam.ignore_eos else ids
    text = tokenizer.decode(text_ids, skip_special_tokens=beam.skip_special_tokens)
    return CompletionOutput(index, text, ids, len(ids), "stop" if b.finished else "length",
                            eos_token_id if b.finished else None,
                            b.logprobs[:len(ids)] if beam.logprobs is not None else None)
