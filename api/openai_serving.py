"""Turning engine outputs into OpenAI responses: what chat and completions share.

Owns: `ResponseContext`, the per-request accumulation (text, token counts, finish reasons per
choice), usage, the token texts of logprobs and `prompt_logprobs`, the chunk envelope; the
rules of the stream (`sse_events`: `finish_reason` once per choice, `include_usage` adds a last
chunk with `choices: []`, an error after the stream started becomes an error chunk, and
`data: [DONE]` always ends it); `merge` of several prompts' streams. The two response shapes
are its subclasses: `api.chat_response.ChatResponse` (`chat.completion[.chunk]`, tool calls)
and `api.completion_response.CompletionResponse` (`text_completion`, echo).

In: an async iterator of `(group, RequestOutput)` — group is the prompt's index for multi-prompt
completions. Out: dicts (JSON bodies) or the SSE body's bytes (`data: <JSON>\n\n` events).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from typing import ClassVar

from api.tools import HermesToolParser
from engine.outputs import RequestOutput


@dataclass
class _Choice:
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list = field(default_factory=list)     # engine.outputs.TokenLogprob
    token_ids: list[int] = field(default_factory=list)
    started: bool = False
    parser: HermesToolParser | None = None     # streamed tool-call parsing


@dataclass(kw_only=True)
class ResponseContext:
    """What one HTTP request needs to build its responses; a subclass gives the shape
    (`object_name`, `chunk_object`, `_choice_chunks`, `_final_choice`, `_final_fields`)."""

    object_name: ClassVar[str]                   # the non-streamed body's `object`
    chunk_object: ClassVar[str]                  # the stream chunks' `object`
    request_id: str
    model: str
    n: int
    tokenizer: object
    num_prompts: int = 1
    include_usage: bool = False
    continuous_usage: bool = False
    want_logprobs: bool = False
    num_logprobs: int = 0                        # top alternatives asked per output token
    echo_texts: list[str] | None = None          # echo: text before each group's output (the
                                                 # prompt; chat: the open last message)
    prompt_ids: list[list[int]] | None = None    # return_token_ids: prompt ids per group
    tokens_as_ids: bool = False                  # return_tokens_as_token_ids
    prompt_lps: dict[int, list] = field(default_factory=dict)   # group -> prompt logprobs
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: list[int] = field(default_factory=list)   # per group
    cached_tokens: list[int] = field(default_factory=list)   # per group: prefix-cache hits
    tokens_details: bool = False                 # --enable-prompt-tokens-details
    choices: dict[int, _Choice] = field(default_factory=dict)

    def choice(self, group: int, index: int) -> tuple[int, _Choice]:
        """The response-wide choice index (`group * n + index`) and its accumulator."""
        i = group * self.n + index
        return i, self.choices.setdefault(i, _Choice())

    def usage(self) -> dict:
        """OpenAI usage in tokens: prompt (all prompts), completion (all choices), total; with
        `tokens_details`, `prompt_tokens_details.cached_tokens` (the prompts' prefix-cache
        hits, as vLLM's `--enable-prompt-tokens-details`)."""
        prompt = sum(self.prompt_tokens)
        completion = sum(c.num_tokens for c in self.choices.values())
        usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                 "total_tokens": prompt + completion}
        if self.tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": sum(self.cached_tokens)}
        return usage

    # ------------------------------------------------------------------ logprobs
    def _token(self, token_id: int, context: list[int] = ()) -> str:
        """A logprob entry's token text: `token_id:N` with return_tokens_as_token_ids, else
        its decoded text as vLLM corrects it (`decode_logprob_token`) after `context`, the
        choice's tokens before this position."""
        if self.tokens_as_ids:                   # vLLM's return_tokens_as_token_ids
            return f"token_id:{token_id}"
        return decode_logprob_token(self.tokenizer, token_id, context)

    @staticmethod
    def _alternatives(entry, k: int) -> list[tuple[int, float]]:
        """vLLM's alternatives of a position: the token itself, then the top ones not already
        listed, the first `k` of them."""
        alts = {entry.token_id: entry.logprob}
        for t, v in entry.top:
            alts.setdefault(t, v)
        return list(alts.items())[:k]

    def prompt_logprobs(self, group: int) -> list | None:
        """vLLM's `prompt_logprobs` of a group: None for the first token, then per token
        `{token id: {logprob, rank, decoded_token}}`, the token first, then its top
        alternatives (ranks 1, 2, ...); None when not asked."""
        entries = self.prompt_lps.get(group)
        if entries is None:
            return None
        out: list = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            d = {str(e.token_id): {"logprob": clamp(e.logprob), "rank": e.rank,
                                   "decoded_token": self.tokenizer.decode([e.token_id])}}
            for rank, (t, v) in enumerate(e.top, 1):
                d.setdefault(str(t), {"logprob": clamp(v), "rank": rank,
                                      "decoded_token": self.tokenizer.decode([t])})
            out.append(d)
        return out

    # ------------------------------------------------------------------ pieces
    def _apply(self, group: int, out: RequestOutput):
        """Fold one RequestOutput in; yields (choice index, choice, delta text, new logprobs,
        finish reason, new token ids)."""
        if len(self.prompt_tokens) <= group:
            grow = [0] * (group + 1 - len(self.prompt_tokens))
            self.prompt_tokens.extend(grow)
            self.cached_tokens.extend(grow)
        self.prompt_tokens[group] = out.num_prompt_tokens
        self.cached_tokens[group] = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_lps[group] = out.prompt_logprobs
        for c in out.outputs:
            i, ch = self.choice(group, c.index)
            ch.text += c.text
            ch.token_ids += c.token_ids
            ch.num_tokens = c.num_output_tokens
            new_lps = c.logprobs or []
            ch.logprobs += new_lps
            if c.finish_reason is not None:
                ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
            yield i, ch, c.text, new_lps, c.finish_reason, c.token_ids

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {"id": self.request_id, "object": self.chunk_object, "created": self.created,
                 "model": self.model, "choices": choices}
        if self.include_usage:
            chunk["usage"] = self.usage() if self.continuous_usage else None
        return chunk

    def opening_chunks(self) -> list[dict]:
        """Chunks a stream starts with before any output (chat: each choice's role)."""
        return []

    def stream_chunks(self, group: int, out: RequestOutput) -> list[dict]:
        """SSE chunks for one RequestOutput."""
        chunks = []
        for i, ch, text, lps, finish, out_ids in self._apply(group, out):
            chunks += self._choice_chunks(group, i, ch, text, lps, finish, out_ids)
        return chunks

    def _choice_chunks(self, group: int, i: int, ch: _Choice, text: str, lps: list,
                       finish: str | None, out_ids: list[int]) -> list[dict]:
        """The chunks of one choice's delta (`text`, new logprobs `lps`, new token ids)."""
        raise NotImplementedError

    def final_body(self) -> dict:
        """The non-streamed response after every output was folded in with `absorb`."""
        choices = []
        for i in sorted(self.choices):
            ch = self.choices[i]
            choices.append(self._final_choice(i, ch))
            if self.prompt_ids is not None:           # return_token_ids (vLLM)
                choices[-1].setdefault("token_ids", ch.token_ids)
        return {"id": self.request_id, "object": self.object_name, "created": self.created,
                "model": self.model, "choices": choices, "usage": self.usage(),
                **self._final_fields()}

    def _final_choice(self, i: int, ch: _Choice) -> dict:
        """One choice of the non-streamed body."""
        raise NotImplementedError

    def _final_fields(self) -> dict:
        """Body fields after `usage`."""
        return {}

    def absorb(self, group: int, out: RequestOutput) -> None:
        """Fold an output into the totals without building chunks (non-streamed responses)."""
        for _ in self._apply(group, out):
            pass


async def merge(streams: list[AsyncIterator[RequestOutput]]
                ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as they produce, tagged with their index."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()     # aborts the request if it is not finished
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, s):
        try:
            async for out in s:
                await queue.put((i, out))
        except Exception as e:       # surfaced to the consumer below
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)    # pumps out of their streams
        for s in streams:
            await s.aclose()


def decode_logprob_token(tokenizer, token_id: int, context: list[int]) -> str:
    """A token's text for logprobs, as vLLM writes it (`v1/engine/logprobs.py:
    _correct_decoded_token`): its own decode, unless that ends in U+FFFD (a byte of an
    unfinished UTF-8 character); then the text it completes after up to 4 tokens of `context`
    (the byte tokens before it, which showed as ""), or "" while the character is unfinished."""
    text = tokenizer.decode([token_id])
    if not text.endswith("\ufffd"):
        return text
    for n in range(1, min(len(context), 4) + 1):
        ctx = list(context[-n:])
        full = tokenizer.decode(ctx + [token_id])
        if full.endswith("\ufffd"):
            continue
        clean = len(ctx)
        while clean > 0 and tokenizer.decode([ctx[clean - 1]]).endswith("\ufffd"):
            clean -= 1
        prefix = tokenizer.decode(ctx[:clean]) if clean else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        common = 0
        for a, b in zip(prefix, full):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""


def clamp(logprob: float) -> float:
    """-inf (a masked token) as the finite number OpenAI and vLLM send instead."""
    return max(logprob, -9999.0)


def _event(obj) -> bytes:
    """One SSE event of `obj` in compact JSON, as vLLM frames its chunks:
    `data: {"id":"cmpl-..."}\\n\\n`."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def sse_events(ctx: ResponseContext, first: tuple[int, RequestOutput] | None,
                     rest: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[bytes]:
    """The stream's body, framed (`data: <JSON>\\n\\n`, UTF-8): its chunks — those of one
    engine output joined into one piece, so that it is one `send` — usage, errors, then
    `data: [DONE]`."""
    def output(group: int, out: RequestOutput) -> bytes:
        return b"".join(map(_event, ctx.stream_chunks(group, out)))

    try:
        for chunk in ctx.opening_chunks():
            yield _event(chunk)
        if first is not None and (body := output(*first)):
            yield body
        async for group, out in rest:
            if body := output(group, out):
                yield body
        if ctx.include_usage:
            yield _event({"id": ctx.request_id, "object": ctx.chunk_object,
                          "created": ctx.created, "model": ctx.model, "choices": [],
                          "usage": ctx.usage()})
    except Exception as e:           # after the stream started: an error chunk, then [DONE]
        yield _event({"error": {"message": f"{type(e).__name__}: {e}",
                                "type": "internal_error", "param": None, "code": None}})
    finally:
        await rest.aclose()
    yield b"data: [DONE]\n\n"
