"""Tensor parallelism: per-step communication vs compute at N = 1 and N = 3, in one run.

Workload: `--num-prompts` seeded random prompts of `--input-len` tokens, `--output-len` output
tokens each (EOS ignored, greedy), all submitted at once to an offline `LLMEngine` in float32,
for each `--sizes` N (default 1,3: SmolLM2-135M has 9 heads and 3 KV heads). For each N, per step
class (steps that carry prefill tokens; decode-only steps), from rank 0:

- `step_ms`: mean wall time of `LLMEngine.step`;
- `collective_ms`: mean time rank 0 spends in all-reduce / all-gather (it includes waiting for
  the slowest rank, so on an oversubscribed host it is mostly that wait);
- `control_ms`: mean time to pickle the `SchedulerOutput` and write it to the workers' pipes;
- `compute_ms`: step - collective - control;
and `throughput_tok_s` (output tokens / wall time), `outputs_equal_to_n1` (greedy tokens).

A size written `N:gloo` runs N ranks with their collectives through gloo
(`CONTINUUM_TP_SHM=0`) instead of shared memory (engine/distributed/shm.py): `--sizes
1,3,3:gloo` compares the two transports in one run.

On this project's 2-core machine N = 3 puts three ranks on two cores: the figures show what the
split and its communication cost, not a speed-up (there is none to have without more cores or
devices). Prints one JSON line (and writes it to `--save-result FILE`).

    python benchmarks/tp_bench.py [--sizes 1,3,3:gloo] [--num-prompts 8] [--input-len 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine_bench import random_prompts  # noqa: E402
from benchmarks.harness import add_save_result, save_result  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402


def _counters(eng: LLMEngine) -> tuple[float, float]:
    """(collective seconds, control-plane seconds) so far on rank 0; zeros with one rank."""
    if eng._tp is None:
        return 0.0, 0.0
    group, workers = eng._tp
    return group.comm_seconds, workers.send_seconds


def measure(size: int, prompts: list[list[int]], output_len: int) -> tuple[dict, list]:
    """Run the workload on an engine of `size` ranks; (figures, greedy outputs)."""
    eng = LLMEngine(EngineConfig(dtype="float32", device="cpu", max_model_len=2048,
                                 kv_cache_memory=0.5, tensor_parallel_size=size))
    try:
        eng.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))   # warm-up
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
        ids = [f"tp-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            eng.add_request(rid, p, params)
        outputs: dict[str, list[int]] = {rid: [] for rid in ids}
        steps = {"prefill": [], "decode": []}
        t_start = time.perf_counter()
        while eng.has_unfinished_requests():
            kind = "prefill" if eng.scheduler.waiting or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running) \
                else "decode"
            c0, s0 = _counters(eng)
            t0 = time.perf_counter()
            for out in eng.step():
                outputs[out.request_id].extend(out.outputs[0].token_ids)
            t = time.perf_counter() - t0
            c1, s1 = _counters(eng)
            steps[kind].append((t, c1 - c0, s1 - s0))
        wall = time.perf_counter() - t_start
    finally:
        eng.shutdown()
    figures = {"throughput_tok_s": round(len(prompts) * output_len / wall, 1)}
    for kind, rows in steps.items():
        if not rows:
            continue
        step, coll, ctrl = (statistics.mean(r[i] for r in rows) * 1000 for i in range(3))
        figures[kind] = {"steps": len(rows), "step_ms": round(step, 2),
                         "collective_ms": round(coll, 2), "control_ms": round(ctrl, 3),
                         "compute_ms": round(step - coll - ctrl, 2),
                         "collective_share": round(coll / step, 3)}
    return figures, [outputs[rid] for rid in ids]


def main(argv: list[str] | None = None) -> dict:
    """Parse flags, run every size; print, save and return the result."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,3", help="tensor-parallel sizes, N or N:gloo "
                   "(default: 1,3)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=32, help="output tokens")
    p.add_argument("--seed", type=int, default=0)
    add_save_result(p)
    args = p.parse_args(argv)
    prompts = random_prompts(args.num_prompts, args.input_len, 49152, args.seed)
    result, first = {}, None
    for entry in args.sizes.split(","):
        size, _, transport = entry.partition(":")
        os.environ["CONTINUUM_TP_SHM"] = "0" if transport == "gloo" else "1"   # workers inherit
        figures, outs = measure(int(size), prompts, args.output_len)
        first = outs if first is None else first
        figures["outputs_equal_to_first_size"] = outs == first
        name = f"tp{size}" + (f"_{transport}" if transport else "")
        result[name] = figures
        print(f"{name}: {json.dumps(figures)}", file=sys.stderr)
    result = {"workload": {k: v for k, v in vars(args).items() if k != "save_result"}, **result}
    print(json.dumps(result))
    save_result(args.save_result, result)
    return result


if __name__ == "__main__":
    main()
