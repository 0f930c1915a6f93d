"""`--api-server-count 2` against 1 (issue 52), served, alternating in one run on one host.

Two workloads at concurrency `--concurrency` (64): workload A (64 random prompts of 128 tokens,
128 output tokens, ignore_eos, greedy; `benchmarks/quant_bench.py:workload`) and many short
requests (`--short-prompts` prompts of 16 tokens, 8 output tokens). For each configuration
(`--configs`: default = no flags, bf16 = `--quantization none --dtype bfloat16`), each round
starts a fresh server per count and runs both workloads; per point it records output tok/s,
request/s, median TTFT / TPOT, and the CPU seconds each process spent (engine core, the API
processes, from /proc/PID/stat): where the work went.

    python benchmarks/api_server_bench.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):          # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_peers_bench import host  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.harness import continuum, save_result  # noqa: E402
from benchmarks.quant_bench import workload  # noqa: E402

CONFIGS = {"default": [], "bf16": ["--quantization", "none", "--dtype", "bfloat16"]}


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` (all its threads), seconds."""
    return harness.cpu_seconds(f"/proc/{pid}/stat")


def roles(proc, log: Path, count: int) -> dict[str, list[int]]:
    """The server's processes by role: {"core": [pid], "api": [pids]}. With one API process
    the launcher is it and its spawned child (not the resource tracker) the core; with
    several, the launcher's log line names them."""
    if count > 1:
        deadline = time.time() + 60
        while time.time() < deadline:
            m = re.search(r"pids ([\d, ]+); engine core (\d+)", log.read_text())
            if m and log.read_text().count(f"of {count})") >= count:
                return {"core": [int(m.group(2))],
                        "api": [int(p) for p in m.group(1).split(", ")]}
            time.sleep(0.5)
        raise RuntimeError(f"API processes not ready: {log.read_text()[-2000:]}")
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    core = [int(c) for c in children
            if "resource_tracker" not in Path(f"/proc/{c}/cmdline").read_text()]
    return {"core": core, "api": [proc.pid]}


def point(base: str, tokenizer: str, args, pids: dict, short: bool) -> dict:
    """One workload at `args.concurrency` with each role's CPU seconds over it."""
    a = argparse.Namespace(**vars(args))
    if short:
        a.input_len, a.output_len = 16, 8
    n = args.short_prompts if short else args.num_prompts
    before = {r: sum(cpu_seconds(p) for p in ps) for r, ps in pids.items()}
    t0 = time.perf_counter()
    out = workload(base, tokenizer, args.concurrency, n, a, None)
    wall = time.perf_counter() - t0
    out["req_s"] = round(n / wall, 2)
    out["cpu_s"] = {r: round(sum(cpu_seconds(p) for p in ps) - before[r], 2)
                    for r, ps in pids.items()}
    out["wall_s"] = round(wall, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default="default,bf16")
    ap.add_argument("--counts", default="1,2")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--short-prompts", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--save-result", default="benchmarks/results/api_server_bench.json")
    args = ap.parse_args()
    from engine.loader import resolve_model
    tokenizer = str(resolve_model(None))
    result = {"host": host(), "args": vars(args), "runs": []}
    print(json.dumps(result["host"]), flush=True)
    for rnd in range(args.rounds):
        for config in args.configs.split(","):
            for count in (int(c) for c in args.counts.split(",")):
                with tempfile.NamedTemporaryFile(suffix=".log") as f:
                    log = Path(f.name)
                    flags = [*CONFIGS[config], "--api-server-count", str(count),
                             "--kv-cache-memory", "2", "--max-model-len", "2048"]
                    with continuum(flags, log=open(log, "wb")) as srv:
                        pids = roles(srv.proc, log, count)
                        run = {"round": rnd, "config": config, "api_server_count": count,
                               "workload_a": point(srv.base, tokenizer, args, pids, False),
                               "short": point(srv.base, tokenizer, args, pids, True)}
                print(json.dumps(run), flush=True)
                result["runs"].append(run)
    save_result(args.save_result, result, indent=1)


if __name__ == "__main__":
    main()
