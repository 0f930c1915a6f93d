"""Custom batching rules: Triton's five batching hooks, written as a python module.

Triton lets a model add a rule to its dynamic batcher through five functions of a shared
library (server docs/user_guide/batcher.md, "Custom Batching"). Here the same five are python
functions of a module, found as Triton finds the library: the file named by the model config
parameter `TRITON_BATCH_STRATEGY_PATH`, else `batch_strategy.py` in the version folder, else in
the model folder. Names (Triton's, snake_cased):

    batcher_initialize(model_config: dict) -> batcher     TRITONBACKEND_ModelBatcherInitialize
    batch_initialize(batcher) -> batch_state               TRITONBACKEND_ModelBatchInitialize
    batch_include_request(request, batch_state) -> bool    TRITONBACKEND_ModelBatchIncludeRequest
    batch_finalize(batch_state) -> None                    TRITONBACKEND_ModelBatchFinalize
    batcher_finalize(batcher) -> None                      TRITONBACKEND_ModelBatcherFinalize

`request` is a `triton_python_backend_utils.InferenceRequest` (its inputs, id, parameters).
The batcher asks its rule afresh at every decision: one `batch_initialize`, then
`batch_include_request` for each request in batch order until one is refused (the batch then
goes at once, without it), then `batch_finalize`. The first request of a batch always goes.
Flows in: the model's config and folder; flows out: an `include` callable for
`scheduler.dynamic_batcher.decide`.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
from contextlib import contextmanager
from pathlib import Path

from triton_compat.core import pb_utils
from triton_compat.core.config import ConfigError, config_to_json

HOOKS = ("batcher_initialize", "batch_initialize", "batch_include_request", "batch_finalize",
         "batcher_finalize")
PARAMETER = "TRITON_BATCH_STRATEGY_PATH"
FILENAME = "batch_strategy.py"
_ids = itertools.count()
logger = logging.getLogger("continuum.triton")


def find(config, model_dir: Path, version: int) -> Path | None:
    """The strategy module of a model: the parameter's path (relative to the model folder),
    else batch_strategy.py in the version or model folder; None when there is none.
    Raises ConfigError when the parameter names a missing file."""
    if PARAMETER in config.parameters:
        path = model_dir / config.parameters[PARAMETER].string_value
        if not path.is_file():
            raise ConfigError(f"{PARAMETER} '{path}' is not a file")
        return path
    for folder in (model_dir / str(version), model_dir):
        if (folder / FILENAME).is_file():
            return folder / FILENAME
    return None


class BatchStrategy:
    """A loaded strategy module and its batcher state. Raises ConfigError when the module
    fails to import, lacks a hook, or `batcher_initialize` raises."""

    def __init__(self, path: Path, config) -> None:
        try:
            spec = importlib.util.spec_from_file_location(
                f"continuum_batch_strategy_{next(_ids)}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except Exception as e:
            raise ConfigError(f"{path}: {type(e).__name__}: {e}") from None
        missing = [h for h in HOOKS if not callable(getattr(module, h, None))]
        if missing:
            raise ConfigError(f"{path}: the batch strategy does not define {missing[0]}()")
        self.module, self.model = module, config.name
        try:
            self.batcher = module.batcher_initialize(config_to_json(config, defaults=True))
        except Exception as e:
            raise ConfigError(f"{path}: batcher_initialize failed: {type(e).__name__}: "
                              f"{e}") from None

    @contextmanager
    def batch(self):
        """One batch decision: yields `include(pending) -> bool` for `decide`."""
        state = self.module.batch_initialize(self.batcher)

        def include(p) -> bool:
            r = p.key.request
            request = pb_utils.InferenceRequest.incoming(
                [pb_utils.Tensor.wrap(n, a) for n, a in r.inputs.items()], r.id, r.outputs,
                r.correlation_id, r.parameters, r.flags, None, model_name=self.model)
            try:
                return bool(self.module.batch_include_request(request, state))
            except Exception as e:           # Triton logs it; the batch goes as it is
                logger.error("custom batching include function failed for model %s: %s: %s",
                             self.model, type(e).__name__, e)
                return False

        try:
            yield include
        finally:
            self.module.batch_finalize(state)

    def close(self) -> None:
        """`batcher_finalize`, when the model is unloaded."""
        self.module.batcher_finalize(self.batcher)


def load(config, model_dir: Path, version: int) -> BatchStrategy | None:
    """The model's strategy, or None. Only models with `dynamic_batching` use one (Triton:
    custom batching applies to the dynamic batcher). Raises ConfigError."""
    if not config.HasField("dynamic_batching"):
        return None
    path = find(config, model_dir, version)
    return BatchStrategy(path, config) if path is not None else None

