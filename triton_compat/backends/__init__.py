"""Backends: one object per model instance that executes a batch of requests.

Contract (Triton's): `execute(requests) -> (results, times)` with one result per request, in
order — a dict of output arrays, or an `InferError` for that request alone; `times` splits the
execution into compute input / infer / output nanoseconds for the statistics extension.
`close()` is `finalize`. Backends raise `InferError` (status 500) on a load failure.
"""

from __future__ import annotations

from pathlib import Path

from triton_compat.backends.base import Backend, BackendRequest, ExecTimes
from triton_compat.config import BACKENDS
from triton_compat.errors import InferError

__all__ = ["Backend", "BackendRequest", "ExecTimes", "create_instance"]


def create_instance(config, model_dir: Path, version: int, instance_name: str) -> Backend:
    """Load one instance of `config`'s model from `model_dir/<version>/`. Raises InferError."""
    filename = config.default_model_filename or BACKENDS[config.backend][1]
    path = model_dir / str(version) / filename
    if not path.exists():
        raise InferError(f"model file {path} does not exist", 500)
    if config.backend == "python":
        from triton_compat.backends.python import PythonBackend
        return PythonBackend(config, path, model_dir, version, instance_name)
    if config.backend == "pytorch":
        from triton_compat.backends.tensor import TorchScriptBackend
        return TorchScriptBackend(config, path)
    if config.backend == "onnxruntime":
        from triton_compat.backends.tensor import OnnxBackend
        return OnnxBackend(config, path)
    raise InferError(f"backend '{config.backend}' has no instances", 500)
