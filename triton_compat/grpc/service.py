"""The RPCs of Triton's `inference.GRPCInferenceService`, answered over the v2 layer's shared
state (`V2Context`): the same repository, runtimes, batchers and shared-memory regions as HTTP.

Data flow of ModelInfer: `ModelInferRequest` → `codec.decode_request` → `infer.run` (runtime
submit, awaited on the event loop) → `codec.encode_response`. ModelStreamInfer runs each
request of a stream as it arrives, concurrently, and writes each response (or its error, as
`error_message`; the stream goes on) when it is done, marked `triton_final_response`.
Errors are `InferError`s mapped to gRPC status codes as Triton maps its error codes
(INVALID_ARG → INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE, INTERNAL, UNSUPPORTED →
UNIMPLEMENTED). Reference: grpc_predict_v2.proto, Triton's grpc_server.cc / infer_handler.cc /
stream_infer_handler.cc.
"""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc
from google.protobuf import json_format
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from triton_compat.config import wire_datatype
from triton_compat.context import EXTENSIONS, SERVER_NAME, V2Context
from triton_compat.errors import InferError
from triton_compat.grpc.codec import decode_request, encode_response, set_parameter
from triton_compat.infer import run

logger = logging.getLogger("continuum.triton.grpc")

STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 403: grpc.StatusCode.UNAVAILABLE,
          404: grpc.StatusCode.NOT_FOUND, 500: grpc.StatusCode.INTERNAL,
          501: grpc.StatusCode.UNIMPLEMENTED, 503: grpc.StatusCode.UNAVAILABLE}
SHUTTING_DOWN = "GRPC server is shutting down and has stopped accepting new requests."
RESTRICTED_HEADER = "triton-grpc-protocol-"       # grpc_server.h kRestrictedProtocolHeaderTemplate


def status_code(e: InferError) -> grpc.StatusCode:
    """The gRPC status of an InferError (Triton's GrpcStatusUtil::CodeToStatus)."""
    if e.code is not None:
        return getattr(grpc.StatusCode, e.code)
    return STATUS.get(e.status, grpc.StatusCode.UNKNOWN)

# RPC -> Triton's API category for --grpc-restricted-protocol (grpc_server.cc)
CATEGORY = {
    "ServerLive": "health", "ServerReady": "health", "ModelReady": "health",
    "ServerMetadata": "metadata", "ModelMetadata": "metadata", "ModelConfig": "model-config",
    "ModelInfer": "inference", "ModelStreamInfer": "inference",
    "ModelStatistics": "statistics", "RepositoryIndex": "model-repository",
    "RepositoryModelLoad": "model-repository", "RepositoryModelUnload": "model-repository",
    "SystemSharedMemoryStatus": "shared-memory", "SystemSharedMemoryRegister": "shared-memory",
    "SystemSharedMemoryUnregister": "shared-memory", "CudaSharedMemoryStatus": "shared-memory",
    "CudaSharedMemoryRegister": "shared-memory", "CudaSharedMemoryUnregister": "shared-memory",
    "TraceSetting": "trace", "LogSettings": "logging",
}


def _unary(method):
    """Wrap an RPC: the restricted-protocol check, then InferError → gRPC status."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            self.check_restricted(name, context)
            return await method(self, request, context)
        except InferError as e:
            await context.abort(status_code(e), e.message)

    return wrapper


class TritonService(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Triton's gRPC service over `ctx`. Every method is a grpc.aio coroutine."""

    def __init__(self, ctx: V2Context) -> None:
        self.ctx = ctx

    def check_restricted(self, rpc: str, context) -> None:
        """Raise InferError (UNAVAILABLE, Triton's text) when `rpc`'s category is restricted
        (`--grpc-restricted-protocol`) and the call lacks metadata
        `triton-grpc-protocol-<key>: <value>`."""
        rule = self.ctx.grpc_restrictions.get(CATEGORY.get(rpc))
        if rule is None:
            return
        key, value = rule
        header = RESTRICTED_HEADER + key
        got = dict(context.invocation_metadata() or ()).get(header)
        if got != value:
            raise InferError(f"This protocol is restricted, expecting header '{header}'", 503)

    # -- health and metadata ------------------------------------------------------------------
    @_unary
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    @_unary
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.ctx.server_ready())

    @_unary
    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=self.ctx.version,
                                         extensions=EXTENSIONS)

    @_unary
    async def ModelReady(self, request, context):
        try:
            self.ctx.repository().runtime(request.name, request.version)
        except InferError as e:
            if e.status == 404:          # unknown: NOT_FOUND, as Triton; known: ready false
                raise
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    @_unary
    async def ModelMetadata(self, request, context):
        repo = self.ctx.repository()
        config = repo.runtime(request.name, request.version).config
        lead = [-1] if config.max_batch_size > 0 else []

        def tensors(ts):
            return [pb.ModelMetadataResponse.TensorMetadata(
                name=t.name, datatype=wire_datatype(t.data_type), shape=lead + list(t.dims))
                for t in ts]

        return pb.ModelMetadataResponse(
            name=request.name, versions=repo.versions(request.name), platform=config.platform,
            inputs=tensors(config.input), outputs=tensors(config.output))

    @_unary
    async def ModelConfig(self, request, context):
        return pb.ModelConfigResponse(
            config=self.ctx.repository().runtime(request.name, request.version).config)

    @_unary
    async def ModelStatistics(self, request, context):
        repo = self.ctx.repository()
        if request.name:
            rt = repo.runtime(request.name, request.version)
            entries = [rt.stats.json(request.name, str(rt.version))]
        else:
            entries = [rt.stats.json(n, str(v)) for n, v, rt in repo.all_runtimes()]
        return json_format.ParseDict({"model_stats": entries}, pb.ModelStatisticsResponse(),
                                     ignore_unknown_fields=True)

    # -- inference ----------------------------------------------------------------------------
    def _admit(self) -> None:
        lifecycle = self.ctx.lifecycle
        if lifecycle is not None and lifecycle.draining:
            raise InferError(SHUTTING_DOWN, 503)

    async def _infer(self, msg: pb.ModelInferRequest) -> pb.ModelInferResponse:
        request = decode_request(msg)
        version, outputs = await run(self.ctx.repository(), self.ctx.shm, request)
        try:
            return encode_response(request.model, version, request.id, outputs)
        except Exception as e:       # an output the model filled with the wrong kind of data
            raise InferError(f"model '{request.model}' returned an output that cannot be "
                             f"sent: {type(e).__name__}: {e}", 500) from None

    @_unary
    async def ModelInfer(self, request, context):
        self._admit()
        lifecycle = self.ctx.lifecycle
        if lifecycle is not None:
            lifecycle.in_flight += 1
        try:
            return await self._infer(request)
        finally:
            if lifecycle is not None:
                lifecycle.in_flight -= 1

    async def ModelStreamInfer(self, request_iterator, context):
        """Bidirectional stream: each request starts as it arrives (so a stream's requests
        batch together); responses are written in request order, each marked
        `triton_final_response`. A failed request is answered with `error_message` (and its
        id) and the stream goes on."""
        try:
            self.check_restricted("ModelStreamInfer", context)
        except InferError as e:
            await context.abort(status_code(e), e.message)
        order: asyncio.Queue = asyncio.Queue()

        async def reader():
            try:
                async for msg in request_iterator:
                    await order.put(asyncio.ensure_future(self._stream_one(msg)))
            finally:
                await order.put(None)

        lifecycle = self.ctx.lifecycle
        if lifecycle is not None:
            lifecycle.in_flight += 1
        feed = asyncio.ensure_future(reader())
        pending: list[asyncio.Task] = []
        try:
            while (task := await order.get()) is not None:
                pending.append(task)
                yield await task
                pending.remove(task)
        finally:
            feed.cancel()
            while not order.empty():
                if (task := order.get_nowait()) is not None:
                    pending.append(task)
            for task in pending:
                task.cancel()
            if lifecycle is not None:
                lifecycle.in_flight -= 1

    async def _stream_one(self, msg) -> pb.ModelStreamInferResponse:
        try:
            self._admit()
            response = pb.ModelStreamInferResponse(infer_response=await self._infer(msg))
        except InferError as e:
            response = pb.ModelStreamInferResponse(error_message=e.message)
            r = response.infer_response
            r.id, r.model_name, r.model_version = msg.id, msg.model_name, msg.model_version
        except Exception as e:                  # never let one request end the stream
            logger.exception("stream request failed")
            response = pb.ModelStreamInferResponse(error_message=f"{type(e).__name__}: {e}")
            response.infer_response.id = msg.id
        set_parameter(response.infer_response.parameters, "triton_final_response", True)
        return response

    # -- repository ---------------------------------------------------------------------------
    @staticmethod
    def _no_repository_name(request) -> None:
        if request.repository_name:
            raise InferError("'repository_name' specification is not supported", 501)

    @_unary
    async def RepositoryIndex(self, request, context):
        self._no_repository_name(request)
        models = [pb.RepositoryIndexResponse.ModelIndex(**m)
                  for m in self.ctx.repository().index(request.ready)]
        return pb.RepositoryIndexResponse(models=models)

    @_unary
    async def RepositoryModelLoad(self, request, context):
        self._no_repository_name(request)
        config = None
        for key, p in request.parameters.items():
            kind = p.WhichOneof("parameter_choice")
            if key == "config":
                if kind != "string_param":
                    raise InferError(f"invalid value type for load parameter '{key}', expected "
                                     "string_param.")
                config = p.string_param
            elif key.startswith("file:"):
                raise InferError(f"load parameter '{key}': file overrides are not supported by "
                                 "this server; give the model's configuration as 'config'")
            else:
                raise InferError(f"unrecognized load parameter '{key}'.")
        await asyncio.to_thread(self.ctx.repository().load, request.model_name, config)
        return pb.RepositoryModelLoadResponse()

    @_unary
    async def RepositoryModelUnload(self, request, context):
        self._no_repository_name(request)
        p = request.parameters.get("unload_dependents")
        if p is not None and p.WhichOneof("parameter_choice") != "bool_param":
            raise InferError("invalid value type for 'unload_dependents' parameter, expected "
                             "bool_param.")
        await asyncio.to_thread(self.ctx.repository().unload, request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # -- shared memory ------------------------------------------------------------------------
    @_unary
    async def SystemSharedMemoryStatus(self, request, context):
        regions = {r["name"]: pb.SystemSharedMemoryStatusResponse.RegionStatus(**r)
                   for r in self.ctx.shm.status("system", request.name)}
        return pb.SystemSharedMemoryStatusResponse(regions=regions)

    @_unary
    async def SystemSharedMemoryRegister(self, request, context):
        self.ctx.shm.register_system(request.name, request.key, request.offset,
                                     request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @_unary
    async def SystemSharedMemoryUnregister(self, request, context):
        self.ctx.shm.unregister("system", request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @_unary
    async def CudaSharedMemoryStatus(self, request, context):
        regions = {r["name"]: pb.CudaSharedMemoryStatusResponse.RegionStatus(**r)
                   for r in self.ctx.shm.status("cuda", request.name)}
        return pb.CudaSharedMemoryStatusResponse(regions=regions)

    @_unary
    async def CudaSharedMemoryRegister(self, request, context):
        from triton_compat import cuda_ipc
        if not cuda_ipc.available():      # Triton without GPUs answers this before anything
            raise InferError(f"failed to register CUDA shared memory region: '{request.name}', "
                             "GPUs not supported")
        self.ctx.shm.register_cuda(request.name, request.raw_handle, request.device_id,
                                   request.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()

    @_unary
    async def CudaSharedMemoryUnregister(self, request, context):
        self.ctx.shm.unregister("cuda", request.name)
        return pb.CudaSharedMemoryUnregisterResponse()
