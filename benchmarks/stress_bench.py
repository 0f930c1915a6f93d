"""What an operator checks before putting a server behind a load balancer: an overload burst and
a disconnect storm against a real `continuum serve`, with the figures to report.

- `overload`: `burst` concurrent requests at once (10x what the server holds); the refused ones
  must get 503 + Retry-After quickly (latency p50 / p99 against the mean engine step), the
  accepted ones exact usage, and `/health/ready` must stay 200 throughout.
- `storm`: `n` requests (chat and completions, streamed and not) whose clients leave at random
  points (a third of them within 100 ms: while queued, before the first token); afterwards the
  engine must be idle — running = waiting = swapped = 0, device and swap KV usage 0.

Library functions (used by tests/test_stress.py) plus a CLI that starts its own server:

    python benchmarks/stress_bench.py --burst 120 --storm 1000 [--save-result out.json]

Memory is RSS of the server and its engine child, read from /proc, in MiB.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import add_save_result, continuum, percentile, save_result  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
# The overload server: 4 running + 8 waiting. Its context is long so that the requests holding
# it full while the probes run (FILL_TOKENS each) outlast them on any host: 4,000 tokens are
# ~20 s at the 5 ms step of the fastest host seen, the 50 probes well under a second (with
# 400-token fills and a 512-token context, a fast host finished the first fills before the
# probes began and every probe was accepted). 0.4 GiB of KV holds the four at full length in
# bfloat16.
OVERLOAD_FLAGS = ["--max-num-seqs", "4", "--max-waiting-requests", "8", "--max-model-len", "4096",
                  "--kv-cache-memory", "0.4"]
FILL_TOKENS = 4000
IDLE_GAUGES = ("continuum_num_requests_running", "continuum_num_requests_waiting",
               "continuum_num_requests_swapped", "continuum_kv_cache_usage_perc",
               "continuum_cpu_kv_cache_usage_perc")


def rss_mib(pid: int) -> float:
    """Resident memory of `pid` and its direct children (the engine process), MiB."""
    pids = [pid]
    try:
        pids += [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    total = 0
    for p in pids:
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        total += int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))
    return total / 1024


async def metrics(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    """Every unlabelled-or-model-labelled sample of `/metrics`, by name (first occurrence)."""
    async with session.get(f"{base}/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for m in re.finditer(r"^([a-z_:]+)(?:{[^}]*})? (\S+)$", text, re.M):
        out.setdefault(m.group(1), float(m.group(2)))
    return out


async def _poll_ready(session, base: str, codes: list[int], stop: asyncio.Event,
                      path: str = "/health/ready") -> None:
    while not stop.is_set():
        async with session.get(f"{base}{path}") as r:
            codes.append(r.status)
        await asyncio.sleep(0.05)


def _step_ms(m0: dict, m1: dict) -> float:
    """Mean engine step between two /metrics readings, ms."""
    n = m1["continuum_step_duration_seconds_count"] - m0["continuum_step_duration_seconds_count"]
    total = (m1["continuum_step_duration_seconds_sum"]
             - m0["continuum_step_duration_seconds_sum"])
    return total / max(n, 1) * 1e3


async def _post(s: aiohttp.ClientSession, url: str, body: dict):
    """(status, seconds, JSON body, Retry-After); status 0 if the connection failed."""
    t0 = time.perf_counter()
    try:
        async with s.post(url, json=body) as r:
            data = await r.json()
            return r.status, time.perf_counter() - t0, data, r.headers.get("Retry-After")
    except aiohttp.ClientError as e:
        return 0, time.perf_counter() - t0, {"error": repr(e)}, None


async def overload(base: str, burst: int, capacity: int, max_tokens: int = 16,
                   probes: int = 50, headers: dict | None = None) -> dict:
    """Overload, two ways. Burst: `burst` completions (greedy, `ignore_eos`, `max_tokens`
    tokens each) at once, `/health/ready` polled throughout. Probes: with the server full
    (`capacity` requests of FILL_TOKENS tokens in flight: the server needs a context of at
    least FILL_TOKENS + 8, OVERLOAD_FLAGS), `probes` requests one after another, so a
    refusal's latency is measured without the burst's own connection backlog on a shared
    CPU; `fill_done_before_probes` counts fill requests that ended before the probes did (the
    server was then not full throughout)."""
    url = f"{base}/v1/completions"
    body = {"model": MODEL, "prompt": "Tell me about the sea.", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     headers=headers) as s:
        codes: list[int] = []
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll_ready(s, base, codes, stop))
        results = await asyncio.gather(*(_post(s, url, body) for _ in range(burst)))
        stop.set()
        await poller
        m0 = await metrics(s, base)
        fill = []
        for _ in range(capacity):          # spaced: the engine schedules the first ones
            fill.append(asyncio.create_task(_post(s, url, body | {"max_tokens": FILL_TOKENS})))
            await asyncio.sleep(0.15)
        await asyncio.sleep(0.5)
        for _ in range(5):                 # a fill refused while the burst's last requests
            refused_fill = [i for i, t in enumerate(fill)        # were still leaving: again
                            if t.done() and t.exception() is None and t.result()[0] == 503]
            if not refused_fill:
                break
            for i in refused_fill:
                fill[i] = asyncio.create_task(_post(s, url, body | {"max_tokens": FILL_TOKENS}))
            await asyncio.sleep(0.5)
        probe = [await _post(s, url, body) for _ in range(probes)]
        m1 = await metrics(s, base)
        fill_done = sum(t.done() for t in fill)
        for t in fill:                     # the fill's clients leave: aborted, blocks freed
            t.cancel()
        await asyncio.gather(*fill, return_exceptions=True)
        idle_s = await wait_idle(s, base)
    refused = [r for r in results if r[0] == 503]
    accepted = [r for r in results if r[0] == 200]
    probe_ms = [r[1] * 1e3 for r in probe if r[0] == 503]
    return {
        "burst": burst, "capacity": capacity, "accepted": len(accepted),
        "refused": len(refused), "other_statuses": sorted({r[0] for r in results} - {200, 503}),
        "refused_with_retry_after": sum(r[3] is not None for r in refused),
        "burst_refusal_ms_p50": percentile([r[1] * 1e3 for r in refused], 50),
        "burst_refusal_ms_p99": percentile([r[1] * 1e3 for r in refused], 99),
        "accepted_exact": all(r[2]["usage"]["completion_tokens"] == max_tokens
                              for r in accepted),
        "prompt_tokens": sorted({r[2]["usage"]["prompt_tokens"] for r in accepted}),
        "ready_statuses": sorted(set(codes)), "ready_polls": len(codes),
        "probes_refused": len(probe_ms), "probe_refusal_ms_p50": percentile(probe_ms, 50),
        "probe_refusal_ms_p99": percentile(probe_ms, 99), "mean_step_ms_full": _step_ms(m0, m1),
        "idle_after_s": idle_s, "fill_done_before_probes": fill_done,
    }


SLOW_MODEL_CONFIG = """backend: "python" max_batch_size: 1
dynamic_batching { default_queue_policy { max_queue_size: %d } }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
         { name: "EXEC" data_type: TYPE_INT64 dims: [ 1 ] },
         { name: "BATCH" data_type: TYPE_INT32 dims: [ 1 ] } ]
parameters { key: "delay_ms" value { string_value: "%d" } }
"""


def slow_v2_repository(root: Path, max_queue_size: int = 8, delay_ms: int = 50) -> Path:
    """A model repository with `slow`: one instance, batch 1, `delay_ms` per execution, at most
    `max_queue_size` queued (tests/triton_models/seq_model.py). Returns the repository path."""
    model = root / "slow"
    (model / "1").mkdir(parents=True, exist_ok=True)
    src = Path(__file__).resolve().parent.parent / "tests/triton_models/seq_model.py"
    (model / "1" / "model.py").write_text(src.read_text())
    (model / "config.pbtxt").write_text(SLOW_MODEL_CONFIG % (max_queue_size, delay_ms))
    return root


async def overload_v2(base: str, burst: int, model: str = "slow") -> dict:
    """`burst` v2 infer requests at once to `model` (IN = i, JSON); refused = 503 in v2 shape,
    accepted must echo OUT = IN; `/v2/health/ready` polled throughout."""
    url = f"{base}/v2/models/{model}/infer"

    async def one(s, i: int):
        body = {"inputs": [{"name": "IN", "shape": [1, 1], "datatype": "INT32", "data": [i]}]}
        t0 = time.perf_counter()
        async with s.post(url, json=body) as r:
            data = await r.json()
            return r.status, time.perf_counter() - t0, data, i

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        codes: list[int] = []
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll_ready(s, base, codes, stop, "/v2/health/ready"))
        results = await asyncio.gather(*(one(s, i) for i in range(burst)))
        stop.set()
        await poller
    refused = [r for r in results if r[0] == 503]
    accepted = [r for r in results if r[0] == 200]
    return {
        "burst": burst, "accepted": len(accepted), "refused": len(refused),
        "other_statuses": sorted({r[0] for r in results} - {200, 503}),
        "refused_in_v2_shape": sum(isinstance(r[2].get("error"), str) for r in refused),
        "refusal_ms_p50": percentile([r[1] * 1e3 for r in refused], 50),
        "refusal_ms_p99": percentile([r[1] * 1e3 for r in refused], 99),
        "accepted_exact": all(next(o["data"] for o in r[2]["outputs"] if o["name"] == "OUT")
                              == [r[3]] for r in accepted) and bool(accepted),
        "ready_statuses": sorted(set(codes)), "ready_polls": len(codes),
    }


def _storm_request(i: int, rng: random.Random) -> tuple[str, dict]:
    chat, stream = i % 2 == 0, (i // 2) % 2 == 0
    body = {"model": MODEL, "max_tokens": rng.randint(8, 64), "ignore_eos": True,
            "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Story number {i}, please."}]
        return "/v1/chat/completions", body
    body["prompt"] = f"Once upon a time, story {i}:"
    return "/v1/completions", body


async def storm(base: str, n: int = 1000, concurrency: int = 32, max_leave_s: float = 5.0,
                seed: int = 0, headers: dict | None = None) -> dict:
    """`n` requests, `concurrency` at a time, each client leaving after a random time (a third
    within 0.1 s, the rest up to `max_leave_s`; the requests that finish first just finish).
    Returns counts, the storm's duration and the seconds until the engine was idle again."""
    rng = random.Random(seed)
    counts = {"left": 0, "completed": 0, "refused": 0, "other": 0}
    gate = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, headers=headers) as s:

        async def request(path: str, body: dict) -> None:
            async with s.post(f"{base}{path}", json=body) as r:
                await r.read()
                key = {200: "completed", 503: "refused"}.get(r.status, "other")
                counts[key] += 1

        async def one(i: int) -> None:
            path, body = _storm_request(i, rng)
            leave = rng.uniform(0, 0.1) if rng.random() < 1 / 3 else rng.uniform(0.1, max_leave_s)
            async with gate:
                try:
                    await asyncio.wait_for(request(path, body), leave)
                except asyncio.TimeoutError:
                    counts["left"] += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        duration = time.perf_counter() - t0
        idle_s = await wait_idle(s, base)
    return {"requests": n, **counts, "storm_s": duration, "idle_after_s": idle_s}


async def wait_idle(session: aiohttp.ClientSession, base: str, timeout: float = 30.0
                    ) -> float | None:
    """Seconds until every IDLE_GAUGES gauge reads 0, or None after `timeout` seconds."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        m = await metrics(session, base)
        if all(m.get(g, 0.0) == 0 for g in IDLE_GAUGES):
            return time.perf_counter() - t0
        await asyncio.sleep(0.1)
    return None


def _run_against_server(flags: list[str], work) -> dict:
    """Start `continuum serve FLAGS` on a free port, run `work(base, pid)`, stop it."""
    with continuum(["--max-model-len", "512", "--uvicorn-log-level", "warning", *flags],
                   timeout=900) as srv:
        return work(srv.base, srv.proc.pid)


def _overload_work(burst: int, capacity: int):
    def work(base: str, pid: int) -> dict:
        asyncio.run(overload(base, burst, capacity))       # warm-up: allocator caches, pools
        before = rss_mib(pid)
        out = asyncio.run(overload(base, burst, capacity))
        return out | {"rss_mib_before_after": [before, rss_mib(pid)]}
    return work


def _storm_work(n: int, concurrency: int):
    def work(base: str, pid: int) -> dict:
        asyncio.run(storm(base, 200, concurrency, seed=1))  # warm-up: allocator caches
        before = rss_mib(pid)
        out = asyncio.run(storm(base, n, concurrency))
        return out | {"rss_mib_before_after": [before, rss_mib(pid)]}
    return work


def main(argv: list[str] | None = None) -> dict:
    """Run the burst and the storm, each against a server of its own; print (and save)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--burst", type=int, default=120,
                   help="overload burst size (default: 10x the 4 + 8 the server holds)")
    p.add_argument("--storm", type=int, default=1000, help="disconnect-storm requests")
    p.add_argument("--storm-concurrency", type=int, default=32)
    add_save_result(p)
    args = p.parse_args(argv)
    result = {
        "overload": _run_against_server(OVERLOAD_FLAGS, _overload_work(args.burst, 4 + 8)),
        # A small KV cache with swap preemption: the storm also swaps requests out and in.
        "storm": _run_against_server(["--max-num-seqs", "16", "--max-waiting-requests", "64",
                                      "--kv-cache-memory", "0.04", "--preemption-mode", "swap",
                                      "--swap-space", "0.05"],
                                     _storm_work(args.storm, args.storm_concurrency)),
    }
    with tempfile.TemporaryDirectory() as tmp:
        repo = slow_v2_repository(Path(tmp))
        result["overload_v2"] = _run_against_server(
            ["--no-llm", "--model-repository", str(repo), "--grpc-port", "0"],
            lambda base, pid: asyncio.run(overload_v2(base, 10 * (1 + 8))))
    print(json.dumps(result, indent=2))
    save_result(args.save_result, result)
    return result


if __name__ == "__main__":
    main()
