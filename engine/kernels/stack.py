"""The decoder's layers in one C call (`engine/kernels/layer_stack.c`) for a model whose every
projection is one quantized weight (the GGUF default on the CPU).

Owns: the ctypes mirror of layer_stack.c's structs, filled once per model and KV cache (weight
and cache addresses never move), and the per-step call. The call runs the same kernels, in the
same order and with the same arguments, as `LlamaForCausalLM.forward`'s fused path, so its result
is bit-identical; it removes the Python between them (about 40 us a layer on 2 cores).

In: the model (`engine.models.llama.LlamaForCausalLM`, fused kernels set, no tensor parallelism,
no LoRA), its KV cache `[layers, 2, kv_heads, blocks, block_size, head_dim]`; per step the
residual stream `x [T, hidden]`, `h = rms_norm(x) * ln1` of layer 0, positions, and the step's
`AttentionMetadata` (slot mapping, per-token block tables and context lengths), and where asked
a float32 logits buffer. Out: `h` after the final norm, `[T, hidden]` (`x` is updated in place),
and with the buffer every row's logits through the model's LM head when that is one quantized
weight (the embedded model's tied Q8_0 table): the Python between the layers' call and the LM
head's ran on caches the layers' weights had just swept (docs/cpu.md, "Single stream on an AVX2
host").
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_float, c_int, c_int64, c_void_p

import torch


class _QProj(ctypes.Structure):
    _fields_ = [("type", c_int), ("w", c_void_p), ("row_bytes", c_int64), ("scale", c_void_p),
                ("bias", c_void_p), ("n", c_int64), ("k", c_int64), ("q8_packed", c_void_p),
                ("panel_packed", c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("ln1", c_void_p), ("ln2", c_void_p), ("qkv", _QProj), ("o", _QProj),
                ("gate_up", _QProj), ("down", _QProj), ("k_cache", c_void_p),
                ("v_cache", c_void_p)]


class _Stack(ctypes.Structure):
    _fields_ = [("num_layers", c_int), ("hidden", c_int), ("num_heads", c_int),
                ("num_kv_heads", c_int), ("head_dim", c_int), ("inter", c_int),
                ("block_size", c_int), ("bf16", c_int), ("int8_x", c_int),
                ("num_blocks", c_int64), ("eps", c_float), ("scale", c_float),
                ("cos", c_void_p), ("sin", c_void_p), ("final_norm", c_void_p),
                ("layers", POINTER(_Layer)), ("kv_kind", c_int), ("k_write", c_float),
                ("v_write", c_float), ("k_read", c_float), ("v_read", c_float),
                ("head", _QProj), ("head_int8_x", c_int)]


def _single_quant(lin) -> bool:
    """Whether `lin` is an `engine.linear.Linear` over one quantized weight (not LoRA-wrapped,
    not separate products of differing block types)."""
    from engine.linear import Linear
    return isinstance(lin, Linear) and lin.path == "quant" and len(lin.parts) == 1


def _proj(lin) -> _QProj:
    qtype, w, row_bytes, scale = lin.parts[0].kernel_args
    n, k = lin.parts[0].shape
    bias = None if lin.bias is None else lin.bias.data_ptr()
    q8, panel = lin.parts[0].q8_packed, lin.parts[0].panel_packed
    return _QProj(qtype, w, row_bytes, scale, bias, n, k, None if q8 is None else q8.data_ptr(),
                  None if panel is None else panel.data_ptr())


class LayerStack:
    """`layer_stack_forward` bound to one model (see the module docstring). Build with
    `LayerStack.build`, which returns None for a model the C loop does not cover."""

    def __init__(self, model, kernels) -> None:
        cfg = model.cfg
        self.model, self.fn = model, kernels._fn["layer_stack_forward"]
        self.int8_x = model.layers[0][1].int8_x
        self._layers = (_Layer * cfg.num_layers)()
        for i, (ln1, qkv, o, ln2, gate_up, down) in enumerate(model.layers):
            self._layers[i] = _Layer(ln1.data_ptr(), ln2.data_ptr(), _proj(qkv), _proj(o),
                                     _proj(gate_up), _proj(down), None, None)
        lm = model.lm_head            # folded into the call where it is one quantized weight
        self.has_head = _single_quant(lm)
        self._head = _proj(lm) if self.has_head else _QProj()
        self._head_int8_x = int(self.has_head and lm.int8_x)
        self._cache: torch.Tensor | None = None
        self._stack: _Stack | None = None

    @classmethod
    def build(cls, model, kernels) -> LayerStack | None:
        """The stack for `model`, or None where the per-op path must run: no fused kernels
        (float32 over dense weights, CUDA, NPU), tensor parallelism, LoRA, a projection that is
        not one quantized weight, or mixed int8-activation settings."""
        if kernels is None or model.fused is None or model.tp is not None \
                or not getattr(kernels, "layer_stack", True):     # CUDA's TritonFused
            return None
        lins = [lin for layer in model.layers for lin in (layer[1], layer[2], layer[4],
                                                          layer[5])]
        if not all(_single_quant(lin) for lin in lins):
            return None
        if len({lin.int8_x for lin in lins}) != 1:
            return None
        return cls(model, kernels)

    def _bind(self, kv_cache: torch.Tensor, kv=None) -> _Stack:
        """The struct with `kv_cache`'s per-layer K / V addresses (rebuilt when the cache
        tensor changes); `kv`: an 8-bit cache's `engine.kv_quant.KVQuant`, or None."""
        if self._cache is kv_cache and self._stack is not None:
            return self._stack
        m, cfg = self.model, self.model.cfg
        for i, (k_cache, v_cache) in enumerate(m.layer_caches(kv_cache)):
            self._layers[i].k_cache, self._layers[i].v_cache = (k_cache.data_ptr(),
                                                                v_cache.data_ptr())
        self._stack = _Stack(
            cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, kv_cache.shape[4], int(m.dtype == torch.bfloat16),
            int(self.int8_x), kv_cache.shape[3], cfg.rms_norm_eps, m.scale, m.cos.data_ptr(),
            m.sin.data_ptr(), m.norm.data_ptr(), self._layers)
        self._stack.head, self._stack.head_int8_x = self._head, self._head_int8_x
        if kv is not None:
            st = self._stack
            st.kv_kind, st.k_write, st.v_write = kv.kind, 1 / kv.k_scale, 1 / kv.v_scale
            st.k_read, st.v_read = kv.k_read_scale, kv.v_read_scale
        self._cache = kv_cache
        return self._stack

    def forward(self, x: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, meta,
                kv_cache: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        """Every layer over the step's T tokens: `x` and `h` `[T, hidden]` contiguous in the
        model dtype (see the module docstring); returns `h`. With `logits` (float32 `[T,
        vocab]`, contiguous; only where `has_head`), every row's LM head product too, the bits
        `LlamaForCausalLM.compute_logits` gives. Raises MemoryError, ValueError (a weight
        without kernels, a head_dim / GQA group paged attention cannot take, logits asked of
        a stack without the LM head)."""
        cfg, n = self.model.cfg, x.shape[0]
        stack = self._bind(kv_cache, meta.kv)
        qkv = x.new_empty((n, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim))
        attn = x.new_empty((n, cfg.num_heads * cfg.head_dim))
        o = x.new_empty((n, cfg.hidden_size))
        gate_up = x.new_empty((n, 2 * cfg.intermediate_size))
        act = x.new_empty((n, cfg.intermediate_size))
        tables = meta.kernel_block_tables
        rc = self.fn(ctypes.addressof(stack), x.data_ptr(), h.data_ptr(), n,
                     positions.data_ptr(), meta.slot_mapping.data_ptr(), tables.data_ptr(),
                     tables.shape[1], meta.kernel_ctx_lens.data_ptr(), qkv.data_ptr(),
                     attn.data_ptr(), o.data_ptr(), gate_up.data_ptr(), act.data_ptr(),
                     None if logits is None else logits.data_ptr(), torch.get_num_threads())
        if rc == -1:
            raise MemoryError("layer stack: out of memory for the input copies")
        if rc:
            raise ValueError(f"layer stack: error {rc} (no kernel for a weight, head_dim / "
                             "GQA group too large, or logits without the LM head)")
        return h
