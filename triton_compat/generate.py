"""Triton's generate extension: `POST /v2/models/{m}[/versions/{v}]/generate` and
`/generate_stream` (server-sent events).

Owns: the JSON body → inputs and parameters (a key naming a model input is that input, any
other key a request parameter; a repeated key is refused), the response objects (outputs of
one element unwrapped to a scalar, BYTES as text), "exactly 1 response" for `/generate`, and the
event stream: one `data: {...}` event per response, flushed as produced; an error inside the
stream is `data: {"error": "..."}`; a client that disconnects cancels the request (the engine
aborts it). Decoupled models (the LLM) stream their own responses; other models answer once
through the same runtime and batcher as `/infer`.
Reference: server/docs/protocol/extension_generate.md, http_server.cc GenerateRequestClass.
"""

from __future__ import annotations

import json
from typing import AsyncIterator

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from tritonclient.utils import triton_to_np_dtype

from triton_compat.config import wire_datatype
from triton_compat.context import V2Context
from triton_compat.errors import InferError
from triton_compat.infer import InferRequest, run

# Triton's text. tritonserver 2.51 sends it as a 200 whose body is {"error": ...} (its
# response had started, measured); here the response has not started: a 400, as any bad request.
ONE_RESPONSE = ("generate expects model to produce exactly 1 response, use generate stream "
                "for model that generates various number of responses")


def _no_duplicates(pairs: list) -> dict:
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise InferError(f"generate request has the key '{key}' more than once")
        seen[key] = value
    return seen


def parse_body(raw: bytes) -> dict:
    """The request JSON object, keys in body order. Raises InferError(400)."""
    try:
        body = json.loads(raw or b"{}", object_pairs_hook=_no_duplicates)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise InferError(f"failed to parse the request JSON buffer: {e}") from None
    if not isinstance(body, dict):
        raise InferError("the generate request must be a JSON object")
    return body


def to_inputs(config, body: dict) -> tuple[dict, dict, dict]:
    """(inputs, datatypes, parameters) from a generate body, shaped by the model's config
    (a batch dimension of 1 for batching models). Raises InferError(400) with Triton's texts."""
    by_name = {t.name: t for t in config.input}
    inputs, datatypes = {}, {}
    for name, t in by_name.items():
        if name not in body:
            if not t.optional:   # current source's text (2.51 let core say "expected 2 inputs")
                raise InferError("unexpected key not found in generate request, expecting key "
                                 f"'{name}'")
            continue
        wire = wire_datatype(t.data_type)
        value = body[name]
        flat = value if isinstance(value, list) else [value]
        try:
            if wire == "BYTES":
                array = np.array([v.encode() if isinstance(v, str) else
                                  json.dumps(v).encode() for v in flat], dtype=np.object_)
            else:
                array = np.array(flat, dtype=triton_to_np_dtype(wire))
        except (TypeError, ValueError, OverflowError):
            raise InferError(f"input '{name}' has unsupported datatype {wire}") from None
        dims = [d if d != -1 else array.size for d in t.dims] or [array.size]
        if int(np.prod(dims)) != array.size:
            raise InferError(f"The schema can not convert input '{name}' to tensor with proper "
                             "shape")
        array = array.reshape(dims)
        if config.max_batch_size > 0:
            array = array[None]
        inputs[name], datatypes[name] = array, wire
    params = {k: v for k, v in body.items() if k not in by_name}
    return inputs, datatypes, params


def to_json(model: str, version: str, outputs: dict) -> dict:
    """A generate response: outputs of one element as scalars, BYTES as text."""
    out = {"model_name": model, "model_version": version}
    for name, array in outputs.items():
        flat = np.asarray(array).reshape(-1)
        values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else
                  v.item() if hasattr(v, "item") else v for v in flat]
        out[name] = values[0] if len(values) == 1 else values
    return out


async def responses(ctx: V2Context, model: str, version: str,
                    body: dict) -> AsyncIterator[dict]:
    """The response objects of one generate request. Raises InferError."""
    rt = ctx.repository().runtime(model, version)
    inputs, datatypes, params = to_inputs(rt.config, body)
    if getattr(rt, "decoupled", False):
        async for outputs, _final in rt.generate(inputs, str(params.get("id", "")),
                                                 datatypes):
            if outputs is not None:            # None: a flag-only final response
                yield to_json(model, str(rt.version), outputs)
        return
    ran, tensors = await run(ctx.repository(), ctx.shm, InferRequest(
        model, version, "", inputs, datatypes, None, params))
    yield to_json(model, ran, {t.name: t.array for t in tensors})


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def router(ctx: V2Context) -> APIRouter:
    """The generate routes over `ctx`."""
    r = APIRouter()

    @r.post("/v2/models/{model}/generate")
    @r.post("/v2/models/{model}/versions/{version}/generate")
    async def generate(model: str, request: Request, version: str = ""):
        body = parse_body(await request.body())
        got = []
        stream = responses(ctx, model, version, body)
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
        body = parse_body(await request.body())
        stream = responses(ctx, model, version, body)
        try:                             # errors before the first response: a plain status
            first = await stream.__anext__()
        except StopAsyncIteration:
            first = None

        async def events():
            try:
                if first is not None:
                    yield _event(first)
                async for item in stream:
                    yield _event(item)
            except InferError as e:
                yield _event({"error": e.message})
            finally:
                await stream.aclose()        # a disconnect cancels us here: abort the request

        return StreamingResponse(events(), media_type="text/event-stream")

    return r
