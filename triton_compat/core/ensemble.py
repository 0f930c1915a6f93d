"""Ensemble scheduler: a DAG of composing-model steps wired by tensor names.

Owns: running one ensemble request. Each `ensemble_scheduling.step` maps ensemble tensors to
its model's inputs (`input_map`: model input -> ensemble tensor) and its model's outputs to new
ensemble tensors (`output_map`: model output -> ensemble tensor). A step is submitted to its
composing model's runtime as soon as all of its inputs exist, so independent steps run
concurrently, and each composing model keeps its own dynamic batcher (requests of different
ensemble calls are batched together there). Driven by callbacks: no thread of its own.

A decoupled composing model makes the ensemble decoupled (Triton core's
ValidateEnsembleConfig): each of that step's responses carries its own copy of the tensors on
through the steps after it (a branch), every branch that completes the ensemble's outputs is
one response of the ensemble, and the final flag follows once every branch has run out of
steps. The first failing step fails the request with that step's error (Triton's behaviour).
Reference: Triton core src/ensemble_scheduler/ (ensemble_scheduler.cc, ensemble_utils.cc).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from triton_compat.core.backends import BackendRequest
from triton_compat.errors import DECOUPLED_HTTP, InferError
from scheduler.futures import settle
from triton_compat.core.runtime import ModelRuntime
from triton_compat.core.stats import ModelStats
from triton_compat.core.validate import Signature, check_inputs, check_outputs


class EnsembleRuntime:
    """A loaded ensemble. `resolve(model_name, version) -> runtime` finds composing models
    (loaded before the ensemble). Raises InferError(500) when an output is produced by no
    step."""

    def __init__(self, config, version: int, resolve) -> None:
        self.config, self.version, self.resolve = config, version, resolve
        self.steps = list(config.ensemble_scheduling.step)
        self.decoupled = any(resolve(s.model_name, s.model_version).decoupled
                             for s in self.steps)
        if self.decoupled:            # as Triton serves the config of such an ensemble
            config.model_transaction_policy.decoupled = True
        self.signature = Signature(config)
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

    # a decoupled ensemble's responses, as they come (the same as a decoupled model's)
    generate = ModelRuntime.generate

    def submit(self, request: BackendRequest, datatypes: dict[str, str] | None = None,
               priority: int = 0, timeout_us: int | None = None,
               inline: bool = False, defer=None) -> Future:
        """Validate and start the request; the future resolves to {output name: array} (a
        decoupled ensemble: to {} after its final response, the responses going to
        `request.deliver`). `inline` and `defer` are accepted for the runtime interface; steps
        run on their own models. Raises InferError(400) for a bad request, 501 for one-response
        inference of a decoupled ensemble."""
        if self.decoupled and request.deliver is None:
            raise InferError(DECOUPLED_HTTP, 501)
        wanted = check_outputs(self.signature, request.outputs or None)
        batch_size = check_inputs(self.signature, request.inputs, datatypes or {}, request.id)
        run = _EnsembleRun(self, request, wanted, priority, timeout_us, batch_size)
        run.launch(_Branch(dict(request.inputs), set()))
        return run.future

    def abort_all(self, message: str) -> None:
        """Nothing of its own to answer: its steps' requests are in the composing models'
        runtimes, which the repository aborts too (and each step's failure fails the run)."""

    def close(self, timeout_s: float = 30.0) -> bool:
        """Nothing to release: composing models are unloaded on their own. True."""
        return True


class _Branch:
    """The tensors one line of responses has so far, and the steps it has run."""

    __slots__ = ("tensors", "done")

    def __init__(self, tensors: dict, done: set) -> None:
        self.tensors, self.done = tensors, done


class _EnsembleRun:
    """The state of one ensemble request while its steps run. `open` counts what may still
    produce tensors: running steps and decoupled steps not final yet."""

    def __init__(self, ensemble: EnsembleRuntime, request: BackendRequest, wanted: list[str],
                 priority: int, timeout_us: int | None, batch_size: int) -> None:
        self.ensemble, self.request, self.wanted = ensemble, request, wanted
        self.priority, self.timeout_us, self.batch_size = priority, timeout_us, batch_size
        self.open = 0
        self.responded = False
        self.lock = threading.Lock()
        self.future: Future = Future()
        self.t0 = time.perf_counter_ns()
        ensemble.pending_count += 1

    def launch(self, branch: _Branch) -> None:
        """Submit every step of `branch` whose inputs exist; a branch with nothing left to run
        is answered, and the request ends when nothing is open."""
        steps = self.ensemble.steps
        with self.lock:
            if self.future.done():
                return
            ready = [i for i in range(len(steps)) if i not in branch.done
                     and all(v in branch.tensors for v in steps[i].input_map.values())]
            branch.done |= set(ready)
            self.open += len(ready)
        if not ready:
            self._branch_ended(branch)
        for i in ready:
            self._submit(branch, steps[i])
        if not ready:
            self._maybe_end()

    def _submit(self, branch: _Branch, step) -> None:
        inputs = {k: branch.tensors[v] for k, v in step.input_map.items()}
        try:
            runtime = self.ensemble.resolve(step.model_name, step.model_version)
            deliver = None
            if runtime.decoupled:
                def deliver(result, final, branch=branch, step=step):
                    self._response(branch, step, result, final)
            sub = runtime.submit(BackendRequest(inputs, list(step.output_map), self.request.id,
                                                self.request.parameters, deliver),
                                 priority=self.priority, timeout_us=self.timeout_us)
        except InferError as e:
            self._fail(e)
            return
        if deliver is None:
            sub.add_done_callback(lambda f: self._step_done(branch, step, f))
        else:                 # its responses come through `deliver`; only failures here
            sub.add_done_callback(lambda f: self._check(f))

    def _check(self, future: Future) -> None:
        error = future.exception()
        if error is not None:
            self._fail(error if isinstance(error, InferError) else InferError(str(error), 500))

    def _step_done(self, branch: _Branch, step, future: Future) -> None:
        error = future.exception()
        if error is not None:
            self._fail(error if isinstance(error, InferError) else InferError(str(error), 500))
            return
        with self.lock:
            self._outputs(branch, step, future.result())
            self.open -= 1
        self.launch(branch)

    def _response(self, branch: _Branch, step, result, final: bool) -> None:
        """One response of a decoupled step: a branch of its own goes on from it."""
        if isinstance(result, Exception):
            self._fail(result if isinstance(result, InferError) else
                       InferError(str(result), 500))
            return
        if result is not None:
            child = _Branch(dict(branch.tensors), set(branch.done))
            self._outputs(child, step, result)
            self.launch(child)
        if final:
            with self.lock:
                self.open -= 1
            self._maybe_end()

    @staticmethod
    def _outputs(branch: _Branch, step, outputs: dict) -> None:
        for model_name, tensor in step.output_map.items():
            if model_name in outputs:
                branch.tensors[tensor] = outputs[model_name]

    def _branch_ended(self, branch: _Branch) -> None:
        """`branch` has no step left: its outputs are a response when they are complete."""
        if not all(n in branch.tensors for n in self.wanted):
            return
        outputs = {n: branch.tensors[n] for n in self.wanted}
        if self.ensemble.decoupled:
            self.responded = True
            self.request.deliver(outputs, False)
        elif not self.responded:
            self.responded = True
            self._settle(True)
            settle(self.future, outputs)

    def _maybe_end(self) -> None:
        """Nothing open: a decoupled ensemble sends its final flag; a request without its
        outputs fails (Triton's text)."""
        with self.lock:
            if self.open or self.future.done():
                return
        if self.ensemble.decoupled:
            self.request.deliver(None, True)
            self._settle(True)
            settle(self.future, {})
        elif not self.responded:
            self._fail(InferError(f"in ensemble '{self.ensemble.config.name}', "
                                  f"[request id: {self.request.id or '<id_unknown>'}] "
                                  "unexpected deadlock, at least one output is not set while "
                                  "no more ensemble steps can be made"))

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
