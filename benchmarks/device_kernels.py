"""The GPU check's kernel section (`benchmarks/device_check.py`): one layer's batch-1 decode
attention, the Llama-3.2-1B shape (32 heads over 8 KV heads, head_dim 64, blocks of 16), at
growing contexts, by the split-KV decode kernels and by the one-pass kernel
(`engine.accel.triton_attention`). On CUDA each figure is a CUDA graph of `reps` launches
replayed, so it is GPU time, not Triton's Python launch cost; under the smoke run (the CPU,
Triton's interpreter) the contexts are tiny and the times only show that it runs.

In: the plan's device and dtype. Out: per context, microseconds a launch for each path and
their ratio, and the largest difference between the two outputs (they must agree).
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.device_measure import timed_ms


def _time_us(fn, device: str, reps: int) -> float:
    """Median microseconds of one `fn()`: on CUDA a graph of `reps` calls replayed 5 times,
    elsewhere `reps` timed calls."""
    if device != "cuda":
        return statistics.median(timed_ms(fn, device, reps)) * 1e3
    fn()                                          # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times) * 1e6


def attention_kernels(plan, report=None, ckpts=None) -> dict:
    """Section `attention_kernel` (see the module docstring); `report`, `ckpts` unused (the
    check's section signature)."""
    from engine.accel.metadata import StepBuffers
    from engine.accel.triton_attention import NUM_SPLITS, TritonAttention

    device = torch.device(plan.device)
    dtype = getattr(torch, plan.perf_dtype)
    heads, kv_heads, head_dim, block = 32, 8, 64, 16
    contexts = (128, 1024, 4096) if plan.device == "cuda" else (16, 64)
    reps = 50 if plan.device == "cuda" else 1
    g = torch.Generator().manual_seed(0)
    out: dict = {"shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                           "block_size": block, "dtype": plan.perf_dtype}}
    for ctx in contexts:
        blocks = -(-ctx // block)
        cache = torch.randn(2, kv_heads, blocks, block, head_dim, generator=g).to(device, dtype)
        q = torch.randn(1, heads, head_dim, generator=g).to(device, dtype)
        buffers = StepBuffers(device, 1, 1, blocks)
        results = {}
        for name, split_below in (("split_kv", 10**9), ("one_pass", 0)):
            backend = TritonAttention(split_below=split_below, num_splits=NUM_SPLITS)
            _, _, meta = buffers.fill(backend, [0], torch.tensor([ctx - 1]),
                                      torch.tensor([-1]), [1], [ctx], [list(range(blocks))], 1)
            o = torch.empty_like(q)

            def step(backend=backend, meta=meta, o=o):
                backend.attend(q, cache[0], cache[1], meta, head_dim ** -0.5, o)
            results[name] = (_time_us(step, plan.device, reps), o.float().cpu())
        (t_split, o_split), (t_one, o_one) = results["split_kv"], results["one_pass"]
        out[str(ctx)] = {"split_kv_us": round(t_split, 2), "one_pass_us": round(t_one, 2),
                         "speedup": round(t_one / t_split, 2),
                         "max_abs_diff": (o_split - o_one).abs().max().item()}
    return out
