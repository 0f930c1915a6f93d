"""In-process A/B of the dense linear paths (engine/linear.py) on this host: which GEMM a dense
checkpoint's `--dtype auto` should take.

Candidates, each over the embedded model's dense linear shapes (30 layers of fused QKV 960 x
576, O 576 x 576, gate / up 3072 x 576, down 576 x 1536, and the tied LM head 49152 x 576;
random weights, timing only):
  onednn-bf16   oneDNN's prepacked bfloat16 matmul (`--dtype bfloat16` on AVX512-BF16 / AMX)
  kernel-bf16   engine/kernels/gemm.c: bfloat16 weights, float32 FMAs (the AVX2 hosts' path)
  onednn-f32    oneDNN's prepacked float32 matmul (`--dtype float32`: twice the weight bytes)
at each of `--rows` rows of x (decode batches and prefill chunks). Rounds alternate the paths
in a rotated order, so the host's swings meet every path alike. Prints per rows and path the
median ms of a pass over all the linears and its ratio to the first path, with the host's ISA.

    python benchmarks/linear_paths_bench.py --rows 1,16,64,256 --rounds 9

Raises SystemExit where the host has no oneDNN bfloat16 matmul or no CPU kernels.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):          # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import add_save_result, save_result  # noqa: E402
from benchmarks.kernel_ab import measure  # noqa: E402  (rounds in a rotated order)

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS, VOCAB, HIDDEN = 30, 49152, 576
PATHS = {"onednn-bf16": ("onednn", "bfloat16"), "kernel-bf16": ("kernel", "bfloat16"),
         "onednn-f32": ("onednn", "float32")}


def build_linears(path: str, dtype_name: str, kernels) -> list:
    """The model's dense linears (module docstring) as (`engine.linear.Linear` on `path`, its
    input width)."""
    import torch

    from engine.linear import Linear

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    shapes = SHAPES * LAYERS + [(VOCAB, HIDDEN)]
    return [(Linear((torch.randn(n, k, generator=g) * 0.02).to(dtype), None, path, kernels), k)
            for n, k in shapes]


def main(argv: list[str] | None = None) -> dict:
    """Run the A/B (flags: --help); print and return {rows: {path: summary}}."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,16,64,256")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--paths", default=",".join(PATHS))
    add_save_result(p)
    args = p.parse_args(argv)
    import torch

    from engine import kernels as K
    from engine.kernels.isa import isa_label

    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        raise SystemExit("no oneDNN bfloat16 matmul on this host")
    kernels = K.load()
    if kernels is None:
        raise SystemExit("no CPU kernels on this host")
    names = args.paths.split(",")
    linears = {n: build_linears(*PATHS[n], kernels) for n in names}
    result = {"host": isa_label(), "threads": torch.get_num_threads(), "rows": {}}
    for m in (int(r) for r in args.rows.split(",")):
        xs = {n: {k: torch.randn(m, k).to(getattr(torch, PATHS[n][1])) for k in (576, 1536)}
              for n in names}

        def runner(n):
            def run():
                for lin, k in linears[n]:
                    lin(xs[n][k])
            return run
        times = measure({n: runner(n) for n in names}, args.rounds)
        first = times[names[0]]
        result["rows"][m] = {n: {"median_ms": round(statistics.median(ts), 3),
                                 "ratio_to_first": round(statistics.median(
                                     [t / f for t, f in zip(ts, first)]), 3)}
                             for n, ts in times.items()}
        print(f"rows {m}: " + ", ".join(f"{n} {r['median_ms']} ms (x{r['ratio_to_first']})"
                                        for n, r in result["rows"][m].items()), flush=True)
    print(f"host: {result['host']}, {result['threads']} threads")
    save_result(args.save_result, result)
    return result


if __name__ == "__main__":
    main()
