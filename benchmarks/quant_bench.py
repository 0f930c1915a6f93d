"""Quantized weights (issue 40): the embedded GGUF served as its blocks against Continuum's
bfloat16 and float32 weights and against llama.cpp, same client, same workload, one run.

Workload A: `--num-prompts` random prompts of `--input-len` tokens, `--output-len` output tokens
(ignore_eos; `min_tokens` for llama.cpp, which has no ignore_eos), completions endpoint, streamed,
at each concurrency of `--concurrency` (concurrency 1 sends `--c1-prompts` requests: 64 single
streams of 128 tokens take minutes per server). Servers, one at a time on a free loopback port,
each with the same KV budget (`--kv-cache-memory` GiB):
  gguf-bf16 / gguf-f32   `--quantization gguf --dtype bfloat16|float32` (the blocks, read by
                         engine/kernels/quant.c; activations in that dtype)
  bf16 / f32             `--quantization none --dtype ...` (the GGUF dequantized at load)
  int8-bf16              `--quantization int8 --dtype bfloat16`
  gguf-q8-bf16           gguf-bf16 with `--activation-quantization int8` (quant_q8.c /
                         quant_q8_wide.c; where the host has AVX-512 VNNI or AVX2)
  gguf / gguf-q8         `--quantization gguf` at `--dtype auto` (the host's default dtype:
                         float32 on an AVX2 host) with activations `none` / `int8`
  llama.cpp              `llama_cpp.server` (llama-cpp-python, built for this host) on the same
                         GGUF, 2 threads, with `--llama-python PATH` (a venv's python)
With `--rounds R` the Continuum servers run R times, alternating (a 2-core VM drifts by 20% or
more between runs), and each point is the median of its rounds.
Per server: output tokens/s, median TTFT and TPOT per point, and the server's resident memory
(every process of its session, VmRSS) after the last point. Ratios: each gguf / int8 server to
bf16, f32 and llama.cpp.

Before the servers, in this process: bytes of weights read per decoded token by each weight
format, the host's read bandwidth (a 1 GiB float32 sum on the torch threads), and the
quantized linears' single-row time as a fraction of the bound bytes / bandwidth, with float32
and with int8 activations.

    python benchmarks/quant_bench.py --llama-python /tmp/llamacpp/bin/python

`--model FILE.gguf` serves another GGUF (a Llama with the embedded model's tokenizer, e.g. a
random-weight one built for a size where weights dominate memory) instead of the embedded one;
the per-token weight figures are then skipped (they read the embedded file's layout).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):          # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (continuum, free_port, save_result, start,  # noqa: E402
                                stop)

# The activations' dtype is named (`none`) where `auto` would pick int8 on a host with VNNI and
# no bfloat16 units, so that each server is the same configuration on every host.
SERVERS = {"gguf-bf16": ["--quantization", "gguf", "--dtype", "bfloat16",
                         "--activation-quantization", "none"],
           "gguf-f32": ["--quantization", "gguf", "--dtype", "float32"],
           "bf16": ["--quantization", "none", "--dtype", "bfloat16"],
           "f32": ["--quantization", "none", "--dtype", "float32"],
           "int8-bf16": ["--quantization", "int8", "--dtype", "bfloat16",
                         "--activation-quantization", "none"],
           "gguf-q8-bf16": ["--quantization", "gguf", "--activation-quantization", "int8",
                            "--dtype", "bfloat16"],
           "gguf": ["--quantization", "gguf", "--activation-quantization", "none"],
           "gguf-q8": ["--quantization", "gguf", "--activation-quantization", "int8"]}
# int8 activations over the same server with activations left alone
Q8_PAIRS = (("gguf-q8-bf16", "gguf-bf16"), ("gguf-q8", "gguf"))


def session_rss_mib(pid: int) -> float:
    """Resident memory (VmRSS, MiB) of every process in the session led by `pid`."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) != pid:                 # the session id
                continue
            for line in (stat.parent / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1024


def weight_bytes() -> dict:
    """Bytes read per decoded token (linears and LM head; the embedding lookup reads one row)
    by each weight format, the host's read bandwidth, and the quantized linears' single-row
    GB/s (best of 20) as a fraction of it: through the Python wrapper, the C kernels alone, and
    one C call over all layers' gate / up rows, with float32 and with int8 activations."""
    import torch

    from engine import kernels
    from engine.loader import embedded_gguf_path
    from engine.quant.formats import QuantWeight
    from engine.quant.gguf_weights import read_gguf_weights

    lib = kernels.load()
    weights, _, _ = read_gguf_weights(embedded_gguf_path(), 9, 3)
    head = weights["model.embed_tokens.weight"]
    linears = []                        # as the model calls them: QKV and gate / up fused
    for i in range(30):
        p = f"model.layers.{i}."
        for names in (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                      ["self_attn.o_proj"], ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]):
            linears.append(QuantWeight.cat([weights[p + n + ".weight"] for n in names]))
    params = sum(w.shape[0] * w.shape[1] for w in linears + [head])
    big = torch.ones(1 << 28)                                   # 1 GiB of float32
    best = min(_timed(big.sum) for _ in range(5))
    read_gbs = big.numel() * 4 / best / 1e9
    xs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in linears}
    lin_bytes = sum(w.nbytes for w in linears)
    out = {"bytes_per_token": {"gguf": lin_bytes + head.nbytes, "bf16": 2 * params,
                               "f32": 4 * params,
                               "int8": params + 4 * sum(w.shape[0] for w in linears + [head])},
           "host_read_gbs": round(read_gbs, 1), "int8_activations": lib.q8_available}
    ys = {w.shape[0]: torch.empty(1, w.shape[0]) for w in linears}
    big_w = QuantWeight.cat([weights[f"model.layers.{i}.mlp.{n}_proj.weight"]
                             for i in range(30) for n in ("gate", "up")])
    big_y = torch.empty(1, big_w.shape[0])
    for name, int8_x in (("gguf", False), ("gguf_q8", True)):
        # int8: over the packed copies the served model reads (`q8_pack`, quant_q8_wide.c)
        ws, big = (([_q8_packed(lib, w) for w in linears], _q8_packed(lib, big_w)) if int8_x
                   else (linears, big_w))
        # through CpuKernels.quant_linear (as the model calls it: Python wrapper, new output)
        # and the C entry point alone with its arguments made beforehand (the kernel's rate)
        t_py = min(_timed(lambda: [lib.quant_linear(xs[w.shape[1]], w, int8_x=int8_x)
                                   for w in ws]) for _ in range(20))
        fn = lib._fn["quant_linear_q8" if int8_x else "quant_linear"]

        def packed(w):
            return (_ptr(w.q8_packed),) if int8_x else ()
        calls = [(*w.kernel_args, None, xs[w.shape[1]].data_ptr(), w.shape[1], 0,
                  ys[w.shape[0]].data_ptr(), w.shape[0], 1, 1, w.shape[0], w.shape[1],
                  torch.get_num_threads(), *packed(w)) for w in ws]
        t_c = min(_timed(lambda: [fn(*a) for a in calls]) for _ in range(20))
        # one call over the 30 layers' gate / up rows stacked (33 MB): the inner loop's rate
        # without the ~2 us of call and fork / join that each of the 120 calls pays
        n, k = big.shape
        args = (*big.kernel_args, None, xs[k].data_ptr(), k, 0, big_y.data_ptr(), n, 1, 1, n,
                k, torch.get_num_threads(), *packed(big))
        t_loop = min(_timed(lambda: fn(*args)) for _ in range(20))
        out[f"{name}_one_call_gbs"] = round(big_w.nbytes / t_loop / 1e9, 1)
        out[f"{name}_one_call_fraction_of_bound"] = round(big_w.nbytes / t_loop / 1e9 / read_gbs,
                                                          2)
        for sfx, t in (("", t_py), ("_kernel", t_c)):
            out[f"{name}_linears{sfx}_ms"] = round(t * 1e3, 2)
            out[f"{name}_linears{sfx}_gbs"] = round(lin_bytes / t / 1e9, 1)
            out[f"{name}_linears{sfx}_fraction_of_bound"] = round(lin_bytes / t / 1e9 / read_gbs,
                                                                   2)
    return out


def _q8_packed(lib, w):
    """A copy of the QuantWeight `w` with the int8 nest's packed weights (None where the
    build has no int8 kernels: the products then stay float32)."""
    from engine.quant.formats import QuantWeight
    copy = QuantWeight(w.qtype, w.data, w.shape, w.scale)
    if lib.q8_available:
        lib.q8_pack(copy)
    return copy


def _ptr(t):
    return None if t is None else t.data_ptr()


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def workload(base: str, tokenizer: str, concurrency: int, prompts: int, args,
             extra_body: dict | None) -> dict:
    """One point of workload A against `base`; vLLM's metric keys (times in ms)."""
    from benchmarks.servebench.serve_bench import add_arguments, run

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    a = ap.parse_args(["--base-url", base, "--tokenizer", tokenizer, "--dataset-name", "random",
                       "--random-input-len", str(args.input_len), "--random-output-len",
                       str(args.output_len), "--ignore-eos", "--num-prompts", str(prompts),
                       "--max-concurrency", str(concurrency), "--no-progress"])
    a.extra_body = extra_body
    m = run(a)[0]
    return {"concurrency": concurrency, "prompts": prompts, "completed": m["completed"],
            "output_tok_s": round(m["output_throughput"], 1),
            "median_ttft_ms": round(m["median_ttft_ms"], 1),
            "median_tpot_ms": round(m["median_tpot_ms"], 2)}


def bench_server(name: str, base: str, pid: int, tokenizer: str, args,
                 extra_body: dict | None = None) -> dict:
    """Workload A at each concurrency against the server at `base` (session `pid`): its points
    (`workload`) and its resident memory (MiB) after the last one."""
    points = [workload(base, tokenizer, c, args.c1_prompts if c == 1 else args.num_prompts,
                       args, extra_body) for c in args.concurrency]
    rss = session_rss_mib(pid)
    print(f"{name}: {json.dumps(points)} rss {rss:.0f} MiB", flush=True)
    return {"points": points, "rss_mib": round(rss)}


def llama_cpp(args, gguf: str, tokenizer: str) -> dict:
    """`bench_server` on llama-cpp-python's OpenAI server (`args.llama_python`) serving `gguf`
    with 2 threads; `min_tokens` stands in for ignore_eos. Raises RuntimeError if it does not
    start within 300 s."""
    port = free_port()
    cmd = [args.llama_python, "-m", "llama_cpp.server", "--model", gguf, "--n_threads", "2",
           "--n_threads_batch", "2", "--n_ctx", str(args.llama_n_ctx), "--host", "127.0.0.1",
           "--interrupt_requests", "False",      # its default cuts a stream at the next request
           "--port", str(port)]
    proc = start(cmd, f"http://127.0.0.1:{port}/v1/models", timeout=300)
    try:
        return bench_server("llama.cpp", f"http://127.0.0.1:{port}", proc.pid, tokenizer, args,
                            {"min_tokens": args.output_len})
    finally:
        stop(proc)


def median_run(runs: list[dict]) -> dict:
    """One server's rounds as one result: each point's median tok/s, TTFT and TPOT, and the
    median RSS (it varies by a few hundred MiB between runs: freed memory glibc keeps), with
    each round's figures."""
    points = []
    for i, first in enumerate(runs[0]["points"]):
        each = [r["points"][i] for r in runs]
        point = dict(first)
        for key in ("output_tok_s", "median_ttft_ms", "median_tpot_ms"):
            point[key] = statistics.median(p[key] for p in each)
        point["rounds_tok_s"] = [p["output_tok_s"] for p in each]
        points.append(point)
    rss = [r["rss_mib"] for r in runs]
    return {"points": points, "rss_mib": statistics.median(rss), "rounds_rss_mib": rss}


def ratios(results: dict) -> dict:
    """Output tokens/s of each quantized server over each baseline, per concurrency."""
    out = {}
    for q8, plain in Q8_PAIRS:
        if q8 in results and plain in results:
            out[f"{q8} / {plain}"] = {
                p["concurrency"]: round(p["output_tok_s"] / b["output_tok_s"], 2)
                for p, b in zip(results[q8]["points"], results[plain]["points"])}
    for q in [n for n in results if n.startswith(("gguf", "int8"))]:
        for base in [n for n in results if not n.startswith(("gguf", "int8"))]:
            out[f"{q} / {base}"] = {
                p["concurrency"]: round(p["output_tok_s"] / b["output_tok_s"], 2)
                for p, b in zip(results[q]["points"], results[base]["points"])}
        for base in [n for n in results if not n.startswith(("gguf", "int8"))]:
            out[f"{q} / {base} rss"] = round(results[q]["rss_mib"] / results[base]["rss_mib"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", default=",".join(SERVERS),
                    help=f"comma list of {', '.join(SERVERS)}")
    ap.add_argument("--concurrency", default="1,16,64",
                    type=lambda s: [int(c) for c in s.split(",")])
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the Continuum servers this many times, alternating; medians")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--c1-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--kv-cache-memory", default="0.5", help="GiB, every Continuum server")
    ap.add_argument("--llama-python", default=None,
                    help="python of a venv with llama-cpp-python[server]: add llama.cpp")
    ap.add_argument("--llama-n-ctx", type=int, default=4096)
    ap.add_argument("--save-result", default="benchmarks/results/quant_bench.json")
    ap.add_argument("--model", default=None,
                    help="a GGUF file to serve instead of the embedded model")
    args = ap.parse_args()

    from engine.kernels.isa import cpu_flags, cpu_isa
    from engine.loader import embedded_gguf_path, resolve_model

    gguf = args.model or str(embedded_gguf_path())
    tokenizer = str(resolve_model(args.model))
    result = {"host": {"isa": cpu_isa(), "avx512_bf16": "avx512_bf16" in cpu_flags(),
                       "cpus": len(__import__("os").sched_getaffinity(0))},
              "workload": {k: getattr(args, k) for k in ("num_prompts", "c1_prompts",
                                                         "input_len", "output_len",
                                                         "concurrency", "kv_cache_memory", "rounds",
                                                         "model")}}
    if args.model is None:
        result["weights"] = weight_bytes()
    print(json.dumps(result, indent=1), flush=True)
    runs: dict[str, list] = {}
    for _ in range(args.rounds):               # rounds alternate the servers: drift hits all
        for name in args.servers.split(","):
            flags = ([gguf] if args.model else []) + SERVERS[name] + [
                "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", "2048"]
            with continuum(flags) as srv:
                runs.setdefault(name, []).append(
                    bench_server(name, srv.base, srv.proc.pid, tokenizer, args))
    servers = {name: median_run(r) for name, r in runs.items()}
    if args.llama_python:
        servers["llama.cpp"] = llama_cpp(args, gguf, tokenizer)
    result["servers"] = servers
    result["ratios"] = ratios(servers)
    print(json.dumps(result["ratios"], indent=1))
    save_result(args.save_result, result)


if __name__ == "__main__":
    main()
