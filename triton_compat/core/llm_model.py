"""The served LLM as a Triton model: decoupled, with the inputs and outputs of Triton's vLLM
backend, over the same engine as the OpenAI routes.

Owns: the model's configuration (Triton's `ModelConfig`: `text_input` BYTES [1]; optional
`stream`, `exclude_input_in_output`, `return_finish_reason`, `return_num_input_tokens`,
`return_num_output_tokens` BOOL [1], `sampling_parameters` BYTES [1] (vLLM `SamplingParams`
as JSON), `max_tokens` INT32 [1]; outputs `text_output` BYTES [-1], `finish_reason` BYTES [-1],
`num_input_tokens` UINT32 [1], `num_output_tokens` UINT32 [-1]; decoupled transaction policy,
`max_batch_size` 0: the engine batches), the translation of one request into engine
`SamplingParams` (a `lora_name` parameter selects a LoRA adapter, as in the vLLM backend),
and `generate()`: an async iterator of response tensors — one per engine delta when streaming,
else one with the whole text (the prompt first unless `exclude_input_in_output`, as the vLLM
backend does). Statistics count requests like any model.
Reference: triton-inference-server/vllm_backend src/model.py, src/utils/request.py.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator, Callable

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from scheduler.request import QueueFullError
from triton_compat.errors import DECOUPLED_HTTP, InferError
from triton_compat.core.validate import Signature, check_inputs
from triton_compat.core.stats import ModelStats

BOOL_INPUTS = ("stream", "exclude_input_in_output", "return_finish_reason",
               "return_num_input_tokens", "return_num_output_tokens")
# vLLM SamplingParams keys this engine honours (others are refused, never silently dropped)
SAMPLING_KEYS = {"n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop",
                 "stop_token_ids", "ignore_eos", "logit_bias"}


def llm_config(name: str) -> mc.ModelConfig:
    """The Triton configuration of the LLM model `name` (vLLM backend's schema)."""
    c = mc.ModelConfig(name=name, backend="vllm", platform="vllm", max_batch_size=0)
    c.model_transaction_policy.decoupled = True
    c.input.add(name="text_input", data_type=mc.TYPE_STRING, dims=[1])
    for n in BOOL_INPUTS:
        c.input.add(name=n, data_type=mc.TYPE_BOOL, dims=[1], optional=True)
    c.input.add(name="sampling_parameters", data_type=mc.TYPE_STRING, dims=[1], optional=True)
    c.input.add(name="max_tokens", data_type=mc.TYPE_INT32, dims=[1], optional=True)
    c.output.add(name="text_output", data_type=mc.TYPE_STRING, dims=[-1])
    c.output.add(name="finish_reason", data_type=mc.TYPE_STRING, dims=[-1])
    c.output.add(name="num_input_tokens", data_type=mc.TYPE_UINT32, dims=[1])
    c.output.add(name="num_output_tokens", data_type=mc.TYPE_UINT32, dims=[-1])
    c.instance_group.add(name=name, count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    return c


def _scalar(inputs: dict, name: str, default=None):
    value = inputs.get(name)
    if value is None:
        return default
    flat = np.asarray(value).reshape(-1)
    if flat.size != 1:
        raise InferError(f"input '{name}' must hold one element, got {flat.size}")
    item = flat[0]
    return item.decode("utf-8", "replace") if isinstance(item, bytes) else item.item() \
        if hasattr(item, "item") else item


INT_KEYS = ("n", "max_tokens", "min_tokens", "top_k", "seed")
FLOAT_KEYS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty")


def _coerce(key: str, value):
    """vLLM's backend converts numeric and boolean parameters given as strings (genai-perf
    sends `{"max_tokens": "16"}`). Raises InferError(400) for one that does not convert."""
    try:
        if key in INT_KEYS and isinstance(value, str):
            return int(value)
        if key in FLOAT_KEYS and isinstance(value, str):
            return float(value)
    except ValueError:
        raise InferError(f"sampling_parameters: '{key}' must be a number, got {value!r}") \
            from None
    if key == "ignore_eos" and isinstance(value, str):
        return value.strip().lower() in ("true", "1")
    return value


def sampling_params(inputs: dict, default_max_tokens: int = 16,
                    request_params: dict | None = None, loras: list[str] | None = None):
    """Engine `SamplingParams` from the request's `sampling_parameters` (JSON) and
    `max_tokens`; without `sampling_parameters`, from the request's parameters (as the vLLM
    backend reads them: a generate body's `"parameters": {"temperature": 0}`), less the
    request id and Triton's own `triton_*` keys. Their `lora_name` selects a LoRA adapter of
    `loras` (None: LoRA is off), with the vLLM backend's errors. Raises InferError(400) naming
    a bad key or value."""
    from scheduler.request import SamplingParams

    if "sampling_parameters" not in inputs and request_params:
        raw = json.dumps({k: v for k, v in request_params.items()
                          if k != "id" and not k.startswith("triton_")})
    else:
        raw = _scalar(inputs, "sampling_parameters", "{}") or "{}"
    try:
        given = json.loads(raw)
    except json.JSONDecodeError as e:
        raise InferError(f"input 'sampling_parameters' is not valid JSON: {e}") from None
    if not isinstance(given, dict):
        raise InferError("input 'sampling_parameters' must be a JSON object")
    lora_name = given.pop("lora_name", None)
    if lora_name is not None:
        if loras is None:
            raise InferError("LoRA feature is not enabled.")
        if lora_name not in loras:
            raise InferError(f"LoRA {lora_name} is not supported, we currently support {loras}")
    unknown = sorted(set(given) - SAMPLING_KEYS)
    if unknown:
        raise InferError(f"sampling_parameters: unsupported key '{unknown[0]}' (supported: "
                         f"{', '.join(sorted(SAMPLING_KEYS))})")
    kwargs = {k: _coerce(k, v) for k, v in given.items()}
    kwargs.setdefault("max_tokens", default_max_tokens)
    if (max_tokens := _scalar(inputs, "max_tokens")) is not None:
        kwargs["max_tokens"] = int(max_tokens)
    if isinstance(kwargs.get("stop"), str):
        kwargs["stop"] = (kwargs["stop"],)
    for key in ("stop", "stop_token_ids"):
        if key in kwargs:
            kwargs[key] = tuple(kwargs[key] or ())
    if kwargs.get("logit_bias"):
        kwargs["logit_bias"] = {int(k): float(v) for k, v in kwargs["logit_bias"].items()}
    try:
        return SamplingParams(**kwargs, lora_name=lora_name)
    except (TypeError, ValueError) as e:
        raise InferError(f"sampling_parameters: {e}") from None


class LLMModel:
    """The LLM as a decoupled Triton model. `get_llm()` returns the engine front
    (`ProcessAsyncLLM`, None while it loads); `tokenizer()` the HF tokenizer."""

    version = 1
    decoupled = True
    runs_inline = False

    def __init__(self, name: str, get_llm: Callable, get_tokenizer: Callable,
                 get_loras: Callable = lambda: None) -> None:
        self.name, self.get_llm, self.get_tokenizer = name, get_llm, get_tokenizer
        self.get_loras = get_loras           # the LoRA adapters' names; None: LoRA off
        self.config = llm_config(name)
        self.signature = Signature(self.config)
        self.stats = ModelStats()
        self.pending_count = 0

    def ready(self) -> bool:
        """True once the engine is loaded."""
        return self.get_llm() is not None

    def submit(self, *args, **kwargs):
        """Decoupled: one-response infer is refused, with Triton's HTTP text (gRPC says its
        own in the service)."""
        raise InferError(DECOUPLED_HTTP, 501)

    def abort_all(self, message: str) -> None:
        """Nothing here: the engine aborts its own requests (`ProcessAsyncLLM.abort_all`)."""

    def close(self, timeout_s: float = 30.0) -> bool:
        """Nothing to release: the engine is the server's. True."""
        return True

    async def generate(self, inputs: dict, request_id: str = "",
                       datatypes: dict | None = None,
                       parameters: dict | None = None) -> AsyncIterator[tuple]:
        """Responses for one request: ({output name: array}, final); exactly the last one is
        final. `parameters` (the request's) are the sampling parameters when the request has
        no `sampling_parameters` input, as in the vLLM backend. Raises InferError: 400 bad
        input, 503 engine not ready or full, 500 engine failure."""
        llm, tokenizer = self.get_llm(), self.get_tokenizer()
        if llm is None or tokenizer is None:
            raise InferError(f"Request for unknown model: '{self.name}' is not ready "
                             "(the engine is loading)", 503)
        try:
            check_inputs(self.signature, inputs, datatypes or {})  # Triton's input errors
        except InferError as e:
            e.refused = True
            raise
        prompt = _scalar(inputs, "text_input")
        flags = {n: bool(_scalar(inputs, n, False)) for n in BOOL_INPUTS}
        stream = flags["stream"]
        prepend = "exclude_input_in_output" not in inputs and not stream or \
            ("exclude_input_in_output" in inputs and not flags["exclude_input_in_output"])
        if prepend and stream:
            raise InferError("When streaming, `exclude_input_in_output` = False is not allowed.")
        params = sampling_params(inputs, request_params=parameters, loras=self.get_loras())
        ids = tokenizer.encode(str(prompt))
        start = time.perf_counter_ns()
        texts, counts, reasons, ok = [""] * params.n, [0] * params.n, [None] * params.n, False
        try:
            async for out in llm.generate(request_id or f"triton-{uuid.uuid4().hex}", ids,
                                          params):
                if out.error:
                    raise InferError(f"generation failed: {out.error}", 500)
                delta = [""] * params.n
                for o in out.outputs:
                    delta[o.index] += o.text
                    counts[o.index], reasons[o.index] = o.num_output_tokens, o.finish_reason
                if stream:
                    yield self._tensors(delta, reasons, len(ids), counts, flags), out.finished
                else:
                    texts = [t + d for t, d in zip(texts, delta)]
            if not stream:
                yield self._tensors([(str(prompt) if prepend else "") + t for t in texts],
                                    reasons, len(ids), counts, flags), True
            ok = True
        except InferError:
            raise
        except Exception as e:
            raise InferError(f"{type(e).__name__}: {e}",
                             503 if isinstance(e, QueueFullError) else 500) from None
        finally:
            self.stats.record_request(ok, time.perf_counter_ns() - start, 1)

    @staticmethod
    def _tensors(texts, reasons, n_in, counts, flags) -> dict:
        out = {"text_output": np.array([t.encode() for t in texts], dtype=np.object_)}
        if flags["return_finish_reason"]:
            out["finish_reason"] = np.array([str(r).encode() for r in reasons], dtype=np.object_)
        if flags["return_num_input_tokens"]:
            out["num_input_tokens"] = np.array([n_in], dtype=np.uint32)
        if flags["return_num_output_tokens"]:
            out["num_output_tokens"] = np.array(counts, dtype=np.uint32)
        return out
