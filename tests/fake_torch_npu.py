"""A stand-in for `torch_npu` with the three operators the NPU attention backend calls
(engine/accel/npu_attention.py), in plain torch on the CPU. No Ascend hardware has run the
backend: this module is what the tests run it against, so it is strict.

Owns: `FakeTorchNpu` (a module object) and `install(monkeypatch)`, which puts one into
`sys.modules["torch_npu"]` for a test. In: the backend's operator calls, by keyword, as
vLLM-Ascend v0.13.0 makes them (vllm_ascend/attention/attention_v1.py). Out: the operators'
documented effects (cache writes in place, attention outputs), and `calls`, the names and
arguments of every call in order, so a test can assert which operator a step used.

Every call's arguments are checked against the operators' documentation (ATB
ReshapeAndCache and PagedAttention, torch_npu.npu_fused_infer_attention_score) and
vLLM-Ascend's usage: names (keyword-only; an unknown name is a TypeError), shapes, dtypes
(float16/bfloat16 data, int32 indices, host int lists for the fused operator's lengths, an
int32 host tensor for PagedAttention's `context_lens`), contiguity, the cache layout
`[num_blocks, block_size, num_kv_heads, head_dim]`, the "TND" layout string, the sparse_mode 3
mask, and that the lengths agree with each other and with the tensors. A mismatch raises
AssertionError naming the operator and the argument.

Semantics: attention is computed in float32 and returned in the query's dtype; a chunk of n
queries over a context of L keys is right-down causal (query i sees keys j <= L - n + i), which
is what sparse_mode 3 and PagedAttention's single query (n = 1, all L keys) mean.
"""

from __future__ import annotations

import math
import sys
import types

import torch

DATA_DTYPES = (torch.float16, torch.bfloat16)
MASK_SIZE = 2048


def _check(ok: bool, op: str, msg: str) -> None:
    if not ok:
        raise AssertionError(f"fake torch_npu.{op}: {msg}")


def _check_cache(op: str, name: str, cache, num_kv_heads: int, head_dim: int, dtype) -> None:
    """`cache` must be a contiguous `[num_blocks, block_size, num_kv_heads, head_dim]`."""
    _check(isinstance(cache, torch.Tensor) and cache.dim() == 4, op,
           f"{name} must be a 4-d tensor, got {getattr(cache, 'shape', type(cache))}")
    _check(tuple(cache.shape[2:]) == (num_kv_heads, head_dim), op,
           f"{name} must be [num_blocks, block_size, num_kv_heads={num_kv_heads}, "
           f"head_dim={head_dim}] (the NPU layout), got {tuple(cache.shape)}")
    _check(cache.dtype == dtype, op, f"{name} dtype {cache.dtype} != data dtype {dtype}")
    _check(cache.is_contiguous(), op, f"{name} must be contiguous")


def _check_data(op: str, name: str, t, dim: int) -> None:
    _check(isinstance(t, torch.Tensor) and t.dim() == dim, op,
           f"{name} must be a {dim}-d tensor, got {getattr(t, 'shape', type(t))}")
    _check(t.dtype in DATA_DTYPES, op, f"{name} must be float16 or bfloat16, got {t.dtype}")
    _check(t.is_contiguous(), op, f"{name} must be contiguous")


def _check_index(op: str, name: str, t, dim: int) -> None:
    _check(isinstance(t, torch.Tensor) and t.dim() == dim, op,
           f"{name} must be a {dim}-d tensor, got {getattr(t, 'shape', type(t))}")
    _check(t.dtype == torch.int32, op, f"{name} must be int32, got {t.dtype}")
    _check(t.is_contiguous(), op, f"{name} must be contiguous")


def _check_heads(op: str, num_heads, num_kv_heads, query) -> None:
    _check(isinstance(num_heads, int) and isinstance(num_kv_heads, int), op,
           "num_heads and the KV head count must be ints")
    _check(query.shape[1] == num_heads, op, f"query has {query.shape[1]} heads, "
           f"num_heads={num_heads}")
    _check(num_kv_heads > 0 and num_heads % num_kv_heads == 0, op,
           f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")


def _gather(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of a sequence from a `[num_blocks, block_size, ...]` cache."""
    block_size = cache.shape[1]
    blocks = table_row[:math.ceil(length / block_size)].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """`q [n, H, D]` over `k, v [L, KVH, D]`, right-down causal, in float32 → q's dtype."""
    n, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    length = k.shape[0]
    visible = torch.arange(length)[None, :] <= torch.arange(n)[:, None] + (length - n)
    s = s.masked_fill(~visible.to(s.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)


class FakeTorchNpu(types.ModuleType):
    """The stand-in module (see the module docstring). `calls`: `(operator name, kwargs)`."""

    def __init__(self) -> None:
        super().__init__("torch_npu")
        self.calls: list[tuple[str, dict]] = []

    def ops_called(self) -> list[str]:
        """The operators called so far, in order."""
        return [name for name, _ in self.calls]

    def _npu_reshape_and_cache(self, *, key, value, key_cache, value_cache, slot_indices):
        """ATB ReshapeAndCache: `key, value [n, KVH, D]` into the caches at `slot_indices [n]`
        (int32, each in [0, num_blocks * block_size), no repeats)."""
        op = "_npu_reshape_and_cache"
        self.calls.append((op, dict(key=key, value=value, key_cache=key_cache,
                                    value_cache=value_cache, slot_indices=slot_indices)))
        _check_data(op, "key", key, 3)
        _check_data(op, "value", value, 3)
        _check(value.shape == key.shape, op, f"value {tuple(value.shape)} != key "
               f"{tuple(key.shape)}")
        n, num_kv_heads, head_dim = key.shape
        for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
            _check_cache(op, name, cache, num_kv_heads, head_dim, key.dtype)
        _check(value_cache.shape == key_cache.shape, op, "key_cache and value_cache differ")
        _check_index(op, "slot_indices", slot_indices, 1)
        _check(slot_indices.shape[0] == n, op, f"{slot_indices.shape[0]} slots for {n} tokens")
        num_slots = key_cache.shape[0] * key_cache.shape[1]
        _check(bool(((slot_indices >= 0) & (slot_indices < num_slots)).all()), op,
               f"slot_indices outside [0, {num_slots}): {slot_indices.tolist()}")
        _check(slot_indices.unique().numel() == n, op, "slot_indices repeat a slot")
        idx = slot_indices.long()
        key_cache.view(num_slots, num_kv_heads, head_dim)[idx] = key
        value_cache.view(num_slots, num_kv_heads, head_dim)[idx] = value

    def _npu_paged_attention(self, *, query, key_cache, value_cache, num_kv_heads, num_heads,
                             scale_value, block_table, context_lens, out):
        """ATB PagedAttention: one query token per sequence, `query [B, H, D]`, over its
        `context_lens[b]` cached tokens (int32 host tensor [B]) → `out [B, H, D]` in place."""
        op = "_npu_paged_attention"
        self.calls.append((op, dict(query=query, key_cache=key_cache, value_cache=value_cache,
                                    num_kv_heads=num_kv_heads, num_heads=num_heads,
                                    scale_value=scale_value, block_table=block_table,
                                    context_lens=context_lens, out=out)))
        _check_data(op, "query", query, 3)
        _check_heads(op, num_heads, num_kv_heads, query)
        batch, _, head_dim = query.shape
        for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
            _check_cache(op, name, cache, num_kv_heads, head_dim, query.dtype)
        _check(isinstance(scale_value, float), op, "scale_value must be a float")
        _check_index(op, "block_table", block_table, 2)
        _check(block_table.shape[0] == batch, op, f"block_table has {block_table.shape[0]} "
               f"rows for {batch} queries")
        _check_index(op, "context_lens", context_lens, 1)
        _check(context_lens.device.type == "cpu", op, "context_lens must be a host tensor")
        _check(context_lens.shape[0] == batch, op, f"{context_lens.shape[0]} context_lens for "
               f"{batch} queries")
        _check(isinstance(out, torch.Tensor) and out.shape == query.shape
               and out.dtype == query.dtype and out.is_contiguous(), op,
               "out must be a contiguous tensor of query's shape and dtype")
        block_size = key_cache.shape[1]
        for b, length in enumerate(context_lens.tolist()):
            self._check_table_row(op, block_table[b], length, block_size, key_cache.shape[0])
            out[b] = _attend(query[b:b + 1], _gather(key_cache, block_table[b], length),
                             _gather(value_cache, block_table[b], length), scale_value)[0]

    def npu_fused_infer_attention_score(
            self, query, key, value, *, atten_mask=None, block_table=None, input_layout="BSH",
            block_size=0, actual_seq_lengths=None, actual_seq_lengths_kv=None,
            num_key_value_heads=0, num_heads=1, scale=1.0, sparse_mode=0):
        """torch_npu's fused attention, the paged TND case only: `query [T, H, D]`, `key,
        value [num_blocks, block_size, KVH * D]` read through `block_table [B, max_blocks]`
        (int32), `actual_seq_lengths` the cumulative query ends and `actual_seq_lengths_kv` the
        context lengths (host int lists), sparse_mode 3 → `(out [T, H, D], lse placeholder)`."""
        op = "npu_fused_infer_attention_score"
        self.calls.append((op, dict(
            query=query, key=key, value=value, atten_mask=atten_mask, block_table=block_table,
            input_layout=input_layout, block_size=block_size,
            actual_seq_lengths=actual_seq_lengths, actual_seq_lengths_kv=actual_seq_lengths_kv,
            num_key_value_heads=num_key_value_heads, num_heads=num_heads, scale=scale,
            sparse_mode=sparse_mode)))
        _check(input_layout == "TND", op, f"input_layout must be 'TND', got {input_layout!r}")
        _check(sparse_mode == 3, op, f"the stand-in implements sparse_mode 3, got {sparse_mode}")
        _check_data(op, "query", query, 3)
        _check_heads(op, num_heads, num_key_value_heads, query)
        _check(isinstance(scale, float), op, "scale must be a float")
        num_tokens, _, head_dim = query.shape
        for name, kv in (("key", key), ("value", value)):
            _check_data(op, name, kv, 3)
            _check(tuple(kv.shape[1:]) == (block_size, num_key_value_heads * head_dim), op,
                   f"{name} must be the cache viewed [num_blocks, block_size={block_size}, "
                   f"num_kv_heads * head_dim={num_key_value_heads * head_dim}], got "
                   f"{tuple(kv.shape)}")
            _check(kv.dtype == query.dtype, op, f"{name} dtype {kv.dtype} != {query.dtype}")
        _check(isinstance(block_size, int) and block_size > 0 and block_size % 16 == 0, op,
               f"block_size must be a positive multiple of 16, got {block_size}")
        self._check_mask(op, atten_mask, query.device)
        for name, lens in (("actual_seq_lengths", actual_seq_lengths),
                           ("actual_seq_lengths_kv", actual_seq_lengths_kv)):
            _check(isinstance(lens, list) and all(type(x) is int for x in lens), op,
                   f"{name} must be a host list of ints, got {type(lens).__name__}")
        ends = actual_seq_lengths
        starts = [0] + ends[:-1]
        _check(len(ends) > 0 and all(e > s for s, e in zip(starts, ends)), op,
               f"actual_seq_lengths must be increasing cumulative query ends, got {ends}")
        _check(ends[-1] == num_tokens, op, f"query lengths sum to {ends[-1]}, query has "
               f"{num_tokens} tokens")
        _check(len(actual_seq_lengths_kv) == len(ends), op,
               f"{len(actual_seq_lengths_kv)} kv lengths for {len(ends)} sequences")
        _check_index(op, "block_table", block_table, 2)
        _check(block_table.shape[0] == len(ends), op, f"block_table has "
               f"{block_table.shape[0]} rows for {len(ends)} sequences")
        num_kv_heads = num_key_value_heads
        k4 = key.view(key.shape[0], block_size, num_kv_heads, head_dim)
        v4 = value.view(value.shape[0], block_size, num_kv_heads, head_dim)
        out = torch.empty_like(query)
        for b, (s, e, length) in enumerate(zip(starts, ends, actual_seq_lengths_kv)):
            _check(length >= e - s, op, f"sequence {b}: context {length} < its {e - s} queries")
            self._check_table_row(op, block_table[b], length, block_size, key.shape[0])
            out[s:e] = _attend(query[s:e], _gather(k4, block_table[b], length),
                               _gather(v4, block_table[b], length), scale)
        return out, torch.empty(1, dtype=query.dtype, device=query.device)

    @staticmethod
    def _check_table_row(op: str, row: torch.Tensor, length: int, block_size: int,
                         num_blocks: int) -> None:
        needed = math.ceil(length / block_size)
        _check(length >= 1, op, f"a context length of {length}")
        _check(needed <= row.shape[0], op, f"a context of {length} needs {needed} blocks, the "
               f"table row has {row.shape[0]}")
        used = row[:needed]
        _check(bool(((used >= 0) & (used < num_blocks)).all()), op,
               f"block ids {used.tolist()} outside [0, {num_blocks})")

    @staticmethod
    def _check_mask(op: str, mask, device: torch.device) -> None:
        """sparse_mode 3 takes the compressed 2048 x 2048 mask, 1 strictly above the diagonal."""
        _check(isinstance(mask, torch.Tensor) and tuple(mask.shape) == (MASK_SIZE, MASK_SIZE),
               op, f"atten_mask must be [{MASK_SIZE}, {MASK_SIZE}] for sparse_mode 3, got "
               f"{getattr(mask, 'shape', mask)}")
        _check(mask.dtype in (torch.int8, torch.bool, torch.uint8), op,
               f"atten_mask must be int8/bool/uint8, got {mask.dtype}")
        _check(mask.device == device, op, "atten_mask is not on query's device")
        want = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=mask.device).triu(1)
        _check(torch.equal(mask.bool(), want), op,
               "atten_mask must be 1 strictly above the diagonal, 0 elsewhere")


def install(monkeypatch) -> FakeTorchNpu:
    """Put a fresh stand-in into `sys.modules["torch_npu"]` for one test; returns it."""
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake
