"""Output processor: token ids → text deltas, stop strings, `RequestOutput`s — the front end's
half of the engine (vLLM v1's `OutputProcessor`): it runs in the process that serves the
protocol, never in the engine core's.

Owns: per request and per choice, the incremental detokenizer (`tokenizers.decoders.DecodeStream`,
primed with the prompt's tail; it returns nothing until a UTF-8 sequence is complete, so no broken
character is ever emitted), the text held back while it could be the start of a stop string,
the request's timing metrics, and its prompt logprobs until its first output carries them.

A step may bring several tokens (accepted speculative drafts); with stop strings they are
decoded one at a time and those after the token that completes a stop string are dropped, so
output and usage end where they would without speculation.

In: the core's `EngineCoreOutputs` (`RequestStepOutput`s, one with `error` set: the request
failed, its grammar did not compile or its step raised; prompt logprobs; first-scheduled times;
the step's stats). Out: `RequestOutput` deltas, the step's stats completed with the generated
tokens and the finished requests, and the ids of sequences a stop string ended (the front end
tells the core to finish them: `EngineCore.finish_sequences`).
Not thread-safe: a caller that shares it between threads holds a lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream

from engine.outputs import (CompletionOutput, EngineCoreOutputs, PromptLogprob, RequestMetrics,
                            RequestOutput, TokenLogprob)
from scheduler.output import RequestStepOutput
from scheduler.request import SamplingParams

PRIME_TOKENS = 6    # prompt tokens fed to the detokenizer first, for correct leading spaces


@dataclass
class _Choice:
    stream: DecodeStream
    held: str = ""                  # text not yet emitted (possible stop-string prefix)
    num_tokens: int = 0
    finished: bool = False


@dataclass
class _RequestState:
    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    choices: dict[int, _Choice] = field(default_factory=dict)
    prompt_logprobs: list | None = None   # [None, PromptLogprob...] while being scored
    sent_prompt_logprobs: bool = False
    num_cached_tokens: int = 0            # prompt tokens read from the prefix cache

    @property
    def finished(self) -> bool:
        """Whether this choice has ended."""
        return (len(self.choices) == self.params.n
                and all(c.finished for c in self.choices.values()))


def _held_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class OutputProcessor:
    """Detokenizes and applies stop strings; see the module docstring."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._backend = tokenizer._tokenizer if hasattr(tokenizer, "_tokenizer") else tokenizer
        self.requests: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float) -> None:
        """Track a new request; `arrival_time` in seconds (`time.monotonic()`)."""
        self.requests[request_id] = _RequestState(request_id, params, prompt_token_ids,
                                                  RequestMetrics(arrival_time,
                                                                 lora_name=params.lora_name))

    def add_prompt_logprobs(self, scored: dict[str, tuple[int, list[PromptLogprob]]]) -> None:
        """Keep a step's prompt logprobs (`ModelRunnerOutput.prompt_logprobs`) until the
        request's first output carries them. Entries arrive in prompt order, chunk by chunk;
        a prompt scored again (recomputed after preemption) or after delivery is ignored."""
        for rid, (first, entries) in scored.items():
            state = self.requests.get(rid)
            if state is None or state.sent_prompt_logprobs:
                continue
            if state.prompt_logprobs is None:
                state.prompt_logprobs = [None]
            have = len(state.prompt_logprobs)
            if first <= have:
                state.prompt_logprobs += entries[have - first:]

    def remove(self, request_id: str) -> None:
        """Forget a request (aborted); unknown ids are ignored."""
        self.requests.pop(request_id, None)

    def _choice(self, state: _RequestState, index: int) -> _Choice:
        choice = state.choices.get(index)
        if choice is None:
            choice = _Choice(DecodeStream(ids=state.prompt_token_ids[-PRIME_TOKENS:],
                                          skip_special_tokens=state.params.skip_special_tokens))
            state.choices[index] = choice
        return choice

    def process_step(self, core: EngineCoreOutputs) -> tuple[list[RequestOutput], list[str]]:
        """One core step's outputs: (the `RequestOutput` deltas, sequence ids ended by a stop
        string). Fills `core.stats`' generated tokens and finished requests, when it has stats."""
        for rid, when, cached in core.scheduled:
            state = self.requests.get(rid)
            if state is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = when
                state.num_cached_tokens = cached
        if core.prompt_logprobs:
            self.add_prompt_logprobs(core.prompt_logprobs)
        outputs, stopped = self.process(core.outputs)
        stats = core.stats
        if stats is not None:
            stats.num_generation_tokens = sum(len(c.token_ids) for o in outputs
                                              for c in o.outputs)
            stats.finished = [(o.outputs[-1].finish_reason, o.metrics, o.num_prompt_tokens,
                               sum(c.num_output_tokens for c in o.outputs))
                              for o in outputs if o.finished]
        return outputs, stopped

    def process(self, updates: list[RequestStepOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns (outputs, sequence ids ended by a stop string). The final outputs of requests
        that failed before they ran (`error`) come first, as `finish` makes them."""
        now = time.monotonic()
        by_request: dict[str, list[CompletionOutput]] = {}
        stopped: list[str] = []
        failed: list[RequestOutput] = []
        for u in updates:
            if u.error is not None:
                failed += self.finish([u.request_id], "error", u.error)
                continue
            rid = u.parent_id or u.request_id
            state = self.requests.get(rid)
            if state is None:
                continue
            m = state.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            out = self._process_choice(state, u)
            if isinstance(out.stop_reason, str) and not u.finished:   # a stop string hit
                stopped.append(u.request_id)
            by_request.setdefault(rid, []).append(out)
        results = failed
        for rid, outs in by_request.items():
            state = self.requests[rid]
            finished = state.finished
            if finished:
                state.metrics.finished_time = now
                del self.requests[rid]
            result = RequestOutput(rid, outs, len(state.prompt_token_ids), finished,
                                   state.metrics, num_cached_tokens=state.num_cached_tokens)
            if state.params.prompt_logprobs is not None and not state.sent_prompt_logprobs:
                result.prompt_logprobs = state.prompt_logprobs or [None]
                state.sent_prompt_logprobs, state.prompt_logprobs = True, None
            results.append(result)
        return results, stopped

    def _process_choice(self, state: _RequestState, u: RequestStepOutput) -> CompletionOutput:
        choice = self._choice(state, u.index)
        params = state.params
        tokens = list(u.new_token_ids)
        text = choice.held
        if params.stop and len(tokens) > 1:     # speculative tokens: none past a stop string
            for n, t in enumerate(tokens, 1):
                text += choice.stream.step(self._backend, t) or ""
                if any(stop in text for stop in params.stop):
                    tokens = tokens[:n]
                    break
        else:
            text += "".join(p for p in (choice.stream.step(self._backend, t) for t in tokens)
                            if p)
        choice.num_tokens += len(tokens)
        finish_reason = u.status.finish_reason
        stop_reason = u.stop_reason
        if params.stop:
            hit = min(((text.find(s), s) for s in params.stop if s in text), default=None)
            if hit is not None:
                idx, stop = hit
                text = text[:idx + len(stop)] if params.include_stop_str_in_output else text[:idx]
                finish_reason, stop_reason = "stop", stop
                choice.held = ""
            elif finish_reason is None:
                keep = _held_suffix(text, params.stop)
                if keep:
                    text, choice.held = text[:-keep], text[-keep:]
                else:
                    choice.held = ""
        choice.finished = finish_reason is not None
        logprobs = None
        if params.logprobs is not None and u.logprobs:
            logprobs = [TokenLogprob(t, lp, top) for t, lp, top in u.logprobs[:len(tokens)]]
        return CompletionOutput(u.index, text, tokens, choice.num_tokens,
                                finish_reason, stop_reason, logprobs)

    def finish(self, request_ids: list[str], finish_reason: str,
               error: str | None = None) -> list[RequestOutput]:
        """Final outputs for requests the engine ends itself: every choice not yet finished gets
        `finish_reason` ("abort": the server aborted it; "error": it failed alone, `error` says
        why) and no new text. Unknown ids are skipped; the requests are forgotten."""
        now = time.monotonic()
        outputs = []
        for rid in dict.fromkeys(request_ids):
            state = self.requests.pop(rid, None)
            if state is None:
                continue
            state.metrics.finished_time = now
            outs = [CompletionOutput(i, "", [], choice.num_tokens, finish_reason)
                    for i in range(state.params.n)
                    if not (choice := self._choice(state, i)).finished]
            outputs.append(RequestOutput(rid, outs, len(state.prompt_token_ids), True,
                                         state.metrics, error=error,
                                         num_cached_tokens=state.num_cached_tokens))
        return outputs
