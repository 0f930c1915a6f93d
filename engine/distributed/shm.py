"""Shared-memory collectives for the tensor-parallel ranks of one CPU host.

Owns: `ShmCommunicator` (one rank's view of a shared mapping and the C helper `shm_comm.c`,
built by `engine.halt_poll.build_helper` and called via ctypes) and `connect`, which sets it up
over an already formed torch.distributed group. In: contiguous float32 / bfloat16 CPU tensors;
out: the same tensor summed over the ranks in place (`all_reduce`), or every rank's rows side
by side (`all_gather_rows`). The algorithm and its waiting are in shm_comm.c's header comment.

Why: gloo's TCP transport hands each collective between its I/O thread and the caller through
loopback sockets and futex wake-ups, ~100 µs and more per collective where the model makes
two per layer; and where ranks share CPUs (more ranks than cores) every hand-off waits for a
scheduler turn. On the 2-CPU AVX2 host, 3 ranks took 215-239 ms a decode token through gloo
against 11-12 ms for one rank (docs/serving.md, "Tensor parallelism").

The mapping is a file in /dev/shm (else the temporary directory) that rank 0 creates,
reserves (`posix_fallocate`: a full /dev/shm is an error here, not a SIGBUS later) and unlinks
once every rank has mapped it, so a crash leaves nothing behind. Any rank that cannot build
the helper or map the file makes every rank keep gloo (`connect` returns None, logged once).
`CONTINUUM_TP_SHM=0` keeps gloo too.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger("continuum.tp")

ENV = "CONTINUUM_TP_SHM"
SOURCE = Path(__file__).with_name("shm_comm.c")
SLOT_BYTES = 2 << 20          # a chunk of one rank's tensor: larger tensors go in several
SPIN_NS = 1_000_000           # spin this long before sleeping, where every rank has a CPU
TIMEOUT_NS = 300 * 10**9      # one chunk's wait before giving up (parallel.COLLECTIVE_TIMEOUT)
_ERRORS = {-2: "a collective waited over 300 s", -3: "a gathered row is over the slot"}


class _Comm(ctypes.Structure):
    """shm_comm in shm_comm.c."""

    _fields_ = [("base", ctypes.c_void_p), ("slot_bytes", ctypes.c_int64),
                ("rank", ctypes.c_int32), ("world", ctypes.c_int32),
                ("seq", ctypes.c_uint64), ("spin_ns", ctypes.c_int64),
                ("timeout_ns", ctypes.c_int64)]


def _library() -> ctypes.CDLL:
    from engine.halt_poll import build_helper
    lib = ctypes.CDLL(str(build_helper("shm_comm", SOURCE.read_text())))
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    lib.continuum_shm_all_reduce.argtypes = [P, P, I64, ctypes.c_int]
    lib.continuum_shm_all_gather_rows.argtypes = [P, P, P, I64, I64]
    lib.continuum_shm_attach.argtypes = [P]
    for name in ("continuum_shm_all_reduce", "continuum_shm_all_gather_rows",
                 "continuum_shm_max_ranks", "continuum_shm_header_bytes"):
        getattr(lib, name).restype = ctypes.c_int
    lib.continuum_shm_attach.restype = None
    return lib


class ShmCommunicator:
    """Rank `rank` of `world` over the mapping `mm` (`mmap.mmap`, shared, `header_bytes` + 2 *
    world * `SLOT_BYTES` bytes). Every rank must make the same calls in the same order with
    tensors of the same shape and dtype, as with torch.distributed.

    Errors: RuntimeError naming the dead rank when a peer process exits mid-collective, or after
    300 s without the others; the group is then out of step and must be torn down."""

    DTYPES = (torch.float32, torch.bfloat16)

    def __init__(self, lib: ctypes.CDLL, mm: mmap.mmap, rank: int, world: int,
                 spin_ns: int) -> None:
        self._lib, self._mm = lib, mm
        self._view = ctypes.c_char.from_buffer(mm)      # pins the mapping while we use it
        self._comm = _Comm(ctypes.addressof(self._view), SLOT_BYTES, rank, world, 0,
                           spin_ns, TIMEOUT_NS)
        self._ref = ctypes.byref(self._comm)
        self.rank, self.world = rank, world
        lib.continuum_shm_attach(self._ref)

    def handles(self, x: torch.Tensor, gather: bool = False) -> bool:
        """Whether `x` can go through shared memory (a contiguous float32 / bfloat16 CPU
        tensor; to be gathered, `[N, C]` with a row within `SLOT_BYTES`); other tensors take
        torch.distributed."""
        if gather and (x.dim() != 2 or x.shape[1] * x.element_size() > SLOT_BYTES):
            return False
        return x.device.type == "cpu" and x.dtype in self.DTYPES and x.is_contiguous()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` (any shape; `handles(x)`) over the ranks in place, in rank order (every rank
        gets the same bits; bfloat16 summed in float32 and rounded once). Returns `x`."""
        rc = self._lib.continuum_shm_all_reduce(self._ref, x.data_ptr(), x.numel(),
                                                int(x.dtype == torch.bfloat16))
        self._check(rc)
        return x

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """`[N, C]` on each rank (`handles(x, gather=True)`) → `[N, world * C]`, rank r's
        columns at r * C."""
        rows, cols = x.shape
        row_bytes = cols * x.element_size()
        out = torch.empty(rows, self.world * cols, dtype=x.dtype)
        self._check(self._lib.continuum_shm_all_gather_rows(self._ref, x.data_ptr(),
                                                            out.data_ptr(), rows, row_bytes))
        return out

    def _check(self, rc: int) -> None:
        if rc > 0:
            raise RuntimeError(f"tensor-parallel rank {rc - 1} exited during a collective")
        if rc < 0:
            raise RuntimeError(_ERRORS.get(rc, f"shared-memory collective failed ({rc})"))

    def close(self) -> None:
        """Unmap (after the group's last collective)."""
        self._ref = None
        del self._view
        self._mm.close()


def connect(rank: int, world: int) -> ShmCommunicator | None:
    """The group's `ShmCommunicator`, set up over the default torch.distributed group (every
    rank must call this at the same point), or None on every rank where any rank cannot (the
    reason logged by rank 0) or `CONTINUUM_TP_SHM=0`."""
    if os.environ.get(ENV, "1").strip() == "0":
        return None
    mm, why, lib = None, "", None
    try:
        lib = _library()
        size = lib.continuum_shm_header_bytes() + 2 * world * SLOT_BYTES
        if world > lib.continuum_shm_max_ranks():
            raise OSError(f"{world} ranks is over {lib.continuum_shm_max_ranks()}")
        path = _create(size) if rank == 0 else None
    except (OSError, subprocess.SubprocessError) as e:
        path, why = None, f"{type(e).__name__}: {e}"
    names = [path]
    dist.broadcast_object_list(names, src=0)
    path = names[0]
    if path is not None and lib is not None:
        try:
            with open(path, "r+b") as f:
                mm = mmap.mmap(f.fileno(), size)
        except OSError as e:
            why = f"{type(e).__name__}: {e}"
    ok = torch.tensor([int(mm is not None)])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if rank == 0 and path is not None:
        os.unlink(path)                 # every rank has tried to map it
    if not ok.item():
        if mm is not None:
            mm.close()
        if why or rank == 0:
            logger.warning("tensor parallel: rank %d: collectives through gloo (no shared "
                           "memory: %s)", rank, why or "another rank could not set it up")
        return None
    from engine.kernels.isa import usable_cpus
    comm = ShmCommunicator(lib, mm, rank, world, SPIN_NS if world <= usable_cpus() else 0)
    dist.barrier()                      # every pid recorded before the first collective
    return comm


def _create(size: int) -> str:
    """A new file of `size` bytes reserved in /dev/shm (else the temporary directory); its
    path. Raises OSError (e.g. ENOSPC where /dev/shm is too small)."""
    where = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix="continuum-tp-", dir=where)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return path
