"""The completions response shape: `text_completion` bodies and streams, over
`api.openai_serving.ResponseContext`.

Owns: the completions logprobs format (tokens, token_logprobs, top_logprobs, text_offset),
echo (the prompt's text before each group's output, and with logprobs its tokens scored by
the prompt logprobs, as vLLM echoes them), `stop_reason` in every chunk (vLLM), and the
prompt's token ids on each choice's first chunk with return_token_ids.
In: `RequestOutput` deltas of one or several prompts (`group`). Out: dicts in OpenAI's shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

from api.openai_serving import ResponseContext, _Choice, clamp
from engine.outputs import TokenLogprob


@dataclass(kw_only=True)
class CompletionResponse(ResponseContext):
    """A completions request's responses (see the module docstring); `echo_ids`: each
    group's prompt ids when echoing."""

    object_name = "text_completion"
    chunk_object = "text_completion"
    echo_ids: list[list[int]] | None = None
    echo_only: bool = False           # echo with max_tokens 0: the generated token left out

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
            tops.append(None if e is None else {self._token(a, context): clamp(v)
                                                for a, v in self._alternatives(e, k)})
            context.append(t)
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens,
                "token_logprobs": [None if e is None else clamp(e.logprob) for _, e in rows],
                "top_logprobs": tops, "text_offset": offsets}

    def _choice_chunks(self, group: int, i: int, ch: _Choice, text: str, lps: list,
                       finish: str | None, out_ids: list[int]) -> list[dict]:
        if self.echo_only:                # the prompt, then the finish; the token left out
            text, lps, out_ids = "", [], []
            finish = "length" if finish is not None else None
        echo = self.echo_texts[group] if self.echo_texts is not None else ""
        prefix = "" if ch.started else echo        # the prompt rides on the first chunk
        offset = len(echo) + len(ch.text) - len(text)
        before = ch.token_ids[:len(ch.token_ids) - len(out_ids)]
        body = {"index": i, "text": prefix + text, "finish_reason": finish,
                "logprobs": self.completion_logprobs(lps, offset, before=before)
                if ch.started or self.echo_ids is None
                else self.completion_logprobs(lps, 0, group),
                "stop_reason": ch.stop_reason if finish is not None else None}
        if self.prompt_ids is not None:             # return_token_ids
            body["token_ids"] = out_ids
            if not ch.started:
                body["prompt_token_ids"] = self.prompt_ids[group]
        ch.started = True
        return [self._chunk([body])] if text or finish is not None or lps else []

    def _final_choice(self, i: int, ch: _Choice) -> dict:
        g = i // self.n
        echo = self.echo_texts is not None
        offset = 0 if self.echo_ids is not None else len(self.echo_texts[g]) if echo else 0
        if self.echo_only:                # the prompt alone (see CompletionRequest.echo_only)
            return {"index": i, "text": self.echo_texts[g],
                    "logprobs": self.completion_logprobs([], 0, g), "finish_reason": "length",
                    "stop_reason": None, "prompt_logprobs": self.prompt_logprobs(g),
                    **({"prompt_token_ids": self.prompt_ids[g], "token_ids": self.prompt_ids[g]}
                       if self.prompt_ids is not None else {})}
        choice = {"index": i, "text": (self.echo_texts[g] if echo else "") + ch.text,
                  "logprobs": self.completion_logprobs(ch.logprobs, offset,
                                                       g if echo else None),
                  "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason,
                  "prompt_logprobs": self.prompt_logprobs(g)}
        if self.prompt_ids is not None:
            choice["prompt_token_ids"] = self.prompt_ids[g]
        return choice
