"""Asynchronous front of the engine: the engine loop in the background, streams for asyncio.

Owns: one asyncio queue per request and the loop that steps the engine. Two interchangeable
back-ends share the stream bookkeeping (`_StreamRouter`):

- `AsyncLLM` (the default): the engine loop runs in a background thread of this process. Torch
  releases the GIL inside its kernels, so the event loop (HTTP, SSE) runs during the forward
  pass.
- `ProcessAsyncLLM`: the engine runs in a child process (its own GIL); commands and
  `RequestOutput`s cross a pipe, pickled. `benchmarks/async_bench.py` compares the two.

Errors: `add_request` errors (too long, queue full, bad token id) are raised to the caller of
`generate` before any output. A request that fails during a step ends its own stream with
`RequestFailedError`; the engine and the other requests go on. A consumer that stops iterating
(client disconnect, cancellation) aborts its request; its blocks are freed at the next step
boundary.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future, InvalidStateError

from engine.config import EngineConfig
from engine.distributed.parallel import TensorParallelError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from scheduler.request import QueueFullError, SamplingParams

logger = logging.getLogger("continuum.async")


class RequestFailedError(RuntimeError):
    """The request failed inside the engine (it alone); the message says why."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class _StreamRouter:
    """Per-request asyncio queues fed from a background thread; `generate` and `abort`."""

    def __init__(self, config: EngineConfig) -> None:
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.dead_error: BaseException | None = None
        # Requests the engine can hold (running + waiting): past it `generate` refuses at once,
        # without a round trip to the engine, which reads commands only between steps.
        self.capacity = config.max_num_seqs + config.max_waiting_requests

    def _submit_add(self, args: tuple, fut: Future) -> None:
        raise NotImplementedError

    def _submit_abort(self, request_id: str) -> None:
        raise NotImplementedError

    def abort_all(self) -> None:
        """Abort every request the engine holds (a server shutting down): each stream ends with
        a last output whose unfinished choices have finish_reason "abort". Any thread."""
        raise NotImplementedError

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams (called from a background thread)."""
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

    def _fail_all(self, error: BaseException) -> None:
        """The engine is gone: later `generate` calls raise EngineDeadError, and every stream
        in flight ends with RequestFailedError."""
        self.dead_error = error
        for loop, q in list(self._streams.values()):
            loop.call_soon_threadsafe(q.put_nowait, RequestFailedError(f"{error}"))

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream `RequestOutput` deltas until the request finishes.

        Raises (before the first output): whatever `LLMEngine.add_request` raises;
        QueueFullError at once if `capacity` requests are in flight; EngineDeadError if the
        loop is gone. Later: RequestFailedError if the request fails.
        """
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine is not running: {self.dead_error}")
        self.check_capacity()
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        fut: Future = Future()
        self._submit_add((request_id, list(prompt_token_ids), params, None, priority), fut)
        try:
            await asyncio.wrap_future(fut)
        except BaseException as e:
            self._streams.pop(request_id, None)
            if isinstance(e, asyncio.CancelledError):   # the client left before the engine
                self._submit_abort(request_id)         # acknowledged: abort (after the add)
            raise
        finished = False
        try:
            while True:
                out = await q.get()
                if isinstance(out, Exception):
                    finished = True
                    self._streams.pop(request_id, None)
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

    def check_capacity(self) -> None:
        """Raise QueueFullError if `capacity` requests are in flight (cheap: a server calls it
        before parsing a request, so that refusals cost next to nothing under overload)."""
        if len(self._streams) >= self.capacity:
            raise QueueFullError(f"the queue is full: the server holds {self.capacity} requests "
                                 "(--max-num-seqs + --max-waiting-requests); retry later")

    def abort(self, request_id: str) -> None:
        """Abort a request (any state); safe to call from any thread, idempotent."""
        self._streams.pop(request_id, None)
        self._submit_abort(request_id)


class AsyncLLM(_StreamRouter):
    """The engine loop in a background thread of this process (see the module docstring)."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine.config)
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="continuum-engine", daemon=True)
        self._thread.start()

    def _submit_add(self, args: tuple, fut: Future) -> None:
        self._inbox.put(("add", (args, fut)))

    def _submit_abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def abort_all(self) -> None:
        self._inbox.put(("abort_all", None))

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain_inbox(block=not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
        except BaseException as e:      # a bug: report it to every waiting stream
            logger.exception("engine loop died")
            self._fail_all(e)

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                kind, payload = (self._inbox.get(timeout=0.5) if block
                                 else self._inbox.get_nowait())
            except queue.Empty:
                return
            block = False
            if kind == "add":
                args, fut = payload
                try:
                    self.engine.add_request(*args)
                    _resolve(fut, None)
                except Exception as e:
                    _resolve(fut, e)
            elif kind == "abort":
                self.engine.abort_request(payload)
            elif kind == "abort_all":
                self._dispatch(self.engine.abort_all())
            elif kind == "stop":
                return

    @property
    def is_alive(self) -> bool:
        """Whether the engine loop is running and has not died."""
        return self._thread.is_alive() and self.dead_error is None

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the loop after the current step (pending requests are dropped)."""
        self._stopped.set()
        self._inbox.put(("stop", None))
        self._thread.join(timeout)


def engine_snapshot(engine: LLMEngine, step_cost: bool = True) -> dict:
    """Scheduler gauges and cumulative counters, for the metrics layer; with `step_cost`, the
    fitted step-cost model too (a least-squares fit, ~70 us, when no scheduler rule has
    fitted this step's window already)."""
    s = engine.scheduler
    snapshot = {"num_running": s.num_running, "num_waiting": s.num_waiting,
                "num_swapped": s.num_swapped, "kv_cache_usage": s.kv.usage(),
                "cpu_kv_cache_usage": s.kv.cpu_pool.usage() if s.kv.cpu_pool is not None
                else 0.0,
                "prefill_budget": s.prefill_budget,
                "counters": dataclasses.asdict(s.counters),
                "spec_decode": (dataclasses.asdict(s.spec_counters)
                                if s.config.num_speculative_tokens else None)}
    if step_cost:
        snapshot["step_cost"] = s.latency.coefficients()
    return snapshot


def engine_info(engine: LLMEngine) -> dict:
    """What the API layer needs to know about the loaded engine."""
    return {"model_dir": str(engine.model_dir), "max_model_len": engine.max_model_len,
            "vocab_size": engine.model_config.vocab_size, "load_time": engine.load_time,
            "architecture": engine.model_config.architecture, "dtype": str(engine.dtype),
            "device": engine.device.kind}


def _engine_core_main(config: EngineConfig, conn) -> None:
    """Child process of `ProcessAsyncLLM`: build the engine, then serve commands and step.

    Messages to the parent: ("ready", info) once; ("added", id) / ("add_error", (id, exc));
    ("outputs", (outputs, step_stats, snapshot)) per step and after "abort_all";
    ("stats", ([], [], snapshot)) after commands that changed state without a step (aborts).
    """
    if not logging.getLogger().handlers:     # a spawned child starts without logging config
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # A terminal's Ctrl-C reaches the whole process group: the parent owns shutdown (it sends
    # "stop", or terminates this process), so the child does not die mid-step on SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _engine_core_loop(config, conn)
    except (EOFError, BrokenPipeError):     # the parent is gone: nothing left to serve
        return


def _rank_died(message: str) -> None:
    """A tensor-parallel rank died (the engine logged it): this process exits at once, which
    the parent's reader sees as the engine dying (every stream fails, the server exits)."""
    os._exit(1)


def _engine_core_loop(config: EngineConfig, conn) -> None:
    """Build the engine, then serve commands and step until "stop" (see `_engine_core_main`).
    Sends ("dead", message) and returns if the engine cannot start or must stop."""
    try:
        engine = LLMEngine(config, on_fatal=_rank_died)
    except BaseException as e:
        conn.send(("dead", f"{type(e).__name__}: {e}"))
        return
    try:
        _serve(engine, conn)
    except TensorParallelError as e:
        logger.error("engine stopped: %s", e)
        conn.send(("dead", str(e)))
    finally:
        engine.shutdown()


def _serve(engine: LLMEngine, conn) -> None:
    """Serve commands and step until "stop"."""
    step_stats: list = []
    next_cost = 0.0                         # monotonic time of the next step-cost refit
    engine.stat_loggers.append(step_stats.append)
    conn.send(("ready", engine_info(engine)))
    while True:
        if not engine.has_unfinished_requests():
            conn.poll(None)
        aborted = False
        while conn.poll(0):
            kind, payload = conn.recv()
            if kind == "add":
                try:
                    engine.add_request(*payload)
                    conn.send(("added", payload[0]))
                except Exception as e:
                    conn.send(("add_error", (payload[0], e)))
            elif kind == "abort":
                engine.abort_request(payload)
                aborted = True
            elif kind == "abort_all":
                conn.send(("outputs", (engine.abort_all(), [], engine_snapshot(engine))))
            elif kind == "stop":
                return
        if engine.has_unfinished_requests():
            outputs = engine.step()
            # The step-cost gauge: refitted once a second, and at the last step before idle.
            now = time.monotonic()
            with_cost = now >= next_cost or not engine.has_unfinished_requests()
            if with_cost:
                next_cost = now + 1.0
            conn.send(("outputs", (outputs, list(step_stats),
                                   engine_snapshot(engine, with_cost))))
            step_stats.clear()
        elif aborted:
            conn.send(("stats", ([], [], engine_snapshot(engine))))


class ProcessAsyncLLM(_StreamRouter):
    """The engine in a child process (spawned; it loads the model itself)."""

    def __init__(self, config: EngineConfig, start_timeout: float = 600.0,
                 on_stats=None, on_dead=None) -> None:
        """Starts the child and waits until its engine is loaded.

        `on_stats(step_stats, snapshot)` is called from the reader thread after every step and
        after aborts; `on_dead(message)` once from the reader thread if the engine process
        exits without `shutdown()` (killed, out of memory), after every stream has failed.
        Raises EngineDeadError if the engine cannot start (message says why).
        """
        super().__init__(config)
        self.on_stats, self.on_dead = on_stats, on_dead
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._send_lock = threading.Lock()
        self._pending: dict[str, Future] = {}
        self._stopping = False           # set by shutdown(): the pipe closing is then expected
        self._proc = ctx.Process(target=_engine_core_main, args=(config, child),
                                 name="continuum-engine-core", daemon=True)
        self._proc.start()
        if not self._conn.poll(start_timeout):
            raise EngineDeadError("engine process did not start in time")
        try:
            kind, detail = self._conn.recv()
        except EOFError:                   # it exited without a word (killed, os._exit)
            self._proc.join(5)
            raise EngineDeadError("engine process exited during start (exit code "
                                  f"{self._proc.exitcode})") from None
        if kind != "ready":
            self._proc.join(5)
            raise EngineDeadError(f"engine process failed to start: {detail}")
        self.info: dict = detail
        self._reader = threading.Thread(target=self._read, name="continuum-engine-reader",
                                        daemon=True)
        self._reader.start()

    def _fail_all(self, error: BaseException) -> None:
        super()._fail_all(error)
        for rid in list(self._pending):        # adds the engine never acknowledged
            fut = self._pending.pop(rid, None)
            if fut is not None:
                _resolve(fut, EngineDeadError(f"the engine is not running: {error}"))

    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def _submit_add(self, args: tuple, fut: Future) -> None:
        self._pending[args[0]] = fut
        try:
            self._send(("add", args))
        except OSError as e:          # the engine process is gone
            self._pending.pop(args[0], None)
            fut.set_exception(EngineDeadError(f"the engine is not running: {e}"))

    def _submit_abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except OSError:             # the engine is gone: nothing left to abort
            pass

    def abort_all(self) -> None:
        try:
            self._send(("abort_all", None))
        except OSError:             # the engine is gone: its streams have failed already
            pass

    def _read(self) -> None:
        reason = None
        try:
            while True:
                kind, payload = self._conn.recv()
                if kind in ("outputs", "stats"):
                    outputs, step_stats, snapshot = payload
                    self._dispatch(outputs)
                    if self.on_stats is not None:
                        self.on_stats(step_stats, snapshot)
                elif kind == "added":
                    _resolve(self._pending.pop(payload), None)
                elif kind == "add_error":
                    rid, err = payload
                    _resolve(self._pending.pop(rid), err)
                elif kind == "dead":            # it stopped itself and says why
                    reason = payload
        except (EOFError, OSError):       # the pipe closed: shutdown, or the child died
            if self._stopping:
                self._fail_all(EngineDeadError("the engine was shut down"))
                return
            self._proc.join(1)
            message = (f"engine stopped: {reason}" if reason else
                       f"engine process exited unexpectedly (exit code {self._proc.exitcode})")
            logger.error("%s", message)
            self._fail_all(EngineDeadError(message))
            if self.on_dead is not None:
                self.on_dead(message)
        except BaseException as e:      # a bug: say where, and never hang the streams
            logger.exception("engine reader stopped")
            self._fail_all(e)

    @property
    def is_alive(self) -> bool:
        """Whether the engine loop is running and has not died."""
        return self._proc.is_alive() and self.dead_error is None

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine process (terminated if it does not exit within `timeout` seconds)."""
        self._stopping = True
        try:
            self._send(("stop", None))
        except OSError:
            pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.terminate()


def _resolve(fut: Future, error: BaseException | None) -> None:
    """Settle an add's future unless its waiter has gone (cancelled: the client left)."""
    try:
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)
    except InvalidStateError:
        pass


def _deliver(items: list) -> None:
    for q, out in items:
        q.put_nowait(out)
