"""What the trace extension costs a v2 request: Continuum with tracing off against the same
server from a tree without tracing (`--baseline-tree`, e.g. a `git worktree` of the commit
before), and with tracing on (every request traced to a file), on `simple` over HTTP (JSON
tensors), closed loop at each concurrency.

All servers run at once (`--no-llm`, the example repository) and each point is measured on
one after the other, `--rounds` times in turn (the host's speed drifts within minutes). Prints
one JSON line per point with the median requests/s of each server, the ratios against the
baseline, and the host's ISA; saves them (`--save-result`, default
benchmarks/results/trace_overhead_bench.json).

    git worktree add /tmp/before <commit before tracing>
    python benchmarks/trace_overhead_bench.py --baseline-tree /tmp/before
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.harness import (add_save_result, closed_loop, free_port, launch,  # noqa: E402
                                save_result, stop, wait_ready)

BODY = json.dumps({"inputs": [
    {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))},
    {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}]}).encode()


def start_server(tree: Path, flags: list[str], log) -> tuple:
    """`python -m api serve --no-llm` from `tree` on the example repository: (proc, base)."""
    port = free_port()
    cmd = [sys.executable, "-m", "api", "serve", "--no-llm", "--port", str(port),
           "--model-repository", str(ROOT / "examples/model_repository"), "--load-model",
           "simple", "--model-control-mode", "explicit", "--grpc-port", "0",
           "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log", *flags]
    proc = launch(cmd, log, cwd=tree)
    base = f"http://127.0.0.1:{port}"
    wait_ready(f"{base}/v2/health/ready", proc)
    return proc, base


async def rate(base: str, concurrency: int, seconds: float) -> float:
    """Requests/s of `concurrency` closed-loop clients over `seconds` (after 1 s of warm-up)."""
    import httpx
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency)) as client:
        url = f"{base}/v2/models/simple/infer"

        def one(_w: int, _i: int):
            async def send():
                r = await client.post(url, content=BODY)
                return r.status_code == 200
            return send()

        latencies, failures = await closed_loop(one, concurrency, seconds, 1.0)
    if failures:
        raise RuntimeError(f"{failures} requests failed on {base}")
    return len(latencies) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-tree", type=Path, required=True)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    add_save_result(ap, "trace_overhead_bench")
    args = ap.parse_args()
    from engine.kernels.isa import isa_label
    trace_file = Path(tempfile.mkdtemp()) / "trace.json"
    servers = {"baseline": (args.baseline_tree, []), "tracing-off": (ROOT, []),
               "tracing-on": (ROOT, ["--trace-config", f"triton,file={trace_file}",
                                     "--trace-config", "level=TIMESTAMPS",
                                     "--trace-config", "rate=1",
                                     "--trace-config", "triton,log-frequency=1000"])}
    log = open(Path(tempfile.gettempdir()) / "trace_overhead_bench.log", "wb")
    running = {name: start_server(tree, flags, log) for name, (tree, flags) in servers.items()}
    points = []
    try:
        for c in [int(x) for x in args.concurrency.split(",")]:
            got: dict[str, list[float]] = {name: [] for name in servers}
            for _ in range(args.rounds):
                for name, (_proc, base) in running.items():
                    got[name].append(asyncio.run(rate(base, c, args.seconds)))
            med = {name: round(statistics.median(v), 1) for name, v in got.items()}
            point = {"isa": isa_label(), "concurrency": c, "requests_per_s": med,
                     "rounds": got,
                     "off_over_baseline": round(med["tracing-off"] / med["baseline"], 3),
                     "on_over_baseline": round(med["tracing-on"] / med["baseline"], 3)}
            print(json.dumps({k: v for k, v in point.items() if k != "rounds"}), flush=True)
            points.append(point)
    finally:
        for proc, _ in running.values():
            stop(proc)
    save_result(args.save_result, points)


if __name__ == "__main__":
    main()
