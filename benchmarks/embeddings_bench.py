"""`POST /v1/embeddings` vs `POST /v2/models/{m}/infer` on the same server, same texts.

Both routes reach the same model runtime and dynamic batcher, so the OpenAI layer's cost is
what this measures: `--concurrency` closed-loop clients (aiohttp, one text per request, the
next sent when the previous is answered) drive `/v1/embeddings` (`encoding_format` float, so
both answers are JSON floats) for `--duration` seconds after a `--warmup`, then `/v2/.../infer`
(JSON body: TEXT BYTES [1, 1]) the same way, for `--rounds` rounds (the order alternating);
results are pooled per route. Also reported: the mean batch size the encoder step ran during
each route's phases (from the statistics extension), to show both are batched alike.

Prints one JSON object: per route requests/s and p50 / p99 latency (ms), and the throughput
ratio v1 / v2 (goal ≥ 0.9). Starts its own `continuum serve --no-llm` on the example
repository unless given `--base-url`. Usage:
    python benchmarks/embeddings_bench.py [--duration 10] [--concurrency 16] [--base-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (add_save_result, closed_loop, continuum,  # noqa: E402
                                latency_summary, save_result)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "model_repository"
SENTENCES = ["The quick brown fox jumps over the lazy dog.",
             "Continuous batching keeps the accelerator busy between requests.",
             "Paris is the capital of France and its largest city.",
             "A short one.",
             "Embeddings map each text to a point in a space where similar texts lie close.",
             "The dynamic batcher waits a little so that requests can share one execution."]
GOAL = 0.9


def _bodies(route: str, model: str, encoding: str) -> tuple[str, list[dict]]:
    """(path, one JSON body per sentence) of `route` ("v1" or "v2")."""
    if route == "v1":
        return "/v1/embeddings", [{"model": model, "input": s, "encoding_format": encoding}
                                  for s in SENTENCES]
    return f"/v2/models/{model}/infer", [
        {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [s]}]}
        for s in SENTENCES]


async def drive(base: str, route: str, args) -> dict:
    """Closed loop of `args.concurrency` clients (`harness.closed_loop`) against one route;
    latencies (s) of the requests sent after the warm-up, and the count of failures (non-200
    or no answer)."""
    import aiohttp

    path, bodies = _bodies(route, args.model, args.encoding_format)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(base, connector=connector, headers=headers) as session:
        async def post(body: dict) -> bool:
            async with session.post(path, json=body) as r:
                await r.read()
                return r.status == 200

        latencies, failures = await closed_loop(
            lambda w, i: post(bodies[i % len(bodies)]), args.concurrency, args.duration,
            args.warmup)
    return {"latencies": latencies, "failed": failures}


def _encoder_counts(base: str, model: str) -> tuple[int, int]:
    """(inference_count, execution_count) summed over the model's composing steps, or over
    the model itself when it is not an ensemble."""
    import httpx

    config = httpx.get(f"{base}/v2/models/{model}/config", timeout=10).json()
    steps = [s["model_name"] for s in config.get("ensemble_scheduling", {}).get("step", [])]
    names = [s for s in steps if "encoder" in s] or steps[:1] or [model]
    stats = httpx.get(f"{base}/v2/models/{names[0]}/stats", timeout=10).json()["model_stats"][0]
    return stats["inference_count"], stats["execution_count"]


def _summary(runs: list[dict], duration: float, batches: list[tuple[int, int]]) -> dict:
    """One route's runs pooled: `harness.latency_summary` over all of them (ms to 2
    decimals), failures, and the encoder's mean batch size over the runs' phases."""
    latencies = [x for r in runs for x in r["latencies"]]
    inferences, executions = (sum(b[i] for b in batches) for i in (0, 1))
    return {**latency_summary(latencies, duration * len(runs), digits=2),
            "failed": sum(r["failed"] for r in runs),
            "encoder_mean_batch": round(inferences / executions, 2) if executions else None}


def run(base: str, args) -> dict:
    """Drive both routes `args.rounds` times (v1 first in even rounds, v2 first in odd ones,
    so that a drift of the machine's speed favours neither); the result object."""
    runs = {"v1": [], "v2": []}
    batches = {"v1": [], "v2": []}
    for r in range(args.rounds):
        for route in ("v1", "v2") if r % 2 == 0 else ("v2", "v1"):
            before = _encoder_counts(base, args.model)
            runs[route].append(asyncio.run(drive(base, route, args)))
            after = _encoder_counts(base, args.model)
            batches[route].append((after[0] - before[0], after[1] - before[1]))
    v1 = _summary(runs["v1"], args.duration, batches["v1"])
    v2 = _summary(runs["v2"], args.duration, batches["v2"])
    ratio = round(v1["requests_per_s"] / v2["requests_per_s"], 3) if v2["requests_per_s"] \
        else None
    return {"model": args.model, "concurrency": args.concurrency, "duration_s": args.duration,
            "rounds": args.rounds, "encoding_format": args.encoding_format,
            "v1_embeddings": v1, "v2_infer": v2, "throughput_ratio_v1_over_v2": ratio,
            "goal": GOAL, "meets_goal": ratio is not None and ratio >= GOAL}


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print and return the JSON result."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=10.0, help="seconds measured per phase")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds not measured first")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent clients")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of both routes (order alternating), pooled")
    p.add_argument("--model", default="text_embedding")
    p.add_argument("--encoding-format", default="float", choices=["float", "base64"])
    p.add_argument("--base-url", default=None,
                   help="a running server (default: start one on the example repository)")
    p.add_argument("--api-key", default=None, help="the server's --api-key, if any")
    add_save_result(p)
    args = p.parse_args(argv)
    if args.base_url:
        result = run(args.base_url.rstrip("/").removesuffix("/v1"), args)
    else:
        from examples.prepare_model_repository import prepare

        prepare()                                   # the example model files (idempotent)
        flags = ["--no-llm", "--model-repository", str(EXAMPLES), "--uvicorn-log-level",
                 "warning", "--grpc-port", "0"]
        with continuum(flags, timeout=180) as srv:
            result = run(srv.base, args)
    print(json.dumps(result))
    save_result(args.save_result, result)
    return result


if __name__ == "__main__":
    main()
