"""The value types of `triton_python_backend_utils` (see `triton_compat.core.pb_utils`, which
re-exports them): the constants of tritonserver.h a model uses, `TritonError`, `Tensor` (numpy
on the CPU, DLPack in and out), `InferenceResponse`, the `InferenceResponseSender` of every
request, `PreferredMemory` and `InferenceTrace`, with the names, methods and error texts of
Triton's python backend (r24.10: src/pb_stub.cc's bindings, src/response_sender.cc). Apart
from `pb_utils` so that BLS (`triton_compat.core.bls`), which `pb_utils.InferenceRequest.exec` runs,
can build responses without importing `pb_utils` back.
"""

from __future__ import annotations

import threading

import numpy as np
from tritonclient.utils import triton_to_np_dtype

from triton_compat.core import dlpack
from triton_compat.errors import TritonModelException

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
