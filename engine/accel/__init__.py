"""The accelerator half of the model runner: attention backends for CUDA (kernels in Triton's
language) and Ascend NPUs (torch_npu's fused operators), the step's device buffers, CUDA graphs
for decode steps, and the KV-cache memory profile behind `--gpu-memory-utilization`.

Owns: the choice of attention backend for a device (`attention_backend`). In: the device
kind. Out: a backend object with `name`, `block_dim` (the block axis of the runner's cache),
`cache_shape(...)`, `check_dtype(dtype)` (ValueError, one line, for a dtype it cannot run) and
`forward(q, k, v, k_cache, v_cache, meta, scale)`, or None where the model runner keeps its CPU
path (`engine.attention`: compiled C kernels or torch).

`CONTINUUM_ATTENTION_BACKEND` = `triton` or `npu` forces a backend on any device: with
`TRITON_INTERPRET=1` (Triton's numpy interpreter) or a stand-in `torch_npu` module the whole
engine runs either accelerator path on the CPU, which is how the tests check them here.
"""

from __future__ import annotations

import os

BACKENDS = ("triton", "npu")


def attention_backend(device_kind: str, sliding_window: int | None = None):
    """The attention backend for `device_kind` ("cpu", "cuda", "npu"): `TritonAttention` on
    CUDA, `NpuAttention` on an NPU, None on the CPU — unless `CONTINUUM_ATTENTION_BACKEND`
    names one. Raises ValueError (one line) for an unknown name, ImportError when the backend's
    package (triton, torch_npu) is missing."""
    forced = os.environ.get("CONTINUUM_ATTENTION_BACKEND", "auto")
    if forced not in ("auto",) + BACKENDS:
        raise ValueError(f"CONTINUUM_ATTENTION_BACKEND must be auto, triton or npu, got {forced!r}")
    name = forced if forced != "auto" else {"cuda": "triton", "npu": "npu"}.get(device_kind)
    if name == "triton":
        from engine.accel.triton_attention import TritonAttention
        return TritonAttention(sliding_window)
    if name == "npu":
        from engine.accel.npu_attention import NpuAttention
        return NpuAttention(sliding_window)
    return None
