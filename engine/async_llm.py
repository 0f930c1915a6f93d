"""Asynchronous front of the engine: the engine loop in the background, streams for asyncio.

Owns: one asyncio queue per request, and `EngineCore`, the one command loop that steps the
engine: it takes add / abort / abort_all / stop commands between steps, steps while requests
are unfinished, and emits ("added" | "add_error" | "outputs" | "stats", payload) messages. Two
interchangeable back-ends carry the commands and messages, and share the stream bookkeeping
and the handling of those messages (`_StreamRouter`):

- `AsyncLLM` (in-process use): the core runs in a background thread of this process; commands
  cross a queue and messages are handled as they are emitted. Torch releases the GIL inside its
  kernels, so the event loop (HTTP, SSE) runs during the forward pass.
- `ProcessAsyncLLM` (the server): the core runs in a child process (its own GIL); commands and
  messages cross a pipe, pickled. `benchmarks/async_bench.py` compares the two.

Errors: `add_request` errors (too long, queue full, bad token id) are raised to the caller of
`generate` before any output. A request that fails during a step ends its own stream with
`RequestFailedError`; the engine and the other requests go on. A consumer that stops iterating
(client disconnect, cancellation) aborts its request; its blocks are freed at the next step
boundary.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future, InvalidStateError

from engine.config import EngineConfig
from engine.device import freeze_heap, trim_heap
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

    def __init__(self, config: EngineConfig, on_stats=None) -> None:
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._pending: dict[str, Future] = {}      # adds the core has not acknowledged yet
        self.dead_error: BaseException | None = None
        self.on_stats = on_stats
        # Requests the engine can hold (running + waiting): past it `generate` refuses at once,
        # without a round trip to the engine, which reads commands only between steps.
        self.capacity = config.max_num_seqs + config.max_waiting_requests

    def _command(self, kind: str, payload) -> None:
        """Send a command to the core. Raises OSError when the core is gone."""
        raise NotImplementedError

    def _submit_add(self, args: tuple, fut: Future, kind: str = "add") -> None:
        self._pending[args[0]] = fut
        try:
            self._command(kind, args)
        except OSError as e:          # the engine is gone
            self._pending.pop(args[0], None)
            _resolve(fut, EngineDeadError(f"the engine is not running: {e}"))

    async def lora(self, op: str, *args) -> None:
        """Run `LLMEngine.{op}_lora(*args)` in the engine between steps ("add": name, path;
        "remove": name). Raises what it raises (`engine.lora.adapter.LoraError`)."""
        fut: Future = Future()
        self._submit_add((f"lora-{uuid.uuid4().hex}", op, args), fut, "lora")
        await asyncio.wrap_future(fut)

    def _submit_abort(self, request_id: str) -> None:
        try:
            self._command("abort", request_id)
        except OSError:             # the engine is gone: nothing left to abort
            pass

    def abort_all(self) -> None:
        """Abort every request the engine holds (a server shutting down): each stream ends with
        a last output whose unfinished choices have finish_reason "abort". Any thread."""
        try:
            self._command("abort_all", None)
        except OSError:             # the engine is gone: its streams have failed already
            pass

    def _on_message(self, kind: str, payload) -> None:
        """A message of the core (`EngineCore`): outputs to their streams, stats to
        `on_stats(step_stats, snapshot)`, an add's acknowledgement to its waiter."""
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
        """The engine is gone: later `generate` calls raise EngineDeadError, every stream in
        flight ends with RequestFailedError, and adds it never acknowledged fail."""
        self.dead_error = error
        for loop, q in list(self._streams.values()):
            loop.call_soon_threadsafe(q.put_nowait, RequestFailedError(f"{error}"))
        for rid in list(self._pending):
            fut = self._pending.pop(rid, None)
            if fut is not None:
                _resolve(fut, EngineDeadError(f"the engine is not running: {error}"))

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


class _QueueCommands:
    """`EngineCore`'s command source over a `queue.SimpleQueue` (the thread back-end)."""

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._next = None

    def wait(self) -> None:
        """Block until a command is there."""
        if self._next is None:
            self._next = self.inbox.get()

    def poll(self) -> bool:
        """Whether a command is there now."""
        if self._next is None:
            try:
                self._next = self.inbox.get_nowait()
            except queue.Empty:
                return False
        return True

    def recv(self) -> tuple:
        """The next command (after `poll` said there is one)."""
        item, self._next = self._next, None
        return item


class AsyncLLM(_StreamRouter):
    """The engine's `EngineCore` in a background thread of this process (see the module
    docstring)."""

    def __init__(self, engine: LLMEngine, on_stats=None) -> None:
        super().__init__(engine.config, on_stats)
        self.engine = engine
        self._commands = _QueueCommands()
        self._thread = threading.Thread(target=self._run, name="continuum-engine", daemon=True)
        self._thread.start()

    def _command(self, kind: str, payload) -> None:
        self._commands.inbox.put((kind, payload))

    def _run(self) -> None:
        try:
            EngineCore(self.engine, self._on_message).run(self._commands)
        except BaseException as e:      # a bug: report it to every waiting stream
            logger.exception("engine loop died")
            self._fail_all(e)

    @property
    def is_alive(self) -> bool:
        """Whether the engine loop is running and has not died."""
        return self._thread.is_alive() and self.dead_error is None

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the loop after the current step (pending requests are dropped)."""
        self._command("stop", None)
        self._thread.join(timeout)


class EngineCore:
    """The engine's command loop, whatever carries commands and messages: add / abort /
    abort_all / stop are taken between steps; while requests are unfinished, the engine steps
    and its outputs go out with the step's stats and a scheduler snapshot.

    `emit(kind, payload)`: ("added", request id) / ("add_error", (request id, exception)) per
    add; ("outputs", (outputs, step_stats, snapshot)) per step and after "abort_all";
    ("stats", ([], [], snapshot)) after aborts that changed state without a step. The step-cost
    gauge in the snapshot is refitted once a second and at the last step before idle."""

    def __init__(self, engine: LLMEngine, emit) -> None:
        self.engine, self.emit = engine, emit
        self.step_stats: list = []
        self.next_cost = 0.0                  # monotonic time of the next step-cost refit
        engine.stat_loggers.append(self.step_stats.append)

    def run(self, commands) -> None:
        """Serve `commands` (`wait()` blocks until one is there, `poll()` says whether one is,
        `recv()` takes it) and step until "stop"."""
        engine, busy = self.engine, False
        while True:
            if not engine.has_unfinished_requests():
                if busy:                      # idle now: the burst's freed memory goes back
                    trim_heap()
                commands.wait()
            aborted = False
            while commands.poll():
                kind, payload = commands.recv()
                if kind == "stop":
                    return
                aborted = self.handle(kind, payload) or aborted
            busy = engine.has_unfinished_requests()
            if busy:
                self.step()
            elif aborted:
                self.emit("stats", ([], [], engine_snapshot(engine)))

    def handle(self, kind: str, payload) -> bool:
        """One command other than stop; True for an abort (its state goes out after)."""
        engine = self.engine
        if kind == "add":
            try:
                engine.add_request(*payload)
                self.emit("added", payload[0])
            except Exception as e:
                self.emit("add_error", (payload[0], e))
        elif kind == "lora":                 # runtime LoRA adapter (un)loading
            call_id, op, args = payload
            try:
                getattr(engine, f"{op}_lora")(*args)
                self.emit("added", call_id)
            except Exception as e:
                self.emit("add_error", (call_id, e))
        elif kind == "abort":
            engine.abort_request(payload)
            return True
        elif kind == "abort_all":
            self.emit("outputs", (engine.abort_all(), [], engine_snapshot(engine)))
        return False

    def step(self) -> None:
        """One engine step; its outputs, stats and snapshot go out."""
        engine = self.engine
        outputs = engine.step()
        now = time.monotonic()
        with_cost = now >= self.next_cost or not engine.has_unfinished_requests()
        if with_cost:
            self.next_cost = now + 1.0
        self.emit("outputs", (outputs, list(self.step_stats),
                              engine_snapshot(engine, with_cost)))
        self.step_stats.clear()


def engine_snapshot(engine: LLMEngine, step_cost: bool = True) -> dict:
    """What the metrics layer reads of the engine: the scheduler's snapshot
    (`Scheduler.snapshot`: request counts, KV usage, prefill budget, counters; with
    `step_cost`, the fitted step-cost model), and with LoRA on, `lora`: the adapters loaded,
    `max_loras`, and the adapters of the running and the waiting requests (vLLM's
    `lora_requests_info`)."""
    snapshot = engine.scheduler.snapshot(step_cost)
    if engine.lora is not None:
        sched = engine.scheduler
        snapshot["lora"] = {
            "loaded": len(engine.lora.paths), "max_loras": engine.config.max_loras,
            "running": sorted({r.sampling_params.lora_name for r in sched.running} - {None}),
            "waiting": sorted({r.sampling_params.lora_name for _, r in sched.waiting} - {None})}
    return snapshot


def engine_info(engine: LLMEngine) -> dict:
    """What the API layer needs to know about the loaded engine."""
    return {"model_dir": str(engine.model_dir), "max_model_len": engine.max_model_len,
            "vocab_size": engine.model_config.vocab_size, "load_time": engine.load_time,
            "architecture": engine.model_config.architecture, "dtype": str(engine.dtype),
            "device": engine.device.kind}


def _engine_core_main(config: EngineConfig, conn) -> None:
    """Child process of `ProcessAsyncLLM`: build the engine, then run its `EngineCore` over the
    pipe. Sends ("ready", info) once, then the core's messages; ("dead", message) if the engine
    cannot start or must stop."""
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


class _PipeCommands:
    """`EngineCore`'s command source over the child's end of the pipe."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def wait(self) -> None:
        """Block until a command is there."""
        self.conn.poll(None)

    def poll(self) -> bool:
        """Whether a command is there now."""
        return self.conn.poll(0)

    def recv(self) -> tuple:
        """The next command."""
        return self.conn.recv()


def _engine_core_loop(config: EngineConfig, conn) -> None:
    """Build the engine, then run its core until "stop" (see `_engine_core_main`)."""
    try:
        engine = LLMEngine(config, on_fatal=_rank_died)
    except BaseException as e:
        conn.send(("dead", f"{type(e).__name__}: {e}"))
        return
    freeze_heap()                   # a full collection over the built engine: a 226 ms stall
    try:
        conn.send(("ready", engine_info(engine)))
        EngineCore(engine, lambda kind, payload: conn.send((kind, payload))).run(
            _PipeCommands(conn))
    except TensorParallelError as e:
        logger.error("engine stopped: %s", e)
        conn.send(("dead", str(e)))
    finally:
        engine.shutdown()


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
        super().__init__(config, on_stats)
        self.on_dead = on_dead
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._send_lock = threading.Lock()
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

    def _command(self, kind: str, payload) -> None:
        with self._send_lock:
            self._conn.send((kind, payload))

    def _read(self) -> None:
        reason = None
        try:
            while True:
                kind, payload = self._conn.recv()
                if kind == "dead":              # it stopped itself and says why
                    reason = payload
                else:
                    self._on_message(kind, payload)
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
            self._command("stop", None)
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
