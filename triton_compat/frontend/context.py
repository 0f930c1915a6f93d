"""What the v2 front-ends (HTTP routes, gRPC service) share: one object per server.

Owns nothing of its own; it hands both protocols the same repository, readiness, shared-memory
regions, lifecycle (drain) and restricted-API rules, so that a request behaves the same
whichever wire it came over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from triton_compat.errors import InferError
from triton_compat.trace.settings import TraceManager

SERVER_NAME = "continuum"
# What this server implements of Triton's extensions (reported by GET /v2 and ServerMetadata).
EXTENSIONS = ["classification", "sequence", "model_repository",
              "model_repository(unload_dependents)", "schedule_policy", "model_configuration",
              "system_shared_memory", "cuda_shared_memory", "binary_tensor_data", "parameters",
              "statistics", "trace", "logging"]


@dataclass
class V2Context:
    """The v2 layer's shared state. `get_repository()` is None while the repository loads;
    `server_ready()` says whether everything served is ready; `lifecycle` (api.lifecycle) counts
    requests in flight and says when the server drains."""

    get_repository: Callable
    server_ready: Callable[[], bool]
    version: str
    shm: object                                   # shared_memory.SharedMemoryManager
    lifecycle: object = None
    grpc_restrictions: dict = field(default_factory=dict)   # category -> (header, value)
    # True while other HTTP requests are in progress: a cheap model's infer then waits for the
    # end of the event loop's pass to run with them as one batch (runtime.ModelRuntime.submit)
    busy: Callable[[], bool] = lambda: False
    # --trace-config and the trace API (tracing off by default, as in tritonserver)
    tracer: TraceManager = field(default_factory=TraceManager)

    def trace(self, model: str, headers=None):
        """A trace for a request to `model` when its trace setting samples it, else None."""
        return self.tracer.sample(model, headers)

    def repository(self):
        """The loaded repository. Raises InferError(503) while it loads."""
        r = self.get_repository()
        if r is None:
            raise InferError("the model repository is still loading", 503)
        return r
