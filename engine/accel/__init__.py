"""The accelerator half of the model runner: attention backends for CUDA (kernels in Triton's
language) and Ascend NPUs (torch_npu's fused operators), the step's device buffers, CUDA graphs
for decode steps, and the KV-cache memory profile behind `--gpu-memory-utilization`.

Owns: the choice of attention backend for a device (`attention_backend`, `backend_name`) and of
its fused elementwise ops (`fused_ops`). In:
the device kind. Out: a backend object with `name`, `block_dim` (the block axis of the runner's
cache), `sliding_window` (whether `forward` applies a layer's window), `cache_shape(...)`,
`check_dtype(dtype)` (ValueError, one line, for a dtype it cannot run) and `forward(q, k, v,
k_cache, v_cache, meta, scale, window)`, or None where the model runner keeps its CPU path
(`engine.attention`: compiled C kernels or torch).

`CONTINUUM_ATTENTION_BACKEND` = `triton` or `npu` forces a backend on any device: with
`TRITON_INTERPRET=1` (Triton's numpy interpreter) or a stand-in `torch_npu` module the whole
engine runs either accelerator path on the CPU, which is how the tests check them here.
"""

from __future__ import annotations

import os

BACKENDS = ("triton", "npu")


def backend_name(device_kind: str) -> str | None:
    """"triton" on CUDA, "npu" on an NPU, None on the CPU — unless
    `CONTINUUM_ATTENTION_BACKEND` names one. Raises ValueError (one line) for an unknown name."""
    forced = os.environ.get("CONTINUUM_ATTENTION_BACKEND", "auto")
    if forced not in ("auto",) + BACKENDS:
        raise ValueError(f"CONTINUUM_ATTENTION_BACKEND must be auto, triton or npu, got {forced!r}")
    return forced if forced != "auto" else {"cuda": "triton", "npu": "npu"}.get(device_kind)


def has_sliding_window(device_kind: str) -> bool:
    """Whether the attention on `device_kind` applies sliding windows (the Triton kernels do;
    the CPU paths and the NPU operators attend fully, so the engine caps max_model_len at a
    model's window there)."""
    return backend_name(device_kind) == "triton"


def fused_ops(device_kind: str, dtype):
    """The fused elementwise ops (`model.fused`) for a model of `dtype` on an accelerator:
    `TritonFused` with the Triton backend in float16 / bfloat16, else None (float32 keeps
    torch's ops, bit-identical to transformers; the NPU path keeps torch's)."""
    import torch
    if backend_name(device_kind) != "triton" or dtype not in (torch.float16, torch.bfloat16):
        return None
    from engine.accel.triton_fused import TritonFused
    return TritonFused()


def attention_backend(device_kind: str, kv=None):
    """The attention backend for `device_kind` (`backend_name`): `TritonAttention` (over an
    8-bit cache with `kv`, an `engine.kv_quant.KVQuant`), `NpuAttention` or None. Raises
    ValueError for an unknown forced name or an 8-bit cache on the NPU, ImportError when the
    backend's package (triton, torch_npu) is missing."""
    name = backend_name(device_kind)
    if name == "triton":
        from engine.accel.triton_attention import TritonAttention
        return TritonAttention(kv=kv)
    if kv is not None and name is not None:
        raise ValueError(f"--kv-cache-dtype {kv.name}: the {name} attention backend reads "
                         "only the model dtype (use --kv-cache-dtype auto)")
    if name == "npu":
        from engine.accel.npu_attention import NpuAttention
        return NpuAttention()
    return None
