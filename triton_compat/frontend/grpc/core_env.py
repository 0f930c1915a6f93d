"""How grpcio's C-core does its socket I/O in the server process: on the loop thread.

Owns: `import_grpc`, which imports grpcio with C-core's EventEngine listener and endpoints
turned off through GRPC_EXPERIMENTS. C-core reads that variable once, when grpcio is imported,
so the server's entry point calls this before anything else imports grpc (`tritonclient.grpc`
does, through triton_compat.core.config). The variable is put back as it was right after, so child
processes (the engine, ray workers, perf_analyzer from a benchmark) never see it.
Flows in: the environment; flows out: the imported `grpc` module, the environment unchanged.
"""

from __future__ import annotations

import os
import sys

# C-core's EventEngine listener and endpoints: with them on, every socket read and write runs
# on EventEngine's own threads, which hand each event to the completion-queue thread
EVENT_ENGINE_IO = ("event_engine_listener", "event_engine_for_all_other_endpoints")


def import_grpc() -> bool:
    """Import grpc with C-core's EventEngine listener and endpoints off, unless
    GRPC_EXPERIMENTS already names either (then the user's choice stands). Socket reads and
    writes then run inside `CompletionQueue.poll` on the completion-queue thread
    (grpc/loop.py; iomgr's pollset), with no thread switch to wake that thread for each
    event. Measured with perf_analyzer on `simple`, side by side on one host: gRPC + system
    shared memory at concurrency 1, 4.9 → 1.0 context switches and 354 → 303 µs of server
    CPU per request; gRPC at 16, 296 → 189 µs and 3942 → 5159 infer/s.
    Returns whether the experiments were turned off: False when the user named them, or when
    grpc was imported before (C-core has read the variable then)."""
    current = os.environ.get("GRPC_EXPERIMENTS")
    if "grpc" in sys.modules or any(name in (current or "") for name in EVENT_ENGINE_IO):
        import grpc  # noqa: F401
        return False
    off = ",".join(f"-{name}" for name in EVENT_ENGINE_IO)
    os.environ["GRPC_EXPERIMENTS"] = f"{current},{off}" if current else off
    try:
        import grpc  # noqa: F401
    finally:
        if current is None:
            del os.environ["GRPC_EXPERIMENTS"]
        else:
            os.environ["GRPC_EXPERIMENTS"] = current
    return True
