"""KServe v2 protocol benchmark: Continuum vs Triton 2.51 on the same python models, measured
by Triton's own load generator, perf_analyzer 2.51, one server after the other in one run.

Models (python backend in both servers, same files): `simple` (Triton's add/sub, INT32 [16])
and `content_type` (magika's ONNX classifier run by onnxruntime inside a python model,
benchmarks/triton_models/onnx_model.py, INT32 [2048] → FP32 [214]). Modes: HTTP with JSON
tensors, HTTP binary, gRPC, gRPC + system shared memory; concurrency 1 / 4 / 16. Output: a JSON
file and a table of infer/s and p99 latency (µs) with Continuum / Triton ratios.

Needs (not project dependencies; see the README's benchmark section):
- perf_analyzer 2.51: `pip install tritonclient==2.51.0 nvidia-cuda-runtime-cu12` in a venv,
  `apt-get install libb64-0d`; pass `--perf-analyzer VENV/bin/perf_analyzer`.
- tritonserver 2.51: `pip install nvidia-pytriton==0.7.0 onnxruntime` in a venv; pass
  `--triton-venv VENV` (its python backend runs the models with that venv's packages).
Run: `python benchmarks/triton_protocol_bench.py --perf-analyzer ... --triton-venv ...`.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from examples.prepare_model_repository import magika_onnx  # noqa: E402

EXAMPLES = ROOT / "examples" / "model_repository"
MODES = {   # name -> perf_analyzer flags
    "http-json": ["-i", "http", "--input-tensor-format", "json", "--output-tensor-format", "json"],
    "http-binary": ["-i", "http"],
    "grpc": ["-i", "grpc"],
    "grpc-shm": ["-i", "grpc", "--shared-memory", "system", "--output-shared-memory-size",
                 "4096"],
}
CONTENT_TYPE = """name: "content_type"
backend: "python"
max_batch_size: 64
input [ { name: "bytes" data_type: TYPE_INT32 dims: [ 2048 ] } ]
output [ { name: "target_label" data_type: TYPE_FP32 dims: [ 214 ] } ]
dynamic_batching { }
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "onnx_path" value { string_value: "%s" } }
"""


def build_repository(root: Path) -> None:
    """`simple` (the example, copied) and `content_type` as a python model over the ONNX file."""
    shutil.copytree(EXAMPLES / "simple", root / "simple")
    onnx = magika_onnx()
    (root / "content_type" / "1").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "triton_models" / "onnx_model.py",
                root / "content_type" / "1" / "model.py")
    (root / "content_type" / "config.pbtxt").write_text(CONTENT_TYPE % onnx)


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc, timeout: float = 180) -> None:
    """Poll `url` until it answers 200. Raises RuntimeError if `proc` exits or `timeout`
    seconds pass."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready in {timeout} s")


def start_continuum(repo: Path, log) -> tuple:
    """`continuum serve --no-llm` on `repo` with client shared memory: (process, HTTP port,
    gRPC port)."""
    http, grpc = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "api", "serve", "--no-llm", "--model-repository", str(repo),
         "--port", str(http), "--grpc-port", str(grpc), "--allow-client-shm",
         "--uvicorn-log-level", "warning"], stdout=log, stderr=log, cwd=ROOT,
        start_new_session=True)
    return proc, http, grpc


def start_triton(repo: Path, venv: Path, log) -> tuple:
    """tritonserver 2.51 from the nvidia-pytriton package in `venv` on `repo`, its python
    backend stub installed for this python: (process, HTTP port, gRPC port)."""
    site = next((venv / "lib").glob("python3*/site-packages"))
    ts = site / "pytriton" / "tritonserver"
    stub = ts / "backends" / "python" / "triton_python_backend_stub"
    if not stub.exists():
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        shutil.copy(ts / "python_backend_stubs" / version / "triton_python_backend_stub", stub)
    libs = [str(ts / "external_libs"), str(ts / "lib"), str(site / "nvidia_pytriton.libs")]
    env = dict(os.environ, PATH=f"{venv / 'bin'}:{os.environ['PATH']}",
               LD_LIBRARY_PATH=":".join(libs + [os.environ.get("LD_LIBRARY_PATH", "")]))
    http, grpc, metrics = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [str(ts / "bin" / "tritonserver"), "--model-repository", str(repo),
         "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
         # 2.51 predates --allow-client-shm: client shared memory is always on there
         "--backend-directory", str(ts / "backends")],
        stdout=log, stderr=log, env=env, start_new_session=True)
    return proc, http, grpc


def perf_analyzer(binary: Path, model: str, mode: str, concurrency: int, http: int, grpc: int,
                  interval_ms: int) -> dict:
    """One perf_analyzer point: {"throughput": infer/s, "p99_us": ..., "avg_us": ...}."""
    port = grpc if MODES[mode][1] == "grpc" else http
    env = dict(os.environ)
    lib = next(Path(binary).parent.parent.glob("lib/python3*/site-packages/nvidia/"
                                                "cuda_runtime/lib"), None)
    if lib is not None:
        env["LD_LIBRARY_PATH"] = f"{lib}:{env.get('LD_LIBRARY_PATH', '')}"
    with tempfile.NamedTemporaryFile(suffix=".csv") as out:
        cmd = [str(binary), "-m", model, "-u", f"127.0.0.1:{port}", *MODES[mode],
               "--concurrency-range", str(concurrency), "--input-data", "zero",
               "--measurement-interval", str(interval_ms), "--percentile", "99",
               "--max-trials", "10", "--stability-percentage", "25", "-f", out.name]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        if r.returncode != 0:
            return {"error": (r.stdout + r.stderr)[-600:]}
        row = next(csv.DictReader(open(out.name)))
    return {"throughput": float(row["Inferences/Second"]), "p99_us": int(row["p99 latency"]),
            "avg_us": int(row["Avg latency"]) if "Avg latency" in row else None}


def measure(name: str, start, args, repo: Path, log) -> dict:
    """Start a server with `start`, run every (model, mode, concurrency) point against it,
    stop it: {"model/mode/concurrency": perf_analyzer point}."""
    proc, http, grpc = start(repo, log)
    results = {}
    try:
        wait_ready(f"http://127.0.0.1:{http}/v2/health/ready", proc)
        for model in args.models.split(","):
            for mode in args.modes.split(","):
                for c in [int(x) for x in args.concurrency.split(",")]:
                    point = perf_analyzer(args.perf_analyzer, model, mode, c, http, grpc,
                                          args.interval_ms)
                    results[f"{model}/{mode}/{c}"] = point
                    print(f"{name:9s} {model:12s} {mode:11s} c={c:<3d} {point}", flush=True)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
    return results


def table(ours: dict, theirs: dict) -> str:
    """A Markdown table of both servers' points: infer/s, their ratio, p99 (µs)."""
    lines = ["| model / mode / concurrency | Continuum infer/s | Triton infer/s | ratio | "
             "Continuum p99 µs | Triton p99 µs |", "|---|---|---|---|---|---|"]
    for key, a in ours.items():
        b = theirs.get(key, {})
        if "throughput" not in a or "throughput" not in b:
            lines.append(f"| {key} | {a.get('throughput', 'error')} | "
                         f"{b.get('throughput', 'error')} | | | |")
            continue
        lines.append(f"| {key} | {a['throughput']:.0f} | {b['throughput']:.0f} | "
                     f"{a['throughput'] / b['throughput']:.2f} | {a['p99_us']} | {b['p99_us']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark (flags: see --help); write and return the JSON result."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--perf-analyzer", type=Path, required=True)
    p.add_argument("--triton-venv", type=Path, default=None,
                   help="venv with nvidia-pytriton==0.7.0 (omit to measure Continuum only)")
    p.add_argument("--models", default="simple,content_type")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--interval-ms", type=int, default=3000)
    p.add_argument("--servers", default="continuum,triton")
    p.add_argument("--output", type=Path, default=Path("triton_protocol_bench.json"))
    args = p.parse_args(argv)
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        build_repository(repo)
        with open(Path(tmp) / "servers.log", "wb") as log:
            for name in args.servers.split(","):
                if name == "continuum":
                    result["continuum"] = measure(name, start_continuum, args, repo, log)
                elif args.triton_venv is not None:
                    result["triton"] = measure(
                        name, lambda r, lg: start_triton(r, args.triton_venv, lg), args, repo,
                        log)
    args.output.write_text(json.dumps(result, indent=2))
    if "continuum" in result and "triton" in result:
        print(table(result["continuum"], result["triton"]))
    return result


if __name__ == "__main__":
    main()
