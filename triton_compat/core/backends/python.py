"""The python backend: a `model.py` defining `TritonPythonModel`, as in Triton's python backend.

`initialize(args)` gets Triton's args dict (model_config as a JSON string, model name,
version, repository, instance name and kind); `execute(requests)` gets the batch's requests
(not concatenated: a python model batches as it likes). Every request has a response sender.
A model that is not decoupled answers each request once: in the list `execute` returns, or
through the sender (before or after returning: the execution then ends when every request has
its answer); an error set on a response fails that request alone; an exception or a wrong
list fails every request not answered yet, with the message. A decoupled model sends any
number of responses through the senders and returns None. `execute` may be a coroutine
(`async def`, python_backend README "Async execute"): it runs on an event loop of the
instance's own (a thread started on first use, stopped at finalize); a decoupled model's
coroutine runs in the background, so the instance takes its next batch at once; any other
model's is awaited. `finalize()` runs on unload. The module is imported by `python_import`
(the model's folders on the import path, sibling modules of its own), with
`triton_python_backend_utils` resolving to `triton_compat.core.pb_utils`; BLS calls from the
model go through `triton_compat.core.bls`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import sys
import threading
import time
import traceback
from pathlib import Path

from triton_compat.core import bls, pb_utils as pb
from triton_compat.core.backends import python_import
from triton_compat.core.backends.base import Backend, BackendRequest, ExecTimes
from triton_compat.core.config import config_to_json
from triton_compat.errors import InferError

_OWN_CODE = str(Path(__file__).resolve().parent.parent)    # triton_compat/

logger = logging.getLogger("continuum.triton.python_model")
_ERROR_STATUS = {pb.TritonError.INVALID_ARG: 400, pb.TritonError.NOT_FOUND: 404,
                 pb.TritonError.UNSUPPORTED: 501, pb.TritonError.UNAVAILABLE: 503}


class _Answer:
    """The one answer of a non-decoupled request sent through its sender (any thread);
    `done` is set under the instance's condition, which `wait` waits on."""

    __slots__ = ("result", "done", "sender", "cond")

    def __init__(self, cond: threading.Condition) -> None:
        self.result, self.done, self.sender, self.cond = None, False, None, cond

    def set(self, result) -> None:
        with self.cond:
            self.result, self.done = result, True
            self.cond.notify_all()

    def wait(self):
        with self.cond:
            self.cond.wait_for(lambda: self.done)
        return self.result


def exception_text(e: BaseException) -> str:
    """pybind11's `error_already_set::what()` of an exception a model raised, as Triton's stub
    reports it: "Type: words", then "\n\nAt:\n" and the frames, innermost first, each
    "  file(line): function\n". Only the model's frames: Triton's stub calls `execute` from
    C++, so no frame of the server appears there either."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith(_OWN_CODE)]
    text = f"{type(e).__name__}: {e}"
    if frames:
        text += "\n\nAt:\n" + "".join(f"  {f.filename}({f.lineno}): {f.name}\n"
                                     for f in reversed(frames))
    return text


class PythonBackend(Backend):
    """One instance of a python model. Raises InferError (500) when the model fails to load."""

    def __init__(self, config, path: Path, model_dir: Path, version: int,
                 instance_name: str) -> None:
        self.config_json = config_to_json(config, defaults=True)    # as Triton's stub sees it
        self.name, self.instance_name = config.name, instance_name
        # A model runs with no command line, as in Triton's stub process: qa models call
        # `unittest.main(...)`, which would parse the server's flags. Set once, at the first
        # python model's load, when the server has long parsed its own.
        sys.argv[:] = [sys.argv[0]] if sys.argv else [""]
        self.decoupled = config.model_transaction_policy.decoupled
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._answered = threading.Condition()
        self._open: dict[int, tuple] = {}   # decoupled requests not final: id -> (sender, req)
        self.module = None
        try:
            self.module = python_import.load(path)
            self.model_dir = python_import.folders(self.module)[1]
            self.model = self.module.TritonPythonModel()
            if hasattr(self.model, "initialize"):
                with bls.running(self, "initialize"):
                    self.model.initialize({
                        "model_config": json.dumps(self.config_json),
                        "model_instance_kind": "CPU", "model_instance_name": instance_name,
                        "model_instance_device_id": "0", "model_repository": str(model_dir),
                        "model_version": str(version), "model_name": config.name})
        except (Exception, SystemExit) as e:   # a model calling exit() included
            if self.module is not None:
                python_import.unload(self.module)
            raise InferError(f"failed to load python model {path}: "
                             f"{type(e).__name__}: {e}", 500) from None

    def execute(self, requests: list[BackendRequest]) -> tuple[list, ExecTimes]:
        """Call the model's `execute` on the batch; map its answers back to the requests."""
        t0 = time.perf_counter_ns()
        answers = [_Answer(self._answered) for _ in requests]
        pb_requests = [self._request(r, a) for r, a in zip(requests, answers)]
        t1 = time.perf_counter_ns()
        try:
            with bls.running(self):
                returned = self.model.execute(pb_requests)
                if inspect.iscoroutine(returned):
                    returned = self._run_coroutine(returned, requests, answers)
            error = None
        except (Exception, SystemExit) as e:
            returned, error = None, self._failure(e)
        finally:
            python_import.forget_lazy(self.model_dir)
        t2 = time.perf_counter_ns()
        for r, p in zip(requests, pb_requests):
            r.reschedule = bool(p.release_flags() & pb.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
        if self.decoupled:         # responses went through the senders
            if error is None and returned is not None:
                error = InferError(f"Python model '{self.instance_name}' is using the "
                                   "decoupled mode and the execute function must return "
                                   "None.", 500)
            results = [self._close(a.sender, r, error) for a, r in zip(answers, requests)]
            with self._lock:       # a rescheduled request comes back with a sender of its own
                for r in requests:
                    if r.reschedule:
                        self._open.pop(id(r), None)
            return results, ExecTimes(t1 - t0, t2 - t1, 0)
        results = self._answers(requests, pb_requests, answers, returned, error)
        return results, ExecTimes(t1 - t0, t2 - t1, time.perf_counter_ns() - t2)

    def _request(self, r: BackendRequest, answer: _Answer) -> pb.InferenceRequest:
        """The request `execute` sees, with its sender: made now for a decoupled model, on
        the model's first `get_response_sender()` for any other (most never ask)."""
        def cancelled() -> bool:
            return getattr(r, "cancelled", False)

        sender = None
        if self.decoupled:
            def deliver(response, final: bool) -> None:
                if final:
                    with self._lock:
                        self._open.pop(id(r), None)
                r.deliver(None if response is None else self._result(response, r), final)

            sender = answer.sender = pb.InferenceResponseSender(deliver, True, cancelled)
            with self._lock:
                self._open[id(r)] = (sender, r)
        return pb.InferenceRequest.incoming(
            [pb.Tensor.wrap(n, a) for n, a in r.inputs.items()], r.id, r.outputs, r.correlation_id,
            r.parameters, r.flags, sender, cancelled, self.name,
            None if self.decoupled else lambda: self._sender(r, answer, cancelled))

    def _sender(self, r: BackendRequest, answer: _Answer, cancelled) -> pb.InferenceResponseSender:
        """A non-decoupled request's sender, made when the model first asks for it: its one
        response is the request's answer; after `execute` returned one it sends no more."""
        def deliver(response, final: bool) -> None:
            if response is not None:
                answer.set(self._result(response, r))

        with answer.cond:
            answer.sender = pb.InferenceResponseSender(deliver, False, cancelled)
            if answer.done:                 # answered by the list `execute` returned
                answer.sender.claim(True, True)
        return answer.sender

    def _failure(self, e: Exception) -> InferError:
        """The error of an `execute` that raised, in the python backend's words: the instance's
        name and pybind11's text of the exception (src/pb_stub.cc, ProcessRequests)."""
        logger.error("python model '%s' failed: %s: %s", self.name, type(e).__name__, e)
        return InferError(f"Failed to process the request(s) for model '{self.instance_name}', "
                          f"message: {exception_text(e)}", 500)

    def _close(self, sender, r: BackendRequest, error) -> object:
        """A decoupled request after `execute`: on an error, the error if its sender was still
        open (then closed), else nothing more to say."""
        if error is None or not sender.close():
            return {}
        with self._lock:
            self._open.pop(id(r), None)
        return error

    def _answers(self, requests, pb_requests, answers, returned, error) -> list:
        """Non-decoupled: each request's answer, from the returned list or its sender; after
        an error, the error for every request not answered yet (Triton's python backend)."""
        if returned is not None and error is None:
            if not isinstance(returned, list) or len(returned) != len(requests):
                n = len(returned) if isinstance(returned, list) else type(returned).__name__
                error = InferError(f"python model '{self.name}' returned {n} responses for "
                                   f"{len(requests)} requests", 500)
            else:
                error = self._take_returned(requests, pb_requests, answers, returned)
        results = []
        for r, p, answer in zip(requests, pb_requests, answers):
            sender = answer.sender
            if answer.done:
                results.append(answer.result)
            elif error is not None:    # a failed execution answers, and never runs again
                r.reschedule = False
                if sender is not None:
                    sender.close()
                results.append(error)
            elif r.reschedule:
                results.append({})
            elif sender is None or sender.is_closed():
                results.append(InferError(f"python model '{self.name}' returned no response "
                                          "for a request and sent none", 500))
            else:                  # the model holds the sender: its answer comes later
                results.append(answer.wait())
        return results

    def _take_returned(self, requests, pb_requests, answers, returned) -> InferError | None:
        """Record the returned responses (each closes its request's sender, as in Triton);
        the first that breaks the rules is the error of the requests not answered yet."""
        for r, p, answer, response in zip(requests, pb_requests, answers, returned):
            if response is None:
                continue
            try:
                if r.reschedule:
                    raise pb.TritonModelException(
                        "Expected a None object in the execute function return list for "
                        f"reschduled request, found type '{type(response)}'.")
                with answer.cond:     # the sender, if the model made one, closes with this
                    if answer.sender is not None:
                        answer.sender.claim(True, True)
                    answer.result, answer.done = self._result(response, r), True
            except pb.TritonModelException as e:
                return self._failure(e)
        return None

    def _result(self, response, request: BackendRequest):
        if not isinstance(response, pb.InferenceResponse):
            return InferError(f"python model '{self.name}' returned a "
                              f"{type(response).__name__}, not an InferenceResponse", 500)
        if response.has_error():
            return InferError(response.error().message(),
                              _ERROR_STATUS.get(response.error().code(), 500))
        try:
            return {t.name(): pb.array_of(t) for t in response.output_tensors()
                    if not request.outputs or t.name() in request.outputs}
        except pb.TritonModelException as e:
            return InferError(f"python model '{self.name}': {e}", 500)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The instance's event loop, its thread started on first use."""
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()

                def run() -> None:
                    asyncio.set_event_loop(loop)
                    with bls.running(self):
                        loop.run_forever()

                self._loop_thread = threading.Thread(
                    target=run, name=f"python-{self.instance_name}-loop", daemon=True)
                self._loop_thread.start()
                self._loop = loop
            return self._loop

    def _run_coroutine(self, coroutine, requests, answers):
        """Await a non-decoupled model's coroutine on the instance loop; start a decoupled
        model's in the background (its failure ends every request still open)."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._event_loop())
        if not self.decoupled:
            return future.result()

        def done(f) -> None:
            if f.cancelled() or f.exception() is None:
                return
            e = f.exception()
            logger.error("python model '%s': async execute failed:\n%s", self.name,
                         "".join(_format(e)))
            error = self._failure(e)
            for a, r in zip(answers, requests):
                if self._close(a.sender, r, error) is error:
                    r.deliver(error, True)

        future.add_done_callback(done)
        return None

    def close(self) -> None:
        """Stop the instance's loop (as Triton does, before `finalize`), call the model's
        `finalize` (its exception is logged), end the requests still open."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(30)
            if not self._loop_thread.is_alive():
                self._loop.close()
        try:
            if hasattr(self.model, "finalize"):
                with bls.running(self, "finalize"):
                    self.model.finalize()
        except (Exception, SystemExit) as e:
            logger.error("python model '%s': finalize failed: %s: %s", self.name,
                         type(e).__name__, e)
        finally:
            with self._lock:
                still_open, self._open = list(self._open.values()), {}
            for sender, r in still_open:
                if sender.close():
                    r.deliver(InferError(f"model '{self.name}' was unloaded", 503), True)
            python_import.unload(self.module)


def _format(e: BaseException) -> list[str]:
    return traceback.format_exception(type(e), e, e.__traceback__)
