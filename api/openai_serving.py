"""Turning engine outputs into OpenAI responses: one JSON body, or SSE chunks.

Owns: the per-request accumulation (text, token counts, finish reasons per choice), the chunk
shapes of `chat.completion.chunk` and `text_completion`, usage, logprobs in OpenAI's two
formats, and the rules of the stream (the role rides on each choice's first chunk,
`finish_reason` once per choice, `include_usage` adds a last chunk with `choices: []`, an error
after the stream started becomes an error chunk, and `data: [DONE]` always ends it).

In: an async iterator of `(group, RequestOutput)` — group is the prompt's index for multi-prompt
completions. Out: dicts (JSON bodies) or SSE `data:` payload strings.

Tool calls (`tool_parsing`): each chat choice's text goes through an `api.tools.HermesToolParser`,
streamed or not, so `tool_calls` arrive in OpenAI's shape and a choice that called a tool ends
with finish_reason "tool_calls".
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from api.tools import HermesToolParser
from engine.outputs import RequestOutput, TokenLogprob


@dataclass
class _Choice:
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    started: bool = False
    parser: HermesToolParser | None = None     # streamed tool-call parsing


@dataclass
class ResponseContext:
    """What one HTTP request needs to build its responses."""

    request_id: str
    model: str
    chat: bool
    n: int
    num_prompts: int
    tokenizer: object
    include_usage: bool = False
    continuous_usage: bool = False
    want_logprobs: bool = False
    num_logprobs: int = 0                        # top alternatives asked per output token
    echo_texts: list[str] | None = None          # echo: text before each group's output (the
                                                 # prompt; chat: the open last message)
    tool_parsing: bool = False                   # chat: parse hermes tool calls
    prompt_ids: list[list[int]] | None = None    # return_token_ids: prompt ids per group
    tokens_as_ids: bool = False                  # return_tokens_as_token_ids
    echo_ids: list[list[int]] | None = None      # completions echo: each group's prompt ids
    prompt_lps: dict[int, list] = field(default_factory=dict)   # group -> prompt logprobs
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: list[int] = field(default_factory=list)   # per group
    choices: dict[int, _Choice] = field(default_factory=dict)

    def choice(self, group: int, index: int) -> tuple[int, _Choice]:
        """The response-wide choice index (`group * n + index`) and its accumulator."""
        i = group * self.n + index
        return i, self.choices.setdefault(i, _Choice())

    def usage(self) -> dict:
        """OpenAI usage in tokens: prompt (all prompts), completion (all choices), total."""
        prompt = sum(self.prompt_tokens)
        completion = sum(c.num_tokens for c in self.choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

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

    def chat_logprobs(self, lps: list[TokenLogprob], before: list[int] = ()) -> dict | None:
        """Chat format: `{"content": [{token, logprob, bytes, top_logprobs}]}`, or None if not
        asked; `top_logprobs` as vLLM lists them (see `_alternatives`); `before`: the choice's
        tokens before `lps`."""
        if not self.want_logprobs:
            return None
        content, context = [], list(before)
        for lp in lps:
            tok = self._token(lp.token_id, context)
            tops = [(self._token(t, context), v) for t, v in self._alternatives(
                lp, self.num_logprobs)]
            content.append({"token": tok, "logprob": _clamp(lp.logprob),
                            "bytes": list(tok.encode("utf-8")),
                            "top_logprobs": [{"token": t, "logprob": _clamp(v),
                                              "bytes": list(t.encode("utf-8"))}
                                             for t, v in tops]})
            context.append(lp.token_id)
        return {"content": content}

    def completion_logprobs(self, lps: list[TokenLogprob], offset: int,
                            group: int | None = None, before: list[int] = ()) -> dict | None:
        """Completions format (tokens, token_logprobs, top_logprobs: the token and `logprobs`
        alternatives, text_offset in characters from `offset`), or None; `before`: the
        choice's tokens before `lps`. With `group` (an echo), the group's prompt tokens come
        first, scored by its prompt logprobs (the first token has none), as vLLM echoes them."""
        if not self.want_logprobs:
            return None
        rows: list = [(lp.token_id, lp) for lp in lps]
        if group is not None and self.echo_ids is not None:
            rows = list(zip(self.echo_ids[group], self.prompt_lps.get(group) or [])) + rows
        k = self.num_logprobs + 1
        tokens, tops, context = [], [], list(before)
        for t, e in rows:
            tokens.append(self._token(t, context))
            tops.append(None if e is None else {self._token(a, context): _clamp(v)
                                                for a, v in self._alternatives(e, k)})
            context.append(t)
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens,
                "token_logprobs": [None if e is None else _clamp(e.logprob) for _, e in rows],
                "top_logprobs": tops, "text_offset": offsets}

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
            d = {str(e.token_id): {"logprob": _clamp(e.logprob), "rank": e.rank,
                                   "decoded_token": self.tokenizer.decode([e.token_id])}}
            for rank, (t, v) in enumerate(e.top, 1):
                d.setdefault(str(t), {"logprob": _clamp(v), "rank": rank,
                                      "decoded_token": self.tokenizer.decode([t])})
            out.append(d)
        return out

    # ------------------------------------------------------------------ pieces
    def _apply(self, group: int, out: RequestOutput):
        """Fold one RequestOutput in; yields (choice index, choice, delta text, new logprobs,
        finish reason, new token ids)."""
        if len(self.prompt_tokens) <= group:
            self.prompt_tokens.extend([0] * (group + 1 - len(self.prompt_tokens)))
        self.prompt_tokens[group] = out.num_prompt_tokens
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

    @property
    def chunk_object(self) -> str:
        """The `object` of this response's stream chunks."""
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {"id": self.request_id, "object": self.chunk_object, "created": self.created,
                 "model": self.model, "choices": choices}
        if self.include_usage:
            chunk["usage"] = self.usage() if self.continuous_usage else None
        return chunk

    def stream_chunks(self, group: int, out: RequestOutput) -> list[dict]:
        """SSE chunks for one RequestOutput."""
        chunks = []
        for i, ch, text, lps, finish, out_ids in self._apply(group, out):
            if self.chat and self.tool_parsing:
                chunks += self._tool_chunks(i, ch, text, lps, finish)
                continue
            if self.chat:
                delta: dict = {}
                if not ch.started:
                    delta["role"] = "assistant"
                delta["content"] = text        # (an echo went out in a chunk of its own)
                body = {"index": i, "delta": delta, "finish_reason": finish,
                        "logprobs": self.chat_logprobs(lps, ch.token_ids[:len(ch.token_ids)
                                                                         - len(out_ids)])}
            else:
                echo = self.echo_texts[group] if self.echo_texts is not None else ""
                prefix = "" if ch.started else echo        # the prompt rides on the first chunk
                offset = len(echo) + len(ch.text) - len(text)
                before = ch.token_ids[:len(ch.token_ids) - len(out_ids)]
                body = {"index": i, "text": prefix + text, "finish_reason": finish,
                        "logprobs": self.completion_logprobs(lps, offset, before=before)
                        if ch.started or self.echo_ids is None
                        else self.completion_logprobs(lps, 0, group)}
            if finish is not None or not self.chat:     # completions: in every chunk (vLLM)
                body["stop_reason"] = ch.stop_reason if finish is not None else None
            if self.prompt_ids is not None:         # return_token_ids
                body["token_ids"] = out_ids
                if not ch.started and not self.chat:
                    body["prompt_token_ids"] = self.prompt_ids[group]
            ch.started = True
            if text or finish is not None or lps or "role" in body.get("delta", {}):
                chunks.append(self._chunk([body]))
        return chunks

    def _tool_chunks(self, i: int, ch: _Choice, text: str, lps: list, finish) -> list[dict]:
        """Chunks of one chat choice's delta through its tool-call parser: one chunk per parser
        delta (content or tool_calls), the logprobs on the first, finish_reason on the last."""
        if ch.parser is None:
            ch.parser = HermesToolParser()
        deltas = ch.parser.feed(text) + (ch.parser.finish() if finish is not None else [])
        if finish is not None:
            deltas = deltas or [{}]
            finish = self._tool_finish(ch, finish)
        elif not deltas and (lps or not ch.started):
            deltas = [{"content": ""}]
        chunks = []
        for k, delta in enumerate(deltas):
            if not ch.started:
                delta = {"role": "assistant", **delta}
                ch.started = True
            last = k == len(deltas) - 1
            body = {"index": i, "delta": delta,
                    "logprobs": self.chat_logprobs(lps, ch.token_ids[:len(ch.token_ids)
                                                                     - len(lps)])
                    if k == 0 else None,
                    "finish_reason": finish if last else None}
            if last and finish is not None:
                body["stop_reason"] = ch.stop_reason
            chunks.append(self._chunk([body]))
        return chunks

    @staticmethod
    def _tool_finish(ch: _Choice, finish: str) -> str:
        """"tool_calls" for a choice that stopped after calling a tool."""
        return "tool_calls" if finish == "stop" and ch.parser and ch.parser.calls else finish

    def _chat_message(self, ch: _Choice) -> tuple[dict, str | None]:
        """The non-streamed message of a chat choice, and its finish_reason."""
        if not self.tool_parsing:
            echo = self.echo_texts[0] if self.echo_texts is not None else ""
            return {"role": "assistant", "content": echo + ch.text}, ch.finish_reason
        ch.parser = HermesToolParser()
        deltas = ch.parser.feed(ch.text) + ch.parser.finish()
        content = "".join(d.get("content", "") for d in deltas)
        message = {"role": "assistant",
                   "content": content if content.strip() or not ch.parser.calls else None}
        if ch.parser.calls:
            message["tool_calls"] = ch.parser.calls
        return message, self._tool_finish(ch, ch.finish_reason)

    def final_body(self) -> dict:
        """The non-streamed response after every output was folded in with `absorb`."""
        choices = []
        for i in sorted(self.choices):
            ch = self.choices[i]
            if self.chat:
                message, finish = self._chat_message(ch)
                choices.append({"index": i, "message": message,
                                "logprobs": self.chat_logprobs(ch.logprobs),
                                "finish_reason": finish, "stop_reason": ch.stop_reason})
            else:
                g = i // self.n
                echo = self.echo_texts is not None
                choices.append({"index": i, "text": (self.echo_texts[g] if echo else "") + ch.text,
                                "logprobs": self.completion_logprobs(
                                    ch.logprobs, 0 if self.echo_ids is not None else
                                    len(self.echo_texts[g]) if echo else 0,
                                    g if echo else None),
                                "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason,
                                "prompt_logprobs": self.prompt_logprobs(g)})
                if self.prompt_ids is not None:
                    choices[-1]["prompt_token_ids"] = self.prompt_ids[i // self.n]
            if self.prompt_ids is not None:           # return_token_ids (vLLM)
                choices[-1]["token_ids"] = ch.token_ids
        body = {"id": self.request_id, "object": "chat.completion" if self.chat else
                "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}
        if self.chat and self.prompt_ids is not None:
            body["prompt_token_ids"] = self.prompt_ids[0]
        if self.chat:
            body["prompt_logprobs"] = self.prompt_logprobs(0)
        return body

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


def _clamp(logprob: float) -> float:
    """-inf (a masked token) as the finite number OpenAI and vLLM send instead."""
    return max(logprob, -9999.0)


def _dumps(obj) -> str:
    """Compact JSON, as vLLM writes its chunks (`{"id":"cmpl-..."`)."""
    return json.dumps(obj, separators=(",", ":"))


async def sse_events(ctx: ResponseContext, first: tuple[int, RequestOutput] | None,
                     rest: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
    """SSE `data:` payloads: the stream's chunks, usage, errors, then `[DONE]`."""
    try:
        if ctx.chat:
            for g in range(ctx.num_prompts):
                for k in range(ctx.n):
                    i, ch = ctx.choice(g, k)
                    ch.started = True
                    first_chunk = ctx._chunk([{"index": i, "delta": {"role": "assistant",
                                                                     "content": ""},
                                               "logprobs": None, "finish_reason": None}])
                    if ctx.prompt_ids is not None:     # return_token_ids: the prompt's, once
                        first_chunk["prompt_token_ids"] = ctx.prompt_ids[g]
                    yield _dumps(first_chunk)
                    if ctx.echo_texts is not None:     # echo: the open message, a chunk alone
                        yield _dumps(ctx._chunk([{"index": i, "delta": {
                            "content": ctx.echo_texts[g]}, "logprobs": None,
                            "finish_reason": None}]))
        if first is not None:
            for chunk in ctx.stream_chunks(*first):
                yield _dumps(chunk)
        async for group, out in rest:
            for chunk in ctx.stream_chunks(group, out):
                yield _dumps(chunk)
        if ctx.include_usage:
            yield _dumps({"id": ctx.request_id, "object": ctx.chunk_object,
                              "created": ctx.created, "model": ctx.model, "choices": [],
                              "usage": ctx.usage()})
    except Exception as e:           # after the stream started: an error chunk, then [DONE]
        yield _dumps({"error": {"message": f"{type(e).__name__}: {e}",
                                    "type": "internal_error", "param": None, "code": None}})
    finally:
        await rest.aclose()
    yield "[DONE]"
