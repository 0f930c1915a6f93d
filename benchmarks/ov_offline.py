"""OpenVINO GenAI offline, for `benchmarks/cpu_peers_bench.py` (run with the OpenVINO venv's
python, which has neither this repository's packages nor its dependencies).

In: `--ir DIR` (an `optimum-cli export openvino` output), `--prompts FILE` (JSON: a list of
token-id lists), `--output-len`, `--concurrency 1,16,64`, `--c1-prompts`. Runs, per
concurrency c, the prompts (the first `--c1-prompts` at c = 1) in waves of c requests handed
to one `ContinuousBatchingPipeline.generate` call each (greedy, `ignore_eos`), 2 inference
threads, a 4 GB KV cache and dynamic split-fuse (../shared/REFERENCES.md's settings). Out: one
JSON line on stdout, `{"points": [{"concurrency", "prompts", "output_tok_s",
"output_tokens"}]}`; output tokens / wall seconds of all waves, after one warm-up request.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import openvino as ov
import openvino_genai as ov_genai


def pipeline(ir: str) -> ov_genai.ContinuousBatchingPipeline:
    """The pipeline on 2 CPU threads (the host's cores), as the references run it."""
    sched = ov_genai.SchedulerConfig()
    sched.cache_size = 4
    sched.dynamic_split_fuse = True
    sched.max_num_batched_tokens = 2048
    return ov_genai.ContinuousBatchingPipeline(ir, sched, "CPU", {"INFERENCE_NUM_THREADS": 2})


def run_waves(pipe, prompts: list[list[int]], c: int, output_len: int) -> tuple[float, int]:
    """(seconds, output tokens) for `prompts` in waves of `c`."""
    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens, cfg.min_new_tokens, cfg.ignore_eos = output_len, output_len, True
    tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), c):
        wave = [ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts[i:i + c]]
        for r in pipe.generate(wave, [cfg] * len(wave)):
            tokens += len(r.m_generation_ids[0])
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ir", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--c1-prompts", type=int, default=16)
    args = ap.parse_args()
    prompts = json.load(open(args.prompts))
    pipe = pipeline(args.ir)
    run_waves(pipe, prompts[:1], 1, 8)                                 # warm-up
    points = []
    for c in (int(x) for x in args.concurrency.split(",")):
        batch = prompts[:args.c1_prompts] if c == 1 else prompts
        seconds, tokens = run_waves(pipe, batch, c, args.output_len)
        points.append({"concurrency": c, "prompts": len(batch), "output_tokens": tokens,
                       "output_tok_s": round(tokens / seconds, 1)})
    print(json.dumps({"points": points}), flush=True)


if __name__ == "__main__":
    main()
