"""Userspace halt-polling: keep this virtual machine's idle CPUs from halting while small
requests follow each other closely.

Why: in a guest, a CPU with nothing to run executes HLT, the hypervisor takes it back, and
waking it (an interrupt sent through the host, the vCPU scheduled again) takes 0.1 to over
1 ms on a loaded host; Linux guests that load the `haltpoll` cpuidle driver poll a while
before halting for this reason. Where the guest kernel does not, a thread that is woken
after its CPU halted pays that wake-up: a client on the same VM waiting on a 0.3 ms answer,
a worker handed a request. Measured on a 2-CPU AMD EPYC firecracker guest (no cpuidle
driver), perf_analyzer HTTP c1 on `simple`: with the event loop itself polling
(api/http_protocol.py `BusyPoll`) 20-28 % of requests still waited ~1 ms for the client's
halted CPU when the host was busy (p90 1.36-1.55 ms, 1,650-1,800 infer/s); with this thread,
p99 0.61-0.69 ms and 2,440-2,660 infer/s, alternating in one run.

How: one thread per process at SCHED_IDLE (it runs only on a CPU that has nothing else to run,
and any thread that wakes preempts it at once) spins in C with the GIL released
(`continuum_spin_until`, a `pause` loop on CLOCK_MONOTONIC) until a deadline that the front
ends move forward with `keep_warm` while v2 requests arrive closely (`BusyPoll`, the gRPC
loop's own spin); when the deadline passes it blocks on an Event until the next `keep_warm`.
Costs: the CPU time of otherwise idle CPUs while such traffic lasts, and at most
`keep_warm`'s window after it stops; nothing while idle.

`halt_poll()` returns the process's `HaltPoll`, or None where it is off: `CONTINUUM_HALT_POLL`
= `0` (off), `1` (on), `auto` (the default: on in a guest — the `hypervisor` CPU flag — whose
kernel has no `haltpoll` cpuidle driver, with at least two CPUs to use and a C compiler to
build the 10-line helper into `$CONTINUUM_CACHE/halt_poll/`).
Flows in: `keep_warm(seconds)` from the HTTP protocol and the gRPC loop threads; out: nothing
but CPU time on idle CPUs.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger("continuum.halt_poll")

ENV = "CONTINUUM_HALT_POLL"
# How long (s) a request that follows another closely keeps the CPUs awake: its answer (a small
# model's, ~0.3 ms on the 2-CPU host) and the client's turn to the next request.
WINDOW_S = 1e-3
SOURCE = r"""
#include <stdint.h>
#include <time.h>

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Spin until CLOCK_MONOTONIC passes *until_ns, which another thread may move meanwhile. */
void continuum_spin_until(volatile int64_t *until_ns) {
    while (now_ns() < *until_ns) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        __asm__ volatile("yield");
#endif
    }
}
"""


class HaltPoll:
    """The spinning thread (see the module docstring). `spin` is the C helper: a function
    of one `int64_t *` (a deadline, CLOCK_MONOTONIC ns) that returns once it has passed."""

    def __init__(self, spin) -> None:
        self._spin = spin
        self._until = ctypes.c_int64(0)
        self._address = ctypes.addressof(self._until)
        self._wake = threading.Event()
        self.spinning = False               # the thread is in (or about to enter) its spin
        self._thread = threading.Thread(target=self._run, name="halt-poll", daemon=True)
        self._thread.start()

    def keep_warm(self, seconds: float) -> None:
        """Spin until at least `seconds` from now (a later deadline already set stays).
        Cheap while spinning (one store); wakes the thread otherwise (an Event set). A call
        in the ~1 µs between the thread's last look at the deadline and its next wait is
        missed: the next call starts it again."""
        until = time.monotonic_ns() + int(seconds * 1e9)
        if until > self._until.value:
            self._until.value = until
        if not self.spinning:
            self._wake.set()

    def _run(self) -> None:
        try:           # this thread only (Linux: pid 0 is the calling thread)
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError) as e:     # spinning at normal priority would compete
            logger.warning("halt polling off: SCHED_IDLE refused (%s)", e)
            return
        while True:
            self._wake.wait()
            self._wake.clear()
            self.spinning = True
            while time.monotonic_ns() < self._until.value:   # moved while it returned
                self._spin(self._address)
            self.spinning = False


def wanted(env: str | None = None, cpuinfo: str = "/proc/cpuinfo",
           cpuidle: str = "/sys/devices/system/cpu/cpuidle/current_driver") -> tuple[bool, str]:
    """Whether to run halt polling here, and why (for the log): `env` is CONTINUUM_HALT_POLL's
    value (`0`, `1`, `auto` or None = auto). Raises ValueError for another value."""
    env = (env or "auto").strip().lower()
    if env not in ("0", "1", "auto"):
        raise ValueError(f"{ENV} must be 0, 1 or auto, not {env!r}")
    if env != "auto":
        return env == "1", f"{ENV}={env}"
    if len(os.sched_getaffinity(0)) < 2:
        return False, "one CPU: nothing else to keep awake"
    try:
        flags = next((line for line in open(cpuinfo) if line.startswith("flags")), "").split()
    except OSError:
        flags = []
    if "hypervisor" not in flags:
        return False, "not a virtual machine"
    try:
        driver = Path(cpuidle).read_text().strip()
    except OSError:
        driver = "none"
    if driver == "haltpoll":
        return False, "the guest kernel polls (cpuidle driver haltpoll)"
    return True, f"a virtual machine whose kernel does not (cpuidle driver: {driver})"


@lru_cache(maxsize=1)
def halt_poll() -> HaltPoll | None:
    """This process's `HaltPoll`, started on the first call, or None where it is off (see the
    module docstring; the reason is logged once). Never raises: a bad CONTINUUM_HALT_POLL or
    a failed build is logged and leaves it off."""
    try:
        on, why = wanted(os.environ.get(ENV))
    except ValueError as e:
        logger.warning("halt polling off: %s", e)
        return None
    if not on:
        logger.debug("halt polling off: %s", why)
        return None
    try:
        spin = ctypes.CDLL(str(build())).continuum_spin_until
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("halt polling off: its helper did not build (%s)", e)
        return None
    spin.argtypes, spin.restype = [ctypes.c_void_p], None
    logger.info("halt polling on: %s", why)
    return HaltPoll(spin)


def find_compiler() -> str | None:
    """`$CC`, else `cc` or `gcc` on the PATH, else None (as engine/kernels finds it)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build() -> Path:
    """The helper library, compiled once per source into `$CONTINUUM_CACHE/halt_poll/`.
    Raises OSError (no compiler, unwritable cache) or subprocess.SubprocessError."""
    compiler = find_compiler()
    if compiler is None:
        raise OSError("no C compiler (cc, gcc or $CC)")
    from engine.loader import cache_root

    key = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    target = cache_root() / "halt_poll" / f"halt_poll-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, out = Path(tmp) / "halt_poll.c", Path(tmp) / target.name
        src.write_text(SOURCE)
        subprocess.run([compiler, "-O2", "-shared", "-fPIC", str(src), "-o", str(out)],
                       check=True, capture_output=True, text=True, timeout=60)
        os.replace(out, target)            # atomic: a concurrent builder sees all or nothing
    return target
