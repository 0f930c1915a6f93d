"""The engine core's command loop, whatever carries its messages (`EngineCoreProc`, as vLLM
v1's): typed commands (`engine.messages`) are taken between steps; while requests are
unfinished the core steps, and each step's `EngineCoreOutputs` goes out with a scheduler
snapshot. Also the core's child process (`engine_core_main`) and what the front end reads of
the core (`engine_info`, `engine_snapshot`).

In: commands from a `QueueCommands` (the thread back end) or a `PipeCommands` (the process
back end). Out: `emit(message)` — `Acknowledged`, `EngineCoreOutputs`, and over the pipe
`Ready` / `Dead`.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import time

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.heap import freeze_heap, trim_heap
from engine.distributed.parallel import TensorParallelError
from engine.log_config import configure
from engine.messages import (AbortAll, AbortRequests, Acknowledged, AddRequest, Dead,
                             FinishSequences, LoraAdapters, LoraCall, Ready, Stop)
from engine.outputs import EngineCoreOutputs

logger = logging.getLogger("continuum.async")

SNAPSHOT_S = 0.1        # the longest a step's snapshot is left out while the counts hold


class EngineCoreProc:
    """The loop: commands between steps, a step while requests are unfinished, its outputs
    out, with `engine_snapshot` where due (`step`; the step-cost gauge in it refitted once a
    second and at the last step before idle). Aborts that change the scheduler without a
    step send an `EngineCoreOutputs` with the snapshot alone."""

    def __init__(self, core: EngineCore, emit) -> None:
        self.core, self.emit = core, emit
        self.next_cost = 0.0                  # monotonic time of the next step-cost refit
        self.next_snapshot = 0.0              # ... by which the next snapshot goes out
        self._sent_counts: tuple[int, int, int] | None = None   # running, waiting, swapped
        self._handlers = {AddRequest: self._add, AbortRequests: self._abort,
                          FinishSequences: self._finish, AbortAll: self._abort_all,
                          LoraCall: self._lora}

    def run(self, commands) -> None:
        """Serve `commands` (`wait()` blocks until one is there, `poll()` says whether one is,
        `recv()` takes it) and step until `Stop`. The loop runs in torch's inference mode,
        entered once: the model runner's step then does not enter and leave it each time
        (about 5 % of a single-stream step's Python, docs/cpu.md)."""
        with torch.inference_mode():
            self._loop(commands)

    def _loop(self, commands) -> None:
        core, busy = self.core, False
        while True:
            if not core.has_unfinished_requests():
                if busy:                      # idle now: the burst's freed memory goes back
                    trim_heap()
                commands.wait()
            changed = False
            while commands.poll():
                command = commands.recv()
                if isinstance(command, Stop):
                    return
                changed = self._handlers[type(command)](command) or changed
            busy = core.has_unfinished_requests()
            if busy:
                self.step()
            elif changed:
                self.emit(EngineCoreOutputs(snapshot=engine_snapshot(core)))

    def _add(self, cmd: AddRequest) -> bool:
        try:
            self.core.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                  cmd.arrival_time, cmd.priority)
            self.emit(Acknowledged(cmd.request_id))
        except Exception as e:
            self.emit(Acknowledged(cmd.request_id, e))
        return False

    def _lora(self, cmd: LoraCall) -> bool:
        """Runtime LoRA adapter (un)loading; its acknowledgement carries any LoraError."""
        try:
            if cmd.op == "add":
                self.core.add_lora(cmd.name, cmd.path)
            else:
                self.core.remove_lora(cmd.name)
            self.emit(Acknowledged(cmd.call_id))
        except Exception as e:
            self.emit(Acknowledged(cmd.call_id, e))
            return False
        self.emit(LoraAdapters(dict(self.core.lora.paths)))   # every front end lists them
        return False

    def _abort(self, cmd: AbortRequests) -> bool:
        self.core.abort_request(cmd.request_ids)
        return True

    def _finish(self, cmd: FinishSequences) -> bool:
        self.core.finish_sequences(cmd.sequence_ids)
        return True

    def _abort_all(self, cmd: AbortAll) -> bool:
        self.core.abort_all()               # the front end ends the streams itself
        return True

    def step(self) -> None:
        """One core step; its outputs go out, with the snapshot where it is due: at the last
        step before idle, when the numbers of running, waiting or swapped requests changed,
        and at least every `SNAPSHOT_S` seconds (gauges a scrape reads, not per-token data:
        building, pickling and reading it each step cost a single stream ~10 % of the API
        process's time per token, docs/architecture.md step 7)."""
        core, sched = self.core, self.core.scheduler
        out = core.step()
        now = time.monotonic()
        with_cost = now >= self.next_cost or not core.has_unfinished_requests()
        if with_cost:
            self.next_cost = now + 1.0
        counts = (len(sched.running), len(sched.waiting), len(sched.swapped))
        if with_cost or counts != self._sent_counts or now >= self.next_snapshot:
            out.snapshot = engine_snapshot(core, with_cost)
            self._sent_counts, self.next_snapshot = counts, now + SNAPSHOT_S
        self.emit(out)


def engine_snapshot(core: EngineCore, step_cost: bool = True) -> dict:
    """What the metrics layer reads of the engine: the scheduler's snapshot
    (`Scheduler.snapshot`: request counts, KV usage, prefill budget, counters; with
    `step_cost`, the fitted step-cost model), and with LoRA on, `lora`: the adapters loaded,
    `max_loras`, and the adapters of the running and the waiting requests (vLLM's
    `lora_requests_info`)."""
    snapshot = core.scheduler.snapshot(step_cost)
    if core.lora is not None:
        sched = core.scheduler
        snapshot["lora"] = {
            "loaded": len(core.lora.paths), "max_loras": core.config.max_loras,
            "running": sorted({r.sampling_params.lora_name for r in sched.running} - {None}),
            "waiting": sorted({r.sampling_params.lora_name for _, r in sched.waiting} - {None})}
    return snapshot


def engine_info(core: EngineCore) -> dict:
    """What the API layer needs to know about the loaded engine."""
    return {"model_dir": str(core.model_dir), "max_model_len": core.max_model_len,
            "vocab_size": core.model_config.vocab_size, "load_time": core.load_time,
            "architecture": core.model_config.architecture, "dtype": str(core.dtype),
            "device": core.device.kind, "kv_cache_dtype": core.kv_cache_dtype,
            "block_size": core.config.block_size, "num_gpu_blocks": core.num_gpu_blocks,
            "num_cpu_blocks": core.num_cpu_blocks}


class QueueCommands:
    """`EngineCoreProc`'s command source over a `queue.SimpleQueue` (the thread back end)."""

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

    def recv(self):
        """The next command (after `poll` said there is one)."""
        item, self._next = self._next, None
        return item


class PipeCommands:
    """`EngineCoreProc`'s command source over the child's end of the pipe."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def wait(self) -> None:
        """Block until a command is there."""
        self.conn.poll(None)

    def poll(self) -> bool:
        """Whether a command is there now."""
        return self.conn.poll(0)

    def recv(self):
        """The next command."""
        return self.conn.recv()


def engine_core_main(config: EngineConfig, conn) -> None:
    """Child process of `ProcessAsyncLLM` (`conn`: one pipe), or of `--api-server-count N`'s
    launcher (`conn`: a list of N pipes, `engine.core_clients`): build the core, then run its
    `EngineCoreProc` over the pipe(s). Sends `Ready` once, then the loop's messages; `Dead` if
    the core cannot start or must stop."""
    configure()          # a spawned child starts without logging: the server's start settings
    # A terminal's Ctrl-C reaches the whole process group: the parent owns shutdown (it sends
    # Stop, or terminates this process), so the child does not die mid-step on SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _core_loop(config, conn)
    except (EOFError, BrokenPipeError):     # the parent is gone: nothing left to serve
        return


def _rank_died(message: str) -> None:
    """A tensor-parallel rank died (the core logged it): this process exits at once, which
    the parent's reader sees as the engine dying (every stream fails, the server exits)."""
    os._exit(1)


def _core_loop(config: EngineConfig, conn) -> None:
    """Build the core, then run its loop until `Stop` (see `engine_core_main`)."""
    if isinstance(conn, list):               # several API processes
        from engine.core_clients import ClientOutbox, ClientPipes
        commands = ClientPipes(conn)
        emit = ClientOutbox(conn, commands)
    else:
        commands, emit = PipeCommands(conn), conn.send
    try:
        core = EngineCore(config, on_fatal=_rank_died)
    except BaseException as e:
        emit(Dead(f"{type(e).__name__}: {e}"))
        return
    freeze_heap()                   # a full collection over the built engine: a 226 ms stall
    if isinstance(conn, list):
        commands.live_requests = lambda: core.scheduler.requests.keys()
    try:
        emit(Ready(engine_info(core)))
        EngineCoreProc(core, emit).run(commands)
    except TensorParallelError as e:
        logger.error("engine stopped: %s", e)
        emit(Dead(str(e)))
    finally:
        core.shutdown()
