"""Dynamic batching on vs off: 20 concurrent clients of batch-1 requests, over KServe v2 HTTP.

Builds a temporary model repository from the shipped examples with each model twice — as
shipped (dynamic batching on) and a copy whose configs drop `dynamic_batching` (Triton's
default scheduler: one request per execution) — starts one `continuum serve --no-llm` on it,
and drives every variant in turn with the same closed loop: `--concurrency` clients
(tritonclient's asyncio HTTP client), each sending its next request when the previous one is
answered, for `--duration` seconds after a warm-up. Models: `content_type` (ONNX) and
`text_embedding` (ensemble: tokenizer → encoder → pooling; off = no batching in any step).

Prints one JSON line (and writes it to `--save-result FILE`): per model, requests/s and
p50 / p99 latency (ms) for on and off, the throughput ratio, and whether p99 is no worse. Usage:
    python benchmarks/dynamic_batching_bench.py [--duration 15] [--concurrency 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (add_save_result, closed_loop, continuum,  # noqa: E402
                                latency_summary, save_result)
from examples.prepare_model_repository import prepare  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "model_repository"
STEPS = ["text_tokenizer", "minilm_encoder", "mean_pool_l2"]
SENTENCES = ["The quick brown fox jumps over the lazy dog.",
             "Continuous batching keeps the accelerator busy between requests.",
             "Paris is the capital of France and its largest city.",
             "A short one.",
             "Dynamic batching trades a little queueing delay for much higher throughput, "
             "because one execution of a batch costs far less than one per request."]


def _copy_model(name: str, new: str, repo: Path, batching: bool) -> None:
    """Link `name`'s version folder under `new`, with its config minus dynamic_batching."""
    (repo / new).mkdir()
    (repo / new / "1").symlink_to(EXAMPLES / name / "1", target_is_directory=True)
    text = (EXAMPLES / name / "config.pbtxt").read_text()
    text = re.sub(r'^name: "[^"]*"', f'name: "{new}"', text, flags=re.M)
    if not batching:
        text = re.sub(r"dynamic_batching \{[^}]*\}", "", text, flags=re.S)
    for step in STEPS:          # an ensemble's steps point at the copies of the same variant
        text = text.replace(f'model_name: "{step}"',
                            f'model_name: "{step}{"" if batching else "_nobatch"}"')
    (repo / new / "config.pbtxt").write_text(text)


def build_repository(repo: Path) -> None:
    """Both variants of content_type and text_embedding (with its steps)."""
    for name in ["content_type", "text_embedding", *STEPS]:
        _copy_model(name, name, repo, True)
        _copy_model(name, f"{name}_nobatch", repo, False)


def _request(model: str, i: int, rng: np.random.Generator):
    import tritonclient.http.aio as aioclient

    if model.startswith("content_type"):
        x = aioclient.InferInput("bytes", [1, 2048], "INT32")
        x.set_data_from_numpy(rng.integers(0, 257, (1, 2048)).astype(np.int32))
    else:
        x = aioclient.InferInput("TEXT", [1, 1], "BYTES")
        x.set_data_from_numpy(np.array([[SENTENCES[i % len(SENTENCES)].encode()]],
                                       dtype=object))
    return [x]


async def drive(url: str, model: str, concurrency: int, duration: float,
                warmup: float) -> dict:
    """Closed loop of `concurrency` clients (`harness.closed_loop`) against `model`:
    requests/s, p50 / p99 latency (ms) of the requests sent after the warm-up, failures."""
    import tritonclient.http.aio as aioclient

    client = aioclient.InferenceServerClient(url, conn_limit=concurrency)
    rngs = [np.random.default_rng(w) for w in range(concurrency)]

    def request(w: int, i: int):
        return client.infer(model, _request(model, i, rngs[w]))

    try:
        latencies, failures = await closed_loop(request, concurrency, duration, warmup)
    finally:
        await client.close()
    return {**latency_summary(latencies, duration, digits=1), "failed": failures}


def _measure(host: str, models: list[str], args) -> dict:
    """Per model, the closed loop with batching on, then off, and their comparison."""
    result = {}
    for model in models:
        on = asyncio.run(drive(host, model, args.concurrency, args.duration, args.warmup))
        off = asyncio.run(drive(host, f"{model}_nobatch", args.concurrency, args.duration,
                                args.warmup))
        result[model] = {
            "batching_on": on, "batching_off": off,
            "throughput_ratio": round(on["requests_per_s"] / off["requests_per_s"], 2),
            "p99_no_worse": on["p99_ms"] <= off["p99_ms"]}
        print(f"{model}: {json.dumps(result[model])}", file=sys.stderr, flush=True)
    return result


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print and return the JSON result."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=15.0, help="seconds measured per variant")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds not measured first")
    p.add_argument("--concurrency", type=int, default=20, help="concurrent clients")
    p.add_argument("--models", default="content_type,text_embedding")
    add_save_result(p)
    args = p.parse_args(argv)
    prepare()                                   # the example model files (idempotent)
    result = {"concurrency": args.concurrency, "duration_s": args.duration}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        build_repository(repo)
        flags = ["--no-llm", "--model-repository", str(repo), "--uvicorn-log-level", "warning",
                 "--grpc-port", "0"]
        with continuum(flags, ready_path="/v2/health/ready", timeout=180) as srv:
            result |= _measure(srv.base.removeprefix("http://"), args.models.split(","), args)
    print(json.dumps(result))
    save_result(args.save_result, result)
    return result


if __name__ == "__main__":
    main()
