"""The python backend: a `model.py` defining `TritonPythonModel`, as in Triton's python backend.

`initialize(args)` gets Triton's args dict (model_config as a JSON string, model name,
version, repository, instance name and kind); `execute(requests)` gets the batch's requests
(not concatenated: a python model batches as it likes) and must return one
`InferenceResponse` per request; an error set on a response fails that request alone; an
exception or a wrong number of responses fails the whole batch, each request with the message.
`finalize()` runs on unload. The module is imported under a unique name per instance, with
`triton_python_backend_utils` resolving to `triton_compat.pb_utils`.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
import time
from pathlib import Path

from triton_compat import pb_utils
from triton_compat.backends.base import Backend, BackendRequest, ExecTimes
from triton_compat.config import config_to_json
from triton_compat.errors import InferError

_ids = itertools.count()


class PythonBackend(Backend):
    """One instance of a python model. Raises InferError (500) when the model fails to load."""

    def __init__(self, config, path: Path, model_dir: Path, version: int,
                 instance_name: str) -> None:
        sys.modules.setdefault("triton_python_backend_utils", pb_utils)
        self.config_json = config_to_json(config)
        self.decoupled = config.model_transaction_policy.decoupled
        name = f"continuum_python_model_{next(_ids)}"
        try:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            self.model = module.TritonPythonModel()
            if hasattr(self.model, "initialize"):
                self.model.initialize({
                    "model_config": json.dumps(self.config_json),
                    "model_instance_kind": "CPU", "model_instance_name": instance_name,
                    "model_instance_device_id": "0", "model_repository": str(model_dir),
                    "model_version": str(version), "model_name": config.name})
        except Exception as e:
            raise InferError(f"failed to load python model {path}: "
                             f"{type(e).__name__}: {e}", 500) from None

    def execute(self, requests: list[BackendRequest]) -> tuple[list, ExecTimes]:
        """Call the model's `execute` on the batch; map responses back to requests."""
        t0 = time.perf_counter_ns()
        pb_requests = [pb_utils.InferenceRequest(
            [pb_utils.Tensor(n, a) for n, a in r.inputs.items()], r.id, r.outputs,
            correlation_id=r.correlation_id, parameters=r.parameters,
            sender=self._sender(r), flags=r.flags) for r in requests]
        t1 = time.perf_counter_ns()
        try:
            responses = self.model.execute(pb_requests)
        except Exception as e:
            err = InferError(f"Failed to process the request(s) for model "
                             f"'{self.config_json['name']}': {type(e).__name__}: {e}", 500)
            return [err] * len(requests), ExecTimes(t1 - t0, time.perf_counter_ns() - t1, 0)
        t2 = time.perf_counter_ns()
        for r, pb in zip(requests, pb_requests):
            r.reschedule = bool(pb.release_flags()
                                & pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
        if self.decoupled:         # responses go through the senders; execute returns None
            return [{} for _ in requests], ExecTimes(t1 - t0, t2 - t1, 0)
        if not isinstance(responses, list) or len(responses) != len(requests):
            n = len(responses) if isinstance(responses, list) else type(responses).__name__
            err = InferError(f"python model '{self.config_json['name']}' returned {n} "
                             f"responses for {len(requests)} requests", 500)
            return [err] * len(requests), ExecTimes(t1 - t0, t2 - t1, 0)
        results = [self._result(resp, req) for resp, req in zip(responses, requests)]
        return results, ExecTimes(t1 - t0, t2 - t1, time.perf_counter_ns() - t2)

    def _sender(self, request: BackendRequest):
        if not self.decoupled:
            return None

        def deliver(response, final: bool) -> None:
            result = None if response is None else self._result(response, request)
            request.deliver(result, final)

        return pb_utils.InferenceResponseSender(deliver)

    def _result(self, response, request: BackendRequest):
        if not isinstance(response, pb_utils.InferenceResponse):
            return InferError(f"python model '{self.config_json['name']}' returned a "
                              f"{type(response).__name__}, not an InferenceResponse", 500)
        if response.has_error():
            status = 400 if response.error().code() == pb_utils.TritonError.INVALID_ARG else 500
            return InferError(response.error().message(), status)
        return {t.name(): t.as_numpy() for t in response.output_tensors()}

    def close(self) -> None:
        """Call the model's `finalize`, if it has one."""
        if hasattr(self.model, "finalize"):
            self.model.finalize()
