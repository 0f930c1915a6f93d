"""Where a batch-1 decode step goes on a GPU: the profile behind docs/accelerators.md's
breakdown, as one script for the device command (run it after `benchmarks/device_check.py`).

On the Llama-3.2-1B-shaped random checkpoint in bfloat16 with CUDA graphs, one request in
decode: the median step (`engine.step()`, CUDA synchronized), the median replay of the batch-1
graph alone, a cProfile of 200 steps (host time by function) and a `torch.profiler` table of 20
steps (GPU time by kernel). Writes `--out` (text). `--smoke`: the tiny config in float32 on
this CPU under Triton's interpreter (no graphs), to show the script runs
(tests/test_device_check.py).

    python benchmarks/device_profile.py --base-dir build/device/base --out $OUT/profile.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.device_measure import sync, timed_ms  # noqa: E402


def median_ms(fn, device: str, n: int) -> float:
    """Median milliseconds of `n` calls of `fn`, the device synchronized around each."""
    return statistics.median(timed_ms(fn, device, n))


def profile(base_dir: str, smoke: bool) -> str:
    """The report's text (see the module docstring); the checkpoint it builds is removed
    after."""
    with tempfile.TemporaryDirectory(prefix="dprof-") as tmp:
        return _profile(base_dir, Path(tmp), smoke)


def _profile(base_dir: str, tmp: Path, smoke: bool) -> str:
    """`profile` with its checkpoint built under `tmp`."""
    from benchmarks.checkpoints import build_checkpoint
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from scheduler.request import SamplingParams

    device, name, dtype = ("cpu", "tiny", "float32") if smoke else \
        ("cuda", "llama-3.2-1b", "bfloat16")
    steps, kernel_steps = (5, 2) if smoke else (200, 20)
    path = build_checkpoint(base_dir, tmp / name, name)
    sizes = dict(kv_cache_memory=0.02) if smoke else dict(gpu_memory_utilization=0.5)
    eng = LLMEngine(EngineConfig(model=str(path), dtype=dtype, device=device, seed=0,
                                 max_model_len=512 if smoke else 2048, max_num_seqs=8,
                                 **sizes))
    rng = random.Random(0)
    eng.add_request("p", [rng.randrange(100, 1000) for _ in range(8)],
                    SamplingParams(max_tokens=10 * steps, temperature=0, ignore_eos=True))
    for _ in range(5):                                 # the prefill and warm-up decodes
        eng.step()
    out = [f"{name} {dtype} on {device}, batch 1, context ~{8 + 5} tokens and growing",
           f"step: median {median_ms(eng.step, device, steps // 4):.3f} ms"]
    graphs = eng.runner.graphs
    if graphs is not None and graphs.graphs:
        graph, _ = graphs.graphs[graphs.bucket_for(1)]
        out.append(f"graph replay alone: median {median_ms(graph.replay, device, 100):.3f} ms")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        eng.step()
    sync(device)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    out += ["", f"cProfile of {steps} steps, by own time:", text.getvalue()]
    from torch.profiler import ProfilerActivity, profile as torch_profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch_profile(activities=activities) as p:
        for _ in range(kernel_steps):
            eng.step()
        sync(device)
    key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    out += [f"torch.profiler of {kernel_steps} steps, by {key}:",
            p.key_averages().table(sort_by=key, row_limit=30)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-dir", required=True, help="config.json + tokenizer of the base")
    ap.add_argument("--out", required=True, help="the report (text)")
    ap.add_argument("--smoke", action="store_true", help="tiny, float32, this CPU")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["CONTINUUM_ATTENTION_BACKEND"] = "triton"
        os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    text = profile(args.base_dir, args.smoke)
    Path(args.out).write_text(text)
    print(text[:3000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
