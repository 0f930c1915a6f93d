"""The tensor-parallel group and the Megatron-style sharding of a Llama-family checkpoint.

Owns: `TensorParallelGroup` (rank, world size, the collectives the model calls, and the time
spent in them) and `shard_weights`, which turns full HF-named weights into one rank's shard.
In: full weights `{name: tensor}` and the `ModelConfig`; out: the same names holding the rank's
slice, and a `ModelConfig` whose head and MLP sizes are the rank's (vocabulary and hidden size
stay whole: logits are gathered, the residual stream is replicated).

The split follows Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism", section 3): column-parallel Q/K/V (by
attention head, each rank keeping whole heads and the KV heads its query heads read) and
gate/up (by intermediate row); row-parallel O and down (by input column), each followed by an
all-reduce; the embedding and the LM head split by vocabulary row (the embedding masks ids
outside its range and all-reduces; the head's partial logits are all-gathered).
`shard_lora` splits a LoRA adapter along with its layers: a column-parallel projection's B by
output row (A whole), a row-parallel projection's A by input column (B whole), so each rank's
delta of O / down is a partial sum that the layer's all-reduce adds up with the base's (vLLM's
`ColumnParallelLinearWithLoRA` / `RowParallelLinearWithLoRA` split them the same way).
"""

from __future__ import annotations

import dataclasses
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.quant.formats import QuantWeight

# How long a collective (or the start-up rendezvous) may wait for the other ranks. Steps meet
# in collectives only while running (the control plane is a pipe), so this bounds a forward
# pass, not idle time. A dead rank fails a collective at once (its sockets close); this catches
# a rank that hangs.
COLLECTIVE_TIMEOUT = timedelta(seconds=300)


class TensorParallelError(RuntimeError):
    """A rank died, hung or failed mid-step: the ranks can no longer run in step, so the
    engine must stop (it is never retried as a per-request failure)."""


def check_tensor_parallel(cfg, size: int, device=None) -> None:
    """Raise ValueError (one line, naming `--tensor-parallel-size`) unless the model's query
    heads, KV heads and MLP width all divide evenly by `size` (`cfg`: `ModelConfig`) and
    `device` (an `engine.device.Device`, if given) has a device for every rank."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {size}")
    for what, n in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                    ("MLP intermediate size", cfg.intermediate_size)):
        if n % size:
            raise ValueError(f"--tensor-parallel-size {size} does not divide the model's {n} "
                             f"{what} (it has {cfg.num_heads} attention heads, "
                             f"{cfg.num_kv_heads} KV heads, MLP width {cfg.intermediate_size})")
    if device is not None:
        device.check_world_size(size)


class TensorParallelGroup:
    """One rank's membership in the group of `world_size` ranks (the default process group).

    The collectives run in place on the calling rank's tensor: through shared memory
    (`engine.distributed.shm`) for CPU tensors where the group set it up, else through
    torch.distributed; `comm_seconds` accumulates the wall time spent in them (seconds;
    per-step communication vs compute in the benchmark)."""

    def __init__(self, rank: int, world_size: int, shm=None) -> None:
        self.rank, self.world_size, self.shm = rank, world_size, shm
        self.comm_seconds = 0.0

    @classmethod
    def init(cls, backend: str, rank: int, world_size: int, port: int) -> TensorParallelGroup:
        """Join the group whose rank 0 listens on 127.0.0.1:`port` (rank 0 hosts the TCP
        store), and with `backend` "gloo" (CPU ranks) set up the shared-memory collectives.
        Blocks until every rank has joined; raises RuntimeError (torch's) after
        `COLLECTIVE_TIMEOUT`."""
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        shm = None
        if backend == "gloo" and world_size > 1:
            from engine.distributed.shm import connect
            shm = connect(rank, world_size)
        return cls(rank, world_size, shm)

    @property
    def transport(self) -> str:
        """How the collectives travel, for the log: "shared memory" or "gloo" / "nccl" ..."""
        return "shared memory" if self.shm is not None else dist.get_backend()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns `x`. Raises RuntimeError when a peer is
        gone (torch's, or `ShmCommunicator`'s)."""
        t0 = time.perf_counter()
        if self.shm is not None and self.shm.handles(x):
            self.shm.all_reduce(x)
        else:
            dist.all_reduce(x)
        self.comm_seconds += time.perf_counter() - t0
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """`[N, C]` on each rank → `[N, world_size * C]`, rank r's columns at r*C."""
        t0 = time.perf_counter()
        x = x.contiguous()
        if self.shm is not None and self.shm.handles(x, gather=True):
            out = self.shm.all_gather_rows(x)
        else:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x)
            out = torch.cat(parts, dim=1)
        self.comm_seconds += time.perf_counter() - t0
        return out

    def barrier(self) -> None:
        """Wait until every rank reaches this point (start-up: every shard is loaded)."""
        dist.barrier()

    def destroy(self) -> None:
        """Leave the group (the process may build another engine afterwards)."""
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if dist.is_initialized():
            dist.destroy_process_group()


def vocab_shard(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """(first id, rows) of rank's vocabulary shard: ceil(vocab / world_size) rows each, the
    last shard padded with zero rows past the vocabulary (ids there never occur)."""
    rows = -(-vocab_size // world_size)
    return rank * rows, rows


def shard_weights(cfg, weights: dict, rank: int, world_size: int):
    """Rank's shard of HF-named Llama weights (see the module docstring): float tensors, or
    `engine.quant.QuantWeight`s sharded along whole rows / blocks (a row-parallel weight whose
    split falls inside a block is dequantized).

    Returns (local `ModelConfig`: num_heads, num_kv_heads, intermediate_size divided by
    `world_size`; `{name: tensor}` with the same names). Norm weights are replicated. Raises
    ValueError where the sizes do not divide (`check_tensor_parallel`)."""
    check_tensor_parallel(cfg, world_size)
    d, r, n = cfg.head_dim, rank, world_size

    def rows(t, per: int):
        if isinstance(t, QuantWeight):            # whole rows of blocks
            return t.rows(r * per, per)
        return t[r * per:(r + 1) * per].contiguous()

    def cols(t, per: int):
        if isinstance(t, QuantWeight):            # whole blocks, else dequantized
            part = t.cols(r * per, per)
            if part is not None:
                return part
            t = t.dequantize()
        return t[:, r * per:(r + 1) * per].contiguous()

    def vocab_rows(t):
        start, count = vocab_shard(cfg.vocab_size, r, n)
        if isinstance(t, QuantWeight):
            return t.rows(start, count)
        part = t[start:start + count]
        if part.shape[0] < count:
            part = torch.cat([part, part.new_zeros(count - part.shape[0], part.shape[1])])
        return part.contiguous()

    q_rows, kv_rows = cfg.num_heads // n * d, cfg.num_kv_heads // n * d
    mlp_rows = cfg.intermediate_size // n
    out = {}
    for name, t in weights.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = vocab_rows(t)
        elif name.endswith(("q_proj.weight", "q_proj.bias")):
            out[name] = rows(t, q_rows)
        elif name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            out[name] = rows(t, kv_rows)
        elif name.endswith("o_proj.weight"):
            out[name] = cols(t, q_rows)
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            out[name] = rows(t, mlp_rows)
        elif name.endswith("down_proj.weight"):
            out[name] = cols(t, mlp_rows)
        else:                                   # norms: replicated
            out[name] = t
    local = dataclasses.replace(cfg, num_heads=cfg.num_heads // n,
                                num_kv_heads=cfg.num_kv_heads // n,
                                intermediate_size=mlp_rows)
    return local, out


# Megatron roles of the LoRA-targetable projections (engine.lora.adapter.MODULES)
_ROW_PARALLEL = ("o_proj", "down_proj")


def shard_lora(cfg, weights: dict, rank: int, world_size: int) -> dict:
    """Rank's shard of a LoRA adapter's `{(layer, module): (A [r, in], B [out, r])}` for the
    full model `cfg` (see the module docstring); the same keys, contiguous float tensors."""
    d, n = cfg.head_dim, world_size
    out_rows = {"q_proj": cfg.num_heads // n * d, "k_proj": cfg.num_kv_heads // n * d,
                "v_proj": cfg.num_kv_heads // n * d, "gate_proj": cfg.intermediate_size // n,
                "up_proj": cfg.intermediate_size // n}
    out = {}
    for (layer, module), (a, b) in weights.items():
        if module in _ROW_PARALLEL:
            per = a.shape[1] // n
            a = a[:, rank * per:(rank + 1) * per].contiguous()
        else:
            per = out_rows[module]
            b = b[rank * per:(rank + 1) * per].contiguous()
        out[(layer, module)] = (a, b)
    return out
