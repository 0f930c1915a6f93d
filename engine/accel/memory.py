"""The KV cache's share of an accelerator's memory: `--gpu-memory-utilization` minus the
weights, a profiled peak step and what is outside torch's allocator.

Owns: `kv_budget_bytes` (the arithmetic) and `profiled_kv_budget` (runs the profile). In: the
loaded model (weights already on the device), the step limits (`--max-num-batched-tokens`,
`--max-num-seqs`). Out: bytes for the KV cache.

As vLLM sizes it (`gpu_worker.determine_available_memory`): run one step of the largest size
the scheduler may build — `max_num_tokens` tokens spread over `max_num_seqs` prompts, then the
logits and the sampler's softmax and sort of `logit_rows` rows (one per sequence, one per
draft token more with speculative decoding) — into a scratch KV cache just large enough for
those tokens (each sequence its own blocks, every slot written once), and read the allocator's
peak. The cache then gets

    utilization * total - peak allocated (weights + activations) - memory outside torch

where memory outside torch (the CUDA context, NCCL, cuBLAS workspaces) is what the device
reports in use beyond torch's reserved pool. CUDA graphs are captured after the cache, from the
headroom `1 - utilization` leaves (decode graphs need little: their activations are
`max_num_seqs` rows), so a utilization of 1.0 leaves them nothing.

Under tensor parallelism a rank cannot run a step alone (every layer all-reduces across the
ranks, which are not running yet), so rank 0 sizes the cache from what is in use now plus an
estimate of the peak step's activations (`estimate_step_bytes`), for every rank alike.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("continuum.engine")


def kv_budget_bytes(total: int, free: int, reserved: int, peak_allocated: int,
                    utilization: float) -> int:
    """Bytes for the KV cache (see the module docstring): all arguments in bytes, `reserved`
    is torch's pool now, `free` the device's free memory now. Raises ValueError (one line)
    when nothing is left for the cache."""
    outside_torch = max(0, total - free - reserved)
    budget = int(utilization * total) - peak_allocated - outside_torch
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(
            f"--gpu-memory-utilization {utilization} leaves no room for the KV cache: "
            f"{utilization * total / gib:.2f} GiB allowed, {peak_allocated / gib:.2f} GiB for "
            f"the weights and a peak step, {outside_torch / gib:.2f} GiB outside torch; raise "
            "it or lower --max-num-batched-tokens")
    return budget


def estimate_step_bytes(cfg, dtype: torch.dtype, max_num_tokens: int, logit_rows: int) -> int:
    """Bytes a step's activations may take at once (the tensor-parallel estimate): per token
    the residual stream, a layer's QKV, attention output, gate / up and its product in `dtype`,
    twice over (the allocator holds inputs and outputs together); the logits and the sampler's
    softmax, sort values and int64 indices in float32 / int64 per logit row."""
    elem = torch.empty((), dtype=dtype).element_size()
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_token = (3 * cfg.hidden_size + qkv + cfg.num_heads * cfg.head_dim
                 + 3 * cfg.intermediate_size) * elem
    return 2 * max_num_tokens * per_token + logit_rows * cfg.vocab_size * (3 * 4 + 8)


@torch.inference_mode()
def profile_peak_step(model, backend, device, max_num_tokens: int, max_num_seqs: int,
                      block_size: int, logit_rows: int | None = None) -> None:
    """Run the largest step once (see the module docstring) on `device` (`engine.device.
    Device`) with `backend` (`engine.accel`), so that the allocator's peak counts it;
    `logit_rows` defaults to one per sequence."""
    from engine.accel.metadata import StepBuffers

    cfg = model.cfg
    dev = device.torch_device
    seqs = max(1, min(max_num_seqs, max_num_tokens))
    lens = [max_num_tokens // seqs + (i < max_num_tokens % seqs) for i in range(seqs)]
    tables, slots, first = [], [], 0
    for n in lens:                                      # each sequence its own blocks
        tables.append(list(range(first, first + -(-n // block_size))))
        slots += [tables[-1][p // block_size] * block_size + p % block_size for p in range(n)]
        first += len(tables[-1])
    buffers = StepBuffers(dev, max_num_tokens, seqs, max(len(t) for t in tables))
    positions = torch.cat([torch.arange(n) for n in lens])
    input_ids, pos, meta = buffers.fill(backend, [0] * max_num_tokens, positions,
                                        torch.tensor(slots), lens, lens, tables, 0)
    cache = torch.zeros(backend.cache_shape(cfg.num_layers, cfg.num_kv_heads, first, block_size,
                                            cfg.head_dim), dtype=model.dtype, device=dev)
    hidden = model.forward(input_ids, pos, meta, cache)
    rows = min(max_num_tokens, logit_rows or seqs)
    logits = model.compute_logits(hidden[-rows:])
    logits.softmax(dim=-1).sort(dim=-1)              # the sampler's top-p sort is the largest
    device.synchronize()


def profiled_kv_budget(model, device, utilization: float, max_num_tokens: int,
                       max_num_seqs: int, block_size: int, logit_rows: int,
                       tensor_parallel: bool = False) -> int:
    """Profile the peak step on the accelerator `device` (estimate it under
    `tensor_parallel`) and return the KV cache's bytes. Raises ValueError when nothing is left
    (`kv_budget_bytes`)."""
    from engine.accel import attention_backend

    stats = device.memory_stats()
    stats.empty_cache()
    stats.reset_peak_memory_stats(device.torch_device)
    if tensor_parallel:
        peak = stats.memory_allocated(device.torch_device) + estimate_step_bytes(
            model.cfg, model.dtype, max_num_tokens, logit_rows)
    else:
        profile_peak_step(model, attention_backend(device.kind), device, max_num_tokens,
                          max_num_seqs, block_size, logit_rows)
        peak = stats.max_memory_allocated(device.torch_device)
    free, total = device.memory_info()
    budget = kv_budget_bytes(total, free, stats.memory_reserved(device.torch_device), peak,
                             utilization)
    stats.empty_cache()
    logger.info("memory profile: peak step %.2f GiB with the weights, KV cache %.2f GiB of "
                "%.2f GiB (--gpu-memory-utilization %s)", peak / (1 << 30), budget / (1 << 30),
                total / (1 << 30), utilization)
    return budget
