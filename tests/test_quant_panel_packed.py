"""The bfloat16 panels' repacked weights (engine/kernels/quant_panel.c, `CpuKernels.panel_pack`):
the products read from the copy equal, bit for bit, those of the panels over the blocks, for
every type it covers (Q4_0, Q4_1, Q8_0, I8), at row counts that take the panels (5 and more:
quant.c's PACKED_PANEL_ROWS; without the copy 5-8 rows take the fused bfloat16 nest; 4 rows
the float32 one either way),
N that leave partial groups of 16 and panels of 48, K with a partial last block, float32 and
bfloat16 outputs with a bias, strided x; and they stay the dequantized model's products
(gguf-py's dequantization, float64). A bfloat16 model's `Linear` carries the copy; a float32 or
int8-activation one does not. Skipped where the build has no AVX512-BF16 (no copy is made).

The served greedy parity of the default (bfloat16) path, which reads the copy from 5 rows on
(prefills, batched decode), is tests/test_engine_correctness.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.quant.formats import QuantWeight, quantize_int8
from tests.test_quant import assert_close, reference


@pytest.fixture(scope="module")
def native():
    """The engine's kernels; on an AMX host, whose tiles take bfloat16 x before the panels
    would (no copy is made there), conftest's avx512-no-amx build: what an AVX512-BF16 EPYC,
    or this host under CONTINUUM_CPU_ISA=avx512, runs. Its pairs' panels at every row count
    (`set_vector_pairs(True)`, an EPYC's setting; restored after the module) also on an Intel
    core without AMX, which takes float32 panels from 16 rows (the test below)."""
    from engine import kernels
    from engine.kernels.isa import host_isa
    from tests.conftest import kernels_at
    lib = kernels.load()
    if host_isa() == "amx" and lib is not None:
        lib = kernels_at("avx512")
    if lib is None or lib._fn["quant_panel_packed_bytes"](3, 16, 32) <= 0:
        pytest.skip("the repacked panels are built for AVX512-BF16 hosts; this build has none")
    was = lib.vector_pairs
    lib.set_vector_pairs(True)
    yield lib
    lib.set_vector_pairs(was)


def weight(name: str, n: int, k: int, rng) -> QuantWeight:
    """`[n, k]` of random normal weights quantized to `name` (gguf-py, or quantize_int8)."""
    if name == "I8":
        return quantize_int8(torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)))
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[name]
    kp = -(-k // 32) * 32
    w = np.zeros((n, kp), np.float32)
    w[:, :k] = rng.standard_normal((n, k))
    return QuantWeight(int(qtype), torch.from_numpy(np.ascontiguousarray(quants.quantize(w, qtype))),
                       (n, k))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "I8"])
def test_repacked_panels_equal_the_blocks(native, name):
    rng = np.random.default_rng(7)
    for n, k in [(16, 32), (37, 64), (100, 96), (53, 200)]:
        w = weight(name, n, k, rng)
        blocks_only = QuantWeight(w.qtype, w.data, w.shape, w.scale)
        native.panel_pack(w)
        assert w.panel_packed is not None and blocks_only.panel_packed is None
        deq = reference(w)[:, :k] if name != "I8" else w.dequantize().double()
        bias = torch.randn(n)
        for m in (4, 5, 8, 9, 16, 33, 70):
            x = torch.randn(m, k + 3)[:, :k].bfloat16()          # strided rows
            for out in (torch.float32, torch.bfloat16):
                got = native.quant_linear(x, w, bias, out)
                if m >= 9:       # the blocks' own panels: the same products, the same bits
                    assert torch.equal(got, native.quant_linear(x, blocks_only, bias, out)), \
                        (n, k, m)
                # bfloat16-rounded weights (and outputs): 2^-9 of each product's magnitude
                # at most, each
                assert_close(got, x, deq, bias, 5e-3)


def test_up_to_four_rows_give_each_row_its_single_row_result(native):
    """Below the panels (quant.c's PACKED_PANEL_ROWS) a weight with the copy keeps the float32
    nest, which gives each row exactly its single-row product: a speculative verification of up
    to 3 drafts has the plain decode's logits (tests/test_spec_decode_engine.py's logprobs)."""
    rng = np.random.default_rng(5)
    w = weight("Q4_1", 96, 576, rng)
    native.panel_pack(w)
    for m in (2, 3, 4):
        x = torch.randn(m, 576).bfloat16()
        rows = torch.cat([native.quant_linear(x[r:r + 1], w) for r in range(m)])
        assert torch.equal(native.quant_linear(x, w), rows), m


def test_k_quants_and_other_builds_get_no_copy(native):
    """The 256-value K-quants have no repacked layout: `panel_pack` leaves them as they are."""
    from tests.test_quant import random_blocks

    w = random_blocks("Q4_K", 48, 256)
    native.panel_pack(w)
    assert w.panel_packed is None
    x = torch.randn(16, 256).bfloat16()
    assert_close(native.quant_linear(x, w, None, torch.float32), x, reference(w), None, 5e-3)


def test_bfloat16_linears_carry_the_copy(native):
    """A quantized `Linear` of a bfloat16 model packs its weight once; a float32 model's, or one
    with int8 activations (the wide nest has its own copy), does not; results equal."""
    from engine.linear import Linear

    rng = np.random.default_rng(3)
    w = weight("Q4_1", 96, 128, rng)
    plain = Linear(QuantWeight(w.qtype, w.data, w.shape), kernels=native)
    assert plain.parts[0].panel_packed is None
    lin = Linear(w, kernels=native, bf16_x=True)
    assert lin.parts[0].panel_packed is not None
    q8 = Linear(QuantWeight(w.qtype, w.data, w.shape), kernels=native, bf16_x=True, int8_x=True)
    assert q8.parts[0].panel_packed is None
    x = torch.randn(24, 128).bfloat16()
    assert torch.equal(lin(x), plain(x))


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K"])
def test_slow_pair_hosts_take_float32_panels_from_16_rows(native, name):
    """Where vdpbf16ps runs at half float32 FMAs' rate (an Intel core without AMX:
    `set_vector_pairs(False)`, the engine's setting there) a bfloat16 x of 16 rows and more
    takes the float32 panels — the float32 x's products bit for bit, weights not rounded to
    bfloat16 — and up to 15 rows the pairs' nests as everywhere (quant.c's
    quant_pair_panel_rows, SLOW_PAIR_PANEL_ROWS)."""
    from engine.kernels import SLOW_PAIR_PANEL_ROWS
    from tests.test_quant import random_blocks

    rng = np.random.default_rng(11)
    w = weight(name, 100, 256, rng) if name == "Q4_1" else random_blocks(name, 100, 512)
    native.panel_pack(w)
    xs = {m: torch.randn(m, w.shape[1]).bfloat16() for m in (8, SLOW_PAIR_PANEL_ROWS, 16, 33)}
    paired = {m: native.quant_linear(x, w, None, torch.float32) for m, x in xs.items()}
    try:
        native.set_vector_pairs(False)
        for m, x in xs.items():
            got = native.quant_linear(x, w, None, torch.float32)
            if m > SLOW_PAIR_PANEL_ROWS:
                assert torch.equal(got, native.quant_linear(x.float(), w, None, torch.float32))
                assert not torch.equal(got, paired[m]), m      # the pairs round W to bfloat16
            else:
                assert torch.equal(got, paired[m]), m
    finally:
        native.set_vector_pairs(True)
