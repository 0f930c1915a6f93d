"""Scheduler overhead per engine step: `schedule()` + `update_from_output()`.

Workload (issue 2): 256 running requests whose contexts are 1–4k tokens, block size 16, prefix
caching on, every request decoding one token per step. The prompts are prefilled first (not
timed); then each timed step is one schedule and one update with a sampled token for every
request. The runner's output is built outside the timed region.

Prints one JSON line (and writes it to `--save-result FILE`): median_ms, p99_ms, mean_ms over the
timed steps, plus the set-up.
Target: median <= 1 ms on the project's 2-core machine.

    python benchmarks/scheduler_bench.py [--steps 500] [--num-requests 256]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import add_save_result, save_result  # noqa: E402
from scheduler.config import CacheConfig, SchedulerConfig  # noqa: E402
from scheduler.output import ModelRunnerOutput  # noqa: E402
from scheduler.request import Request, SamplingParams  # noqa: E402
from scheduler.scheduler import Scheduler  # noqa: E402


def build(num_requests: int, min_len: int, max_len: int, steps: int, block_size: int,
          seed: int) -> Scheduler:
    """A scheduler with `num_requests` requests prefilled and decoding."""
    rng = random.Random(seed)
    max_model_len = max_len + steps + 256
    num_blocks = num_requests * (-(-max_model_len // block_size)) + 64
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=num_requests, max_num_batched_tokens=16384,
                        max_model_len=max_model_len, max_waiting_requests=num_requests),
        CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks, enable_prefix_caching=True))
    params = SamplingParams(max_tokens=steps + 240, ignore_eos=True, temperature=0)
    system = [rng.randrange(32000) for _ in range(256)]     # a shared system prompt
    for i in range(num_requests):
        n = rng.randint(min_len, max_len)
        prompt = system + [rng.randrange(32000) for _ in range(n - len(system))]
        sched.add_request(Request(f"req-{i}", prompt, params, eos_token_id=2))
    while any(r.num_output_tokens == 0 for r in sched.requests.values()):
        out = sched.schedule()
        sampled = {s.request_id: [7] for s in out.scheduled if s.sample}
        sched.update_from_output(out, ModelRunnerOutput(sampled))
    return sched


def main(argv: list[str] | None = None) -> dict:
    """Build the scheduler, time the steps; print, save and return the result."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    add_save_result(ap)
    args = ap.parse_args(argv)

    sched = build(args.num_requests, args.min_len, args.max_len, args.steps + args.warmup,
                  args.block_size, args.seed)
    ids = list(sched.requests)
    times = []
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        runner_output = ModelRunnerOutput({rid: [(step * 31 + i) % 32000]
                                           for i, rid in enumerate(ids)})
        t2 = time.perf_counter()
        sched.update_from_output(out, runner_output)
        t3 = time.perf_counter()
        assert len(out.scheduled) == args.num_requests
        if step >= args.warmup:
            times.append((t1 - t0 + t3 - t2) * 1e3)
    times.sort()
    result = {
        "benchmark": "scheduler_step",
        "num_running": args.num_requests,
        "context_tokens": [args.min_len, args.max_len],
        "block_size": args.block_size,
        "prefix_caching": True,
        "steps": args.steps,
        "median_ms": round(statistics.median(times), 4),
        "p99_ms": round(times[int(0.99 * (len(times) - 1))], 4),
        "mean_ms": round(statistics.fmean(times), 4),
        "kv_usage": round(sched.kv.usage(), 4),
    }
    print(json.dumps(result))
    save_result(args.save_result, result)
    return result


if __name__ == "__main__":
    main()
