"""From a parsed request body to the engine's input: chat prompt, output constraint, tool mode.

Owns: rendering the conversation (and `tools`) through the chat template — the model's own or
`--chat-template` — and choosing the one output constraint of a request (`response_format`,
`structured_outputs`, or the grammar of a `required` / named `tool_choice`), checked by compiling
it off the event loop (`GrammarCompiler`, cached per distinct constraint) so that a bad schema
is a 400 before any work reaches the engine.

In: `ChatCompletionRequest` / `CompletionRequest` and the server's state (tokenizer, compiler,
tool flags). Out: prompt token ids (tokenized with or without special tokens, truncated as
`truncate_prompt_tokens` asks), a `StructuredOutputs` or None, whether to parse tool calls, and
the response id. Errors: `APIError` 400 naming the field.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

from api.errors import bad_request
from api.chat_response import ChatResponse
from api.completion_response import CompletionResponse
from api.protocol import ChatCompletionRequest, CompletionRequest
from api.tools import (system_for_developer, template_messages, template_tools,
                       tool_constraint, tool_mode)
from scheduler.request import ParamError, SamplingParams, StructuredOutputs


async def checked_constraint(compiler, so: StructuredOutputs | None, field: str | None) -> None:
    """Compile `so` in a worker thread (once per distinct constraint: cached).
    Raises: APIError 400 naming `field` when it does not compile."""
    if so is None or compiler is None:
        return
    if not compiler.cached(so):
        try:
            await asyncio.to_thread(compiler.compile, so, field)
        except ParamError as e:
            raise bad_request(str(e), e.param) from None


async def request_constraint(state, body) -> StructuredOutputs | None:
    """The checked `response_format` / `structured_outputs` constraint of a completions body."""
    try:
        so, field = body.constraint()
    except ParamError as e:
        raise bad_request(str(e), e.param) from None
    await checked_constraint(state.grammars, so, field)
    return so


async def prepare_chat(state, body: ChatCompletionRequest
                       ) -> tuple[list[int], StructuredOutputs | None, bool]:
    """(prompt token ids, output constraint, parse tool calls?) of a chat request.
    Raises: APIError 400 (bad tool choice, conflicting constraints, a template that rejects
    the conversation, a constraint that does not compile)."""
    try:
        mode = tool_mode(body, state.config.enable_auto_tool_choice)
        so, field = body.constraint()
        tool_so = tool_constraint(body, mode)
        if tool_so is not None and so is not None:
            raise ParamError(f"{field} cannot be combined with tool_choice {mode!r}", field)
    except ParamError as e:
        raise bad_request(str(e), e.param) from None
    if tool_so is not None:
        so, field = tool_so, "tools"
    prompt = render_chat(state, body)
    await checked_constraint(state.grammars, so, field)
    return _truncated(state, body, prompt), so, mode is not None


def render_chat(state, body) -> list[int]:
    """The token ids of a conversation: `body.messages` (and `tools`) through the chat template
    (the request's `chat_template` only with `--trust-request-chat-template`, else
    `--chat-template` or the model's, with `chat_template_kwargs`, `add_generation_prompt`,
    `continue_final_message`), then tokenized with `add_special_tokens`. `body`: a chat
    completions or a chat `/tokenize` body. Raises: APIError 400 (an untrusted template, a
    template that rejects the conversation)."""
    kwargs = dict(body.chat_template_kwargs or {})       # the template's own variables
    if body.tools:
        kwargs["tools"] = template_tools(body)
    if body.chat_template is not None and not state.config.trust_request_chat_template:
        raise bad_request("Chat template is passed with request, but "
                          "--trust-request-chat-template is not set. Refused request with "
                          "untrusted chat template.", "chat_template")
    template = body.chat_template or state.config.chat_template
    if template is not None:
        kwargs["chat_template"] = template
    messages = system_for_developer(template_messages(body),
                                    str(template or state.tokenizer.chat_template or ""))
    try:
        text = state.tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, tokenize=False, **kwargs)
    except Exception as e:       # a template that rejects the conversation
        raise bad_request(f"chat template failed: {e}", "messages") from None
    return state.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)


def completion_prompts(state, body: CompletionRequest) -> tuple[list, list[list[int]]]:
    """(the prompts as given, their token ids): text tokenized with `add_special_tokens`, each
    truncated as `truncate_prompt_tokens` asks. Raises: APIError 400 naming the field."""
    try:
        raw = body.prompts()
    except ValueError as e:
        raise bad_request(str(e), "prompt") from None
    prompts = [_truncated(state, body, state.tokenizer.encode(
                   p, add_special_tokens=body.add_special_tokens)
                   if isinstance(p, str) else list(p)) for p in raw]
    if any(not p for p in prompts):
        raise bad_request("prompt must not be empty", "prompt")
    return raw, prompts


def engine_params(state, body, prompt: list[int], so=None,
                  lora_name: str | None = None) -> SamplingParams:
    """The engine's `SamplingParams` of a body (max_tokens defaults to what `prompt` leaves of
    max_model_len; `bad_words` tokenized as vLLM does; `lora_name` the adapter the `model`
    field named). Raises: APIError 400 naming the field."""
    default_max = max(1, state.info["max_model_len"] - len(prompt))
    try:
        params = replace(body.to_sampling_params(default_max, so), lora_name=lora_name)
        if body.bad_words:
            params = replace(params, bad_words_token_ids=bad_words_token_ids(
                state.tokenizer, body.bad_words))
        return params
    except ValueError as e:
        raise bad_request(str(e), getattr(e, "param", None)) from None


MAX_BAD_WORDS = 128              # vLLM's VLLM_MAX_NUM_BAD_WORDS default


def bad_words_token_ids(tokenizer, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token ids as it starts a text and, where that tokenizes differently
    into as many tokens, after a space (vLLM's SamplingParams.update_from_tokenizer).
    Raises ParamError: a word with no tokens, more than MAX_BAD_WORDS sequences."""
    out: list[list[int]] = []
    for word in dict.fromkeys(words):
        for spaced in (False, True):
            ids = tokenizer.encode((" " if spaced else "") + word.lstrip(),
                                   add_special_tokens=False)
            if not ids:
                if not spaced:
                    raise ParamError("bad_words entries must tokenize to at least one token.",
                                     "bad_words")
                continue
            if not spaced or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
                if len(out) > MAX_BAD_WORDS:
                    raise ParamError(f"Too many bad words after tokenization: {len(out)}. "
                                     f"The max number is {MAX_BAD_WORDS}.", "bad_words")
    return tuple(tuple(ids) for ids in out)


def _truncated(state, body, prompt: list[int]) -> list[int]:
    try:
        return body.truncated(prompt, state.info["max_model_len"])
    except ParamError as e:
        raise bad_request(str(e), e.param) from None


def chat_context(state, request, body: ChatCompletionRequest, prompt: list[int],
                 tool_parsing: bool) -> ChatResponse:
    """The response builder of a chat request: its id, echo (the open last assistant message,
    as vLLM echoes it), logprobs and token-id options."""
    echo = None
    last = body.messages[-1]
    if body.echo and last.role == "assistant":
        echo = [last.text()]
    return ChatResponse(request_id=f"chatcmpl-{response_id(request, body)}", model=body.model,
                        n=body.n, tokenizer=state.tokenizer, want_logprobs=body.logprobs,
                        num_logprobs=body.top_logprobs or 0, echo_texts=echo,
                        tool_parsing=tool_parsing,
                        tokens_details=state.config.enable_prompt_tokens_details,
                        prompt_ids=[prompt] if body.return_token_ids else None,
                        tokens_as_ids=body.return_tokens_as_token_ids)


def completion_context(state, request, body: CompletionRequest, raw: list,
                       prompts: list[list[int]]) -> CompletionResponse:
    """The response builder of a completions request (`raw`: the prompts as given)."""
    echo = None
    if body.echo:
        echo = [p if isinstance(p, str) else state.tokenizer.decode(p) for p in raw]
    return CompletionResponse(request_id=f"cmpl-{response_id(request, body)}",
                              model=body.model, n=body.n, num_prompts=len(prompts),
                              tokenizer=state.tokenizer,
                              want_logprobs=body.logprobs is not None, echo_texts=echo,
                              num_logprobs=body.logprobs or 0,
                              echo_ids=prompts if body.echo else None, echo_only=body.echo_only,
                              tokens_details=state.config.enable_prompt_tokens_details,
                              prompt_ids=prompts if body.return_token_ids else None,
                              tokens_as_ids=body.return_tokens_as_token_ids)


def response_id(request, body) -> str:
    """The id after `cmpl-` / `chatcmpl-`: the `X-Request-Id` header, else the body's
    `request_id`, else a random one (vLLM's order)."""
    return request.headers.get("X-Request-Id") or body.request_id or uuid.uuid4().hex
