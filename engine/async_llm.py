"""Asynchronous front of the engine: the engine core's loop in the background, streams for asyncio.

Owns: one asyncio queue per request, and the front end's `OutputProcessor` (detokenization,
stop strings, `RequestOutput` deltas: the engine core only schedules and runs the model). The
core's loop (`engine.core_proc.EngineCoreProc`) takes typed commands (`engine.messages`) between
steps and emits typed messages; two interchangeable back ends carry them, and share the stream
bookkeeping and the handling of those messages (`_StreamRouter`):

- `AsyncLLM` (in-process use): the core runs in a background thread of this process; commands
  cross a queue and messages are handled as they are emitted. Torch releases the GIL inside its
  kernels, so the event loop (HTTP, SSE) runs during the forward pass.
- `ProcessAsyncLLM` (the server): the core runs in a child process (its own GIL); commands and
  messages cross a pipe, pickled, and the outputs are detokenized here, by the pipe's reader:
  a callback of the server's event loop (`reader_loop`), or else a reader thread.
  `benchmarks/async_bench.py` compares the two.

Errors: `add_request` errors (too long, queue full, bad token id) are raised to the caller of
`generate` before any output. A request that fails during a step ends its own stream with
`RequestFailedError`; the engine and the other requests go on. A consumer that stops iterating
(client disconnect, cancellation) aborts its request; its blocks are freed at the next step
boundary. A stop string found here finishes its sequence in the core at its next step boundary
(the core may compute a token or two past it; they are dropped here).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.messages import (AbortAll, AbortRequests, Acknowledged, AddRequest, Dead,
                             FinishSequences, FlagsChecked, LoraAdapters, LoraCall, Ready,
                             Stop)
from engine.output_processor import OutputProcessor
from engine.outputs import EngineCoreOutputs, RequestOutput
from engine.tokenizer import load_tokenizer
from scheduler.futures import settle
from scheduler.request import QueueFullError, SamplingParams

if TYPE_CHECKING:       # the engine's modules (torch) load where an engine runs, not here
    from engine.llm_engine import LLMEngine

logger = logging.getLogger("continuum.async")


class RequestFailedError(RuntimeError):
    """The request failed inside the engine (it alone); the message says why."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class _StreamRouter:
    """Per-request asyncio queues fed from a background thread; `generate` and `abort`; the
    output processor, under a lock (the event loop adds and aborts, the background thread
    processes)."""

    def __init__(self, config: EngineConfig, processor: OutputProcessor, on_stats=None,
                 on_lora=None) -> None:
        self.on_lora = on_lora
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._pending: dict[str, Future] = {}      # calls the core has not acknowledged yet
        self.processor = processor
        self._lock = threading.Lock()
        self.dead_error: BaseException | None = None
        self.on_stats = on_stats
        # Requests the engine can hold (running + waiting): past it `generate` refuses at once,
        # without a round trip to the engine, which reads commands only between steps.
        self.capacity = config.max_num_seqs + config.max_waiting_requests

    def _command(self, command) -> None:
        """Send a command (`engine.messages`) to the core. Raises OSError when it is gone."""
        raise NotImplementedError

    def _submit(self, call_id: str, command, fut: Future) -> None:
        self._pending[call_id] = fut
        try:
            self._command(command)
        except OSError as e:          # the engine is gone
            self._pending.pop(call_id, None)
            settle(fut, EngineDeadError(f"the engine is not running: {e}"))

    async def lora(self, op: str, *args) -> None:
        """Load ("add": name, path) or unload ("remove": name) a LoRA adapter in the engine
        between steps. Raises what the core raises (`engine.lora.adapter.LoraError`)."""
        fut: Future = Future()
        call_id = f"lora-{uuid.uuid4().hex}"
        self._submit(call_id, LoraCall(call_id, op, *args), fut)
        await asyncio.wrap_future(fut)

    def _abort_in_core(self, request_id: str) -> None:
        try:
            self._command(AbortRequests([request_id]))
        except OSError:             # the engine is gone: nothing left to abort
            pass

    def abort_all(self) -> None:
        """Abort every request the engine holds (a server shutting down): each stream ends with
        a last output whose unfinished choices have finish_reason "abort". Any thread."""
        try:
            self._command(AbortAll())
        except OSError:             # the engine is gone: its streams have failed already
            return
        with self._lock:
            outputs = self.processor.finish(list(self.processor.requests), "abort")
        self._dispatch(outputs)

    def _on_message(self, message) -> None:
        """A message of the core: outputs to their streams (stop strings found here finish
        their sequences in the core), stats to `on_stats(step_stats, snapshot)`, an
        acknowledgement to its waiter, the adapters after a LoRA call to `on_lora(paths)`."""
        if isinstance(message, EngineCoreOutputs):
            if message.outputs or message.scheduled or message.prompt_logprobs:
                with self._lock:
                    outputs, stopped = self.processor.process_step(message)
                if stopped:
                    try:
                        self._command(FinishSequences(stopped))
                    except OSError:
                        pass
                self._dispatch(outputs)
            if self.on_stats is not None and (message.snapshot is not None
                                              or message.stats is not None):
                self.on_stats([message.stats] if message.stats is not None else [],
                              message.snapshot)
        elif isinstance(message, Acknowledged):
            fut = self._pending.pop(message.call_id, None)
            if fut is not None:
                settle(fut, message.error)
        elif isinstance(message, LoraAdapters) and self.on_lora is not None:
            self.on_lora(message.paths)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: at once to those of the loop this runs on
        (`ProcessAsyncLLM.reader_loop`), through `call_soon_threadsafe` to those of others."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream[0], []).append((stream[1], out))
        here = asyncio._get_running_loop()
        for loop, items in by_loop.items():
            if loop is here:            # the reader runs on the streams' own loop
                _deliver(items)
            else:
                loop.call_soon_threadsafe(_deliver, items)

    def _fail_all(self, error: BaseException) -> None:
        """The engine is gone: later `generate` calls raise EngineDeadError, every stream in
        flight ends with RequestFailedError, and calls it never acknowledged fail."""
        self.dead_error = error
        for loop, q in list(self._streams.values()):
            loop.call_soon_threadsafe(q.put_nowait, RequestFailedError(f"{error}"))
        for rid in list(self._pending):
            fut = self._pending.pop(rid, None)
            if fut is not None:
                settle(fut, EngineDeadError(f"the engine is not running: {error}"))

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
        arrival, prompt = time.monotonic(), list(prompt_token_ids)
        with self._lock:
            self.processor.add_request(request_id, prompt, params, arrival)
        self._submit(request_id, AddRequest(request_id, prompt, params, arrival, priority), fut)
        try:
            await asyncio.wrap_future(fut)
        except BaseException as e:
            self._streams.pop(request_id, None)
            with self._lock:
                self.processor.remove(request_id)
            if isinstance(e, asyncio.CancelledError):   # the client left before the engine
                self._abort_in_core(request_id)        # acknowledged: abort (after the add)
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
        with self._lock:
            self.processor.remove(request_id)
        self._abort_in_core(request_id)


class AsyncLLM(_StreamRouter):
    """`engine`'s core loop in a background thread of this process, its output processor
    here (see the module docstring); `engine` is then driven by this object alone."""

    def __init__(self, engine: LLMEngine, on_stats=None) -> None:
        from engine.core_proc import QueueCommands
        super().__init__(engine.config, engine.output_processor, on_stats)
        self.engine = engine
        self._commands = QueueCommands()
        self._thread = threading.Thread(target=self._run, name="continuum-engine", daemon=True)
        self._thread.start()

    def _command(self, command) -> None:
        self._commands.inbox.put(command)

    def _run(self) -> None:
        from engine.core_proc import EngineCoreProc
        try:
            EngineCoreProc(self.engine.core, self._on_message).run(self._commands)
        except BaseException as e:      # a bug: report it to every waiting stream
            logger.exception("engine loop died")
            self._fail_all(e)

    @property
    def is_alive(self) -> bool:
        """Whether the engine loop is running and has not died."""
        return self._thread.is_alive() and self.dead_error is None

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the loop after the current step (pending requests are dropped)."""
        self._command(Stop())
        self._thread.join(timeout)


def _engine_core_main(config: EngineConfig, conn, check_flags: bool = False) -> None:
    """The child's entry (`engine.core_proc.engine_core_main`), named here so that the parent
    spawns it before importing the engine's modules (torch: seconds of a cold start that the
    child's own imports then overlap). SIGINT is ignored from here, before those imports: a
    terminal's Ctrl-C during a start reaches the child too, and the parent owns shutdown.
    With `check_flags`, it first sends `FlagsChecked` (`engine.flag_checks`), as soon as torch
    is imported, and exits there if a flag cannot run."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if check_flags:
        from engine.flag_checks import flag_error
        error = flag_error(config)
        conn.send(FlagsChecked(error))
        if error is not None:
            return
    from engine.core_proc import engine_core_main
    engine_core_main(config, conn)


def _early_tokenizer(model: str | None) -> tuple:
    """(directory, tokenizer) for a model whose directory is known without a conversion
    (`engine.loader.ready_model_dir`), loaded while the engine core starts; (None, None)
    otherwise, or if it does not load (the core's own start then says why)."""
    from engine.loader import ready_model_dir
    try:
        directory = ready_model_dir(model)
        return (directory, load_tokenizer(directory)) if directory is not None else (None, None)
    except Exception:                       # noqa: BLE001 - loaded again after Ready
        return None, None


def spawn_engine_core(config: EngineConfig, check_flags: bool = False) -> tuple:
    """Start the engine core's child process now (spawned: it imports and builds the engine
    itself) and return (process, this end of its pipe) for `ProcessAsyncLLM(started=...)`.
    `continuum serve` calls it before its own slower checks and imports, which the child's
    start then overlaps; `stop_engine_core` ends one that will not be used. With
    `check_flags`, the child checks the flags that need torch first and says so
    (`flags_checked`), so that the caller need not import torch to check them."""
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_engine_core_main, args=(config, child, check_flags),
                       name="continuum-engine-core", daemon=True)
    proc.start()
    return proc, conn


def flags_checked(started: tuple, timeout: float = 600.0) -> str | None:
    """Wait for the verdict of a child from `spawn_engine_core(check_flags=True)`: None (the
    flags run here; the child goes on to build the engine), or the one-line reason. A child
    that exits or stays silent for `timeout` seconds gives None: `ProcessAsyncLLM` then
    reports it as a failed start."""
    _, conn = started
    try:
        if not conn.poll(timeout):
            return None
        message = conn.recv()
    except (EOFError, OSError):
        return None
    return message.error if isinstance(message, FlagsChecked) else None


def stop_engine_core(started: tuple) -> None:
    """End a child from `spawn_engine_core` that will not serve (the server refused a flag)."""
    proc, conn = started
    conn.close()
    proc.kill()
    proc.join(5)


class ProcessAsyncLLM(_StreamRouter):
    """The engine core in a child process (spawned; it loads the model itself); the output
    processor, over the model's tokenizer (`tokenizer`), here."""

    def __init__(self, config: EngineConfig, start_timeout: float = 600.0,
                 on_stats=None, on_dead=None, on_lora=None, conn=None,
                 started: tuple | None = None,
                 reader_loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Starts the child (or takes `started`, `spawn_engine_core`'s) and waits until its
        engine is loaded; the tokenizer loads meanwhile where the model's directory needs no
        conversion (`_early_tokenizer`), after it otherwise. With `conn`, this front end's pipe
        to an engine core another process started (one of `--api-server-count`'s API
        processes, `engine.core_clients`), no child is started.

        `on_stats(step_stats, snapshot)` is called from the pipe's reader after every step and
        after aborts (snapshot None: only this front end's requests' stats); `on_dead(message)`
        once from the reader if the engine process exits without `shutdown()` (killed,
        out of memory), after every stream has failed; `on_lora(paths)` after every LoRA call.
        With `reader_loop` (the server's event loop, running in another thread), the pipe is
        read there (`loop.add_reader`) instead of by a reader thread, and these callbacks run
        there: a step's outputs then reach the streams of that loop without a second thread's
        wake-up, GIL hand-over and self-pipe write (docs/architecture.md, step 7).
        Raises EngineDeadError if the engine cannot start (message says why).
        """
        self.on_dead = on_dead
        self._send_lock = threading.Lock()
        self._stopping = False           # set by shutdown(): the pipe closing is then expected
        self._proc = None
        if conn is not None:
            self._conn = conn
        else:
            self._proc, self._conn = started if started is not None else \
                spawn_engine_core(config)
        # the tokenizer while the engine core starts, where its directory needs no conversion
        early_dir, early = _early_tokenizer(config.model)
        first = self._first_message(start_timeout)
        if not isinstance(first, Ready):
            self._exit_code()              # reap the child that stopped itself
            raise EngineDeadError(f"engine process failed to start: {first.reason}")
        self.info: dict = first.info
        try:
            self.tokenizer = early if early is not None and \
                str(early_dir) == self.info["model_dir"] else load_tokenizer(self.info["model_dir"])
        except Exception as e:
            self.shutdown()
            raise EngineDeadError(f"the model's tokenizer did not load: {e}") from None
        super().__init__(config, OutputProcessor(self.tokenizer), on_stats, on_lora)
        self._dead_reason: str | None = None      # the core's `Dead` message, if it sent one
        self.reader_loop = reader_loop
        if reader_loop is None:
            threading.Thread(target=self._read, name="continuum-engine-reader",
                             daemon=True).start()
        else:
            reader_loop.call_soon_threadsafe(self._attach)

    def _first_message(self, timeout: float):
        """The core's first message after a `FlagsChecked` one (`Ready` or `Dead`). Raises
        EngineDeadError if none comes in `timeout` seconds or the process exits silently."""
        deadline = time.monotonic() + timeout
        while True:
            if not self._conn.poll(max(0.0, deadline - time.monotonic())):
                raise EngineDeadError("engine process did not start in time")
            try:
                message = self._conn.recv()
            except EOFError:                   # it exited without a word (killed, os._exit)
                raise EngineDeadError("engine process exited during start (exit code "
                                      f"{self._exit_code()})") from None
            if isinstance(message, FlagsChecked):
                if message.error is None:
                    continue
                message = Dead(message.error)
            return message

    def _exit_code(self) -> int | None:
        """The engine process's exit code once it has exited (None: still running, or not
        this process's child)."""
        if self._proc is None:
            return None
        self._proc.join(5)
        return self._proc.exitcode

    def _command(self, command) -> None:
        with self._send_lock:
            self._conn.send(command)

    def _read(self) -> None:
        """The reader thread (no `reader_loop`): every message until the pipe closes."""
        try:
            while True:
                self._take(self._conn.recv())
        except BaseException as e:
            self._stopped_reading(e)

    def _attach(self) -> None:
        """On `reader_loop`: read the pipe there. The socket stays blocking: uvloop's
        `add_reader` makes it non-blocking (libuv's `uv_poll_init`), and a command larger than
        the socket's buffer (a prompt of 10^6 ids) would then fail to send with EAGAIN."""
        fd = self._conn.fileno()
        self.reader_loop.add_reader(fd, self._readable)
        os.set_blocking(fd, True)

    def _readable(self) -> None:
        """`reader_loop`'s callback when the pipe has data: one message (read whole: the core
        writes it at once). Not a `poll()` for more: each builds a selector (~6 % of a single
        stream's time here), and the loop's own poll calls this again while data is there."""
        try:                    # one message: the loop calls again while more are there
            self._take(self._conn.recv())
        except BaseException as e:
            self.reader_loop.remove_reader(self._conn.fileno())
            self._stopped_reading(e)

    def _stopped_reading(self, error: BaseException) -> None:
        """The reader ended on `error`: the pipe closed (EOFError, OSError: shutdown, or the
        child died), else a bug — said where, and no stream left hanging."""
        if isinstance(error, (EOFError, OSError)):
            self._closed()
        else:
            logger.error("engine reader stopped", exc_info=error)
            self._fail_all(error)

    def _take(self, message) -> None:
        if isinstance(message, Dead):   # it stopped itself and says why
            self._dead_reason = message.reason
        else:
            self._on_message(message)

    def _closed(self) -> None:
        """The pipe closed: every stream fails; unless `shutdown()` closed it, say why (the
        core's `Dead` reason, else the exit code) and call `on_dead`."""
        if self._stopping:
            self._fail_all(EngineDeadError("the engine was shut down"))
            return
        reason = self._dead_reason
        message = (f"engine stopped: {reason}" if reason else
                   f"engine process exited unexpectedly (exit code {self._exit_code()})")
        logger.error("%s", message)
        self._fail_all(EngineDeadError(message))
        if self.on_dead is not None:
            self.on_dead(message)

    @property
    def is_alive(self) -> bool:
        """Whether the engine loop is running and has not died."""
        alive = self._proc is None or self._proc.is_alive()
        return alive and self.dead_error is None

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine process (terminated if it does not exit within `timeout` seconds);
        over another process's engine core, leave it (`Stop` there aborts this front end's
        requests and closes its pipe; the core stops once every front end has left)."""
        self._stopping = True
        try:
            self._command(Stop())
        except OSError:
            pass
        if self._proc is None:
            return
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.terminate()


def _deliver(items: list) -> None:
    for q, out in items:
        q.put_nowait(out)
