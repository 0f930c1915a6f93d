"""Decode step time per attention path, in one process (an A/B, not a timed test).

Fills one engine with `--batch` requests whose prompt lengths are drawn uniformly from
`--min-len..--max-len` tokens, runs until all of them decode, then times decode steps with
each attention path, interleaved in rounds so that machine noise hits all alike:

- `kernels`: the compiled CPU kernels (the CPU default; K/V read in place via block tables);
- `torch_grouped`: the pure-torch path (CUDA / NPU) with decode groups of similar context;
- `torch_one_group`: the pure-torch path with one group padded to the step's longest context.

Prints one JSON line (and writes it to `--save-result FILE`) with the median step time of each
(ms) and the ratios to `kernels`.
    python benchmarks/attention_bench.py [--dtype bfloat16] [--batch 64]
        [--min-len 32] [--max-len 1536] [--rounds 6]
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

import engine.model_runner as runner_module  # noqa: E402
from benchmarks.harness import add_save_result, save_result  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    """Run the A/B; print and return the JSON result."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=1536)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps-per-round", type=int, default=4)
    add_save_result(p)
    args = p.parse_args(argv)
    eng = LLMEngine(EngineConfig(dtype=args.dtype, kv_cache_memory=2.0))
    rng = random.Random(0)
    for i in range(args.batch):
        n = rng.randint(args.min_len, args.max_len)
        eng.add_request(str(i), [rng.randrange(100, 49000) for _ in range(n)],
                        SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0))
    for _ in range(10_000):               # bounded: prefill everything, then decode
        eng.step()
        running = eng.scheduler.running
        if (len(running) == args.batch and not eng.scheduler.waiting
                and all(r.output_token_ids for r in running)):
            break
    kernels = eng.runner.kernels
    if kernels is None:
        raise SystemExit("no compiled CPU kernels here (no C compiler, or CONTINUUM_CPU_KERNELS=0)")
    grouped = (runner_module.DECODE_GROUP_RATIO, runner_module.DECODE_GROUP_MAX_BLOCKS)
    variants = {"kernels": (kernels, grouped), "torch_grouped": (None, grouped),
                "torch_one_group": (None, (None, grouped[1]))}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, (kern, (ratio, cap)) in variants.items():
            eng.runner.kernels = kern
            runner_module.DECODE_GROUP_RATIO, runner_module.DECODE_GROUP_MAX_BLOCKS = ratio, cap
            for _ in range(args.steps_per_round):
                t0 = time.perf_counter()
                eng.step()
                times[name].append(time.perf_counter() - t0)
    eng.runner.kernels = kernels
    runner_module.DECODE_GROUP_RATIO, runner_module.DECODE_GROUP_MAX_BLOCKS = grouped
    med = {k: round(statistics.median(v) * 1000, 1) for k, v in times.items()}
    result = {"benchmark": "attention_paths", "dtype": args.dtype, "batch": args.batch,
              "context_tokens": [args.min_len, args.max_len],
              **{f"{k}_step_ms": v for k, v in med.items()},
              **{f"{k}_over_kernels": round(v / med["kernels"], 2)
                 for k, v in med.items() if k != "kernels"}}
    print(json.dumps(result))
    save_result(args.save_result, result)
    return result


if __name__ == "__main__":
    main()
