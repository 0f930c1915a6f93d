"""The backend interface and the request type a backend receives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np


@dataclass
class BackendRequest:
    """One request as a backend sees it: validated inputs (numpy, batch dimension first when
    the model batches), the output names to return, and the client's id and parameters.
    `deliver(outputs_or_error, final)`: a decoupled model's responses go there (any thread).
    Sequence models also get the request's correlation id and START / END flags."""

    inputs: dict[str, np.ndarray]
    outputs: list[str]
    id: str = ""
    parameters: dict = field(default_factory=dict)
    deliver: Callable | None = None
    correlation_id: int | str = 0    # the sequence id (sequence models)
    flags: int = 0                   # SEQUENCE_START 1 | SEQUENCE_END 2
    reschedule: bool = False         # set by the backend: the model asked to run it again
    cancelled: bool = False          # set by the server: the client went away (is_cancelled)
    trace: object = None             # triton_compat.trace.Trace when the request is traced

    @property
    def batch_size(self) -> int:
        """Rows along the batch dimension (the first input's first dimension)."""
        first = next(iter(self.inputs.values()), None)
        return int(first.shape[0]) if first is not None and first.ndim else 1


@dataclass
class ExecTimes:
    """Nanoseconds spent preparing inputs, running the model, and splitting outputs."""

    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0


class Backend:
    """One model instance. Subclasses implement `execute`; `close` releases resources."""

    def execute(self, requests: list[BackendRequest]) -> tuple[list, ExecTimes]:
        """Run a batch: one dict of outputs or one InferError per request, and the timings."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the instance (the python backend's `finalize`)."""
