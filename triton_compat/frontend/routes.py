"""KServe v2 / Triton HTTP routes, mounted on the same FastAPI app as the OpenAI API.

Owns: the `/v2` endpoints (server and model metadata, health, config, infer, statistics,
repository index / load / unload) and the mapping of every failure to `{"error": "..."}` with
Triton's status codes. Data flow of an infer: body (JSON header + binary tensors, possibly
gzip / deflate encoded) → `tensors.parse_request` → `infer.Inference` (shared-memory inputs,
`runtime.submit`, awaited future, shared-memory outputs) → `tensors.encode_response`. Parsing
and encoding run on the event loop; the model runs on its runtime's worker threads, so a slow
model never blocks other routes (only a model measured cheaper than the thread hand-off runs
on the loop, `ModelRuntime.runs_inline`). The HTTP protocol (`http_infer.InferRoute`) or
`http_infer.InferFastPath`, in front of the FastAPI app (api/server.py), answers infer requests
before they reach these routes.
Reference: KServe v2 protocol (required_api.md) and Triton's HTTP extensions
(server/docs/protocol/extension_*.md).
"""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from triton_compat.frontend import generate, log_settings, shm_routes
from triton_compat.core.config import config_to_json, wire_datatype
from triton_compat.frontend.context import EXTENSIONS, SERVER_NAME, V2Context
from triton_compat.errors import InferError
from triton_compat.trace.api import trace_settings
from triton_compat.frontend.http_infer import infer_http, read_body


def _error(e: InferError) -> JSONResponse:
    return JSONResponse({"error": e.message}, status_code=e.status)


def install(app, ctx: V2Context, max_input_size: int = 64 << 20) -> None:
    """Add the `/v2` routes and the InferError → `{"error": ...}` handler to a FastAPI app.

    `ctx` is the v2 layer's shared state (repository, readiness, shared-memory regions);
    `max_input_size` (bytes, Triton's `--http-max-input-size`) bounds an infer request body,
    compressed or not."""
    async def handler(_request, e: InferError):
        return _error(e)

    app.add_exception_handler(InferError, handler)
    app.include_router(_router(ctx, max_input_size))
    app.include_router(shm_routes.router(ctx.shm, _json_object))
    app.include_router(generate.router(ctx))


def _router(ctx: V2Context, max_input_size: int) -> APIRouter:
    router = APIRouter()
    repo = ctx.repository

    @router.get("/v2")
    async def server_metadata():
        return {"name": SERVER_NAME, "version": ctx.version, "extensions": EXTENSIONS}

    @router.get("/v2/health/live")
    async def live():
        return Response(status_code=200)

    @router.get("/v2/health/ready")
    async def ready():
        # tritonserver answers 400 when not ready (HandleServerHealth), not 503
        return Response(status_code=200 if ctx.server_ready() else 400)

    @router.get("/v2/models/stats")
    @router.get("/v2/models/{model}/stats")
    @router.get("/v2/models/{model}/versions/{version}/stats")
    async def model_stats(model: str = "", version: str = ""):
        r = repo()
        if model:
            rt = r.stats_runtime(model, version)
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
        except InferError:          # tritonserver 2.51: 400 with this text, whatever the cause
            return JSONResponse({"error": "Model version not ready"}, status_code=400)
        return Response(status_code=200)

    @router.get("/v2/models/{model}/config")
    @router.get("/v2/models/{model}/versions/{version}/config")
    async def model_config(model: str, version: str = ""):
        return config_to_json(repo().runtime(model, version).config, defaults=True)

    @router.post("/v2/models/{model}/infer")
    @router.post("/v2/models/{model}/versions/{version}/infer")
    async def infer(model: str, request: Request, version: str = ""):
        # Normally answered by http_infer.InferRoute / InferFastPath before routing; same code.
        repo().runtime(model, version)       # unknown model: 404 before the body is read
        body = await read_body(request, max_input_size)
        payload, headers = await infer_http(ctx, model, version, request.headers, body,
                                            max_input_size)
        return Response(payload, headers={k.decode(): v.decode() for k, v in headers})

    @router.get("/v2/repository/index")
    @router.post("/v2/repository/index")
    async def repository_index(request: Request):
        ready_only = False
        if request.method == "POST" and (raw := await request.body()):
            ready_only = bool(_json_object(raw).get("ready", False))
        return JSONResponse(repo().index(ready_only))

    @router.post("/v2/repository/models/{model}/load")
    async def load(model: str, request: Request):
        config = None
        if raw := await request.body():
            params = _json_object(raw).get("parameters") or {}
            if not isinstance(params, dict):
                raise InferError("'parameters' must be a JSON object")
            config = params.get("config")
            if config is not None and not isinstance(config, str):
                raise InferError("parameter 'config' must be a string holding the model's "
                                 "configuration as JSON")
            if any(k.startswith("file:") for k in params):
                raise InferError("file: overrides of a model's files are not supported by this "
                                 "server; give the model's config as parameter 'config'")
        await asyncio.to_thread(repo().load, model, config)
        return Response(status_code=200)

    @router.get("/v2/trace/setting")
    @router.post("/v2/trace/setting")
    @router.get("/v2/models/{model}/trace/setting")
    @router.post("/v2/models/{model}/trace/setting")
    async def trace_setting(request: Request, model: str = ""):
        """Triton's trace extension (triton_compat/trace/settings.py)."""
        return JSONResponse(trace_settings(ctx, model, _json_object(await request.body())
                                           if request.method == "POST" else None))

    @router.get("/v2/logging")
    @router.post("/v2/logging")
    async def logging_settings(request: Request):
        """Triton's logging extension (triton_compat/frontend/log_settings.py)."""
        if request.method == "POST":
            return JSONResponse(log_settings.update(_json_object(await request.body())))
        return JSONResponse(log_settings.as_dict())

    @router.post("/v2/repository/models/{model}/unload")
    async def unload(model: str):
        await asyncio.to_thread(repo().unload, model)
        return Response(status_code=200)

    return router


def _json_object(raw: bytes) -> dict:
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise InferError(f"failed to parse the request JSON buffer: {e}") from None
    if not isinstance(value, dict):
        raise InferError("the request body must be a JSON object")
    return value
