"""Ensemble scheduler: a DAG of composing-model steps wired by tensor names.

Owns: running one ensemble request. Each `ensemble_scheduling.step` maps ensemble tensors to
its model's inputs (`input_map`: model input -> ensemble tensor) and its model's outputs to new
ensemble tensors (`output_map`: model output -> ensemble tensor). A step is submitted to its
composing model's runtime as soon as all of its inputs exist, so independent steps run
concurrently, and each composing model keeps its own dynamic batcher (requests of different
ensemble calls are batched together there). Driven by future callbacks: no thread of its own.
The first failing step fails the request with that step's error (Triton's behaviour).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from triton_compat.backends import BackendRequest
from triton_compat.errors import InferError
from triton_compat.runtime import settle
from triton_compat.stats import ModelStats
from triton_compat.validate import Signature, check_inputs, check_outputs


class EnsembleRuntime:
    """A loaded ensemble. `resolve(model_name, version) -> runtime` finds composing models."""

    def __init__(self, config, version: int, resolve) -> None:
        self.config, self.version, self.resolve = config, version, resolve
        self.signature = Signature(config)
        self.steps = list(config.ensemble_scheduling.step)
        self.stats = ModelStats()
        self.pending_count = 0
        self.runs_inline = False         # its steps run on their own models' threads
        produced = {t.name for t in config.input}
        for step in self.steps:
            produced |= set(step.output_map.values())
        for t in config.output:
            if t.name not in produced:
                raise InferError(f"ensemble '{config.name}': output '{t.name}' is not "
                                 "produced by any step", 500)

    def submit(self, request: BackendRequest, datatypes: dict[str, str] | None = None,
               priority: int = 0, timeout_us: int | None = None,
               inline: bool = False, defer=None) -> Future:
        """Validate and start the request; the future resolves to {output name: array}.
        (`inline` and `defer` are accepted for the runtime interface; steps run on their own
        models.)"""
        batch_size = check_inputs(self.signature, request.inputs, datatypes or {})
        wanted = check_outputs(self.signature, request.outputs or None)
        run = _EnsembleRun(self, request, wanted, priority, timeout_us, batch_size)
        run.launch()
        return run.future

    def close(self, timeout_s: float = 30.0) -> bool:
        """Nothing to release: composing models are unloaded on their own. True."""
        return True


class _EnsembleRun:
    """The state of one ensemble request while its steps run."""

    def __init__(self, ensemble: EnsembleRuntime, request: BackendRequest, wanted: list[str],
                 priority: int, timeout_us: int | None, batch_size: int) -> None:
        self.ensemble, self.request, self.wanted = ensemble, request, wanted
        self.priority, self.timeout_us, self.batch_size = priority, timeout_us, batch_size
        self.tensors = dict(request.inputs)
        self.waiting = list(range(len(ensemble.steps)))
        self.running = 0
        self.finishing = False
        self.lock = threading.Lock()
        self.future: Future = Future()
        self.t0 = time.perf_counter_ns()
        ensemble.pending_count += 1

    def launch(self) -> None:
        """Submit every step whose inputs exist; finish when nothing is left to run."""
        with self.lock:
            if self.future.done():
                return
            ready = [i for i in self.waiting
                     if all(v in self.tensors for v in self.ensemble.steps[i].input_map.values())]
            self.waiting = [i for i in self.waiting if i not in ready]
            self.running += len(ready)
            submits = [(i, {k: self.tensors[v] for k, v in self.ensemble.steps[i].input_map
                            .items()}) for i in ready]
            finished = not ready and self.running == 0 and not self.finishing
            self.finishing |= finished
        if finished:
            self._finish()
        for i, inputs in submits:
            step = self.ensemble.steps[i]
            try:
                runtime = self.ensemble.resolve(step.model_name, step.model_version)
                sub = runtime.submit(BackendRequest(inputs, list(step.output_map),
                                                    self.request.id, self.request.parameters),
                                     priority=self.priority, timeout_us=self.timeout_us)
            except InferError as e:
                self._fail(e)
                return
            sub.add_done_callback(lambda f, step=step: self._step_done(step, f))

    def _step_done(self, step, future: Future) -> None:
        error = future.exception()
        if error is not None:
            self._fail(error if isinstance(error, InferError) else InferError(str(error), 500))
            return
        outputs = future.result()
        with self.lock:
            self.running -= 1
            for model_name, tensor in step.output_map.items():
                self.tensors[tensor] = outputs[model_name]
        self.launch()

    def _finish(self) -> None:
        missing = [n for n in self.wanted if n not in self.tensors]
        if missing:
            self._fail(InferError(f"ensemble '{self.ensemble.config.name}' could not produce "
                                  f"output '{missing[0]}'", 500))
            return
        self._settle(True)
        settle(self.future, {n: self.tensors[n] for n in self.wanted})

    def _fail(self, error: InferError) -> None:
        with self.lock:
            if self.future.done():
                return
            settle(self.future, error)
        self._settle(False)

    def _settle(self, ok: bool) -> None:
        self.ensemble.pending_count -= 1
        self.ensemble.stats.record_request(ok, time.perf_counter_ns() - self.t0,
                                           self.batch_size)
