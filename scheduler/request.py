"""The request as the scheduler sees it, its sampling parameters, and admission errors.

Owns: `Request` — the one object per sequence that holds its token ids, `num_computed_tokens`,
status, priority and arrival time. Everything the scheduler, the KV-cache manager and the
engine's output processor need is read from it; nothing is stored twice. Only the scheduler
mutates it (`scheduler.scheduler.Scheduler`: its four calls; drafts, too, reach it through
`update_from_output`).

`SamplingParams` is defined here, beside the request, because the scheduler applies its stop
conditions (`max_tokens`, `min_tokens`, `ignore_eos`, `stop_token_ids`: `check_stop`, the one
place they live) and its length limits at admission (`check_admission`); the model runner's
sampler reads the rest. It is pure data, validated once in `__post_init__`: a user mistake raises
`ValueError`, which the API maps to HTTP 400.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_waiting_requests`; the request was not admitted (HTTP 503)."""


class ParamError(ValueError):
    """A request parameter is not allowed; `param` names it (HTTP 400 with that `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestTooLongError(ParamError):
    """Prompt (plus `max_tokens`) does not fit in `max_model_len` (HTTP 400). `param` says which
    part is at fault: "prompt" (no room for any output) or "max_tokens"."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message, param)


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Every status from FINISHED_STOPPED on is final."""

    WAITING = 0
    WAITING_FOR_GRAMMAR = 1  # queued, its structured-output grammar still compiling
    RUNNING = 2
    PREEMPTED = 3          # recompute preemption: back in the waiting queue, blocks freed
    SWAPPED = 4            # swap preemption: blocks in the CPU swap pool
    FINISHED_STOPPED = 5   # EOS, a stop token id, or a stop string (engine side)
    FINISHED_LENGTH_CAPPED = 6  # max_tokens or max_model_len reached
    FINISHED_ABORTED = 7   # client went away, timeout, shutdown
    FINISHED_ERROR = 8     # the request failed alone (runner error, grammar that did not compile)

    @property
    def is_finished(self) -> bool:
        """Whether the status is one of the FINISHED_* states."""
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's `finish_reason` for a final status, else None."""
        return _FINISH_REASONS.get(self)


STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the generated text (vLLM's `structured_outputs` kinds).

    `kind` is one of STRUCTURED_OUTPUT_KINDS; `spec` is text: a JSON schema ("json"), ignored
    ("json_object": any JSON object), a regular expression ("regex"), a JSON list of strings
    ("choice"), or a Lark / GBNF grammar ("grammar"). Pure data: the engine's
    `engine.structured` turns it into a token mask. Raises ParamError for an unknown kind.
    """

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_OUTPUT_KINDS:
            raise ParamError(f"unknown structured output kind {self.kind!r}; expected one of "
                             f"{', '.join(STRUCTURED_OUTPUT_KINDS)}", "structured_outputs")


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True)
class SamplingParams:
    """How to sample and when to stop, per request (OpenAI and vLLM parameter names).

    Token counts are in tokens; probabilities in [0, 1]. `max_tokens=None` means "until
    `max_model_len`". `seed=None` means non-reproducible sampling. `n` choices are produced by
    forking the request after its prompt is computed (blocks shared, copy-on-write).

    Raises: ParamError (a ValueError) naming the parameter on any out-of-range value.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                 # 0 (or -1) = disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None    # number of top logprobs per token (0 = sampled token only)
    prompt_logprobs: int | None = None   # the same per prompt token (-1: the whole vocabulary)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True   # in the detokenized text
    allowed_token_ids: tuple[int, ...] | None = None   # the only tokens that may be sampled
    cache_salt: str | None = None      # prefix-cache blocks are shared only within one salt
    lora_name: str | None = None       # the LoRA adapter the request runs with (engine.lora)
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None   # banned token sequences
    structured_outputs: StructuredOutputs | None = None   # constrains the output (grammar)

    def __post_init__(self) -> None:
        def bad(name: str, value, why: str) -> None:
            raise ParamError(f"{name} {why}, got {value!r}", name)

        if self.n < 1:
            bad("n", self.n, "must be at least 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, "must be at least 1")
        if self.min_tokens < 0:
            bad("min_tokens", self.min_tokens, "must be non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", self.min_tokens, f"must not exceed max_tokens={self.max_tokens}")
        if self.temperature < 0:
            bad("temperature", self.temperature, "must be non-negative")
        if not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "must be in (0, 1]")
        if self.top_k < -1:
            bad("top_k", self.top_k, "must be -1, 0 (disabled) or positive")
        if not 0 <= self.min_p <= 1:
            bad("min_p", self.min_p, "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", self.repetition_penalty, "must be positive")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", self.logprobs, "must be in [0, 20]")
        if self.prompt_logprobs is not None and not -1 <= self.prompt_logprobs <= 20:
            bad("prompt_logprobs", self.prompt_logprobs, "must be -1 or in [0, 20]")
        if isinstance(self.stop, str) or isinstance(self.stop_token_ids, int):
            raise ValueError("stop and stop_token_ids must be sequences")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """Whether decoding is greedy (temperature 0)."""
        return self.temperature == 0.0


_arrival_counter = iter(range(1 << 62))


@dataclass(eq=False, slots=True)
class Request:
    """One sequence: prompt and output token ids, progress and scheduling attributes.

    `all_token_ids` is prompt + output (a list, appended to); `num_computed_tokens` counts the
    leading tokens whose K/V is in the cache (or scheduled to be, this step). A request with
    `sampling_params.n > 1` is forked into `n` sequences once all but its last prompt token are
    computed; its children have ids `f"{parent_id}#{index}"` and `parent_id` set.

    Args (beyond the fields): `arrival_time` in seconds (`time.monotonic()`), `priority` lower =
    sooner (used by the `priority` policy), `eos_token_id` None for none.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    extra_keys: object = None              # folded into prefix-cache hashes (adapter id, salt)
    parent_id: str | None = None
    index: int = 0                         # choice index among the n forks
    all_token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None   # the stop token id (or stop string) that finished it
    num_preemptions: int = 0
    forked: bool = False                   # True once the n-way fork happened (or n == 1)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts proposed for the next step
    spec_window: object = None             # scheduler.spec_decode.AcceptanceWindow, once drafted
    seq: int = field(init=False)           # tie-breaker: admission order among equal arrivals
    arrival_step: int = field(default=0, init=False)   # scheduler steps before it was added

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.forked = self.sampling_params.n == 1 or self.parent_id is not None
        self.seq = next(_arrival_counter)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.all_token_ids)

    @property
    def max_num_running_seqs(self) -> int:
        """Sequences it occupies in a batch: `n` for a parent not yet forked, else 1 (vLLM v0's
        `SequenceGroup.get_max_num_running_seqs`)."""
        return 1 if self.forked else self.sampling_params.n

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The generated token ids (a new list each call)."""
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        """Whether the status is one of the FINISHED_* states."""
        return self.status >= RequestStatus.FINISHED_STOPPED

    def fork(self, index: int) -> Request:
        """A sibling sequence sharing this request's tokens and progress (no blocks; see
        `KVCacheManager.fork`)."""
        child = Request(f"{self.request_id}#{index}", self.prompt_token_ids, self.sampling_params,
                        self.eos_token_id, self.arrival_time, self.priority, self.extra_keys,
                        parent_id=self.request_id, index=index)
        child.all_token_ids = list(self.all_token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        return child


def check_admission(request: Request, max_model_len: int, max_num_seqs: int) -> None:
    """Whether `request` can ever run. Raises RequestTooLongError if its prompt (plus
    `max_tokens`) exceeds `max_model_len`, ValueError if its `n` exceeds `max_num_seqs`."""
    num_prompt = request.num_prompt_tokens
    max_tokens = request.sampling_params.max_tokens
    if num_prompt >= max_model_len:
        raise RequestTooLongError(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"your prompt has {num_prompt} tokens, leaving no room for output.")
    if max_tokens is not None and num_prompt + max_tokens > max_model_len:
        raise RequestTooLongError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
            f"{max_tokens} in the completion).", "max_tokens")
    if request.sampling_params.n > max_num_seqs:
        raise ValueError(f"n ({request.sampling_params.n}) exceeds max_num_seqs "
                         f"({max_num_seqs})")


def check_stop(req: Request, token: int, max_model_len: int) -> RequestStatus:
    """The one place stop conditions live (stop strings are the detokenizer's, engine side):
    the status of `req` once `token`, its last token, is appended (RUNNING: it goes on). Called
    by the scheduler, which sets `stop_reason` through it.

    EOS (unless `ignore_eos`) and `stop_token_ids` count only once `min_tokens` are out;
    `max_tokens` and `max_model_len` cap the length.
    """
    params = req.sampling_params
    num_out = len(req.all_token_ids) - req.num_prompt_tokens
    if num_out >= params.min_tokens:
        if token == req.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if (params.max_tokens is not None and num_out >= params.max_tokens) \
            or len(req.all_token_ids) >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return RequestStatus.RUNNING
