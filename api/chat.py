"""From a parsed request body to the engine's input: chat prompt, output constraint, tool mode.

Owns: rendering the conversation (and `tools`) through the chat template — the model's own or
`--chat-template` — and choosing the one output constraint of a request (`response_format`,
`structured_outputs`, or the grammar of a `required` / named `tool_choice`), checked by compiling
it off the event loop (`GrammarCompiler`, cached per distinct constraint) so that a bad schema
is a 400 before any work reaches the engine.

In: `ChatCompletionRequest` / `CompletionRequest` and the server's state (tokenizer, compiler,
tool flags). Out: prompt token ids, a `StructuredOutputs` or None, and whether to parse tool
calls. Errors: `APIError` 400 naming the field.
"""

from __future__ import annotations

import asyncio

from api.errors import bad_request
from api.protocol import ChatCompletionRequest
from api.tools import template_messages, template_tools, tool_constraint, tool_mode
from scheduler.request import ParamError, StructuredOutputs


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
    kwargs = {"tools": template_tools(body)} if body.tools else {}
    if state.config.chat_template is not None:
        kwargs["chat_template"] = state.config.chat_template
    try:
        ids = state.tokenizer.apply_chat_template(
            template_messages(body), add_generation_prompt=body.add_generation_prompt,
            **kwargs)
    except Exception as e:       # a template that rejects the conversation
        raise bad_request(f"chat template failed: {e}", "messages") from None
    await checked_constraint(state.grammars, so, field)
    prompt = list(ids if isinstance(ids, list) else ids["input_ids"])
    return prompt, so, mode is not None
