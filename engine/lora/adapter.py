"""A LoRA adapter read from a PEFT directory, checked against the base model.

Owns: the reading of `adapter_config.json` + `adapter_model.safetensors` (PEFT's format), the
checks (rank, target modules, shapes, unsupported variants), and each module's scaling folded
into its B matrix. In: the directory and the base model's `ModelConfig`. Out: a `LoraAdapter`
holding, per (layer, module), float32 `A [r, in]` and `B·scaling [out, r]` on the CPU.

Scaling is PEFT's (`peft.tuners.lora.layer.LoraLayer.update_layer`): `lora_alpha / r`, or
`lora_alpha / sqrt(r)` with `use_rslora`, where `r` and `lora_alpha` may be overridden per module
by `rank_pattern` / `alpha_pattern` (a key matches a module whose name ends with it). The
delta of a module is `x @ A.T @ B.T * scaling` (Hu et al., "LoRA", arXiv:2106.09685, eq. 3).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from engine.lora.errors import LoraError

# The projections an adapter may target, with their (in, out) sizes from the model config.
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?"
                  r"\.weight$")




@dataclass
class LoraAdapter:
    """One adapter: `name`, `path`, its largest rank, and `weights[(layer, module)] = (A, B)`
    with `A [r, in]` and `B [out, r]` float32, B already multiplied by the module's scaling."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def nbytes(self) -> int:
        """Host memory held by the weights (bytes)."""
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(in, out) features of each targetable projection of a `ModelConfig` (a TP rank's
    config gives that rank's shard)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def _pattern_value(patterns: dict, module_name: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key the module's name ends with."""
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module_name):
            return value
    return default


def _read_config(name: str, path: Path) -> dict:
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise LoraError(f"LoRA adapter {name!r}: {cfg_file} does not exist")
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise LoraError(f"LoRA adapter {name!r}: adapter_config.json is not JSON: {e}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights")):
        if cfg.get(key):
            raise LoraError(f"LoRA adapter {name!r}: {why} is not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("modules_to_save"):
        raise LoraError(f"LoRA adapter {name!r}: only LoRA weights are supported (bias "
                        f"{cfg.get('bias')!r}, modules_to_save {cfg.get('modules_to_save')!r})")
    return cfg


def load_adapter(name: str, path: str | Path, model_cfg, max_rank: int) -> LoraAdapter:
    """Read and check the PEFT adapter at `path` for a base model of `model_cfg`.

    Raises: LoraError naming the adapter — a missing file, a rank above `max_rank`, a module
    that is not one of MODULES (or a layer the model lacks), a shape that does not fit the
    model, an A without its B, or an unsupported PEFT variant."""
    path = Path(path)
    cfg = _read_config(name, path)
    st_file = path / "adapter_model.safetensors"
    if not st_file.is_file():
        raise LoraError(f"LoRA adapter {name!r}: {st_file} does not exist")
    shapes = module_shapes(model_cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(st_file), framework="pt") as f:
        for key in f.keys():
            m = _KEY.fullmatch(key)
            if m is None or m.group(2) not in MODULES:
                raise LoraError(f"LoRA adapter {name!r}: {key} targets a module LoRA is not "
                                f"supported on (supported: {', '.join(MODULES)})")
            layer, module = int(m.group(1)), m.group(2)
            if layer >= model_cfg.num_layers:
                raise LoraError(f"LoRA adapter {name!r}: {key} names layer {layer}; the model "
                                f"has {model_cfg.num_layers}")
            pairs.setdefault((layer, module), {})[m.group(3)] = f.get_tensor(key)
    if not pairs:
        raise LoraError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    weights, top_rank = {}, 0
    for (layer, module), ab in sorted(pairs.items()):
        where = f"layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise LoraError(f"LoRA adapter {name!r}: {where} has lora_{''.join(ab)} only")
        a, b = ab["A"].float(), ab["B"].float()
        n_in, n_out = shapes[module]
        r = a.shape[0]
        if a.shape != (r, n_in) or b.shape != (n_out, r):
            raise LoraError(f"LoRA adapter {name!r}: {where} has A {tuple(a.shape)} and B "
                            f"{tuple(b.shape)}; the model needs A [r, {n_in}] and B [{n_out}, r]")
        if r > max_rank:
            raise LoraError(f"LoRA adapter {name!r}: rank {r} at {where} is above "
                            f"--max-lora-rank {max_rank}")
        full = f"model.layers.{layer}.{'self_attn' if module[0] in 'qkvo' else 'mlp'}.{module}"
        alpha = _pattern_value(cfg.get("alpha_pattern"), full, cfg.get("lora_alpha", 8))
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        weights[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
        top_rank = max(top_rank, r)
    return LoraAdapter(name, str(path), top_rank, weights)
