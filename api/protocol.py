"""OpenAI protocol models (pydantic) and their translation to `SamplingParams`.

Owns: the request bodies of `/v1/chat/completions` and `/v1/completions` — OpenAI's fields plus
vLLM's extras (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`,
`stop_token_ids`, `priority`) — with their validation. Unknown fields are rejected (HTTP 400
naming the field), and so are OpenAI fields Continuum accepts in the schema but does not
implement (tools, response formats, ...), never silently ignored.

Responses are built as plain dicts by `api.server` in OpenAI's shapes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from scheduler.request import ParamError, SamplingParams

# OpenAI request fields that exist in the API but are not implemented here: a request that sets
# one gets a 400 naming it.
UNSUPPORTED_FIELDS = (
    "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
    "response_format", "audio", "modalities", "prediction", "web_search_options",
    "reasoning_effort", "service_tier", "store", "metadata", "suffix", "best_of",
)


MAX_STOP = 64            # stop strings, and stop token ids, per request (OpenAI allows 4)
MAX_LOGIT_BIAS = 300     # logit_bias entries per request (OpenAI's limit)


class UnsupportedFieldError(ParamError):
    """A known OpenAI field that Continuum does not implement was set."""

    def __init__(self, field: str) -> None:
        super().__init__(f"'{field}' is not supported by this server", field)


class StreamOptions(BaseModel):
    """OpenAI `stream_options` (vLLM adds `continuous_usage_stats`: usage in every chunk)."""
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(BaseModel):
    """A text content part of a chat message (the only part type served)."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; `content` is a string or a list of text parts."""
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text (parts joined, None as empty)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints (NaN and infinity are refused in every float)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str
    n: int = Field(1, ge=1, le=16)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extras
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = 0
    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data):
        if isinstance(data, dict):
            for name in UNSUPPORTED_FIELDS:
                if data.get(name) is not None:
                    raise UnsupportedFieldError(name)
        return data

    @model_validator(mode="after")
    def _check(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise ParamError(f"stop: at most {MAX_STOP} strings, got {len(self.stop)}", "stop")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP:
            raise ParamError(f"stop_token_ids: at most {MAX_STOP} ids, got "
                             f"{len(self.stop_token_ids)}", "stop_token_ids")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ParamError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got "
                                 f"{len(self.logit_bias)}", "logit_bias")
            for key, value in self.logit_bias.items():
                if not (key.isascii() and key.isdigit()):
                    raise ParamError(f"logit_bias keys must be token ids, got {key!r}",
                                     "logit_bias")
                if not -100 <= value <= 100:
                    raise ParamError(f"logit_bias values must be in [-100, 100], got {value}",
                                     "logit_bias")
        return self

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Translate to engine `SamplingParams` (raises ValueError on a bad combination)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()} or None,
            seed=self.seed, stop=stop, stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, logprobs=logprobs)


class ChatCompletionRequest(_SamplingFields):
    """`POST /v1/chat/completions` body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Engine parameters; `default_max_tokens` (tokens) applies when the request gives none."""
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs)


class CompletionRequest(_SamplingFields):
    """`POST /v1/completions` body."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of strings or token-id lists (one per completion group)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Engine parameters; `default_max_tokens` (tokens) applies when the request gives none."""
        return self.sampling_params(self.max_tokens or default_max_tokens, self.logprobs)
