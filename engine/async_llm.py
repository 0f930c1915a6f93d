"""`AsyncLLM`: the engine loop in a background thread, streams per request for asyncio callers.

Owns: the engine thread, the inbox of commands from the event loop (add, abort), and one
asyncio queue per request. The engine thread drains the inbox, steps the engine while work is
pending, and hands each step's `RequestOutput`s to the event loop in one call. Torch releases the
GIL inside its kernels, so the event loop (HTTP, SSE) keeps running during the forward pass.

Errors: `add_request` errors (too long, queue full, bad token id) are raised to the caller of
`generate` before any output. A request that fails during a step ends its own stream with
`RequestFailedError`; the engine and the other requests go on. A consumer that stops iterating
(client disconnect, cancellation) aborts its request; its blocks are freed at the next step
boundary.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from scheduler.request import SamplingParams

logger = logging.getLogger("continuum.async")


class RequestFailedError(RuntimeError):
    """The request failed inside the engine (it alone); the message says why."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class AsyncLLM:
    """Thread-backed asynchronous front of an `LLMEngine` (see the module docstring)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = threading.Event()
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="continuum-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                block = not self.engine.has_unfinished_requests()
                self._drain_inbox(block)
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
        except BaseException as e:      # a bug: report it to every waiting stream
            logger.exception("engine loop died")
            self.dead_error = e
            for loop, q in list(self._streams.values()):
                loop.call_soon_threadsafe(q.put_nowait, EngineDeadError(f"engine loop died: {e}"))

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            kind, payload = cmd
            if kind == "add":
                args, fut = payload
                try:
                    self.engine.add_request(*args)
                    fut.set_result(None)
                except Exception as e:
                    self._streams.pop(args[0], None)
                    fut.set_exception(e)
            elif kind == "abort":
                self.engine.abort_request(payload)
            elif kind == "stop":
                return

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)

    # ------------------------------------------------------------------ event-loop side
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream `RequestOutput` deltas until the request finishes.

        Raises (before the first output): whatever `LLMEngine.add_request` raises;
        EngineDeadError if the loop is gone. Later: RequestFailedError if the request fails.
        """
        if self.dead_error is not None or self._stopped.is_set():
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        fut: Future = Future()
        self._inbox.put(("add", ((request_id, prompt_token_ids, params, None, priority), fut)))
        await asyncio.wrap_future(fut)
        finished = False
        try:
            while True:
                out = await q.get()
                if isinstance(out, Exception):
                    finished = True
                    raise out
                if out.error is not None:
                    finished = True
                    raise RequestFailedError(out.error)
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (any state); safe to call from any thread, idempotent."""
        self._streams.pop(request_id, None)
        self._inbox.put(("abort", [request_id]))

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.dead_error is None

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the loop after the current step (pending requests are dropped)."""
        self._stopped.set()
        self._inbox.put(("stop", None))
        self._thread.join(timeout)


def _deliver(items: list) -> None:
    for q, out in items:
        q.put_nowait(out)
