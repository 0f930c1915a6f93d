"""engine/halt_poll.py: where halt polling runs (a guest whose kernel does not poll, or as
CONTINUUM_HALT_POLL says), and that its thread spins only at SCHED_IDLE, only until the
deadline it is given, and then blocks. The end-to-end check that a server idle after a run of
requests spends no CPU is in tests/test_v2_http_wire.py."""

from __future__ import annotations

import os
import time

import pytest

from engine.halt_poll import HaltPoll, build, find_compiler, wanted


def _host(tmp_path, flags: str, driver: str | None, poll_ns: str | None = "200000"):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 {flags}\n\n")
    cpuidle = tmp_path / "driver"
    if driver is not None:
        cpuidle.write_text(driver + "\n")
    limit = tmp_path / "guest_halt_poll_ns"
    if poll_ns is not None:
        limit.write_text(poll_ns + "\n")
    return dict(cpuinfo=str(cpuinfo), cpuidle=str(cpuidle), poll_ns=str(limit))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="auto needs two CPUs to use")
def test_auto_polls_in_a_guest_whose_kernel_does_not(tmp_path):
    assert wanted(None, **_host(tmp_path, "avx2 hypervisor", "none"))[0]
    assert wanted("auto", **_host(tmp_path, "hypervisor", None))[0]         # no cpuidle at all
    assert not wanted(None, **_host(tmp_path, "hypervisor", "haltpoll"))[0]  # the kernel polls
    assert not wanted(None, **_host(tmp_path, "avx2", "intel_idle"))[0]      # bare metal
    assert not wanted(None, **_host(tmp_path, "hypervisor", "haltpoll", None))[0]  # default limit


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="auto needs two CPUs to use")
def test_auto_polls_where_the_haltpoll_driver_may_not(tmp_path):
    """A firecracker guest's kernel loads the haltpoll driver with guest_halt_poll_ns 0: its
    POLL state is never entered, so its CPUs halt at once as without the driver."""
    on, why = wanted(None, **_host(tmp_path, "hypervisor", "haltpoll", "0"))
    assert on and "guest_halt_poll_ns 0" in why


def test_the_environment_decides_first(tmp_path):
    bare = _host(tmp_path, "avx2", "intel_idle")
    assert wanted("1", **bare) == (True, "CONTINUUM_HALT_POLL=1")
    assert not wanted("0", **_host(tmp_path, "hypervisor", "none"))[0]
    with pytest.raises(ValueError, match="CONTINUUM_HALT_POLL must be 0, 1 or auto"):
        wanted("yes", **bare)


def _cpu_ticks(tid: int) -> int:
    """A thread's user + system time in clock ticks."""
    fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


@pytest.mark.skipif(find_compiler() is None, reason="the helper needs a C compiler")
def test_the_thread_spins_at_idle_priority_until_its_deadline_then_sleeps():
    import ctypes

    poll = HaltPoll(ctypes.CDLL(str(build())))
    try:
        deadline = time.monotonic() + 10

        def until(condition) -> bool:
            while not condition() and time.monotonic() < deadline:
                time.sleep(0.001)
            return condition()

        assert until(lambda: poll.sleeping)  # nothing asked yet: it sleeps
        tid = poll.native_id
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE   # never ahead of a runnable thread
        poll.keep_warm(0.3)
        assert until(lambda: not poll.sleeping)
        poll.keep_warm(0.001)                # an earlier deadline does not cut the later one
        time.sleep(0.1)
        assert not poll.sleeping
        assert until(lambda: poll.sleeping)  # the deadline passed: it sleeps
        idle = _cpu_ticks(tid)
        time.sleep(1.0)
        assert _cpu_ticks(tid) - idle <= 0.05 * os.sysconf("SC_CLK_TCK")
        poll.keep_warm(0.05)                 # and wakes when asked again
        assert until(lambda: not poll.sleeping)
    finally:
        poll.stop(timeout=10)
    assert not poll._thread.is_alive()
