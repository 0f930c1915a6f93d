"""Run Triton's gRPC service on the HTTP server's event loop (grpc.aio): one process, one
loop, the same runtimes. Started and stopped by the app's lifespan."""

from __future__ import annotations

import logging

import grpc
from tritonclient.grpc import service_pb2_grpc

from triton_compat.context import V2Context
from triton_compat.grpc.service import TritonService

logger = logging.getLogger("continuum.triton.grpc")
MAX_MESSAGE_BYTES = 2**31 - 1          # Triton's default: INT32_MAX both ways


async def start(ctx: V2Context, address: str, port: int) -> grpc.aio.Server:
    """Listen on `address:port` and serve. Raises RuntimeError when the port cannot be bound."""
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
    ])
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(TritonService(ctx), server)
    if server.add_insecure_port(f"{address}:{port}") == 0:
        raise RuntimeError(f"--grpc-port {port}: cannot listen on {address}:{port}")
    await server.start()
    logger.info("KServe v2 gRPC (Triton GRPCInferenceService) on %s:%d", address, port)
    return server
