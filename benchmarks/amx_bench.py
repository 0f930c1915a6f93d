"""The quantized linears on AMX tiles against the AVX-512 nests and oneDNN's dense bfloat16
(issue 51): the row count from which the tiles win, measured, not guessed.

For each row count M in `--rows`: the embedded model's 120 quantized linears (QKV, O, gate / up,
down of the 30 layers, as the model calls them) and its tied LM head, bfloat16 x, one C call
each (arguments made beforehand, as the layer stack calls them), best of `--repeats`:
  amx      quant_amx.c's tile nest (`quant_amx_config(1)`: every M)
  avx512   quant.c's vector nests (the nest off)
  dense    the same weights dequantized to bfloat16, `torch.nn.functional.linear` (oneDNN,
           which runs on AMX tiles on this host) — what `--quantization none --dtype bfloat16`
           computes
Prints one JSON line per M (milliseconds and the amx / avx512 and amx / dense time ratios),
then `min_rows`: the fewest rows from which the tiles are faster at every M measured, the
value `engine/kernels/__init__.py:AMX_MIN_ROWS` takes. Then, per row count of `--lora-rows`,
the multi-LoRA deltas of a step (`lora_sgmv`, lora.c) for the model's four fused projections
x 30 layers, rank 16 on every module (R = 48 / 16 / 32 / 16), 16 rows to each of 4 slots'
adapters in turn (full tiles): on AMX tiles (lora_amx.c) against vdpbf16ps. Skips (exit
0, one line) on a host or build without AMX.

    python benchmarks/amx_bench.py --rows 1,2,3,4,5,6,8,12,16,32,64,128,512
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):          # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def model_linears():
    """The embedded GGUF's linears as the model fuses them, and its LM head (QuantWeight)."""
    from engine.loader import embedded_gguf_path
    from engine.quant.formats import QuantWeight
    from engine.quant.gguf_weights import read_gguf_weights

    weights, _, _ = read_gguf_weights(embedded_gguf_path(), 9, 3)
    linears = []
    for i in range(30):
        p = f"model.layers.{i}."
        for names in (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                      ["self_attn.o_proj"], ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]):
            linears.append(QuantWeight.cat([weights[p + n + ".weight"] for n in names]))
    return linears + [weights["model.embed_tokens.weight"]]


def best(fn, repeats: int) -> float:
    """The fastest of `repeats` runs of fn, seconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(lib, linears, dense, m: int, repeats: int) -> dict:
    """Milliseconds of the 121 products at m rows through each path."""
    import torch

    threads = torch.get_num_threads()
    xs = {w.shape[1]: torch.randn(m, w.shape[1]).bfloat16() for w in linears}
    ys = {w.shape[0]: torch.empty(m, w.shape[0], dtype=torch.bfloat16) for w in linears}
    fn = lib._fn["quant_linear"]
    calls = [(*w.kernel_args, None, xs[w.shape[1]].data_ptr(), w.shape[1], 1,
              ys[w.shape[0]].data_ptr(), w.shape[0], 0, m, w.shape[0], w.shape[1], threads)
             for w in linears]
    out = {"rows": m}
    for name, rows in (("amx", 1), ("avx512", 0)):
        lib._fn["quant_amx_config"](rows)
        for a in calls[:8]:                                      # warm the scratch and caches
            fn(*a)
        out[f"{name}_ms"] = round(best(lambda: [fn(*a) for a in calls], repeats) * 1e3, 3)
    lin = torch.nn.functional.linear
    pairs = [(xs[w.shape[1]], d) for w, d in zip(linears, dense)]
    out["dense_ms"] = round(best(lambda: [lin(x, d) for x, d in pairs], repeats) * 1e3, 3)
    out["amx_over_avx512"] = round(out["amx_ms"] / out["avx512_ms"], 3)
    out["amx_over_dense"] = round(out["amx_ms"] / out["dense_ms"], 3)
    return out


def measure_lora(lib, m: int, repeats: int) -> dict:
    """Milliseconds of one step's LoRA deltas (120 projections) at m rows, tiles and vectors."""
    import torch

    g = torch.Generator().manual_seed(0)
    calls = []
    for n_in, outs in ((576, (576, 192, 192)), (576, (576,)), (576, (1536, 1536)),
                       (1536, (576,))):
        rank, slots = 16, 4
        r = rank * len(outs)
        bands, c = [], 0
        for i, o in enumerate(outs):
            bands.append([i * rank, (i + 1) * rank, c, c + o])
            c += o
        a = (torch.randn(slots, r, n_in, generator=g) * 0.05).bfloat16()
        bt = (torch.randn(slots, r, c, generator=g) * 0.05).bfloat16()
        held = (torch.ones(slots, dtype=torch.int32), a, bt,
                torch.tensor(bands, dtype=torch.int32))     # bound by address: kept alive
        fn = lib.lora_sgmv_bound(*held)
        x = torch.randn(m, n_in, generator=g).bfloat16()
        out = torch.zeros(m, c, dtype=torch.bfloat16)
        calls.append((fn, x, out, held))
    row_slot = ((torch.arange(m) // 16) % 4).int()       # 16 rows a slot: full tiles
    threads = torch.get_num_threads()
    out = {"lora_rows": m}
    for name, rows in (("amx", 1), ("avx512", 0)):
        lib._fn["quant_amx_config"](rows)
        run = lambda: [fn(x, o, row_slot.data_ptr(), threads)           # noqa: E731
                       for _ in range(30) for fn, x, o, _ in calls]
        run()
        out[f"{name}_ms"] = round(best(run, repeats) * 1e3, 3)
    out["amx_over_avx512"] = round(out["amx_ms"] / out["avx512_ms"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,12,16,32,64,128,512")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--lora-rows", default="16,64")
    args = ap.parse_args()
    import torch

    from engine import kernels
    from engine.kernels.isa import isa_label
    lib = kernels.load()
    if lib is None or lib._fn["quant_amx_config"](0) != 0:
        print("amx_bench: skipped, this build has no AMX tile nest (host isa "
              f"{isa_label()})")
        return
    before = lib._fn["quant_amx_min_rows"]()
    linears = model_linears()
    dense = [w.dequantize().bfloat16() for w in linears]
    print(json.dumps({"host_isa": isa_label(), "threads": torch.get_num_threads()}))
    results = []
    for m in (int(r) for r in args.rows.split(",")):
        results.append(measure(lib, linears, dense, m, args.repeats))
        print(json.dumps(results[-1]), flush=True)
    wins = [r["rows"] for r in results if r["amx_over_avx512"] < 1.0]
    min_rows = next((r["rows"] for r in results if all(
        x["amx_over_avx512"] < 1.0 for x in results if x["rows"] >= r["rows"])), None)
    print(json.dumps({"amx_faster_at": wins, "min_rows": min_rows}))
    for m in (int(r) for r in args.lora_rows.split(",") if r):
        print(json.dumps(measure_lora(lib, m, args.repeats)), flush=True)
    lib._fn["quant_amx_config"](before)


if __name__ == "__main__":
    main()
