"""KServe v2 gRPC messages ↔ the protocol-neutral `InferRequest` / `OutputTensor`.

Owns: decoding a `ModelInferRequest` (inputs from shared memory, typed `contents`, or
`raw_input_contents` taken in order by the inputs that use neither; `InferParameter`s to Python
values, checked as Triton checks them) and encoding a `ModelInferResponse` (one
`raw_output_contents` entry per output, empty for an output written to a region). Messages are
Triton's own generated classes (`tritonclient.grpc.service_pb2`). Error texts are Triton's
(infer_handler.cc InferGRPCToInput / SetInferenceRequestMetadata, grpc_utils.h
ParseSharedMemoryParams). Reference: KServe v2 gRPC protocol (grpc_predict_v2.proto).
"""

from __future__ import annotations

import math

import numpy as np
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import triton_to_np_dtype

from triton_compat.frontend.classification import class_count
from triton_compat.errors import InferError
from triton_compat.frontend.infer import (InferRequest, OutputRequest, OutputTensor, ShmInput, ShmRef,
                                 array_from_bytes, tensor_bytes)
from triton_compat.frontend.tensors import MAX_ELEMENTS

# InferTensorContents field -> the datatypes it carries (FP16 / BF16 have none: raw only)
CONTENTS_TYPES = {
    "bool_contents": ("BOOL",), "int_contents": ("INT8", "INT16", "INT32"),
    "int64_contents": ("INT64",), "uint_contents": ("UINT8", "UINT16", "UINT32"),
    "uint64_contents": ("UINT64",), "fp32_contents": ("FP32",), "fp64_contents": ("FP64",),
    "bytes_contents": ("BYTES",),
}
# request parameter -> (allowed InferParameter kinds, Triton's text for another kind)
PARAMETER_KINDS = {
    "sequence_id": (("int64_param", "string_param"), "int64_param or string_param."),
    "sequence_start": (("bool_param",), "bool_param."),
    "sequence_end": (("bool_param",), "bool_param."),
    "priority": (("int64_param", "uint64_param"), "int64_param or uint64_param."),
    "timeout": (("int64_param",), "int64_param."),
    "triton_enable_empty_final_response": (("bool_param",), "bool_param."),
}


def parameters(params) -> dict:
    """A protobuf map of `InferParameter` → {key: bool | int | str | float}."""
    out = {}
    for key, p in params.items():
        kind = p.WhichOneof("parameter_choice")
        out[key] = getattr(p, kind) if kind is not None else None
    return out


def set_parameter(target, key: str, value) -> None:
    """Store a Python value into a protobuf map of `InferParameter`."""
    p = target[key]
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    else:
        p.string_param = str(value)


def request_parameters(msg: pb.ModelInferRequest) -> dict:
    """The request's parameters, their kinds checked as Triton's SetInferenceRequestMetadata.
    Raises InferError(400)."""
    if not msg.parameters:
        return {}
    for key, p in msg.parameters.items():
        kind = p.WhichOneof("parameter_choice")
        if key in PARAMETER_KINDS:
            allowed, text = PARAMETER_KINDS[key]
            if kind not in allowed:
                raise InferError(f"invalid value type for '{key}' parameter, expected {text}")
            if key == "priority" and kind == "int64_param" and p.int64_param < 0:
                raise InferError("invalid value for 'priority', expected value >= 0.")
        elif key.startswith("triton_"):
            raise InferError("parameter keys starting with 'triton_' are reserved for Triton "
                             "usage. Only the following keys starting with 'triton_' are "
                             "allowed: triton_enable_empty_final_response")
        elif kind not in ("int64_param", "bool_param", "string_param", "double_param"):
            raise InferError(f"invalid value type for '{key}' parameter, expected int64_param, "
                             "bool_param, or string_param.")
    return parameters(msg.parameters)


def shm_ref(params, tensor: str) -> ShmRef | None:
    """A tensor's `shared_memory_*` parameters (Triton's ParseSharedMemoryParams), or None.
    Raises InferError(400) with Triton's texts."""
    if not params:                       # the common case: a tensor without parameters
        return None

    def entry(key):          # (the value's kind or None, the InferParameter or None)
        if key not in params:
            return None, None
        p = params[key]
        return p.WhichOneof("parameter_choice"), p

    region, region_p = entry("shared_memory_region")
    offset, offset_p = entry("shared_memory_offset")
    size, size_p = entry("shared_memory_byte_size")
    for key, kind in (("shared_memory_offset", offset), ("shared_memory_byte_size", size)):
        if kind is not None and region is None:
            raise InferError(f"'{key}' can not be specified without 'shared_memory_region' "
                             f"parameter for tensor '{tensor}'")
        if kind not in (None, "int64_param"):
            raise InferError(f"invalid value type for '{key}' parameter for tensor '{tensor}', "
                             "expected int64_param.")
    if region is None:
        return None
    if region != "string_param":
        raise InferError("invalid value type for 'shared_memory_region' parameter for tensor "
                         f"'{tensor}', expected string_param.")
    if size is None:
        raise InferError("'shared_memory_byte_size' must be specified along with "
                         f"'shared_memory_region' parameter for tensor '{tensor}'")
    # Triton casts a negative int64 to size_t, which then fails its range checks
    return ShmRef(region_p.string_param, (offset_p.int64_param if offset else 0) % (1 << 64),
                  size_p.int64_param % (1 << 64))


def decode_request(msg: pb.ModelInferRequest) -> InferRequest:
    """A `ModelInferRequest` as an `InferRequest`. Raises InferError(400) with Triton's text for
    malformed tensors or parameters."""
    model, raw = msg.model_name, msg.raw_input_contents
    inputs, datatypes, next_raw = {}, {}, 0
    for t in msg.inputs:
        name, datatype = t.name, t.datatype
        if name in inputs:
            raise InferError(f"input '{name}' already exists in request")
        shape = list(t.shape)
        if min(shape, default=0) < 0 or math.prod(shape) > MAX_ELEMENTS:
            raise InferError(f"input '{name}' has an invalid shape {shape}")
        ref = shm_ref(t.parameters, name)
        if ref is not None:
            if t.HasField("contents"):
                raise InferError("unexpected 'content' provided when using shared memory for "
                                 f"input tensor '{name}' for model '{model}'")
            inputs[name] = ShmInput(ref, datatype, shape)
        elif t.HasField("contents"):
            if raw:
                raise InferError("contents field must not be specified when using "
                                 f"raw_input_contents for '{name}' for model '{model}'")
            inputs[name] = _from_contents(t, shape, model, msg.id)
        elif next_raw < len(raw):
            inputs[name] = array_from_bytes(name, datatype, shape, raw[next_raw], model, msg.id)
            next_raw += 1
        else:
            raise InferError(f"unable to find data for input tensor '{name}' for model "
                             f"'{model}' in request.")
        datatypes[name] = datatype
    outputs = None
    if len(msg.outputs):
        outputs = []             # a repeated output is answered once, as tritonserver 2.51
        for o in msg.outputs:
            name = o.name
            ref = shm_ref(o.parameters, name)
            if ref is not None and "classification" in o.parameters:
                raise InferError("output can't set both 'shared_memory_region' and "
                                 "'classification'")
            count = o.parameters["classification"].int64_param \
                if "classification" in o.parameters else 0
            outputs.append(OutputRequest(name, None, ref, class_count(count)))
    return InferRequest(model, msg.model_version, msg.id, inputs, datatypes, outputs,
                        request_parameters(msg))


def _from_contents(t, shape: list[int], model: str, request_id: str) -> np.ndarray:
    filled = [f for f in CONTENTS_TYPES if len(getattr(t.contents, f))]
    if len(filled) > 1:
        raise InferError(f"unexpected explicit tensor data for input tensor '{t.name}' for "
                         f"model '{model}', binary data was already supplied.")
    field = filled[0] if filled else next(
        (f for f, types in CONTENTS_TYPES.items() if t.datatype in types), None)
    if field is None or t.datatype not in CONTENTS_TYPES[field]:
        given = CONTENTS_TYPES[field][-1] if field else t.datatype
        raise InferError(f"unexpected explicit tensor data for input tensor '{t.name}' for "
                         f"model '{model}' of type '{given}', expected datatype "
                         f"'{t.datatype}'")
    values = getattr(t.contents, field)
    count = math.prod(shape)
    if len(values) != count:
        if t.datatype == "BYTES":
            raise InferError(f"[request id: {request_id or '<id_unknown>'}] expected {count} "
                             f"string elements for inference input '{t.name}' for model "
                             f"'{model}', got {len(values)}")
        size = np.dtype(triton_to_np_dtype(t.datatype)).itemsize
        raise InferError(f"[request id: {request_id or '<id_unknown>'}] input byte size "
                         f"mismatch for input '{t.name}' for model '{model}'. Expected "
                         f"{count * size}, got {len(values) * size}")
    if t.datatype == "BYTES":
        return np.array(list(values), dtype=np.object_).reshape(shape)
    try:
        return np.array(values, dtype=triton_to_np_dtype(t.datatype)).reshape(shape)
    except (OverflowError, ValueError) as e:
        raise InferError(f"input '{t.name}': {e}") from None


def encode_response(model: str, version: str, request_id: str,
                    outputs: list[OutputTensor]) -> pb.ModelInferResponse:
    """The `ModelInferResponse`: every output's metadata and one `raw_output_contents` entry
    per output, in the same order (clients find an output's bytes by its index); the entry of
    an output written to a shared-memory region is empty."""
    resp = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    for t in outputs:
        resp.outputs.add(name=t.name, datatype=t.datatype, shape=t.array.shape)
        shm = t.request is not None and t.request.shm is not None
        resp.raw_output_contents.append(b"" if shm else tensor_bytes(t.datatype, t.array))
    return resp
