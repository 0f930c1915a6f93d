"""Paged attention over a flat token batch, in plain torch (runs on CPU, CUDA or NPU).

Owns: `AttentionMetadata` — what one step's attention needs, built once per step by the model
runner and shared by every layer — and `paged_attention`, which writes the step's K/V into the
cache through the slot mapping and then reads each request's context through its block table.

Layout: the flat batch holds the decode-like requests (one query token) first, then each
prefill chunk. Cache per layer: K and V `[num_blocks, block_size, num_kv_heads, head_dim]`;
slot s is `(s // block_size, s % block_size)`.

- Decodes are batched: their blocks are gathered into `[B, max_blocks * block_size]` contexts
  and masked by context length. Query heads are grouped by KV head (GQA), so K/V are not
  repeated.
- A prefill chunk attends to its cached prefix plus itself with a causal mask offset by its
  start position (so chunked prefill and prefix-cache hits are exact). A chunk that starts at
  position 0 uses its own fresh K/V with `is_causal` and reads nothing back.

All K/V of a layer are written before any of that layer's reads (the KV-cache manager's
contract: a block cached this step may be read by another request in this step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One request's chunk: tokens `token_start : token_start + num_tokens` of the flat batch,
    at positions `start_position ...`; `block_table` covers its whole context."""

    token_start: int
    num_tokens: int
    start_position: int
    block_table: torch.Tensor          # [num_blocks_needed] int64
    mask: torch.Tensor | None = None   # [num_tokens, context_len] bool, None when start == 0


@dataclass
class AttentionMetadata:
    """Per-step attention inputs (device tensors), shared by all layers."""

    slot_mapping: torch.Tensor                      # [num_tokens] int64
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64
    decode_mask: torch.Tensor | None = None          # [num_decodes, 1, 1, max_blocks*bs] bool
    prefills: list[PrefillChunk] = field(default_factory=list)


def build_prefill_mask(start: int, num_tokens: int, device: torch.device) -> torch.Tensor:
    """Causal mask `[num_tokens, start + num_tokens]`: query i sees keys 0..start+i."""
    q_pos = torch.arange(start, start + num_tokens, device=device)
    k_pos = torch.arange(start + num_tokens, device=device)
    return k_pos[None, :] <= q_pos[:, None]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write K/V of the step into the cache, then attend.

    Args:
        q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (post-RoPE).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        meta: the step's `AttentionMetadata`. scale: softmax scale (1/sqrt(head_dim)).

    Returns: [T, num_heads * head_dim].
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    block_size = k_cache.shape[1]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, meta.slot_mapping, k)
    v_flat.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)

    nd = meta.num_decodes
    if nd:
        tables = meta.decode_block_tables
        ctx = tables.shape[1] * block_size
        kd = k_cache[tables].view(nd, ctx, num_kv_heads, head_dim).transpose(1, 2)
        vd = v_cache[tables].view(nd, ctx, num_kv_heads, head_dim).transpose(1, 2)
        qd = q[:nd].view(nd, num_kv_heads, group, head_dim)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[:nd] = od.reshape(nd, num_heads, head_dim)

    for p in meta.prefills:
        s, n = p.token_start, p.num_tokens
        qp = q[s:s + n].transpose(0, 1).unsqueeze(0)                 # [1, H, n, D]
        if p.start_position == 0:
            kp, vp = k[s:s + n], v[s:s + n]
            mask, causal = None, True
        else:
            ctx = p.start_position + n
            kp = k_cache[p.block_table].view(-1, num_kv_heads, head_dim)[:ctx]
            vp = v_cache[p.block_table].view(-1, num_kv_heads, head_dim)[:ctx]
            mask, causal = p.mask, False
        op = F.scaled_dot_product_attention(
            qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=group > 1)
        out[s:s + n] = op[0].transpose(0, 1)
    return out.view(num_tokens, num_heads * head_dim)
