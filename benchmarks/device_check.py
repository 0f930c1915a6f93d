"""The GPU check of issue 41: the accelerator path (`engine.accel`: Triton attention, CUDA graphs,
the `--gpu-memory-utilization` profile) on one H100 / H200, against transformers on the same GPU
and weights, in one command of at most 8 minutes. Writes one JSON (`--out`), rewritten after
each section, so that a run cut short keeps what it measured.

Models: random-weight checkpoints (seed 0) built at the start from configs by
`benchmarks.checkpoints` (`smollm2` = the embedded model's config, `llama-3.2-1b`), from
`--base-dir` (config.json + tokenizer: `benchmarks/device_bundle.py` prepares it, since the
embedded model's GGUF needs `gguf`, which the GPU image lacks). Sections:

1. parity: greedy tokens of the engine vs transformers' greedy decoding (argmax of its logits,
   with its KV cache, one prompt at a time) — smollm2 and llama-3.2-1b, each in float32 and
   bfloat16 — with CUDA graphs and with `enforce_eager`, each in three phases: every prompt
   alone (prefix cache reset first); a prompt whose prefix another prompt has just cached; all
   16 at once after that warm-up (the shared-prefix prompts hit the cache: the hit counts are
   recorded). `max_num_batched_tokens` 64, so the ~300-token prompt is chunked. The near-tie
   rule of tests/test_engine_correctness.py: a token may first differ from the reference only
   where the reference's top-2 logit gap is below `near_tie`: 1e-3 in float32; in bfloat16
   about the largest bfloat16-vs-float32 logit difference of transformers on these random
   checkpoints (std 0.05 weights; measured on a CPU over four prompts up to 400 tokens: 0.36
   for smollm2 -> 0.5, 1.32 for llama-3.2-1b, whose logits are wider -> 1.5), i.e. a gap that
   bfloat16 rounding alone can close. Each prompt's first
   difference and gap are recorded, and whether the graph and eager engines agreed.
2. decode_step: the median of ~20 timed `engine.step()` calls (CUDA synchronized) once N
   requests (short prompts, ignore_eos) are all in decode, N = 1, 16, 64, 256, with and without
   graphs, on llama-3.2-1b bfloat16; against the HBM bound = weight bytes (the checkpoint's
   parameters in the serving dtype, tied embeddings once) / bandwidth, the bandwidth measured by
   a device-to-device copy of 1 GiB (bytes read + written / time). fraction = bound / step.
0. attention_kernel: one layer's batch-1 decode attention at contexts 128 / 1024 / 4096, the
   split-KV kernels against the one-pass kernel (`benchmarks/device_kernels.py`).
3. throughput: 256 prompts of 128 random token ids (seed 0), 128 output tokens, ignore_eos:
   output tokens/s of the engine (graphs) vs transformers' continuous batching
   (`generate_batch`, timed from its first request's start to its last finish, so its own
   warm-up is excluded as the engine's start is) on the same model and GPU.

Goals (llama-3.2-1b, recorded with pass/fail): single-stream decode (batch 1, graphs) >= 40% of
the HBM bound; throughput >= 3x transformers' continuous batching; parity as on the CPU.
`--budget-s` (default 360): a section, or an engine within one, that would start past it is
recorded as "skipped: budget"; transformers' `generate_batch` is abandoned 50 s past it.
`--smoke`: the same on a CPU in ~30 s (tiny config, float32, Triton's interpreter, batches 1
and 2, 4 throughput prompts of 16 in / 8 out, `generate_batch` without its warm-up; no graphs:
recorded as unavailable). tests/test_device_check.py runs it.

First `python benchmarks/device_bundle.py` here (it writes build/device/, which the device run
must carry: it is gitignored). The device command, from the repository root (`--print-command`
prints it):

    pip install --no-index --no-deps build/device/wheels/*.whl 2>/dev/null; python benchmarks/device_check.py --base-dir build/device/base --out $OUT/device_check.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.device_kernels import attention_kernels  # noqa: E402
from benchmarks.device_measure import (Report, attempt, copy_bandwidth_gb_s,  # noqa: E402
                                      environment, free_memory, generate_batch,
                                      greedy_reference, load_hf, log, random_prompts,
                                      run_with_timeout, sync, timed_ms, weight_bytes)

COMMAND = ("pip install --no-index --no-deps build/device/wheels/*.whl 2>/dev/null; "
           "python benchmarks/device_check.py --base-dir build/device/base "
           "--out $OUT/device_check.json")
NEAR_TIE_BF16 = {"tiny": 0.5, "smollm2": 0.5, "llama-3.2-1b": 1.5}      # see the docstring


def near_tie(model: str, dtype: str) -> float:
    """The near-tie tolerance (logits) of `model` (a `CONFIGS` name) in `dtype`."""
    return 1e-3 if dtype == "float32" else NEAR_TIE_BF16[model]
GOAL_FRACTION_OF_BOUND = 0.40
GOAL_THROUGHPUT_RATIO = 3.0
SHARED = " ".join(f"item {i} costs {i * 3} coins;" for i in range(12))
TEXTS = ("Hello", "The capital of France is", "def fibonacci(n):\n    return",
         "Once upon a time, in a land far away, there lived", "1, 2, 3, 4, 5, 6,",
         "The quick brown fox jumps over the lazy dog because", "Écris une phrase sur la mer.",
         "请用一句话介绍长城。", "import numpy as np\nx = np.", "Dear Sir or Madam, I am writing",
         "Water boils at", "<html><body><h1>", "Q: What is 2 + 2?\nA:")
LONG = " ".join(f"Fact {i}: {i} squared is {i * i}." for i in range(1, 60))


@dataclass(frozen=True)
class Plan:
    """Sizes of one run: `FULL` on a GPU, `SMOKE` on this CPU."""

    device: str
    parity: tuple[tuple[str, tuple[str, ...]], ...]     # (checkpoint, dtypes)
    perf_model: str
    perf_dtype: str
    num_texts: int            # prompts of TEXTS; + 2 shared-prefix prompts + 1 long one
    long_len: int             # tokens of the chunked prompt
    chunk_budget: int         # max_num_batched_tokens of the parity engines
    max_tokens: int
    max_model_len: int
    kv_cache_gib: float
    batch_sizes: tuple[int, ...]
    timed_steps: int
    num_prompts: int          # throughput workload
    input_len: int
    output_len: int
    copy_bytes: int


FULL = Plan(device="cuda", parity=(("smollm2", ("float32", "bfloat16")),
                                   ("llama-3.2-1b", ("float32", "bfloat16"))),
            perf_model="llama-3.2-1b", perf_dtype="bfloat16", num_texts=13, long_len=300,
            chunk_budget=64, max_tokens=24, max_model_len=2048, kv_cache_gib=2.0,
            batch_sizes=(1, 16, 64, 256), timed_steps=20, num_prompts=256, input_len=128,
            output_len=128, copy_bytes=1 << 30)
SMOKE = Plan(device="cpu", parity=(("tiny", ("float32",)),), perf_model="tiny",
             perf_dtype="float32", num_texts=1, long_len=40, chunk_budget=16, max_tokens=8,
             max_model_len=512, kv_cache_gib=0.02, batch_sizes=(1, 2), timed_steps=5,
             num_prompts=4, input_len=16, output_len=8, copy_bytes=64 << 20)


def build_checkpoints(plan: Plan, base_dir: Path, work: Path) -> dict:
    """Every checkpoint the plan names, built on the device (random init there is fast; the
    weights are written once, float32, for both engines to load). Returns name -> path, s."""
    import torch

    from benchmarks.checkpoints import build_checkpoint

    names = dict.fromkeys([m for m, _ in plan.parity] + [plan.perf_model])
    out = {}
    for name in names:
        t0 = time.perf_counter()
        with torch.device(plan.device):
            path = build_checkpoint(base_dir, work / name, name)
        free_memory()
        out[name] = {"path": str(path), "seconds": round(time.perf_counter() - t0, 1),
                     "weight_bytes_float32": sum(f.stat().st_size
                                                 for f in path.glob("*.safetensors"))}
    return out


def parity_prompts(plan: Plan, tokenizer) -> tuple[dict[str, list[int]], list[int]]:
    """(name -> prompt ids, the warm-up prompt that caches the shared prefix)."""
    prompts = {f"text{i}": tokenizer.encode(t) for i, t in enumerate(TEXTS[:plan.num_texts])}
    for i in (1, 2):
        prompts[f"shared{i}"] = tokenizer.encode(f"{SHARED} What does item {i * 3} cost?")
    prompts["long"] = tokenizer.encode(LONG * 4)[:plan.long_len]
    return prompts, tokenizer.encode(f"{SHARED} What does item 0 cost?")


def compare(out: list[int], ref: tuple[list[int], list[float]], tol: float) -> str | dict:
    """The near-tie rule on one output: "exact", or its verdict ("near-tie": the first
    difference is where the reference's top-2 gap < tol; else "mismatch"), first-difference
    index and the reference's gap there."""
    tokens, gaps = ref
    i = next((i for i, (a, b) in enumerate(zip(out, tokens)) if a != b), None)
    if i is None and len(out) == len(tokens):
        return "exact"
    if i is None:
        return {"verdict": "mismatch", "first_diff": min(len(out), len(tokens)), "gap": None}
    return {"verdict": "near-tie" if gaps[i] < tol else "mismatch", "first_diff": i,
            "gap": gaps[i]}


def make_engine(plan: Plan, model: str, dtype: str, eager: bool, **overrides):
    """An `LLMEngine` of `model` (a checkpoint path) in `dtype` on the plan's device;
    `eager` = `enforce_eager`; `overrides` are `EngineConfig` fields."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    cfg = dict(model=model, dtype=dtype, device=plan.device, enforce_eager=eager,
               max_model_len=plan.max_model_len, seed=0)
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg))


def run_phases(eng, prompts: dict[str, list[int]], warm: list[int], n: int) -> tuple[dict, dict]:
    """(phase -> name -> tokens, prefix-cache hit counts) of the three parity phases."""
    from scheduler.request import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    kv, counters = eng.scheduler.kv, eng.scheduler.counters

    def gen(ps):
        return [c[0] for c in eng.generate(list(ps), params)]

    out: dict[str, dict] = {"alone": {}}
    for name, p in prompts.items():
        kv.reset_prefix_cache()
        out["alone"][name] = gen([p])[0]
    alone_hits = counters.prefix_cache_hits
    kv.reset_prefix_cache()
    gen([warm])
    h0 = counters.prefix_cache_hits
    out["cached_prefix"] = {"shared1": gen([prompts["shared1"]])[0]}
    h1 = counters.prefix_cache_hits
    out["concurrent"] = dict(zip(prompts, gen(prompts.values())))
    hits = {"alone": alone_hits, "cached_prefix": h1 - h0,
            "concurrent": counters.prefix_cache_hits - h1}
    return out, hits


def parity_engine(plan: Plan, path: str, dtype: str, eager: bool, prompts, warm, refs) -> dict:
    """One engine's parity record (see the module docstring)."""
    tol = near_tie(Path(path).name, dtype)
    eng = make_engine(plan, path, dtype, eager, kv_cache_memory=plan.kv_cache_gib,
                      max_num_seqs=32, max_num_batched_tokens=plan.chunk_budget)
    graphs, replays = eng.runner.graphs, count_replays(eng)
    about = {"attention_backend": getattr(eng.runner.backend, "name", None),
             "graph_buckets": graphs.buckets if graphs is not None else None}
    outputs, hits = run_phases(eng, prompts, warm, plan.max_tokens)
    del eng, graphs
    checks = {ph: {name: compare(toks, refs[name], tol) for name, toks in outs.items()}
              for ph, outs in outputs.items()}
    verdicts = [c if c == "exact" else c["verdict"] for ph in checks.values() for c in ph.values()]
    return {**about, "graph_replays": len(replays), "prefix_cache_hits": hits, "checks": checks,
            "counts": {v: verdicts.count(v) for v in ("exact", "near-tie", "mismatch")},
            "pass": "mismatch" not in verdicts and hits["cached_prefix"] > 0
            and hits["concurrent"] > 0, "_outputs": outputs}


def parity_model(plan: Plan, report: Report, path: str, dtypes) -> dict:
    """Parity of one checkpoint in each dtype, graphs and eager."""
    from transformers import AutoTokenizer

    prompts, warm = parity_prompts(plan, AutoTokenizer.from_pretrained(path))
    result: dict = {"prompt_lens": {k: len(v) for k, v in prompts.items()}}
    for dtype in dtypes:
        if report.over_budget():
            result[dtype] = "skipped: budget"
            continue
        hf = load_hf(path, dtype, plan.device)
        refs = {k: greedy_reference(hf, p, plan.max_tokens, plan.device)
                for k, p in prompts.items()}
        del hf
        free_memory()
        runs: dict = {"near_tie_tolerance": near_tie(Path(path).name, dtype)}
        for mode in ("eager", "graphs"):   # eager first: a CUDA error in a graph is sticky
            if mode == "graphs" and plan.device != "cuda":
                runs[mode] = "graphs: unavailable on cpu"
            elif report.over_budget():
                runs[mode] = "skipped: budget"
            else:
                runs[mode] = attempt(parity_engine, plan, path, dtype, mode == "eager",
                                     prompts, warm, refs)
                free_memory()
        outs = [runs[m].pop("_outputs") for m in ("graphs", "eager") if "_outputs" in runs[m]]
        runs["graph_eager_identical"] = outs[0] == outs[1] if len(outs) == 2 else None
        if len(outs) == 2:
            runs["graph_eager_differ"] = [f"{ph}/{n}" for ph, o in outs[0].items()
                                          for n in o if o[n] != outs[1][ph][n]]
        result[dtype] = runs
    return result


def parity(plan: Plan, report: Report, ckpts: dict) -> dict:
    """Section 1 (see the module docstring): one entry per checkpoint, or its error."""
    return {name: attempt(parity_model, plan, report, ckpts[name]["path"], dtypes)
            for name, dtypes in plan.parity}


def perf_engine(plan: Plan, path: str, eager: bool):
    """The engine of the step times and the throughput: KV cache from the
    `--gpu-memory-utilization` profile on a GPU (0.5: transformers runs after it)."""
    sizes = dict(max_num_seqs=max(plan.batch_sizes + (plan.num_prompts,)))
    if plan.device == "cuda":
        sizes["gpu_memory_utilization"] = 0.5
    else:
        sizes["kv_cache_memory"] = plan.kv_cache_gib
    return make_engine(plan, path, plan.perf_dtype, eager, **sizes)


def count_replays(eng) -> list[int]:
    """A counter of the runner's CUDA graph replays (empty list: none yet, or no graphs)."""
    graphs, count = eng.runner.graphs, []
    if graphs is not None:
        replay = graphs.replay
        graphs.replay = lambda bucket: (count.append(bucket), replay(bucket))[1]
    return count


def decode_step_ms(eng, plan: Plan, batch: int, replays: list[int], rng) -> dict:
    """Median ms of `plan.timed_steps` steps once `batch` requests are all in decode."""
    from scheduler.request import SamplingParams

    params = SamplingParams(max_tokens=plan.timed_steps + 8, temperature=0, ignore_eos=True)
    ids = [f"decode-{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    vocab = min(eng.model_config.vocab_size, len(eng.tokenizer))
    for rid in ids:
        eng.add_request(rid, [rng.randrange(100, vocab) for _ in range(8)], params)
    started: set[str] = set()
    prefill_steps = 0
    while len(started) < batch:
        started.update(o.request_id for o in eng.step() if any(c.token_ids for c in o.outputs))
        prefill_steps += 1
    for _ in range(2):                  # warm-up decode steps
        eng.step()
    before = len(replays)
    times = timed_ms(eng.step, plan.device, plan.timed_steps)
    eng.abort_request(ids)
    return {"median_ms": statistics.median(times), "min_ms": min(times),
            "prefill_steps": prefill_steps, "graph_replays": len(replays) - before}


def decode_steps(plan: Plan, report: Report, ckpts: dict, state: dict) -> dict:
    """Section 2 (see the module docstring). Keeps the last engine in `state` for section 3."""
    path = ckpts[plan.perf_model]["path"]
    wbytes = weight_bytes(path, plan.perf_dtype)
    bandwidth = copy_bandwidth_gb_s(plan.device, plan.copy_bytes)
    bound_ms = wbytes / (bandwidth * 1e9) * 1e3
    result = {"model": plan.perf_model, "dtype": plan.perf_dtype, "weight_bytes": wbytes,
              "copy_bytes": plan.copy_bytes, "bandwidth_gb_s": round(bandwidth, 1),
              "hbm_bound_ms": bound_ms}
    for mode in ("eager", "graphs"):
        if mode == "graphs" and plan.device != "cuda":
            result[mode] = "graphs: unavailable on cpu"
        elif report.over_budget():
            result[mode] = "skipped: budget"
        else:
            state.pop("engine", None)
            free_memory()
            result[mode] = attempt(time_engine, plan, path, mode == "eager", bound_ms, state)
    return result


def time_engine(plan: Plan, path: str, eager: bool, bound_ms: float, state: dict) -> dict:
    """Decode step times of one perf engine at each batch size; the engine stays in `state`."""
    eng = perf_engine(plan, path, eager)
    state["engine"] = eng
    replays, rng = count_replays(eng), random.Random(0)
    runs = {"kv_cache_gib": round(eng.runner.kv_cache.nbytes / 2**30, 2),
            "engine_start_s": round(eng.load_time, 1)}
    for batch in plan.batch_sizes:
        r = decode_step_ms(eng, plan, batch, replays, rng)
        r["fraction_of_bound"] = bound_ms / r["median_ms"]
        runs[str(batch)] = r
    return runs


def engine_throughput(eng, plan: Plan, prompts) -> dict:
    """Output tokens/s of `eng` on all `prompts` at once (after a short warm-up)."""
    from scheduler.request import SamplingParams

    eng.generate(prompts[:8], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    params = SamplingParams(max_tokens=plan.output_len, temperature=0, ignore_eos=True)
    sync(plan.device)
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    sync(plan.device)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o[0]) for o in outs)
    return {"graphs": eng.runner.graphs is not None, "seconds": round(seconds, 3),
            "output_tokens": tokens, "tokens_per_s": tokens / seconds}


def transformers_throughput(plan: Plan, report: Report, path: str, prompts) -> dict:
    """`generate_batch` (its warm-up on a GPU only: CUDA graphs), abandoned and recorded as a
    timeout if it runs 50 s past the budget, so that the JSON is always written."""
    hf = load_hf(path, plan.perf_dtype, plan.device)
    limit = max(10.0, report.budget_s + 50 - report.elapsed())
    value, report.abandoned = run_with_timeout(
        lambda: generate_batch(hf, prompts, plan.output_len, plan.device == "cuda"), limit)
    return value


def throughput(plan: Plan, report: Report, ckpts: dict, state: dict) -> dict:
    """Section 3 (see the module docstring)."""
    path = ckpts[plan.perf_model]["path"]
    eng = state.pop("engine", None) or perf_engine(plan, path, plan.device != "cuda")
    vocab = min(eng.model_config.vocab_size, len(eng.tokenizer))
    prompts = random_prompts(plan.num_prompts, plan.input_len, vocab)
    result = {"workload": {"prompts": plan.num_prompts, "input_len": plan.input_len,
                           "output_len": plan.output_len},
              "continuum": engine_throughput(eng, plan, prompts)}
    del eng
    free_memory()
    hf = (attempt(transformers_throughput, plan, report, path, prompts)
          if not report.over_budget() else "skipped: budget")
    result["transformers_generate_batch"] = hf
    ok = isinstance(hf, dict) and hf.get("complete")
    result["ratio"] = result["continuum"]["tokens_per_s"] / hf["tokens_per_s"] if ok else None
    return result


def goal(value, target: float) -> dict:
    """A goal's record: its target, the measured value (None: not measured), pass or not."""
    return {"target": target, "value": value, "pass": None if value is None else value >= target}


def goals(plan: Plan, data: dict) -> dict:
    """The goals of issue 41 on `plan.perf_model`, from the sections' values (None: not
    measured)."""
    def get(*keys):
        d = data
        for k in keys:
            d = d.get(k) if isinstance(d, dict) else None
        return d

    def passes(model: str) -> bool | None:
        runs = [r for d in (data.get("parity") or {}).get(model, {}).values()
                if isinstance(d, dict) for r in d.values() if isinstance(r, dict)]
        return all(r.get("pass") for r in runs) if runs else None

    return {"model": plan.perf_model,
            "single_stream_fraction_of_hbm_bound": goal(
                get("decode_step", "graphs", "1", "fraction_of_bound"), GOAL_FRACTION_OF_BOUND),
            "throughput_vs_transformers_cb": goal(get("throughput", "ratio"),
                                                  GOAL_THROUGHPUT_RATIO),
            "parity": {"target": "differences only at near-ties",
                       "pass": passes(plan.perf_model)},
            "parity_all_models": {m: passes(m) for m, _ in plan.parity}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-dir", help="config.json + tokenizer files (build/device/base); "
                    "default: the embedded model (needs gguf)")
    ap.add_argument("--out", default="device_check.json")
    ap.add_argument("--work-dir", help="where checkpoints are built (default: a temporary "
                    "directory, removed at the end)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip sections that would start later (default 360; smoke 240)")
    ap.add_argument("--device", help="default cuda (smoke: cpu)")
    ap.add_argument("--smoke", action="store_true", help="the CPU run (see the docstring)")
    ap.add_argument("--print-command", action="store_true",
                    help="print the device command and exit")
    return ap.parse_args(argv)


def setup(args: argparse.Namespace) -> Plan:
    """The plan, and the environment it needs (set before torch or triton is imported)."""
    plan = SMOKE if args.smoke else FULL
    if args.device:
        plan = dataclasses.replace(plan, device=args.device)
    if args.smoke:
        os.environ["CONTINUUM_ATTENTION_BACKEND"] = "triton"
        os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")          # no network on the device
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("continuum").setLevel(logging.INFO)
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return plan


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.print_command:
        print(COMMAND)
        return 0
    plan = setup(args)
    if args.base_dir:
        base_dir = Path(args.base_dir)
    else:
        from engine.loader import resolve_model
        base_dir = resolve_model(None)
    budget = args.budget_s if args.budget_s is not None else 240 if args.smoke else 360
    report = Report(Path(args.out), budget, "smoke" if args.smoke else "full", COMMAND)
    report.data["plan"] = dataclasses.asdict(plan)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="dcheck-"))
    state: dict = {}
    try:
        report.section("env", environment, plan.device)
        report.section("attention_kernel", attention_kernels, plan)
        ckpts = report.section("checkpoints", build_checkpoints, plan, base_dir, work)
        if not isinstance(ckpts, dict) or "error" in ckpts:
            ckpts = None
        for name, fn, *rest in (("parity", parity), ("decode_step", decode_steps, state),
                                ("throughput", throughput, state)):
            if ckpts is None:
                report.data[name] = "skipped: no checkpoints"
            else:
                report.section(name, fn, plan, report, ckpts, *rest)
        state.clear()
        report.data["goals"] = goals(plan, report.data)
        report.write()
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    log(f"done in {report.elapsed():.0f} s: {args.out}; goals: "
        + json.dumps(report.data.get("goals")))
    if report.abandoned is not None:        # transformers' thread would keep us alive
        sys.stdout.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
