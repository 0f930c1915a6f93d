"""What one engine step costs on this host, by decode batch and by prefill tokens (issue
"SLO-aware scheduling": the profile behind its feasibility bound), in-process, one run.

No server and no client: `LLMEngine.step` timed with `time.perf_counter`, per dtype.

- `decode_step_ms`: median step (ms; the median of `--repeats` sweeps) with B requests all
  decoding, each at `--context` tokens of context, for B in `--batches`. `per_row_ms` is the
  slope between the two largest batches.
  `rows_within_2x` is where the step curve (linear between measured batches) crosses twice the
  B = 1 step, the target `slo_bench` sets (`--target-itl-ms` = 2 x the unloaded decode step):
  a larger decode batch cannot meet it even with no prefill in the step.
  `decode_throughput_within_2x_ratio` is its tokens/s (rows / target) over the largest batch's
  (B / step): the most decode throughput any schedule keeping every step within the
  target can have against one that lets the batch grow, before any prefill. Under 0.95 it rules
  out the issue's "throughput >= 0.95x the fixed budget's" at concurrency max(B).
- `prefill_ms_per_token`: with `--decodes` requests decoding, the median step with P prompt
  tokens of one new request added, minus the decode-only step, over P (the largest P).
- `step_p99_over_median`: a lone request's decode steps, p99 / median: the host's jitter, which
  a p99 target must leave room for (`slo_bench`'s `most_load_p99_within_target`).

On a GPU a decode batch costs about one row (the step reads the weights once); on a CPU each row
costs a GEMM row at the host's FLOP rate, so `per_row_ms` against the B = 1 step says how much
decode batching a latency target leaves.

    python benchmarks/step_cost_bench.py [--dtypes float32,bfloat16] [--batches 1,4,16,32,64]
        [--save-result FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.engine_bench import random_prompts  # noqa: E402
from benchmarks.harness import add_save_result, save_result  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402


def _timed_steps(eng: LLMEngine, n: int) -> list[float]:
    """Durations (ms) of `n` engine steps."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        eng.step()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _prompts(eng: LLMEngine, seeds, n: int, length: int) -> list[list[int]]:
    """`n` random prompts of `length` tokens, from the next seed (no two calls alike)."""
    return random_prompts(n, length, eng.model_config.vocab_size, next(seeds))


def _start_decoding(eng: LLMEngine, seeds, batch: int, context: int, tag: str) -> None:
    """Add `batch` requests of `context` prompt tokens; step until all of them decode."""
    for i, prompt in enumerate(_prompts(eng, seeds, batch, context)):
        eng.add_request(f"{tag}-{i}", prompt,
                        SamplingParams(max_tokens=1024, ignore_eos=True, temperature=0))
    sched = eng.scheduler
    while sched.waiting or not all(r.output_token_ids for r in sched.running):
        eng.step()


def _drain(eng: LLMEngine) -> None:
    eng.abort_all()
    while eng.has_unfinished_requests():
        eng.step()


def decode_steps(eng: LLMEngine, seeds, batches: list[int], context: int, steps: int,
                 repeats: int) -> dict:
    """Median decode-only step (ms) per batch size: the median over `repeats` sweeps of each
    sweep's median (the host's load drifts between sweeps more than within one)."""
    sweeps = {b: [] for b in batches}
    for r in range(repeats):
        for b in batches:
            _start_decoding(eng, seeds, b, context, f"b{b}-{r}")
            sweeps[b].append(statistics.median(_timed_steps(eng, steps + 3)[3:]))
            _drain(eng)
    return {b: statistics.median(v) for b, v in sweeps.items()}


def prefill_cost(eng: LLMEngine, seeds, decodes: int, sizes: list[int], context: int,
                 repeats: int) -> dict:
    """Median step (ms) with `decodes` decoding plus P prompt tokens of a new one-token request."""
    _start_decoding(eng, seeds, decodes, context, "d")
    out = {0: statistics.median(_timed_steps(eng, repeats + 2)[2:])}
    for p in sizes:
        times = []
        for k in range(repeats):
            eng.add_request(f"p{p}-{k}", _prompts(eng, seeds, 1, p)[0],
                            SamplingParams(max_tokens=1))
            times += _timed_steps(eng, 1)            # the whole prompt in one step, then done
        out[p] = statistics.median(times)
    _drain(eng)
    return out


def jitter(eng: LLMEngine, seeds, context: int, steps: int) -> tuple[float, float]:
    """A lone request's decode steps: (median ms, p99 / median)."""
    _start_decoding(eng, seeds, 1, context, "j")
    times = _timed_steps(eng, steps)
    _drain(eng)
    med = statistics.median(times)
    return med, float(np.percentile(times, 99)) / med


def rows_within(step_ms: dict[int, float], target_ms: float) -> float:
    """Decode rows at which the step curve (linear between measured batch sizes, ascending)
    reaches `target_ms`; the largest batch if it never does."""
    pts = sorted(step_ms.items())
    for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
        if t1 > target_ms:
            return b0 + (b1 - b0) * max(0.0, target_ms - t0) / (t1 - t0)
    return float(pts[-1][0])


def measure(dtype: str, args) -> dict:
    """Every figure of the module docstring for one dtype."""
    seeds = itertools.count(args.seed)
    sizes = [32, 128]
    eng = LLMEngine(EngineConfig(dtype=dtype, device="cpu", enable_prefix_caching=False,
                                 max_num_batched_tokens=max(2048, args.decodes + sizes[-1])))
    batches = sorted(int(b) for b in args.batches.split(","))
    dec = decode_steps(eng, seeds, batches, args.context, args.steps, args.repeats)
    pre = prefill_cost(eng, seeds, args.decodes, sizes, args.context, args.steps)
    med, ratio = jitter(eng, seeds, args.context, args.jitter_steps)
    eng.shutdown()
    target = 2 * dec[batches[0]]
    hi, lo = batches[-1], batches[-2] if len(batches) > 1 else batches[-1]
    rows = rows_within(dec, target)
    return {
        "decode_step_ms": {str(b): round(v, 1) for b, v in dec.items()},
        "per_row_ms": round((dec[hi] - dec[lo]) / max(1, hi - lo), 2),
        "rows_within_2x": round(rows, 1),
        "decode_throughput_within_2x_ratio": round((rows / target) / (hi / dec[hi]), 2),
        "prefill_step_ms": {str(p): round(v, 1) for p, v in pre.items()},
        "prefill_ms_per_token": round((pre[sizes[-1]] - pre[0]) / sizes[-1], 2),
        "lone_step_median_ms": round(med, 1),
        "step_p99_over_median": round(ratio, 2),
    }


def main(argv: list[str] | None = None) -> dict:
    """Measure every dtype; print, save and return the result."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batches", default="1,4,16,32,64")
    p.add_argument("--context", type=int, default=256, help="prompt tokens per decoding request")
    p.add_argument("--decodes", type=int, default=5, help="decoding requests beside a prefill")
    p.add_argument("--steps", type=int, default=20, help="timed steps per point (median)")
    p.add_argument("--repeats", type=int, default=3, help="sweeps over --batches (median)")
    p.add_argument("--jitter-steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    add_save_result(p)
    args = p.parse_args(argv)
    res = {"benchmark": "step_cost", "threads": torch.get_num_threads(), "context": args.context}
    for dtype in args.dtypes.split(","):
        res[dtype] = measure(dtype, args)
        print(json.dumps({dtype: res[dtype]}), file=sys.stderr, flush=True)
    print(json.dumps(res))
    save_result(args.save_result, res)
    return res


if __name__ == "__main__":
    main()
