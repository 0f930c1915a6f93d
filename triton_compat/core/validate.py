"""A request and a model's answer checked against the model's config, with Triton's texts.

Owns: `Signature` (what the checks read from a `ModelConfig`, taken once per loaded model:
reading protobuf fields on every request cost more than the checks themselves), and the three
checks: `check_inputs` (count, names, datatypes, shapes, batch size), `check_outputs` (the
names asked for) and `check_result` (what a model returned). Used by every runtime: plain,
sequence and ensemble models, and the LLM as a Triton model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tritonclient.utils import np_to_triton_dtype, triton_to_np_dtype

from triton_compat.core.config import wire_datatype
from triton_compat.errors import InferError


@dataclass(frozen=True)
class InputSpec:
    """One config input: KServe datatype, dims (with a leading -1 for batching models), and
    whether a request may leave it out."""

    wire: str
    dims: tuple[int, ...]
    optional: bool


class Signature:
    """The parts of a `ModelConfig` the checks read, as plain Python values: `name`,
    `max_batch_size`, `inputs` {name: InputSpec} and `required` (in config order), `outputs`
    {name: KServe datatype} in config order, `output_dtypes` {name: numpy dtype, None for
    BYTES and BF16, which are checked by kind}."""

    def __init__(self, config) -> None:
        self.name, self.max_batch_size = config.name, config.max_batch_size
        lead = (-1,) if config.max_batch_size > 0 else ()
        self.inputs = {t.name: InputSpec(wire_datatype(t.data_type), lead + tuple(t.dims),
                                         t.optional) for t in config.input}
        self.required = [n for n, t in self.inputs.items() if not t.optional]
        self.outputs = {t.name: wire_datatype(t.data_type) for t in config.output}
        self.output_dtypes = {n: None if w in ("BYTES", "BF16") else
                              np.dtype(triton_to_np_dtype(w)) for n, w in self.outputs.items()}


def _count_error(sig: Signature, inputs: dict, absent: list[str], request_id: str) -> InferError:
    missing = ",".join(f"'{n}'" for n in absent)
    # the order tritonserver 2.51 prints them in: its unordered_map's, the reverse of the
    # request's for a few inputs (measured)
    got = ",".join(f"'{n}'" for n in reversed(list(inputs)))
    expected, required = len(sig.inputs), len(sig.required)
    count = (f"expected {expected} inputs" if required == expected else
             f"expected number of inputs between {required} and {expected}")
    return InferError(f"[request id: {request_id or '<id_unknown>'}] {count} but got "
                      f"{len(inputs)} inputs for model '{sig.name}'. Got input(s) [{got}], but "
                      f"missing required input(s) {'[' + missing if missing else ''}]. "
                      "Please provide all required input(s).")


NOTE_BATCH = ("NOTE: Setting a non-zero max_batch_size in the model config requires a batch "
              "dimension to be prepended to each input shape. If you want to specify the full "
              "shape including the batch dim in your input dims config, try setting "
              "max_batch_size to zero. See the model configuration docs for more info on "
              "max_batch_size.")


def _dims(dims) -> str:
    """Triton's DimsListToString: `[-1,16]`."""
    return "[" + ",".join(str(d) for d in dims) + "]"


def check_inputs(sig: Signature, inputs: dict[str, np.ndarray], datatypes: dict[str, str],
                 request_id: str = "") -> int:
    """Validate inputs against the config with Triton's messages, in Triton core's order
    (InferenceRequest::Normalize): the input count (ValidateRequestInputs, also its "]" when
    nothing is missing), unknown names, the batch dimension, the batch size, then each
    input's datatype and shape. Returns the batch size (1 for models that do not batch).

    Raises InferError(400) for a missing, extra, mistyped or misshapen input."""
    name, expected = sig.name, sig.inputs
    log = f"[request id: {request_id or '<id_unknown>'}] "
    extra = [n for n in inputs if n not in expected]
    absent = [n for n in sig.required if n not in inputs]
    if (len(inputs) > len(expected) or len(inputs) < len(sig.required)
            or (absent and not extra)):
        raise _count_error(sig, inputs, absent, request_id)
    if extra:
        raise InferError(f"unexpected inference input '{extra[0]}' for model '{name}'")
    batch, batching = 0, sig.max_batch_size > 0
    if batching:
        for n, array in inputs.items():
            if not array.shape:
                raise InferError(f"{log}input '{n}' has no shape but model requires batch "
                                 f"dimension for '{name}'")
            if batch and array.shape[0] != batch:
                raise InferError(f"{log}input '{n}' batch size does not match other inputs "
                                 f"for '{name}'")
            batch = array.shape[0]
        if batch > sig.max_batch_size:
            raise InferError(f"{log}inference request batch-size must be <= "
                             f"{sig.max_batch_size} for '{name}'")
    for n, array in inputs.items():
        t = expected[n]
        if datatypes.get(n, t.wire) != t.wire:
            raise InferError(f"{log}inference input '{n}' data-type is '{datatypes[n]}', but "
                             f"model '{name}' expects '{t.wire}'")
        shape = array.shape
        if len(shape) != len(t.dims) or any(d != -1 and d != s for d, s in zip(t.dims, shape)):
            raise InferError(f"{log}unexpected shape for input '{n}' for model '{name}'. "
                             f"Expected {_dims(t.dims)}, got {_dims(shape)}. "
                             f"{NOTE_BATCH if batching else ''}")
    return max(batch, 1) if batching else 1


def check_outputs(sig: Signature, names: list[str] | None) -> list[str]:
    """The requested output names (all when None), each once: a name asked for twice is
    answered once, as Triton 2.51 does (its core keeps them in a set). Raises InferError(400)
    for an unknown one."""
    if names is None:
        return list(sig.outputs)
    for n in names:
        if n not in sig.outputs:
            raise InferError(f"unexpected inference output '{n}' for model '{sig.name}'")
    return list(dict.fromkeys(names))


def check_result(sig: Signature, wanted: list[str], result, batch_size: int):
    """The result, or an InferError(500) when an output in `wanted` is missing from it or is
    not an array. An output of another datatype or batch size than the config's is sent as
    the model made it, with its own datatype (`output_datatype`), as tritonserver 2.51's
    python backend sends it.

    Not as Triton 2.51, on purpose: a requested output the model did not return fails the
    request with its name (docs/triton-conformance.md, model-output-checked)."""
    if isinstance(result, Exception):
        return result
    model = sig.name
    missing = [n for n in wanted if n not in result]
    if missing:
        return InferError(f"model '{model}' did not return output '{missing[0]}'", 500)
    for name in sig.outputs:
        if name in result and not isinstance(result[name], np.ndarray):
            return InferError(f"model '{model}' returned output '{name}' as a "
                              f"{type(result[name]).__name__}, not an array", 500)
    return result


def output_datatype(sig: Signature, name: str, array: np.ndarray) -> str:
    """The wire datatype an output is sent with: its config's, or, for an array of another
    dtype, the array's own (BYTES for strings), as Triton sends what a model made."""
    kind = array.dtype.kind
    if name not in sig.outputs:               # not in the config (a decoupled model's)
        return "BYTES" if kind in "OSU" else np_to_triton_dtype(array.dtype) or "BYTES"
    wire, want = sig.outputs[name], sig.output_dtypes[name]
    if wire == "BYTES" and kind in "OSU" or wire == "BF16" or want == array.dtype:
        return wire
    if kind in "OSU":
        return "BYTES"
    return np_to_triton_dtype(array.dtype) or wire
