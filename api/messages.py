"""Anthropic's Messages API, as vLLM serves it: `POST /v1/messages` (the `anthropic` SDK's
`messages.create` / `messages.stream`, Claude Code pointed at the server with
`ANTHROPIC_BASE_URL`) and `POST /v1/messages/count_tokens`.

Owns: the request bodies (`MessagesRequest`, `CountTokensRequest`), their translation into the
chat request the rest of the server already serves (`to_chat`), the `message` object, its stream
of typed events, and errors in Anthropic's shape.

Data flow: JSON body → `MessagesRequest` (pydantic; unknown fields ignored with vLLM's warning,
so `cache_control` on blocks and `metadata` pass) → `to_chat`: `system` (a string, or its text
blocks; others skipped, as vLLM skips them) as the first system message; each message's text
blocks joined, an assistant's `tool_use` blocks as its tool calls, a user's `tool_result` blocks
as `tool` messages (their text); `max_tokens`, `stop_sequences` → `stop`, `temperature`,
`top_p`, `top_k`; `tools` (`name`, `description`, `input_schema`) and `tool_choice` (`auto`,
`any` → `required`, `tool` → a named function, `none`; `disable_parallel_tool_use` →
`parallel_tool_calls`); `output_config.format` (a JSON schema) → `response_format` →
`ChatCompletionRequest` → the chat route's prompt, constraint, tool mode and engine parameters
(api/chat.py) → the server's `respond` (api/respond.py) with `MessagesContext`, which builds:
- not streamed: the `message` (`content`: a `text` block, then a `tool_use` block per hermes
  call parsed out of the text when tools are on — `input` the arguments object; one empty text
  block when there is nothing; `stop_reason` `end_turn`, `max_tokens`, `stop_sequence` (with the
  matched `stop_sequence`) or `tool_use`; `usage` in input / output tokens);
- streamed: `event: <type>` + `data: <JSON>` events: `message_start` (the message without
  content, usage so far), per content block `content_block_start`, `content_block_delta`s
  (`text_delta`, or a call's arguments as `input_json_delta`), `content_block_stop`; then
  `message_delta` (`stop_reason`, `stop_sequence`, usage) and `message_stop`; an `error` event
  if the engine fails mid-stream.
`count_tokens` renders the same prompt and answers `{"input_tokens", "context_management":
{"original_input_tokens"}}`.

Errors: `{"type": "error", "error": {"type", "message"}}` with Anthropic's type for the status
(`invalid_request_error` 400, `not_found_error` 404, `request_too_large` 413, `api_error` 500,
`overloaded_error` 503). Deliberate deviations from vLLM 0.32
(tests/test_vllm_differential_apis.py marks them): its body-validation errors come in OpenAI's
shape, here all in Anthropic's; its non-streamed message leaves out a null `stop_sequence`, here
it is kept (Anthropic's shape); ids are `msg_` / `toolu_` (vLLM: `chatcmpl-` /
`chatcmpl-tool-`). Not served (a 400 naming the field): images and documents (this server's
models read text), server tools (web search, bash, ...). `thinking` is checked as vLLM checks it and has no
effect: no reasoning parser runs here.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from api import lora
from api.chat import engine_params, prepare_chat, render_chat, response_id
from api.errors import APIError, bad_request
from api.openai_serving import ResponseContext
from api.protocol import ChatCompletionRequest
from api.tools import HermesToolParser
from engine.outputs import RequestOutput
from scheduler.request import ParamError

BLOCKS = ("text", "image", "document", "tool_use", "tool_result", "thinking",
          "redacted_thinking")


class Block(BaseModel):
    """A content block of a message or of `system` (the kinds in BLOCKS; images and documents
    are refused by `to_chat`)."""
    type: Literal[BLOCKS]
    text: str | None = None
    id: str | None = None                    # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None           # tool_result
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    thinking: str | None = None              # thinking (kept out of the prompt, as vLLM's
    signature: str | None = None             # templates without reasoning do)


class Message(BaseModel):
    """One turn of `messages` (vLLM also takes a `system` turn there)."""
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(BaseModel):
    """A client tool: its `input_schema` is the function's parameters (`type` object when
    left out)."""
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]

    @field_validator("input_schema")
    @classmethod
    def _object(cls, v: dict) -> dict:
        return {"type": "object", **v}


class ToolChoice(BaseModel):
    """`tool_choice`: `auto`, `any` (some tool), `tool` (the one `name`d) or `none`."""
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self):
        if self.type == "tool" and not self.name:
            raise ParamError("tool_choice.name is required when type is 'tool'", "tool_choice")
        return self


class OutputFormat(BaseModel):
    """`output_config.format`: a JSON schema the text must follow."""
    type: Literal["json_schema"] = "json_schema"
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class OutputConfig(BaseModel):
    """`output_config` (its `effort` has no effect here)."""
    format: OutputFormat | None = None
    effort: str | None = None


class CountTokensRequest(BaseModel):
    """`POST /v1/messages/count_tokens` body: a conversation without sampling fields."""
    model: str = Field(min_length=1)
    messages: list[Message]
    system: str | list[Block] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("thinking")
    @classmethod
    def _thinking(cls, v: dict | None) -> dict | None:
        if v is not None and v.get("type") not in ("enabled", "disabled", "adaptive"):
            raise ParamError("thinking.type must be 'enabled', 'disabled' or 'adaptive'",
                             "thinking")
        return v


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages` body (the fields served; see the module docstring)."""
    NULL_MEANS_DEFAULT: ClassVar[frozenset[str]] = frozenset({"stream"})     # as vLLM
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    request_id: str | None = Field(None, max_length=256)
    priority: int = 0

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v <= 0:
            raise ParamError("max_tokens must be positive", "max_tokens")
        return v

    @model_validator(mode="after")
    def _budget(self):
        t = self.thinking or {}
        if t.get("type") == "enabled" and not (1024 <= t.get("budget_tokens", 0)
                                                < self.max_tokens):
            raise ParamError("thinking.budget_tokens must be at least 1024 and less than "
                             "max_tokens", "thinking")
        return self


def _refuse_media(kinds, where: str) -> None:
    """Raises APIError 400 naming `where` when an image or document is among the block
    types `kinds`: the served models read text."""
    kind = next((k for k in kinds if k in ("image", "document")), None)
    if kind is not None:
        raise bad_request(f"{where}: {kind} blocks are not served: this server's models read "
                          "text only", where)


def _result_text(block: Block, where: str) -> str:
    """A tool_result's content as text (its text parts, newline-joined, as vLLM joins them).
    Raises APIError 400 for media in it."""
    if not isinstance(block.content, list):
        return block.content or ""
    _refuse_media((p.get("type") for p in block.content), where)
    return "\n".join(p.get("text", "") for p in block.content if p.get("type") == "text")


def conversation(body: CountTokensRequest) -> list[dict]:
    """The chat messages of `system` and `messages` (see the module docstring).
    Raises APIError 400 for image or document blocks."""
    out = []
    system = body.system if not isinstance(body.system, list) else "".join(
        b.text for b in body.system if b.type == "text" and b.text)    # vLLM: text blocks only
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        where = f"messages[{i}]"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        _refuse_media((b.type for b in m.content), where)
        parts = []                                    # the text parts, in block order
        for b in m.content:
            if b.type == "text" and b.text:
                parts.append(b.text)
            elif b.type == "tool_result" and m.role == "user":
                out.append({"role": "tool", "tool_call_id": b.tool_use_id or "",
                            "content": _result_text(b, where)})
            elif b.type == "tool_result":             # in an assistant turn: its text (vLLM)
                parts.append(f"Tool result: {_result_text(b, where)}")
        text = "\n".join(parts)
        calls = [{"id": b.id or f"toolu_{uuid.uuid4().hex}", "type": "function",
                  "function": {"name": b.name or "", "arguments": json.dumps(b.input or {})}}
                 for b in m.content if b.type == "tool_use"]
        if text or calls or m.role != "user":
            msg: dict = {"role": m.role, "content": text or None}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def to_chat(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that computes `body` (a count_tokens body gives the same prompt).
    Raises APIError 400 naming the field."""
    fields: dict[str, Any] = {"model": body.model, "messages": conversation(body),
                              "chat_template_kwargs": body.chat_template_kwargs}
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stream=body.stream, priority=body.priority,
                      request_id=body.request_id, stop=body.stop_sequences)
        fields.update({k: getattr(body, k) for k in ("temperature", "top_p", "top_k")
                       if getattr(body, k) is not None})
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in _tools(body.tools)]
    if (choice := body.tool_choice) is not None and body.tools:    # without tools: ignored (vLLM)
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            choice.type) or {"type": "function", "function": {"name": choice.name}}
    fmt = body.output_config.format if body.output_config else None
    if fmt is not None and fmt.schema_ is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "json_schema", "schema": fmt.schema_}}
    if not fields["messages"]:
        raise bad_request("messages must not be empty: give at least one message", "messages")
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, ParamError):
            raise bad_request(str(cause), cause.param) from None
        field = CHAT_FIELDS.get(str(err["loc"][0]), str(err["loc"][0])) if err["loc"] else None
        loc = ".".join(str(x) for x in err["loc"])
        raise bad_request(f"{loc}: {err['msg']}" if loc else err["msg"], field) from None


def _tools(tools: list[dict]) -> list[Tool]:
    """The client tools. Raises APIError 400 naming `tools` for a server tool or a bad one."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            raise bad_request(f"tools[{i}]: {tool['type']!r} tools are not served, only "
                              "client tools with an input_schema", "tools")
        try:
            out.append(Tool.model_validate(tool))
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            raise bad_request(f"tools[{i}].{loc}: {err['msg']}", "tools") from None
    return out


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def error_response(e: APIError) -> JSONResponse:
    """`e` as Anthropic's error body `{"type": "error", "error": {"type", "message"}}`, the
    type the one Anthropic gives the status, the field `e` names added to its message."""
    param = CHAT_FIELDS.get(e.param, e.param)
    message = e.message if param is None or param in e.message \
        else f"{e.message} (parameter={param})"
    body = {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"),
                                       "message": message}}
    return JSONResponse(body, status_code=e.status, headers=e.headers)


class MessagesContext(ResponseContext):
    """One `/v1/messages` request's message and stream events (`tool_parsing`: hermes calls
    become `tool_use` blocks, as on the chat route)."""

    object_name = chunk_object = "message"

    def __init__(self, *, tool_parsing: bool = False, **kw) -> None:
        super().__init__(n=1, **kw)
        self.tool_parsing = tool_parsing
        self.parser = HermesToolParser() if tool_parsing else None
        self.index = -1                # the open block's index (-1: none yet)
        self.open: str | None = None   # the open block's type
        self.called = False

    def _usage(self) -> dict:
        """Anthropic's usage; with `tokens_details` the prefix-cache hits are
        `cache_read_input_tokens`, out of `input_tokens` (vLLM's split)."""
        used = self.usage()
        if not self.tokens_details:
            return {"input_tokens": used["prompt_tokens"],
                    "output_tokens": used["completion_tokens"]}
        cached = used["prompt_tokens_details"]["cached_tokens"]
        return {"input_tokens": used["prompt_tokens"] - cached,
                "output_tokens": used["completion_tokens"], "cache_read_input_tokens": cached}

    def _stop(self, called: bool) -> tuple[str | None, str | None]:
        """(stop_reason, stop_sequence) of the finished choice (vLLM's mapping)."""
        ch = self.choices.get(0)
        if ch is None or ch.finish_reason == "length":
            return ("max_tokens" if ch else None), None
        if isinstance(ch.stop_reason, str):
            return "stop_sequence", ch.stop_reason
        return ("tool_use" if called else "end_turn"), None

    @staticmethod
    def _tool_block(call: dict, arguments: dict | None = None) -> dict:
        return {"type": "tool_use", "id": f"toolu_{call['id'].removeprefix('call_')}",
                "name": call["function"]["name"], "input": arguments or {}}

    def final_body(self) -> dict:
        """The non-streamed `message`. A call whose arguments are not a JSON object (cut short
        by `max_tokens`, or written so) stays in the text as the model wrote it: a `tool_use`
        block's `input` must be an object, and a client must not run half a call."""
        text = self.choices[0].text if 0 in self.choices else ""
        blocks = []
        if self.tool_parsing:
            parser = HermesToolParser()
            text = "".join(d.get("content", "") for d in parser.feed(text) + parser.finish())
            for call, whole in zip(parser.calls, parser.complete):
                args = call["function"]["arguments"]
                try:
                    value = json.loads(args) if whole else None
                except ValueError:
                    value = None
                if isinstance(value, dict):
                    blocks.append(self._tool_block(call, value))
                else:
                    text += (f'<tool_call>\n{{"name": {json.dumps(call["function"]["name"])}, '
                             f'"arguments": {args}')
        content = ([{"type": "text", "text": text}] if text else []) + blocks
        reason, sequence = self._stop(bool(blocks))
        return {"id": self.request_id, "type": "message", "role": "assistant",
                "content": content or [{"type": "text", "text": ""}], "model": self.model,
                "stop_reason": reason, "stop_sequence": sequence, "usage": self._usage()}

    # ------------------------------------------------------------------ the stream
    @staticmethod
    def _event(kind: str, **fields) -> bytes:
        return (f"event: {kind}\ndata: ".encode()
                + json.dumps({"type": kind, **fields}, separators=(",", ":")).encode()
                + b"\n\n")

    def _start(self, block: dict) -> bytes:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + self._event("content_block_start", index=self.index, content_block=block)

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return self._event("content_block_stop", index=self.index)

    def _delta(self, d: dict) -> bytes:
        """Events of one parser delta (text, or a call's start and arguments)."""
        out = b""
        if d.get("content"):
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            out += self._event("content_block_delta", index=self.index,
                               delta={"type": "text_delta", "text": d["content"]})
        for tc in d.get("tool_calls", []):
            if "id" in tc:                        # a call starts
                self.called = True
                out += self._start(self._tool_block(tc))
            if piece := tc["function"].get("arguments"):
                out += self._event("content_block_delta", index=self.index,
                                   delta={"type": "input_json_delta", "partial_json": piece})
        return out

    def _deltas(self, group: int, out: RequestOutput) -> bytes:
        texts = [text for _, _, text, *_ in self._apply(group, out) if text]
        if self.parser is None:
            return b"".join(self._delta({"content": t}) for t in texts)
        return b"".join(self._delta(d) for t in texts for d in self.parser.feed(t))

    async def events(self, first: tuple[int, RequestOutput] | None,
                     rest: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[bytes]:
        """The stream's body: the events of the module docstring, in order."""
        try:
            if first is not None:
                self.prompt_tokens = [first[1].num_prompt_tokens]
                self.cached_tokens = [first[1].num_cached_tokens]
            start = self._event("message_start", message={
                "id": self.request_id, "type": "message", "role": "assistant", "content": [],
                "model": self.model, "stop_reason": None, "stop_sequence": None,
                "usage": self._usage()})
            yield start + (self._deltas(*first) if first is not None else b"")
            async for group, out in rest:
                if chunk := self._deltas(group, out):
                    yield chunk
            end = b"".join(self._delta(d) for d in self.parser.finish()) if self.parser else b""
            reason, sequence = self._stop(self.called)
            yield (end + self._close()
                   + self._event("message_delta", delta={"stop_reason": reason,
                                                         "stop_sequence": sequence},
                                 usage=self._usage())
                   + self._event("message_stop"))
        except Exception as e:          # after the stream started: Anthropic's error event
            yield self._event("error", error={"type": "api_error",
                                              "message": f"{type(e).__name__}: {e}"})
        finally:
            await rest.aclose()


# chat request fields -> the /v1/messages fields they came from (errors name the latter)
CHAT_FIELDS = {"stop": "stop_sequences", "response_format": "output_config.format"}


def install(app, state, parse, engine_or_503, refuse_if_full, respond) -> None:
    """Add `POST /v1/messages` and `POST /v1/messages/count_tokens` to `app`, with the server's
    body parser, readiness and capacity checks, and its `respond`; every error is rendered in
    Anthropic's shape."""

    async def create(request: Request):
        refuse_if_full()
        body = await parse(request, MessagesRequest, state.http_max_input_size)
        chat = to_chat(body)
        adapter = lora.resolve_model(state, chat.model)
        llm = engine_or_503()
        prompt, so, tool_parsing = await prepare_chat(state, chat)
        ctx = MessagesContext(request_id=f"msg_{response_id(request, body)}", model=chat.model,
                              tokenizer=state.tokenizer, tool_parsing=tool_parsing,
                              tokens_details=state.config.enable_prompt_tokens_details)
        params = engine_params(state, chat, prompt, so, adapter)
        return await respond(request, llm, ctx, body=chat, prompts=[prompt], params=params,
                             param="messages", stream_body=ctx.events)

    async def count(request: Request):
        body = await parse(request, CountTokensRequest, state.http_max_input_size)
        chat = to_chat(body)
        lora.resolve_model(state, chat.model)
        engine_or_503()
        n = len(render_chat(state, chat))
        return {"input_tokens": n, "context_management": {"original_input_tokens": n}}

    for path, route in (("/v1/messages", create), ("/v1/messages/count_tokens", count)):
        app.add_api_route(path, _anthropic_errors(route), methods=["POST"])


def _anthropic_errors(route):
    """`route` with its APIErrors rendered in Anthropic's shape (fields named as this body
    names them)."""
    async def wrapped(request: Request):
        try:
            return await route(request)
        except APIError as e:
            return error_response(e)
    wrapped.__name__ = route.__name__
    return wrapped
