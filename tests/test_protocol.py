"""OpenAI protocol models: validation and translation to SamplingParams (no server)."""

import pytest
from pydantic import ValidationError

from api.protocol import ChatCompletionRequest, CompletionRequest, UnsupportedFieldError
from api.server import _validation_error

CHAT = [{"role": "user", "content": "hi"}]


def test_chat_defaults_and_translation():
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": CHAT, "max_completion_tokens": 7, "stop": "END", "seed": 3,
         "logit_bias": {"42": -5}, "logprobs": True, "top_logprobs": 4, "top_k": 5,
         "repetition_penalty": 1.2, "min_tokens": 2, "ignore_eos": True,
         "stop_token_ids": [9]})
    p = req.to_sampling_params(default_max_tokens=100)
    assert (p.max_tokens, p.stop, p.seed, p.logit_bias, p.logprobs) == (7, ("END",), 3,
                                                                        {42: -5.0}, 4)
    assert (p.top_k, p.repetition_penalty, p.min_tokens, p.ignore_eos, p.stop_token_ids) == \
        (5, 1.2, 2, True, (9,))
    assert ChatCompletionRequest.model_validate(
        {"model": "m", "messages": CHAT}).to_sampling_params(100).max_tokens == 100


def test_text_parts_are_joined_as_vllm_joins_them():
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": None},
                                     {"type": "refusal", "refusal": "b"}]}]})
    assert req.messages[0].text() == "a\nb"            # newline-joined, a part without text skipped


@pytest.mark.parametrize("prompt,expected", [
    ("x", ["x"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_completion_prompt_forms(prompt, expected):
    assert CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompts() == expected


@pytest.mark.parametrize("body,param", [
    ({"functions": []}, "functions"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"top_p": 0}, "top_p"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"stop": ["x"] * 65}, "stop"),
])
def test_rejections_name_the_parameter(body, param):
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT, **body})
    err = _validation_error(e.value)
    assert err.status == 400 and err.param == param


def test_unsupported_field_error_message():
    assert "'audio' is not supported" in str(UnsupportedFieldError("audio"))


def test_top_logprobs_requires_logprobs():
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT, "top_logprobs": 2})


class _CharTokenizer:
    """One character per token id (ord), enough to check offsets."""

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_streamed_echo_logprob_offsets_count_the_echoed_prompt():
    from api.completion_response import CompletionResponse
    from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob

    def output(text, finish=None):
        lps = [TokenLogprob(ord(c), -0.5, []) for c in text]
        return RequestOutput("r", [CompletionOutput(0, text, [ord(c) for c in text], 0, finish,
                                                    logprobs=lps)], 3, finish is not None,
                             RequestMetrics(0.0))

    ctx = CompletionResponse(request_id="cmpl-1", model="m", n=1, tokenizer=_CharTokenizer(),
                             want_logprobs=True, echo_texts=["abc"])
    first = ctx.stream_chunks(0, output("de"))[0]["choices"][0]
    second = ctx.stream_chunks(0, output("f", "length"))[0]["choices"][0]
    assert first["text"] == "abcde" and first["logprobs"]["text_offset"] == [3, 4]
    assert second["logprobs"]["text_offset"] == [5]
    final = CompletionResponse(request_id="cmpl-2", model="m", n=1,
                               tokenizer=_CharTokenizer(), want_logprobs=True,
                               echo_texts=["abc"])
    final.absorb(0, output("de"))
    final.absorb(0, output("f", "length"))
    assert final.final_body()["choices"][0]["logprobs"]["text_offset"] == [3, 4, 5]
