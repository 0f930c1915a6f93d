"""Triton's generate extension: `POST /v2/models/{m}[/versions/{v}]/generate` and
`/generate_stream` (server-sent events), as tritonserver 2.51 answers them.

Owns: the JSON body → inputs and parameters (http_server.cc ConvertGenerateRequest: each key,
in body order, is a model input when it names one, else a request parameter of type string,
int, bool or double; `parameters` holds more of either; `id` is the request id and a
parameter too), the response objects (FinalizeResponse: outputs of one element unwrapped to
a scalar, BYTES as text, the request's `id` echoed, keys sorted), "exactly 1 response" for
`/generate`, and the event stream: one `data: {...}` event per response, sent as the model
sends it. The first response sets the status; a model's error is an event `{"error": ...}`;
errors before the model runs are plain JSON. A client that disconnects cancels the request
(the engine aborts it). Decoupled models (the LLM) stream their own responses; other models
answer once through the same runtime and batcher as `/infer`.
Reference: server/docs/protocol/extension_generate.md, http_server.cc (2.51) HandleGenerate,
GenerateRequestClass.
"""

from __future__ import annotations

import json
from typing import AsyncIterator

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from tritonclient.utils import triton_to_np_dtype

from triton_compat.core.config import wire_datatype
from triton_compat.frontend.context import V2Context
from triton_compat.errors import InferError
from triton_compat.frontend.infer import InferRequest, run
from triton_compat.frontend.tensors import _json_type_error

# Triton's text. tritonserver 2.51 sends it as a 200 whose body is {"error": ...} (its
# response had started, measured); here the response has not started: a 400, as any bad request.
ONE_RESPONSE = ("generate expects model to produce exactly 1 response, use generate stream "
                "for model that generates various number of responses")
PARAM_TYPES = (str, int, float, bool)


class _Object(list):
    """A JSON object read as its (key, value) pairs, in body order, repeats kept."""


def parse_body(raw: bytes) -> _Object:
    """The request JSON object as (key, value) pairs in body order, repeats kept (Triton reads
    them one by one). Raises InferError(400)."""
    try:
        body = json.loads(raw or b"{}", object_pairs_hook=_Object)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise InferError(f"failed to parse the request JSON buffer: {e}", refused=True) \
            from None
    if not isinstance(body, _Object):
        raise InferError("the generate request must be a JSON object", refused=True)
    return body


def _shape(dims: list[int], count: int, name: str) -> list[int]:
    """Triton's two-pass shape for `count` values on metadata `dims`: fixed dims take their
    share, the innermost variable dim the rest, other variable dims 1."""
    shape = list(dims)
    for d in reversed(shape):
        if d != -1:
            if d == 0 or count % d:
                raise InferError(f"The schema can not convert input '{name}' to tensor with "
                                 "proper shape")
            count //= d
    for i in reversed(range(len(shape))):
        if shape[i] == -1:
            shape[i], count = count, 1
    if count != 1:
        raise InferError(f"The schema can not convert input '{name}' to tensor with proper "
                         "shape")
    return shape


def _tensor(name: str, wire: str, dims: list[int], value) -> np.ndarray:
    """One input from its JSON value (a value or a 1-D array). Raises InferError(400) with
    Triton's texts."""
    flat = value if isinstance(value, list) and not isinstance(value, _Object) else [value]
    if wire == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            raise InferError(_json_type_error("BYTES"))
        array = np.array([v.encode() for v in flat], dtype=np.object_)
    else:
        types = {bool} if wire == "BOOL" else {int} if wire.startswith(("INT", "UINT")) \
            else {int, float}
        if not all(type(v) in types for v in flat) or \
                (wire.startswith("UINT") and any(v < 0 for v in flat)):
            raise InferError(_json_type_error(wire))
        try:
            array = np.array(flat, dtype=triton_to_np_dtype(wire))
        except (OverflowError, ValueError):
            raise InferError(f"Unable to parse 'data': a value of input '{name}' does not fit "
                             f"{wire}") from None
    return array.reshape(_shape(dims, array.size, name))


def _convert(config, pairs, inputs: dict, datatypes: dict, params: dict,
             request_id: str) -> None:
    """Triton's ConvertGenerateRequest over `pairs`, filling inputs and parameters."""
    by_name = {t.name: t for t in config.input}
    lead = [-1] if config.max_batch_size > 0 else []
    for key, value in pairs:
        t = by_name.get(key)
        if t is None:
            if not isinstance(value, PARAM_TYPES):
                raise InferError(f"parameter '{key}' has invalid type. It should be either "
                                 "'int', 'bool', or 'string'.")
            params[key] = value
            continue
        if key in inputs:
            raise InferError(f"[request id: {request_id or '<id_unknown>'}] input '{key}' "
                             "already exists in request")
        wire = wire_datatype(t.data_type)
        inputs[key] = _tensor(key, wire, lead + list(t.dims), value)
        datatypes[key] = wire


def to_inputs(config, pairs: _Object) -> tuple[dict, dict, dict, str]:
    """(inputs, datatypes, parameters, request id) from a generate body, shaped by the
    model's metadata. Raises InferError(400, refused) with Triton's texts."""
    try:
        return _to_inputs(config, pairs)
    except InferError as e:
        e.refused = True
        raise


def _to_inputs(config, pairs: _Object) -> tuple[dict, dict, dict, str]:
    ids = [v for k, v in pairs if k == "id"]
    if ids and not isinstance(ids[0], str):
        raise InferError("Unable to parse 'id': attempt to access JSON non-string as string")
    request_id = ids[0] if ids else ""
    inputs, datatypes, params = {}, {}, {}
    top = []
    for key, value in pairs:
        if key != "parameters":
            top.append((key, value))
            continue
        if any(t.name == "parameters" for t in config.input):
            raise InferError("Keyword 'parameters' for nested schema also given as input "
                             "tensor name")
        if not isinstance(value, _Object):
            raise InferError("Expected JSON object for keyword: 'parameters': attempt to "
                             "access JSON non-object as object")
        try:
            _convert(config, value, inputs, datatypes, params, request_id)
        except InferError as e:
            raise InferError(f"Converting keyword: 'parameters': {e.message}") from None
    _convert(config, top, inputs, datatypes, params, request_id)
    return inputs, datatypes, params, request_id


def to_json(model: str, version: str, outputs: dict, request_id: str = "") -> dict:
    """A generate response: outputs of one element as scalars, BYTES as text, the request's
    id when it has one, keys sorted as Triton's std::map writes them."""
    out = {"model_name": model, "model_version": version}
    if request_id:
        out["id"] = request_id
    for name, array in outputs.items():
        flat = np.asarray(array).reshape(-1)
        values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else
                  v.item() if hasattr(v, "item") else v for v in flat]
        out[name] = values[0] if len(values) == 1 else values
    return dict(sorted(out.items()))


async def responses(ctx: V2Context, model: str, version: str,
                    pairs: _Object) -> AsyncIterator[dict]:
    """The response objects of one generate request. Raises InferError: refused before it
    runs (`refused` set), or a model's error response."""
    rt = ctx.repository().runtime(model, version)
    inputs, datatypes, params, request_id = to_inputs(rt.config, pairs)
    if rt.decoupled:
        async for outputs, _final in rt.generate(inputs, request_id, datatypes, params):
            if outputs is not None:            # None: a flag-only final response
                yield to_json(model, str(rt.version), outputs, request_id)
        return
    ran, tensors = await run(ctx.repository(), ctx.shm, InferRequest(
        model, version, request_id, inputs, datatypes, None, params))
    yield to_json(model, ran, {t.name: t.array for t in tensors}, request_id)


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def router(ctx: V2Context) -> APIRouter:
    """The generate routes over `ctx`."""
    r = APIRouter()

    @r.post("/v2/models/{model}/generate")
    @r.post("/v2/models/{model}/versions/{version}/generate")
    async def generate(model: str, request: Request, version: str = ""):
        ctx.repository().runtime(model, version)      # unknown model: 404 first
        pairs = parse_body(await request.body())
        got = []
        stream = responses(ctx, model, version, pairs)
        try:
            async for item in stream:
                got.append(item)
                if len(got) > 1:
                    raise InferError(ONE_RESPONSE)
        finally:
            await stream.aclose()
        if not got:
            raise InferError(ONE_RESPONSE)
        return JSONResponse(got[0])

    @r.post("/v2/models/{model}/generate_stream")
    @r.post("/v2/models/{model}/versions/{version}/generate_stream")
    async def generate_stream(model: str, request: Request, version: str = ""):
        ctx.repository().runtime(model, version)
        pairs = parse_body(await request.body())
        stream = responses(ctx, model, version, pairs)
        status, first = 200, None
        try:                   # the first response sets the status; a refusal is plain JSON
            first = _event(await stream.__anext__())
        except StopAsyncIteration:
            pass
        except InferError as e:
            if e.refused:
                raise
            status, first = e.status, _event({"error": e.message})
            await stream.aclose()

        async def events():
            try:
                if first is not None:
                    yield first
                if status != 200:
                    return
                async for item in stream:
                    yield _event(item)
            except InferError as e:
                yield _event({"error": e.message})
            finally:
                await stream.aclose()        # a disconnect cancels us here: abort the request

        return StreamingResponse(events(), status_code=status, media_type="text/event-stream")

    return r
