"""What the benchmark scripts share: server processes, closed-loop load, summaries, results.

Owns: starting a server process on a free loopback port and waiting until it answers, stopping
it with its whole process group, `continuum serve` as a context manager, the closed-loop load
driver (N clients, each sending its next request when its previous one is answered, measured
over a window after a warm-up), the latency summary of such a run, and the `--save-result
FILE` flag every script takes (JSON; `benchmarks/results/<script>.json` for the scripts that
save by default), CPU seconds from /proc (`proc_stat`, `cpu_seconds`), and the host's steal time over a measurement (`StealMeter`: the share of the
vCPUs' time the hypervisor gave to others, which no server on the guest can outrun).

In: server command lines or `continuum serve` flags, readiness URLs, a `request(worker, i)`
that builds one request and returns the awaitable sending it, result dicts. Out:
`subprocess.Popen` handles and base URLs, latencies (seconds), summaries (ms, requests/s) and
JSON files. `continuum bench compare` (`benchmarks/servebench/compare.py`) starts its servers
through it too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


# ----------------------------------------------------------------------------- processes
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free TCP port on the loopback interface, never one this process was given before.

    The kernel may hand the same ephemeral port to two `bind(("", 0))` calls in a row once the
    first socket is closed; a caller asking for two ports (HTTP and gRPC) must get two."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def launch(cmd: list[str], log: IO[bytes] | None = None,
           env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.Popen:
    """Start `cmd` in `cwd` (default: the repository root), in a process group of its own (so
    that `stop` reaches what it starts: the engine process, python-backend stubs), its output
    to `log` (a file opened in binary mode) or discarded, with `env` (default: this
    process's)."""
    out = log if log is not None else subprocess.DEVNULL
    return subprocess.Popen(cmd, cwd=cwd or ROOT, stdout=out, stderr=out, env=env,
                            start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    """Poll `url` every 0.5 s until it answers 200. Raises RuntimeError if `proc` exits first
    or `timeout` seconds pass."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} during start-up: "
                               f"{' '.join(map(str, proc.args))}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready in {timeout} s: {' '.join(map(str, proc.args))}")


def stop(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM to `proc`'s process group (it drains and exits), SIGKILL after `timeout` s."""
    try:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:          # it exited between the poll and the signal
        proc.wait()


def start(cmd: list[str], ready_url: str, *, log: IO[bytes] | None = None,
          env: dict[str, str] | None = None, timeout: float = 300.0) -> subprocess.Popen:
    """`launch(cmd)`, then `wait_ready(ready_url)` within `timeout` seconds; a server that
    does not get ready is stopped before the RuntimeError propagates."""
    proc = launch(cmd, log, env)
    try:
        wait_ready(ready_url, proc, timeout)
    except BaseException:
        stop(proc)
        raise
    return proc


def continuum_command(port: int, flags: list[str]) -> list[str]:
    """`python -m api serve --port PORT FLAGS` with this interpreter."""
    return [sys.executable, "-m", "api", "serve", "--port", str(port), *flags]


@dataclass
class Server:
    """A running server: its base URL (`http://127.0.0.1:PORT`) and process."""
    base: str
    proc: subprocess.Popen


@contextmanager
def continuum(flags: list[str], *, ready_path: str = "/health/ready",
              log: IO[bytes] | None = None, env: dict[str, str] | None = None,
              timeout: float = 300.0) -> Iterator[Server]:
    """`continuum serve FLAGS` on a free loopback port, ready (`ready_path` answers 200 within
    `timeout` seconds) for the body of the `with`, stopped after it."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start(continuum_command(port, flags), base + ready_path, log=log, env=env,
                 timeout=timeout)
    try:
        yield Server(base, proc)
    finally:
        stop(proc)


# ----------------------------------------------------------------------------- load
async def closed_loop(request: Callable[[int, int], Awaitable], concurrency: int,
                      duration: float, warmup: float) -> tuple[list[float], int]:
    """`concurrency` clients; client w sends request i = w, w + concurrency, ... (the clients
    share out the indices), each when its previous one is answered, until `warmup + duration`
    seconds have passed. `request(w, i)` builds the request (not timed) and returns the
    awaitable that sends it (timed); it is answered unless it raises or returns False.
    Returns (latencies in seconds of the answered requests sent after the warm-up, failures)."""
    latencies: list[float] = []
    failures = 0
    start_s = time.perf_counter()
    measure_from, stop_at = start_s + warmup, start_s + warmup + duration

    async def client(w: int) -> None:
        nonlocal failures
        i = w
        while time.perf_counter() < stop_at:
            pending = request(w, i)
            t0 = time.perf_counter()
            try:
                ok = (await pending) is not False
            except Exception:
                ok = False
            if not ok:
                failures += 1
            elif t0 >= measure_from:
                latencies.append(time.perf_counter() - t0)
            i += concurrency

    await asyncio.gather(*(client(w) for w in range(concurrency)))
    return latencies, failures


def percentile(values: list[float], q: float) -> float | None:
    """The `q`-th percentile (0-100, numpy's linear interpolation) of `values`; None if empty."""
    return float(np.percentile(values, q)) if len(values) else None


def latency_summary(latencies: list[float], seconds: float, digits: int = 1) -> dict:
    """`requests_per_s` (answered requests over `seconds`, 1 decimal), `p50_ms` and `p99_ms`
    (rounded to `digits`; None without requests) and `completed`, from latencies in seconds."""
    ms = [x * 1000 for x in latencies]
    p50, p99 = percentile(ms, 50), percentile(ms, 99)
    return {"requests_per_s": round(len(ms) / seconds, 1),
            "p50_ms": None if p50 is None else round(p50, digits),
            "p99_ms": None if p99 is None else round(p99, digits),
            "completed": len(ms)}


def proc_stat(path: str | Path) -> list[str]:
    """The fields of a /proc/PID/stat or /proc/PID/task/TID/stat file after the command name
    (which may hold spaces): element i is proc(5)'s field i + 3 (state first, utime [11],
    stime [12], policy [38]). Raises OSError when the process or thread is gone."""
    return Path(path).read_text().rsplit(")", 1)[1].split()


def cpu_seconds(path: str | Path) -> float:
    """utime + stime in a /proc stat file (`proc_stat`), seconds: a process's (all its
    threads) or one thread's. Raises OSError when it is gone."""
    fields = proc_stat(path)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class StealMeter:
    """The hypervisor's steal time over a span, from /proc/stat's `cpu` line (proc(5): the
    8th value, time a virtual CPU was runnable but the host ran something else): `start()`,
    then `percent()` = steal / all CPU time since, in % (0.0 where /proc/stat is absent or
    has no steal field). Measured on the session-36 Intel KVM guest: perf_analyzer windows
    fell from ~6,500 to ~2,000 infer/s while steal rose from 0 to 20-35 % on both vCPUs for
    tens of seconds (benchmarks/results/steal_trace_intel_noamx_session36.txt)."""

    def __init__(self, stat: str = "/proc/stat") -> None:
        self.stat, self._start = stat, (0, 0)

    def _read(self) -> tuple[int, int]:
        try:
            with open(self.stat) as f:
                values = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return 0, 0
        # user nice system idle iowait irq softirq steal [guest guest_nice: inside user]
        return (values[7] if len(values) > 7 else 0), sum(values[:8])

    def start(self) -> StealMeter:
        self._start = self._read()
        return self

    def percent(self) -> float:
        steal, total = self._read()
        spent = total - self._start[1]
        return round(100.0 * (steal - self._start[0]) / spent, 1) if spent > 0 else 0.0


# ----------------------------------------------------------------------------- results
def add_save_result(parser: argparse.ArgumentParser, script: str | None = None) -> None:
    """`--save-result FILE`: where the script writes its JSON result. With `script`, the
    script saves by default, to `benchmarks/results/<script>.json`; without, only when given."""
    default = RESULTS / f"{script}.json" if script else None
    parser.add_argument("--save-result", type=Path, default=default, metavar="FILE",
                        help="write the JSON result to FILE"
                             + (f" (default: {default.relative_to(ROOT)})" if default else ""))


def save_result(path: Path | str | None, result, indent: int = 2) -> None:
    """Write `result` as JSON to `path` (its folder made if missing); nothing if `path` is
    None."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent))
