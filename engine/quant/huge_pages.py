"""Quantized weights in transparent huge pages.

Owns `to_huge_pages`: the block data of a model's `QuantWeight`s and the repacked copies the
kernels read instead of the blocks (`q8_packed`: the int8-activation nest's, which an AVX2 or
AVX-512 VNNI host reads at every row count; `panel_packed`: the bfloat16 panels') copied into
one anonymous mapping advised `MADV_HUGEPAGE` (Linux's transparent huge pages: 2 MiB pages for
a mapping that asks, where `/sys/kernel/mm/transparent_hugepage/enabled` is `madvise` — the
usual default — or `always`), each weight's tensors then views of their copies. In: weights
whose kernel arguments the kernels have not yet been handed (the layer stack takes them after
the model is built); out: the bytes moved.

Why: a decode step streams every block of every quantized linear (~96 MB for the embedded
model); in 4 KiB pages that is ~24,000 pages a step, each a TLB miss and a page walk, and the
hardware prefetchers stop at every page boundary. GGUF blocks otherwise sit in the file's page
cache mapping (4 KiB pages) or in torch's allocations (no huge pages under `madvise`). Measured
in one process, the same weights in both placements called in alternation (the embedded model's
121 products, Emerald Rapids under KVM, docs/cpu.md "Session 29"): 0.87-0.96x the time at one
row of x, 0.93-0.97x at 16 and 64. The repacked copies stayed in torch's 4 KiB pages until
session 40, although on an AVX2 host they are all a decode step reads: there, moving them too
took the 121 products at one row to 0.92-0.97x the time (AMD EPYC Zen 3, alternating; 1.00x at
16 rows, where the products are bound by arithmetic).
"""

from __future__ import annotations

import logging
import mmap
from pathlib import Path

import torch

from engine.quant.formats import QuantWeight

logger = logging.getLogger("continuum.quant")

HUGE_PAGE = 2 << 20          # bytes: x86-64's transparent huge page
ALIGN = 4096                 # bytes between the start of one weight's copy and the next
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MOVED = ("data", "q8_packed", "panel_packed")   # the QuantWeight tensors a step may read


def thp_mode() -> str:
    """The kernel's transparent huge page mode ("always", "madvise" or "never"); "never"
    where the file is missing (not Linux, or a kernel without THP)."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return "never"
    return text[text.find("[") + 1:text.find("]")] if "[" in text else "never"


def to_huge_pages(weights: list[QuantWeight]) -> int:
    """Copy each weight's blocks (`data`, uint8 `[N, row_bytes]`) and its repacked copies
    (`q8_packed`, `panel_packed`, uint8, where present) into one anonymous mapping advised for
    huge pages and point the attributes at the copies (the same values; `kernel_args` taken
    afresh). Weights listed twice (a tied embedding and LM head) are moved once. Returns the
    bytes moved: 0 where the kernel's THP mode is "never", madvise is missing, or the tensors
    are smaller than one huge page (nothing is changed then). Never raises: a mapping or an
    advice the kernel refuses leaves the weights where they were, with one log line."""
    unique = list({id(w): w for w in weights}.values())
    moves = [(w, name) for w in unique for name in MOVED if getattr(w, name) is not None]
    sizes = [-(-getattr(w, name).numel() // ALIGN) * ALIGN for w, name in moves]
    total = sum(sizes)
    if total < HUGE_PAGE or thp_mode() == "never" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0
    try:
        buf = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arena = torch.frombuffer(buf, dtype=torch.uint8)  # holds buf alive
        offset = (-arena.data_ptr()) % HUGE_PAGE
        buf.madvise(mmap.MADV_HUGEPAGE, offset, total)
    except OSError as e:
        logger.info("quantized weights stay where they were: no %d-byte huge-page mapping "
                    "(%s)", total, e)
        return 0
    for (w, name), size in zip(moves, sizes):
        old = getattr(w, name)
        copy = arena[offset:offset + old.numel()].view(old.shape)
        copy.copy_(old)
        setattr(w, name, copy)
        offset += size
    for w in unique:
        w.__dict__.pop("kernel_args", None)               # its cached address is stale
    return total
