"""Scheduling-policy benchmark: `sjf` against `fcfs` on the same ShareGPT burst, one run.

For each policy a server is started (`continuum serve --scheduling-policy P --max-num-seqs N`,
default N = 8, so that a queue forms) and `continuum bench serve` sends the same ShareGPT
prompts all at once (`--request-rate inf`, same seed). Output: mean / median / p99 end-to-end
latency and TTFT, output throughput, and the sjf / fcfs ratios, as a JSON file and a table.
The goal (issue "SLO-aware scheduling"): sjf lowers mean end-to-end latency at the same
throughput. The issue's other parts (adaptive prefill budget, automatic preemption mode,
goodput under Poisson arrivals) are not here yet.

Run: `python benchmarks/slo_bench.py [--num-prompts 64] [--max-num-seqs 8]`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.triton_protocol_bench import free_port, wait_ready

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms", "mean_ttft_ms", "p99_ttft_ms",
        "output_throughput")


def run_policy(policy: str, args, tmp: Path) -> dict:
    """Serve with `policy`, send the burst, stop: the bench's figures (KEYS)."""
    port = free_port()
    log = open(tmp / f"server_{policy}.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "api", "serve", "--port", str(port), "--scheduling-policy",
         policy, "--max-num-seqs", str(args.max_num_seqs), "--uvicorn-log-level", "warning"],
        stdout=log, stderr=log, cwd=ROOT, start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health/ready", proc, timeout=300)
        out = tmp / f"{policy}.json"
        subprocess.run([sys.executable, "-m", "api", "bench", "serve", "--base-url",
                        f"http://127.0.0.1:{port}", "--dataset-name", "sharegpt",
                        "--num-prompts", str(args.num_prompts), "--request-rate", "inf",
                        "--seed", str(args.seed), "--no-progress", "--save-result", str(out)],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())
        result = result[0] if isinstance(result, list) else result
        return {k: result[k] for k in KEYS}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)


def main(argv: list[str] | None = None) -> dict:
    """Run both policies (flags: see --help); write and return the JSON result."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--output", type=Path, default=Path("slo_bench.json"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = {policy: run_policy(policy, args, Path(tmp)) for policy in ("fcfs", "sjf")}
    result["sjf_over_fcfs"] = {k: result["sjf"][k] / result["fcfs"][k] for k in KEYS}
    args.output.write_text(json.dumps(result, indent=2))
    print("| figure | fcfs | sjf | sjf / fcfs |\n|---|---|---|---|")
    for k in KEYS:
        print(f"| {k} | {result['fcfs'][k]:.1f} | {result['sjf'][k]:.1f} | "
              f"{result['sjf_over_fcfs'][k]:.2f} |")
    return result


if __name__ == "__main__":
    main()
