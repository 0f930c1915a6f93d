"""The RPCs of Triton's `inference.GRPCInferenceService`, answered over the v2 layer's shared
state (`V2Context`): the same repository, runtimes, batchers and shared-memory regions as HTTP.

Data flow of ModelInfer, on the completion-queue thread (grpc/loop.py): the serialized
`ModelInferRequest` → its header's plan (grpc/wire.py), else parsed and `codec.decode_request`
→ `Inference` (runtime submit; a cheap model runs on this thread when an instance is idle) →
`wire.encode_response` (bytes) where the inference finished → reply. The other
RPCs run on worker threads as grpcio would run them. ModelStreamInfer submits each request of a
stream as it arrives (a reader thread), so they batch together, and writes the responses in
request order (or a request's error, as `error_message`; the stream goes on), each marked
`triton_final_response`.
Errors are `InferError`s mapped to gRPC status codes as Triton maps its error codes
(INVALID_ARG → INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE, INTERNAL, UNSUPPORTED →
UNIMPLEMENTED). Reference: grpc_predict_v2.proto, Triton's grpc_server.cc / infer_handler.cc /
stream_infer_handler.cc.
"""

from __future__ import annotations

import functools
import logging

import grpc
from google.protobuf import json_format
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from engine.log_config import verbose
from triton_compat.core.config import wire_datatype
from triton_compat.frontend.context import EXTENSIONS, SERVER_NAME, V2Context
from triton_compat.errors import InferError
from triton_compat.frontend import log_settings
from triton_compat.frontend.grpc import wire
from triton_compat.frontend.grpc.codec import decode_request
from triton_compat.frontend.grpc.loop import PARSE_ERROR
from triton_compat.frontend.grpc.stream import Stream
from triton_compat.frontend.infer import Inference
from triton_compat.trace.api import trace_settings
from triton_compat.trace.settings import grpc_body

logger = logging.getLogger("continuum.triton.grpc")

STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
          500: grpc.StatusCode.INTERNAL, 501: grpc.StatusCode.UNIMPLEMENTED,
          503: grpc.StatusCode.UNAVAILABLE}
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
    def wrapper(self, request, context):
        try:
            self.check_restricted(name, context.invocation_metadata())
            return method(self, request, context)
        except InferError as e:
            context.abort(status_code(e), e.message)

    return wrapper


def _traced_reply(reply, trace):
    """`reply` with GRPC_SEND_START / GRPC_SEND_END around it, then the trace finished."""
    def traced(*args):
        trace.mark("GRPC_SEND_START")
        try:
            reply(*args)
        finally:
            trace.mark("GRPC_SEND_END")
            trace.finish()
    return traced


class TritonService(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Triton's gRPC service over `ctx`, served by grpc/loop.py: ModelInfer through
    `model_infer` on the completion-queue thread (`fast`), every other RPC as grpcio's
    `handler(request, context)` on a worker thread, which may block."""

    def __init__(self, ctx: V2Context) -> None:
        self.ctx = ctx
        self.fast = {"ModelInfer": self.model_infer}
        self.plans = wire.Plans()           # ModelInfer request headers seen: their decoding
        # set by grpc/server.start: the loop's `call_soon` and whether other calls are in
        # progress, so a burst of calls to a cheap model runs as one batch (infer.Inference)
        self.later, self.busy = None, None

    def check_restricted(self, rpc: str, metadata) -> None:
        """Raise InferError (UNAVAILABLE, Triton's text) when `rpc`'s category is restricted
        (`--grpc-restricted-protocol`) and the call's `metadata` ((key, value) pairs) lacks
        `triton-grpc-protocol-<key>: <value>`."""
        rule = self.ctx.grpc_restrictions.get(CATEGORY.get(rpc))
        if rule is None:
            return
        key, value = rule
        header = RESTRICTED_HEADER + key
        got = dict(metadata or ()).get(header)
        if got != value:
            raise InferError(f"This protocol is restricted, expecting header '{header}'", 503)

    # -- health and metadata ------------------------------------------------------------------
    @_unary
    def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    @_unary
    def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.ctx.server_ready())

    @_unary
    def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=self.ctx.version,
                                         extensions=EXTENSIONS)

    @_unary
    def ModelReady(self, request, context):
        try:            # unknown, unloaded or loading: ready false, as tritonserver 2.51
            self.ctx.repository().runtime(request.name, request.version)
        except InferError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    @_unary
    def ModelMetadata(self, request, context):
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
    def ModelConfig(self, request, context):
        return pb.ModelConfigResponse(
            config=self.ctx.repository().runtime(request.name, request.version).config)

    @_unary
    def ModelStatistics(self, request, context):
        repo = self.ctx.repository()
        if request.name:         # unknown: INVALID_ARGUMENT, Triton's text
            rt = repo.stats_runtime(request.name, request.version)
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

    def model_infer(self, data: bytes, metadata, reply) -> None:
        """ModelInfer without a thread of its own (grpc/loop.py's fast path): `data` (the
        serialized `ModelInferRequest`) decoded from its header's plan (grpc/wire.py) or parsed
        and decoded, checked and submitted on the calling thread; a model cheap enough runs
        there too (`ModelRuntime.runs_inline`), others on their instances' threads.
        `reply(response bytes, code, details)` is called once, on this thread or the one that
        finished the inference. Never blocks."""
        request = self.plans.decode(data)     # None: a request shape not seen before
        msg = None
        if request is None:
            try:
                msg = pb.ModelInferRequest.FromString(data)
            except Exception:
                reply(None, grpc.StatusCode.INTERNAL, PARSE_ERROR)
                return
        try:
            self.check_restricted("ModelInfer", metadata)
            self._admit()
        except InferError as e:
            reply(None, status_code(e), e.message)
            return
        model, version = (msg.model_name, msg.model_version) if request is None else \
            (request.model, request.version)
        lifecycle = self.ctx.lifecycle
        if lifecycle is not None:
            lifecycle.enter()
        trace = self.ctx.trace(model, dict(metadata or ()))
        if trace is not None:               # the message is read already: both at once
            trace.mark("GRPC_WAITREAD_START")
            trace.mark("GRPC_WAITREAD_END")
            reply = _traced_reply(reply, trace)
        try:
            rt = self.ctx.repository().runtime(model, version)
            if rt.decoupled:         # Triton's text (infer_handler.cc)
                raise InferError("ModelInfer RPC doesn't support models with decoupled "
                                 "transaction policy", 501)
            if request is None:
                request = decode_request(msg)
                self.plans.learn(data, msg, request)      # clears msg's tensors: decoded
            if verbose():                    # --log-verbose 1: each request, as Triton logs it
                logger.debug("gRPC infer request: model '%s' version '%s' id '%s'",
                             model, version, request.id)
            inference = Inference(self.ctx.repository(), self.ctx.shm, request,
                                  busy=self.busy, later=self.later, trace=trace, runtime=rt)
        except InferError as e:
            if lifecycle is not None:
                lifecycle.leave()
            reply(None, status_code(e), e.message)
            return

        def done(future) -> None:
            try:
                response = self._response(request, *inference.outcome())
            except InferError as e:
                reply(None, status_code(e), e.message)
                return
            finally:
                if lifecycle is not None:
                    lifecycle.leave()
            reply(response)

        inference.future.add_done_callback(done)   # at once when it ran on this thread

    @staticmethod
    def _response(request, version, outputs) -> bytes:
        try:
            return wire.encode_response(request.model, version, request.id, outputs)
        except Exception as e:       # an output the model filled with the wrong kind of data
            raise InferError(f"model '{request.model}' returned an output that cannot be "
                             f"sent: {type(e).__name__}: {e}", 500) from None

    def ModelStreamInfer(self, request_iterator, context):
        """Bidirectional stream (see grpc/stream.py): requests start as they arrive; a
        decoupled model's responses are written as produced, other models' in request order;
        each response carries `triton_final_response`; a failed request is answered with
        `error_message` and the stream goes on."""
        try:
            self.check_restricted("ModelStreamInfer", context.invocation_metadata())
        except InferError as e:
            context.abort(status_code(e), e.message)
        lifecycle = self.ctx.lifecycle
        if lifecycle is not None:
            lifecycle.enter()
        strict = dict(context.invocation_metadata() or ()).get("triton_grpc_error") == "true"

        def end_with(error: InferError) -> None:      # triton_grpc_error: true
            context.abort(status_code(error), error.message)

        try:
            stream = Stream(self, request_iterator, end_with if strict else None)
            yield from stream.responses(context.is_active)
        finally:
            if lifecycle is not None:
                lifecycle.leave()

    # -- repository ---------------------------------------------------------------------------
    @staticmethod
    def _no_repository_name(request) -> None:
        if request.repository_name:
            raise InferError("'repository_name' specification is not supported", 501)

    @_unary
    def RepositoryIndex(self, request, context):
        self._no_repository_name(request)
        models = [pb.RepositoryIndexResponse.ModelIndex(**m)
                  for m in self.ctx.repository().index(request.ready)]
        return pb.RepositoryIndexResponse(models=models)

    @_unary
    def RepositoryModelLoad(self, request, context):
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
        self.ctx.repository().load(request.model_name, config)
        return pb.RepositoryModelLoadResponse()

    @_unary
    def RepositoryModelUnload(self, request, context):
        self._no_repository_name(request)
        p = request.parameters.get("unload_dependents")
        if p is not None and p.WhichOneof("parameter_choice") != "bool_param":
            raise InferError("invalid value type for 'unload_dependents' parameter, expected "
                             "bool_param.")
        self.ctx.repository().unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # -- trace extension (triton_compat/trace) --------------------------------------------------
    @_unary
    def TraceSetting(self, request, context):
        """Read or update a model's (or the global) trace setting (Triton's trace extension)."""
        body = grpc_body(request.settings) if len(request.settings) else None
        settings = trace_settings(self.ctx, request.model_name, body)
        return pb.TraceSettingResponse(settings={
            k: pb.TraceSettingResponse.SettingValue(value=v if isinstance(v, list) else [v])
            for k, v in settings.items()})

    # -- logging extension (triton_compat/frontend/log_settings.py) --------------------------------------
    @_unary
    def LogSettings(self, request, context):
        """Read or update the log settings (Triton's logging extension); each value's set
        field is its type, checked as tritonserver checks it."""
        changes, kinds = {}, {}
        for name, value in request.settings.items():
            kind = value.WhichOneof("parameter_choice")     # None: no value set (skipped)
            if kind is not None:
                changes[name] = getattr(value, kind)
                kinds[name] = kind.removesuffix("_param")
        settings = log_settings.update(changes, kinds)
        field = {bool: "bool_param", int: "uint32_param", str: "string_param"}
        return pb.LogSettingsResponse(settings={
            name: pb.LogSettingsResponse.SettingValue(**{field[type(value)]: value})
            for name, value in settings.items()})

    # -- shared memory ------------------------------------------------------------------------
    @_unary
    def SystemSharedMemoryStatus(self, request, context):
        regions = {r["name"]: pb.SystemSharedMemoryStatusResponse.RegionStatus(**r)
                   for r in self.ctx.shm.status("system", request.name)}
        return pb.SystemSharedMemoryStatusResponse(regions=regions)

    @_unary
    def SystemSharedMemoryRegister(self, request, context):
        self.ctx.shm.register_system(request.name, request.key, request.offset,
                                     request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @_unary
    def SystemSharedMemoryUnregister(self, request, context):
        self.ctx.shm.unregister("system", request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @_unary
    def CudaSharedMemoryStatus(self, request, context):
        regions = {r["name"]: pb.CudaSharedMemoryStatusResponse.RegionStatus(**r)
                   for r in self.ctx.shm.status("cuda", request.name)}
        return pb.CudaSharedMemoryStatusResponse(regions=regions)

    @_unary
    def CudaSharedMemoryRegister(self, request, context):
        self.ctx.shm.register_cuda(request.name, request.raw_handle, request.device_id,
                                   request.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()

    @_unary
    def CudaSharedMemoryUnregister(self, request, context):
        self.ctx.shm.unregister("cuda", request.name)
        return pb.CudaSharedMemoryUnregisterResponse()
