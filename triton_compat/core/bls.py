"""Business Logic Scripting: python models calling the server's models (`InferenceRequest.exec`).

Owns: the hook to the running server (`install(get_repository, loop)`, called once at start-up
by api/server.py: the model repository and the asyncio loop the app runs on), running one BLS
request on its target, the iterator of a decoupled call's responses, the model loading API, and
the guard against a call that could never be served.

Flow: `exec()` resolves the target with `ModelRepository.runtime` and submits a
`BackendRequest` to it from the calling thread, as a client request would be (same validation,
queue, batcher and statistics). A one-response call waits on the runtime's future; a decoupled
call gets a `deliver` callback that feeds a `ResponseIterator` (any thread), and returns once
the first response is there, as the python backend does. The LLM (`LLMModel`, whose
`generate` must run on the server's loop) is driven by a coroutine handed to that loop with
`asyncio.run_coroutine_threadsafe`. `async_exec()` does the same without blocking the calling
loop. Failures come back as an `InferenceResponse` with `has_error()`, with Triton's texts
(python_backend src/request_executor.cc): unknown or unready model, a decoupled model called
without `decoupled=True`, invalid inputs, the model's own errors.

Waiting: a call to a model whose instances are all busy waits in that model's queue, as in
Triton. Triton also waits when it can never be served (README "Limitation": a model calling
itself with no instance free "will block on the inference execution forever"); here such a
call, where every instance of the target is itself blocked in a call to that target, returns an
error response at once instead. Calling the LLM from the server's event-loop thread (a python
model run inline by the HTTP route) would block the loop the LLM needs: an error response too.
Reference: python_backend README, "Business Logic Scripting", "Model Loading API".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import queue
import threading
from typing import TYPE_CHECKING

from triton_compat.core import pb_types as pb
from triton_compat.core.backends.base import BackendRequest
from triton_compat.errors import InferError, TritonModelException

if TYPE_CHECKING:
    from triton_compat.core.pb_utils import InferenceRequest

ONLY_IN_EXECUTE = "BLS is only supported during the 'execute' function."
_STATUS_CODES = {400: pb.TritonError.INVALID_ARG, 404: pb.TritonError.NOT_FOUND,
                 501: pb.TritonError.UNSUPPORTED, 503: pb.TritonError.UNAVAILABLE}


class _Server:
    """What `install` was given, and the BLS calls waiting on each runtime."""

    get_repository = None
    loop: asyncio.AbstractEventLoop | None = None
    loop_thread: int | None = None
    pid: int | None = None
    lock = threading.Lock()
    waiting: dict[int, set[int]] = {}    # id(runtime) -> ids of its instances blocked on it


_current = threading.local()     # .backend: the python instance whose code runs on this thread;
                                 # .phase: "initialize" / "finalize" while those run


def install(get_repository, loop: asyncio.AbstractEventLoop) -> None:
    """Give BLS the server's repository (`get_repository()`, None while it loads) and the
    running loop of the app. Call from that loop (api/server.py's lifespan start-up)."""
    _Server.get_repository, _Server.loop = get_repository, loop
    _Server.loop_thread, _Server.pid = threading.get_ident(), os.getpid()


class running:
    """`with running(backend, phase)`: mark this thread as running `backend`'s code (`phase`:
    "initialize" / "finalize", where BLS is refused; None: execute). A class, not a
    generator: it wraps every execution."""

    __slots__ = ("backend", "phase", "saved")

    def __init__(self, backend, phase: str | None = None) -> None:
        self.backend, self.phase = backend, phase

    def __enter__(self) -> None:
        self.saved = getattr(_current, "backend", None), getattr(_current, "phase", None)
        _current.backend, _current.phase = self.backend, self.phase

    def __exit__(self, *_) -> None:
        _current.backend, _current.phase = self.saved


class BLSError(Exception):
    """A call that fails before reaching its model (answered as an error response)."""


def _error_response(e: BaseException) -> pb.InferenceResponse:
    if isinstance(e, InferError):
        code = pb.TritonError.ALREADY_EXISTS if e.code == "ALREADY_EXISTS" else \
            _STATUS_CODES.get(e.status, pb.TritonError.INTERNAL)
        return pb.InferenceResponse(error=pb.TritonError(e.message, code))
    message = str(e) if isinstance(e, BLSError) else f"{type(e).__name__}: {e}"
    return pb.InferenceResponse(error=pb.TritonError(message))


def _response(result, wanted: list[str]) -> pb.InferenceResponse:
    """A response from a runtime's result: outputs (only those asked for, when named), None
    (a flag-only final response: no outputs), or an exception (an error response)."""
    if isinstance(result, BaseException):
        return _error_response(result)
    tensors = [pb.Tensor(n, a) for n, a in (result or {}).items() if not wanted or n in wanted]
    return pb.InferenceResponse(tensors)


class ResponseIterator:
    """The responses of a decoupled BLS call, as they arrive, ending after the final one (an
    empty response when the model sent the final flag alone). Iterating again after the end
    starts over from the first response; `next` after the end raises StopIteration (the
    python backend's ResponseIterator). Dropping it before the end cancels an LLM call."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._seen: list = []
        self._index, self._finished, self._ended = 0, False, False
        self._lock = threading.Lock()
        self.first: concurrent.futures.Future = concurrent.futures.Future()
        self.cancel = None

    def put(self, response: pb.InferenceResponse, final: bool) -> None:
        """Add a response (any thread); ignored after the final one."""
        with self._lock:
            if self._ended:
                return
            self._ended = final
        self._queue.put((response, final))
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self.first.set_result(None)

    def __iter__(self) -> "ResponseIterator":
        if self._finished and self._index >= len(self._seen):
            self._index = 0
        return self

    def __next__(self) -> pb.InferenceResponse:
        if self._index < len(self._seen):
            self._index += 1
            return self._seen[self._index - 1]
        if self._finished:
            raise StopIteration
        response, self._finished = self._queue.get()
        self._seen.append(response)
        self._index += 1
        return response

    def __del__(self) -> None:
        if not self._ended and self.cancel is not None:
            self.cancel()


@contextlib.contextmanager
def _waiting_on(target):
    """Register the calling instance as blocked on `target` for the duration; raise BLSError
    when every instance of `target` would then be blocked on it (the call can never run)."""
    caller, instances = getattr(_current, "backend", None), getattr(target, "instances", ())
    ids = {id(i) for i in instances}
    if caller is None or id(caller) not in ids:
        yield
        return
    with _Server.lock:
        waiting = _Server.waiting.setdefault(id(target), set())
        if ids <= waiting | {id(caller)}:
            raise BLSError(f"every instance of model '{target.config.name}' ({len(ids)}) is "
                           "waiting for a BLS request to that model: the request could never "
                           "run (Triton blocks here forever; add instances to "
                           "instance_group, or use a decoupled model with async execute)")
        waiting.add(id(caller))
    try:
        yield
    finally:
        with _Server.lock:
            waiting.discard(id(caller))


def _target(request: InferenceRequest, decoupled: bool):
    """(runtime or LLM model, BackendRequest, datatypes, timeout µs). Raises BLSError with
    Triton's texts, or TritonModelException where the python backend raises."""
    if getattr(_current, "phase", None) is not None:
        raise TritonModelException(ONLY_IN_EXECUTE)
    name, version = request.model_target()
    if _Server.get_repository is None or os.getpid() != _Server.pid:
        raise BLSError(f"Model {name} - BLS is not available here: the model is not running "
                       "in the server's process")
    repository = _Server.get_repository()
    try:
        if repository is None:
            raise InferError("the model repository is loading", 503)
        target = repository.runtime(name, None if version in (-1, None) else version)
    except InferError:
        raise BLSError(f"Model {name} - Error when running inference: Failed for execute "
                       f"the inference request. Model '{name}' is not ready.") from None
    if target.decoupled and not decoupled:
        raise BLSError(f"Model {name} - Error when running inference: Model {name} is using "
                       "the decoupled. The current BLS request call doesn't support models "
                       "using the decoupled transaction policy. Please use 'decoupled=True' "
                       "argument to the 'exec' or 'async_exec' calls for decoupled models.'")
    inputs = {t.name(): pb.array_of(t) for t in request.inputs()}
    datatypes = {n: pb.wire_datatype(a) for n, a in inputs.items()}
    params = json.loads(request.parameters())
    if request.correlation_id() not in (0, ""):
        params["sequence_id"] = request.correlation_id()
    if request.flags():
        flags = request.flags()
        params["sequence_start"] = bool(flags & pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START)
        params["sequence_end"] = bool(flags & pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END)
    if request.timeout():
        params["timeout"] = request.timeout()
    backend_request = BackendRequest(inputs, list(request.requested_output_names()),
                                     request.request_id(), params)
    return target, backend_request, datatypes, request.timeout() or None


def _submit(target, backend_request: BackendRequest, datatypes: dict, timeout):
    """`target.submit`, its refusals (bad inputs, full queue) as Triton words them."""
    try:
        return target.submit(backend_request, datatypes, 0, timeout)
    except InferError as e:
        raise BLSError(f"Model {target.config.name} - Error when running inference: "
                       f"{e.message}") from None


def _is_llm(target) -> bool:
    from triton_compat.core.llm_model import LLMModel
    return isinstance(target, LLMModel)


def _stream(target, backend_request: BackendRequest, datatypes: dict, timeout,
            on_loop: bool) -> ResponseIterator:
    """Start a decoupled call (or a one-response model called with decoupled=True); its
    responses go to the iterator returned."""
    it, wanted = ResponseIterator(), backend_request.outputs
    if _is_llm(target):
        pump = _pump(target, backend_request, datatypes, it)
        if on_loop:
            task = _Server.loop.create_task(pump)
            it.cancel = task.cancel
        else:
            it.cancel = asyncio.run_coroutine_threadsafe(pump, _Server.loop).cancel
        return it
    if target.decoupled:
        backend_request.deliver = lambda result, final: it.put(_response(result, wanted), final)

    def done(f: concurrent.futures.Future) -> None:    # failed, or a one-response model
        if f.cancelled() or f.exception() is not None:
            it.put(_error_response(f.exception() if not f.cancelled() else
                                   InferError("the request was cancelled", 500)), True)
        elif backend_request.deliver is None:
            it.put(_response(f.result(), wanted), True)

    _submit(target, backend_request, datatypes, timeout).add_done_callback(done)
    return it


async def _pump(model, backend_request: BackendRequest, datatypes: dict,
                it: ResponseIterator) -> None:
    """Run the LLM's `generate` on the server loop, feeding `it`."""
    try:
        async for outputs, final in model.generate(backend_request.inputs, backend_request.id,
                                                    datatypes):
            it.put(_response(outputs, backend_request.outputs), final)
            if final:
                return
        it.put(pb.InferenceResponse(), True)
    except asyncio.CancelledError:
        it.put(_error_response(InferError("the request was cancelled", 500)), True)
        raise
    except Exception as e:
        it.put(_error_response(e), True)


def run(request: InferenceRequest, decoupled: bool = False):
    """`InferenceRequest.exec`: an InferenceResponse, or a ResponseIterator with
    `decoupled=True` (returned once the first response is there)."""
    try:
        target, backend_request, datatypes, timeout = _target(request, decoupled)
        if _is_llm(target) and threading.get_ident() == _Server.loop_thread:
            raise BLSError(f"Model {target.name} - a blocking BLS call to the LLM from the "
                           "server's event-loop thread would never return: use async_exec")
        with _waiting_on(target):
            if decoupled:
                it = _stream(target, backend_request, datatypes, timeout, False)
                it.first.result()
                return it
            future = _submit(target, backend_request, datatypes, timeout)
            try:
                return _response(future.result(), [])
            except Exception as e:
                return _error_response(e)
    except BLSError as e:
        return _single(_error_response(e), decoupled)


def _single(response: pb.InferenceResponse, decoupled: bool):
    if not decoupled:
        return response
    it = ResponseIterator()
    it.put(response, True)
    return it


def run_async(request: InferenceRequest, decoupled: bool = False) -> asyncio.Future:
    """`InferenceRequest.async_exec`: a future on the running loop (started at once) of what
    `run` returns. Raises RuntimeError when no loop runs in this thread."""
    loop = asyncio.get_running_loop()
    try:
        target, backend_request, datatypes, timeout = _target(request, decoupled)
        if decoupled:
            it = _stream(target, backend_request, datatypes, timeout, loop is _Server.loop)
        else:
            future = _submit(target, backend_request, datatypes, timeout)
    except BLSError as e:
        result = loop.create_future()
        result.set_result(_single(_error_response(e), decoupled))
        return result

    async def wait():
        if decoupled:
            await asyncio.wrap_future(it.first)
            return it
        try:
            return _response(await asyncio.wrap_future(future), [])
        except Exception as e:
            return _error_response(e)

    return asyncio.ensure_future(wait())


def _repository():
    repository = _Server.get_repository() if _Server.get_repository else None
    if repository is None:
        raise TritonModelException("the model repository is not available")
    return repository


def load_model(model_name: str, config: str = "", files: dict | None = None) -> None:
    """`pb_utils.load_model`: load or reload a repository model (`config`: its configuration
    as JSON). Needs `--model-control-mode explicit`. Raises TritonModelException (control
    mode none, unknown model, load failure, `files`)."""
    name = model_name
    if files:
        raise TritonModelException("load_model: 'files' (override model files) is not "
                                      "supported; put the files in the model repository")
    try:
        _repository().load(name, config or None)
    except InferError as e:
        raise TritonModelException(e.message) from None


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    """`pb_utils.unload_model`. Raises TritonModelException."""
    try:
        _repository().unload(model_name)
    except InferError as e:
        raise TritonModelException(e.message) from None


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    """`pb_utils.is_model_ready`: whether the model (at `model_version`; '' the latest) is
    loaded and ready."""
    try:
        _repository().runtime(model_name, model_version or None)
        return True
    except (InferError, TritonModelException):
        return False
