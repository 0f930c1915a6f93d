"""OpenAI protocol models (pydantic) and their translation to `SamplingParams`.

Owns: the request bodies of `/v1/chat/completions` and `/v1/completions` — OpenAI's fields plus
vLLM's extras (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`,
`stop_token_ids`, `priority`, `structured_outputs`, `include_stop_str_in_output`,
`skip_special_tokens`, `spaces_between_special_tokens`, `allowed_token_ids`,
`truncate_prompt_tokens`, `add_special_tokens`, `request_id`, `bad_words`, `cache_salt`,
`return_token_ids`, `return_tokens_as_token_ids`; on chat `chat_template`,
`chat_template_kwargs`, `continue_final_message`) — with their validation, and the translation
of `response_format` / `structured_outputs` into one `StructuredOutputs` constraint. Fields a
body does not define are split off by `split_unknown` (the server ignores them with vLLM's
warning, or refuses them under `--strict-openai`); OpenAI fields Continuum does not implement
(audio, predictions, ...) are refused (HTTP 400 naming the field), never silently ignored. Tools (`tools`, `tool_choice`) are declared here; `api.tools` gives them
meaning.

Responses are built as plain dicts by `api.openai_serving` in OpenAI's shapes.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from api.beam_search import BeamParams
from scheduler.request import ParamError, SamplingParams, StructuredOutputs

# OpenAI request fields that exist in the API but are not implemented here: under
# --strict-openai a request that sets one gets a 400 naming it (by default they are unknown
# fields: ignored with vLLM's warning, as vLLM ignores them).
UNSUPPORTED_FIELDS = (
    "functions", "function_call", "audio", "modalities", "prediction", "web_search_options",
    "reasoning_effort", "service_tier", "store", "metadata", "best_of",
)


MAX_STOP = 64            # stop token ids per request
MAX_STOP_STRINGS = 4     # stop strings per request (vLLM's VLLM_MAX_STOP_STRINGS; OpenAI's 4)
INT64 = (-2 ** 63, 2 ** 63 - 1)     # `seed`'s range (vLLM's)
MAX_LOGIT_BIAS = 300     # logit_bias entries per request (OpenAI's limit)
MAX_LOGPROBS = 20        # top logprobs per token (vLLM's default max_logprobs)


class UnsupportedFieldError(ParamError):
    """A known OpenAI field that Continuum does not implement was set."""

    def __init__(self, field: str) -> None:
        super().__init__(f"'{field}' is not supported by this server", field)


class StreamOptions(BaseModel):
    """OpenAI `stream_options` (vLLM adds `continuous_usage_stats`: usage in every chunk)."""
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


TEXT_PARTS = ("text", "refusal")


class TextPart(BaseModel):
    """A text content part of a chat message: the part types vLLM's chat route reads as text
    (`refusal`'s text in its `refusal` field). Other types (images, audio) are refused by name
    (`ChatMessage`): the served models read text."""
    model_config = ConfigDict(extra="allow")
    type: str               # one of TEXT_PARTS (ChatMessage checks)
    text: str | None = None
    refusal: str | None = None

    def value(self) -> str | None:
        """The part's text (None: a part with none, skipped as vLLM skips it)."""
        return self.refusal if self.type == "refusal" else self.text


class FunctionCall(BaseModel):
    """A function call in an assistant message of the history (`arguments`: JSON text)."""
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str


class ToolCall(BaseModel):
    """One entry of an assistant message's `tool_calls`."""
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One chat message; `content` is a string or a list of text parts. Any `role` is taken
    to the template as vLLM takes it (system, developer, user, assistant, tool, the old
    function, or a custom one). Assistant messages may carry `tool_calls` and their
    `reasoning` (`reasoning_content`: vLLM's older name), which reach the template; `tool`
    messages answer a call, named by `tool_call_id`."""
    model_config = ConfigDict(extra="forbid")
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v):
        """A part of another type is a 400 naming it (not pydantic's union error)."""
        for p in v if isinstance(v, list) else ():
            kind = p.get("type") if isinstance(p, dict) else None
            if kind not in TEXT_PARTS:
                raise ParamError(f"{kind!r} content parts are not served: this server's "
                                 f"models read text (parts of type "
                                 f"{', '.join(TEXT_PARTS)})", "messages")
        return v

    def text(self) -> str:
        """The message's text: its text parts newline-joined, as vLLM joins them for
        templates that take a string; None as empty."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(v for p in self.content if (v := p.value()) is not None)


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema is always enforced (`strict` or not), as vLLM
    does."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str                  # any string, as vLLM takes it (OpenAI: [a-zA-Z0-9_-]{1,64})
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI `response_format`: `text`, `json_object` (any JSON object) or `json_schema`."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ParamError("response_format of type json_schema needs 'json_schema'",
                             "response_format")
        return self


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs`: exactly one of `json` (a schema, object or JSON text),
    `regex`, `choice`, `grammar` (Lark or GBNF), `json_object`."""
    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        self.constraint()
        return self

    def constraint(self) -> StructuredOutputs:
        """The one constraint given. Raises ParamError when none or several are set."""
        given = {k: v for k, v in (("json", self.json_), ("regex", self.regex),
                                   ("choice", self.choice), ("grammar", self.grammar),
                                   ("json_object", self.json_object or None)) if v is not None}
        if len(given) != 1:
            raise ParamError("structured_outputs needs exactly one of json, regex, choice, "
                             f"grammar, json_object; got {sorted(given) or 'none'}",
                             "structured_outputs")
        (kind, value), = given.items()
        if kind == "choice" or (kind == "json" and not isinstance(value, str)):
            value = json.dumps(value)
        return StructuredOutputs(kind, "" if kind == "json_object" else value)


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints (NaN and infinity are refused in every float)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    # Fields whose explicit null means "not given" (the default), as vLLM 0.32's optional
    # fields take it; a null elsewhere is a 400, as there (`drop_nulls`).
    NULL_MEANS_DEFAULT: ClassVar[frozenset[str]] = frozenset({
        "temperature", "top_p", "presence_penalty", "frequency_penalty", "stream", "top_k",
        "min_p", "repetition_penalty", "return_token_ids", "return_tokens_as_token_ids"})

    model: str | None = None         # left out: the served model (vLLM's default)
    n: int = Field(1, ge=1, le=16)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])
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
    structured_outputs: StructuredOutputsParams | None = None
    response_format: ResponseFormat | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True     # a fast tokenizer's decode has no such knob:
    allowed_token_ids: list[int] | None = None     # accepted, no effect (as in vLLM)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)   # keep the last N; -1: the limit
    request_id: str | None = Field(None, max_length=256)      # the response id's suffix
    cache_salt: str | None = Field(None, min_length=1)   # prefix cache shared per salt only
    bad_words: list[str] | None = None             # never generated (api/chat.py tokenizes)
    return_token_ids: bool = False                 # prompt and output token ids in the body
    return_tokens_as_token_ids: bool = False       # logprobs' tokens as "token_id:N"
    use_beam_search: bool = False                  # n beams, api/beam_search.py (vLLM's)
    length_penalty: float = 1.0                    # beam search: score / length^penalty
    prompt_logprobs: int | None = None             # per prompt token (-1: whole vocabulary)

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
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise ParamError(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}",
                             "stop")
        if self.stop == "" or isinstance(self.stop, list) and "" in self.stop:   # vLLM's words
            raise ParamError("stop cannot contain an empty string.", "stop")
        self._check_prompt_logprobs()
        if self.bad_words is not None and any(not w for w in self.bad_words):
            raise ParamError(f"bad_words cannot contain an empty string. Got bad_words="
                             f"{self.bad_words}", "bad_words")
        if self.n > 1 and self.temperature < 1e-5 and not self.use_beam_search:   # vLLM's rule
            raise ParamError(f"n must be 1 when using greedy sampling, got {self.n}.", "n")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ParamError("allowed_token_ids must not be empty", "allowed_token_ids")
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
        return self

    def _check_prompt_logprobs(self) -> None:
        """vLLM's rules and words: -1 or 0..20, and only 0 when streamed."""
        k = self.prompt_logprobs
        if k is None:
            return
        if self.stream and (k > 0 or k == -1):
            raise ParamError("`prompt_logprobs` are not available when `stream=True`.",
                             "prompt_logprobs")
        if k < -1:
            raise ParamError("`prompt_logprobs` must be a positive value or -1.",
                             "prompt_logprobs")
        if k > MAX_LOGPROBS:
            raise ParamError(f"Requested prompt logprobs of {k}, which is greater than max "
                             f"allowed: {MAX_LOGPROBS}", "prompt_logprobs")

    def constraint(self) -> tuple[StructuredOutputs | None, str | None]:
        """(the output constraint, the field it came from), or (None, None).
        Raises ParamError when `response_format` and `structured_outputs` both constrain."""
        fmt = self.response_format
        from_format = None
        if fmt is not None and fmt.type == "json_object":
            from_format = StructuredOutputs("json_object")
        elif fmt is not None and fmt.type == "json_schema":
            from_format = StructuredOutputs("json", json.dumps(fmt.json_schema.schema_ or {}))
        if from_format is not None and self.structured_outputs is not None:
            raise ParamError("give response_format or structured_outputs, not both",
                             "structured_outputs")
        if from_format is not None:
            return from_format, "response_format"
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint(), "structured_outputs"
        return None, None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured: StructuredOutputs | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """Translate to engine `SamplingParams` (raises ValueError on a bad combination);
        `structured` is the output constraint, if any; `prompt_logprobs` as vLLM resolves it
        (an echo asks for the prompt's at the output's count)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()} or None,
            seed=self.seed, stop=stop, stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, logprobs=logprobs, structured_outputs=structured,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, cache_salt=self.cache_salt,
            allowed_token_ids=(tuple(self.allowed_token_ids)
                               if self.allowed_token_ids is not None else None))

    def beam_params(self, params: SamplingParams) -> BeamParams | None:
        """The beam search this body asks for (`use_beam_search`: `n` beams, `params`'
        resolved max_tokens and logprobs), or None."""
        if not self.use_beam_search:
            return None
        return BeamParams(self.n, params.max_tokens, self.temperature, self.length_penalty,
                          self.ignore_eos, self.include_stop_str_in_output,
                          self.skip_special_tokens, params.logprobs)

    def truncated(self, prompt: list[int], max_model_len: int) -> list[int]:
        """`prompt` (token ids) cut to its last `truncate_prompt_tokens` (-1: `max_model_len`),
        as vLLM does. Raises ParamError when that is more than `max_model_len`."""
        n = self.truncate_prompt_tokens
        if n is None:
            return prompt
        n = max_model_len if n == -1 else n
        if n > max_model_len:
            raise ParamError(f"truncate_prompt_tokens value ({n}) is greater than max_model_len "
                             f"({max_model_len}). Please, select a smaller truncation size.",
                             "truncate_prompt_tokens")
        return prompt[-n:] if n else []


class FunctionDefinition(BaseModel):
    """A tool's function: its name (any string, as vLLM takes it; OpenAI's own API allows
    `[a-zA-Z0-9_-]{1,64}`) and the JSON schema of its arguments."""
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """One entry of `tools` (only function tools are served; `type` may be left out, as vLLM
    takes it)."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming one function: `{"type": "function", "function": {"name": ...}}`."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: _FunctionName


class ChatCompletionRequest(_SamplingFields):
    """`POST /v1/chat/completions` body."""
    NULL_MEANS_DEFAULT = _SamplingFields.NULL_MEANS_DEFAULT | {"n", "logprobs",
                                                               "parallel_tool_calls"}

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_special_tokens: bool = False                 # on the rendered prompt (vLLM's default)
    chat_template: str | None = None                 # instead of the model's / --chat-template
    chat_template_kwargs: dict[str, Any] | None = None   # e.g. {"enable_thinking": false}
    continue_final_message: bool = False             # the last message left open, no new turn
    echo: bool = False                               # the open last message before the output

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tools == []:               # vLLM's words
            raise ParamError("`tools` must not be an empty array. Either provide at least "
                             "one tool or omit the field.", "tools")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ParamError("tool_choice is set but no tools are given", "tool_choice")
        if self.continue_final_message and self.add_generation_prompt:
            raise ParamError("Cannot set both `continue_final_message` and "
                             "`add_generation_prompt` to True.", "continue_final_message")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools}:
                raise ParamError(f"tool_choice names {name!r}, which is not in tools",
                                 "tool_choice")
        return self

    def to_sampling_params(self, default_max_tokens: int,
                           structured: StructuredOutputs | None = None) -> SamplingParams:
        """Engine parameters; `default_max_tokens` (tokens) applies when the request gives none;
        `structured` is the output constraint (see `constraint` and `api.tools`)."""
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:         # vLLM: top_logprobs, 0 by default
            prompt_logprobs = self.top_logprobs or 0
        return self.sampling_params(max_tokens, logprobs, structured, prompt_logprobs)


class CompletionRequest(_SamplingFields):
    """`POST /v1/completions` body."""
    NULL_MEANS_DEFAULT = _SamplingFields.NULL_MEANS_DEFAULT | {"echo"}

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)       # 0 only with echo: the prompt scored
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    add_special_tokens: bool = True                  # when tokenizing a text prompt
    suffix: str | None = None                        # refused, as vLLM refuses it here

    @model_validator(mode="after")
    def _check_beam_stream(self):
        if self.use_beam_search and self.stream:         # vLLM's completions refuse it too
            raise ParamError("Streaming is not currently supported with beam search",
                             "use_beam_search")
        if self.max_tokens == 0 and not self.echo:       # vLLM's words
            raise ParamError("max_tokens must be at least 1, got 0.", "max_tokens")
        if self.suffix is not None:
            raise ParamError("suffix is only supported for models with FIM completion "
                             "rendering", "suffix")
        return self

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens` 0: the answer is the prompt (with its logprobs), nothing
        generated — how lm-evaluation-harness scores a text (vLLM runs one token and drops
        it, counting it in usage; so does Continuum)."""
        return self.echo and self.max_tokens == 0

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

    def to_sampling_params(self, default_max_tokens: int,
                           structured: StructuredOutputs | None = None) -> SamplingParams:
        """Engine parameters; `default_max_tokens` (tokens) applies when the request gives none;
        `structured` is the output constraint (see `constraint`)."""
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:         # vLLM: an echo's logprobs cover it
            prompt_logprobs = self.logprobs
        max_tokens = 1 if self.echo_only else self.max_tokens or default_max_tokens
        return self.sampling_params(max_tokens, self.logprobs, structured, prompt_logprobs)


def split_unknown(model: type[BaseModel], data: dict) -> tuple[dict, list[str]]:
    """(`data` without the top-level keys `model` does not define, those keys sorted): what
    vLLM's server ignores with a warning and `--strict-openai` refuses."""
    known = set(model.model_fields)
    known |= {f.alias for f in model.model_fields.values() if f.alias}
    unknown = sorted(k for k in data if k not in known)
    if not unknown:
        return data, []
    return {k: v for k, v in data.items() if k in known}, unknown


def drop_nulls(model: type[BaseModel], data: dict) -> dict:
    """`data` without the explicit nulls of the fields `model.NULL_MEANS_DEFAULT` names: such a
    null means "not given" (clients such as LangChain send `"temperature": null`), so the
    default applies, as in vLLM. Other nulls stay, for validation to judge."""
    nullable = getattr(model, "NULL_MEANS_DEFAULT", ())
    drop = [k for k, v in data.items() if v is None and k in nullable]
    return {k: v for k, v in data.items() if k not in drop} if drop else data
