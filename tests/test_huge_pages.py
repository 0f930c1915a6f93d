"""engine/quant/huge_pages.py: a model's quantized blocks moved into a mapping advised for
transparent huge pages compute the same products, each weight once, and nothing moves where the
kernel has THP off or the weights are too small to fill a huge page."""

from __future__ import annotations

import pytest
import torch

from engine.quant import huge_pages
from engine.quant.formats import QuantWeight
from engine.quant.huge_pages import HUGE_PAGE, thp_mode, to_huge_pages


def q4_1(n: int, k: int, seed: int) -> QuantWeight:
    """Random Q4_1 blocks `[n, k]` with finite float16 scales (d = 2^-4, m = -2^-4)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (n, k // 32 * 20), dtype=torch.uint8, generator=g)
    blocks = data.view(n, k // 32, 20)
    blocks[:, :, 0:2] = torch.tensor([0x00, 0x2c], dtype=torch.uint8)
    blocks[:, :, 2:4] = torch.tensor([0x00, 0xac], dtype=torch.uint8)
    return QuantWeight(3, data, (n, k))


def smaps_field(addr: int, field: str) -> str | None:
    """`field` of the /proc/self/smaps entry whose range holds `addr`."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    return None


def test_moved_weights_compute_the_same_products():
    from engine import kernels as K

    kernels = K.load()
    if kernels is None:
        pytest.skip("no C compiler: the CPU kernels cannot be built")
    if thp_mode() == "never":
        pytest.skip("transparent huge pages are off on this kernel")
    ws = [q4_1(3072, 576, 0), q4_1(1536, 1536, 1)]              # 2.6 MB of blocks
    x = {k: torch.randn(3, k, generator=torch.Generator().manual_seed(k)) for k in (576, 1536)}
    before = [kernels.quant_linear(x[w.shape[1]], w) for w in ws]
    old = [w.data.data_ptr() for w in ws]
    moved = to_huge_pages(ws + ws[:1])                          # listed twice: moved once
    assert moved == sum(-(-w.data.numel() // 4096) * 4096 for w in ws) >= HUGE_PAGE
    for w, addr in zip(ws, old):
        assert w.data.data_ptr() != addr and w.data.data_ptr() % 4096 == 0
        assert w.kernel_args[1] == w.data.data_ptr()
    assert ws[0].data.data_ptr() % HUGE_PAGE == 0
    assert smaps_field(ws[0].data.data_ptr(), "THPeligible") == "1"
    after = [kernels.quant_linear(x[w.shape[1]], w) for w in ws]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_repacked_copies_move_with_the_blocks_and_compute_the_same_products():
    """The int8-activation nest's copy (`q8_packed`) is all an AVX2 host's decode step reads:
    it moves into the huge pages too, and the products read from there are the same bits."""
    from engine import kernels as K

    kernels = K.load()
    if kernels is None:
        pytest.skip("no C compiler: the CPU kernels cannot be built")
    if thp_mode() == "never":
        pytest.skip("transparent huge pages are off on this kernel")
    if not kernels.q8_available:
        pytest.skip("this build has no int8-activation nest (neither AVX2 nor AVX-512 VNNI)")
    ws = [q4_1(3072, 576, 0), q4_1(1536, 1536, 1)]
    for w in ws:
        kernels.q8_pack(w)
    x = {k: torch.randn(1, k, generator=torch.Generator().manual_seed(k)) for k in (576, 1536)}
    before = [kernels.quant_linear(x[w.shape[1]], w, int8_x=True) for w in ws]
    old = [(w.data.data_ptr(), w.q8_packed.data_ptr()) for w in ws]
    moved = to_huge_pages(ws)
    assert moved == sum(-(-t.numel() // 4096) * 4096 for w in ws for t in (w.data, w.q8_packed))
    for w, (data, packed) in zip(ws, old):
        assert w.data.data_ptr() != data and w.q8_packed.data_ptr() != packed
        assert smaps_field(w.q8_packed.data_ptr(), "THPeligible") == "1"
    after = [kernels.quant_linear(x[w.shape[1]], w, int8_x=True) for w in ws]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_nothing_moves_with_thp_off_or_too_few_bytes(tmp_path, monkeypatch):
    ws = [q4_1(1536, 576, 0), q4_1(576, 1536, 1)]
    old = [w.data.data_ptr() for w in ws]
    off = tmp_path / "enabled"
    off.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_ENABLED", off)
    assert thp_mode() == "never" and to_huge_pages(ws) == 0
    monkeypatch.setattr(huge_pages, "THP_ENABLED", tmp_path / "missing")
    assert thp_mode() == "never" and to_huge_pages(ws) == 0
    off.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "THP_ENABLED", off)
    assert thp_mode() == "madvise"
    assert to_huge_pages([q4_1(64, 576, 2)]) == 0                # 23 KB: under one huge page
    big = [q4_1(3072, 576, 0), q4_1(1536, 1536, 1)]
    big_old = [w.data.data_ptr() for w in big]

    class Refused:
        MAP_PRIVATE = MAP_ANONYMOUS = MADV_HUGEPAGE = 0

        @staticmethod
        def mmap(*args, **kwargs):
            raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(huge_pages, "mmap", Refused)
    assert to_huge_pages(big) == 0                               # no mapping: left in place
    assert [w.data.data_ptr() for w in ws + big] == old + big_old
