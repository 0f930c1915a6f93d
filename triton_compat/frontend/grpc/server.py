"""Run Triton's gRPC service in the server process: grpcio's core on one completion-queue
thread (grpc/loop.py) over the same repository, runtimes and shared-memory regions as HTTP.
Started and stopped by the app's lifespan."""

from __future__ import annotations

import logging

from tritonclient.grpc import service_pb2_grpc

from triton_compat.frontend.context import V2Context
from triton_compat.frontend.grpc.loop import Server
from triton_compat.frontend.grpc.service import TritonService

logger = logging.getLogger("continuum.triton.grpc")
MAX_MESSAGE_BYTES = 2**31 - 1          # Triton's default: INT32_MAX both ways
# Threads for the RPCs that may block (control plane) and for streams: each stream holds one
# while it is open. ModelInfer needs none.
WORKERS = 128
# Calls C-core holds before the loop has asked for them (a burst): grpcio drops calls past 1,000
# at random and every call past 3,000 (CANCELLED at the client) by default; tritonserver 2.51
# takes them all and leaves the bound to the model's queue policy (`max_queue_size`).
MAX_PENDING_CALLS = 2**31 - 1


def start(ctx: V2Context, address: str, port: int, credentials=None) -> Server:
    """Listen on `address:port` and serve (returns at once); `stop(grace)` ends it. With
    `credentials` (`grpc.ServerCredentials`, api/network.py) the port speaks TLS only. Raises
    RuntimeError when the port cannot be bound."""
    service = TritonService(ctx)
    server = Server(service, service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server,
                    service.fast, options=[
                        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                        ("grpc.so_reuseport", 0),
                        ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
                        ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS)],
                    workers=WORKERS)
    service.later, service.busy = server, server.busy    # batch a burst (Server.call_soon)
    try:
        bound = (server.add_secure_port(f"{address}:{port}", credentials)
                 if credentials is not None else server.add_insecure_port(f"{address}:{port}"))
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise RuntimeError(f"--grpc-port {port}: cannot listen on {address}:{port}")
    server.start()
    logger.info("KServe v2 gRPC (Triton GRPCInferenceService) on %s:%d%s", address, port,
                " (TLS)" if credentials is not None else "")
    return server
