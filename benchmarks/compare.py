"""`continuum bench compare`: Continuum vs. the transformers static-batching baseline, same
workload, one run, and ratios — plus any other running server as an extra column.

Starts each server in turn on a free loopback port (so they never share the CPU): Continuum on
the embedded model (`python -m api serve`), then the BASELINE
(`benchmarks/hf_baseline_server.py`, transformers `generate` on static batches). Runs the same
`continuum bench serve` workload (same dataset, seed and sweep) against each, and against every
`--extra-url NAME=URL` (e.g. a vLLM or llama.cpp server you run; it must serve the same model).
Prints, per concurrency, output throughput and median TTFT / TPOT of each, and Continuum's
throughput ratio to each other column. `--save-result` writes all points and the ratios.

    continuum bench compare --dataset-name random --random-input-len 128 \\
        --random-output-len 128 --ignore-eos --num-prompts 64 --max-concurrency 1,16,64
"""

from __future__ import annotations

import argparse
import copy
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.serve_bench import add_arguments, run

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], url: str, ready_path: str, timeout: float = 600) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited during start-up: {' '.join(cmd)}")
        try:
            if httpx.get(url + ready_path, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server not ready after {timeout} s: {' '.join(cmd)}")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _bench(args, name: str, url: str, model_dir: str) -> list[dict]:
    a = copy.copy(args)
    a.base_url, a.tokenizer, a.model, a.save_result, a.plot = url, model_dir, None, None, None
    print(f"\n##### {name}: {url}", flush=True)
    return run(a)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="continuum bench compare",
                                 description=__doc__.split("\n")[0])
    add_arguments(ap, with_base_url=False)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                    help="dtype of both Continuum and the baseline")
    ap.add_argument("--baseline-batch-size", type=int, default=16)
    ap.add_argument("--extra-url", action="append", default=[], metavar="NAME=URL",
                    help="another running OpenAI-compatible server serving the same model")
    args = ap.parse_args(argv)
    from engine.loader import resolve_model
    model_dir = str(resolve_model(None))
    results: dict[str, list[dict]] = {}

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start([sys.executable, "-m", "api", "serve", "--port", str(port), "--dtype",
                   args.dtype, "--uvicorn-log-level", "warning"], url, "/health/ready")
    try:
        results["continuum"] = _bench(args, "continuum", url, model_dir)
    finally:
        _stop(proc)

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start([sys.executable, str(ROOT / "benchmarks" / "hf_baseline_server.py"), model_dir,
                   "--port", str(port), "--dtype", args.dtype, "--batch-size",
                   str(args.baseline_batch_size)], url, "/health")
    try:
        results["hf-baseline"] = _bench(args, "hf-baseline (transformers static batching)",
                                        url, model_dir)
    finally:
        _stop(proc)

    for spec in args.extra_url:
        name, _, extra = spec.partition("=")
        results[name] = _bench(args, name, extra, model_dir)

    ratios = _print_table(results)
    if args.save_result:
        Path(args.save_result).write_text(json.dumps({"results": results, "ratios": ratios},
                                                     indent=1))


def _print_table(results: dict[str, list[dict]]) -> list[dict]:
    names = list(results)
    ratios = []
    print("\nconcurrency | " + " | ".join(f"{n} tok/s (TTFT/TPOT ms)" for n in names)
          + " | " + " | ".join(f"continuum/{n}" for n in names[1:]))
    for i, point in enumerate(results["continuum"]):
        cells, row = [], {"max_concurrency": point["max_concurrency"]}
        for n in names:
            p = results[n][i]
            cells.append(f"{p['output_throughput']:.1f} ({p['median_ttft_ms']:.0f}/"
                         f"{p['median_tpot_ms']:.1f})")
        for n in names[1:]:
            other = results[n][i]["output_throughput"]
            row[f"continuum_over_{n}"] = point["output_throughput"] / other if other else None
        ratios.append(row)
        print(f"{point['max_concurrency']} | " + " | ".join(cells) + " | " + " | ".join(
            f"{row[f'continuum_over_{n}']:.2f}x" if row[f"continuum_over_{n}"] else "n/a"
            for n in names[1:]))
    return ratios


if __name__ == "__main__":
    main()
