"""The floor of a Python gRPC server on this host: how many `simple` infers per second, and how
much server CPU per request, a servicer reaches when it does nothing but parse the two inputs
with numpy and return a canned `ModelInferResponse`. Two servers, each over grpcio's core:
`stock`, grpcio's own thread-pool `grpc.server`, and `loop`, Continuum's completion-queue loop
(triton_compat/frontend/grpc/loop.py, ModelInfer on its fast path). Compare with the `simple/grpc` rows
of triton_protocol_bench.py in the same session: the stock floor is at or below tritonserver,
which is why the loop exists. Both run with C-core's socket I/O on the polling thread, as
`continuum serve` runs (triton_compat/frontend/grpc/core_env.py); GRPC_EXPERIMENTS set by the caller
wins (`GRPC_EXPERIMENTS=event_engine_listener,event_engine_for_all_other_endpoints` measures
grpcio's default).

Run: `python benchmarks/grpc_floor.py --perf-analyzer VENV/bin/perf_analyzer` (perf_analyzer
2.51, as for triton_protocol_bench.py). Flags: --servers stock,loop, --concurrency 1,4,16,
--workers (the stock pool size, default Continuum's), --interval-ms, --save-result FILE (JSON:
the points). Prints one line per point: infer/s, p99 µs, server CPU µs per request.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from triton_compat.frontend.grpc.core_env import import_grpc  # noqa: E402

import_grpc()                # as `continuum serve` does, before anything else imports grpc

import grpc  # noqa: E402
import numpy as np  # noqa: E402
from tritonclient.grpc import model_config_pb2 as mc  # noqa: E402
from tritonclient.grpc import service_pb2 as pb  # noqa: E402
from tritonclient.grpc import service_pb2_grpc  # noqa: E402

from benchmarks.harness import add_save_result, free_port, save_result  # noqa: E402
from benchmarks.triton_protocol_bench import perf_analyzer  # noqa: E402
from triton_compat.frontend.grpc.loop import Server  # noqa: E402
from triton_compat.frontend.grpc.server import WORKERS  # noqa: E402

NAMES_IN, NAMES_OUT = ("INPUT0", "INPUT1"), ("OUTPUT0", "OUTPUT1")


class Canned(service_pb2_grpc.GRPCInferenceServiceServicer):
    """What perf_analyzer asks of a server, answered for `simple` only; counts ModelInfer."""

    def __init__(self) -> None:
        self.count, self.lock = 0, threading.Lock()

    def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=True)

    def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="triton", version="2.51.0")

    def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=True)

    def ModelMetadata(self, request, context):
        meta = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name="simple", versions=["1"], platform="python",
            inputs=[meta(name=n, datatype="INT32", shape=[-1, 16]) for n in NAMES_IN],
            outputs=[meta(name=n, datatype="INT32", shape=[-1, 16]) for n in NAMES_OUT])

    def ModelConfig(self, request, context):
        config = mc.ModelConfig(name="simple", backend="python", max_batch_size=8)
        for n in NAMES_IN:
            config.input.add(name=n, data_type=mc.TYPE_INT32, dims=[16])
        for n in NAMES_OUT:
            config.output.add(name=n, data_type=mc.TYPE_INT32, dims=[16])
        return pb.ModelConfigResponse(config=config)

    def ModelInfer(self, request, context):
        with self.lock:
            self.count += 1
        a, b = (np.frombuffer(r, np.int32) for r in request.raw_input_contents)
        response = pb.ModelInferResponse(model_name="simple", model_version="1",
                                         id=request.id)
        for n in NAMES_OUT:
            response.outputs.add(name=n, datatype="INT32", shape=[1, 16])
        response.raw_output_contents.extend([(a + b).tobytes(), (a - b).tobytes()])
        return response


def serve(kind: str, servicer: Canned, workers: int):
    """Start `servicer` on the `stock` or `loop` server: (server, port)."""
    port = free_port()
    if kind == "stock":
        server = grpc.server(ThreadPoolExecutor(workers))
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    else:
        fast = {"ModelInfer": lambda data, metadata, reply:
                reply(servicer.ModelInfer(pb.ModelInferRequest.FromString(data), None))}
        server = Server(servicer, service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server,
                        fast, options=[], workers=workers)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, port


def main(argv: list[str] | None = None) -> list[dict]:
    """Serve the canned servicer in this process and measure it with perf_analyzer; the
    points ({"server", "concurrency", perf_analyzer's figures, "cpu_us_per_request"})."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--perf-analyzer", type=Path, required=True)
    p.add_argument("--servers", default="stock,loop")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--workers", type=int, default=WORKERS)
    p.add_argument("--interval-ms", type=int, default=2000)
    add_save_result(p)
    args = p.parse_args(argv)
    points = []
    for kind in args.servers.split(","):
        servicer = Canned()
        server, port = serve(kind, servicer, args.workers)
        try:
            for c in [int(x) for x in args.concurrency.split(",")]:
                cpu, count = time.process_time(), servicer.count
                point = perf_analyzer(args.perf_analyzer, "simple", "grpc", c, 0, port,
                                      args.interval_ms)
                served = servicer.count - count
                # process_time counts this process's perf_analyzer wait too: it only sleeps
                point["cpu_us_per_request"] = round((time.process_time() - cpu) * 1e6
                                                    / max(served, 1), 1)
                print(f"{kind:5s} floor c={c:<3d} {point}", flush=True)
                points.append({"server": kind, "concurrency": c, **point})
        finally:
            server.stop(0)
    save_result(args.save_result, points)
    return points


if __name__ == "__main__":
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    main()
