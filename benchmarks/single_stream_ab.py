"""In-process A/B of engine builds at single-stream decode: two or more `LLMEngine`s, differing
by one load-time setting, built in one process and timed in alternation.

A decode step of the embedded model moves by a few per cent between configurations, while
this project's 2-vCPU guests move by a quarter within minutes: processes run one after the
other compare the host's moods. Engines in one process, one request at a time each, in an
order rotated round by round, meet the same moods (kernel_ab.py does the same for kernel
builds). Each round decodes `--tokens` tokens of one request (greedy, ignore_eos, a 128-token
random prompt) on every engine; the result per engine is the median decode rate (tok/s,
counted after the first token) and the median of the per-round ratios to the first engine.

Settings (`--variant NAME=KEY=VALUE[,KEY=VALUE]`, applied while that engine loads):
  huge_pages   `blocks`: only the quantized blocks go into transparent huge pages (as before
               session 40); `all`: the repacked copies too (`engine.quant.huge_pages.MOVED`)
  fold_head    `0`: the LM head as its own C call after the layers' (as before session 40);
               `1` (default): folded into the layers' call where the model allows
               (`engine.kernels.stack.LayerStack.has_head`)
  kept_inputs  `0`: a decode step's inputs built as new tensors (as before session 41); `1`
               (default): written into the runner's kept buffers (`engine.cpu_step`)
  argmax_in_call `0`: the sampler's argmax over the logits (as before session 41); `1`
               (default): the layers' call's, for all-greedy steps
  embed_in_call `0`: the token ids looked up in Python (as before session 41); `1` (default):
               by the layers' call, first norm included
  dtype        the engine's `--dtype` (default bfloat16)
  quantization the engine's `--quantization` (default: the GGUF's own)

    python benchmarks/single_stream_ab.py --variant before=huge_pages=blocks \\
        --variant after=huge_pages=all --rounds 20

Raises SystemExit for a malformed variant or an unknown key.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):          # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import add_save_result, save_result  # noqa: E402

HUGE_PAGES = {"blocks": ("data",), "all": ("data", "q8_packed", "panel_packed")}
KEYS = ("huge_pages", "fold_head", "kept_inputs", "argmax_in_call", "embed_in_call", "dtype",
        "quantization")
SWITCHES = ("fold_head", "kept_inputs", "argmax_in_call", "embed_in_call")


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    """`NAME=KEY=VALUE[,KEY=VALUE]` (or `NAME=` for the defaults) -> (name, {key: value}).
    Raises SystemExit for a spec without a name, an unknown key or value."""
    name, sep, rest = spec.partition("=")
    if not sep or not name:
        raise SystemExit(f"--variant {spec!r}: want NAME=KEY=VALUE[,KEY=VALUE]")
    settings = dict(item.split("=", 1) for item in rest.split(",") if item)
    for key, value in settings.items():
        if key not in KEYS:
            raise SystemExit(f"--variant {spec!r}: unknown key {key!r} (known: {KEYS})")
        if key == "huge_pages" and value not in HUGE_PAGES:
            raise SystemExit(f"--variant {spec!r}: huge_pages is one of {list(HUGE_PAGES)}")
        if key in SWITCHES and value not in ("0", "1"):
            raise SystemExit(f"--variant {spec!r}: {key} is 0 or 1")
    return name, settings


@contextlib.contextmanager
def applied(settings: dict[str, str]):
    """The load-time hooks of `settings` in force (restored after)."""
    from engine.quant import huge_pages

    moved = huge_pages.MOVED
    huge_pages.MOVED = HUGE_PAGES[settings.get("huge_pages", "all")]
    try:
        yield
    finally:
        huge_pages.MOVED = moved


def build(settings: dict[str, str], kv_gib: float):
    """An `LLMEngine` of the embedded model under `settings`."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    kw = {"quantization": settings["quantization"]} if "quantization" in settings else {}
    with applied(settings):
        eng = LLMEngine(EngineConfig(dtype=settings.get("dtype", "bfloat16"), device="cpu",
                                     kv_cache_memory=kv_gib, max_model_len=2048, **kw))
    stack = eng.model.stack
    if settings.get("fold_head") == "0" and stack is not None:
        eng.model.stack.has_head = False
    if settings.get("embed_in_call") == "0" and stack is not None:
        stack.embeds = False
    if settings.get("kept_inputs") == "0":
        eng.runner.decode_inputs = None
    if settings.get("argmax_in_call") == "0":
        eng.runner.greedy_in_forward = False
    return eng


def main(argv: list[str] | None = None) -> dict:
    """Build every variant, alternate them, print and return per-variant figures."""
    from benchmarks.engine_bench import engine_single_stream, random_prompts
    from engine.heap import freeze_heap
    from engine.kernels.isa import isa_label

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", action="append", required=True)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--kv-cache-memory", type=float, default=0.3, help="GiB per engine")
    add_save_result(ap)
    args = ap.parse_args(argv)
    variants = dict(parse_variant(v) for v in args.variant)
    engines = {name: build(s, args.kv_cache_memory) for name, s in variants.items()}
    freeze_heap()          # as the server's engine core process does once its engine is built
    first = next(iter(engines.values()))
    prompts = random_prompts(4, 128, first.model_config.vocab_size, 0)
    for eng in engines.values():
        engine_single_stream(eng, prompts[0], 16)                 # warm-up
    rates: dict[str, list[float]] = {n: [] for n in engines}
    names = list(engines)
    for r in range(args.rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            rates[n].append(engine_single_stream(engines[n], prompts[r % 4], args.tokens))
    base = rates[names[0]]
    result = {"benchmark": "single_stream_ab", "host": isa_label(), "rounds": args.rounds,
              "tokens": args.tokens, "variants": {
                  n: {"settings": variants[n], "median_tok_s": round(statistics.median(v), 2),
                      "ratio_to_first": round(statistics.median(
                          [a / b for a, b in zip(v, base)]), 4),
                      "rounds_tok_s": [round(a, 2) for a in v]} for n, v in rates.items()}}
    for n, v in result["variants"].items():
        print(f"{n}: median {v['median_tok_s']} tok/s, x{v['ratio_to_first']} of the first")
    save_result(args.save_result, result)
    return result


if __name__ == "__main__":
    main()
