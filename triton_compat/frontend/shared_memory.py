"""Triton's shared-memory extension: registered system (POSIX) and CUDA regions.

Owns: the table of regions by name, each mapped once at register; handing an inference a view
of `[offset, offset + byte_size)` of a region (`acquire` / `release`, a use count per region);
unregister, refused while an inference uses the region (tritonserver 2.51's
UnregisterHelper); and the checks with tritonserver 2.51's texts (shared_memory_manager.cc,
http_server.cc), answered 400 where a client's mistake gets 500 there
(docs/triton-conformance.md). Client shared memory is refused unless the server runs with
`--allow-client-shm` (a flag of later Tritons; off by default), with 403 over HTTP and
UNAVAILABLE over gRPC, as Triton refuses a restricted API.

System regions are opened as `shm_open` opens them on Linux: the file `/dev/shm/<key without
its leading slashes>`. A key can never name anything else: it must be one path component, not
`.` or `..`, and not Triton's reserved `triton_python_backend_shm_region_` prefix.
CUDA regions (`cudaIpcMemHandle_t`, 64 bytes) are opened with cuda-python where CUDA is present;
elsewhere registering one fails with Triton's "GPUs not supported" text.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass

from triton_compat.errors import InferError

SHM_DIR = "/dev/shm"
RESERVED_PREFIX = "triton_python_backend_shm_region_"          # Triton's common.h
CLIENT_SHM_DISABLED = ("Client shared memory is disabled. Start the server with "
                       "'--allow-client-shm=true' to enable.")  # kClientShmDisabledErrorStr
CUDA_IPC_HANDLE_BYTES = 64
# TRITONSERVER_Error codes -> HTTP status (Triton's HttpCodeFromError)
NOT_FOUND, INVALID_ARG = 404, 400
# client shared memory off: HTTP 403 and gRPC UNAVAILABLE, the codes of a restricted API
SHM_OFF_STATUS, SHM_OFF_CODE = 403, "UNAVAILABLE"


@dataclass
class Region:
    """A registered region: what status reports, its mapping, and its in-flight uses."""

    name: str
    kind: str                           # "system" or "cuda"
    key: str
    offset: int
    byte_size: int
    device_id: int = 0
    buffer: object = None               # system: mmap of [0, offset + byte_size) of the object
    uses: int = 0                       # inferences holding it (unregister refused meanwhile)

    def status(self) -> dict:
        """The region's entry in a status response (Triton's GetStatus)."""
        if self.kind == "system":
            return {"name": self.name, "key": self.key, "offset": self.offset,
                    "byte_size": self.byte_size}
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}


# tritonserver 2.51 (a GPU build) on a host without a GPU, for a handle it cannot open
CUDA_INVALID = "failed to register shared memory region: invalid args"


def cuda_unavailable() -> InferError:
    """Registering a CUDA region where there is no CUDA: tritonserver 2.51's answer on a host
    without a GPU (400)."""
    return InferError(CUDA_INVALID, INVALID_ARG)


def key_path(key: str) -> str:
    """The file `shm_open(key)` opens. Raises InferError(400) with tritonserver 2.51's text
    for a key `shm_open` cannot open: more than one path component, `.` or `..`, or Triton's
    reserved `triton_python_backend_shm_region_` prefix (checked here, before the file system
    is touched, so a key never names anything outside /dev/shm)."""
    bare = key.lstrip("/")
    if not bare or "/" in bare or bare in (".", "..") or "\0" in bare or \
            bare.startswith(RESERVED_PREFIX):
        raise InferError(f"Unable to open shared memory region: '{key}'", INVALID_ARG)
    return os.path.join(SHM_DIR, bare)


class SharedMemoryManager:
    """The server's registered regions; thread-safe (one lock)."""

    def __init__(self, allow_client_shm: bool = False) -> None:
        self.allow = allow_client_shm
        self.lock = threading.Lock()
        self.regions: dict[str, Region] = {}

    def check_allowed(self) -> None:
        """Raise InferError (403 / UNAVAILABLE, as a restricted API) unless client shared
        memory is allowed (--allow-client-shm)."""
        if not self.allow:
            raise InferError(CLIENT_SHM_DISABLED, SHM_OFF_STATUS, SHM_OFF_CODE)

    def register_system(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map `byte_size` bytes at `offset` of the POSIX shared-memory object `key` as region
        `name`. Raises InferError with Triton's texts: refused (client shm off), no name,
        invalid key, name taken (400, ALREADY_EXISTS over gRPC), object not found, out of
        bounds (400)."""
        self.check_allowed()
        if not name:
            raise InferError("'region name' is necessary to register system shared memory "
                             "region", INVALID_ARG)
        path = key_path(key)
        with self.lock:
            if name in self.regions:
                raise InferError(f"shared memory region '{name}' already in manager",
                                 400, "ALREADY_EXISTS")
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:        # Triton's text; its code is INTERNAL (500), but a key that
                # names no object is the client's mistake: 400 here
                raise InferError(f"Unable to open shared memory region: '{key}'",
                                 INVALID_ARG) from None
            try:
                size = os.fstat(fd).st_size
                if offset + byte_size > size:
                    raise InferError(f"failed to register shared memory region '{name}': "
                                     "invalid args", INVALID_ARG)
                try:
                    buffer = mmap.mmap(fd, offset + byte_size) if offset + byte_size else b""
                except (OSError, ValueError) as e:
                    raise InferError(f"failed to register shared memory region '{name}': "
                                     f"unable to process address space{e.strerror or e}",
                                     INVALID_ARG) from None
            finally:
                os.close(fd)
            self.regions[name] = Region(name, "system", key, offset, byte_size, buffer=buffer)

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int,
                      byte_size: int) -> None:
        """Open a CUDA IPC memory handle as region `name`. Raises InferError: refused, no name,
        a handle that is not a cudaIpcMemHandle_t, no CUDA here (tritonserver 2.51's text on a
        host without a GPU), or the CUDA error."""
        self.check_allowed()
        if not name:
            raise InferError("'region name' is necessary to register cuda shared memory "
                             "region", INVALID_ARG)
        from triton_compat.frontend import cuda_ipc
        if not cuda_ipc.available():
            raise cuda_unavailable()
        if len(raw_handle) != CUDA_IPC_HANDLE_BYTES:
            raise InferError("'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t",
                             INVALID_ARG)
        with self.lock:
            if name in self.regions:
                raise InferError(f"shared memory region '{name}' already in manager",
                                 400, "ALREADY_EXISTS")
            tensor = cuda_ipc.open_handle(name, raw_handle, device_id, byte_size)
            self.regions[name] = Region(name, "cuda", "", 0, byte_size, device_id,
                                        buffer=tensor)

    def status(self, kind: str, name: str = "") -> list[dict]:
        """Status entries of every `kind` region, or of region `name`. Raises InferError(404)
        for an unknown name or one registered as the other kind."""
        with self.lock:
            if not name:
                return [r.status() for _, r in sorted(self.regions.items()) if r.kind == kind]
            region = self.regions.get(name)
            label = "system" if kind == "system" else "cuda"
            if region is None:
                raise InferError(f"Unable to find {label} shared memory region: '{name}'",
                                 NOT_FOUND)
            if region.kind != kind:
                this, other = (("CUDA", "system") if region.kind == "cuda"
                               else ("system", "CUDA"))
                raise InferError(f"The region named '{name}' is registered as {this} shared "
                                 f"memory, not {other} shared memory", NOT_FOUND)
            return [region.status()]

    def unregister(self, kind: str, name: str = "") -> None:
        """Unregister region `name` of `kind`, or every `kind` region when `name` is empty.
        An unknown name succeeds. Raises InferError(400) with tritonserver 2.51's texts for a
        region an inference is using (every other region of an unregister-all still goes)."""
        self.check_allowed()
        with self.lock:
            names = [name] if name else [n for n, r in self.regions.items() if r.kind == kind]
            busy = []
            for n in names:
                region = self.regions.get(n)
                if region is None or region.kind != kind:
                    continue
                if region.uses:
                    busy.append(n)
                else:
                    self._drop(region)
        if busy and name:
            raise InferError(f"Cannot unregister shared memory region '{name}', it is "
                             "currently in use.", INVALID_ARG)
        if busy:
            label = "system" if kind == "system" else "cuda"
            raise InferError(f"Failed to unregister the following {label} shared memory "
                             "regions: " + "".join(f"{n} ," for n in busy), INVALID_ARG)

    def _drop(self, region: Region) -> None:
        del self.regions[region.name]
        if region.kind == "cuda":
            from triton_compat.frontend import cuda_ipc
            cuda_ipc.close(region.buffer)
        elif isinstance(region.buffer, mmap.mmap):
            try:
                region.buffer.close()
            except BufferError:   # a model still holds an array over it: unmapped at its GC
                pass
        region.buffer = None

    def acquire(self, ref) -> tuple[Region, memoryview]:
        """A view of `ref` (region, offset, byte_size) for one inference; the region stays
        mapped until `release`; it is shorter than `ref.byte_size` when offset + byte_size
        wraps past 2**64. Raises InferError with Triton's texts (GetMemoryInfo): unknown region
        (404), offset outside it, offset + byte_size outside it (400)."""
        with self.lock:
            region = self.regions.get(ref.region)
            if region is None:
                raise InferError(f"Unable to find shared memory region: '{ref.region}'",
                                 NOT_FOUND)
            if ref.offset >= region.byte_size:
                raise InferError(f"Invalid offset for shared memory region: '{ref.region}'",
                                 INVALID_ARG)
            # the sum as tritonserver 2.51 computes it, in 64 bits: a byte_size that wraps
            # it passes here, and the tensor's size check then refuses it
            if (ref.offset + ref.byte_size) % (1 << 64) > region.byte_size:
                raise InferError("Invalid offset + byte size for shared memory region: "
                                 f"'{ref.region}'", INVALID_ARG)
            region.uses += 1
        if region.kind == "cuda":             # the CPU backends get a host copy
            from triton_compat.frontend import cuda_ipc
            return region, memoryview(cuda_ipc.read(region.buffer, ref.offset, ref.byte_size))
        start = region.offset + ref.offset
        return region, memoryview(region.buffer)[start:start + ref.byte_size]

    def release(self, region: Region) -> None:
        """End one inference's use of `region`."""
        with self.lock:
            region.uses -= 1

    def write(self, ref, data: bytes, output: str) -> None:
        """Copy an output's bytes into `ref` (a region acquired by this inference). Raises
        InferError(400) when they do not fit, with Triton's text (Triton's allocator answers
        INTERNAL; a region too small is the client's mistake, so 400 here)."""
        if len(data) > ref.byte_size:
            raise InferError(f"shared memory size specified with the request for output "
                             f"'{output}' ({ref.byte_size} bytes) should be at least "
                             f"{len(data)} bytes to hold the results", INVALID_ARG)
        with self.lock:
            region = self.regions[ref.region]
        if region.kind == "cuda":
            from triton_compat.frontend import cuda_ipc
            cuda_ipc.write(region.buffer, ref.offset, data)
            return
        start = region.offset + ref.offset
        region.buffer[start:start + len(data)] = data

    def close(self) -> None:
        """Unmap everything (server shutdown)."""
        with self.lock:
            for region in list(self.regions.values()):
                self._drop(region)
