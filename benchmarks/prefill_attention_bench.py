"""Prefill attention alone: one sequence's `--tokens`-token chunk attending causally to itself
through the paged cache (`CpuKernels.paged_decode`, which hands prefill runs to the AMX tiles on
an AMX host), the embedded model's heads (9 query heads over 3 KV heads, head_dim 64, blocks of
16, scattered), `--layers` layers of random bfloat16 K / V, best of `--repeats`.

Prints one JSON line: milliseconds a layer and the rate of the causal products' floating-point
operations (4 * heads * head_dim * tokens^2 / 2 a layer). An A/B of two commits runs it in each
checkout, alternating (the host's noise moves whole runs).

    python benchmarks/prefill_attention_bench.py [--tokens 2048] [--layers 8] [--repeats 6]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.amx_bench import best  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    import torch

    from engine.kernels import load
    from engine.kernels.isa import isa_label
    lib = load()
    if lib is None:
        print(json.dumps({"skipped": "no CPU kernels (no C compiler?)"}))
        return
    torch.manual_seed(0)
    heads, kv_heads, d, bs, t = 9, 3, 64, 16, args.tokens
    nb = (t + bs - 1) // bs + 9
    sets = []
    for _ in range(args.layers):
        table = torch.randperm(nb)[:(t + bs - 1) // bs].int().view(1, -1).expand(t, -1)
        sets.append((torch.randn(t, heads, d).bfloat16(),
                     torch.randn(kv_heads, nb, bs, d).bfloat16(),
                     torch.randn(kv_heads, nb, bs, d).bfloat16(), table.contiguous(),
                     torch.arange(1, t + 1, dtype=torch.int32),
                     torch.empty(t, heads, d).bfloat16()))
    run = lambda: [lib.paged_decode(*s[:5], d ** -0.5, s[5]) for s in sets]   # noqa: E731
    run()
    seconds = best(run, args.repeats)
    flops = 4 * heads * d * t * t / 2 * args.layers
    print(json.dumps({"host_isa": isa_label(), "tokens": t, "threads": torch.get_num_threads(),
                      "ms_per_layer": round(seconds / args.layers * 1e3, 2),
                      "tflop_s": round(flops / seconds / 1e12, 3)}))


if __name__ == "__main__":
    main()
