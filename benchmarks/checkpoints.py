"""Random-weight checkpoints built from configs, with the embedded model's tokenizer: how model
families other than the embedded one are tested and benchmarked without downloading weights.

Owns: `CONFIGS` (named config overrides: `tiny` for the tests, `smollm2` = the embedded model's
own config, `llama-3.2-1b` = Llama-3.2-1B's shapes), `build_checkpoint`, and `random_blocks`
(random GGUF blocks for the quantized kernels' tests and timings). In: the embedded
model's directory (`engine.loader.resolve_model(None)`: config.json and tokenizer files). Out: a
directory with config.json, model.safetensors (transformers' `LlamaForCausalLM` initialisation
under a fixed seed) and the tokenizer, loadable by Continuum and transformers alike.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# Overrides of the embedded model's config.json. Llama-3.2-1B's published config: hidden 2048,
# 16 layers, 32 heads over 8 KV heads (head_dim 64), MLP 8192, vocabulary 128256, rope theta
# 500000 with llama3 scaling, tied embeddings. Its vocabulary is larger than the tokenizer's
# (49152): ids past the tokenizer decode to nothing, as padded vocabularies do. Weights are drawn
# with std 0.05 (0.2 for `tiny`), not transformers' 0.02, at which greedy decoding of a random
# model repeats two or three tokens (measured on `smollm2`: 2-3 distinct tokens in 16 at 0.02,
# 16 in 16 at 0.05), which would let a broken attention pass a parity check.
CONFIGS: dict[str, dict] = {
    "tiny": dict(hidden_size=192, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                 max_position_embeddings=1024, initializer_range=0.2),
    "smollm2": dict(initializer_range=0.05),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling={"factor": 32.0, "high_freq_factor": 4.0,
                                       "low_freq_factor": 1.0,
                                       "original_max_position_embeddings": 8192,
                                       "rope_type": "llama3"},
                         tie_word_embeddings=True, initializer_range=0.05),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt")


MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
               "Qwen2ForCausalLM": "qwen2"}


def build_checkpoint(base_dir: str | Path, out_dir: str | Path, name: str, seed: int = 0,
                     architecture: str = "LlamaForCausalLM", **overrides) -> Path:
    """Write a random-weight checkpoint of config `name` (`CONFIGS`, then `overrides`) for
    `architecture` (a key of `MODEL_TYPES`) to `out_dir` (float32 on disk; a no-op when it is
    already there with the same config), with `base_dir`'s tokenizer. Returns `out_dir`.
    Raises KeyError for an unknown name or architecture."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    cfg = json.loads((Path(base_dir) / "config.json").read_text())
    for k in ("quantization_config", "torch_dtype", "dtype", "transformers_version"):
        cfg.pop(k, None)
    cfg.update(CONFIGS[name], **overrides)
    model_type = MODEL_TYPES[architecture]
    cfg.update(architectures=[architecture], model_type=model_type)
    stamp = out / ".built"
    if stamp.exists() and json.loads(stamp.read_text()) == [cfg, seed]:
        return out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items()
                                                 if k != "model_type"})
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    for f in TOKENIZER_FILES:
        if (Path(base_dir) / f).exists():
            shutil.copy(Path(base_dir) / f, out / f)
    stamp.write_text(json.dumps([cfg, seed]))
    return out


def random_blocks(name: str, n: int, k: int, seed: int = 0):
    """An `engine.quant.formats.QuantWeight` `[n, k]` of random blocks of the kernels' GGUF
    type `name` ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"; k a multiple of its block of 32 or
    256 values) drawn from `seed`: random quants, float16 scale fields (d; dmin) set to small
    finite values of either sign, as a quantizer writes them. For the kernel tests and
    kernel_ab's timings. Raises KeyError for another type."""
    import numpy as np
    import torch

    from engine.quant.formats import KERNEL_TYPES, TYPE_IDS, QuantWeight

    qtype = TYPE_IDS[name]
    _, per, nbytes = KERNEL_TYPES[qtype]
    rng = np.random.default_rng(seed)
    nb = k // per
    raw = rng.integers(0, 256, size=(n, nb, nbytes), dtype=np.uint8)

    def f16(lo=0.001, hi=0.02):
        vals = rng.uniform(lo, hi, size=(n, nb)) * rng.choice([-1, 1], size=(n, nb))
        return vals.astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    fields = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [208]}[name]
    for off in fields:
        raw[..., off:off + 2] = f16()
    return QuantWeight(qtype, torch.from_numpy(raw.reshape(n, nb * nbytes)), (n, k))
