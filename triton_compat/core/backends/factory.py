"""One model instance of a config's backend: python (`backends/python.py`), pytorch and
onnxruntime (`backends/tensor.py`), loaded from the version folder's model file."""

from __future__ import annotations

from pathlib import Path

from triton_compat.core.backends.base import Backend
from triton_compat.core.config import BACKENDS
from triton_compat.errors import InferError


def create_instance(config, model_dir: Path, version: int, instance_name: str) -> Backend:
    """Load one instance of `config`'s model from `model_dir/<version>/`. Raises InferError."""
    filename = config.default_model_filename or BACKENDS[config.backend][1]
    path = model_dir / str(version) / filename
    if not path.exists():
        raise InferError(f"model file {path} does not exist", 500)
    if config.backend == "python":
        from triton_compat.core.backends.python import PythonBackend
        return PythonBackend(config, path, model_dir, version, instance_name)
    if config.backend == "pytorch":
        from triton_compat.core.backends.tensor import TorchScriptBackend
        return TorchScriptBackend(config, path)
    if config.backend == "onnxruntime":
        from triton_compat.core.backends.tensor import OnnxBackend
        return OnnxBackend(config, path)
    raise InferError(f"backend '{config.backend}' has no instances", 500)
