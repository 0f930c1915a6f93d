"""A GGUF file's tensor directory, read without parsing its metadata values.

Owns: `read_gguf_tensors`, which walks the header (GGUF v2 / v3, the layout in ggml's
`docs/gguf.md`: magic, version, tensor count, key-value count, the key-value pairs, the tensor
infos, padding to `general.alignment`, then the data) and returns each tensor's name, ggml type,
dims and a view of its bytes in a copy-on-write memory map. In: a path. Out: `GgufTensors`.

Why not gguf-py's `GGUFReader`: it builds a numpy view for every part of every metadata value,
and a model's tokenizer is stored there (SmolLM2's 49k tokens and 48k merges): 1.6 s of every
engine start for the embedded model, for values the engine never reads (the converted HF
directory holds the tokenizer). Here the values are stepped over — a string array by its
lengths alone — and only `general.architecture` and `general.alignment` are kept: ~20 ms. Type
sizes come from gguf-py (`GGML_QUANT_SIZES`), and tests/test_quant.py checks the result against
`GGUFReader` on the embedded model and on a file carrying every value type.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

GGUF_MAGIC = b"GGUF"
# GGUFValueType -> struct format of a scalar (STRING = 8 and ARRAY = 9 are walked)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
_FLOAT_DTYPES = {0: np.float32, 1: np.float16}      # F32, F16: typed views; others: bytes
_U64 = struct.Struct("<Q")                          # a string's length


@dataclass
class GgufTensor:
    """One tensor: `dims` in ggml order (innermost first), `data` a flat view of its bytes —
    float32 / float16 for F32 / F16, uint8 for every other type (block formats, BF16)."""

    name: str
    tensor_type: int
    dims: tuple[int, ...]
    data: np.ndarray


@dataclass
class GgufTensors:
    """The file's tensors in file order, its `general.architecture` ("" when absent) and the
    memory map their views share."""

    architecture: str
    tensors: list[GgufTensor]
    data: np.memmap


class _Cursor:
    """Little-endian reads from a buffer, advancing an offset."""

    def __init__(self, buf) -> None:
        self.buf, self.pos = buf, 0

    def read(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.read("Q")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8")

    def skip_value(self, vtype: int) -> None:
        if vtype in _SCALARS:
            self.pos += struct.calcsize(_SCALARS[vtype])
        elif vtype == _STRING:
            n = self.read("Q")              # (not `pos += read()`: that adds to the old pos)
            self.pos += n
        elif vtype == _ARRAY:
            etype, count = self.read("I"), self.read("Q")
            if etype in _SCALARS:
                self.pos += count * struct.calcsize(_SCALARS[etype])
            elif etype == _STRING:          # a tokenizer's 49 k tokens: one loop, no calls
                buf, pos, length = self.buf, self.pos, _U64.unpack_from
                for _ in range(count):
                    pos += 8 + length(buf, pos)[0]
                self.pos = pos
            else:
                for _ in range(count):
                    self.skip_value(etype)
        else:
            raise ValueError(f"unknown GGUF value type {vtype} at byte {self.pos}")


def read_gguf_tensors(path: str) -> GgufTensors:
    """The tensor directory of the GGUF at `path` (see the module docstring). Raises OSError
    (unreadable) or ValueError (not a GGUF v2 / v3, an unknown value or tensor type, a tensor
    past the end of the file)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    data = np.memmap(path, mode="c")          # copy-on-write: writable views, no copy
    cur = _Cursor(data)
    if bytes(data[:4]) != GGUF_MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.read("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = cur.read("Q"), cur.read("Q")
    arch, alignment = "", 32
    for _ in range(n_kv):
        key, vtype = cur.string(), cur.read("I")
        if key == "general.architecture" and vtype == _STRING:
            arch = cur.string()
        elif key == "general.alignment" and vtype in _SCALARS:
            alignment = cur.read(_SCALARS[vtype])
        else:
            cur.skip_value(vtype)
    infos = []
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.read("I")
        dims = tuple(cur.read("Q") for _ in range(n_dims))
        infos.append((name, cur.read("I"), dims, cur.read("Q")))
    start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, ttype, dims, offset in infos:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        nbytes = int(np.prod(dims, dtype=np.int64)) // block * size
        lo = start + offset
        if lo + nbytes > data.size:
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        view = data[lo:lo + nbytes]
        if ttype in _FLOAT_DTYPES:
            view = view.view(_FLOAT_DTYPES[ttype])
        tensors.append(GgufTensor(name, ttype, dims, view))
    return GgufTensors(arch, tensors, data)
