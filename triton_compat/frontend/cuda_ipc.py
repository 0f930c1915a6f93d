"""CUDA IPC memory for the CUDA shared-memory extension, through cuda-python's runtime API.

Owns: whether CUDA can be used here, opening a client's `cudaIpcMemHandle_t` on a device
(`cudaIpcOpenMemHandle`), and copying between a region and host memory for the CPU backends
(`cudaMemcpy`). Imported only when a CUDA region is registered; on a host without a CUDA device
or without cuda-python, `available()` is False and registering fails with Triton's text.
Untested on this project's CPU machines (no GPU is lent to every task): the test skips there.
"""

from __future__ import annotations

from dataclasses import dataclass

from triton_compat.errors import InferError


def _runtime():
    try:
        from cuda.bindings import runtime            # cuda-python >= 12.6
    except ImportError:
        from cuda import cudart as runtime           # older cuda-python
    return runtime


def available() -> bool:
    """True when a CUDA device and cuda-python are both present."""
    try:
        import torch
        if not torch.cuda.is_available():
            return False
        _runtime()
        return True
    except Exception:
        return False


@dataclass
class CudaBlock:
    """An opened IPC allocation: its device pointer (int) and device id."""

    pointer: int
    device_id: int


def _check(result, what: str):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise InferError(f"failed to register shared memory region: {what}: {err}", 400)
    return rest[0] if rest else None


def open_handle(name: str, raw_handle: bytes, device_id: int, byte_size: int) -> CudaBlock:
    """Open `raw_handle` (64 bytes) on `device_id`. Raises InferError on a CUDA error."""
    rt = _runtime()
    _check(rt.cudaSetDevice(device_id), "cudaSetDevice")
    handle = rt.cudaIpcMemHandle_t()
    handle.reserved = raw_handle
    pointer = _check(rt.cudaIpcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess),
                     f"region '{name}': cudaIpcOpenMemHandle")
    return CudaBlock(int(pointer), device_id)


def read(block: CudaBlock, offset: int, byte_size: int) -> bytearray:
    """Copy `byte_size` bytes at `offset` of the block to host memory."""
    rt = _runtime()
    host = bytearray(byte_size)
    import ctypes
    buf = (ctypes.c_char * byte_size).from_buffer(host)
    _check(rt.cudaMemcpy(ctypes.addressof(buf), block.pointer + offset, byte_size,
                         rt.cudaMemcpyKind.cudaMemcpyDeviceToHost), "cudaMemcpy")
    return host


def write(block: CudaBlock, offset: int, data: bytes) -> None:
    """Copy `data` into the block at `offset`."""
    rt = _runtime()
    import ctypes
    buf = ctypes.create_string_buffer(data, len(data))
    _check(rt.cudaMemcpy(block.pointer + offset, ctypes.addressof(buf), len(data),
                         rt.cudaMemcpyKind.cudaMemcpyHostToDevice), "cudaMemcpy")


def close(block: CudaBlock) -> None:
    """Close the IPC mapping (unregister)."""
    _runtime().cudaIpcCloseMemHandle(block.pointer)
