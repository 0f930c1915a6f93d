"""Run Triton's gRPC service in the server process: grpcio's thread-pool server over the same
repository, runtimes and shared-memory regions as HTTP. Started and stopped by the app's
lifespan."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import grpc
from tritonclient.grpc import service_pb2_grpc

from triton_compat.context import V2Context
from triton_compat.grpc.service import TritonService

logger = logging.getLogger("continuum.triton.grpc")
MAX_MESSAGE_BYTES = 2**31 - 1          # Triton's default: INT32_MAX both ways
# RPCs served at once: each holds a worker thread while its request queues or runs, so this
# bounds how many gRPC requests the dynamic batcher can see together; more wait in grpcio.
WORKERS = 128


def start(ctx: V2Context, address: str, port: int) -> grpc.Server:
    """Listen on `address:port` and serve (returns at once). Raises RuntimeError when the port
    cannot be bound."""
    server = grpc.server(ThreadPoolExecutor(WORKERS, thread_name_prefix="grpc"), options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
    ])
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(TritonService(ctx), server)
    try:
        bound = server.add_insecure_port(f"{address}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise RuntimeError(f"--grpc-port {port}: cannot listen on {address}:{port}")
    server.start()
    logger.info("KServe v2 gRPC (Triton GRPCInferenceService) on %s:%d", address, port)
    return server
