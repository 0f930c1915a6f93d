"""Would several v2 front-end processes steady perf_analyzer? An A/B on `simple`.

Issue 54's open half asks perf_analyzer 2.51 to stabilise every point at its default settings
(three 5 s windows in a row within 10 %). On the Intel KVM guests it fails about one round in
four, for tritonserver 2.51 as for Continuum, and session 34 traced the windows' swings to the
speed of the vCPU that the v2 path's one Python thread runs on. This script tests the lead that
followed: N front ends, each a whole `continuum serve --no-llm` server (api/launch.py
`build_server`, its own repository, statistics and shared-memory registry) accepting on one
shared listening socket, so the kernel spreads perf_analyzer's connections over N processes and
both vCPUs. That is valid only for a stateless model such as `simple`; it is an experiment, not a
way to serve (server-side statistics, shared-memory regions, sequences and model control would
each need one owner: perf_analyzer reads the statistics between windows and at times fails with
"failed to find the requested model version" when two processes answer).

Each `--counts` value N is one such server (N = 1: the server as it is), all up at once; every
point runs perf_analyzer at its defaults on each in turn, the order alternating between rounds.
Output: one line per round with its windows (infer/s), whether it stabilised and the host's
steal time over it (harness.StealMeter); `--save-result` keeps every round.

    python benchmarks/v2_front_ends_ab.py --perf-analyzer .venv-perf-analyzer/bin/perf_analyzer \\
        --points http-json:4,http-binary:16 --rounds 3 --counts 1,2
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import triton_protocol_bench as tpb  # noqa: E402
from benchmarks.harness import (StealMeter, add_save_result, free_port, launch,  # noqa: E402
                                save_result, stop, wait_ready)


def _front_end(argv: list[str], sock: socket.socket, index: int) -> None:
    """One front end: `continuum serve ARGV` on the shared `sock`, its gRPC port offset by
    `index` (grpcio binds each process's own)."""
    from triton_compat.frontend.grpc.core_env import import_grpc
    import_grpc()
    from api.cli import build_parser
    from api.launch import build_server
    from api.serve_config import serve_config
    from engine.log_config import configure
    args = build_parser(bench_flags=False).parse_args(argv)
    args.grpc_port += index
    config = serve_config(args, model_checks=False)
    configure(config.log)
    server, _ = build_server(config)
    server.run(sockets=[sock])


def serve_front_ends(n: int, argv: list[str]) -> None:
    """Run `n` front ends of `continuum serve ARGV` (its --port shared) until SIGTERM / SIGINT,
    which each of them gets."""
    port = int(argv[argv.index("--port") + 1])
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.set_inheritable(True)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_front_end, args=(argv, sock, i)) for i in range(n)]
    for p in procs:
        p.start()

    def forward(sig, _frame):
        for p in procs:
            if p.exitcode is None:
                os.kill(p.pid, sig)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    for p in procs:
        p.join()


def perf_analyzer_windows(binary: Path, mode: str, c: int, port: int) -> dict:
    """perf_analyzer at its defaults (`-v`): {"stable", "windows": infer/s of each 5 s window,
    "steal_pct"}, with the output's tail when it did not stabilise."""
    lib = next(binary.parent.parent.glob("lib/python3*/site-packages/nvidia/cuda_runtime/lib"))
    env = dict(os.environ, LD_LIBRARY_PATH=f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    steal = StealMeter().start()
    r = subprocess.run([str(binary), "-m", "simple", "-u", f"127.0.0.1:{port}", *tpb.MODES[mode],
                        "--concurrency-range", str(c), "--input-data", "zero", "-v"],
                       capture_output=True, text=True, env=env, timeout=300)
    out = r.stdout + r.stderr
    point = {"stable": r.returncode == 0 and "Failed to obtain stable" not in out,
             "windows": [round(float(w)) for w in
                         re.findall(r"Pass \[\d+\] throughput: ([\d.]+) infer/sec", out)],
             "steal_pct": round(steal.percent(), 2)}
    if not point["stable"]:
        point["tail"] = out[-300:]
    return point


def main(argv: list[str] | None = None) -> dict:
    """Run the A/B (flags: see --help); returns and saves {"N front ends": {point: rounds}}."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--perf-analyzer", type=Path, required=True)
    p.add_argument("--points", default="http-json:4,http-binary:16",
                   help="mode:concurrency,... (HTTP modes: gRPC ports differ per front end)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--counts", default="1,2", help="front ends of each server")
    add_save_result(p, "v2_front_ends_ab")
    args = p.parse_args(argv)
    points = [(m, int(c)) for m, c in (x.split(":") for x in args.points.split(","))]
    if any(not m.startswith("http") for m, _ in points):
        p.error("--points: HTTP modes only (each front end binds its own gRPC port)")
    counts = [int(x) for x in args.counts.split(",")]
    result: dict = {f"{n} front ends": {} for n in counts}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        tpb.build_repository(repo)
        servers = {}
        with open(Path(tmp) / "servers.log", "wb") as log:
            try:
                for n in counts:
                    http = free_port()
                    servers[n] = (launch([sys.executable, __file__, "--serve", str(n), "serve",
                                          "--no-llm", "--model-repository", str(repo),
                                          "--port", str(http), "--grpc-port", str(free_port())],
                                         log), http)
                for proc, http in servers.values():
                    wait_ready(f"http://127.0.0.1:{http}/v2/health/ready", proc)
                time.sleep(5)            # every front end up, not only the first to answer
                for mode, c in points:
                    for r in range(args.rounds):
                        for n in counts if r % 2 == 0 else counts[::-1]:
                            point = perf_analyzer_windows(args.perf_analyzer, mode, c,
                                                          servers[n][1])
                            result[f"{n} front ends"].setdefault(f"{mode}/{c}", []).append(point)
                            print(f"{n} front ends {mode} c{c} round {r + 1}: {point}", flush=True)
            finally:
                for proc, _ in servers.values():
                    stop(proc)
    save_result(args.save_result, result)
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:     # the server side, started by main() as a process
        serve_front_ends(int(sys.argv[2]), sys.argv[3:])
    else:
        main()
