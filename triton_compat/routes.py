"""KServe v2 / Triton HTTP routes, mounted on the same FastAPI app as the OpenAI API.

Owns: the `/v2` endpoints (server and model metadata, health, config, infer, statistics,
repository index / load / unload) and the mapping of every failure to `{"error": "..."}` with
Triton's status codes. Data flow of an infer: body (JSON header + binary tensors, possibly
gzip / deflate encoded) → `tensors.parse_request` → `runtime.submit` (validation, queue) →
awaited future → `tensors.encode_response`. Parsing and encoding run on the event loop; the
model runs on its runtime's worker threads, so a slow model never blocks other routes.
Reference: KServe v2 protocol (required_api.md) and Triton's HTTP extensions
(server/docs/protocol/extension_*.md).
"""

from __future__ import annotations

import asyncio
import json
import zlib
from typing import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from triton_compat.backends import BackendRequest
from triton_compat.config import config_to_json, wire_datatype
from triton_compat.errors import InferError
from triton_compat.tensors import TensorError, encode_response, parse_request

SERVER_NAME = "continuum"
EXTENSIONS = ["binary_tensor_data", "parameters", "model_configuration", "model_repository",
              "model_repository(unload_dependents)", "schedule_policy", "statistics"]


def _error(e: InferError) -> JSONResponse:
    return JSONResponse({"error": e.message}, status_code=e.status)


def install(app, get_repository: Callable, server_ready: Callable[[], bool],
            version: str, max_input_size: int = 64 << 20) -> None:
    """Add the `/v2` routes and the InferError → `{"error": ...}` handler to a FastAPI app.

    `get_repository()` returns the ModelRepository (None while it loads); `server_ready()`
    says whether everything this server serves is ready; `max_input_size` (bytes, Triton's
    `--http-max-input-size`) bounds an infer request body, compressed or not."""
    async def handler(_request, e: InferError):
        return _error(e)

    app.add_exception_handler(InferError, handler)
    app.include_router(_router(get_repository, server_ready, version, max_input_size))


def _router(get_repository: Callable, server_ready: Callable[[], bool],
            version: str, max_input_size: int) -> APIRouter:
    router = APIRouter()

    def repo():
        r = get_repository()
        if r is None:
            raise InferError("the model repository is still loading", 503)
        return r

    @router.get("/v2")
    async def server_metadata():
        return {"name": SERVER_NAME, "version": version, "extensions": EXTENSIONS}

    @router.get("/v2/health/live")
    async def live():
        return Response(status_code=200)

    @router.get("/v2/health/ready")
    async def ready():
        return Response(status_code=200 if server_ready() else 503)

    @router.get("/v2/models/stats")
    @router.get("/v2/models/{model}/stats")
    @router.get("/v2/models/{model}/versions/{version}/stats")
    async def model_stats(model: str = "", version: str = ""):
        r = repo()
        if model:
            rt = r.runtime(model, version)
            return {"model_stats": [rt.stats.json(model, str(rt.version))]}
        return {"model_stats": [rt.stats.json(n, str(v)) for n, v, rt in r.all_runtimes()]}

    @router.get("/v2/models/{model}")
    @router.get("/v2/models/{model}/versions/{version}")
    async def model_metadata(model: str, version: str = ""):
        rt = repo().runtime(model, version)
        config = rt.config
        lead = [-1] if config.max_batch_size > 0 else []

        def tensors(ts):
            return [{"name": t.name, "datatype": wire_datatype(t.data_type),
                     "shape": lead + list(t.dims)} for t in ts]

        return {"name": model, "versions": repo().versions(model), "platform": config.platform,
                "inputs": tensors(config.input), "outputs": tensors(config.output)}

    @router.get("/v2/models/{model}/ready")
    @router.get("/v2/models/{model}/versions/{version}/ready")
    async def model_ready(model: str, version: str = ""):
        try:
            repo().runtime(model, version)
        except InferError:
            return Response(status_code=400)
        return Response(status_code=200)

    @router.get("/v2/models/{model}/config")
    @router.get("/v2/models/{model}/versions/{version}/config")
    async def model_config(model: str, version: str = ""):
        return config_to_json(repo().runtime(model, version).config)

    @router.post("/v2/models/{model}/infer")
    @router.post("/v2/models/{model}/versions/{version}/infer")
    async def infer(model: str, request: Request, version: str = ""):
        rt = repo().runtime(model, version)
        body = _decode(await _read_body(request, max_input_size),
                       request.headers.get("content-encoding"), max_input_size)
        header_length = request.headers.get("inference-header-content-length")
        try:
            parsed = parse_request(body, int(header_length) if header_length else None)
        except ValueError as e:            # TensorError, or a bad header value
            raise InferError(str(e) if isinstance(e, TensorError) else
                             f"invalid Inference-Header-Content-Length: {header_length}")
        priority, timeout = _int_param(parsed.parameters, "priority"), \
            _int_param(parsed.parameters, "timeout")
        names = [o.name for o in parsed.outputs] if parsed.outputs is not None else None
        future = rt.submit(BackendRequest(parsed.inputs, names, parsed.id, parsed.parameters),
                           parsed.datatypes, priority or 0, timeout)
        try:
            outputs = await asyncio.wrap_future(future)
        except InferError:
            raise
        except Exception as e:              # a model bug still answers in the v2 error shape
            raise InferError(f"{type(e).__name__}: {e}", 500) from None
        binary = {o.name: o.binary for o in parsed.outputs or []}
        types = {t.name: wire_datatype(t.data_type) for t in rt.config.output}
        order = names if names is not None else [t.name for t in rt.config.output]
        try:
            payload, header_len = encode_response(
                model, str(rt.version), parsed.id,
                [(n, types[n], outputs[n], binary.get(n, parsed.binary_default)) for n in order])
        except Exception as e:           # an output the model filled with the wrong kind of data
            raise InferError(f"model '{model}' returned an output that cannot be sent: "
                             f"{type(e).__name__}: {e}", 500) from None
        if header_len is None:
            return Response(payload, media_type="application/json")
        return Response(payload, media_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": str(header_len)})

    @router.get("/v2/repository/index")
    @router.post("/v2/repository/index")
    async def repository_index(request: Request):
        ready_only = False
        if request.method == "POST" and (raw := await request.body()):
            ready_only = bool(_json_object(raw).get("ready", False))
        return JSONResponse(repo().index(ready_only))

    @router.post("/v2/repository/models/{model}/load")
    async def load(model: str):
        await asyncio.to_thread(repo().load, model)
        return Response(status_code=200)

    @router.post("/v2/repository/models/{model}/unload")
    async def unload(model: str):
        await asyncio.to_thread(repo().unload, model)
        return Response(status_code=200)

    return router


def _too_large(size: int, limit: int) -> InferError:
    return InferError(f"request size {size} bytes exceeds the maximum allowed value of "
                      f"{limit} bytes (--http-max-input-size)")


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (400) once it passes `limit` bytes, before all of it is held."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _decode(body: bytes, encoding: str | None, limit: int) -> bytes:
    """Undo gzip / deflate Content-Encoding, never inflating past `limit` bytes."""
    if encoding not in ("gzip", "deflate"):
        return body
    try:
        inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
        out = inflater.decompress(body, limit + 1)
    except zlib.error as e:
        raise InferError(f"failed to decompress the {encoding} request body: {e}") from None
    if len(out) > limit:
        raise _too_large(len(out), limit)
    return out


def _int_param(params: dict, key: str) -> int | None:
    value = params.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InferError(f"parameter '{key}' must be a non-negative integer, got {value!r}")
    return value


def _json_object(raw: bytes) -> dict:
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise InferError(f"failed to parse the request JSON buffer: {e}") from None
    if not isinstance(value, dict):
        raise InferError("the request body must be a JSON object")
    return value
