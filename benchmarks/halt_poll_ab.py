"""Halt polling A/B on the KServe v2 path: two `continuum serve --no-llm` processes on
`simple`, one with CONTINUUM_HALT_POLL=1 and one with =0, both up at once, each point measured
by perf_analyzer 2.51 at its default stability settings on one then the other, the order
alternating between rounds (the host drifts by tens of percent within minutes).

Points are `mode:concurrency` (modes as in triton_protocol_bench: http-json, http-binary,
grpc, grpc-shm). `--swap` starts the =0 server first (on the session-35 Intel guest the
server started first sometimes ran a c4 point at 1,900-2,700 infer/s whichever it was; in
session 36's A/A runs the first of two halt-polling servers still drew more unstable rounds,
unexplained, and one trace showed windows falling with the host's steal time: each line now
carries the round's `steal_pct`).
`--values 0,0` (or `1,1`) runs an A/A test instead: two identical servers, named by their
CONTINUUM_HALT_POLL value and start order, which shows what the start order alone does.
Output: one line per measurement, with the CPU seconds the server's threads used during it
(all of them, its SCHED_IDLE halt-polling thread, its busiest thread: from /proc's per-thread
stat) and those of the server left idle meanwhile; a JSON file of every round
(`--save-result`).
Run: `python benchmarks/halt_poll_ab.py --perf-analyzer VENV/bin/perf_analyzer
--points http-json:1,http-json:4 --rounds 3`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import triton_protocol_bench as tpb  # noqa: E402
from benchmarks.harness import (add_save_result, cpu_seconds, free_port, launch,  # noqa: E402
                                proc_stat, save_result, stop, wait_ready)


def thread_cpu(pid: int) -> dict[int, tuple[int, float]]:
    """{thread id: (scheduling policy, user + system CPU seconds)} of process `pid`, from
    /proc/PID/task/TID/stat (harness.proc_stat)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = (int(proc_stat(task / "stat")[38]), cpu_seconds(task / "stat"))
        except OSError:             # the thread ended meanwhile
            continue
    return out


def cpu_used(before: dict, after: dict) -> dict:
    """CPU seconds between two `thread_cpu` readings: all threads, the SCHED_IDLE ones (the
    halt-polling thread), the busiest one."""
    used = {t: cpu - before.get(t, (0, 0.0))[1] for t, (_, cpu) in after.items()}
    idle = sum(u for t, u in used.items() if after[t][0] == os.SCHED_IDLE)
    return {"cpu_s": round(sum(used.values()), 2), "idle_policy_cpu_s": round(idle, 2),
            "busiest_thread_cpu_s": round(max(used.values(), default=0.0), 2)}


def start(repo: Path, halt_poll: str, log) -> tuple:
    """One server with CONTINUUM_HALT_POLL=`halt_poll`: (process, HTTP port, gRPC port)."""
    http, grpc = free_port(), free_port()
    env = dict(os.environ, CONTINUUM_HALT_POLL=halt_poll)
    proc = launch([sys.executable, "-m", "api", "serve", "--no-llm", "--model-repository",
                   str(repo), "--port", str(http), "--grpc-port", str(grpc)], log, env)
    return proc, http, grpc


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--perf-analyzer", type=Path, required=True)
    p.add_argument("--points", default="http-json:1,http-binary:1,grpc:1,http-json:4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--swap", action="store_true", help="start the halt-polling-off server first")
    p.add_argument("--values", default="1,0",
                   help="CONTINUUM_HALT_POLL of the server started first, then second")
    add_save_result(p, "halt_poll_ab")
    args = p.parse_args(argv)
    points = [(m, int(c)) for m, c in (x.split(":") for x in args.points.split(","))]
    values = args.values.split(",")
    if len(values) != 2 or not set(values) <= {"0", "1"}:
        p.error("--values takes two of 0 / 1, e.g. 1,0")
    if args.swap:
        values.reverse()
    label = {"1": "on", "0": "off"}
    names = [(label[v] if values[0] != values[1] else f"{label[v]}{i + 1}", v)
             for i, v in enumerate(values)]
    rounds: dict = {}
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "servers.log", "w") as log:
        repo = Path(tmp) / "repo"
        shutil.copytree(tpb.EXAMPLES / "simple", repo / "simple")
        procs = {name: start(repo, value, log) for name, value in names}
        try:
            for proc, http, _ in procs.values():
                wait_ready(f"http://127.0.0.1:{http}/v2/health/ready", proc)
            for r in range(args.rounds):
                for mode, c in points:
                    order = list(procs) if r % 2 == 0 else list(reversed(procs))
                    for name in order:
                        proc, http, grpc = procs[name]
                        before = {n: thread_cpu(pr.pid) for n, (pr, _, _) in procs.items()}
                        point = tpb.perf_analyzer(args.perf_analyzer, "simple", mode, c, http,
                                                  grpc, None)
                        used = {n: cpu_used(before[n], thread_cpu(pr.pid))
                                for n, (pr, _, _) in procs.items()}
                        point["server"] = used.pop(name)
                        point["idle_server_cpu_s"] = sum(u["cpu_s"] for u in used.values())
                        rounds.setdefault(f"{mode}/{c}", {}).setdefault(name, []).append(point)
                        shown = point if "error" not in point else "unstable " + str(
                            {k: v for k, v in point.items() if k != "error"})
                        print(f"halt polling {name:4s} {mode}/{c} round {r + 1}: {shown}",
                              flush=True)
        finally:
            for proc, _, _ in procs.values():
                stop(proc)
    result = {"host": tpb.host(), "started": [n for n, _ in names], "rounds": rounds}
    save_result(args.save_result, result)
    return result


if __name__ == "__main__":
    main()
