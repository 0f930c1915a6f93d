"""The chat completion's response shape: `chat.completion` bodies and `chat.completion.chunk`
streams, over `api.openai_serving.ResponseContext`.

Owns: the chat logprobs format (`{"content": [{token, logprob, bytes, top_logprobs}]}`), the
role on each choice's first chunk (a stream opens with one per choice, then the echoed open
message in a chunk of its own), and tool calls (`tool_parsing`): each choice's text goes
through an `api.tools.HermesToolParser`, streamed or not, so `tool_calls` arrive in OpenAI's
shape and a choice that called a tool ends with finish_reason "tool_calls".
In: `RequestOutput` deltas (`stream_chunks` / `absorb`). Out: dicts in OpenAI's shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

from api.openai_serving import ResponseContext, _Choice, clamp
from api.tools import HermesToolParser
from engine.outputs import TokenLogprob


@dataclass(kw_only=True)
class ChatResponse(ResponseContext):
    """A chat request's responses (see the module docstring); `tool_parsing`: parse hermes
    tool calls out of the text."""

    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    tool_parsing: bool = False

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
            content.append({"token": tok, "logprob": clamp(lp.logprob),
                            "bytes": list(tok.encode("utf-8")),
                            "top_logprobs": [{"token": t, "logprob": clamp(v),
                                              "bytes": list(t.encode("utf-8"))}
                                             for t, v in tops]})
            context.append(lp.token_id)
        return {"content": content}

    def opening_chunks(self) -> list[dict]:
        """Each choice's first chunk (its role, empty content; the prompt's token ids with
        return_token_ids), then the echoed open message in a chunk of its own."""
        chunks = []
        for g in range(self.num_prompts):
            for k in range(self.n):
                i, ch = self.choice(g, k)
                ch.started = True
                first = self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                if self.prompt_ids is not None:
                    first["prompt_token_ids"] = self.prompt_ids[g]
                chunks.append(first)
                if self.echo_texts is not None:
                    chunks.append(self._chunk([{"index": i, "delta": {
                        "content": self.echo_texts[g]}, "logprobs": None,
                        "finish_reason": None}]))
        return chunks

    def _choice_chunks(self, group: int, i: int, ch: _Choice, text: str, lps: list,
                       finish: str | None, out_ids: list[int]) -> list[dict]:
        if self.tool_parsing:
            return self._tool_chunks(i, ch, text, lps, finish)
        delta: dict = {}
        if not ch.started:
            delta["role"] = "assistant"
        delta["content"] = text            # (an echo went out in a chunk of its own)
        body = {"index": i, "delta": delta, "finish_reason": finish,
                "logprobs": self.chat_logprobs(lps, ch.token_ids[:len(ch.token_ids)
                                                                 - len(out_ids)])}
        if finish is not None:
            body["stop_reason"] = ch.stop_reason
        if self.prompt_ids is not None:    # return_token_ids
            body["token_ids"] = out_ids
        ch.started = True
        return [self._chunk([body])] if text or finish is not None or lps or "role" in delta \
            else []

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

    def _message(self, ch: _Choice) -> tuple[dict, str | None]:
        """The non-streamed message of a choice, and its finish_reason."""
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

    def _final_choice(self, i: int, ch: _Choice) -> dict:
        message, finish = self._message(ch)
        return {"index": i, "message": message, "logprobs": self.chat_logprobs(ch.logprobs),
                "finish_reason": finish, "stop_reason": ch.stop_reason}

    def _final_fields(self) -> dict:
        fields = {"prompt_token_ids": self.prompt_ids[0]} if self.prompt_ids is not None else {}
        return {**fields, "prompt_logprobs": self.prompt_logprobs(0)}
