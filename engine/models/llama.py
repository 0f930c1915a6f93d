"""Llama-family decoder (Llama 2/3, SmolLM/SmolLM2, Mistral, Qwen2) over a flat token batch.

Owns: the weights (loaded from HF-format safetensors, names as in transformers' `modeling_llama`
/ `modeling_qwen2`), RMSNorm, rotary embeddings (default, linear and llama3 scaling), the fused
QKV and gate/up projections, and the LM head. Attention is `engine.attention.paged_attention`.

In: `input_ids [T] int64`, `positions [T] int64`, the step's `AttentionMetadata`, the KV cache
`[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`. Out: hidden states
`[T, hidden]`; `compute_logits` turns selected rows into float32 logits `[N, vocab]`.

The math follows transformers' implementation (RMSNorm in float32, rotate-half RoPE with cos/sin
cast to the model dtype), so float32 greedy outputs match `transformers.generate`.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from engine.attention import AttentionMetadata, paged_attention
from engine.distributed.parallel import TensorParallelGroup, shard_weights, vocab_shard
from engine.linear import Linear
from engine.device import Device
from engine.kernels.stack import KEPT_ROWS, LayerStack
from engine.loader import ModelLoadError, check_architecture
from engine.quant import Quantization
from engine.quant.formats import QuantWeight, quantize_int8

logger = logging.getLogger("continuum.model")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture numbers read from `config.json`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    layer_windows: tuple[int, ...] = ()   # per layer: its sliding window in tokens, 0 = full

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        """Parse `model_dir/config.json`. Raises UnsupportedArchitectureError, ModelLoadError."""
        try:
            cfg = json.loads((Path(model_dir) / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{model_dir}/config.json: {e}") from e
        arch = check_architecture(cfg, str(model_dir))
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ModelLoadError(f"{model_dir}: rope type {rope_type!r} is not supported")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window, layer_windows = _sliding_windows(cfg, arch)
        return cls(
            architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta,
            rope_scaling=rope if rope_type != "default" else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            sliding_window=window, eos_token_ids=eos_ids, bos_token_id=cfg.get("bos_token_id"),
            layer_windows=layer_windows)

    def kv_bytes_per_token(self, dtype: torch.dtype, kv=None) -> int:
        """Bytes of K and V per token over all layers: of `dtype`, or the 8-bit rows of `kv`
        (`engine.kv_quant.KVQuant`)."""
        if kv is not None:
            return 2 * self.num_layers * self.num_kv_heads * kv.row_bytes(self.head_dim)
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


def _sliding_windows(cfg: dict, arch: str) -> tuple[int | None, tuple[int, ...]]:
    """(the model's sliding window or None, each layer's window, 0 = full attention), as
    transformers reads them: Mistral windows every layer (`sliding_window`, 4096 when the key is
    absent, null = none); Qwen2 only with `use_sliding_window` (default false; window default
    4096), on the layers `layer_types` marks "sliding_attention" (default: those from
    `max_window_layers`, 28, on); Llama has none. Raises ModelLoadError for a `layer_types` of
    the wrong length."""
    layers = cfg["num_hidden_layers"]
    if arch == "MistralForCausalLM":
        window = cfg.get("sliding_window", 4096)
        return window, (window or 0,) * layers
    window = cfg.get("sliding_window", 4096)
    if arch != "Qwen2ForCausalLM" or not cfg.get("use_sliding_window", False) or not window:
        return None, (0,) * layers
    types = cfg.get("layer_types") or ["sliding_attention" if i >= cfg.get("max_window_layers", 28)
                                       else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ModelLoadError(f"config.json: layer_types has {len(types)} entries for {layers} "
                             "layers")
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return (window if any(windows) else None), windows


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` float32 (RoFormer; llama3 scaling per Meta's
    Llama 3.1 reference, as in transformers' `_compute_llama3_parameters`)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv = torch.where(medium, smoothed, scaled)
    return inv


class LlamaForCausalLM:
    """The decoder with its weights on `device` in `dtype`; see the module docstring. Linear
    layers run on `linear_path` (`engine.linear`; "kernel" needs `kernels`).

    With `tp` (a `TensorParallelGroup`) the model is that rank's shard
    (`engine.distributed.parallel.shard_weights`): `cfg` becomes the rank's (its heads, KV heads
    and MLP width; the KV cache it writes holds its KV heads only), the forward pass all-reduces
    after the embedding and each row-parallel projection, and `compute_logits` gathers the
    vocabulary, so every rank returns the same full logits."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, max_positions: int, linear_path: str = "torch",
                 kernels=None, tp: TensorParallelGroup | None = None,
                 int8_activations: bool = False) -> None:
        self.tp, self.vocab_start = tp, 0
        if tp is not None:
            cfg, weights = shard_weights(cfg, weights, tp.rank, tp.world_size)
            self.vocab_start = vocab_shard(cfg.vocab_size, tp.rank, tp.world_size)[0]
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.linear_path, self.kernels = linear_path, kernels
        lin = partial(Linear, path=linear_path, kernels=kernels, int8_x=int8_activations,
                      bf16_x=dtype == torch.bfloat16 and device.type == "cpu")

        def get(name: str):
            if name not in weights:
                raise ModelLoadError(f"weight {name!r} is missing from the checkpoint")
            return weights[name]

        def w(name: str) -> torch.Tensor:        # a float tensor (norms, biases)
            t = get(name)
            t = t.dequantize() if isinstance(t, QuantWeight) else t
            return t.to(device=device, dtype=dtype)

        served = set()                                  # block types kept quantized

        def proj(names: list[str], bias: torch.Tensor | None = None) -> Linear:
            """One linear over the stacked weights `names`: quantized where all of them are."""
            parts = [get(n) for n in names]
            if all(isinstance(p, QuantWeight) for p in parts):
                served.update(p.type_name for p in parts)
                return lin(parts if len(parts) > 1 else parts[0], bias)
            return lin(torch.cat([w(n) for n in names]), bias)

        embed = get("model.embed_tokens.weight")
        if isinstance(embed, QuantWeight):
            served.add(embed.type_name)
            self.embed = embed
        else:
            self.embed = w("model.embed_tokens.weight")
        self.lm_head = (lin(self.embed) if cfg.tie_word_embeddings else proj(["lm_head.weight"]))
        self.norm = w("model.norm.weight")
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            qkv_b = (torch.cat([w(attn + f"{x}_proj.bias") for x in "qkv"])
                     if cfg.qkv_bias else None)
            self.layers.append((
                w(p + "input_layernorm.weight"),
                proj([attn + f"{x}_proj.weight" for x in "qkv"], qkv_b),
                proj([attn + "o_proj.weight"]),
                w(p + "post_attention_layernorm.weight"),
                proj([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                proj([p + "mlp.down_proj.weight"]),
            ))
        self.quant_types = sorted(served)                       # e.g. ["Q4_1", "Q8_0"]
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(cfg))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)     # [max_positions, head_dim]
        sin = emb.sin()
        sin[:, :cfg.head_dim // 2] *= -1                         # see _rotate
        self.sin = sin.to(device=device, dtype=dtype)
        self.scale = cfg.head_dim ** -0.5
        # the norm that follows each layer: the next layer's input norm, then the final one
        self._next_norms = [layer[0] for layer in self.layers[1:]] + [self.norm]
        self._windows = cfg.layer_windows or (0,) * cfg.num_layers   # each layer's, 0 = full
        self._caches_for: torch.Tensor | None = None
        self.fused = None                                       # see set_kernels
        self.stack = None               # engine.kernels.stack.LayerStack, see set_kernels
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    def quant_weights(self) -> list[QuantWeight]:
        """Every `QuantWeight` the forward pass reads (the quantized projections' blocks, the
        embedding's), each once."""
        found = {id(self.embed): self.embed} if isinstance(self.embed, QuantWeight) else {}
        for lin in [self.lm_head] + [x for layer in self.layers for x in layer]:
            for part in getattr(lin, "parts", None) or []:
                if isinstance(part, QuantWeight):
                    found[id(part)] = part
        return list(found.values())

    def enable_lora(self, slots) -> None:
        """Put the LoRA deltas of `slots` (`engine.lora.slots.LoraSlots`) after every
        projection of every layer; rows of the base model are unchanged."""
        from engine.lora.slots import LoraLinear
        self.stack = None                                   # the C loop has no LoRA deltas
        self.layers = [(ln1, LoraLinear(qkv, slots, i, "qkv"), LoraLinear(o, slots, i, "o"), ln2,
                        LoraLinear(gate_up, slots, i, "gate_up"),
                        LoraLinear(down, slots, i, "down"))
                       for i, (ln1, qkv, o, ln2, gate_up, down) in enumerate(self.layers)]

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm as one torch op. In float32 it is bit-identical to HF's LlamaRMSNorm (torch
        decomposes it into the same pow / mean / rsqrt / mul); in bfloat16 it scales before
        rounding, where HF rounds twice."""
        return F.rms_norm(x, (x.shape[-1],), weight, eps=self.cfg.rms_norm_eps)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE, `x * cos + rotate_half(x) * sin`, with `rotate_half(x) * sin`
        computed as `roll(x, D/2) * sin_signed` (sin with its first half negated): the same
        products, exactly, in one op fewer."""
        return x * cos + x.roll(self.cfg.head_dim // 2, -1) * sin

    def layer_caches(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (K, V) views `[kv_heads, blocks, block_size, head_dim]` of `kv_cache`, made
        once per cache tensor (the per-op forward and `engine.kernels.stack` read them)."""
        if self._caches_for is not kv_cache:
            self._caches = [(kv_cache[i, 0], kv_cache[i, 1]) for i in range(self.cfg.num_layers)]
            self._caches_for = kv_cache
        return self._caches

    def set_kernels(self, kernels) -> None:
        """Use `kernels` (`engine.kernels.CpuKernels`, on CUDA `engine.accel.triton_fused.
        TritonFused`, or None) for the fused residual-add + RMSNorm, SiLU-and-mul and RoPE —
        in bfloat16 / float16, and in float32 where the linears are quantized (the GGUF
        default: its products already sum in the kernels' order, and at one decode row the
        ~120 small torch ops these replace took a third of the step). float32 over dense
        weights keeps torch's ops, bit-identical to transformers: the exact reference the
        correctness tests compare token by token."""
        use = self.dtype in (torch.bfloat16, torch.float16) or (
            self.dtype == torch.float32 and bool(self.quant_types))
        self.fused = kernels if kernels is not None and use else None
        self.stack = LayerStack.build(self, self.fused)    # every layer in one C call

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """Hidden states `[T, hidden]` after the final norm (a tensor of the caller's); writes
        the step's K/V."""
        cfg, fused, eps = self.cfg, self.fused, self.cfg.rms_norm_eps
        n = input_ids.shape[0]
        heads = cfg.num_heads + cfg.num_kv_heads
        if self.stack is not None and getattr(meta, "kernels", None) is not None:
            h, _ = self.stack.run(input_ids, positions, meta, kv_cache)
            return h.clone() if n <= KEPT_ROWS else h       # not the stack's kept scratch
        if fused is None:
            cos = self.cos[positions].unsqueeze(1)          # [T, 1, D]
            sin = self.sin[positions].unsqueeze(1)
        x = self._embed(input_ids)                          # the residual stream (a copy)
        h = fused.rms_norm(x, self.layers[0][0], eps) if fused else None
        for (ln1, qkv_proj, o_proj, ln2, gate_up_proj, down_proj), (k_cache, v_cache), \
                next_norm, window in zip(self.layers, self.layer_caches(kv_cache),
                                         self._next_norms, self._windows):
            if fused is None:
                h = self._rms_norm(x, ln1)
            qkv = qkv_proj(h)
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk = qk.view(n, heads, cfg.head_dim)        # q and k heads rotated in one go
            if fused is None:
                qk = self._rotate(qk, cos, sin)
            else:
                fused.rotary(qk, positions, self.cos, self.sin)
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim)
            attn = self._reduce(o_proj(paged_attention(q, k, v, k_cache, v_cache, meta,
                                                       self.scale, window)))
            if fused is None:
                x = x + attn
                gate, up = gate_up_proj(self._rms_norm(x, ln2)).chunk(2, dim=-1)
                x = x + self._reduce(down_proj(F.silu(gate) * up))
            else:        # x += attn; h = norm(x), and likewise after the MLP, in place
                h = fused.add_rms_norm(attn, x, ln2, eps)
                h = fused.add_rms_norm(self._reduce(down_proj(fused.silu_and_mul(
                    gate_up_proj(h)))), x, next_norm, eps)
        return self._rms_norm(x, self.norm) if fused is None else h

    def forward_with_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                            meta: AttentionMetadata, kv_cache: torch.Tensor, greedy: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor, list[int] | None] | None:
        """`forward` and `compute_logits(hidden, reuse_output=True)` of every row in one C
        call, the same bits — (hidden `[T, hidden]`, valid until the next call; float32 logits
        `[T, vocab]` in the LM head's kept buffer; with `greedy`, each row's argmax as T ints,
        else None) — where the layer stack takes the LM head (a quantized model on the CPU
        kernels: `engine.kernels.stack`); else None, with nothing run. For steps that sample
        every row (decodes, verified drafts). Raises what `LayerStack.run` raises."""
        stack = self.stack
        if stack is None or not stack.has_head or getattr(meta, "kernels", None) is None:
            return None
        logits = self.lm_head.reused_output(input_ids.shape[0], torch.float32)
        hidden, tokens = stack.run(input_ids, positions, meta, kv_cache, logits=logits,
                                   greedy=greedy)
        return hidden, logits, tokens

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, reuse_output: bool = False) -> torch.Tensor:
        """`[N, hidden]` → float32 logits `[N, vocab]`. With `reuse_output` (the model
        runner's sampling rows, which are consumed within the step) a GGUF LM head writes into
        a buffer it keeps, valid until the next such call: a 64-row decode step's 12.6 MB of
        logits, allocated anew, was 3,072 first-touch page faults a step (~2.7 us each on a
        KVM guest; glibc gave each step's logits fresh pages as the heap fragmented)."""
        logits = self.lm_head(hidden, torch.float32, reuse_output=reuse_output)
        if self.tp is None:
            return logits
        return self.tp.all_gather_columns(logits)[:, :self.cfg.vocab_size]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows `[T, hidden]` (a copy); under tensor parallelism each rank looks up
        the ids in its vocabulary shard, zeroes the others' and the ranks sum (exact: one
        non-zero term per row)."""
        if self.tp is None:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed.shape[0])
        x = self._lookup(local.clamp(0, self.embed.shape[0] - 1))
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows of `ids` (a copy), dequantized from a quantized table."""
        if isinstance(self.embed, QuantWeight):
            return self.kernels.quant_embed(self.embed, ids, self.dtype)
        return self.embed[ids]

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's partial sums, summed over the ranks (identity alone)."""
        return x if self.tp is None else self.tp.all_reduce(x)


def load_model(model_dir: Path, device: Device, dtype: torch.dtype,
               max_positions: int, tp: TensorParallelGroup | None = None,
               quant: Quantization | None = None) -> LlamaForCausalLM:
    """Read `config.json` and the weights and build the model on `device`
    (`engine.device.Device`, which picks the linear path for `dtype`); with `tp`, this rank's
    shard of it. Weights: every `*.safetensors` in `model_dir`, or with `quant` "gguf" the GGUF
    file's tensors in their block format (`engine.quant.gguf_weights`); "int8" quantizes the
    linear weights and the embedding per output channel at load; `quant.int8_activations`
    quantizes the activations of the decode-sized quantized products to int8.

    Raises: ModelLoadError (missing or unreadable weights), UnsupportedArchitectureError,
    ValueError (a dtype this device cannot run, one line).
    """
    quant = quant or Quantization()
    kernels = device.kernels(dtype)
    path = device.linear_path(dtype)
    cfg = ModelConfig.from_dir(model_dir)
    mapping = None
    if quant.method == "gguf":
        from engine.quant.gguf_weights import read_gguf_weights
        weights, _, mapping = read_gguf_weights(Path(quant.gguf), cfg.num_heads,
                                                cfg.num_kv_heads)
    else:
        weights = _read_safetensors(Path(model_dir))
    if quant.method == "int8":
        weights = {k: quantize_int8(v) if _is_int8_target(k, v) else v
                   for k, v in weights.items()}
    model = LlamaForCausalLM(cfg, weights, device.torch_device, dtype, max_positions, path,
                             kernels, tp, quant.int8_activations)
    if device.torch_device.type == "cpu" and model.quant_types:
        from engine.quant.huge_pages import to_huge_pages
        moved = to_huge_pages(model.quant_weights())      # fewer TLB misses a step
        logger.debug("quantized weights in transparent huge pages: %.1f MB", moved / 1e6)
    if mapping is not None:          # the blocks copied out of the file: resident once
        mapping.release()
    return model


def _is_int8_target(name: str, t: torch.Tensor) -> bool:
    """The tensors `--quantization int8` quantizes: projections, LM head, embedding."""
    return t.dim() == 2 and name.endswith(("_proj.weight", "lm_head.weight",
                                           "embed_tokens.weight"))


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every `*.safetensors` in `model_dir`. Raises ModelLoadError."""
    weights: dict[str, torch.Tensor] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    weights[name] = st.get_tensor(name)
        except Exception as e:   # safetensors raises its own error types
            raise ModelLoadError(f"{f}: cannot read weights: {e}") from e
    return weights
