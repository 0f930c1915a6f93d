"""One KServe v2 inference, whatever the wire: the part HTTP and gRPC share.

Owns: `InferRequest` (what a front-end decoded: inputs as arrays or shared-memory references,
the outputs asked for, id and parameters), `run()` (inputs read from their shared-memory
regions in place, the request submitted to the model's runtime and awaited, outputs written
into the regions that asked for them) and `OutputTensor` (what the front-end encodes).
Data flow: routes.py / grpc/service.py decode → `run` → `ModelRuntime.submit` (validation,
queue, batcher thread) → future → outputs → encode. Regions stay in use (unregister deferred)
from the moment an input is read until the response is built.
Reference: Triton's shared-memory extension (server/docs/protocol/extension_shared_memory.md).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import numpy as np
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor, triton_to_np_dtype

from triton_compat.core.backends import BackendRequest
from triton_compat.frontend.classification import classify
from triton_compat.errors import InferError
from triton_compat.core.validate import output_datatype
from triton_compat.frontend.openapi_schemas import DATATYPES

# wire datatype -> numpy dtype (BYTES: object): tritonclient's triton_to_np_dtype, looked up once
NP_DTYPES = {t: triton_to_np_dtype(t) for t in DATATYPES}


@dataclass
class ShmRef:
    """A tensor's place in a registered region: name, offset and size in bytes."""

    region: str
    offset: int
    byte_size: int


@dataclass
class ShmInput:
    """An input whose data is in a shared-memory region (read at `run`)."""

    ref: ShmRef
    datatype: str
    shape: list[int]


@dataclass
class OutputRequest:
    """An output the client asked for: binary (HTTP only; None = the request's default), the
    region to write it into, if any, and `class_count` > 0 for its top classes instead of its
    tensor (the classification extension, `triton_compat.frontend.classification`)."""

    name: str
    binary: bool | None = None
    shm: ShmRef | None = None
    class_count: int = 0


@dataclass
class InferRequest:
    """A decoded v2 infer request, the one type both front ends decode into (HTTP:
    `tensors.parse_request`, gRPC: `grpc/codec.decode_request`) and `Inference` submits.
    `inputs` keeps the client's order; a value is an array or a `ShmInput`. `outputs` None:
    every output of the model, as the protocol says."""

    model: str
    version: str
    id: str
    inputs: dict[str, np.ndarray | ShmInput]
    datatypes: dict[str, str]
    outputs: list[OutputRequest] | None
    parameters: dict = field(default_factory=dict)
    binary_default: bool = False     # HTTP: the `binary_data_output` request parameter


@dataclass
class OutputTensor:
    """One response output: wire datatype, the array (its shape is the output's), and the
    region it was written to (then the response carries no data for it)."""

    name: str
    datatype: str
    array: np.ndarray
    request: OutputRequest | None


def int_param(params: dict, key: str) -> int | None:
    """A non-negative integer request parameter (priority, timeout), or None when absent.

    Raises InferError(400) for another value, with the text of Triton's JSON reader (which
    answers it with 500: a client's mistake is a 400 here, docs/triton-conformance.md)."""
    value = params.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InferError(f"Unable to parse '{key}': attempt to access JSON "
                         "non-unsigned-integer as unsigned-integer")
    return value


def array_from_bytes(name: str, datatype: str, shape: list[int], raw, model: str,
                     request_id: str = "", declared: int | None = None) -> np.ndarray:
    """An input tensor from its raw bytes (a bytes-like; fixed-size types are not copied).
    `declared`: the byte size the client gave, when `raw` may be shorter (a shared-memory
    reference), as the size error reports it.

    BYTES: 4-byte little-endian length before each element. Raises InferError(400) when the
    size does not match the shape, with Triton core's texts (InferenceRequest::Normalize,
    ValidateBytesInputs)."""
    count = math.prod(shape)
    log = f"[request id: {request_id or '<id_unknown>'}] "
    if datatype == "BYTES":
        try:
            flat = deserialize_bytes_tensor(bytes(raw)) if len(raw) else \
                np.empty(0, dtype=np.object_)
        except Exception:
            raise InferError(f"{log}incomplete string length indicator for inference input "
                             f"'{name}' for model '{model}', expecting 4 bytes but only "
                             f"{len(raw) % 4} bytes available. Please make sure the string "
                             "length indicator is in one buffer.") from None
        if flat.size != count:
            raise InferError(f"{log}expected {count} string elements for inference input "
                             f"'{name}' for model '{model}', got {flat.size}")
        return flat.reshape(shape)
    dtype = triton_to_np_dtype(datatype)
    if dtype is None:
        raise InferError(f"input '{name}' has an invalid datatype '{datatype}'")
    expected = count * np.dtype(dtype).itemsize
    size = len(raw) if declared is None else declared
    if size != expected or len(raw) != expected:
        raise InferError(f"{log}input byte size mismatch for input '{name}' for model "
                         f"'{model}'. Expected {expected}, got {size}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def tensor_bytes(datatype: str, array: np.ndarray) -> bytes:
    """An output's raw bytes (BYTES elements length-prefixed, numpy str encoded as UTF-8)."""
    if datatype == "BYTES":
        flat = array.reshape(-1)
        if flat.dtype.kind == "U":
            flat = np.array([x.encode() for x in flat], dtype=np.object_)
        if flat.size == 0:
            return b""
        return serialize_byte_tensor(flat).item()
    return np.ascontiguousarray(array, dtype=NP_DTYPES.get(datatype)).tobytes()


class Inference:
    """One inference in flight: shared-memory regions held, the request submitted to its
    model's runtime (`future`; `inline` as `ModelRuntime.submit`, None: a loop thread, which
    runs a cheap model (`runs_inline`) at once, or, when the model has a dynamic batcher and
    `busy()` or its batch must wait, at the end of a pass: `later.call_soon`, by default the
    running asyncio loop's); `runtime`: the model's, when the caller has looked it up. `finish(outputs)`
    builds the response outputs; `release()` gives the regions back (always, in a
    `finally`).

    Raises InferError with the status Triton gives: 400 bad input or region use, 404 unknown
    model, 503 not ready / queue full / timeout."""

    def __init__(self, repository, shm, request: InferRequest,
                 inline: bool | None = None, busy=None, later=None, trace=None,
                 runtime=None) -> None:
        self.rt = runtime if runtime is not None else \
            repository.runtime(request.model, request.version)
        if trace is not None:               # the trace extension: REQUEST_START
            trace.start(request.model, int(self.rt.version), request.id)
        self.labels = repository.labels(request.model)
        defer = None
        if inline is None:                  # a loop thread: only a model cheaper than a hop
            inline = self.rt.runs_inline
            # a model with a dynamic batcher runs its batches on this loop (ModelRuntime.
            # _drain), and lets others arriving queue first: one batch. Without one (Triton's
            # default scheduler) each runs alone anyway: run it now.
            if inline and self.rt.batcher.dynamic and busy is not None:
                inline, defer = not busy(), later or asyncio.get_running_loop()
        self.shm, self.request, self.held, self.trace = shm, request, [], trace
        try:
            inputs = {}
            for name, value in request.inputs.items():
                if isinstance(value, ShmInput):
                    region, view = shm.acquire(value.ref)
                    self.held.append(region)
                    value = array_from_bytes(name, value.datatype, value.shape, view,
                                             request.model, request.id, value.ref.byte_size)
                inputs[name] = value
            for o in request.outputs or []:
                if o.shm is not None:
                    self.held.append(shm.acquire(o.shm)[0])
            params = request.parameters
            priority, timeout = (int_param(params, "priority"), int_param(params, "timeout")) \
                if params else (None, None)
            names = [o.name for o in request.outputs] if request.outputs is not None else None
            self.future = self.rt.submit(BackendRequest(inputs, names, request.id, params,
                                                        trace=trace),
                                         request.datatypes, priority or 0, timeout,
                                         inline=inline, defer=defer)
        except BaseException as e:
            if isinstance(e, InferError):
                e.refused = True             # answered before the model ran
            self.release()
            raise

    def finish(self, outputs: dict) -> tuple[str, list[OutputTensor]]:
        """The version that ran and the outputs in the order to send (the client's, else the
        config's); those asked into a region are written there."""
        rt, request = self.rt, self.request
        types = rt.signature.outputs
        wanted = request.outputs
        if wanted is None:
            wanted = [OutputRequest(name) for name in types]
        elif len({o.name for o in wanted}) < len(wanted):
            # an output asked for twice is sent once (its last ask), as Triton 2.51
            wanted = list({o.name: o for o in reversed(wanted)}.values())[::-1]
        sig = rt.signature
        result = [OutputTensor(o.name, output_datatype(sig, o.name, outputs[o.name]),
                               outputs[o.name], o) for o in wanted]
        for t in result:
            if t.request.class_count > 0:     # Triton's classification extension
                t.array = classify(t.array, t.datatype, t.request.class_count,
                                   sig.max_batch_size > 0, self.labels.get(t.name))
                t.datatype = "BYTES"
        for t in result:
            if t.request.shm is not None:
                self.shm.write(t.request.shm, tensor_bytes(t.datatype, t.array), t.name)
        return str(rt.version), result

    def outcome(self) -> tuple[str, list[OutputTensor]]:
        """Once `future` is done: `finish` of its outputs, the regions given back and the
        trace answered. Raises InferError (500 for a model failure)."""
        try:
            try:
                outputs = self.future.result()
            except Exception as e:
                raise model_failure(e) from None
            return self.finish(outputs)
        finally:
            self.close()

    async def settled(self) -> None:
        """Until `future` is done, awaited on the event loop (a model that ran inline is done
        already: no hop through the loop). Cancelled meanwhile: the inference is closed and
        the cancellation goes on. Its result or error is `outcome`'s."""
        if self.future.done():
            return
        try:
            await asyncio.wrap_future(self.future)
        except Exception:
            pass                             # outcome() says what went wrong
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """The end of the inference, answered or abandoned: its trace answered (for a runtime
        that did not mark it: an ensemble) and its regions given back; idempotent."""
        trace, self.trace = self.trace, None
        if trace is not None:
            trace.answered()
        self.release()

    def release(self) -> None:
        """Give back the regions this inference holds (idempotent)."""
        held, self.held = self.held, []
        for region in held:
            self.shm.release(region)


def model_failure(e: Exception) -> InferError:
    """The InferError a failed inference future is answered with: its own, else a model bug
    as a 500 in the v2 error shape."""
    if isinstance(e, InferError):
        return e
    return InferError(f"{type(e).__name__}: {e}", 500)   # a model bug: the v2 error shape


async def run(repository, shm, request: InferRequest,
              busy=None, trace=None) -> tuple[str, list[OutputTensor]]:
    """Run `request` on its model, awaiting it on the event loop: the version that ran it and
    the outputs to send (see `Inference`). A model cheaper than a thread hand-off runs on the
    loop itself when an instance is idle (`ModelRuntime.runs_inline`): at once when the
    request is alone, at the end of the loop's pass with the requests that arrived with it
    when `busy()` (other requests in progress); `trace`: its `Trace`, if sampled. Raises
    InferError (500 for a model failure)."""
    inference = Inference(repository, shm, request, busy=busy, trace=trace)
    await inference.settled()
    return inference.outcome()
