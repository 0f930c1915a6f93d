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
and any thread that wakes preempts it at once) lives in C (`continuum_halt_poll_run`, GIL
released for good): a `pause` loop on CLOCK_MONOTONIC until a deadline that the front ends move
forward with `keep_warm` while v2 requests arrive closely (`BusyPoll`, the gRPC loop's own
spin and each of its blocking waits that ends), then a futex wait until the next `keep_warm`
wakes it.
Costs: the CPU time of otherwise idle CPUs while such traffic lasts, and at most
`keep_warm`'s window after it stops; nothing while idle.

`halt_poll()` returns the process's `HaltPoll`, or None where it is off: `CONTINUUM_HALT_POLL`
= `0` (off), `1` (on), `auto` (the default: on in a guest — the `hypervisor` CPU flag — whose
kernel does not poll: no `haltpoll` cpuidle driver, or one whose `guest_halt_poll_ns` is 0; with
at least two CPUs to use and a C compiler to build the small helper into
`$CONTINUUM_CACHE/halt_poll/`).
Flows in: `keep_warm(seconds)` from the HTTP protocol and the gRPC loop threads; out: nothing
but CPU time on idle CPUs. Linux only (futex); elsewhere `auto` finds no `hypervisor` flag.
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
# A request that arrives after its loop polled empty this many times (a few µs each) was waited
# for: the loop was idle, not behind on a queue of requests, so the CPUs may halt meanwhile.
# Only such requests start a window (concurrent load keeps the CPUs busy by itself).
IDLE_POLLS = 8
SOURCE = r"""
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    _Atomic int64_t until_ns;   /* spin until CLOCK_MONOTONIC passes this */
    _Atomic int32_t sleeping;   /* 1 while the thread waits on this futex word */
    _Atomic int32_t stop;
} halt_poll_state;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

/* The thread's whole life: spin while the deadline is ahead, else sleep on the futex until
   a kick; returns once `stop` is set. Announcing the sleep and then looking at the deadline
   again (sequentially consistent, as the kick's store-then-look) means no kick is lost. */
void continuum_halt_poll_run(halt_poll_state *s) {
    while (!atomic_load(&s->stop)) {
        if (now_ns() < atomic_load(&s->until_ns)) {
            relax();
            continue;
        }
        atomic_store(&s->sleeping, 1);
        if (now_ns() < atomic_load(&s->until_ns) || atomic_load(&s->stop)) {
            atomic_store(&s->sleeping, 0);
            continue;
        }
        syscall(SYS_futex, &s->sleeping, FUTEX_WAIT_PRIVATE, 1, NULL, NULL, 0);
        atomic_store(&s->sleeping, 0);
    }
}

static void wake(halt_poll_state *s) {
    if (atomic_exchange(&s->sleeping, 0))
        syscall(SYS_futex, &s->sleeping, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

/* Move the deadline to `until_ns` if that is later, and wake the thread if it sleeps. */
void continuum_halt_poll_kick(halt_poll_state *s, int64_t until_ns) {
    int64_t current = atomic_load(&s->until_ns);
    while (until_ns > current
           && !atomic_compare_exchange_weak(&s->until_ns, &current, until_ns)) {
    }
    wake(s);
}

void continuum_halt_poll_stop(halt_poll_state *s) {
    atomic_store(&s->stop, 1);
    wake(s);
}
"""


class _State(ctypes.Structure):
    """halt_poll_state in SOURCE."""

    _fields_ = [("until_ns", ctypes.c_int64), ("sleeping", ctypes.c_int32),
                ("stop", ctypes.c_int32)]


class HaltPoll:
    """The polling thread (see the module docstring), over the helper library `lib` (`build`).
    The thread runs the helper's loop in C from start to `stop`, so it never holds the GIL at
    idle priority (a SCHED_IDLE thread preempted while holding it would stall every other
    thread of the process)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._state = _State()
        self._address = ctypes.addressof(self._state)
        self._kick, self._stop = lib.continuum_halt_poll_kick, lib.continuum_halt_poll_stop
        self._kick.argtypes, self._kick.restype = [ctypes.c_void_p, ctypes.c_int64], None
        self._stop.argtypes, self._stop.restype = [ctypes.c_void_p], None
        self._loop = lib.continuum_halt_poll_run
        self._loop.argtypes, self._loop.restype = [ctypes.c_void_p], None
        self._thread = threading.Thread(target=self._run, name="halt-poll", daemon=True)
        self._thread.start()

    @property
    def native_id(self) -> int | None:
        """The thread's kernel id (None before it starts)."""
        return self._thread.native_id

    @property
    def sleeping(self) -> bool:
        """Whether the thread waits for a `keep_warm` (else it spins, or is about to)."""
        return bool(self._state.sleeping)

    def keep_warm(self, seconds: float) -> None:
        """Spin until at least `seconds` from now (a later deadline already set stays); wakes
        the thread if it sleeps. ~1 µs (one ctypes call; a futex wake when asleep)."""
        self._kick(self._address, time.monotonic_ns() + int(seconds * 1e9))

    def stop(self, timeout: float | None = None) -> None:
        """End the thread (it is a daemon: a process may also just exit)."""
        self._stop(self._address)
        self._thread.join(timeout)

    def _run(self) -> None:
        try:           # this thread only (Linux: pid 0 is the calling thread)
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError) as e:     # spinning at normal priority would compete
            logger.warning("halt polling off: SCHED_IDLE refused (%s)", e)
            return
        self._loop(self._address)


def wanted(env: str | None = None, cpuinfo: str = "/proc/cpuinfo",
           cpuidle: str = "/sys/devices/system/cpu/cpuidle/current_driver",
           poll_ns: str = "/sys/module/haltpoll/parameters/guest_halt_poll_ns"
           ) -> tuple[bool, str]:
    """Whether to run halt polling here, and why (for the log): `env` is CONTINUUM_HALT_POLL's
    value (`0`, `1`, `auto` or None = auto). A guest whose cpuidle driver is `haltpoll` polls
    only if its governor's limit `guest_halt_poll_ns` (Linux
    drivers/cpuidle/governors/haltpoll.c; default 200,000) is above 0: firecracker guests
    seen here load the driver with the limit at 0, and their POLL state is never entered.
    Raises ValueError for another `env` value."""
    env = (env or "auto").strip().lower()
    if env not in ("0", "1", "auto"):
        raise ValueError(f"{ENV} must be 0, 1 or auto, not {env!r}")
    if env != "auto":
        return env == "1", f"{ENV}={env}"
    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        return False, "one CPU (or not Linux): nothing else to keep awake"
    try:
        with open(cpuinfo) as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        flags = []
    if "hypervisor" not in flags:
        return False, "not a virtual machine"
    try:
        driver = Path(cpuidle).read_text().strip()
    except OSError:
        driver = "none"
    if driver == "haltpoll":
        try:
            limit = Path(poll_ns).read_text().strip()
        except OSError:
            limit = "unknown"
        if limit != "0":
            return False, f"the guest kernel polls (cpuidle driver haltpoll, up to {limit} ns)"
        return True, "a virtual machine whose kernel does not (cpuidle driver haltpoll with " \
                     "guest_halt_poll_ns 0)"
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
        lib = ctypes.CDLL(str(build()))
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("halt polling off: its helper did not build (%s)", e)
        return None
    logger.info("halt polling on: %s", why)
    return HaltPoll(lib)


def find_compiler() -> str | None:
    """`$CC`, else `cc` or `gcc` on the PATH, else None: the compiler of every C helper
    (engine/kernels re-exports it; this module imports no torch)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build() -> Path:
    """The helper library, compiled once per source into `$CONTINUUM_CACHE/halt_poll/`.
    Raises OSError (no compiler, unwritable cache) or subprocess.SubprocessError."""
    return build_helper("halt_poll", SOURCE)


def build_helper(name: str, source: str) -> Path:
    """A small C helper library (`source`: one translation unit, stdlib + Linux headers; no
    -march, so it runs on any x86-64 or arm64 host), compiled once per source into
    `$CONTINUUM_CACHE/<name>/<name>-<key>.so` and returned. Processes that build it at once
    each compile and rename into place (atomic). Raises OSError (no compiler, unwritable
    cache) or subprocess.SubprocessError (the compiler failed or ran over 60 s)."""
    compiler = find_compiler()
    if compiler is None:
        raise OSError("no C compiler (cc, gcc or $CC)")
    from engine.loader import cache_root

    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    target = cache_root() / name / f"{name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, out = Path(tmp) / f"{name}.c", Path(tmp) / target.name
        src.write_text(source)
        subprocess.run([compiler, "-O2", "-std=gnu11", "-shared", "-fPIC", str(src), "-o", str(out)],
                       check=True, capture_output=True, text=True, timeout=60)
        os.replace(out, target)            # atomic: a concurrent builder sees all or nothing
    return target
