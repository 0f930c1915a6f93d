"""The GPU check's measurements of everything but the engine (`benchmarks/device_check.py`),
run on the device: the transformers side (`greedy_reference`: tokens and top-2 gaps;
`generate_batch`: continuous-batching throughput), the HBM bound's two terms (`weight_bytes`,
`copy_bandwidth_gb_s`), the environment, and the check's JSON record (`Report`: rewritten
after each section, sections skipped past the budget).
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import platform
import random
import sys
import threading
import time
import traceback
from pathlib import Path


class Report:
    """The device check's JSON, rewritten after each section: the sections' values (or
    errors, or "skipped: budget"), each one's wall time, the budget."""

    def __init__(self, path: Path, budget_s: float, mode: str, command: str) -> None:
        self.path, self.budget_s, self.t0 = path, budget_s, time.perf_counter()
        self.abandoned: threading.Thread | None = None     # a transformers run left behind
        self.data: dict = {"mode": mode, "command": command, "budget_s": budget_s,
                           "wall_s": {}, "skipped": []}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over_budget(self) -> bool:
        return self.elapsed() > self.budget_s

    def write(self) -> None:
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(self.path)

    def section(self, name: str, fn, *args):
        """Run `fn(*args)` as section `name` unless past the budget; its value (or its error)
        becomes the section. Returns the value, or None."""
        if self.over_budget():
            self.data[name] = "skipped: budget"
            self.data["skipped"].append(name)
            self.write()
            return None
        log(f"section {name} at {self.elapsed():.0f} s")
        self.data[name] = "running"
        self.write()
        t0 = time.perf_counter()
        value = attempt(fn, *args)
        self.data[name] = value
        self.data["wall_s"][name] = round(time.perf_counter() - t0, 1)
        self.write()
        return value


def attempt(fn, *args):
    """`fn(*args)`, or {"error", "traceback"} when it raises: recorded, and the run goes on."""
    try:
        return fn(*args)
    except Exception as e:
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"[:2000],
                "traceback": traceback.format_exc()[-3000:]}


def log(msg: str) -> None:
    """Print `msg` to stderr with the elapsed time (the device log's progress line)."""
    print(f"[device_check] {msg}", file=sys.stderr, flush=True)


def sync(device: str) -> None:
    """Wait for queued work on `device` ("cuda" or "cpu": a no-op) before a timer."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def timed_ms(fn, device: str, n: int) -> list[float]:
    """Milliseconds of each of `n` calls of `fn()`, `device` synchronized before and after
    each (`sync`): host time plus what the call queued on the device."""
    times = []
    for _ in range(n):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def free_memory() -> None:
    """Collect garbage and empty torch's CUDA cache between engines and models."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def environment(device: str) -> dict:
    """Versions, the device, and the settings that change numerics or the attention path."""
    import torch
    import transformers
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "triton": triton.__version__,
           "device": device, "cuda": torch.version.cuda,
           "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
           "attention_backend": os.environ.get("CONTINUUM_ATTENTION_BACKEND", "auto"),
           "triton_interpret": os.environ.get("TRITON_INTERPRET", "0")}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
    return env


def load_hf(path: str, dtype: str, device: str):
    """transformers' model at `path` in `dtype` ("float32" / "bfloat16") on `device`, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(
        device).eval()


def greedy_reference(hf, prompt: list[int], n: int, device: str) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens (argmax of its logits, with its KV cache: what `generate`
    does with EOS off) and the top-2 logit gap at each position."""
    import torch

    params = inspect.signature(hf.forward).parameters    # `cache` from transformers 5.24 on
    key = "cache" if "cache" in params else "past_key_values"
    tokens, gaps = [], []
    with torch.inference_mode():
        out = hf(input_ids=torch.tensor([prompt], device=device), use_cache=True)
        for k in range(n):
            logits = out.logits[0, -1].float()
            top = logits.topk(2).values
            tokens.append(int(logits.argmax()))
            gaps.append(float(top[0] - top[1]))
            if k + 1 < n:
                past = out.get("cache")
                past = out.get("past_key_values") if past is None else past
                out = hf(input_ids=torch.tensor([[tokens[-1]]], device=device), use_cache=True,
                         **{key: past})
    return tokens, gaps


def weight_bytes(path: str, dtype: str) -> int:
    """The checkpoint's parameters (tied embeddings once, as saved) in `dtype`'s bytes."""
    import torch
    from safetensors import safe_open

    numel = 0
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            numel += sum(torch.Size(st.get_slice(k).get_shape()).numel() for k in st.keys())
    return numel * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def copy_bandwidth_gb_s(device: str, nbytes: int, repeats: int = 10) -> float:
    """Device memory bandwidth: (bytes read + written) / time of the best of `repeats`
    device-to-device copies of `nbytes`."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    free_memory()
    return 2 * nbytes / best / 1e9


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`n` seeded prompts of `length` random token ids in [100, vocab)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def generate_batch(hf, prompts: list[list[int]], output_len: int, warmup: bool) -> dict:
    """transformers' continuous batching (`generate_batch`) on `prompts`, greedy, EOS off
    (-1). Timed from the first request's start (leaving the queue) to the last one's finish
    where its outputs carry those times, which leaves out its warm-up and the sizing of its
    cache (done after the requests are queued when `warmup` is off), else the whole call
    (`timed` says which)."""
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    accepted = inspect.signature(hf.generate_batch).parameters
    kwargs = {k: v for k, v in (("progress_bar", False), ("warmup", warmup)) if k in accepted}
    t0 = time.perf_counter()
    results = hf.generate_batch(inputs=prompts, generation_config=gen, **kwargs)
    wall = time.perf_counter() - t0
    outs = list(results.values()) if isinstance(results, dict) else list(results)
    tokens = sum(len(o.generated_tokens) for o in outs)
    spans = [o.lifespan for o in outs if min(getattr(o, "lifespan", (-1, -1))) > 0]
    span = max(e for _, e in spans) - min(s for s, _ in spans) if spans else None
    timed = "requests" if span and 0 < span <= wall else "call"
    seconds = span if timed == "requests" else wall
    return {"call_s": round(wall, 3), "seconds": round(seconds, 3), "timed": timed,
            "warmup": kwargs.get("warmup"), "requests": len(outs), "output_tokens": tokens,
            "complete": tokens == len(prompts) * output_len,
            "errors": [o.error for o in outs if getattr(o, "error", None)][:3],
            "tokens_per_s": tokens / seconds}


def run_with_timeout(fn, timeout: float) -> tuple[object, threading.Thread | None]:
    """(fn()'s value or an error dict, None), or (a timeout error dict, the thread still
    running it) after `timeout` seconds: a daemon thread the caller may abandon."""
    box: dict = {}

    def target():
        box["value"] = attempt(fn)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return {"error": f"timeout: still running after {timeout:.0f} s"}, thread
    return box["value"], None
