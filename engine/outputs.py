"""What the engine hands back per step: the core's token-level `EngineCoreOutputs`, the front
end's `RequestOutput` deltas made from them, and the per-step statistics.

`RequestOutput` is a delta: the text and token ids that each choice gained in this step (a
consumer joins them); the prompt's logprobs, when asked, ride on the first. `finished` is True
on the last output of a request, when every choice has a `finish_reason` ("stop", "length",
"abort", "error"). `StepStats`, `EngineCoreOutputs` (and `scheduler.output.RequestStepOutput`)
cross the engine core's pipe each step, pickled positionally (`positional_pickle`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


def positional_pickle(cls):
    """Class decorator for a dataclass that crosses the engine's pipe each step: pickle it as
    its constructor and its fields in order, not as the default empty instance and a dict of
    field names (a decode step's `EngineCoreOutputs` then reads back in ~0.6x the time, in
    ~1/3 of the bytes; the API process reads one a token, docs/architecture.md step 7)."""
    names = tuple(f.name for f in fields(cls))

    def __reduce__(self):
        return cls, tuple(getattr(self, n) for n in names)

    cls.__reduce__ = __reduce__
    return cls


@dataclass
class TokenLogprob:
    """Logprob of one generated token and the top alternatives (raw model distribution)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class PromptLogprob:
    """Logprob of one prompt token given the tokens before it (raw model distribution, float32
    log-softmax), its rank (1 = the most likely; ties share the better rank, as vLLM counts),
    and the `top` alternatives, most likely first (ranks 1, 2, ...)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class CompletionOutput:
    """One choice's delta. `num_output_tokens` is the choice's total so far (for usage)."""

    index: int
    text: str
    token_ids: list[int]
    num_output_tokens: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestMetrics:
    """Timestamps in seconds (`time.monotonic()`), for TTFT / ITL / queue-time metrics, and
    the LoRA adapter the request ran with (None: the base model), for per-adapter counters."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    lora_name: str | None = None


@dataclass
class RequestOutput:
    """A step's news for one request (all its choices)."""

    request_id: str
    outputs: list[CompletionOutput]
    num_prompt_tokens: int
    finished: bool
    metrics: RequestMetrics
    error: str | None = None           # set with finish_reason "error"
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # precedes it); on the request's first output only.
    prompt_logprobs: list[PromptLogprob | None] | None = None
    # Prompt tokens the prefix cache gave (computed before the request's first step; 0 until
    # it is first scheduled), as vLLM's `RequestOutput.num_cached_tokens`.
    num_cached_tokens: int = 0


@positional_pickle
@dataclass
class StepStats:
    """One engine step, for the metrics layer. Times in seconds. Scheduler gauges (running,
    waiting, swapped, KV usage) and cumulative counters are read from the scheduler itself
    (`engine.core_proc.engine_snapshot`), also between steps. With several front-end
    processes (`--api-server-count`) one of them gets the engine-wide fields; the others get
    `engine_wide` False (zeros there) and fill only their own requests' fields."""

    batch_size: int                    # requests scheduled
    num_tokens: int                    # tokens computed (prefill + decode)
    num_prefill_tokens: int
    step_time: float                   # the core's schedule + execute + update
    scheduler_time: float              # schedule + update_from_output
    # Filled by the front end's OutputProcessor (it alone sees stop strings):
    num_generation_tokens: int = 0
    finished: list[tuple[str, RequestMetrics, int, int]] = field(default_factory=list)
    # (finish_reason, metrics, prompt tokens, generation tokens) of requests finished this step
    engine_wide: bool = True           # batch, token and time fields are this step's own


@positional_pickle
@dataclass(slots=True)
class EngineCoreOutputs:
    """One `EngineCore.step`'s news, token ids only (the front end's `OutputProcessor` turns
    it into `RequestOutput`s): `outputs`, the scheduler's `RequestStepOutput` per sequence that
    gained tokens, finished, or failed (`error` set: a grammar that did not compile, a runner
    error); `prompt_logprobs`, `ModelRunnerOutput.prompt_logprobs`; `scheduled`, (request id,
    `time.monotonic()`, tokens already computed) of each request (re)started this step; `stats`, the step's core-side
    `StepStats` (None off a step); `snapshot`, the scheduler's snapshot for the metrics layer
    (`engine.core_proc.engine_snapshot`; set by the core loop, None in-process)."""

    outputs: list[Any] = field(default_factory=list)
    prompt_logprobs: dict[str, tuple[int, list[PromptLogprob]]] | None = None
    scheduled: list[tuple[str, float, int]] = field(default_factory=list)
    stats: StepStats | None = None
    snapshot: dict | None = None
