"""Sequence batching benchmark: how many voice-activity streams a server keeps in real time.

Each stream sends 16 kHz audio as one request per 512-sample chunk (32 ms), every 32 ms, as
one sequence (`sequence_id`, START on the first chunk, END on the last), the next chunk when it
is due and the previous answer is back. A chunk's latency is from when it was due to its
answer, so a server that falls behind accumulates it. A stream stays real time when its p99
chunk latency is under 32 ms. Streams start spread over one chunk period. Per configuration the
benchmark tries more and more streams (`--streams`) and reports the most that all stayed real
time. Near its limit a server is bistable (once behind, the queue only grows), so repeat runs
on a noisy host before reading much into one figure.

Configurations (model in the benchmark's repository):
- `onnx-state-direct` (`vad`, the example): Silero VAD on the onnxruntime backend, its state
  as implicit state, the direct sequence batcher with 32 slots (Continuum only: the Triton of
  nvidia-pytriton has only the python backend);
- `onnx-state-oldest` (`vad_oldest`): the same with the oldest strategy (32 candidate
  sequences, 5 ms queue delay): batches of the ready chunks only, no padding rows;
- `python-direct` (`vad_seq`): benchmarks/triton_models/vad_model.py, a python model keeping
  each stream's state by correlation id, under the direct sequence batcher (32 slots);
- `python-single` (`vad_single`): the same python model under the default scheduler: one
  request per execution (the baseline).
Both servers in one run, one after the other: Continuum and (with `--triton-venv`) Triton
2.51 on the python configurations. Output: a JSON file (`--save-result`, default
benchmarks/results/sequence_batching_bench.json) and a Markdown table.

Run: `python benchmarks/sequence_batching_bench.py [--triton-venv VENV] [--streams 8,16,32]`
(the Triton venv as in triton_protocol_bench.py).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import add_save_result, save_result, stop, wait_ready  # noqa: E402
from benchmarks.triton_protocol_bench import start_continuum, start_triton  # noqa: E402
from examples.prepare_model_repository import silero_onnx  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "model_repository"
CHUNK, RATE = 512, 16000
PERIOD_S = CHUNK / RATE                      # 32 ms
CONFIGS = {"onnx-state-direct": "vad", "onnx-state-oldest": "vad_oldest",
           "python-direct": "vad_seq",
           "python-single": "vad_single"}
PYTHON_VAD = """name: "{name}"
backend: "python"
max_batch_size: {mbs}
input [ {{ name: "audio" data_type: TYPE_FP32 dims: [ 512 ] }} ]
output [ {{ name: "probability" data_type: TYPE_FP32 dims: [ 1 ] }} ]
{batching}
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
parameters {{ key: "onnx_path" value {{ string_value: "{onnx}" }} }}
"""


def synthetic_audio(seed: int, chunks: int) -> np.ndarray:
    """Speech-like test audio, FP32 [chunks, 512] at 16 kHz: voiced stretches (a harmonic
    series on a wandering pitch, shaped into syllables) between pauses, over low noise.
    Deterministic in `seed`."""
    rng = np.random.default_rng(seed)
    n = chunks * CHUNK
    t = np.arange(n) / RATE
    pitch = 110 + 60 * rng.random() + 20 * np.sin(2 * np.pi * (0.3 + rng.random()) * t)
    phase = 2 * np.pi * np.cumsum(pitch) / RATE
    voiced = sum(np.sin(k * phase) / k for k in range(1, 12))
    syllables = np.clip(np.sin(2 * np.pi * (3 + 2 * rng.random()) * t), 0, None)
    talking = np.repeat(rng.random(n // 8000 + 1) < 0.6, 8000)[:n]      # 0.5 s turns
    audio = 0.2 * voiced * syllables * talking + 0.005 * rng.standard_normal(n)
    return audio.astype(np.float32).reshape(chunks, CHUNK)


def build_repository(root: Path) -> None:
    """`vad` (the example, its ONNX file copied), `vad_oldest` (the example under the oldest
    strategy), `vad_seq` and `vad_single` (python)."""
    onnx = silero_onnx()
    shutil.copytree(EXAMPLES / "vad", root / "vad", symlinks=False)
    shutil.copytree(EXAMPLES / "vad", root / "vad_oldest", symlinks=False)
    config = (root / "vad" / "config.pbtxt").read_text().replace('name: "vad"',
                                                                  'name: "vad_oldest"')
    (root / "vad_oldest" / "config.pbtxt").write_text(re.sub(
        r"^  direct .*$", "  oldest { max_candidate_sequences: 32 "
        "max_queue_delay_microseconds: 5000 }", config, flags=re.M))
    for name, mbs, batching in (
            ("vad_seq", 32, "sequence_batching { direct { } }"),
            ("vad_single", 1, "")):
        (root / name / "1").mkdir(parents=True)
        shutil.copy(ROOT / "benchmarks" / "triton_models" / "vad_model.py",
                    root / name / "1" / "model.py")
        (root / name / "config.pbtxt").write_text(PYTHON_VAD.format(
            name=name, mbs=mbs, batching=batching, onnx=onnx))


async def run_streams(address: str, model: str, streams: int, chunks: int,
                      first_id: int) -> dict:
    """Feed `streams` real-time streams of `chunks` chunks each over gRPC; per-stream p99
    latency (ms), the overall p50 / p99, the count of real-time streams and of errors."""
    import tritonclient.grpc.aio as grpcclient

    client = grpcclient.InferenceServerClient(address)
    audio = [synthetic_audio(first_id + s, chunks) for s in range(streams)]
    latencies: list[list[float]] = [[] for _ in range(streams)]
    errors = [0]

    async def one(s: int, t0: float) -> None:
        for k in range(chunks):
            due = t0 + k * PERIOD_S
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            x = grpcclient.InferInput("audio", [1, CHUNK], "FP32")
            x.set_data_from_numpy(audio[s][k:k + 1])
            try:
                await client.infer(model, [x], sequence_id=first_id + s,
                                   sequence_start=k == 0, sequence_end=k == chunks - 1)
            except Exception:
                errors[0] += 1
            latencies[s].append((time.perf_counter() - due) * 1000)

    start = time.perf_counter() + 0.2
    try:
        await asyncio.gather(*(one(s, start + s * PERIOD_S / streams)
                               for s in range(streams)))
    finally:
        await client.close()
    p99 = [float(np.percentile(lat, 99)) for lat in latencies]
    flat = np.concatenate(latencies)
    return {"streams": streams, "realtime_streams": sum(p < PERIOD_S * 1000 for p in p99),
            "p50_ms": float(np.percentile(flat, 50)), "p99_ms": float(np.percentile(flat, 99)),
            "stream_p99_ms": [round(p, 2) for p in p99], "errors": errors[0]}


def measure(name: str, start, configs: list[str], args, repo: Path, log) -> dict:
    """Start a server and, per configuration, feed it more and more streams (`--streams`,
    ascending; after a warm-up stream) until some stream falls behind; stop the server.
    {config: {"max_realtime_streams": N, "runs": [run_streams result + batch size]}}."""
    proc, http, grpc = start(repo, log)
    out = {}
    try:
        wait_ready(f"http://127.0.0.1:{http}/v2/health/ready", proc)
        for i, config in enumerate(configs):
            model = CONFIGS[config]
            address = f"127.0.0.1:{grpc}"
            asyncio.run(run_streams(address, model, 2, 30, 900_000 + 100 * i))   # warm-up
            runs, best = [], 0
            for j, n in enumerate(sorted(int(x) for x in args.streams.split(","))):
                before = _counts(http, model)
                result = asyncio.run(run_streams(address, model, n, int(args.seconds / PERIOD_S),
                                                 100_000 * (i + 1) + 1000 * j))
                after = _counts(http, model)
                result["inferences_per_execution"] = \
                    (after[0] - before[0]) / max(1, after[1] - before[1])
                runs.append(result)
                print(f"{name:9s} {config:18s} streams {n:3d}  real-time "
                      f"{result['realtime_streams']:3d}  p50 {result['p50_ms']:7.1f} ms  p99 "
                      f"{result['p99_ms']:7.1f} ms  batch "
                      f"{result['inferences_per_execution']:.1f}  errors {result['errors']}",
                      flush=True)
                if result["realtime_streams"] < n or result["errors"]:
                    break
                best = n
            out[config] = {"max_realtime_streams": best, "runs": runs}
    finally:
        stop(proc)
    return out


def _counts(http: int, model: str) -> tuple[int, int]:
    s = httpx.get(f"http://127.0.0.1:{http}/v2/models/{model}/stats").json()["model_stats"][0]
    return s["inference_count"], s["execution_count"]


def table(result: dict) -> str:
    """Markdown: per server and configuration, the most streams that all stayed real time,
    and the last run's figures."""
    lines = ["| server | configuration | max real-time streams | last run: streams, real-time, "
             "p50 ms, p99 ms, inferences / execution |", "|---|---|---|---|"]
    for server, configs in result.items():
        for config, r in configs.items():
            last = r["runs"][-1]
            lines.append(f"| {server} | {config} | {r['max_realtime_streams']} | "
                         f"{last['streams']}, {last['realtime_streams']}, {last['p50_ms']:.1f}, "
                         f"{last['p99_ms']:.1f}, {last['inferences_per_execution']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark (flags: see --help); write and return the JSON result."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", default="4,8,16,24,32",
                   help="stream counts to try, ascending, until one falls behind (the "
                        "direct configurations have 32 slots)")
    p.add_argument("--seconds", type=float, default=6.0, help="audio per stream and run")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--triton-venv", type=Path, default=None,
                   help="venv with nvidia-pytriton==0.7.0 and onnxruntime (omit: Continuum "
                        "only)")
    add_save_result(p, "sequence_batching_bench")
    args = p.parse_args(argv)
    configs = args.configs.split(",")
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        build_repository(repo)
        with open(Path(tmp) / "servers.log", "wb") as log:
            result["continuum"] = measure("continuum", start_continuum, configs, args, repo,
                                          log)
            if args.triton_venv is not None:
                for onnx in ("vad", "vad_oldest"):      # no onnxruntime backend there
                    (repo / onnx).rename(Path(tmp) / onnx)
                result["triton"] = measure(
                    "triton", lambda r, lg: start_triton(r, args.triton_venv, lg),
                    [c for c in configs if not c.startswith("onnx")], args, repo, log)
    save_result(args.save_result, result)
    print(table(result))
    return result


if __name__ == "__main__":
    main()
