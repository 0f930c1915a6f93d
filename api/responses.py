"""OpenAI's Responses API, text in and text out: `POST /v1/responses` (OpenAI's `responses.create`,
streamed or not) as vLLM serves it without its response store.

Owns: the request body (`ResponsesRequest`), its translation into the chat request the rest of
the server already serves (`to_chat`), the `response` object, and the stream's typed events.

Data flow: JSON body → `ResponsesRequest` (pydantic; unknown fields ignored with vLLM's warning)
→ `to_chat`: `instructions` as a system message, then the `input` items as chat messages
(`conversation`: a string is one user message; message items with string or `input_text` /
`output_text` content; a `function_call` item as an assistant tool call, a
`function_call_output` as a `tool` message), `max_output_tokens` → `max_tokens`, `temperature`,
`top_p`, function `tools` and `tool_choice` (Responses' flattened form → the chat route's),
`text.format` (`json_schema` / `json_object`) → `response_format` → `ChatCompletionRequest` →
the chat route's prompt, constraint, tool mode and engine parameters (api/chat.py) → the
server's `respond` (api/respond.py) with `ResponsesContext`, which builds:
- not streamed: the `response` object (`output`: an assistant `message` with one
  `output_text` part, then a `function_call` item per hermes tool call parsed out of the text
  where tools are on — the message left out when only calls were written; `status`
  `completed`, or `incomplete` with `incomplete_details.reason` `max_output_tokens` when the
  token limit ended it; `usage` in input / output tokens);
- streamed: OpenAI's events, each `event: <type>` + `data: <JSON>` with a `sequence_number`:
  `response.created`, `response.in_progress`, then per output item `response.output_item.added`
  and, for a message, `response.content_part.added`, `response.output_text.delta` per piece of
  text, `response.output_text.done`, `response.content_part.done`; for a function call,
  `response.function_call_arguments.delta` / `.done`; then `response.output_item.done`; last
  `response.completed` (also when incomplete, with the status inside: vLLM's choice; OpenAI
  sends `response.incomplete`), or an `error` event if the engine fails mid-stream.

Not served (a 400 naming the field, never silently dropped): tools other than functions (web
search, file search, ...: vLLM ignores them without a tool server, a deliberate difference),
`background`, a stored `prompt` template (vLLM's 400), input items other than messages,
reasoning and function calls with their outputs (images, files), encrypted reasoning. Like vLLM
without
`VLLM_ENABLE_RESPONSES_API_STORE`, nothing is stored: `store` is accepted, and
`previous_response_id` or `GET /v1/responses/{id}` is vLLM's 404.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from api.errors import APIError, bad_request
from api.openai_serving import ResponseContext
from api import lora
from api.chat import engine_params, prepare_chat, response_id
from api.protocol import ChatCompletionRequest, FunctionDefinition
from api.tools import HermesToolParser
from engine.outputs import RequestOutput
from scheduler.request import ParamError


class InputPart(BaseModel):
    """A text content part of an input message (an `output_text` part echoed back from an
    earlier response keeps its `annotations` and `logprobs`, which are ignored)."""
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


class FunctionTool(FunctionDefinition):
    """A `tools` entry: the chat route's function, flattened into the tool (Responses' form)."""
    type: Literal["function"]


class FunctionCallItem(BaseModel):
    """An input item replaying a call the model made (`function_call`)."""
    model_config = ConfigDict(extra="allow")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    """An input item with a call's result (`function_call_output`)."""
    model_config = ConfigDict(extra="allow")
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(BaseModel):
    """An input item replaying the model's reasoning (`reasoning`: its `content` text, else
    its summary's), which goes to the assistant turn as vLLM hands it to the template."""
    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning"]
    content: list[InputPart] | None = None
    summary: list[dict] = []
    encrypted_content: str | None = None

    def text(self) -> str:
        """The reasoning's text. Raises APIError 400 for encrypted reasoning (vLLM's words)."""
        if self.encrypted_content:
            raise bad_request("Encrypted content is not supported.", "input")
        if self.content:
            return self.content[0].text
        return self.summary[0].get("text", "") if self.summary else ""


ITEMS = {"message": InputMessage, "function_call": FunctionCallItem,
         "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


class ResponsesRequest(BaseModel):
    """`POST /v1/responses` body (the fields served; see the module docstring)."""
    NULL_MEANS_DEFAULT: ClassVar[frozenset[str]] = frozenset({"stream", "store",
                                                              "parallel_tool_calls"})

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
    prompt: Any = None                       # a stored prompt template: refused (vLLM)
    request_id: str | None = Field(None, max_length=256)
    priority: int = 0


def to_chat(body: ResponsesRequest, served_model: str) -> ChatCompletionRequest:
    """The chat request that computes `body`. Raises APIError 400 / 404 (see the module)."""
    if body.background:
        raise bad_request("background responses are not served", "background")
    if body.prompt is not None:                      # vLLM's words
        raise bad_request("prompt template is not supported", "prompt")
    if body.previous_response_id is not None:        # nothing is stored (vLLM's default)
        raise APIError(404, f"Response with id '{body.previous_response_id}' not found.",
                       "invalid_request_error", "response_id")
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += conversation([{"role": "user", "content": body.input}]
                             if isinstance(body.input, str) else body.input)
    if not messages:
        raise bad_request("input must not be empty", "input")
    fields: dict[str, Any] = {"model": body.model or served_model, "messages": messages,
                              "stream": body.stream, "priority": body.priority,
                              "request_id": body.request_id,
                              "parallel_tool_calls": body.parallel_tool_calls}
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p")):
        if getattr(body, theirs) is not None:
            fields[ours] = getattr(body, theirs)
    if body.tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(
            exclude={"type"}, exclude_none=True)} for t in _tools(body.tools)]
    if body.tool_choice is not None:
        choice = body.tool_choice
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}} \
            if isinstance(choice, dict) else choice
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_schema":
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
    elif fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        cause = (err.get("ctx") or {}).get("error")
        param = cause.param if isinstance(cause, ParamError) else "input"
        raise bad_request(str(cause or err["msg"]), param) from None


def _validated(model: type[BaseModel], where: str, item: dict, param: str) -> BaseModel:
    """`item` as `model`. Raises APIError 400 naming `param`, with `where` in the message."""
    try:
        return model.model_validate(item)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise bad_request(f"{where}.{loc}: {err['msg']}", param) from None


def _tools(tools: list[dict]) -> list[FunctionTool]:
    """The function tools. Raises APIError 400 naming `tools` for another kind of tool."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(f"tools[{i}]: {tool.get('type')!r} tools are not served, only "
                              "functions", "tools")
        out.append(_validated(FunctionTool, f"tools[{i}]", tool, "tools"))
    return out


def conversation(items: list[dict]) -> list[dict]:
    """Input items as chat messages: a message as itself (its text parts joined), a
    `function_call` as an assistant message's tool call (consecutive calls in one message), a
    `function_call_output` as a `tool` message, a `reasoning` item as the `reasoning` of the
    assistant turn (an output message after it fills that turn's content, as vLLM merges them). Raises APIError 400 naming `input` for another
    kind of item or a malformed one."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind not in ITEMS:
            raise bad_request(f"input[{i}]: {kind!r} items are not served, only messages, "
                              "reasoning and function calls with their outputs", "input")
        x = _validated(ITEMS[kind], f"input[{i}]", item, "input")
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if kind == "reasoning":           # onto the assistant turn before, or one of its own
            if last is not None and last.get("reasoning") is None:
                last["reasoning"] = x.text()
            else:
                messages.append({"role": "assistant", "content": None, "reasoning": x.text()})
        elif kind == "message":
            text = x.content if isinstance(x.content, str) else \
                "\n".join(p.text for p in x.content)                    # vLLM's join
            if item.get("type") == "message" and x.role == "assistant" and last is not None \
                    and last["content"] is None:     # an output message joins its turn (vLLM)
                last["content"] = text
            else:
                messages.append({"role": x.role, "content": text})
        elif kind == "function_call":
            call = {"id": x.call_id, "type": "function",
                    "function": {"name": x.name, "arguments": x.arguments}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": x.call_id, "content": x.output})
    return messages


class ResponsesContext(ResponseContext):
    """One `/v1/responses` request's response object and stream events (`body`: the request,
    whose settings the response echoes; `tool_parsing`: hermes tool calls become
    `function_call` output items, as on the chat route)."""

    object_name = "response"
    chunk_object = "response"

    def __init__(self, *, body: ResponsesRequest, tool_parsing: bool = False, **kw) -> None:
        super().__init__(n=1, **kw)
        self.body, self.tool_parsing = body, tool_parsing
        self.sequence = 0
        self.items: list[dict] | None = None     # streamed: the output items so far
        self.open: dict | None = None            # streamed: the item being written
        self.parser = HermesToolParser() if tool_parsing else None
        self.tools = [t.model_dump(exclude_none=True) for t in _tools(body.tools or [])]

    # ------------------------------------------------------------------ the response object
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
                     "input_tokens_details": {"cached_tokens": sum(self.cached_tokens)},
                     "output_tokens": used["completion_tokens"],
                     "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": used["total_tokens"]}
        output = [] if status == "in_progress" else (
            self.items if self.items is not None else self._output_items())
        tools = self.tools
        return {
            "id": self.request_id, "object": "response", "created_at": self.created,
            "status": status, "model": self.model,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.instructions, "metadata": b.metadata, "output": output,
            "parallel_tool_calls": b.parallel_tool_calls,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "tool_choice": b.tool_choice if b.tool_choice is not None
            else ("auto" if tools else "none"),
            "tools": tools, "background": False, "max_output_tokens": b.max_output_tokens,
            "max_tool_calls": None, "previous_response_id": None, "prompt": None,
            "reasoning": None, "service_tier": "auto",
            "text": b.text.model_dump(by_alias=True, exclude_none=True) if b.text else None,
            "top_logprobs": None, "truncation": "disabled", "usage": usage, "user": b.user}

    @staticmethod
    def _part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": None}

    @staticmethod
    def _message_item(text: str | None) -> dict:
        """A message item: completed with `text`, or in progress (None) with no content."""
        return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                "status": "in_progress" if text is None else "completed",
                "content": [] if text is None else [ResponsesContext._part(text)]}

    @staticmethod
    def _call_item(call: dict, status: str = "completed") -> dict:
        """A function_call item of a parsed call (`id`, `function.name`, `.arguments`)."""
        return {"id": f"fc_{call['id'].removeprefix('call_')}", "type": "function_call",
                "call_id": call["id"], "name": call["function"]["name"],
                "arguments": call["function"].get("arguments", ""), "status": status}

    def _output_items(self) -> list[dict]:
        """The non-streamed output: the message, and the function calls parsed out of it."""
        text = self.choices[0].text if 0 in self.choices else ""
        if not self.tool_parsing:
            return [self._message_item(text)]
        parser = HermesToolParser()
        content = "".join(d.get("content", "") for d in parser.feed(text) + parser.finish())
        items = [self._message_item(content)] if content.strip() or not parser.calls else []
        return items + [self._call_item(c) for c in parser.calls]

    def final_body(self) -> dict:
        """The non-streamed `response` object."""
        return self._response("completed")

    # ------------------------------------------------------------------ the stream
    def _event(self, kind: str, **fields) -> bytes:
        obj = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return (f"event: {kind}\ndata: ".encode()
                + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

    def _open_item(self, item: dict) -> bytes:
        self.items.append(item)
        self.open = item
        at = {"output_index": len(self.items) - 1}
        out = self._event("response.output_item.added", item=dict(item), **at)
        if item["type"] == "message":
            item["text"] = ""                  # the text so far (dropped when it closes)
            out += self._event("response.content_part.added", item_id=item["id"],
                               content_index=0, part={**self._part(""), "logprobs": []},
                               **at)
        return out

    def _close_item(self) -> bytes:
        item, self.open = self.open, None
        if item is None:
            return b""
        at = {"item_id": item["id"], "output_index": self.items.index(item)}
        item["status"] = "completed"
        if item["type"] == "function_call":
            return (self._event("response.function_call_arguments.done", name=item["name"],
                                arguments=item["arguments"], **at)
                    + self._event("response.output_item.done", item=item,
                                  output_index=at["output_index"]))
        text = item.pop("text")
        item["content"] = [self._part(text)]
        return (self._event("response.output_text.done", text=text, logprobs=[],
                            content_index=0, **at)
                + self._event("response.content_part.done", part=self._part(text),
                              content_index=0, **at)
                + self._event("response.output_item.done", item=item,
                              output_index=at["output_index"]))

    def _text(self, text: str) -> bytes:
        out = b""
        if self.open is None or self.open["type"] != "message":
            out = self._close_item() + self._open_item(self._message_item(None))
        self.open["text"] += text
        return out + self._event("response.output_text.delta", item_id=self.open["id"],
                                 output_index=len(self.items) - 1, content_index=0,
                                 delta=text, logprobs=[])

    def _feed(self, deltas: list[dict]) -> bytes:
        """Events of the parser's deltas (content, or a call's start and arguments)."""
        out = b""
        for d in deltas:
            if d.get("content"):
                out += self._text(d["content"])
            for tc in d.get("tool_calls", []):
                if "id" in tc:                    # a call starts
                    out += self._close_item() + self._open_item(
                        self._call_item(tc, "in_progress"))
                piece = tc["function"]["arguments"]
                if piece:
                    self.open["arguments"] += piece
                    out += self._event("response.function_call_arguments.delta", delta=piece,
                                       item_id=self.open["id"],
                                       output_index=len(self.items) - 1)
        return out

    def _deltas(self, group: int, out: RequestOutput) -> bytes:
        texts = [text for _, _, text, *_ in self._apply(group, out) if text]
        if self.parser is None:
            return b"".join(self._text(t) for t in texts)
        return b"".join(self._feed(self.parser.feed(t)) for t in texts)

    async def events(self, first: tuple[int, RequestOutput] | None,
                     rest: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[bytes]:
        """The stream's body: the events of the module docstring, in order."""
        self.items = []
        try:
            opening = (self._event("response.created", response=self._response("in_progress"))
                       + self._event("response.in_progress",
                                     response=self._response("in_progress")))
            if self.parser is None:              # vLLM opens the message before any text
                opening += self._open_item(self._message_item(None))
            yield opening
            if first is not None and (chunk := self._deltas(*first)):
                yield chunk
            async for group, out in rest:
                if chunk := self._deltas(group, out):
                    yield chunk
            end = self._feed(self.parser.finish()) if self.parser is not None else b""
            if not self.items:                   # nothing at all: an empty message
                end += self._open_item(self._message_item(None))
            yield (end + self._close_item()
                   + self._event("response.completed", response=self._response("completed")))
        except Exception as e:          # after the stream started: OpenAI's error event
            yield self._event("error", code="internal_error", message=f"{type(e).__name__}: {e}",
                              param=None)
        finally:
            await rest.aclose()


def response_context(state, request, body: ResponsesRequest, chat: ChatCompletionRequest,
                     tool_parsing: bool) -> ResponsesContext:
    """The response builder of a `/v1/responses` request (id `resp_<X-Request-Id, the body's
    request_id, or random>`)."""
    return ResponsesContext(body=body, request_id=f"resp_{response_id(request, body)}",
                            model=chat.model, tokenizer=state.tokenizer,
                            created=int(time.time()), tool_parsing=tool_parsing)


# chat request fields -> the /v1/responses fields they came from (errors name the latter)
CHAT_FIELDS = {"max_tokens": "max_output_tokens", "response_format": "text.format",
               "messages": "input"}


def install(app, state, parse, engine_or_503, refuse_if_full, respond) -> None:
    """Add `POST /v1/responses` and `GET /v1/responses/{id}` to `app`, with the server's body
    parser, readiness and capacity checks, and its `respond` (bound to the server's state)."""

    @app.post("/v1/responses")
    async def create_response(request: Request):
        refuse_if_full()
        body = await parse(request, ResponsesRequest, state.http_max_input_size)
        chat = to_chat(body, state.served_model_name)
        adapter = lora.resolve_model(state, chat.model)
        llm = engine_or_503()
        try:
            prompt, so, tool_parsing = await prepare_chat(state, chat)
            ctx = response_context(state, request, body, chat, tool_parsing)
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
