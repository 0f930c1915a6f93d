"""Structured outputs: what the grammar mask costs, and what compiling a schema costs.

Throughput: the same chat prompts at each `--concurrency` (closed loop, `--num-prompts`
requests), first with a JSON schema (`response_format` json_schema, greedy), then unconstrained
with each request's `max_tokens` set to the number of tokens its constrained twin produced and
`ignore_eos` — so both runs generate exactly the same number of tokens and the ratio of output
tokens/s is the mask's cost (goal ≥ 0.9). Rounds alternate the order (`--rounds`).

Compile: time to first token of a request with a schema the server has never seen (the
compile happens before the engine admits it), of a second request with the same schema (cached)
and of the same request unconstrained, each the median of `--compile-trials` fresh schemas.

Prints one JSON object (and writes it to `--save-result FILE`). Starts its own `continuum serve`
unless given `--base-url`. Usage:
    python benchmarks/structured_bench.py [--concurrency 1,16] [--num-prompts 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import add_save_result, continuum, save_result  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
GOAL = 0.9
TOPICS = ["a librarian", "a pilot", "a chef", "a farmer", "a doctor", "a painter", "a sailor",
          "a teacher"]


def schema(extra: str | None = None) -> dict:
    """The benchmark's schema (a person with nested and bounded fields); `extra` adds a
    property so the schema is new to the server's cache."""
    props = {"name": {"type": "string", "maxLength": 24},
             "age": {"type": "integer", "minimum": 18, "maximum": 99},
             "job": {"enum": ["engineer", "artist", "cook", "pilot", "other"]},
             "skills": {"type": "array", "items": {"type": "string", "maxLength": 16},
                        "minItems": 2, "maxItems": 4},
             "city": {"type": "string", "maxLength": 20}}
    if extra:
        props[extra] = {"type": "boolean"}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def body(i: int, constrained: dict | None, max_tokens: int) -> dict:
    b = {"model": MODEL, "temperature": 0, "max_tokens": max_tokens, "stream": True,
         "stream_options": {"include_usage": True},
         "messages": [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} "
                                                  "as a JSON object."}]}
    if constrained is not None:
        b["response_format"] = {"type": "json_schema",
                                "json_schema": {"name": "person", "schema": constrained}}
    else:
        b["ignore_eos"] = True
    return b


async def one(client: httpx.AsyncClient, url: str, payload: dict) -> tuple[float, int]:
    """(seconds to the first content token, completion tokens) of one streamed request."""
    t0, ttft, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", url, json=payload) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if ttft is None and any(c["delta"].get("content") for c in chunk["choices"]):
                ttft = time.perf_counter() - t0
    return ttft or 0.0, tokens


async def run(url: str, payloads: list[dict], concurrency: int) -> tuple[float, list[int]]:
    """(wall seconds, completion tokens per request) of `payloads` at `concurrency`."""
    queue = list(enumerate(payloads))
    tokens = [0] * len(payloads)
    async with httpx.AsyncClient(timeout=600) as client:
        async def worker():
            while queue:
                i, p = queue.pop(0)
                tokens[i] = (await one(client, url, p))[1]
        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return time.perf_counter() - t0, tokens


async def throughput(url: str, concurrency: int, n: int, rounds: int) -> dict:
    s = schema()
    constrained = [body(i, s, 200) for i in range(n)]
    _, tokens = await run(url, constrained, concurrency)          # warm-up; fixes the lengths
    free = [body(i, None, t) for i, t in enumerate(tokens)]
    times = {"json_schema": [], "unconstrained": []}
    for r in range(rounds):
        order = [("json_schema", constrained), ("unconstrained", free)]
        for name, payloads in order if r % 2 == 0 else order[::-1]:
            wall, got = await run(url, payloads, concurrency)
            times[name].append(sum(got) / wall)
    tps = {k: statistics.median(v) for k, v in times.items()}
    return {"concurrency": concurrency, "requests": n, "output_tokens": sum(tokens),
            "tok_per_s": {k: round(v, 1) for k, v in tps.items()},
            "ratio": round(tps["json_schema"] / tps["unconstrained"], 3)}


async def compile_times(url: str, trials: int) -> dict:
    first, cached, free = [], [], []
    async with httpx.AsyncClient(timeout=600) as client:
        for _ in range(trials):
            s = schema(f"x_{uuid.uuid4().hex[:8]}")
            first.append((await one(client, url, body(0, s, 8)))[0])
            cached.append((await one(client, url, body(0, s, 8)))[0])
            free.append((await one(client, url, body(0, None, 8)))[0])
    ms = lambda xs: round(1000 * statistics.median(xs), 1)          # noqa: E731
    return {"ttft_ms_new_schema": ms(first), "ttft_ms_cached_schema": ms(cached),
            "ttft_ms_unconstrained": ms(free),
            "compile_ms": round(ms(first) - ms(cached), 1)}


def measure(base: str, args) -> dict:
    """Both parts against the server at `base`: the result object."""
    url = f"{base}/v1/chat/completions"
    result = {"compile": asyncio.run(compile_times(url, args.compile_trials)),
              "throughput": [asyncio.run(throughput(url, int(c), args.num_prompts, args.rounds))
                             for c in args.concurrency.split(",")],
              "goal_ratio": GOAL}
    result["meets_goal"] = all(t["ratio"] >= GOAL for t in result["throughput"])
    return result


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark (flags: see --help); print and return the JSON result."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="a running server (default: start one)")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--compile-trials", type=int, default=5)
    add_save_result(p)
    args = p.parse_args(argv)
    if args.base_url:
        result = measure(args.base_url, args)
    else:
        with continuum(["--max-model-len", "2048"], timeout=900) as srv:
            result = measure(srv.base, args)
    print(json.dumps(result, indent=2))
    save_result(args.save_result, result)
    return result


if __name__ == "__main__":
    main()
