"""vLLM's tokenizer routes: `POST /tokenize` and `POST /detokenize` (vLLM's
`vllm/entrypoints/serve/tokenize`), answered with the served model's own tokenizer and chat
template, so that a client counts and builds prompts exactly as the engine will see them.

Owns: the three request bodies (a text prompt, a conversation, token ids) and the two routes.

Data flow: JSON body → `_parse` (the server's: unknown fields dropped with vLLM's warning, or
refused under `--strict-openai`) → the `model` checked (absent, the served model or a LoRA
adapter; else vLLM's 404) →
- `/tokenize` with `prompt`: `tokenizer.encode(prompt, add_special_tokens)` (default true);
  with `messages` (a chat body wins when both are given, as in vLLM): the conversation rendered
  as `/v1/chat/completions` renders it (`api.chat.render_chat`: `add_generation_prompt`
  default true, `continue_final_message`, `tools`, `chat_template_kwargs`, a request
  `chat_template` only with `--trust-request-chat-template`; `add_special_tokens` default
  false) → `{"count", "max_model_len", "tokens", "token_strs"}`; `token_strs` (the
  vocabulary's token strings) only with `return_token_strs`, else null. No length limit: a
  prompt longer than `max_model_len` is counted, not refused (vLLM's behaviour).
- `/detokenize`: token ids (each 0..2^63-1) → `{"prompt": tokenizer.decode(tokens)}`, special
  tokens kept; ids outside the vocabulary decode to nothing, and ids past 32 bits are a 400
  (the tokenizer's own limit, vLLM's status).

Like vLLM, these routes sit outside `/v1`, so `--api-key` does not guard them. They need the
model's tokenizer: 503 while the engine loads, 404 with `--no-llm`. Errors are OpenAI-shaped
400s naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Request
from pydantic import BaseModel, Field, model_validator

from api import lora
from api.chat import render_chat
from api.errors import bad_request
from api.protocol import ChatMessage, Tool
from scheduler.request import ParamError


class TokenizeCompletionRequest(BaseModel):
    """`POST /tokenize` with a text `prompt` (vLLM's TokenizeCompletionRequest)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    """`POST /tokenize` with a conversation (vLLM's TokenizeChatRequest)."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(None, max_length=128)

    @model_validator(mode="after")
    def _check(self):
        if not self.messages:
            raise ParamError("Cannot apply chat template to an empty conversation. Provide at "
                             "least one message.", "messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise ParamError("Cannot set both `continue_final_message` and "
                             "`add_generation_prompt` to True.", "continue_final_message")
        return self


class DetokenizeRequest(BaseModel):
    """`POST /detokenize` (vLLM's DetokenizeRequest)."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=2 ** 63 - 1)]]


# `/openapi.json`'s view of the bodies (api/openapi.py): component schemas and each route's
SCHEMAS = {"TokenizeCompletionRequest": TokenizeCompletionRequest,
           "TokenizeChatRequest": TokenizeChatRequest, "DetokenizeRequest": DetokenizeRequest,
           "TokenizeRequest": {"anyOf": [{"$ref": "#/components/schemas/TokenizeChatRequest"},
                                         {"$ref": "#/components/schemas/"
                                                  "TokenizeCompletionRequest"}]}}
BODIES = {("post", "/tokenize"): "TokenizeRequest", ("post", "/detokenize"): "DetokenizeRequest"}


def tokenize_body(data: dict) -> type[BaseModel]:
    """The `/tokenize` body class of a JSON object: a conversation where `messages` is given
    (also beside a `prompt`, as vLLM picks), else a text prompt."""
    return TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest


def install(app, state, parse, engine_or_503) -> None:
    """Add `/tokenize` and `/detokenize` to `app`. `parse(request, model, limit)` is the
    server's body parser; `engine_or_503()` raises the server's 404 / 503 while no model's
    tokenizer is there."""

    def checked(model: str | None) -> None:
        engine_or_503()
        if model is not None:
            lora.resolve_model(state, model)         # 404 in vLLM's words for another name

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await parse(request, tokenize_body, state.http_max_input_size)
        checked(body.model)
        if isinstance(body, TokenizeChatRequest):
            tokens = render_chat(state, body)
        else:
            tokens = state.tokenizer.encode(body.prompt,
                                            add_special_tokens=body.add_special_tokens)
        strs = state.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": state.info["max_model_len"],
                "tokens": tokens, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await parse(request, DetokenizeRequest, state.http_max_input_size)
        checked(body.model)
        try:
            return {"prompt": state.tokenizer.decode(body.tokens)}
        except OverflowError as e:                   # an id past the tokenizer's 32 bits
            raise bad_request(f"tokens: {e}", "tokens") from None
