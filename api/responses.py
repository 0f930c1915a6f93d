"""OpenAI's Responses API, text in and text out: `POST /v1/responses` (OpenAI's `responses.create`,
streamed or not) as vLLM serves it without its response store.

Owns: the request body (`ResponsesRequest`), its translation into the chat request the rest of
the server already serves (`to_chat`), the `response` object, and the stream's typed events.

Data flow: JSON body → `ResponsesRequest` (pydantic; unknown fields ignored with vLLM's warning)
→ `to_chat`: `instructions` as a system message, then `input` (a string: one user message; or
message items whose content is a string or `input_text` / `output_text` parts),
`max_output_tokens` → `max_tokens`, `temperature`, `top_p`, `text.format` (`json_schema` /
`json_object`) → `response_format` → `ChatCompletionRequest` → the chat route's prompt,
constraint and engine parameters (api/chat.py) → the server's `_respond` with
`ResponsesContext`, which builds:
- not streamed: the `response` object (`output`: one assistant `message` with one `output_text`
  part; `status` `completed`, or `incomplete` with `incomplete_details.reason`
  `max_output_tokens` when the token limit ended it; `usage` in input / output tokens);
- streamed: OpenAI's events, each `event: <type>` + `data: <JSON>` with a `sequence_number`:
  `response.created`, `response.in_progress`, `response.output_item.added`,
  `response.content_part.added`, `response.output_text.delta` per engine output,
  `response.output_text.done`, `response.content_part.done`, `response.output_item.done`,
  `response.completed` (also when incomplete, with the status inside: vLLM's choice; OpenAI
  sends `response.incomplete`), or an `error` event if the engine fails mid-stream.

Not served (a 400 naming the field, never silently dropped): `tools` (non-empty),
`background`, input items other than messages (function calls and their outputs, images,
files). Like vLLM without `VLLM_ENABLE_RESPONSES_API_STORE`, nothing is stored: `store` is
accepted, and `previous_response_id` or `GET /v1/responses/{id}` is vLLM's 404.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from api.errors import APIError, bad_request
from api.openai_serving import ResponseContext
from api.protocol import ChatCompletionRequest
from engine.outputs import RequestOutput
from scheduler.request import ParamError


class InputPart(BaseModel):
    """A text content part of an input message."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(BaseModel):
    """A message item of `input` (`type` `message`, or left out as OpenAI's easy form)."""
    model_config = ConfigDict(extra="allow")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or a JSON schema (OpenAI's flattened form)."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


    @model_validator(mode="after")
    def _check(self):
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ParamError("text.format of type json_schema needs 'name' and 'schema'",
                             "text.format")
        return self


class TextConfig(BaseModel):
    """`text`: the output's format."""
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """`POST /v1/responses` body (the fields served; see the module docstring)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: TextConfig | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    background: bool = False
    request_id: str | None = Field(None, max_length=256)
    priority: int = 0


def to_chat(body: ResponsesRequest, served_model: str) -> ChatCompletionRequest:
    """The chat request that computes `body`. Raises APIError 400 / 404 (see the module)."""
    if body.tools:
        raise bad_request("tools are not served on /v1/responses (use /v1/chat/completions)",
                          "tools")
    if body.background:
        raise bad_request("background responses are not served", "background")
    if body.previous_response_id is not None:        # nothing is stored (vLLM's default)
        raise APIError(404, f"Response with id '{body.previous_response_id}' not found.",
                       "invalid_request_error", "response_id")
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [InputMessage(role="user", content=body.input)] if isinstance(body.input, str) \
        else [_message(i, item) for i, item in enumerate(body.input)]
    for item in items:
        content = item.content if isinstance(item.content, str) else \
            "".join(p.text for p in item.content)
        messages.append({"role": item.role, "content": content})
    if not messages:
        raise bad_request("input must not be empty", "input")
    fields: dict[str, Any] = {"model": body.model or served_model, "messages": messages,
                              "stream": body.stream, "priority": body.priority,
                              "request_id": body.request_id}
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p")):
        if getattr(body, theirs) is not None:
            fields[ours] = getattr(body, theirs)
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_schema":
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
    elif fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValueError as e:
        raise bad_request(str(e).splitlines()[0], "input") from None


def _message(i: int, item: dict) -> InputMessage:
    """Input item `i` as a message. Raises APIError 400 naming `input` for another kind of
    item or a malformed message."""
    kind = item.get("type", "message")
    if kind != "message":
        raise bad_request(f"input[{i}]: {kind!r} items are not served, only messages", "input")
    try:
        return InputMessage.model_validate(item)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise bad_request(f"input[{i}].{where}: {err['msg']}", "input") from None


class ResponsesContext(ResponseContext):
    """One `/v1/responses` request's response object and stream events (`body`: the request,
    whose settings the response echoes)."""

    object_name = "response"
    chunk_object = "response"

    def __init__(self, *, body: ResponsesRequest, **kw) -> None:
        super().__init__(n=1, **kw)
        self.body = body
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.sequence = 0

    def _response(self, status: str) -> dict:
        ch = self.choices.get(0)
        incomplete = ch is not None and ch.finish_reason == "length"
        if status == "completed" and incomplete:
            status = "incomplete"
        b = self.body
        usage = None
        if status != "in_progress":
            used = self.usage()
            usage = {"input_tokens": used["prompt_tokens"],
                     "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": used["completion_tokens"],
                     "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": used["total_tokens"]}
        return {
            "id": self.request_id, "object": "response", "created_at": self.created,
            "status": status, "model": self.model,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.instructions, "metadata": b.metadata,
            "output": [] if status == "in_progress" else [self._item("completed")],
            "parallel_tool_calls": b.parallel_tool_calls,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "top_p": 1.0 if b.top_p is None else b.top_p, "tool_choice": "none", "tools": [],
            "background": False, "max_output_tokens": b.max_output_tokens,
            "max_tool_calls": None, "previous_response_id": None, "prompt": None,
            "reasoning": None, "service_tier": "auto",
            "text": b.text.model_dump(by_alias=True, exclude_none=True) if b.text else None,
            "top_logprobs": None, "truncation": "disabled", "usage": usage, "user": b.user}

    def _part(self, text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": None}

    def _item(self, status: str) -> dict:
        text = self.choices[0].text if 0 in self.choices else ""
        return {"id": self.item_id, "type": "message", "role": "assistant", "status": status,
                "content": [self._part(text)] if status == "completed" else []}

    def final_body(self) -> dict:
        """The non-streamed `response` object."""
        return self._response("completed")

    def _event(self, kind: str, **fields) -> bytes:
        obj = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return (f"event: {kind}\ndata: ".encode()
                + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

    def _deltas(self, group: int, out: RequestOutput) -> bytes:
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return b"".join(self._event("response.output_text.delta", delta=text, logprobs=[],
                                    **where)
                        for _, _, text, *_ in self._apply(group, out) if text)

    async def events(self, first: tuple[int, RequestOutput] | None,
                     rest: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[bytes]:
        """The stream's body: the events of the module docstring, in order."""
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        try:
            yield (self._event("response.created", response=self._response("in_progress"))
                   + self._event("response.in_progress", response=self._response("in_progress"))
                   + self._event("response.output_item.added", output_index=0,
                                 item=self._item("in_progress"))
                   + self._event("response.content_part.added", part=self._part(""), **where))
            if first is not None and (chunk := self._deltas(*first)):
                yield chunk
            async for group, out in rest:
                if chunk := self._deltas(group, out):
                    yield chunk
            text = self.choices[0].text if 0 in self.choices else ""
            yield (self._event("response.output_text.done", text=text, logprobs=[], **where)
                   + self._event("response.content_part.done", part=self._part(text), **where)
                   + self._event("response.output_item.done", output_index=0,
                                 item=self._item("completed"))
                   + self._event("response.completed", response=self._response("completed")))
        except Exception as e:          # after the stream started: OpenAI's error event
            yield self._event("error", code="internal_error", message=f"{type(e).__name__}: {e}",
                              param=None)
        finally:
            await rest.aclose()


def response_context(state, request, body: ResponsesRequest,
                     chat: ChatCompletionRequest) -> ResponsesContext:
    """The response builder of a `/v1/responses` request (id `resp_<X-Request-Id, the body's
    request_id, or random>`)."""
    rid = request.headers.get("X-Request-Id") or body.request_id or uuid.uuid4().hex
    return ResponsesContext(body=body, request_id=f"resp_{rid}", model=chat.model,
                            tokenizer=state.tokenizer, created=int(time.time()))


# chat request fields -> the /v1/responses fields they came from (errors name the latter)
CHAT_FIELDS = {"max_tokens": "max_output_tokens", "response_format": "text.format",
               "messages": "input"}


def install(app, state, parse, engine_or_503, refuse_if_full, respond) -> None:
    """Add `POST /v1/responses` and `GET /v1/responses/{id}` to `app`, with the server's body
    parser, readiness and capacity checks, and its `_respond` (bound to the server's state)."""
    from api import lora
    from api.chat import engine_params, prepare_chat

    @app.post("/v1/responses")
    async def create_response(request: Request):
        refuse_if_full()
        body = await parse(request, ResponsesRequest, state.http_max_input_size)
        chat = to_chat(body, state.served_model_name)
        adapter = lora.resolve_model(state, chat.model)
        llm = engine_or_503()
        try:
            prompt, so, _ = await prepare_chat(state, chat)
            ctx = response_context(state, request, body, chat)
            params = engine_params(state, chat, prompt, so, adapter)
            return await respond(request, llm, ctx, body=chat, prompts=[prompt], params=params,
                                 param="input", stream_body=ctx.events)
        except APIError as e:            # the chat route's field names, as this body has them
            e.param = CHAT_FIELDS.get(e.param, e.param)
            raise

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        raise APIError(404, f"Response with id '{response_id}' not found.",
                       "invalid_request_error", "response_id")
