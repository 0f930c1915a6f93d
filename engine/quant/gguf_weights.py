"""A GGUF file's tensors under HF names, the quantized ones kept in their block format.

Owns: reading the file's tensors (`engine.quant.gguf_tensors`: the tensor directory alone,
memory-mapped, so the blocks are read from the page cache, not copied), the llama.cpp → transformers tensor names, undoing llama.cpp's Q/K row
permutation for the `llama` architecture (as transformers' `LlamaTensorProcessor` does: rows only,
so blocks stay intact), and the choice per tensor: a `QuantWeight` where `quant.c` has a kernel
for its type, else float32 dequantized at load (gguf-py), named in one log line.

In: the GGUF path and the HF `config.json` numbers (`ModelConfig`). Out: `{HF name: torch
float32 tensor | QuantWeight}`, the set of type names served quantized, and the file's mapping,
whose pages the model builder gives back once it has copied what it copies (fused projections,
permuted rows): otherwise the process holds those bytes twice, as copies and as mapped pages.
"""

from __future__ import annotations

import logging
import mmap
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from engine.loader import ModelLoadError
from engine.quant.formats import KERNEL_TYPES, QuantWeight

logger = logging.getLogger("continuum.quant")

# llama.cpp's per-layer tensor names (gguf-py's tensor_mapping.py) -> transformers' names.
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight":
           "model.norm.weight", "output.weight": "lm_head.weight"}
_FLOAT_TYPES = {0: np.float32, 1: np.float16}     # F32, F16
_BF16 = 30


def hf_name(gguf_name: str) -> str | None:
    """The transformers name of a llama.cpp tensor name, or None for one the model ignores
    (e.g. `rope_freqs.weight`, recomputed from the config)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
    return None


def _unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q / K rows (convert_hf_to_gguf.py), on axis 0 only."""
    dim = rows.shape[0] // n_head // 2
    w = rows.reshape(n_head, dim, 2, *rows.shape[1:])
    return np.ascontiguousarray(w.swapaxes(2, 1).reshape(rows.shape))


def _float_tensor(t, shape: tuple[int, ...]) -> torch.Tensor:
    """A float GGUF tensor (F32, F16, BF16) as float32 of the HF `shape`."""
    data = np.asarray(t.data)
    if t.tensor_type == _BF16:
        out = torch.from_numpy(data.view(np.int16).astype(np.int32) << 16).view(torch.float32)
        return out.reshape(shape).clone()
    return torch.from_numpy(data.astype(np.float32)).reshape(shape)


class GgufMapping:
    """The memory map under a GGUF's `QuantWeight`s (a copy-on-write `np.memmap`)."""

    def __init__(self, data: np.memmap) -> None:
        self._mmap = getattr(data, "_mmap", None)

    def release(self) -> None:
        """Drop the mapping's pages from this process's resident memory (madvise
        MADV_DONTNEED). Weights still viewing the file read their pages again from the page
        cache when next touched; those copied out of it are never touched again, so only
        their copies stay resident. The pages are clean (nothing writes to the weights), so
        nothing is lost. A no-op where the platform lacks madvise."""
        if self._mmap is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._mmap.madvise(mmap.MADV_DONTNEED)


def read_gguf_weights(path: Path, num_heads: int, num_kv_heads: int,
                      keep_types: set[int] | None = None
                      ) -> tuple[dict[str, torch.Tensor | QuantWeight], list[str], GgufMapping]:
    """`{HF name: weight}` of the GGUF at `path`, the names of the quantized types served as
    blocks, and the file's mapping (see `GgufMapping.release`). Two-dimensional tensors of a
    type in `keep_types` (default: every type of `KERNEL_TYPES`) stay `QuantWeight`s; the other
    quantized ones are dequantized to float32 here, and one log line names their types; 1-d
    tensors (norms, biases) are float32.

    Raises ModelLoadError (unreadable file, a tensor the model does not know)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from engine.quant.gguf_tensors import read_gguf_tensors

    keep = set(KERNEL_TYPES) if keep_types is None else keep_types
    try:
        reader = read_gguf_tensors(str(path))
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read GGUF tensors: {e}") from e
    arch = reader.architecture
    out: dict[str, torch.Tensor | QuantWeight] = {}
    kept, dequantized = Counter(), Counter()
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        shape = tuple(reversed(t.dims))                                 # ggml's ne is reversed
        qtype = t.tensor_type
        # llama.cpp permutes Q / K rows for the `llama` architecture only
        heads = 0 if arch != "llama" else (num_heads if ".q_proj." in name else
                                           num_kv_heads if ".k_proj." in name else 0)
        if qtype in _FLOAT_TYPES or qtype == _BF16:
            value = _float_tensor(t, shape)
            if heads:
                value = torch.from_numpy(_unpermute_rows(value.numpy(), heads))
            out[name] = value
            continue
        raw = np.asarray(t.data).reshape(shape[0], -1)             # [N, row_bytes] uint8
        if heads:
            raw = _unpermute_rows(raw, heads)
        if qtype in keep and len(shape) == 2:
            out[name] = QuantWeight(qtype, torch.from_numpy(np.ascontiguousarray(raw)), shape)
            kept[KERNEL_TYPES[qtype][0]] += 1
        else:
            type_name = GGMLQuantizationType(qtype).name
            dense = dequantize(np.ascontiguousarray(raw), GGMLQuantizationType(qtype))
            out[name] = torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)
                                         ).reshape(shape)
            dequantized[type_name] += 1
    if dequantized:
        logger.warning("GGUF tensor types without a CPU kernel, dequantized at load to the "
                       "serving dtype: %s", ", ".join(f"{k} ({v} tensors)"
                                                      for k, v in sorted(dequantized.items())))
    return out, sorted(kept), GgufMapping(reader.data)
