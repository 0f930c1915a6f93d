"""The one interface every servable model version implements, declared: `Runtime`.

The front ends (HTTP, gRPC, generate, BLS), the repository and the ensemble scheduler talk to a
model only through it: `ModelRuntime` (dynamic / default batching), `SequenceRuntime` (the
sequence batcher), `EnsembleRuntime` and `LLMModel` (the engine as a decoupled model).
`tests/test_triton_runtime.py` checks each against it (`isinstance`, the protocol being
runtime-checkable).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol, runtime_checkable


@runtime_checkable
class Runtime(Protocol):
    """A loaded model version. `config`: its `ModelConfig` (protobuf); `signature`: the checks'
    view of it (`validate.Signature`); `decoupled`: it answers with a stream of responses
    (`generate`), not one (`submit`); `runs_inline`: cheaper than a thread hand-off, run on
    the caller's thread when alone; `stats`: Triton's statistics (`stats.ModelStats`);
    `pending_count`: requests queued or executing."""

    config: object
    version: int
    signature: object
    decoupled: bool
    runs_inline: bool
    stats: object
    pending_count: int

    def submit(self, request, datatypes: dict[str, str] | None = None, priority: int = 0,
               timeout_us: int | None = None, inline: bool = False, defer=None) -> Future:
        """Queue a `BackendRequest`; the future resolves to {output: array}. Raises
        InferError (Triton's texts)."""

    def generate(self, inputs: dict, request_id: str = "", datatypes: dict | None = None,
                 parameters: dict | None = None):
        """A decoupled model's responses, as an async iterator of (outputs, final)."""

    def abort_all(self, message: str) -> None:
        """Answer every request in flight with 503 `message` (a drain's deadline passed)."""

    def close(self, timeout_s: float = 30.0) -> bool:
        """Stop, let what runs finish within `timeout_s` seconds; False when it did not."""
