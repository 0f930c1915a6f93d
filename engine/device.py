"""The one place that names a device: resolves `--device` and answers device questions.

Owns: the choice among `cpu`, `cuda` and `npu` (Ascend, through `torch_npu`, imported lazily),
dtype resolution (`--dtype auto`: bfloat16 on an accelerator, on a CPU with bfloat16 matmul
units (AMX, AVX512-BF16) and for quantized weights on AVX-512; float32 on other CPUs),
memory figures used to size the KV cache, the zero tensors the KV cache and its swap pool live
in (`Device.zeros`, `Device.swap_pool`: lazily mapped pages on the CPU) and synchronisation for
timing (the process's heap: `engine.heap`). Every other module in the engine talks to the device
through torch with the `torch.device` returned here.
"""

from __future__ import annotations

import importlib
import math
import mmap
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DeviceUnavailableError(RuntimeError):
    """The requested device cannot be used here (missing package or hardware)."""


@dataclass(frozen=True)
class Device:
    """A resolved device: `kind` is "cpu", "cuda" or "npu"; `torch_device` is what tensors use."""

    kind: str
    torch_device: torch.device

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU); call before reading a timer."""
        if self.kind == "cuda":
            torch.cuda.synchronize(self.torch_device)
        elif self.kind == "npu":
            torch.npu.synchronize(self.torch_device)  # type: ignore[attr-defined]

    def activate(self) -> None:
        """Make this the process's current accelerator (`torch.cuda.set_device` /
        `torch.npu.set_device`): kernels that launch on the current device, as Triton's do,
        and CUDA graph capture then run on this one (`cuda:N`, a tensor-parallel rank's). A
        no-op on the CPU."""
        if self.kind != "cpu":
            getattr(torch, self.kind).set_device(self.torch_device)

    def memory_info(self) -> tuple[int, int] | None:
        """(free, total) device memory in bytes, or None on CPU (host memory is sized by
        flags)."""
        if self.kind == "cpu":
            return None
        return tuple(getattr(torch, self.kind).mem_get_info(self.torch_device))

    def memory_stats(self):
        """The accelerator's torch allocator module (`torch.cuda` / `torch.npu`: its
        `max_memory_allocated`, `memory_reserved`, `reset_peak_memory_stats`), None on CPU."""
        return None if self.kind == "cpu" else getattr(torch, self.kind)

    def kernels(self, dtype: torch.dtype):
        """The model runner's compiled kernels (paged attention, fused elementwise ops) for
        `dtype` on this device, or None for the pure-torch path: `engine.kernels.CpuKernels` on
        the CPU for float32 / bfloat16 (built on first use; None without a C compiler or with
        `CONTINUUM_CPU_KERNELS=0`)."""
        if self.kind != "cpu":
            return None
        from engine import kernels
        return kernels.load() if kernels.CpuKernels.supports(dtype) else None

    def cpu_isa(self) -> str | None:
        """The CPU ISA level the kernels and linear layers target ("avx512", "avx2",
        "generic"; `engine.kernels.isa`), or None off the CPU."""
        if self.kind != "cpu":
            return None
        from engine.kernels.isa import cpu_isa
        return cpu_isa()

    def linear_path(self, dtype: torch.dtype) -> str:
        """Which GEMM the model's linear layers use for `dtype` here: "onednn", "kernel" or
        "torch" (`engine.linear.linear_path`). Raises ValueError (one line) for a dtype this
        device cannot run."""
        from engine.linear import linear_path
        return linear_path(self.kind, dtype, self.kernels(dtype))

    @property
    def dist_backend(self) -> str:
        """The `torch.distributed` backend for tensor parallelism on this kind of device:
        gloo on the CPU, nccl on CUDA, hccl on an Ascend NPU (registered by `torch_npu`)."""
        return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[self.kind]

    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError (one line) when an accelerator has fewer devices than `world_size`
        ranks need (one each); the CPU takes any number of ranks."""
        if self.kind == "cpu":
            return
        count = getattr(torch, self.kind).device_count()
        if count < world_size:
            raise ValueError(f"--tensor-parallel-size {world_size} needs {world_size} {self.kind} "
                             f"devices, one per rank; {count} visible")

    def for_rank(self, rank: int) -> Device:
        """The device a tensor-parallel rank runs on: `cuda:rank` / `npu:rank` (one accelerator
        per rank, as vLLM places them); the CPU is shared by every rank."""
        if self.kind == "cpu":
            return self
        return Device(self.kind, torch.device(self.kind, rank))

    @property
    def pin_memory(self) -> bool:
        """Whether host buffers for swapping should be pinned (only with an accelerator)."""
        return self.kind != "cpu"

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero tensor of `shape` and `dtype` on this device (a KV cache, GiB-sized): on the
        CPU, `host_zeros`'s lazily mapped pages; elsewhere `torch.zeros`."""
        if self.kind == "cpu":
            return host_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=self.torch_device)

    def swap_pool(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero host tensor for swapped-out KV blocks: pinned where an accelerator copies
        from it (`pin_memory`), else `host_zeros`'s lazily mapped pages."""
        if self.pin_memory:
            return torch.zeros(shape, dtype=dtype, pin_memory=True)
        return host_zeros(shape, dtype)


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of zeros (`shape`, `dtype`) in an anonymous mapping of its own:
    the kernel zero-fills each page when it is first touched (POSIX `MAP_ANONYMOUS`), so the
    tensor costs neither time nor resident memory until its pages are used. For KV caches and
    swap pools, which are sized in GiB and mostly untouched at first: `torch.zeros` wrote every
    page at start (measured on an AMD EPYC Zen 3 guest: 0.22 s for a 0.5 GiB cache, 3.7 s for
    the default 4 GiB `--swap-space` of `--preemption-mode swap / auto`). The mapping is freed
    with the last tensor viewing it. Page-aligned (4 KiB). Raises OSError where the kernel
    refuses a mapping of `prod(shape) * dtype.itemsize` bytes (as `torch.zeros` would raise
    RuntimeError for memory it cannot allocate)."""
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)   # holds buf alive


def _npu_available() -> bool:
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


def resolve_device(name: str = "auto") -> Device:
    """Resolve `--device` ("auto", "cpu", "cuda", "cuda:N", "npu", "npu:N").

    "auto" picks CUDA if available, then an Ascend NPU, then the CPU.

    Raises: DeviceUnavailableError with a one-line reason (e.g. `torch_npu` not installed);
    ValueError for an unknown name.
    """
    kind, _, index = name.partition(":")
    if kind == "auto":
        if torch.cuda.is_available():
            return Device("cuda", torch.device("cuda", 0))
        if _npu_available():
            return Device("npu", torch.device("npu", 0))
        return Device("cpu", torch.device("cpu"))
    if kind == "cpu":
        return Device("cpu", torch.device("cpu"))
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError("--device cuda: no CUDA device is visible to torch "
                                         f"{torch.__version__}")
        return Device("cuda", torch.device("cuda", int(index or 0)))
    if kind == "npu":
        try:
            importlib.import_module("torch_npu")
        except ImportError as e:
            raise DeviceUnavailableError(
                "--device npu needs the Ascend PyTorch adapter: pip install torch_npu "
                f"(import failed: {e})") from None
        if not torch.npu.is_available():  # type: ignore[attr-defined]
            raise DeviceUnavailableError("--device npu: torch_npu is installed but sees no NPU")
        return Device("npu", torch.device("npu", int(index or 0)))
    raise ValueError(f"--device must be auto, cpu, cuda or npu, got {name!r}")


def check_device_dtype(device_name: str, dtype_name: str, kv_cache_dtype: str = "auto") -> None:
    """Fail fast, before any engine starts, where `--dtype` cannot run on `--device` here (e.g.
    float16 on a CPU without a float16 matmul), an 8-bit `--kv-cache-dtype` is asked of an
    accelerator (its attention backends read the model dtype only), or `CONTINUUM_CPU_ISA` is
    invalid.

    Raises: ValueError or DeviceUnavailableError, each one line saying what to use instead."""
    device = resolve_device(device_name)
    device.cpu_isa()                        # raises for a bad CONTINUUM_CPU_ISA
    device.linear_path(resolve_dtype(dtype_name, device))
    check_kv_cache_dtype(kv_cache_dtype, device)


def check_kv_cache_dtype(name: str, device: Device) -> None:
    """Raises ValueError (one line) for an 8-bit KV cache on a device without it: the CPU
    kernels, the torch path and the CUDA (Triton) kernels read 8-bit caches; the NPU's fused
    operators here take only the model dtype."""
    if name != "auto" and device.kind == "npu":
        raise ValueError(f"--kv-cache-dtype {name}: 8-bit KV caches run on the CPU and CUDA; "
                         "the npu attention backend reads only the model dtype (use "
                         "--kv-cache-dtype auto)")


def resolve_dtype(name: str, device: Device, quantized: bool = False) -> torch.dtype:
    """Resolve `--dtype` ("auto", "float32", "bfloat16", "float16") for `device`; `quantized`:
    the linears are served as quantized blocks by the CPU kernels (`engine.quant`).

    "auto" is bfloat16 on an accelerator; on the CPU, bfloat16 where the engine's level has
    bfloat16 matmul units (`engine.kernels.isa.bf16_matmul`: AMX-BF16 or AVX512-BF16, as
    vLLM's `auto` takes the checkpoint's bfloat16 there) and, on any AVX-512 or AVX2 host, for
    a quantized model, whose products the block kernels compute in float32 or int8 whatever the
    activations: there a bfloat16 KV cache and activations measured 1.0 / 1.16 / 1.28x float32's
    throughput at concurrency 1 / 16 / 64 on an AVX-512 host without BF16, and 1.13 / 1.26 /
    1.64x at 1 / 4 / 16 at the AVX2 level with int8 activations (docs/cpu.md).
    float32 elsewhere (dense weights without bfloat16 units, whose bfloat16 products would be
    converted to float32). `--dtype float32` is the exact reference everywhere.
    Raises: ValueError for an unknown name.
    """
    if name == "auto":
        if device.kind != "cpu":
            return torch.bfloat16
        from engine.kernels.isa import at_least, bf16_matmul
        fast = bf16_matmul() or (quantized and at_least("avx2"))
        return torch.bfloat16 if fast else torch.float32
    if name not in DTYPES:
        raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {name!r}")
    return DTYPES[name]
