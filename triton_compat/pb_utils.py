"""`triton_python_backend_utils` for models written for Triton's python backend (r24.10 / 2.51).

Owns: the objects a `model.py` sees, with the names, methods and error texts of Triton's python
backend (python_backend README "Usage", src/pb_stub.cc's bindings, src/resources/
triton_python_backend_utils.py): `Tensor` (numpy on the CPU, DLPack in and out), the
`InferenceRequest` a model gets in `execute` and builds for BLS (`exec` / `async_exec`, the
work is `triton_compat.bls`'s), `InferenceResponse`, the `InferenceResponseSender` of every
request (any number of responses for decoupled models; exactly one for the others, 24.06+),
`TritonError`, `TritonModelException`, `Logger`, `ModelConfig` for `auto_complete_config`, the
model loading API and the helpers. The python backend registers this module under the name
`triton_python_backend_utils` before importing a model. Not provided: GPU tensors, custom
metrics (`MetricFamily`), `InferenceResponse(parameters=...)` (added after 2.51).
"""

from __future__ import annotations

import json
import logging
import threading

import numpy as np
from tritonclient.utils import triton_to_np_dtype

from triton_compat import dlpack
from triton_compat.auto_complete import ModelConfig  # noqa: F401  (pb_utils.ModelConfig)

_log = logging.getLogger("continuum.triton.python_model")

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1      # Triton's response flag: the last response
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1  # request flags (tritonserver.h)
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_REQUEST_RELEASE_ALL = 1          # release flags: done with the request
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2   # run it again (iterative sequence models)
TRITONSERVER_MEMORY_GPU, TRITONSERVER_MEMORY_CPU = 1, 2   # PreferredMemory types
# TRITONSERVER_DataType codes, as `Tensor.triton_dtype()` returns them
_TRITON_TYPES = ["INVALID", "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16",
                 "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES", "BF16"]
TRITON_STRING_TO_NUMPY = {"TYPE_STRING": np.object_, "TYPE_BOOL": bool, **{
    f"TYPE_{t}": triton_to_np_dtype(t) for t in _TRITON_TYPES[2:13]}}


class TritonModelException(Exception):
    """Raised by models, and by this module where Triton's bindings raise."""


class TritonError:
    """A per-response error, as `InferenceResponse(error=TritonError("..."))`."""

    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, \
        CANCELLED = range(8)

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message, self._code = message, code

    def message(self) -> str:
        """The error text sent to the client."""
        return self._message

    def code(self) -> int:
        """One of the class constants (INTERNAL by default)."""
        return self._code


def wire_datatype(array: np.ndarray) -> str:
    """The KServe datatype of a numpy array: BYTES for object / bytes / str, BF16 for
    `ml_dtypes.bfloat16`, else tritonclient's name. Raises TritonModelException."""
    if array.dtype.kind in "OSU":
        return "BYTES"
    if dlpack.is_bf16(array):
        return "BF16"
    name = {"b": "BOOL"}.get(array.dtype.kind) or next(
        (t for t in _TRITON_TYPES[2:13] if np.dtype(triton_to_np_dtype(t)) == array.dtype), None)
    if name is None:
        raise TritonModelException(f"unsupported numpy dtype {array.dtype}")
    return name


class Tensor:
    """A named tensor: `Tensor(name, array)` (array-likes become numpy arrays, C-contiguous).

    Raises TritonModelException for an empty name."""

    def __init__(self, name: str, array) -> None:
        if not name:
            raise TritonModelException("Tensor name cannot be an empty string.")
        array = np.asarray(array)
        self._name = name
        self._array = array if array.flags.c_contiguous else np.ascontiguousarray(array)

    @classmethod
    def wrap(cls, name: str, array: np.ndarray) -> "Tensor":
        """A Tensor over a numpy array the server made (no checks; for the backend)."""
        tensor = cls.__new__(cls)
        tensor._name = name
        tensor._array = array if array.flags.c_contiguous else np.ascontiguousarray(array)
        return tensor

    def name(self) -> str:
        """The tensor's name (an input or output name of the model's config)."""
        return self._name

    def as_numpy(self) -> np.ndarray:
        """The data; BYTES tensors are object arrays of `bytes`. Raises TritonModelException
        for BF16 (numpy has no BF16: use `to_dlpack()`), as Triton does."""
        if dlpack.is_bf16(self._array):
            raise TritonModelException("Tensor dtype is BF16 and cannot be converted to NumPy. "
                                       "Use to_dlpack() and from_dlpack() instead.")
        return self._array

    def is_cpu(self) -> bool:
        """Always True here: tensors live in host memory."""
        return True

    def shape(self) -> list[int]:
        """The dimensions."""
        return list(self._array.shape)

    def triton_dtype(self) -> int:
        """TRITONSERVER_DataType code (FP32 = 11, BYTES = 13, BF16 = 14, ...)."""
        return _TRITON_TYPES.index(wire_datatype(self._array))

    def to_dlpack(self):
        """A DLPack capsule sharing the data (e.g. `torch.utils.dlpack.from_dlpack`). Raises
        TritonModelException for BYTES."""
        return dlpack.to_capsule(self._array)

    def __dlpack__(self, stream=None, **_):
        return dlpack.to_capsule(self._array)

    def __dlpack_device__(self) -> tuple[int, int]:
        return dlpack.KDL_CPU, 0

    @staticmethod
    def from_dlpack(name: str, tensor) -> "Tensor":
        """A Tensor sharing the memory of a DLPack capsule, or of an object with `__dlpack__`
        and `__dlpack_device__` (a torch tensor, a numpy array, a Tensor). Raises
        TritonModelException for a non-contiguous or GPU tensor, or an unsupported object."""
        if not name:
            raise TritonModelException("Tensor name cannot be an empty string.")
        if isinstance(tensor, Tensor):
            return Tensor(name, tensor._array)
        return Tensor(name, dlpack.from_object(tensor))


def array_of(tensor: Tensor) -> np.ndarray:
    """The array of a Tensor, BF16 included (for the backend; models use `as_numpy`)."""
    if not isinstance(tensor, Tensor):
        raise TritonModelException(f"expected a pb_utils.Tensor, got {type(tensor).__name__}")
    return tensor._array


class InferenceResponse:
    """The response to one request: output tensors, or an error (a TritonError; a str is taken
    as one)."""

    def __init__(self, output_tensors: list[Tensor] | None = None,
                 error: TritonError | str | None = None) -> None:
        self._outputs = list(output_tensors or [])
        self._error = TritonError(error) if isinstance(error, str) else error

    def output_tensors(self) -> list[Tensor]:
        """The response's tensors."""
        return self._outputs

    def has_error(self) -> bool:
        """Whether the response carries an error."""
        return self._error is not None

    def error(self) -> TritonError | None:
        """The error, if any."""
        return self._error


class InferenceResponseSender:
    """A request's sender: `send(response=None, flags=0)`, with `flags=
    TRITONSERVER_RESPONSE_COMPLETE_FINAL` on the last call. A decoupled model sends any number
    of responses; any other model exactly one (then the final flag, with it or after it).
    `deliver(response, final)` is the server's callback; `send` may be called from any thread.
    Raises TritonModelException with Triton's texts (python_backend src/response_sender.cc)."""

    def __init__(self, deliver, decoupled: bool = True, is_cancelled=None) -> None:
        self._deliver, self._decoupled = deliver, decoupled
        self._is_cancelled = is_cancelled or (lambda: False)
        self._closed, self._sent = False, 0
        self._lock = threading.Lock()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        """Send a response and/or the final flag."""
        if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise TritonModelException("Unable to send response. Unsupported flag provided.")
        if flags == 0 and response is None:
            raise TritonModelException("Inference Response object must be provided when the "
                                       "response flags is set to zero.")
        self.claim(response is not None, bool(flags))
        self._deliver(response, bool(flags))

    def claim(self, has_response: bool, final: bool) -> None:
        """Count one send (Triton's UpdateStateAndCounters); raise if it breaks the rules."""
        with self._lock:
            if not self._decoupled and has_response and self._sent > 0:
                raise TritonModelException("Unable to send response. Non-decoupled model "
                                           "cannot send more than one response.")
            if not self._decoupled and not has_response and final and self._sent == 0:
                raise TritonModelException("Unable to send response. Non-decoupled model "
                                           "cannot send complete final before sending a "
                                           "response.")
            if self._closed:
                raise TritonModelException("Unable to send response. Response sender has "
                                           "been closed.")
            self._closed = self._closed or final
            self._sent += 1

    def close(self) -> bool:
        """Close the sender (the model failed); whether it was open."""
        with self._lock:
            was_open, self._closed = not self._closed, True
            return was_open

    def is_closed(self) -> bool:
        """Whether the final flag was sent (or the sender was closed)."""
        return self._closed

    def is_cancelled(self) -> bool:
        """Whether the client cancelled the request (see `InferenceRequest.is_cancelled`)."""
        return bool(self._is_cancelled())


class PreferredMemory:
    """Where BLS outputs should be placed. Outputs are always in host memory here."""

    def __init__(self, preferred_memory_type: int, preferred_device_id: int = 0) -> None:
        self.preferred_memory_type, self.preferred_device_id = preferred_memory_type, \
            preferred_device_id


class InferenceTrace:
    """A request's trace (tracing is not provided: no context)."""

    def get_context(self) -> str | None:
        """The trace context, None without tracing."""
        return None


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
        self._cancelled = lambda: False

    @classmethod
    def incoming(cls, inputs: list[Tensor], request_id: str, requested_output_names: list[str],
                 correlation_id, parameters: dict, flags: int,
                 sender: InferenceResponseSender | None, is_cancelled=None,
                 model_name: str = "") -> "InferenceRequest":
        """A request of the batch `execute` receives (built by the python backend, on every
        execution: no argument checks)."""
        request = cls.__new__(cls)
        timeout = parameters.get("timeout", 0)
        request._inputs, request._id, request._outputs = inputs, request_id, \
            requested_output_names
        request._model, request._version, request._flags = model_name, -1, flags
        request._timeout = timeout if isinstance(timeout, int) else 0
        request._correlation_id, request._parameters = correlation_id, parameters
        request.preferred_memory, request._trace = None, _NO_TRACE
        request._sender, request._release_flags = sender, TRITONSERVER_REQUEST_RELEASE_ALL
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
        if self._sender is None:
            raise TritonModelException("Unable to get the response sender of a request that "
                                       "was not received by `execute`")
        self._sender_taken = True
        return self._sender

    def sender_taken(self) -> bool:
        """Whether the model asked for the response sender (for the python backend)."""
        return getattr(self, "_sender_taken", False)

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
        with `decoupled=True` an iterator of them (see `triton_compat.bls`)."""
        from triton_compat import bls
        return bls.run(self, decoupled)

    def async_exec(self, decoupled: bool = False):
        """`exec` as an awaitable, started at once on the running event loop. Raises
        RuntimeError outside a coroutine (no running loop)."""
        from triton_compat import bls
        return bls.run_async(self, decoupled)

    def model_target(self) -> tuple[str, int]:
        """(model name, version) a BLS request goes to (for `triton_compat.bls`)."""
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
    return next((t for t in request.inputs() if t.name() == name), None)


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


def __getattr__(name: str):
    """`load_model`, `unload_model`, `is_model_ready` (README "Model Loading API") live with
    BLS in `triton_compat.bls`, which imports this module: looked up on first use."""
    if name in ("load_model", "unload_model", "is_model_ready"):
        from triton_compat import bls
        return getattr(bls, name)
    raise AttributeError(f"module 'triton_python_backend_utils' has no attribute '{name}'")
