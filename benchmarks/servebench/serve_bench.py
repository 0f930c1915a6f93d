"""`continuum bench serve`: load-test any OpenAI-compatible server (vLLM's `vllm bench serve`).

Sends a dataset's requests to `--base-url` (endpoint `chat` or `completions`, always streamed),
with Poisson arrivals at `--request-rate` (`inf` = all at once; `--burstiness` b draws gamma
inter-arrival times of shape b, 1 = Poisson) under `--max-concurrency` (a comma list runs a
sweep in one call). Measures TTFT, TPOT, ITL, E2EL, throughputs and goodput with vLLM's
definitions (`bench_metrics.py`), shows a progress bar, prints a table, and can save the results
(`--save-result FILE.json`: a list with one object per sweep point, vLLM's keys) and plot them
(`--plot FILE.png`).

Output tokens come from the server's usage (requested with `stream_options.include_usage`) when
it reports it, else from the tokenizer. Every loop is bounded: `--num-prompts` requests per
point, `--request-timeout` per request, `--max-duration` per point. Only `--base-url` is
contacted.

    continuum bench serve --base-url http://127.0.0.1:8000 --dataset-name random \\
        --random-input-len 128 --random-output-len 128 --ignore-eos --num-prompts 64 \\
        --max-concurrency 1,16,64 --save-result out.json --plot out.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):          # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import aiohttp  # noqa: E402
import httpx  # noqa: E402

from benchmarks.harness import save_result  # noqa: E402
from benchmarks.servebench.bench_datasets import (  # noqa: E402
    SampleRequest, prefix_repetition_dataset, random_dataset, sharegpt_dataset)
from benchmarks.servebench.bench_metrics import (  # noqa: E402
    RequestResult, calculate_metrics, parse_goodput)


# ----------------------------------------------------------------------------- one request
async def send_request(session: aiohttp.ClientSession, url: str, model: str, endpoint: str,
                       req: SampleRequest, ignore_eos: bool, timeout: float,
                       tokenizer, extra_body: dict | None = None) -> RequestResult:
    """Stream one request; time the chunks that carry tokens.

    The client is aiohttp, as in vLLM's `bench serve`: it spends about half the CPU per streamed
    chunk that httpx does (0.24 vs 0.5 ms measured here), and on a small machine the load
    generator's CPU is taken from the server under test."""
    body: dict = {"model": model, "max_tokens": req.expected_output_len, "stream": True,
                  "stream_options": {"include_usage": True}, "temperature": 0.0}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra_body or {})
    result = RequestResult(success=False, prompt_len=req.prompt_len)
    text, usage_tokens = [], None
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                detail = (await resp.read()).decode(errors="replace")[:200]
                result.error = f"HTTP {resp.status}: {detail}"
                return result
            async for raw in resp.content:          # one SSE line at a time
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    return result
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                piece = "".join((c.get("delta") or {}).get("content") or c.get("text") or ""
                                for c in chunk.get("choices") or [])
                if piece:
                    now = time.perf_counter()
                    if not text:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    text.append(piece)
        result.latency = time.perf_counter() - start
        result.generated_text = "".join(text)
        result.output_len = usage_tokens if usage_tokens is not None else len(
            tokenizer.encode(result.generated_text, add_special_tokens=False))
        result.success = True
    except (aiohttp.ClientError, json.JSONDecodeError, asyncio.TimeoutError,
            ValueError) as e:          # ValueError: an undecodable or oversized line
        result.error = f"{type(e).__name__}: {e}"
    return result


# ----------------------------------------------------------------------------- one run
async def run_point(base_url: str, model: str, endpoint: str, requests: list[SampleRequest],
                    request_rate: float, burstiness: float, max_concurrency: int | None,
                    ignore_eos: bool, request_timeout: float, max_duration: float, seed: int,
                    tokenizer, progress: bool = True, api_key: str | None = None,
                    extra_body: dict | None = None, lora_modules: list[str] | None = None
                    ) -> tuple[list[RequestResult], float]:
    """Send every request once with the given arrival process; returns results and duration.
    With `lora_modules`, each request names one of them, drawn at random (vLLM's
    `--lora-modules`)."""
    from tqdm.asyncio import tqdm

    url = base_url.rstrip("/") + ("/v1/chat/completions" if endpoint == "chat"
                                  else "/v1/completions")
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, desc=f"concurrency {max_concurrency}")

    pick = random.Random(seed + 1)
    models = {id(req): pick.choice(lora_modules) if lora_modules else model for req in requests}

    async def limited(client, req):
        if limit is None:
            r = await send_request(client, url, models[id(req)], endpoint, req, ignore_eos,
                                   request_timeout, tokenizer, extra_body)
        else:
            async with limit:
                r = await send_request(client, url, models[id(req)], endpoint, req, ignore_eos,
                                       request_timeout, tokenizer, extra_body)
        bar.update(1)
        return r

    connector = aiohttp.TCPConnector(limit=max_concurrency or len(requests) or 1)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(connector=connector, headers=headers,
                                     read_bufsize=1 << 20) as client:
        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(limited(client, req)))
            if math.isfinite(request_rate):
                # Gamma(shape=b, scale=1/(rate*b)): mean 1/rate; b = 1 is a Poisson process.
                await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness)))
        done, pending = await asyncio.wait(tasks, timeout=max_duration)
        for t in pending:
            t.cancel()
        duration = time.perf_counter() - start
    bar.close()
    results = [t.result() for t in done]
    results += [RequestResult(False, 0, error="not finished within --max-duration")] * len(pending)
    return results, duration


# ----------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser, with_base_url: bool = True) -> None:
    """The workload flags (vLLM names), shared by `bench serve` and `bench compare`."""
    if with_base_url:
        p.add_argument("--base-url", required=True,
                       help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="completions")
    p.add_argument("--model", default=None, help="default: the first model of /v1/models")
    p.add_argument("--tokenizer", default=None,
                   help="local tokenizer path (default: the served model's root, if local)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset-name", choices=["random", "sharegpt", "prefix-repetition"],
                   default="random")
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    p.add_argument("--prefix-repetition-output-len", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf = all at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival times (1 = Poisson)")
    p.add_argument("--max-concurrency", default=None,
                   help="in-flight request bound; a comma list runs a sweep, e.g. 1,4,16,64")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                   help="LoRA adapters the server serves: each request names one, at random")
    p.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                   help='fields added to every request body, e.g. \'{"min_tokens": 128}\'')
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--max-duration", type=float, default=3600.0,
                   help="seconds per sweep point; unfinished requests count as failed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", default=None, help="JSON file: one object per sweep point")
    p.add_argument("--plot", default=None, help="PNG: throughput vs latency, TTFT/TPOT spread")
    p.add_argument("--no-progress", action="store_true")


def _resolve_model(args) -> tuple[str, str | None]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    data = httpx.get(args.base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30).json()
    first = data["data"][0]
    return args.model or first["id"], first.get("root")


def build_requests(args, tokenizer, seed: int) -> list[SampleRequest]:
    """The dataset's requests for parsed `args`, drawn with `seed`."""
    if args.dataset_name == "random":
        return random_dataset(tokenizer, args.num_prompts, args.random_input_len,
                              args.random_output_len, args.random_range_ratio, seed)
    if args.dataset_name == "sharegpt":
        return sharegpt_dataset(tokenizer, args.num_prompts,
                                Path(args.dataset_path) if args.dataset_path else None,
                                seed, args.sharegpt_output_len)
    return prefix_repetition_dataset(
        tokenizer, args.num_prompts, args.prefix_repetition_prefix_len,
        args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
        args.prefix_repetition_output_len, seed)


def run(args) -> list[dict]:
    """Run the benchmark described by parsed `args`; returns one result dict per point."""
    slos = parse_goodput(args.goodput)
    model, root = _resolve_model(args)
    if args.tokenizer and not Path(args.tokenizer).exists():
        raise ValueError(f"--tokenizer {args.tokenizer!r} is not a local path (nothing is "
                         "downloaded)")
    tok_path = args.tokenizer or root
    if not tok_path or not Path(tok_path).exists():
        raise ValueError("no local tokenizer: pass --tokenizer PATH (the server's model root "
                         f"{root!r} is not a local path)")
    from engine.tokenizer import load_tokenizer     # AutoTokenizer's choice, without AutoConfig
    tokenizer = load_tokenizer(tok_path)
    points = ([int(c) for c in str(args.max_concurrency).split(",")]
              if args.max_concurrency else [None])
    results = []
    for i, conc in enumerate(points):
        # Each sweep point draws its own prompts (seed + point index): with the same prompts, a
        # server's prefix cache would serve a later point's prefills from an earlier point's.
        seed = args.seed + i
        requests = build_requests(args, tokenizer, seed)
        per_request, duration = asyncio.run(run_point(
            args.base_url, model, args.endpoint, requests, args.request_rate, args.burstiness,
            conc, args.ignore_eos, args.request_timeout, args.max_duration, seed,
            tokenizer, progress=not args.no_progress, api_key=args.api_key,
            extra_body=args.extra_body, lora_modules=args.lora_modules))
        metrics = calculate_metrics(per_request, duration, goodput_slos=slos or None)
        metrics.update({"backend": "openai", "base_url": args.base_url, "model_id": model,
                        "endpoint": args.endpoint, "dataset_name": args.dataset_name,
                        "num_prompts": len(requests), "request_rate": args.request_rate,
                        "burstiness": args.burstiness, "max_concurrency": conc, "seed": seed,
                        "ttfts": [r.ttft for r in per_request if r.success],
                        "itls": [gap for r in per_request if r.success for gap in r.itl],
                        "tpots": [(r.latency - r.ttft) / (r.output_len - 1)
                                  for r in per_request if r.success and r.output_len > 1]})
        results.append(metrics)
        print_summary(metrics)
    save_result(args.save_result, results, indent=1)
    if args.plot:
        plot(results, args.plot)
    return results


def print_summary(m: dict) -> None:
    """One point's results as a table on stdout (times in ms)."""
    rows = [("Max concurrency", m["max_concurrency"]), ("Successful requests", m["completed"]),
            ("Failed requests", m["failed"]), ("Duration (s)", f"{m['duration']:.2f}"),
            ("Request throughput (req/s)", f"{m['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{m['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{m['total_token_throughput']:.2f}")]
    if "request_goodput" in m:
        rows.append(("Request goodput (req/s)", f"{m['request_goodput']:.2f}"))
    for name in ("ttft", "tpot", "itl", "e2el"):
        rows += [(f"Mean {name.upper()} (ms)", f"{m[f'mean_{name}_ms']:.2f}"),
                 (f"Median {name.upper()} (ms)", f"{m[f'median_{name}_ms']:.2f}"),
                 (f"P99 {name.upper()} (ms)", f"{m[f'p99_{name}_ms']:.2f}")]
    print("=" * 50)
    for k, v in rows:
        print(f"{k:<40}{'-' if v is None else v:>10}")     # None: not set (no concurrency cap)
    for err in m["errors"][:5]:
        print(f"error: {err}")
    print("=" * 50, flush=True)


def plot(results: list[dict], path: str) -> None:
    """Throughput vs. median TTFT / TPOT across the sweep, and TTFT / TPOT distributions."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    thr = [r["output_throughput"] for r in results]
    ax = axes[0]
    ax.plot(thr, [r["median_tpot_ms"] for r in results], "o-", label="median TPOT (ms)")
    ax.plot(thr, [r["median_ttft_ms"] for r in results], "s--", label="median TTFT (ms)")
    for r, x in zip(results, thr):
        ax.annotate(f"c={r['max_concurrency']}", (x, r["median_tpot_ms"]), fontsize=8)
    ax.set_xlabel("output throughput (tok/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.set_title("throughput vs latency")
    ax.legend()
    for ax, key, title in ((axes[1], "ttfts", "TTFT (ms)"), (axes[2], "tpots", "TPOT (ms)")):
        ax.boxplot([[v * 1000 for v in r[key]] or [0] for r in results])
        ax.set_xticks(range(1, len(results) + 1),
                      [f"c={r['max_concurrency']}" for r in results])
        ax.set_title(f"{title} distribution")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="continuum bench serve", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        run(args)
    except (ValueError, FileNotFoundError, httpx.HTTPError) as e:
        print(f"continuum bench serve: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
