"""Halt polling A/B on the KServe v2 path: two `continuum serve --no-llm` processes on
`simple`, one with CONTINUUM_HALT_POLL=1 and one with =0, both up at once, each point measured
by perf_analyzer 2.51 at its default stability settings on one then the other, the order
alternating between rounds (the host drifts by tens of percent within minutes).

Points are `mode:concurrency` (modes as in triton_protocol_bench: http-json, http-binary,
grpc, grpc-shm). `--swap` starts the =0 server first (on the session-35 Intel guest the
server started first sometimes ran a c4 point at 1,900-2,700 infer/s whichever it was).
Output: one line per measurement and a JSON file of every round (`--save-result`).
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
from benchmarks.harness import (add_save_result, free_port, launch, save_result,  # noqa: E402
                                stop, wait_ready)


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
    add_save_result(p, "halt_poll_ab.json")
    args = p.parse_args(argv)
    points = [(m, int(c)) for m, c in (x.split(":") for x in args.points.split(","))]
    names = [("off", "0"), ("on", "1")] if args.swap else [("on", "1"), ("off", "0")]
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
                        _, http, grpc = procs[name]
                        point = tpb.perf_analyzer(args.perf_analyzer, "simple", mode, c, http,
                                                  grpc, None)
                        rounds.setdefault(f"{mode}/{c}", {}).setdefault(name, []).append(point)
                        shown = "unstable" if "error" in point else point
                        print(f"halt polling {name:3s} {mode}/{c} round {r + 1}: {shown}",
                              flush=True)
        finally:
            for proc, _, _ in procs.values():
                stop(proc)
    result = {"host": tpb.host(), "swap": args.swap, "rounds": rounds}
    save_result(args.save_result, result)
    return result


if __name__ == "__main__":
    main()
