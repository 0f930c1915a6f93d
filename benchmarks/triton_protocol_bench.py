"""KServe v2 protocol benchmark: Continuum vs Triton 2.51 on the same python models, measured
by Triton's own load generator, perf_analyzer 2.51, one server after the other in one run.

Models (python backend in both servers, same files): `simple` (Triton's add/sub, INT32 [16]),
`simple_dyn` (the same with a dynamic batcher and a 100 µs queue delay) and `content_type` (magika's ONNX classifier run by onnxruntime inside a python model,
benchmarks/triton_models/onnx_model.py, INT32 [2048] → FP32 [214]). Modes: HTTP with JSON
tensors, HTTP binary, gRPC, gRPC + system shared memory; concurrency 1 / 4 / 16. Both servers
run at once and each point is measured on one, then the other, `--repeats` rounds (default 3)
in alternating order: the host's speed drifts by tens of percent within minutes, and a point
measured on one server minutes after the other compares the drift as much as the servers.
Output: a JSON file of every round (`--save-result`, default
benchmarks/results/triton_protocol_bench.json) with the host's ISA, and a table of the median
infer/s and the p50 / p99 latency (µs: their spread) with Continuum / Triton ratios.
Every round records the hypervisor's steal time over it (`steal_pct`, harness.StealMeter); the
report lists the rounds perf_analyzer could not stabilise with it. `--steal-retry N` measures a
round again (up to N times, on the same server at once) when its steal passed `--steal-limit`
%, stable or not, keeping every attempt in "attempts": a guest whose host takes a fifth of its
CPUs for tens of seconds measures the host, not the servers.

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
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.harness import (StealMeter, add_save_result, free_port, launch,  # noqa: E402
                                save_result, stop, wait_ready)
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
    """`simple` (the example, copied), `simple_dyn` (the same with Triton's dynamic batcher,
    `max_queue_delay_microseconds: 100`) and `content_type` as a python model over the ONNX
    file."""
    shutil.copytree(EXAMPLES / "simple", root / "simple")
    shutil.copytree(EXAMPLES / "simple", root / "simple_dyn")
    config = root / "simple_dyn" / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "simple"', 'name: "simple_dyn"')
                      + "\ndynamic_batching { max_queue_delay_microseconds: 100 }\n")
    onnx = magika_onnx()
    (root / "content_type" / "1").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "triton_models" / "onnx_model.py",
                root / "content_type" / "1" / "model.py")
    (root / "content_type" / "config.pbtxt").write_text(CONTENT_TYPE % onnx)


def start_continuum(repo: Path, log) -> tuple:
    """`continuum serve --no-llm` on `repo` with client shared memory, otherwise at its
    defaults as a user starts it (the v2 routes write no access lines, as tritonserver):
    (process, HTTP port, gRPC port)."""
    http, grpc = free_port(), free_port()
    proc = launch([sys.executable, "-m", "api", "serve", "--no-llm", "--model-repository",
                   str(repo), "--port", str(http), "--grpc-port", str(grpc),
                   "--allow-client-shm"], log)
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
    proc = launch(
        [str(ts / "bin" / "tritonserver"), "--model-repository", str(repo),
         "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
         # 2.51 predates --allow-client-shm: client shared memory is always on there
         "--backend-directory", str(ts / "backends")], log, env)
    return proc, http, grpc


def perf_analyzer(binary: Path, model: str, mode: str, concurrency: int, http: int, grpc: int,
                  interval_ms: int | None) -> dict:
    """One perf_analyzer point: {"throughput": infer/s, "p50_us", "p90_us", "p99_us": client
    latency percentiles, µs (their spread is the latency's), or {"error": its output's tail}
    when it could not stabilise the measurement (or had not within 300 s). `interval_ms` None:
    perf_analyzer's default stability settings (5 s windows, average latency, within 10 %, 10
    trials); else windows of that length, the p99 latency within 25 %. Either way with
    "steal_pct", the host's steal time over it (% of the CPUs' time)."""
    steal = StealMeter().start()
    point = _run_perf_analyzer(binary, model, mode, concurrency, http, grpc, interval_ms)
    point["steal_pct"] = steal.percent()
    return point


def _run_perf_analyzer(binary: Path, model: str, mode: str, concurrency: int, http: int,
                       grpc: int, interval_ms: int | None) -> dict:
    port = grpc if MODES[mode][1] == "grpc" else http
    env = dict(os.environ)
    lib = next(Path(binary).parent.parent.glob("lib/python3*/site-packages/nvidia/"
                                                "cuda_runtime/lib"), None)
    if lib is not None:
        env["LD_LIBRARY_PATH"] = f"{lib}:{env.get('LD_LIBRARY_PATH', '')}"
    with tempfile.NamedTemporaryFile(suffix=".csv") as out:
        cmd = [str(binary), "-m", model, "-u", f"127.0.0.1:{port}", *MODES[mode],
               "--concurrency-range", str(concurrency), "--input-data", "zero", "-f", out.name]
        if interval_ms is not None:
            cmd += ["--measurement-interval", str(interval_ms), "--percentile", "99",
                    "--max-trials", "10", "--stability-percentage", "25"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        except subprocess.TimeoutExpired as e:     # a point that never settles is a failure
            tail = (e.stdout or b"")[-400:]
            return {"error": f"perf_analyzer still running after 300 s: {tail!r}"}
        if r.returncode != 0:
            return {"error": (r.stdout + r.stderr)[-600:]}
        row = next(csv.DictReader(open(out.name)))
    return {"throughput": float(row["Inferences/Second"]), "p50_us": int(row["p50 latency"]),
            "p90_us": int(row["p90 latency"]), "p99_us": int(row["p99 latency"])}


def measure(starts: dict, args, repo: Path, log) -> dict:
    """Start every server in `starts` ({name: start function}) at once, then measure each
    (model, mode, concurrency) point on each server in turn, `args.repeats` rounds, the order
    of the servers alternating between rounds, so that the host's drift lands on all of them
    alike. Stops them all. Returns {name: {"model/mode/concurrency": point}}, each point the
    median of its rounds (throughput and p99 separately) with every round in "rounds"."""
    procs = {}
    try:
        for name, start in starts.items():
            procs[name] = start(repo, log)
        for proc, http, _ in procs.values():
            wait_ready(f"http://127.0.0.1:{http}/v2/health/ready", proc)
        rounds: dict = {name: {} for name in procs}
        for model in args.models.split(","):
            for mode in args.modes.split(","):
                for c in [int(x) for x in args.concurrency.split(",")]:
                    key = f"{model}/{mode}/{c}"
                    for r in range(args.repeats):
                        order = list(procs) if r % 2 == 0 else list(reversed(procs))
                        for name in order:
                            _, http, grpc = procs[name]
                            point = measure_point(args, model, mode, c, http, grpc)
                            rounds[name].setdefault(key, []).append(point)
                            print(f"{name:9s} {key:28s} round {r + 1}: {point}", flush=True)
    finally:
        for proc, _, _ in procs.values():
            stop(proc)
    return {name: {key: median_point(points) for key, points in by_key.items()}
            for name, by_key in rounds.items()}


def measure_point(args, model: str, mode: str, c: int, http: int, grpc: int) -> dict:
    """One round of a point on one server: perf_analyzer, again up to `args.steal_retry` times
    while the host's steal over it passed `args.steal_limit` % (the last attempt kept, with
    every one in "attempts" when there was more than one)."""
    attempts = []
    for _ in range(1 + args.steal_retry):
        attempts.append(perf_analyzer(args.perf_analyzer, model, mode, c, http, grpc,
                                      None if args.pa_defaults else args.interval_ms))
        if attempts[-1]["steal_pct"] <= args.steal_limit:
            break
    return dict(attempts[-1], attempts=attempts) if len(attempts) > 1 else attempts[0]


def unstable_rounds(result: dict) -> list[str]:
    """One line per round perf_analyzer could not stabilise: server, point, round, steal %."""
    return [f"{name} {key} round {i + 1}: unstable (steal {r.get('steal_pct', '?')} %)"
            for name, points in result.items() if name != "host"
            for key, point in points.items()
            for i, r in enumerate(point["rounds"]) if "error" in r]


def median_point(points: list[dict]) -> dict:
    """The median throughput, p50 and p99 of a point's rounds (rounds that failed to
    stabilise are left out; all failed: the first error), with the rounds themselves."""
    good = [p for p in points if "throughput" in p]
    if not good:
        return dict(points[0], rounds=points)
    return {"throughput": statistics.median(p["throughput"] for p in good),
            "p50_us": statistics.median(p["p50_us"] for p in good),
            "p99_us": statistics.median(p["p99_us"] for p in good), "rounds": points}


def table(ours: dict, theirs: dict) -> str:
    """A Markdown table of both servers' points: median infer/s, their ratio, each round's
    ratio, median p50 and p99 latency (µs)."""
    lines = ["| model / mode / concurrency | Continuum infer/s | Triton infer/s | ratio | "
             "ratio by round | Continuum p50 / p99 µs | Triton p50 / p99 µs |",
             "|---|---|---|---|---|---|---|"]
    for key, a in ours.items():
        b = theirs.get(key, {})
        if "throughput" not in a or "throughput" not in b:
            lines.append(f"| {key} | {a.get('throughput', 'error')} | "
                         f"{b.get('throughput', 'error')} | | | | |")
            continue
        by_round = " / ".join(
            f"{x['throughput'] / y['throughput']:.2f}" if "throughput" in x and "throughput" in y
            else "-" for x, y in zip(a["rounds"], b["rounds"]))
        lines.append(f"| {key} | {a['throughput']:.0f} | {b['throughput']:.0f} | "
                     f"{a['throughput'] / b['throughput']:.2f} | {by_round} | "
                     f"{a['p50_us']:.0f} / {a['p99_us']:.0f} | "
                     f"{b['p50_us']:.0f} / {b['p99_us']:.0f} |")
    return "\n".join(lines)


def host() -> dict:
    """The host the figures belong to: its ISA as Continuum's kernels see it (`cpu isa: ...`)
    and its CPU count."""
    from engine.kernels.isa import isa_label
    return {"isa": isa_label(), "cpus": os.cpu_count()}


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
    p.add_argument("--pa-defaults", action="store_true",
                   help="perf_analyzer's own stability settings instead of --interval-ms "
                        "windows with p99 within 25 %%")
    p.add_argument("--servers", default="continuum,triton")
    p.add_argument("--steal-retry", type=int, default=0,
                   help="measure a round again up to N times while its steal passed the limit")
    p.add_argument("--steal-limit", type=float, default=2.0,
                   help="%% of the CPUs' time the host may steal in a round kept (--steal-retry)")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds per point; the report gives each point's median")
    add_save_result(p, "triton_protocol_bench")
    args = p.parse_args(argv)
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown {', '.join(unknown)} (known: {', '.join(MODES)})")
    starts = {"continuum": start_continuum}
    if args.triton_venv is not None:
        starts["triton"] = lambda r, lg: start_triton(r, args.triton_venv, lg)
    starts = {n: starts[n] for n in args.servers.split(",") if n in starts}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        build_repository(repo)
        with open(Path(tmp) / "servers.log", "wb") as log:
            result = {"host": host(), **measure(starts, args, repo, log)}
    save_result(args.save_result, result)
    print(f"host: {result['host']['isa']}, {result['host']['cpus']} CPUs")
    if "continuum" in result and "triton" in result:
        print(table(result["continuum"], result["triton"]))
    for line in unstable_rounds(result):
        print(line)
    return result


if __name__ == "__main__":
    main()
