"""Offline engine throughput vs. transformers' static-batch `generate`, in one run.

Workload (issue 3): N requests (default 64) of random prompts (`--input-len` tokens, seeded) and
`--output-len` output tokens with EOS ignored, on the embedded model, per dtype:

- `throughput_tok_s`: this engine, all requests submitted at once (continuous batching), output
  tokens / wall time.
- `hf_throughput_tok_s`: transformers `generate` on static batches of `--hf-batch-size`,
  greedy, `min_new_tokens = max_new_tokens` (same work), output tokens / wall time.
- `single_stream_tok_s` / `hf_single_stream_tok_s`: decode rate of one request,
  (output tokens - 1) / (time after the first token), median of `--repeats` runs. For
  transformers: the difference between a full and a 1-token generate.

- `decode_bytes_per_step` / `read_gb_s` / `single_stream_bound_tok_s`: the bytes one decode step
  must read at batch 1 (every linear weight and the LM head, in the dtype), the host's measured
  read bandwidth (a 1 GiB float32 sum with the engine's threads), and their quotient: the
  memory-bandwidth bound on single-stream decode; `single_stream_of_bound` is the fraction reached.

Prints one JSON line (and writes it to `--save-result FILE`). `--profile` adds a
torch-profiler table of one decode step at batch 1 and at batch N to stderr.

    python benchmarks/engine_bench.py [--dtypes float32,bfloat16] [--num-prompts 64]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.harness import add_save_result, save_result  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.heap import freeze_heap  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` seeded prompts of `length` random token ids in [100, vocab)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def engine_throughput(eng: LLMEngine, prompts, output_len: int) -> float:
    """Output tokens per second for all `prompts` submitted at once (after a warm-up)."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
    eng.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))    # warm-up
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    assert all(len(o[0]) == output_len for o in outs)
    return len(prompts) * output_len / elapsed


@torch.inference_mode()      # as the server's engine core loop runs (engine.core_proc)
def engine_single_stream(eng: LLMEngine, prompt, output_len: int) -> float:
    """Decode tokens per second of one request, counted after its first token."""
    eng.add_request("single", prompt, SamplingParams(max_tokens=output_len, ignore_eos=True,
                                                     temperature=0))
    first = None
    n = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            n += len(out.outputs[0].token_ids)
            if first is None and n:
                first = time.perf_counter()
    return (n - 1) / (time.perf_counter() - first)


def read_bandwidth_gb_s(repeats: int = 5) -> float:
    """The host's read bandwidth (GB/s): best of `repeats` sums over 1 GiB of float32."""
    x = torch.ones(1 << 28, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def decode_bytes_per_step(eng: LLMEngine) -> int:
    """Bytes a decode step at batch 1 must read: all linear weights and the LM head (the
    embedding lookup, norms and KV cache are negligible beside them) — their blocks where the
    engine serves them quantized (the GGUF default), else the parameters in the dtype."""
    model = eng.model
    if model.quant_types:
        linears = [lin for layer in model.layers for lin in (layer[1], layer[2], layer[4],
                                                             layer[5])] + [model.lm_head]
        return sum(p.nbytes for lin in linears for p in lin.parts)
    c = eng.model_config
    per_layer = (c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
                 + c.num_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size
                 * c.intermediate_size)
    params = c.num_layers * per_layer + c.vocab_size * c.hidden_size
    return params * torch.empty((), dtype=eng.dtype).element_size()


def hf_generate(model, batch: list[list[int]], new_tokens: int) -> float:
    """Seconds for one static-batch transformers `generate` of exactly `new_tokens` tokens."""
    ids = torch.tensor(batch)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=model.config.eos_token_id)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - t0


def profile_step(eng: LLMEngine, prompts, batch: int) -> str:
    """torch-profiler table of one steady decode step at `batch` requests."""
    from torch.profiler import ProfilerActivity, profile

    for i, p in enumerate(prompts[:batch]):
        eng.add_request(f"prof-{batch}-{i}", p,
                        SamplingParams(max_tokens=64, ignore_eos=True, temperature=0))
    for _ in range(8):
        eng.step()                                  # past prefill, into steady decode
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        eng.step()
    eng.abort_request([f"prof-{batch}-{i}" for i in range(batch)])
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


def hf_figures(model_dir, dtype: str, prompts, args) -> dict:
    """transformers `generate` on the same prompts: static-batch throughput and single-stream
    decode rate (tok/s)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    hf_generate(hf, prompts[:1], 2)                                  # warm-up
    bs = args.hf_batch_size
    total = sum(hf_generate(hf, prompts[i:i + bs], args.output_len)
                for i in range(0, len(prompts), bs))
    one = hf_generate(hf, prompts[:1], 1)
    return {"hf_throughput_tok_s": len(prompts) * args.output_len / total,
            "hf_single_stream_tok_s": statistics.median(
                (args.output_len - 1) / (hf_generate(hf, prompts[:1], args.output_len) - one)
                for _ in range(args.repeats))}


def measure(dtype: str, args) -> dict:
    """Every figure of the module docstring for one dtype, rounded to 2 decimals."""
    eng = LLMEngine(EngineConfig(dtype=dtype, device="cpu", kv_cache_memory=1.0,
                                 max_model_len=args.input_len + args.output_len + 16))
    freeze_heap()          # as the server's engine core process does once its engine is built
    prompts = random_prompts(args.num_prompts, args.input_len,
                             eng.model_config.vocab_size, args.seed)
    r = {"throughput_tok_s": engine_throughput(eng, prompts, args.output_len),
         "single_stream_tok_s": statistics.median(
             engine_single_stream(eng, prompts[i % len(prompts)], args.output_len)
             for i in range(args.repeats))}
    r["decode_bytes_per_step"] = decode_bytes_per_step(eng)
    r["read_gb_s"] = read_bandwidth_gb_s()
    r["single_stream_bound_tok_s"] = r["read_gb_s"] * 1e9 / r["decode_bytes_per_step"]
    r["single_stream_of_bound"] = r["single_stream_tok_s"] / r["single_stream_bound_tok_s"]
    if args.profile:
        for b in (1, args.num_prompts):
            print(f"--- {dtype}: one decode step at batch {b}\n{profile_step(eng, prompts, b)}",
                  file=sys.stderr)
    if not args.skip_hf:
        r.update(hf_figures(eng.model_dir, dtype, prompts, args))
        r["throughput_ratio"] = r["throughput_tok_s"] / r["hf_throughput_tok_s"]
    del eng
    return {k: round(v, 2) for k, v in r.items()}


def main(argv: list[str] | None = None) -> dict:
    """Measure every dtype; print, save and return the result."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true", help="only this engine's figures")
    ap.add_argument("--repeats", type=int, default=3,
                    help="single-stream runs; the median is reported (this machine is noisy)")
    ap.add_argument("--profile", action="store_true")
    add_save_result(ap)
    args = ap.parse_args(argv)

    result: dict = {"benchmark": "engine_offline", "num_prompts": args.num_prompts,
                    "input_len": args.input_len, "output_len": args.output_len,
                    "hf_batch_size": args.hf_batch_size, "threads": torch.get_num_threads()}
    for dtype in args.dtypes.split(","):
        result[dtype] = measure(dtype, args)
    if "float32" in result and "bfloat16" in result:
        result["bf16_over_fp32_throughput"] = round(
            result["bfloat16"]["throughput_tok_s"] / result["float32"]["throughput_tok_s"], 2)
    print(json.dumps(result))
    save_result(args.save_result, result)
    return result


if __name__ == "__main__":
    main()
