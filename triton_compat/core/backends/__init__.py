"""Backends: one object per model instance that executes a batch of requests.

Contract (Triton's): `execute(requests) -> (results, times)` with one result per request, in
order — a dict of output arrays, or an `InferError` for that request alone; `times` splits the
execution into compute input / infer / output nanoseconds for the statistics extension.
`close()` is `finalize`. Backends raise `InferError` (status 500) on a load failure.
`triton_compat.core.backends.factory.create_instance` loads an instance of a config's backend.
"""

from __future__ import annotations

from triton_compat.core.backends.base import Backend, BackendRequest, ExecTimes

__all__ = ["Backend", "BackendRequest", "ExecTimes"]
