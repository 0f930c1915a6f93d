"""A tensor-parallel worker: ranks 1..N-1, each a `python -m engine.distributed.worker` process.

In (pickled objects on stdin, from rank 0's `executor.TensorParallelWorkers`): a `WorkerSpec`,
then a `CacheSpec` once rank 0 has sized the KV cache, then one `SchedulerOutput` per engine
step (with a `LoraUpdate` between steps for an adapter loaded or unloaded at run time), then
None (stop) or EOF (rank 0 is gone). Out: nothing but its part in the collectives;
it logs to stderr. Any failure exits non-zero, which rank 0 sees (its collectives fail and its
monitor reports the exit code) and turns into an engine stop.
"""

from __future__ import annotations

import logging
import pickle
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.log_config import configure
from engine.lora.manager import LoraSpec, LoraUpdate
from engine.quant import Quantization

logger = logging.getLogger("continuum.tp")


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to join the group and load its shard (sent first)."""

    rank: int
    world_size: int
    port: int                  # rank 0's TCP store on 127.0.0.1
    device: str                # `--device` as rank 0 resolved it ("cpu", "cuda", "npu")
    dtype: str                 # "float32", "bfloat16", "float16"
    model_dir: str             # the resolved HF-format directory
    max_model_len: int         # tokens: the rotary table's length
    num_threads: int           # torch intra-op threads of this rank
    quant: Quantization | None = None    # `--quantization` as rank 0 resolved it
    lora: LoraSpec | None = None         # `--enable-lora`'s slots and adapters


@dataclass(frozen=True)
class CacheSpec:
    """The KV cache and sampling setup, identical on every rank (sent second)."""

    block_size: int            # tokens per block
    num_gpu_blocks: int
    num_cpu_blocks: int
    eos_token_ids: tuple[int, ...]
    seed: int
    max_num_tokens: int = 8192  # an accelerator's step buffers (engine.accel.metadata)
    max_num_seqs: int = 256
    kv_quant: object = None     # engine.kv_quant.KVQuant: an 8-bit cache; None: model dtype


def run(spec: WorkerSpec, stream) -> None:
    """Join the group, load the shard, build the runner, then execute steps read from
    `stream` until None or EOF. Raises whatever fails (the caller exits non-zero)."""
    import torch

    from engine.device import DTYPES, resolve_device
    from engine.distributed.parallel import TensorParallelGroup
    from engine.lora.manager import build_lora
    from engine.model_runner import ModelRunner
    from engine.models.llama import ModelConfig, load_model

    torch.set_num_threads(spec.num_threads)
    device = resolve_device(spec.device).for_rank(spec.rank)
    device.activate()
    group = TensorParallelGroup.init(device.dist_backend, spec.rank, spec.world_size, spec.port)
    try:
        model = load_model(Path(spec.model_dir), device, DTYPES[spec.dtype], spec.max_model_len,
                           tp=group, quant=spec.quant)
        lora = None if spec.lora is None else build_lora(
            model, ModelConfig.from_dir(Path(spec.model_dir)), device, DTYPES[spec.dtype],
            spec.lora, group)
        cache: CacheSpec = pickle.load(stream)
        runner = ModelRunner(model, device, cache.block_size, cache.num_gpu_blocks,
                             cache.num_cpu_blocks, cache.eos_token_ids, cache.seed,
                             max_num_tokens=cache.max_num_tokens, max_num_seqs=cache.max_num_seqs,
                             kv_quant=cache.kv_quant)
        runner.lora = lora
        group.barrier()                              # rank 0 waits here for every shard
        while (out := pickle.load(stream)) is not None:
            if isinstance(out, LoraUpdate):
                lora.update(out)
                continue
            runner.execute(out)
    except EOFError:                                 # rank 0 is gone: nothing left to run
        pass
    finally:
        group.destroy()


def main() -> None:
    """Entry point: read the spec from stdin and run; exit 1 with one log line on failure."""
    configure()                      # the server's log settings, from the environment
    # Ctrl-C reaches the whole process group; rank 0 owns shutdown (it closes our stdin).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stream = sys.stdin.buffer
    try:
        spec: WorkerSpec = pickle.load(stream)
    except EOFError:
        return
    try:
        run(spec, stream)
    except Exception as e:                 # torch's collective errors are RuntimeErrors
        logger.error("tensor-parallel rank %d stopped: %s: %s", spec.rank,
                     type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        sys.exit(1)


if __name__ == "__main__":
    main()
