"""Rank 0's side of tensor parallelism: start the workers, feed them every step, watch them.

Owns: the worker processes (ranks 1..N-1, `engine.distributed.worker`), the control plane (one
pickle per step written down each worker's stdin), a monitor thread per worker that reports
an unexpected exit at once, and `TensorParallelRunner`, the `ModelRunner` of rank 0 that sends
each `SchedulerOutput` to the workers before executing it itself. In: the engine's start-up
facts (`WorkerSpec`, then `CacheSpec`), one `SchedulerOutput` per step and, between steps, a
`LoraUpdate` per adapter loaded or unloaded at run time; out: rank 0's
`ModelRunnerOutput` (every rank computes the same logits; rank 0's tokens are the ones kept).
"""

from __future__ import annotations

import logging
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch

from engine.distributed.parallel import TensorParallelError, TensorParallelGroup
from engine.distributed.worker import CacheSpec, WorkerSpec
from engine.kernels.isa import usable_cpus
from engine.lora.manager import LoraSpec, LoraUpdate
from engine.model_runner import ModelRunner
from engine.quant import Quantization
from scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("continuum.tp")


def threads_per_rank(world_size: int) -> int:
    """torch intra-op threads for each of `world_size` ranks sharing this host's cores."""
    return max(1, usable_cpus() // world_size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelWorkers:
    """Ranks 1..`world_size`-1 as child processes of this one (see the module docstring).

    `on_death(message)` is called from a monitor thread when a worker exits while the group is
    not shutting down; `failure` keeps the first such message; `send_seconds` accumulates the
    control plane's time (pickling and writing each step)."""

    def __init__(self, world_size: int, device: str, dtype: str, model_dir: str,
                 max_model_len: int, on_death: Callable[[str], None] | None = None,
                 quant: Quantization | None = None, lora: LoraSpec | None = None) -> None:
        self.port = _free_port()
        self.on_death = on_death
        self.failure: str | None = None
        self.send_seconds = 0.0
        self._stopping = False
        threads = threads_per_rank(world_size)
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, world_size):
            proc = subprocess.Popen([sys.executable, "-m", "engine.distributed.worker"],
                                    stdin=subprocess.PIPE)
            self.procs.append(proc)
            self._write(proc, pickle.dumps(WorkerSpec(
                rank, world_size, self.port, device, dtype, model_dir, max_model_len, threads,
                quant, lora)))
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True,
                             name=f"continuum-tp-monitor-{rank}").start()

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self._stopping:
            return
        message = f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
        if self.failure is None:
            self.failure = message
        if self.on_death is not None:
            self.on_death(message)

    def _write(self, proc: subprocess.Popen, data: bytes) -> None:
        try:
            proc.stdin.write(data)
            proc.stdin.flush()
        except OSError as e:          # BrokenPipeError: the worker is gone
            raise TensorParallelError(self.diagnose() or f"a tensor-parallel worker's pipe "
                                      f"closed: {e}") from None

    def send(self, obj: SchedulerOutput | CacheSpec | LoraUpdate | None) -> None:
        """Pickle `obj` once and hand it to every worker. Raises TensorParallelError if a
        worker is gone."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        t0 = time.perf_counter()
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        for proc in self.procs:
            self._write(proc, data)
        self.send_seconds += time.perf_counter() - t0

    def diagnose(self, wait_s: float = 2.0) -> str | None:
        """The first worker death, waiting up to `wait_s` seconds for exits to be reaped (a
        collective can fail a moment before its peer's exit is seen)."""
        deadline = time.monotonic() + wait_s
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.failure

    def shutdown(self, timeout: float = 10.0) -> None:
        """Tell every worker to stop, wait up to `timeout` seconds, then kill what is left."""
        self._stopping = True
        for proc in self.procs:
            try:
                proc.stdin.write(pickle.dumps(None))
                proc.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_tensor_parallel(world_size: int, device, dtype: torch.dtype, model_dir: str,
                          max_model_len: int, on_death: Callable[[str], None] | None = None,
                          quant: Quantization | None = None, lora: LoraSpec | None = None
                          ) -> tuple[TensorParallelGroup, TensorParallelWorkers]:
    """Start ranks 1..N-1 and join the group as rank 0 (`device`: `engine.device.Device`;
    with `lora`, every rank puts LoRA slots on its shard and reads the adapters itself).
    Sets this process's torch threads to its share of the cores. Raises TensorParallelError
    when the group cannot form (a worker died at start, or the rendezvous timed out)."""
    torch.set_num_threads(threads_per_rank(world_size))
    dtype_name = str(dtype).removeprefix("torch.")
    workers = TensorParallelWorkers(world_size, device.kind, dtype_name, model_dir,
                                    max_model_len, on_death, quant, lora)
    try:
        group = TensorParallelGroup.init(device.dist_backend, 0, world_size, workers.port)
    except Exception as e:           # torch's DistStoreError / RuntimeError
        message = workers.diagnose() or f"{type(e).__name__}: {e}"
        workers.shutdown(timeout=1.0)
        raise TensorParallelError(f"tensor-parallel group did not form: {message}") from None
    logger.info("tensor parallel: %d ranks (%s, collectives through %s), %d torch threads each",
                world_size, device.dist_backend, group.transport, threads_per_rank(world_size))
    return group, workers


class TensorParallelRunner(ModelRunner):
    """Rank 0's `ModelRunner`: each step goes to the workers first, then runs here on rank 0's
    shard. Takes `ModelRunner`'s arguments after the group and the workers (an n-gram
    `proposer` runs on rank 0 only: its drafts are rank 0's output); sends them the cache
    setup and waits until every rank is loaded.

    Any failure of a step (a collective error, a worker gone, or an exception on rank 0 that
    may have left the ranks out of step) raises TensorParallelError: the engine stops."""

    def __init__(self, group: TensorParallelGroup, workers: TensorParallelWorkers, model,
                 device, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 eos_token_ids: tuple[int, ...], seed: int = 0, grammars=None,
                 proposer=None, max_num_tokens: int = 8192, max_num_seqs: int = 256,
                 kv_quant=None) -> None:
        super().__init__(model, device, block_size, num_gpu_blocks, num_cpu_blocks,
                         eos_token_ids, seed, grammars, proposer=proposer,
                         max_num_tokens=max_num_tokens, max_num_seqs=max_num_seqs,
                         kv_quant=kv_quant)
        self.group, self.workers = group, workers
        workers.send(CacheSpec(block_size, num_gpu_blocks, num_cpu_blocks,
                               tuple(eos_token_ids), seed, max_num_tokens, max_num_seqs,
                               kv_quant))
        self._guard(group.barrier, "start")

    def _guard(self, fn, what: str, *args):
        try:
            return fn(*args)
        except TensorParallelError:
            raise
        except Exception as e:
            cause = self.workers.diagnose() or f"rank 0: {type(e).__name__}: {e}"
            raise TensorParallelError(f"tensor-parallel {what} failed: {cause}") from e

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Send `out` to the workers, then run it here. Raises TensorParallelError."""
        self.workers.send(out)
        return self._guard(super().execute, "step", out)
