"""HTTP endpoints of Triton's shared-memory extension, over the server's
`SharedMemoryManager` (the same regions gRPC registers and both protocols' infers use).

`GET  /v2/{system,cuda}sharedmemory[/region/{name}]/status` → JSON array of regions;
`POST /v2/{system,cuda}sharedmemory[/region/{name}]/register` (system: `{"key", "offset",
"byte_size"}`; CUDA: `{"raw_handle": {"b64": ...}, "device_id", "byte_size"}`);
`POST /v2/{system,cuda}sharedmemory[/region/{name}]/unregister` (no name: all of that kind).
Texts and order of checks are Triton's (http_server.cc HandleSystemSharedMemory /
HandleCudaSharedMemory). Reference: server/docs/protocol/extension_shared_memory.md.
"""

from __future__ import annotations

import base64
import binascii
from typing import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from triton_compat.errors import InferError
from triton_compat.frontend.shared_memory import SharedMemoryManager


def _uint(body: dict, key: str, required: bool) -> int:
    if key not in body:
        if required:
            raise InferError(f"Shared memory register request has no '{key}' field")
        return 0
    value = body[key]
    # Not as Triton, on purpose: a mistyped value is its 500; bad input is a 400 here.
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InferError("attempt to access JSON non-unsigned-integer as unsigned-integer")
    return value


def _may_register(shm: SharedMemoryManager, kind: str, name: str) -> None:
    """Triton's first two checks of a register request: client shm allowed, a region name."""
    shm.check_allowed()
    if not name:
        raise InferError(f"'region name' is necessary to register {kind} shared memory region")


def router(shm: SharedMemoryManager, json_object: Callable[[bytes], dict]) -> APIRouter:
    """The shared-memory routes; `json_object(raw)` parses a body (InferError(400) if bad)."""
    r = APIRouter()

    async def body_of(request: Request) -> dict:
        raw = await request.body()
        return json_object(raw) if raw else {}

    @r.get("/v2/systemsharedmemory/status")
    @r.get("/v2/systemsharedmemory/region/{name}/status")
    async def system_status(name: str = ""):
        return JSONResponse(shm.status("system", name))

    @r.get("/v2/cudasharedmemory/status")
    @r.get("/v2/cudasharedmemory/region/{name}/status")
    async def cuda_status(name: str = ""):
        return JSONResponse(shm.status("cuda", name))

    @r.post("/v2/systemsharedmemory/register")
    @r.post("/v2/systemsharedmemory/region/{name}/register")
    async def system_register(request: Request, name: str = ""):
        _may_register(shm, "system", name)
        body = await body_of(request)
        if "key" not in body:
            raise InferError("Shared memory register request has no 'key' field")
        if not isinstance(body["key"], str):
            raise InferError("attempt to access JSON non-string as string")
        offset = _uint(body, "offset", False)
        shm.register_system(name, body["key"], offset, _uint(body, "byte_size", True))
        return Response(status_code=200)

    @r.post("/v2/cudasharedmemory/register")
    @r.post("/v2/cudasharedmemory/region/{name}/register")
    async def cuda_register(request: Request, name: str = ""):
        _may_register(shm, "cuda", name)
        body = await body_of(request)
        handle = body.get("raw_handle")
        if not isinstance(handle, dict) or not isinstance(handle.get("b64"), str):
            raise InferError("Shared memory register request has no 'raw_handle' field")
        try:
            raw = base64.b64decode(handle["b64"], validate=True)
        except (binascii.Error, ValueError):
            raise InferError("'raw_handle' must be a valid base64 encoded "
                             "cudaIpcMemHandle_t") from None
        shm.register_cuda(name, raw, _uint(body, "device_id", True),
                          _uint(body, "byte_size", True))
        return Response(status_code=200)

    @r.post("/v2/systemsharedmemory/unregister")
    @r.post("/v2/systemsharedmemory/region/{name}/unregister")
    async def system_unregister(name: str = ""):
        shm.unregister("system", name)
        return Response(status_code=200)

    @r.post("/v2/cudasharedmemory/unregister")
    @r.post("/v2/cudasharedmemory/region/{name}/unregister")
    async def cuda_unregister(name: str = ""):
        shm.unregister("cuda", name)
        return Response(status_code=200)

    return r
