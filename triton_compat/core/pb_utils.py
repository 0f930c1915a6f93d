"""`triton_python_backend_utils` for models written for Triton's python backend (r24.10 / 2.51).

Owns: the objects a `model.py` sees, with the names, methods and error texts of Triton's python
backend (python_backend README "Usage", src/pb_stub.cc's bindings, src/resources/
triton_python_backend_utils.py): `Tensor` (numpy on the CPU, DLPack in and out), the
`InferenceRequest` a model gets in `execute` and builds for BLS (`exec` / `async_exec`, the
work is `triton_compat.core.bls`'s), `InferenceResponse`, the `InferenceResponseSender` of every
request (any number of responses for decoupled models; exactly one for the others, 24.06+),
`TritonError`, `TritonModelException`, `Logger`, `ModelConfig` for `auto_complete_config`, the
model loading API and the helpers. The python backend registers this module under the name
`triton_python_backend_utils` before importing a model. Not provided: GPU tensors, custom
metrics (`MetricFamily`), `InferenceResponse(parameters=...)` (added after 2.51).
"""

from __future__ import annotations

import json
import logging

import numpy as np
from tritonclient.utils import triton_to_np_dtype

from triton_compat.core import bls
from triton_compat.errors import TritonModelException  # noqa: F401
from triton_compat.core.pb_model_config import ModelConfig  # noqa: F401
from triton_compat.core.pb_types import (  # noqa: F401  (pb_utils' names)
    TRITONSERVER_RESPONSE_COMPLETE_FINAL, TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_END, TRITONSERVER_REQUEST_RELEASE_ALL,
    TRITONSERVER_REQUEST_RELEASE_RESCHEDULE, TRITONSERVER_MEMORY_GPU, TRITONSERVER_MEMORY_CPU,
    TRITON_STRING_TO_NUMPY, _TRITON_TYPES, TritonError, wire_datatype, Tensor, array_of,
    InferenceResponse, InferenceResponseSender, PreferredMemory, InferenceTrace)

_log = logging.getLogger("continuum.triton.python_model")

_REQUIRED = object()
_NO_TRACE = InferenceTrace()


def _never() -> bool:
    return False


class InferenceRequest:
    """A request: one of the batch handed to `execute`, or a BLS request built by a model.

    BLS: `InferenceRequest(model_name=..., inputs=[Tensor...], requested_output_names=[...],
    request_id="", correlation_id=0, model_version=-1, flags=0, timeout=0 (µs),
    preferred_memory=..., trace=..., parameters={str: bool | int | str})`, then `exec()` /
    `await async_exec()` (an InferenceResponse) or `exec(decoupled=True)` (an iterator of
    responses ending after the final one). Raises TypeError for a missing model_name, inputs
    or requested_output_names, TritonModelException for bad parameters or correlation id.
    Reference: python_backend README, "Business Logic Scripting"."""

    def __init__(self, request_id: str = "", correlation_id: int | str = 0, inputs=_REQUIRED,
                 requested_output_names=_REQUIRED, model_name=_REQUIRED,
                 model_version: int = -1, flags: int = 0, timeout: int = 0,
                 preferred_memory: PreferredMemory | None = None,
                 trace: InferenceTrace | None = None, parameters: dict | None = None) -> None:
        for key, value in (("inputs", inputs), ("requested_output_names",
                                                 requested_output_names),
                           ("model_name", model_name)):
            if value is _REQUIRED or value is None:
                raise TypeError(f"InferenceRequest(): missing required argument '{key}'")
        if not isinstance(correlation_id, (int, str)) or isinstance(correlation_id, bool):
            raise TritonModelException("Correlation ID must be integer or string")
        params = dict(parameters or {})
        for key, value in params.items():
            if not isinstance(key, str):
                raise TritonModelException(f"Expect parameters keys to have type str, found "
                                           f"type {type(key)}")
            if not isinstance(value, (bool, int, str)):
                raise TritonModelException("Expect parameters values to have type "
                                           f"bool/int/str, found type {type(value)}")
        self._inputs, self._id = list(inputs), request_id
        self._outputs = list(requested_output_names)
        self._model = model_name.decode() if isinstance(model_name, bytes) else model_name
        self._version, self._flags, self._timeout = model_version, flags, timeout
        self._correlation_id, self._parameters = correlation_id, params
        self.preferred_memory, self._trace = preferred_memory, trace or InferenceTrace()
        self._sender, self._release_flags = None, TRITONSERVER_REQUEST_RELEASE_ALL
        self._make_sender = None
        self._cancelled = lambda: False

    @classmethod
    def incoming(cls, inputs: list[Tensor], request_id: str, requested_output_names: list[str],
                 correlation_id, parameters: dict, flags: int,
                 sender: InferenceResponseSender | None, is_cancelled=None,
                 model_name: str = "", make_sender=None) -> "InferenceRequest":
        """A request of the batch `execute` receives (built by the python backend, on every
        execution: no argument checks). `make_sender()`, when `sender` is None, makes it on
        the model's first `get_response_sender()`."""
        request = cls.__new__(cls)
        timeout = parameters.get("timeout", 0)
        request._inputs, request._id, request._outputs = inputs, request_id, \
            requested_output_names
        request._model, request._version, request._flags = model_name, -1, flags
        request._timeout = timeout if isinstance(timeout, int) else 0
        request._correlation_id, request._parameters = correlation_id, parameters
        request.preferred_memory, request._trace = None, _NO_TRACE
        request._sender, request._release_flags = sender, TRITONSERVER_REQUEST_RELEASE_ALL
        request._make_sender = make_sender
        request._cancelled = is_cancelled or _never
        return request

    def inputs(self) -> list[Tensor]:
        """The request's input tensors."""
        return self._inputs

    def request_id(self) -> str:
        """The request id ('' when not given)."""
        return self._id

    def correlation_id(self) -> int | str:
        """The sequence id: an int, or a str for string ids (0 outside sequences)."""
        return self._correlation_id

    def requested_output_names(self) -> list[str]:
        """The outputs asked for."""
        return self._outputs

    def parameters(self) -> str:
        """The request's parameters as a JSON string (Triton's python backend convention)."""
        return json.dumps(self._parameters)

    def flags(self) -> int:
        """Sequence flags: TRITONSERVER_REQUEST_FLAG_SEQUENCE_START | ..._END."""
        return self._flags

    def set_flags(self, flags: int) -> None:
        """Set the sequence flags (BLS requests to sequence models)."""
        self._flags = flags

    def timeout(self) -> int:
        """The request's timeout in microseconds (0: none)."""
        return self._timeout

    def trace(self) -> InferenceTrace:
        """The request's trace (to pass on to BLS requests)."""
        return self._trace

    def get_response_sender(self) -> InferenceResponseSender:
        """The request's response sender. Raises TritonModelException for a BLS request."""
        if self._sender is None and self._make_sender is not None:
            self._sender = self._make_sender()
        if self._sender is None:
            raise TritonModelException("Unable to get the response sender of a request that "
                                       "was not received by `execute`")
        return self._sender

    def is_cancelled(self) -> bool:
        """Whether the client cancelled the request: the server must mark the request
        (`BackendRequest.cancelled`); False until it does."""
        return bool(self._cancelled())

    def set_release_flags(self, flags: int) -> None:
        """`TRITONSERVER_REQUEST_RELEASE_RESCHEDULE`: execute this request again in a later
        batch (models with `sequence_batching { iterative_sequence: true }`; elsewhere the
        request fails with Triton's error). `TRITONSERVER_REQUEST_RELEASE_ALL`: done."""
        self._release_flags = flags

    def release_flags(self) -> int:
        """The flags set by `set_release_flags` (RELEASE_ALL by default)."""
        return self._release_flags

    def exec(self, decoupled: bool = False):
        """Run this request on its model and wait: an InferenceResponse (errors included), or
        with `decoupled=True` an iterator of them (see `triton_compat.core.bls`)."""
        return bls.run(self, decoupled)

    def async_exec(self, decoupled: bool = False):
        """`exec` as an awaitable, started at once on the running event loop. Raises
        RuntimeError outside a coroutine (no running loop)."""
        return bls.run_async(self, decoupled)

    def model_target(self) -> tuple[str, int]:
        """(model name, version) a BLS request goes to (for `triton_compat.core.bls`)."""
        return self._model, self._version


class Logger:
    """Triton's `pb_utils.Logger`: `log(message, level)`, log_info / log_warn / log_error /
    log_verbose; the levels are `Logger.INFO`, `WARNING`, `ERROR`, `VERBOSE`."""

    INFO, WARNING, ERROR, VERBOSE = logging.INFO, logging.WARNING, logging.ERROR, logging.DEBUG

    class LogLevel:
        """The levels, also as `Logger.LogLevel.INFO` etc."""

        INFO, WARNING, ERROR, VERBOSE = logging.INFO, logging.WARNING, logging.ERROR, \
            logging.DEBUG

    @staticmethod
    def log(message: str, level: int = logging.INFO) -> None:
        """Log at `level`."""
        _log.log(level, message)

    @staticmethod
    def log_info(message: str) -> None:
        """Log at INFO."""
        _log.info(message)

    @staticmethod
    def log_warn(message: str) -> None:
        """Log at WARNING."""
        _log.warning(message)

    @staticmethod
    def log_error(message: str) -> None:
        """Log at ERROR."""
        _log.error(message)

    @staticmethod
    def log_verbose(message: str) -> None:
        """Log at DEBUG."""
        _log.debug(message)


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    """The request's input called `name`, or None."""
    for tensor in request.inputs():
        if tensor.name() == name:
            return tensor
    return None


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    """The response's output called `name`, or None."""
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: dict, name: str) -> dict | None:
    """The `input` entry of the (JSON) model config called `name`, or None."""
    return next((t for t in model_config.get("input", []) if t.get("name") == name), None)


def get_output_config_by_name(model_config: dict, name: str) -> dict | None:
    """The `output` entry of the (JSON) model config called `name`, or None."""
    return next((t for t in model_config.get("output", []) if t.get("name") == name), None)


def triton_string_to_numpy(triton_type: str):
    """Config type name (`TYPE_FP32`) to its numpy dtype; TYPE_STRING -> object."""
    return TRITON_STRING_TO_NUMPY[triton_type]


def triton_to_numpy_type(data_type: int):
    """TRITONSERVER_DataType code to numpy type (13, BYTES -> object; None for others)."""
    name = _TRITON_TYPES[data_type] if 0 < data_type < 14 else None
    return None if name is None else np.object_ if name == "BYTES" else \
        np.bool_ if name == "BOOL" else triton_to_np_dtype(name)


def numpy_to_triton_type(data_type) -> int | None:
    """numpy dtype to TRITONSERVER_DataType code (None when it has none)."""
    try:
        return _TRITON_TYPES.index(wire_datatype(np.empty(0, dtype=data_type)))
    except TritonModelException:
        return None


def serialize_byte_tensor(input_tensor: np.ndarray):
    """BYTES elements as one bytes object, each prefixed by its 4-byte little-endian length
    (C order); () for an empty tensor, None for a tensor that is not BYTES."""
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype.kind not in "OS":
        return None
    items = [x if isinstance(x, bytes) else str(x).encode() for x in input_tensor.reshape(-1)]
    return b"".join(len(x).to_bytes(4, "little") + x for x in items)


def deserialize_bytes_tensor(encoded_tensor: bytes) -> np.ndarray:
    """The inverse of `serialize_byte_tensor`: a 1-D object array of bytes."""
    out, offset, raw = [], 0, bytes(encoded_tensor)
    while offset < len(raw):
        n = int.from_bytes(raw[offset:offset + 4], "little")
        out.append(raw[offset + 4:offset + 4 + n])
        offset += 4 + n
    return np.array(out, dtype=np.object_)


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    """Whether the (JSON) model config sets `model_transaction_policy { decoupled: true }`."""
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


# the model loading API (README "Model Loading API") lives with BLS
load_model, unload_model, is_model_ready = bls.load_model, bls.unload_model, bls.is_model_ready
