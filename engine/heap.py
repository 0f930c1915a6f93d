"""The process's heap, without torch (the API front end calls it before any engine module
loads): `freeze_heap` after a load, `trim_heap` when the engine goes idle."""

from __future__ import annotations

import ctypes
import gc
from functools import lru_cache


def freeze_heap() -> None:
    """Collect, then move every object alive (imports, models, tokenizer: ~0.4-0.5 M objects
    with torch) to the collector's permanent generation (`gc.freeze`): a full collection then
    scans only what requests allocate. Measured: one over a built engine's heap took 226 ms
    (0 ms after the freeze), a stall of every running request. Called by the API server when a
    load finishes and by the engine core process once its engine is built."""
    gc.collect()
    gc.freeze()


def trim_heap() -> None:
    """Give the heap's free memory back to the operating system (glibc's `malloc_trim(0)`;
    nothing elsewhere). Freed activations of a burst otherwise stay resident: glibc raises its
    mmap threshold as large blocks are freed, so later ones come from the heap and keep it
    grown (measured: 270-550 MiB of heap left in an idle engine after 64 concurrent requests).
    The engine core calls it when it goes idle."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's malloc_trim from this process's own symbols, or None (another C library)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
