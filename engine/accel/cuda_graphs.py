"""Decode steps under CUDA graphs: one graph per batch-size bucket, captured once at start over
the runner's step buffers, replayed for every decode-only step.

Owns: `CudaGraphRunner` and the bucket sizes (`graph_buckets`). In: the model, its KV cache,
the runner's `StepBuffers` and attention backend. Out: the hidden states `[bucket, hidden]` of
a replay (rows past the real batch are padding).

Why it is exact: a graph replays the kernels it captured with the same pointers and launch
grids. Everything a decode step changes lives in the buffers (`engine.accel.metadata`: token
ids, positions, slot mapping, block tables, context lengths) and is read by the kernels from
device memory — the attention kernel's grid for a decode-only step is `(bucket, 1,
num_kv_heads)` whatever the contexts, and its loop bounds come from `seq_lens` — so a replay
computes what an eager step would. Padding rows have context 0 and slot -1: they write nothing
and their rows are dropped. The graphs share one memory pool, captured largest first (vLLM's
order), so the smaller ones reuse its blocks.

Buckets: 1, 2, 4, 8, then steps of 16 up to `--max-num-seqs` (and `--max-num-seqs` itself).
Prefill and mixed steps, steps with LoRA adapters and tensor-parallel ranks run eagerly, as
does everything with `--enforce-eager`.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

logger = logging.getLogger("continuum.engine")


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, 16, 32, ... (steps of 16) up to `max_num_seqs`,
    which is always the last."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class CudaGraphRunner:
    """See the module docstring. `capture()` must run before `replay`; `graph_factory` (tests)
    replaces `torch.cuda.CUDAGraph` and the capture context."""

    def __init__(self, model, kv_cache: torch.Tensor, buffers, backend, max_num_seqs: int,
                 graph_factory=None) -> None:
        self.model, self.kv_cache, self.buffers, self.backend = model, kv_cache, buffers, backend
        self.buckets = graph_buckets(min(max_num_seqs, buffers.max_seqs))
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}
        self.factory = graph_factory or _CudaGraphs()

    def bucket_for(self, num_decodes: int) -> int | None:
        """The smallest captured bucket that holds `num_decodes`, or None (run eagerly)."""
        i = bisect.bisect_left(self.buckets, num_decodes)
        return self.buckets[i] if i < len(self.buckets) and self.graphs else None

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket (largest first, one shared pool): a warm-up run (Triton
        compiles its kernels there) then the captured one, each on a step of padding rows.
        Returns the seconds it took."""
        t0 = time.perf_counter()
        for bs in reversed(self.buckets):
            input_ids, positions, meta = self.buffers.fill(self.backend, [], torch.zeros(0),
                                                           torch.zeros(0), [], [], [], 0,
                                                           pad_to=bs)

            def step(input_ids=input_ids, positions=positions, meta=meta):
                return self.model.forward(input_ids, positions, meta, self.kv_cache)

            self.graphs[bs] = self.factory.capture(step)
        seconds = time.perf_counter() - t0
        logger.info("CUDA graphs: %d decode batch sizes (%s) captured in %.1f s",
                    len(self.buckets), _describe(self.buckets), seconds)
        return seconds

    def replay(self, bucket: int) -> torch.Tensor:
        """Replay the graph of `bucket` over the buffers as they are now (the runner filled
        them with `pad_to=bucket`): the hidden states `[bucket, hidden]`, a view of the graph's
        output (valid until the next replay)."""
        graph, out = self.graphs[bucket]
        self.factory.replay(graph)
        return out


class _CudaGraphs:
    """torch.cuda graphs with one memory pool for all of them."""

    def __init__(self) -> None:
        self.pool = None

    def capture(self, step) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):          # warm-up off the capture (as torch advises)
            step()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        return graph, out

    @staticmethod
    def replay(graph) -> None:
        graph.replay()


def _describe(buckets: list[int]) -> str:
    return ", ".join(map(str, buckets)) if len(buckets) <= 6 else \
        f"{buckets[0]}, {buckets[1]}, ..., {buckets[-1]}"
