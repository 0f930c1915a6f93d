"""In-process A/B of kernel builds: the CPU kernels (engine/kernels) built with different `-D`
flags, loaded into one process and timed in alternation on one workload.

On the 2-vCPU AMX VMs this project runs on, the host's speed moves by up to 3x within seconds
(the tile rate flips between ~9 and ~30 ns a `tdpbf16ps`, docs/cpu.md "Session 28"), so two
processes timed one after the other compare the host's moods as much as the code; builds called
in turn inside one process meet the same moods. This is the A/B that separated the AMX nest's
packing changes (session 28) where pairs of processes could not.

Workloads (the same arguments and buffers for every build):
  linears    the embedded model's quantized products at `--rows` rows of bfloat16 x through
             `quant_linear` (QKV, O, gate / up, down of the first `--layers` layers, as the
             model fuses them, and with `--lm-head` its tied LM head): whichever nest the
             build picks on this host (AMX tiles from AMX_MIN_ROWS rows, else the vector nests)
  attention  `paged_decode` of `--batch` sequences of 200-290 tokens over `--layers` layers'
             bfloat16 caches (9 query / 3 KV heads of 64, blocks of 16, block tables
             interleaved as the scheduler hands blocks out), one step's reads
Each round runs every build once, in an order rotated round by round. Prints and returns, per
build: the median and best milliseconds of a round, the median of the per-round ratios to the
first build (time / first's: below 1 is faster), and whether its outputs equal the first
build's bit for bit.

    python benchmarks/kernel_ab.py --variant base= --variant pf4k="-DPF=4096" \\
        --workload linears --rows 64 --layers 30 --rounds 20

A variant is NAME=FLAGS (FLAGS split like a shell's words, added to `cflags()`; empty: the
engine's own build). A word `pairs=0` or `pairs=1` is no compiler flag but the variant's
`CpuKernels.vector_pairs` (the quantized linears' and prefill attention's vdpbf16ps switch, set
per host at load): every variant loads its own copy of its library, so two variants of one
build keep separate switches:

    python benchmarks/kernel_ab.py --variant pairs="pairs=1" --variant f32="pairs=0" \
        --workload linears --qtype Q4_K --rows 16 --layers 2

`--qtype` (linears): random blocks of that type in a 1B-class model's shapes (hidden 2048,
intermediate 8192, 32 / 8 heads of 64: QKV 3072 x 2048, O, gate / up 16384 x 2048, down 2048 x
8192) instead of the embedded model's weights (whose K of 576 K-quants cannot hold).
Raises SystemExit for a malformed variant, CalledProcessError where a build does not compile.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):          # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import add_save_result, save_result  # noqa: E402


def parse_variants(specs: list[str]) -> dict[str, list[str]]:
    """`NAME=FLAGS` strings -> {name: extra compiler flags and `pairs=` words}, in order.
    Raises ValueError for a spec without `=`, an empty or repeated name."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not name or name in out:
            raise ValueError(f"--variant {spec!r}: want NAME=FLAGS with a new, non-empty NAME")
        out[name] = shlex.split(flags)
    return out


def load_builds(variants: dict[str, list[str]], out_dir: Path):
    """{name: CpuKernels} for each variant, compiled (or found) with `cflags()` + its compiler
    flags (none: the engine's own cached build), each loaded from its own copy in `out_dir`
    (one dlopen handle per variant name and build; a copy is never overwritten, as rewriting
    a loaded library crashes the process) and given its `pairs=` word's vector_pairs."""
    from engine import kernels as K
    from engine.halt_poll import find_compiler

    builds = {}
    for name, words in variants.items():
        extra = [w for w in words if not w.startswith("pairs=")]
        path = K.build(find_compiler(), K.cflags() + extra, out_dir=out_dir if extra else None)
        copy = out_dir / "loaded" / f"{name}-{path.stem}.so"   # never rewritten once loaded
        if not copy.exists():
            copy.parent.mkdir(parents=True, exist_ok=True)
            tmp = copy.with_suffix(".tmp")
            shutil.copyfile(path, tmp)
            tmp.replace(copy)
        kernels = K.CpuKernels(ctypes.CDLL(str(copy.resolve())))
        for w in words:
            if w.startswith("pairs="):
                kernels.set_vector_pairs(w == "pairs=1")
        builds[name] = kernels
    return builds


def block_linears(qtype: str, layers: int):
    """A 1B-class model's fused linears of `layers` layers (module docstring), random blocks."""
    from benchmarks.checkpoints import random_blocks

    shapes = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)] * layers
    return [random_blocks(qtype, n, k, seed=i) for i, (n, k) in enumerate(shapes)]


def linears_workload(args):
    """(setup, outputs): setup(kernels) -> a round's closure; outputs of the last round."""
    import torch

    from benchmarks.amx_bench import model_linears

    if args.qtype:
        ws = block_linears(args.qtype, args.layers)
    else:
        ws = model_linears()
        ws = ws[:4 * args.layers] + (ws[-1:] if args.lm_head else [])
    if args.panel_pack or args.int8_x:   # the copies a bfloat16 model's weights get
        from engine import kernels as K
        packer = K.load()
        for w in ws:
            if args.panel_pack:          # read where pairs=1
                packer.panel_pack(w)
            if args.int8_x:              # read by the int8-activation nest
                packer.q8_pack(w)
    if args.huge_pages:              # where the engine keeps them (engine/quant/huge_pages.py)
        from engine.quant.huge_pages import to_huge_pages
        to_huge_pages(ws)
    xs = {w.shape[1]: torch.randn(args.rows, w.shape[1], generator=torch.Generator().manual_seed(0))
          .bfloat16() for w in ws}
    outs: dict = {}

    def setup(name, kernels):
        def run():
            outs[name] = [kernels.quant_linear(xs[w.shape[1]], w, int8_x=args.int8_x)
                          for w in ws]
        return run
    return setup, outs


def attention_workload(args):
    """As linears_workload, for paged decode attention over DRAM-sized caches."""
    import torch

    bs, kvh, heads, d = 16, 3, 9, 64
    rng = random.Random(0)
    ctx = [rng.randint(200, 290) for _ in range(args.batch)]
    blocks = [(c + bs - 1) // bs for c in ctx]
    tables = torch.zeros(args.batch, max(blocks), dtype=torch.int32)
    nxt = 0
    for j in range(max(blocks)):          # block j of every sequence, then j + 1: interleaved
        for b in range(args.batch):
            if j < blocks[b]:
                tables[b, j] = nxt
                nxt += 1
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, kvh, nxt, bs, d, generator=g).bfloat16() for _ in range(args.layers)]
    q = torch.randn(args.batch, heads, d, generator=g).bfloat16()
    lens = torch.tensor(ctx, dtype=torch.int32)
    outs: dict = {}

    def setup(name, kernels):
        out = torch.empty_like(q)

        def run():
            for c in caches:
                kernels.paged_decode(q, c[0], c[1], tables, lens, d ** -0.5, out)
            outs[name] = [out]
        return run
    return setup, outs


WORKLOADS = {"linears": linears_workload, "attention": attention_workload}


def measure(runs: dict, rounds: int) -> dict[str, list[float]]:
    """{name: [ms of each round]}: every run once a round, the order rotated by one each
    round (after one untimed warm-up round)."""
    names = list(runs)
    for n in names:
        runs[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            t0 = time.perf_counter()
            runs[n]()
            times[n].append((time.perf_counter() - t0) * 1e3)
    return times


def summarize(times: dict[str, list[float]], outs: dict) -> dict:
    """Per build: median / best ms, the median per-round ratio to the first build, and
    whether its outputs equal the first's."""
    import torch

    first = next(iter(times))
    result = {}
    for n, ts in times.items():
        ratios = [t / f for t, f in zip(ts, times[first])]
        result[n] = {"median_ms": round(statistics.median(ts), 3), "best_ms": round(min(ts), 3),
                     "ratio_to_first": round(statistics.median(ratios), 4),
                     "rounds_ms": [round(t, 3) for t in ts],
                     "equal_to_first": all(torch.equal(a, b)
                                           for a, b in zip(outs[n], outs[first]))}
    return result


def main(argv: list[str] | None = None) -> dict:
    """Run the A/B (flags: --help); print and return the per-build summary."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", action="append", required=True, metavar="NAME=FLAGS")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="linears")
    p.add_argument("--rows", type=int, default=64, help="linears: rows of x")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--lm-head", action="store_true", help="linears: add the tied LM head")
    p.add_argument("--panel-pack", action="store_true",
                   help="linears: give the weights the bfloat16 panels' repacked copy, as a "
                        "bfloat16 model's get them (Q4_0 / Q4_1 / Q8_0)")
    p.add_argument("--huge-pages", action="store_true",
                   help="linears: the weights and their repacked copies in transparent huge "
                        "pages, as the engine holds them")
    p.add_argument("--int8-x", action="store_true",
                   help="linears: x quantized to int8 over the weights' q8_pack copy, the "
                        "default of an AVX2 host and of VNNI hosts without bfloat16 units")
    p.add_argument("--qtype", choices=["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"],
                   help="linears: random blocks of this type in 1B-class shapes")
    p.add_argument("--batch", type=int, default=64, help="attention: sequences")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--build-dir", type=Path, default=Path("build/kernel_ab"),
                   help="where the flagged builds go (cached by sources and flags)")
    add_save_result(p)
    args = p.parse_args(argv)
    try:
        variants = parse_variants(args.variant)
    except ValueError as e:
        p.error(str(e))
    from engine.kernels.isa import isa_label

    builds = load_builds(variants, args.build_dir)
    setup, outs = WORKLOADS[args.workload](args)
    times = measure({n: setup(n, k) for n, k in builds.items()}, args.rounds)
    result = {"host": isa_label(), "workload": args.workload,
              "builds": {n: variants[n] for n in builds}, "results": summarize(times, outs)}
    save_result(args.save_result, result)
    for n, r in result["results"].items():
        print(f"{n}: median {r['median_ms']} ms, best {r['best_ms']} ms, "
              f"x{r['ratio_to_first']} of the first, equal: {r['equal_to_first']}")
    return result


if __name__ == "__main__":
    main()
