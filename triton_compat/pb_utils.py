"""`triton_python_backend_utils` for models written for Triton's python backend.

Owns: the objects a `model.py` sees — `Tensor`, `InferenceRequest`, `InferenceResponse`,
`TritonError`, `TritonModelException`, `Logger` and the `get_*_by_name` helpers — with the
names and methods of Triton's python backend (python_backend/README.md, "Usage"), so an
unchanged `model.py` runs here. The python backend registers this module under the name
`triton_python_backend_utils` before importing a model. Tensors live on the CPU as numpy
arrays; decoupled models get a response sender (`request.get_response_sender()`); BLS and
DLPack device transfer are not provided.
"""

from __future__ import annotations

import json
import logging

import numpy as np
from tritonclient.utils import triton_to_np_dtype

_log = logging.getLogger("continuum.triton.python_model")


class TritonModelException(Exception):
    """Raised by models (or by this module) for an error inside `execute`."""


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


class Tensor:
    """A named tensor: `Tensor(name, numpy_array)`; `as_numpy()` returns the array."""

    def __init__(self, name: str, array: np.ndarray) -> None:
        if not isinstance(array, np.ndarray):
            raise TritonModelException(f"Tensor '{name}' must be a numpy array, "
                                       f"got {type(array).__name__}")
        self._name, self._array = name, array

    def name(self) -> str:
        """The tensor's name (an input or output name of the model's config)."""
        return self._name

    def as_numpy(self) -> np.ndarray:
        """The data; BYTES tensors are object arrays of `bytes`."""
        return self._array

    def is_cpu(self) -> bool:
        """Always True here: tensors live in host memory."""
        return True


TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1      # Triton's response flag: the last response
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1  # request flags (tritonserver.h)
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_REQUEST_RELEASE_ALL = 1          # release flags: done with the request
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2   # run it again (iterative sequence models)


class InferenceResponseSender:
    """A decoupled request's sender: `send(response=None, flags=0)` any number of times, the
    last with `flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL` (with or without a response).
    `deliver(response, final)` is the server's callback; it may be called from any thread."""

    def __init__(self, deliver) -> None:
        self._deliver, self._closed = deliver, False

    def send(self, response: "InferenceResponse | None" = None, flags: int = 0) -> None:
        """Send a response and/or the final flag. Raises TritonModelException after the final
        one."""
        if self._closed:
            raise TritonModelException("Unable to send response. Response sender has been "
                                       "closed.")
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        self._closed = final
        self._deliver(response, final)

    def is_cancelled(self) -> bool:
        """Whether the client went away (not propagated to models here; always False)."""
        return False


class InferenceRequest:
    """One request of a batch handed to `execute`."""

    def __init__(self, inputs: list[Tensor], request_id: str = "",
                 requested_output_names: list[str] | None = None, correlation_id: int = 0,
                 parameters: dict | None = None, sender: InferenceResponseSender | None = None,
                 flags: int = 0) -> None:
        self._inputs, self._id = inputs, request_id
        self._outputs = list(requested_output_names or [])
        self._correlation_id, self._parameters = correlation_id, parameters or {}
        self._sender, self._flags = sender, flags
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL

    def get_response_sender(self) -> InferenceResponseSender:
        """The response sender of a decoupled model's request. Raises TritonModelException
        for a model that is not decoupled."""
        if self._sender is None:
            raise TritonModelException("get_response_sender() is only available for models "
                                       "with the decoupled transaction policy")
        return self._sender

    def inputs(self) -> list[Tensor]:
        """The request's input tensors."""
        return self._inputs

    def request_id(self) -> str:
        """The client's request id ('' when not given)."""
        return self._id

    def correlation_id(self) -> int | str:
        """The sequence id: an int, or a str for string ids (0 outside sequences)."""
        return self._correlation_id

    def requested_output_names(self) -> list[str]:
        """The outputs the client asked for."""
        return self._outputs

    def parameters(self) -> str:
        """The request's parameters as a JSON string (Triton's python backend convention)."""
        return json.dumps(self._parameters)

    def flags(self) -> int:
        """Sequence flags: TRITONSERVER_REQUEST_FLAG_SEQUENCE_START | ..._END (0 outside
        sequences)."""
        return self._flags

    def is_cancelled(self) -> bool:
        """Cancellation is not propagated to python models; always False."""
        return False

    def set_release_flags(self, flags: int) -> None:
        """`TRITONSERVER_REQUEST_RELEASE_RESCHEDULE`: execute this request again in a later
        batch (models with `sequence_batching { iterative_sequence: true }`; elsewhere the
        request fails with Triton's error). `TRITONSERVER_REQUEST_RELEASE_ALL`: done."""
        self._release_flags = flags

    def release_flags(self) -> int:
        """The flags set by `set_release_flags` (RELEASE_ALL by default)."""
        return self._release_flags


class InferenceResponse:
    """The response to one request: output tensors, or an error."""

    def __init__(self, output_tensors: list[Tensor] | None = None,
                 error: TritonError | None = None) -> None:
        self._outputs, self._error = list(output_tensors or []), error

    def output_tensors(self) -> list[Tensor]:
        """The response's tensors."""
        return self._outputs

    def has_error(self) -> bool:
        """Whether the response carries an error."""
        return self._error is not None

    def error(self) -> TritonError | None:
        """The error, if any."""
        return self._error


class Logger:
    """Triton's `pb_utils.Logger`: log_info / log_warn / log_error / log_verbose."""

    @staticmethod
    def log_info(msg: str) -> None:
        """Log at INFO."""
        _log.info(msg)

    @staticmethod
    def log_warn(msg: str) -> None:
        """Log at WARNING."""
        _log.warning(msg)

    @staticmethod
    def log_error(msg: str) -> None:
        """Log at ERROR."""
        _log.error(msg)

    @staticmethod
    def log_verbose(msg: str) -> None:
        """Log at DEBUG."""
        _log.debug(msg)


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    """The request's input called `name`, or None."""
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    """The response's output called `name`, or None."""
    return next((t for t in response.output_tensors() if t.name() == name), None)


def _by_name(model_config: dict, kind: str, name: str) -> dict:
    return next((t for t in model_config.get(kind, []) if t.get("name") == name), {})


def get_input_config_by_name(model_config: dict, name: str) -> dict:
    """The `input` entry of the (JSON) model config called `name`, or {}."""
    return _by_name(model_config, "input", name)


def get_output_config_by_name(model_config: dict, name: str) -> dict:
    """The `output` entry of the (JSON) model config called `name`, or {}."""
    return _by_name(model_config, "output", name)


def triton_string_to_numpy(triton_type: str):
    """Config type name (`TYPE_FP32`) to its numpy dtype; TYPE_STRING -> object."""
    name = triton_type.removeprefix("TYPE_")
    return triton_to_np_dtype("BYTES" if name == "STRING" else name)


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    """Whether the (JSON) model config sets `model_transaction_policy { decoupled: true }`."""
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))
