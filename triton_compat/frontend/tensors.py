"""KServe v2 tensors on the wire: JSON data and Triton's binary tensor data extension.

Owns: turning an infer request body (JSON header, optionally followed by binary tensor data,
split by the `Inference-Header-Content-Length` header) into numpy arrays, and numpy outputs
back into a response body (JSON `data`, or binary when asked with `binary_data` /
`binary_data_output`). BYTES tensors are numpy object arrays of `bytes`, serialized with
tritonclient's own helpers (4-byte little-endian length before each element); BF16 tensors use
`ml_dtypes.bfloat16`, as tritonclient does. A binary request's JSON header is decoded once per
distinct header (`_BinaryPlan`): clients repeat it on every request of one shape.

JSON goes through orjson, and through the standard `json` wherever orjson would differ: a body
orjson refuses (NaN / Infinity literals, integers past 64 bits, lone surrogates, bad UTF-8)
is parsed again by `json`, which accepts what it accepted before and raises the same errors;
a response with a non-finite float (orjson would write `null`; `json` writes `NaN`, which
tritonclient reads back) is written by `json`.

References: KServe v2 protocol (kserve/docs/predict-api/v2/required_api.md, "Inference");
Triton's binary data extension (server/docs/protocol/extension_binary_data.md).
"""

from __future__ import annotations

import json
import math

import numpy as np
import orjson
from tritonclient.utils import deserialize_bytes_tensor, triton_to_np_dtype

from triton_compat.frontend.classification import class_count
from triton_compat.frontend.infer import (NP_DTYPES, InferRequest, OutputRequest, OutputTensor,
                                          ShmInput, ShmRef, tensor_bytes)

MAX_ELEMENTS = 1 << 31          # larger tensors are refused before any allocation


class TensorError(ValueError):
    """A malformed request or tensor; the message is sent to the client with HTTP 400."""


def parse_request(body: bytes, header_length: int | None, model: str = "",
                  version: str = "") -> InferRequest:
    """Decode an infer request for `model` at `version` (the model named in error texts).
    A binary request whose JSON header was seen before is decoded from its `_BinaryPlan`.
    Raises TensorError with a message fit for the client."""
    plannable = type(body) is bytes and 0 < (header_length or 0) <= PLAN_HEADER_LIMIT
    if plannable:
        plan = _PLANS.get(body[:header_length])
        if plan is not None and len(body) - header_length == plan.data_size:
            return plan.request(body, header_length, model, version)
    request, binary_only = _parse_request(body, header_length, model, version)
    if plannable and binary_only:
        if len(_PLANS) >= PLAN_CACHE_SIZE:
            _PLANS.clear()
        _PLANS[body[:header_length]] = _BinaryPlan(request)
    return request


def _parse_request(body: bytes, header_length: int | None, model: str,
                   version: str) -> tuple[InferRequest, bool]:
    """`parse_request` without the plans: the JSON header read and checked; and whether
    every input came as fixed-size binary data (no JSON `data`, shared memory or BYTES)."""
    if header_length is not None:
        if not 0 <= header_length <= len(body):
            raise TensorError(f"Inference-Header-Content-Length {header_length} is outside the "
                              f"request body ({len(body)} bytes)")
        header, binary = body[:header_length], memoryview(body)[header_length:]
    else:
        header, binary = body, memoryview(b"")
    try:
        req = _loads(header)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TensorError(f"failed to parse the request JSON buffer: {e}") from None
    except RecursionError:      # deeper than json reads: a nested array, not an object
        req = None
    # tritonserver 2.51's texts from here on
    if not isinstance(req, dict) or "inputs" not in req:
        raise TensorError("Unable to parse 'inputs': attempt to access non-existing object "
                          "member 'inputs'")
    if not isinstance(req["inputs"], list):
        raise TensorError("Unable to parse 'inputs': attempt to access JSON non-array as array")
    params = _parameters(req, "the request")
    if params and any(isinstance(k, str) and k.startswith("triton_") for k in params):
        raise TensorError("parameter keys starting with 'triton_' are reserved for Triton usage "
                          "and should not be specified.")
    inputs, datatypes, offset, binary_only = {}, {}, 0, True
    for spec in req["inputs"]:
        name, array, used = _parse_input(spec, binary[offset:], header_length is not None,
                                         model)
        if name in inputs:
            raise TensorError(f"input '{name}' already exists in request")   # Triton's text
        inputs[name], datatypes[name] = array, spec["datatype"]
        offset += used
        binary_only = (binary_only and spec["datatype"] != "BYTES"
                       and "binary_data_size" in (spec.get("parameters") or {}))
    if offset != len(binary):
        raise TensorError(f"{len(binary) - offset} bytes of binary tensor data are not "
                          "claimed by any input's binary_data_size")
    outputs = None
    if req.get("outputs") is not None:
        if not isinstance(req["outputs"], list):
            raise TensorError("'outputs' must be a JSON array")
        # a repeated output is answered once (infer.Inference.finish), as tritonserver 2.51
        outputs = [_parse_output(o, bool(params.get("binary_data_output", False)))
                   for o in req["outputs"]]
    return InferRequest(model, version, str(req.get("id", "")), inputs, datatypes, outputs,
                        params, bool(params.get("binary_data_output", False))), binary_only


PLAN_CACHE_SIZE = 256           # binary request headers remembered (all dropped when full)
PLAN_HEADER_LIMIT = 4096        # bytes; longer headers are not remembered
_PLANS: dict[bytes, "_BinaryPlan"] = {}


class _BinaryPlan:
    """What a binary request's JSON header says, kept to decode the next request with the
    same header bytes (a client sends the same header for every request of one shape: the
    JSON parse and its checks were most of a small request's decoding). Only for headers whose
    inputs are all fixed-size binary data; `request` makes arrays over the new body's bytes.
    Nothing a caller may change is shared: the request's dicts and lists are new each time."""

    __slots__ = ("id", "inputs", "datatypes", "outputs", "parameters", "binary_default",
                 "data_size")

    def __init__(self, parsed: InferRequest) -> None:
        self.id, self.parameters = parsed.id, dict(parsed.parameters)
        self.datatypes = dict(parsed.datatypes)
        self.outputs = None if parsed.outputs is None else list(parsed.outputs)
        self.binary_default = parsed.binary_default
        self.inputs, offset = [], 0           # (name, dtype, element count, offset, shape)
        for name, array in parsed.inputs.items():
            self.inputs.append((name, array.dtype, array.size, offset, array.shape))
            offset += array.nbytes
        self.data_size = offset

    def request(self, body: bytes, start: int, model: str, version: str) -> InferRequest:
        """The request of `body`, whose JSON header (`start` bytes) is this plan's."""
        inputs = {name: np.frombuffer(body, dtype, count, start + offset).reshape(shape)
                  for name, dtype, count, offset, shape in self.inputs}
        outputs = None if self.outputs is None else list(self.outputs)
        return InferRequest(model, version, self.id, inputs, dict(self.datatypes), outputs,
                            dict(self.parameters), self.binary_default)


def parse_raw_request(body: bytes, sig, model: str = "", version: str = "") -> InferRequest:
    """Decode Triton's raw binary request (`Inference-Header-Content-Length: 0`: no JSON, the
    body is the data of the model's only input; server/docs/protocol/extension_binary_data.md
    "Raw Binary Request"). The input's name, datatype and shape come from the config `sig`
    (a `validate.Signature`), as Triton core's InferenceRequest::Normalize deduces them: a
    batching model gets batch 1, the one variable-sized dimension takes what the body holds,
    a BYTES input must have shape [1] and its body is that one element. Every output is sent
    as binary data. Raises TensorError with tritonserver 2.51's texts."""
    prefix = "[request id: <id_unknown>] "
    if len(sig.inputs) != 1:
        raise TensorError(f"{prefix}Raw request must only have 1 input (found 1) to be deduced "
                          f"but got {len(sig.inputs)} inputs in '{model}' model configuration")
    name, spec = next(iter(sig.inputs.items()))
    dims = list(spec.dims[1:] if sig.max_batch_size > 0 else spec.dims)
    shape = ([1] if sig.max_batch_size > 0 else []) + dims
    variable = [i for i, d in enumerate(shape) if d == -1]
    if len(variable) > 1:
        raise TensorError(f"{prefix}The shape of the raw input '{name}' can not be deduced "
                          "because there are more than one variable-sized dimension")
    fixed = math.prod(d for d in dims if d != -1)
    if spec.wire == "BYTES":
        if variable or fixed != 1:
            raise TensorError(f"{prefix}For BYTE datatype raw input '{name}', the model must "
                              "have input shape [1]")
        array = np.empty(1, dtype=np.object_)
        array[0] = bytes(body)
        array = array.reshape(shape)
    else:
        dtype = np.dtype(triton_to_np_dtype(spec.wire))
        if variable:
            shape[variable[0]] = len(body) // dtype.itemsize // max(fixed, 1)
        array = _from_binary(name, spec.wire, dtype, shape, bytes(body))
    return InferRequest(model, version, "", {name: array}, {name: spec.wire}, None, {}, True)


def _loads(header) -> object:
    """The JSON header as `json.loads` reads it: orjson, else `json` (see the module
    docstring). Raises json.JSONDecodeError, UnicodeDecodeError or RecursionError."""
    try:
        return orjson.loads(header)
    except orjson.JSONDecodeError:
        return json.loads(header)


def _parameters(obj: dict, kind: str, name: str = "") -> dict:
    # Not as Triton 2.51, on purpose: it answers 500 for a request `parameters` (or `outputs`)
    # of the wrong JSON type and ignores an output's; bad input is a 400 here, never a 5xx.
    params = obj.get("parameters") or {}
    if type(params) is not dict:
        where = f"{kind} '{name}'" if name else kind
        raise TensorError(f"'parameters' of {where} must be a JSON object")
    return params


def _parse_input(spec, binary: memoryview, has_header: bool,
                 model: str) -> tuple[str, np.ndarray | ShmInput, int]:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise TensorError("each input must be an object with a 'name'")
    name, datatype, shape = spec["name"], spec.get("datatype"), spec.get("shape")
    dtype = NP_DTYPES.get(datatype) if isinstance(datatype, str) else None
    if dtype is None:
        raise TensorError(f"input '{name}' has an invalid datatype {datatype!r}")
    if type(shape) is not list or not all([type(d) is int and d >= 0 for d in shape]):
        raise TensorError(f"input '{name}' must have a 'shape' of non-negative integers")
    count = math.prod(shape)
    if count > MAX_ELEMENTS:
        raise TensorError(f"input '{name}' has {count} elements (shape {shape}), more than "
                          f"the {MAX_ELEMENTS} allowed")
    params = _parameters(spec, "input", name)
    size = params.get("binary_data_size")
    ref = _shm_ref(params) if params else None
    if ("data" in spec) + (size is not None) + (ref is not None) > 1:
        given = [f for f, on in (("'data'", "data" in spec),
                                 ("'binary_data_size'", size is not None),
                                 ("'shared_memory_region'", ref is not None)) if on]
        raise TensorError("Input must set only one of the following fields: 'data', "
                          "'binary_data_size' in 'parameters', 'shared_memory_region' in "
                          "'parameters'. But set " + " ".join(given))   # Triton's text
    if ref is not None:
        return name, ShmInput(ref, datatype, shape), 0
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise TensorError("Unable to parse 'binary_data_size'")
        if size and not has_header:                    # Triton's texts, from here on
            raise TensorError("must specify valid 'Infer-Header-Content-Length' in request "
                              "header and 'binary_data_size' when passing inputs in binary "
                              "data format")
        if size > len(binary):
            raise TensorError(f"unexpected size for input '{name}', expecting "
                              f"{size - len(binary)} additional bytes for model '{model}'")
        return name, _from_binary(name, datatype, dtype, shape, bytes(binary[:size])), size
    if "data" not in spec:
        raise TensorError("Input must set only one of the following fields: 'data', "
                          "'binary_data_size' in 'parameters', 'shared_memory_region' in "
                          "'parameters'. But no field is set")
    return name, _from_json(name, datatype, dtype, shape, spec["data"]), 0


def _from_binary(name, datatype, dtype, shape, raw: bytes) -> np.ndarray:
    count = math.prod(shape)
    if datatype == "BYTES":
        try:
            flat = deserialize_bytes_tensor(raw) if raw else np.empty(0, dtype=np.object_)
        except Exception:
            raise TensorError(f"input '{name}': malformed BYTES binary data") from None
        if flat.size != count:
            raise TensorError(f"input '{name}': {flat.size} BYTES elements for shape {shape}")
        return flat.reshape(shape)
    itemsize = np.dtype(dtype).itemsize
    if len(raw) != count * itemsize:
        raise TensorError(f"input '{name}': unexpected total byte size {len(raw)} for "
                          f"{datatype} shape {shape}, expecting {count * itemsize}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def _flatten(data) -> list:
    """Row-major flattening of nested JSON lists, without recursion (depth-safe)."""
    if not isinstance(data, list):
        return [data]
    out, stack = [], [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out


def _json_types(datatype: str) -> set[type]:
    """The Python types (as orjson / json read them) a JSON `data` element of `datatype` may be."""
    if datatype == "BYTES":
        return {str}
    if datatype == "BOOL":
        return {bool}
    return {int} if datatype.startswith(("INT", "UINT")) else {int, float}


def _from_json(name, datatype, dtype, shape, data) -> np.ndarray:
    # The element types as one set, built in C (`map(type, ...)`), not a per-element
    # isinstance loop: on a 2048-element input that loop and the flattening were 0.35 ms of
    # the request; a flat list (what tritonclient and perf_analyzer send) skips _flatten.
    flat = data if isinstance(data, list) else [data]
    types = set(map(type, flat))
    if list in types:
        flat = _flatten(flat)
        types = set(map(type, flat))
    if not types <= _json_types(datatype):
        raise TensorError(_json_type_error(datatype))
    if len(flat) != math.prod(shape):
        raise TensorError("Unable to parse 'data': Shape does not match true shape of 'data' "
                          "field")
    if datatype == "BYTES":
        return np.array([x.encode() for x in flat] or [], dtype=np.object_).reshape(shape)
    try:
        return np.array(flat, dtype=dtype).reshape(shape)
    except (OverflowError, ValueError):
        if datatype.startswith("UINT") and min(flat) < 0:
            raise TensorError(_json_type_error(datatype)) from None
        raise TensorError(f"Unable to parse 'data': a value of input '{name}' does not fit "
                          f"{datatype}") from None


def _json_type_error(datatype: str) -> str:
    """Triton's HTTP frontend text for a JSON `data` element of the wrong type."""
    if datatype == "BYTES":
        return "Unable to parse JSON bytes array: attempt to access JSON non-string as string"
    what = ("non-boolean as boolean" if datatype == "BOOL" else
            "non-unsigned-integer as unsigned-integer" if datatype.startswith("UINT") else
            "non-signed-integer as signed-integer" if datatype.startswith("INT") else
            "non-number as double")
    return f"Unable to parse 'data': attempt to access JSON {what}"


def _parse_output(spec, binary_default: bool) -> OutputRequest:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise TensorError("each requested output must be an object with a 'name'")
    params = _parameters(spec, "output", spec["name"])
    if not params:
        return OutputRequest(spec["name"], binary_default)
    ref = _shm_ref(params)
    if ref is not None and params.get("binary_data") is True:      # Triton's text
        raise TensorError("Output can't set both 'shared_memory_region' and 'binary_data'")
    if ref is not None and "classification" in params:
        raise TensorError("Output can't set both 'shared_memory_region' and 'classification'")
    return OutputRequest(spec["name"], bool(params.get("binary_data", binary_default)), ref,
                         class_count(params.get("classification", 0)))


def _shm_ref(params: dict) -> ShmRef | None:
    """The `shared_memory_*` parameters of an input or output (HTTP: offset and byte size
    default to 0, as Triton's), or None without `shared_memory_region`."""
    if "shared_memory_region" not in params:
        return None
    values = [params["shared_memory_region"], params.get("shared_memory_offset", 0),
              params.get("shared_memory_byte_size", 0)]
    # Not as Triton 2.51, on purpose: a mistyped value is its 500 "Unable to parse ..."; here
    # bad input is a 400, never a 5xx.
    if not isinstance(values[0], str):
        raise TensorError("Unable to parse 'shared_memory_region': attempt to access JSON "
                          "non-string as string")
    for key, value in zip(("shared_memory_offset", "shared_memory_byte_size"), values[1:]):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise TensorError(f"Unable to parse '{key}': attempt to access JSON "
                              "non-unsigned-integer as unsigned-integer")
    return ShmRef(*values)


def encode_response(model: str, version: str, request_id: str, outputs: list[OutputTensor],
                    binary_default: bool = False) -> tuple[bytes, int | None]:
    """Response body and its JSON header length (None when the body is only JSON).

    `outputs` in the order to send; each is sent as JSON `data`, as binary (its request's
    `binary_data`, else `binary_default`), or, when it went into a shared-memory region,
    with no data (name, datatype and shape only, as Triton)."""
    entries, chunks, finite = [], [], True
    for t in outputs:
        entry = {"name": t.name, "datatype": t.datatype, "shape": list(t.array.shape)}
        request = t.request or OutputRequest(t.name)
        binary = binary_default if request.binary is None else request.binary
        if request.shm is not None:
            pass                 # Triton sends only name, datatype and shape for these
        elif binary:
            raw = tensor_bytes(t.datatype, t.array)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"], all_finite = _to_json(t.datatype, t.array)
            finite = finite and all_finite
        entries.append(entry)
    body = {"model_name": model, "model_version": version, "outputs": entries}
    if request_id:
        body["id"] = request_id
    header = _dumps(body, finite)
    if not chunks:
        return header, None
    return header + b"".join(chunks), len(header)


def _dumps(body: dict, finite: bool) -> bytes:
    """The response JSON: orjson when every float is finite, else (or for a value orjson
    cannot write) `json`, as the module docstring says. Raises TypeError / ValueError for a
    value that is not JSON."""
    if finite:
        try:
            return orjson.dumps(body)
        except orjson.JSONEncodeError:
            pass
    return json.dumps(body, separators=(",", ":")).encode()


def _to_json(datatype: str, array: np.ndarray) -> tuple[list, bool]:
    """An output's JSON `data` (flat, row-major) and whether it holds no NaN / infinity
    (floats checked after FP16 / BF16 become float32, whose numpy kind is "f")."""
    flat = array.reshape(-1)
    if datatype == "BYTES":
        return [x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)
                for x in flat], True
    if datatype in ("FP16", "BF16"):
        flat = flat.astype(np.float32)
    return flat.tolist(), flat.dtype.kind != "f" or bool(np.isfinite(flat).all())
