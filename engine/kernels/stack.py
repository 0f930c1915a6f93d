"""The decoder's layers in one C call (`engine/kernels/layer_stack.c`) for a model whose every
projection is one quantized weight (the GGUF default on the CPU).

Owns: the ctypes mirror of layer_stack.c's structs, filled once per model and KV cache (weight
and cache addresses never move), and the per-step call. The call runs the same kernels, in the
same order and with the same arguments, as `LlamaForCausalLM.forward`'s fused path, so its result
is bit-identical; it removes the Python between them (about 40 us a layer on 2 cores).

In: the model (`engine.models.llama.LlamaForCausalLM`, fused kernels set, no tensor parallelism,
no LoRA), its KV cache `[layers, 2, kv_heads, blocks, block_size, head_dim]`; per step the
token ids (looked up in the embedding table by the call where the table is quantized),
positions, and the step's `AttentionMetadata` (slot mapping, per-token block
tables and context lengths), and where asked a float32 logits buffer. Out: `h` after the final
norm, `[T, hidden]`, and with the buffer every row's logits through the model's LM head when
that is one quantized weight (the embedded model's tied Q8_0 table), and where asked each row's
greedy token (the logits' argmax, taken in the call). Everything that ran as Python between
two weight-streaming calls ran on caches the weights had just swept, at several times its warm
cost (docs/cpu.md, "Single stream on an AVX2 host"), so the lookup, the first norm, the LM head
and the argmax are in the one call, and steps of up to `KEPT_ROWS` tokens reuse kept scratch
buffers (no allocation, no torch op before the call).
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_float, c_int, c_int64, c_void_p

import numpy as np
import torch

# Steps of at most this many tokens (decode batches) run in kept scratch buffers; longer ones
# (prefill chunks) allocate theirs, so that one long chunk does not pin its scratch for good.
KEPT_ROWS = 256


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
                ("head", _QProj), ("head_int8_x", c_int), ("embed", _QProj)]


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
        self._embed = _embedding(model)
        self.embeds = bool(self._embed.w)       # the call looks the token ids up itself
        self._cache: torch.Tensor | None = None
        self._stack: _Stack | None = None
        self._arena: torch.Tensor | None = None        # kept scratch of up to KEPT_ROWS rows
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}
        self._greedy = np.zeros(KEPT_ROWS, dtype=np.int64)
        self._greedy_at = self._greedy.ctypes.data

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
        self._stack.embed = self._embed
        if kv is not None:
            st = self._stack
            st.kv_kind, st.k_write, st.v_write = kv.kind, 1 / kv.k_scale, 1 / kv.v_scale
            st.k_read, st.v_read = kv.k_read_scale, kv.v_read_scale
        self._cache = kv_cache
        return self._stack

    def _scratch(self, n: int) -> tuple[torch.Tensor, ...]:
        """(x, h, qkv, attn, o, gate_up, act), each `[n, width]` of the model dtype: views of
        the kept arena for n <= KEPT_ROWS (made once per n), else new tensors."""
        views = self._views.get(n)
        if views is not None:
            return views
        cfg = self.model.cfg
        widths = (cfg.hidden_size, cfg.hidden_size,
                  (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim,
                  cfg.num_heads * cfg.head_dim, cfg.hidden_size, 2 * cfg.intermediate_size,
                  cfg.intermediate_size)
        kept = n <= KEPT_ROWS
        if not kept:
            return tuple(torch.empty((n, w), dtype=self.model.dtype) for w in widths)
        if self._arena is None or self._arena.numel() < n * sum(widths):
            self._arena = torch.empty(n * sum(widths), dtype=self.model.dtype)
            self._views.clear()                    # views of the old arena
        views, offset = [], 0
        for w in widths:
            views.append(self._arena[offset:offset + n * w].view(n, w))
            offset += n * w
        self._views[n] = views = tuple(views)
        return views

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta,
            kv_cache: torch.Tensor, logits: torch.Tensor | None = None, greedy: bool = False
            ) -> tuple[torch.Tensor, list[int] | None]:
        """Every layer over the step's T tokens, `input_ids [T] int64` at `positions [T]
        int64` (see the module docstring): returns (`h [T, hidden]` after the final norm, of
        the model dtype — for T <= KEPT_ROWS a view of the kept scratch, valid until the next
        call —, the greedy tokens or None). With `logits` (float32 `[T, vocab]`, contiguous;
        only where `has_head`), every row's LM head product too, the bits
        `LlamaForCausalLM.compute_logits` gives; with `greedy` as well, each row's first index
        of its maximum logit (`logits.argmax(-1)`), as a list of T ints. Raises MemoryError;
        IndexError for a token id outside the vocabulary; ValueError (a weight without
        kernels, a head_dim / GQA group paged attention cannot take, logits asked of a stack
        without the LM head)."""
        n = input_ids.shape[0]
        stack = self._bind(kv_cache, meta.kv)
        x, h, qkv, attn, o, gate_up, act = self._scratch(n)
        if not self.embeds:
            x.copy_(self.model._embed(input_ids))
        out = self._greedy if n <= KEPT_ROWS else np.zeros(n, dtype=np.int64)
        at = self._greedy_at if out is self._greedy else out.ctypes.data
        tables = meta.kernel_block_tables
        rc = self.fn(ctypes.addressof(stack), input_ids.data_ptr() if self.embeds else None,
                     x.data_ptr(), h.data_ptr(), n, positions.data_ptr(),
                     meta.slot_mapping.data_ptr(), tables.data_ptr(), tables.shape[1],
                     meta.kernel_ctx_lens.data_ptr(), qkv.data_ptr(), attn.data_ptr(),
                     o.data_ptr(), gate_up.data_ptr(), act.data_ptr(),
                     None if logits is None else logits.data_ptr(),
                     at if greedy else None, torch.get_num_threads())
        if rc == -1:
            raise MemoryError("layer stack: out of memory for the input copies")
        if rc == -5:
            raise IndexError("layer stack: a token id is outside the vocabulary")
        if rc:
            raise ValueError(f"layer stack: error {rc} (no kernel for a weight, head_dim / "
                             "GQA group too large, or logits without the LM head)")
        return h, out[:n].tolist() if greedy else None


def _embedding(model) -> _QProj:
    """The embedding table as the call reads it where it is quantized (the GGUF's Q8_0
    table, or int8); else an empty struct: the caller looks the ids up."""
    from engine.quant.formats import QuantWeight
    table = model.embed
    if not isinstance(table, QuantWeight):
        return _QProj()
    qtype, w, row_bytes, scale = table.kernel_args
    n, k = table.shape
    return _QProj(qtype, w, row_bytes, scale, None, n, k, None, None)
