"""Thread vs. process engine loop, measured the way a server uses it.

For each back-end (`AsyncLLM`: engine loop in a thread; `ProcessAsyncLLM`: engine in a child
process) and each concurrency, N streamed requests (random prompts, EOS ignored) go through
`generate`; every delta is formatted as an OpenAI SSE chunk with `json.dumps` on the event loop
(the HTTP layer's per-token work), and a probe coroutine measures event-loop lag (how late a
5 ms sleep wakes up — what an HTTP request arriving meanwhile would wait).

Prints one JSON line per (back-end, concurrency): output throughput (tok/s), mean TTFT (ms),
ITL p50 / p99 (ms), event-loop lag p50 / p99 (ms); `--save-result FILE` writes them as a list.

    python benchmarks/async_bench.py [--concurrency 1,64] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import add_save_result, save_result  # noqa: E402
from engine.async_llm import AsyncLLM, ProcessAsyncLLM  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


async def run_load(llm, concurrency: int, input_len: int, output_len: int, seed: int) -> dict:
    """`concurrency` streamed requests at once through `llm`; returns throughput (tok/s), TTFT, ITL and event-loop lag (ms)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 49000) for _ in range(input_len)] for _ in range(concurrency)]
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
    lags: list[float] = []
    done = asyncio.Event()

    async def probe():
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - t - 0.005)

    async def one(i: int):
        start = time.perf_counter()
        stamps, n = [], 0
        async for out in llm.generate(f"bench-{seed}-{i}", prompts[i], params):
            c = out.outputs[0]
            json.dumps({"id": f"chatcmpl-{i}", "object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {"content": c.text}, "finish_reason": c.finish_reason}]})
            stamps.append(time.perf_counter())
            n += len(c.token_ids)
        return start, stamps, n

    probe_task = asyncio.create_task(probe())
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - t0
    done.set()
    await probe_task
    ttft = [s[0] - start for start, s, _ in results]
    itl = [b - a for _, s, _ in results for a, b in zip(s, s[1:])]
    return {"output_throughput_tok_s": round(sum(n for *_, n in results) / elapsed, 1),
            "mean_ttft_ms": round(statistics.fmean(ttft) * 1e3, 1),
            "p50_itl_ms": round(pct(itl, 0.5) * 1e3, 2), "p99_itl_ms": round(pct(itl, 0.99) * 1e3, 2),
            "p50_loop_lag_ms": round(pct(lags, 0.5) * 1e3, 2),
            "p99_loop_lag_ms": round(pct(lags, 0.99) * 1e3, 2)}


def main(argv: list[str] | None = None) -> list[dict]:
    """Run every (back-end, concurrency) point; print, save and return their results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    add_save_result(ap)
    args = ap.parse_args(argv)
    results = []
    config = EngineConfig(dtype=args.dtype, device="cpu", kv_cache_memory=1.0,
                          max_model_len=args.input_len + args.output_len + 16)
    for backend in ("thread", "process"):
        llm = AsyncLLM(LLMEngine(config)) if backend == "thread" else ProcessAsyncLLM(config)
        try:
            asyncio.run(run_load(llm, 2, args.input_len, 8, seed=999))       # warm-up
            for c in map(int, args.concurrency.split(",")):
                r = asyncio.run(run_load(llm, c, args.input_len, args.output_len, seed=c))
                results.append({"benchmark": "async_backend", "backend": backend,
                                "concurrency": c, "dtype": args.dtype, **r})
                print(json.dumps(results[-1]), flush=True)
        finally:
            llm.shutdown()
    save_result(args.save_result, results)
    return results


if __name__ == "__main__":
    main()
