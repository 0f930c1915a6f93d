"""The shared-memory collectives of CPU tensor parallelism (engine/distributed/shm.py), between
three real processes joined by torch.distributed (gloo), as the ranks of an engine are: the same
bits as the sums and concatenations torch computes, through several chunks, for float32 and
bfloat16; every rank falls back to gloo together; a rank that dies mid-collective is named
within seconds instead of hanging the others. The engine's own parity through these
collectives is tests/test_tensor_parallel.py."""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback

import pytest
import torch

from tests.conftest import free_port

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")


def _inputs(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    return (torch.randn(n, generator=g) * (rank + 1)).to(dtype)


def _check_collectives(comm, rank: int, world: int) -> None:
    from engine.distributed import shm
    per_slot = shm.SLOT_BYTES // 4
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 577, per_slot, 2 * per_slot + 3):       # float32: 1, 1 and 3 chunks
            x = _inputs(rank, n, dtype)
            # rank order; bfloat16 summed in float32 and rounded once
            expected = sum(_inputs(r, n, dtype).float() for r in range(world)).to(dtype)
            assert comm.handles(x)
            assert torch.equal(comm.all_reduce(x), expected), (dtype, n)
        rows = _inputs(rank, 5 * 16384, dtype).view(5, 16384)   # 64 KiB rows, as logits
        many = _inputs(rank, 70 * 16384, dtype).view(70, 16384)  # over one slot at float32
        for x in (rows, many):
            full = torch.cat([_inputs(r, x.numel(), dtype).view(x.shape)
                              for r in range(world)], dim=1)
            assert comm.handles(x, gather=True)
            assert torch.equal(comm.all_gather_rows(x), full)
    assert not comm.handles(torch.zeros(4, dtype=torch.float64))
    assert not comm.handles(torch.zeros(4, 4).t())


def _no_compiler():
    raise OSError("no C compiler")


def _rank(rank: int, world: int, port: int, errors) -> None:
    """One rank's scenarios, in the same order on every rank; the last rank dies at the end."""
    try:
        import torch.distributed as dist

        from engine.distributed import shm
        from engine.distributed.parallel import TensorParallelGroup

        torch.set_num_threads(1)
        if rank == 1:            # this rank cannot build the helper: every rank keeps gloo
            real, shm._library = shm._library, _no_compiler
        group = TensorParallelGroup.init("gloo", rank, world, port)
        assert group.shm is None and group.transport == "gloo"
        if rank == 1:
            shm._library = real
        comm = shm.connect(rank, world)
        assert comm is not None
        _check_collectives(comm, rank, world)
        group.shm = comm                          # the group's own calls take it
        assert group.transport == "shared memory"
        x = _inputs(rank, 9, torch.float32)
        assert torch.equal(group.all_reduce(x.clone()), sum(_inputs(r, 9, torch.float32)
                                                            for r in range(world)))
        dist.barrier()
        if rank == world - 1:
            os._exit(7)                           # dies before the next collective
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=f"rank {world - 1} exited"):
            comm.all_reduce(torch.ones(8))
        assert time.monotonic() - t0 < 10
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise SystemExit(1)


@pytest.mark.parametrize("world", [2, 3], ids=["spinning", "more-ranks-than-cpus"])
def test_collectives_match_torch_fall_back_together_and_name_a_dead_rank(world, monkeypatch):
    """2 ranks on the 2-CPU hosts spin before sleeping; 3 sleep at once (shm_comm.c)."""
    monkeypatch.setenv("CONTINUUM_TP_SHM", "1")        # the ranks inherit it
    from engine.halt_poll import find_compiler
    if find_compiler() is None:
        pytest.skip("needs a C compiler (cc, gcc or $CC) for the shared-memory helper")
    ctx = multiprocessing.get_context("spawn")
    errors, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, errors))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, "\n".join(failures)
    assert codes == [0] * (world - 1) + [7], codes
    if os.path.isdir("/dev/shm"):              # the mapping's file was unlinked at start
        assert not [f for f in os.listdir("/dev/shm") if f.startswith("continuum-tp-")]
