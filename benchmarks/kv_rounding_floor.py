"""How far a model's logprobs move when only its K / V are rounded (issue 53's accuracy floor):
transformers in float32 with each layer's post-RoPE K and V rounded in one of the ways a KV cache
could store them, against the same model with K / V exact.

Formats (round to nearest even, then back to float32 before attention):
  bfloat16       8 significant bits a value (the `auto` cache of a bfloat16 model);
  float16        11 significant bits;
  int8/head      Continuum's `--kv-cache-dtype int8`: one float16 scale (max |x| / 127) per
                 (token, KV head), engine/kv_quant.py;
  int8/32        one scale per 32 values (llama.cpp's q8_0 cache; 1.88x the bytes of int8/head
                 at head_dim 64, below issue 53's 1.9x capacity);
  int7/head      int8/head with one bit fewer.
The path tokens are the exact model's greedy continuations of kv_cache_bench.py's prompts; each
path token's logprob is teacher-forced, so the figure is comparable to kv_cache_bench.py's
`mean_abs_logprob_diff` (which runs Continuum's own cache against its `auto` cache).

    python benchmarks/kv_rounding_floor.py [--family llama,qwen2,mistral,embedded] [--tokens 128]

Prints one JSON object (and saves it with `--save-result`); about 2 minutes a family on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):          # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.kv_cache_bench import TOPICS, family_checkpoint  # noqa: E402
from engine.kv_quant import KVQuant  # noqa: E402

INT8 = KVQuant("int8")       # `--kv-cache-dtype int8`'s rows, exactly as the cache stores them


def round_rows(x: torch.Tensor, group: int, bits: int = 8) -> torch.Tensor:
    """`x [..., head_dim]` float32 rounded to signed `bits`-bit integers with one float16 scale
    (max |x| / (2^(bits-1) - 1)) per `group` values, and back to float32."""
    shape, top = x.shape, 2 ** (bits - 1) - 1
    g = x.reshape(*shape[:-1], shape[-1] // group, group)
    s = (g.abs().amax(-1, keepdim=True) / top).to(torch.float16).float()
    q = torch.where(s > 0, (g / s.clamp_min(1e-30)).round().clamp(-top, top), 0.0)
    return (q * s).reshape(shape)


FORMATS = {
    "bfloat16": lambda x: x.bfloat16().float(),
    "float16": lambda x: x.half().float(),
    "int8/head": lambda x: INT8.dequantize(INT8.quantize(x), torch.float32),   # the cache's own
    "int8/32": lambda x: round_rows(x, 32),
    "int7/head": lambda x: round_rows(x, x.shape[-1], 7),
}


def install(model, state: dict) -> None:
    """Route `model`'s attention through SDPA with K / V passed through `state["round"]` (None:
    exact)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kw):
        fn = state["round"]
        if fn is not None:
            key, value = fn(key.float()).to(key.dtype), fn(value.float()).to(value.dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("continuum_kv_rounding", attention)
    model.config._attn_implementation = "continuum_kv_rounding"
    for layer in model.model.layers:
        layer.self_attn.config._attn_implementation = "continuum_kv_rounding"


def family(name: str, tokens: int, prompts: int) -> dict:
    """Mean and max |logprob difference| of each format over `prompts` x `tokens` path tokens
    of family `name` ("embedded": the embedded GGUF dequantized to float32, as engine.loader
    unpacks it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.loader import resolve_model
    base = resolve_model(None)
    path = family_checkpoint(name) or str(base)
    tok = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    state: dict = {"round": None}
    install(model, state)
    ids = [tok.encode(t) for t in TOPICS[:prompts]]
    with torch.inference_mode():
        paths = [model.generate(torch.tensor([p]), max_new_tokens=tokens, min_new_tokens=tokens,
                                do_sample=False)[0].tolist() for p in ids]

        def logprobs() -> torch.Tensor:
            out = []
            for p, full in zip(ids, paths):
                lp = model(torch.tensor([full])).logits[0].float().log_softmax(-1)
                out.append(lp[len(p) - 1:-1].gather(1, torch.tensor(full[len(p):])[:, None])[:, 0])
            return torch.cat(out)

        ref = logprobs()
        result = {}
        for fmt, fn in FORMATS.items():
            state["round"] = fn
            d = (logprobs() - ref).abs()
            result[fmt] = {"mean_abs_logprob_diff": round(d.mean().item(), 4),
                           "max_abs_logprob_diff": round(d.max().item(), 3)}
            print(json.dumps({name: {fmt: result[fmt]}}), flush=True)
    return {"tokens": len(ref), **result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="llama,qwen2,mistral,embedded")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--save-result", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    result = {name: family(name, args.tokens, args.prompts) for name in args.family.split(",")}
    print(json.dumps(result))
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
