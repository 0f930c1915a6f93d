"""`--activation-quantization int8`: the quantized products with x quantized to int8 per block
of 32: engine/kernels/quant_q8.c where a weight has no packed copy (up to 8 rows; AVX-512 VNNI),
quant_q8_wide.c over the copy `CpuKernels.q8_pack` makes, at every row count (AVX-512 VNNI, or
AVX2's vpmaddubsw in quant_q8_wide_avx2.h).

The reference is llama.cpp's arithmetic, written here in numpy: x rounded as quantize_row_q8_0
/ q8_1 do (d = max|x| / 127, q = round-half-even(x / d)) times gguf-py's dequantized weights in
float64. The served model is checked against transformers on the GGUF's dequantized weights
(float32; its KL to the same model with q8-rounded linear inputs is reported). Skipped on hosts
without AVX2, where the flag leaves activations in float32 with a warning."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.quant.formats import QuantWeight, quantize_int8

Q8_TYPES = ["Q8_0", "Q4_0", "Q4_1"]
Q8_ROWS = 8                           # quant_q8.c's Q8_MR


def q8_round(x: np.ndarray) -> np.ndarray:
    """x [m, k] float32 as llama.cpp's q8 activations dequantize: float32 [m, k]."""
    m, k = x.shape
    kp = -(-k // 32) * 32
    padded = np.zeros((m, kp), np.float32)
    padded[:, :k] = x
    blocks = padded.reshape(m, -1, 32)
    d = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    return (np.round(blocks * inv) * d).reshape(m, kp)[:, :k]


@pytest.fixture(scope="module")
def native():
    from engine import kernels
    lib = kernels.load()
    if lib is None or not lib.q8_available:
        pytest.skip("int8 activations need AVX-512 VNNI or AVX2 (and a C compiler)")
    return lib


def gguf_weight(name: str, n: int, k: int, rng) -> QuantWeight:
    """`[n, k]` quantized by gguf-py from random normal weights (K zero-padded to blocks)."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[name]
    kp = -(-k // 32) * 32
    w = np.zeros((n, kp), np.float32)
    w[:, :k] = rng.standard_normal((n, k))
    data = np.ascontiguousarray(quants.quantize(w, qtype))
    return QuantWeight(int(qtype), torch.from_numpy(data), (n, k))


def check_q8_products(native, w, rows, rng, out_dtypes=(torch.float32,)) -> None:
    """`w`'s int8-activation products at each row count in `rows` (strided float32 and
    bfloat16 x, bias) within float32 rounding of the q8 reference (the integer dot is exact;
    bfloat16 outputs within their own rounding)."""
    n, k = w.shape
    wd = w.dequantize().double()
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    for m in rows:
        wide = torch.from_numpy(rng.standard_normal((m, k + 7)).astype(np.float32))
        for x in (wide[:, 3:3 + k], wide[:, :k].bfloat16()):
            xq = torch.from_numpy(q8_round(x.float().contiguous().numpy())).double()
            want = xq @ wd.T + bias.double()
            for out_dtype in out_dtypes:
                y = native.quant_linear(x, w, bias, out_dtype, int8_x=True)
                err = ((y.double() - want).abs().max() / want.abs().max()).item()
                tol = 1e-5 if out_dtype == torch.float32 else 1e-2
                assert err < tol, (w.type_name, n, k, m, x.dtype, out_dtype, err)


def q8_weight(name: str, n: int, k: int, rng) -> QuantWeight:
    """A random `[n, k]` weight of block type `name` (I8: quantize_int8's)."""
    if name == "I8":
        return quantize_int8(torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)))
    return gguf_weight(name, n, k, rng)


@pytest.mark.parametrize("name", Q8_TYPES + ["I8"])
def test_int8_activation_products_are_llama_cpp_arithmetic(native, name):
    """Every type, 1..8 rows, K with a lone last block and a partial one, strided float32 and
    bfloat16 x, bias: within float32 rounding of the q8 reference (the integer dot is exact)."""
    if not native.q8_narrow:
        pytest.skip("quant_q8.c's nest over the blocks needs AVX-512 VNNI (an AVX2 build has "
                    "only the packed weights' nest)")
    rng = np.random.default_rng(1)
    for k in (32, 96, 1000):
        check_q8_products(native, q8_weight(name, 37, k, rng), range(1, Q8_ROWS + 1), rng)


@pytest.mark.parametrize("name", Q8_TYPES + ["I8"])
def test_packed_weights_take_the_wide_nest_at_any_row_count(native, name):
    """With the packed copy (quant_q8_wide.c): 1..9 rows and batches of 16, 33 and 70 (partial
    4-row tiles, more than one 64-row pass), N of 1, 37 and 64 (partial 16-row groups and
    32-row tiles), K with a lone last block and a partial one, float32 and bfloat16 outputs:
    the same arithmetic as the reference."""
    rng = np.random.default_rng(3)
    for n, k in ((1, 32), (37, 96), (64, 1000), (37, 576)):
        w = q8_weight(name, n, k, rng)
        native.q8_pack(w)
        assert w.q8_packed is not None
        check_q8_products(native, w, [*range(1, 10), 16, 33, 70], rng,
                          (torch.float32, torch.bfloat16))


@pytest.mark.parametrize("name", Q8_TYPES)
def test_products_match_gguf_py_q8_0_activations(native, name):
    """Against the library rather than this file's reading of it: x quantized by gguf-py's
    Q8_0 (`gguf.quants.quantize`, "bit-exact with ggml-quants.c"'s reference) and dequantized
    by it, times gguf-py's weights, for both nests (the blocks' and, at every row count, the
    packed copy's). Marked deviation: the kernels keep each block's d in float32 where ggml stores it as
    float16 (and round ties to even as ggml's AVX path does, where its reference rounds them
    away from zero), so the bound is float16's rounding of d, not float32's."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(5)
    k = 576
    w = gguf_weight(name, 37, k, rng)
    wd = w.dequantize().double()
    for packed, rows in ((False, (1, 2, 8)), (True, (1, 2, 16, 33))):
        if not packed and not native.q8_narrow:     # an AVX2 build: float32 products there
            continue
        if packed:
            native.q8_pack(w)
        for m in rows:
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
            q8 = GGMLQuantizationType.Q8_0
            xq = quants.dequantize(quants.quantize(x.numpy(), q8), q8)
            want = torch.from_numpy(np.ascontiguousarray(xq, np.float64)) @ wd.T
            y = native.quant_linear(x, w, None, torch.float32, int8_x=True)
            err = ((y.double() - want).abs().max() / want.abs().max()).item()
            assert err < 1e-3, (name, packed, m, err)     # the float32 path: 4e-3


@pytest.mark.parametrize("name", Q8_TYPES)
def test_each_row_is_the_same_sums_at_every_batch_size(native, name):
    """A row's int8-activation products do not depend on the rows beside it: seeded sampling
    alone equals the same request in a batch, and speculative verification keeps the plain
    decode's logits (int8 x would turn a different float32 summation order into a different
    rounding of the next layer's x). So the packed weight's nest runs at every row count."""
    rng = np.random.default_rng(6)
    w = gguf_weight(name, 48, 576, rng)
    native.q8_pack(w)
    x = torch.from_numpy(rng.standard_normal((33, 576)).astype(np.float32)).bfloat16()
    single = [native.quant_linear(x[r:r + 1], w, None, torch.float32, int8_x=True)[0]
              for r in range(33)]
    for m in (2, 3, 4, 5, 8, 9, 16, 33):
        y = native.quant_linear(x[:m], w, None, torch.float32, int8_x=True)
        for r in range(m):
            assert torch.equal(y[r], single[r]), (name, m, r)


@pytest.fixture(scope="module")
def avx2():
    """The kernels built for an AVX2 host (-march=x86-64-v3: no AVX-512, no VNNI), whose int8
    nest is quant_q8_wide_avx2.h's; skipped without AVX2 + FMA or a C compiler."""
    import ctypes

    from engine import kernels
    from engine.kernels.isa import LEVELS, host_isa, march_flags

    compiler = kernels.find_compiler()
    if compiler is None or LEVELS.index(host_isa()) < LEVELS.index("avx2"):
        pytest.skip("needs AVX2 + FMA and a C compiler")
    path = kernels.build(compiler, kernels.BASE_CFLAGS + march_flags("avx2"))
    lib = kernels.CpuKernels(ctypes.CDLL(str(path)))
    assert lib.isa == "avx2" and lib.q8_available and not lib.q8_narrow
    return lib


@pytest.mark.parametrize("name", Q8_TYPES + ["I8"])
def test_the_avx2_nest_is_the_reference_and_the_avx512_nest_bit_for_bit(avx2, name):
    """An AVX2 host's wide nest (vpmaddubsw / vpmaddwd, no VNNI): the reference's arithmetic at
    1-9, 16, 33 and 70 rows (N and K with partial groups and blocks), and — where this host also
    runs the AVX-512 VNNI nest — the same bits as that nest, so a model gives the same tokens on
    both kinds of host. Without the packed copy it keeps float32 products."""
    from engine import kernels

    rng = np.random.default_rng(7)
    native = kernels.load()
    for n, k in ((1, 32), (37, 96), (64, 1000), (37, 576)):
        w = q8_weight(name, n, k, rng)
        x = torch.from_numpy(rng.standard_normal((5, k)).astype(np.float32))
        assert torch.equal(avx2.quant_linear(x, w, int8_x=True), avx2.quant_linear(x, w))
        avx2.q8_pack(w)
        assert w.q8_packed is not None
        check_q8_products(avx2, w, [*range(1, 10), 16, 33, 70], rng,
                          (torch.float32, torch.bfloat16))
        if native is None or not native.q8_narrow:
            continue
        mine = QuantWeight(w.qtype, w.data, w.shape, w.scale)      # the native build's copy
        native.q8_pack(mine)
        for m in (1, 2, 3, 4, 16, 33):
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).bfloat16()
            assert torch.equal(avx2.quant_linear(x, w, None, torch.float32, int8_x=True),
                               native.quant_linear(x, mine, None, torch.float32, int8_x=True))


def test_more_rows_and_k_types_take_the_float_path(native):
    """Past 8 rows without a packed copy, and for Q4_K (no int8 kernel, nothing to pack), the
    result is quant_linear's exactly."""
    from tests.test_quant import random_blocks

    w = gguf_weight("Q4_1", 40, 256, np.random.default_rng(2))
    x = torch.randn(Q8_ROWS + 1, 256)
    assert torch.equal(native.quant_linear(x, w, int8_x=True), native.quant_linear(x, w))
    qk = random_blocks("Q4_K", 8, 256)
    native.q8_pack(qk)
    assert qk.q8_packed is None
    x = torch.randn(12, 256)
    assert torch.equal(native.quant_linear(x, qk, int8_x=True), native.quant_linear(x, qk))


def test_linears_with_the_flag_carry_the_packed_copy(native):
    """An int8-activation `Linear` over Q4_1 blocks packs its weight once (the wide nest reads
    it at every row count); one without the flag does not."""
    from engine.linear import Linear

    rng = np.random.default_rng(4)
    w = gguf_weight("Q4_1", 48, 64, rng)
    assert Linear(w, kernels=native).parts[0].q8_packed is None
    lin = Linear(w, kernels=native, int8_x=True)
    assert lin.parts[0].q8_packed is not None
    x = torch.randn(12, 64)
    want = torch.from_numpy(q8_round(x.numpy())).double() @ w.dequantize().double().T
    assert ((lin(x).double() - want).abs().max() / want.abs().max()).item() < 1e-5


def fake_quant_hooks(model) -> list:
    """Round every nn.Linear's input as llama.cpp's q8 activations are rounded."""
    def hook(_module, args):
        x = args[0]
        rows = x.reshape(-1, x.shape[-1])
        q = torch.from_numpy(q8_round(rows.detach().float().numpy())).to(x.dtype)
        return (q.reshape(x.shape),)
    return [mod.register_forward_pre_hook(hook) for mod in model.modules()
            if isinstance(mod, torch.nn.Linear)]


def test_served_model_stays_near_float32(native, model_dir, tokenizer):
    """The embedded GGUF served with `--activation-quantization int8` (float32), against
    transformers on the same dequantized weights in float32: the engine's logprob of each token
    it generated within 0.5 (mean under 0.1), and the arithmetic's KL(float32 || q8-rounded
    inputs at every linear), reported and bounded (docs/quantization.md has the figures).

    Not token-exact against a q8 reference: rounding to int8 is discontinuous, so float32 noise
    of 1e-7 in a linear's input (summation order) moves this model's logits by up to ~0.1 and
    can flip a greedy choice; the exact arithmetic is the kernel test above."""
    from transformers import AutoModelForCausalLM

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from scheduler.request import SamplingParams
    from tests.test_quant import PROMPTS

    eng = LLMEngine(EngineConfig(kv_cache_memory=0.25, max_model_len=512, dtype="float32",
                                 device="cpu", activation_quantization="int8"))
    assert eng.quant.int8_activations and "int8 activations" in eng._linear_description()
    ids = [tokenizer.encode(p) for p in PROMPTS + ["Hi"]]
    for i, p in enumerate(ids):
        eng.add_request(str(i), p, SamplingParams(max_tokens=16, temperature=0, logprobs=0))
    got: dict[int, list] = {i: [] for i in range(len(ids))}
    while eng.has_unfinished_requests():
        for out in eng.step():
            got[int(out.request_id)].extend(out.outputs[0].logprobs or [])
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    hq = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    fake_quant_hooks(hq)
    gaps, kls, agree, total = [], [], 0, 0
    for i, p in enumerate(ids):
        out = [lp.token_id for lp in got[i]]
        with torch.inference_mode():
            full = torch.tensor([p + out])
            a, b = hf(full).logits[0].log_softmax(-1), hq(full).logits[0].log_softmax(-1)
        kls.append((a.exp() * (a - b)).sum(-1))
        steps = a[len(p) - 1:-1]                      # float32's distribution at each step
        gaps += [abs(steps[j, t].item() - lp.logprob) for j, (t, lp) in enumerate(zip(out,
                                                                                       got[i]))]
        agree += sum(int(steps[j].argmax()) == t for j, t in enumerate(out))
        total += len(out)
    kl, gap = torch.cat(kls), torch.tensor(gaps)
    print(f"int8 activations: KL to float32 mean {kl.mean():.4f}, p99 {kl.quantile(0.99):.4f},"
          f" max {kl.max():.4f}; served logprob vs float32: mean |diff| {gap.mean():.4f}, "
          f"max {gap.max():.4f}; greedy = float32's argmax at {agree} of {total} steps")
    assert kl.mean() < 0.01 and kl.quantile(0.99) < 0.1
    assert gap.mean() < 0.1 and gap.max() < 0.5


def test_auto_is_int8_where_int8_products_have_no_bfloat16_rival():
    """`--activation-quantization auto` (the default) per host class: int8 over quantized
    weights where the kernels have VNNI and the host no fast bfloat16 matmul units (an Ice Lake
    or Cascade Lake Xeon; an Intel core with AVX512-BF16 but no AMX tiles, whose `vdpbf16ps`
    runs at half float32 FMAs' rate) and on AVX2-only hosts (EPYC Milan), unless `--dtype
    float32`; the bfloat16 units' products elsewhere (AMX tiles, a Zen 5's AVX512-BF16);
    float32 products on AVX-512 without VNNI (Skylake)."""
    from engine.quant import auto_int8_activations

    intel, amd = "GenuineIntel", "AuthenticAMD"
    milan = {"avx2", "fma", "f16c"}
    skylake = milan | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    ice_lake = skylake | {"avx512_vnni"}
    zen5 = ice_lake | {"avx512_bf16"}
    cooper_lake = zen5                      # or a Sapphire Rapids with AMX hidden
    sapphire = zen5 | {"amx_tile", "amx_bf16", "amx_int8"}
    for host, vendor in ((ice_lake, intel), (milan, amd), (cooper_lake, intel)):
        assert auto_int8_activations(True, "auto", host, vendor)
        assert auto_int8_activations(True, "bfloat16", host, vendor)
        assert not auto_int8_activations(True, "float32", host, vendor)    # the exact reference
        assert not auto_int8_activations(False, "auto", host, vendor)      # a build without them
    assert not auto_int8_activations(True, "auto", skylake, intel)
    assert not auto_int8_activations(True, "auto", zen5, amd)
    assert not auto_int8_activations(True, "auto", sapphire, intel)


def test_auto_follows_a_cap_to_avx2(monkeypatch):
    """On this host capped at AVX2 (`CONTINUUM_CPU_ISA=avx2`, as `make test`'s second pass) the
    default is int8 — an AVX2 host's — whatever the host's own bfloat16 units."""
    from engine.kernels.isa import LEVELS, cpu_isa, host_isa
    from engine.quant import auto_int8_activations

    if LEVELS.index(host_isa()) < LEVELS.index("avx2"):
        pytest.skip("needs AVX2 + FMA")
    monkeypatch.setenv("CONTINUUM_CPU_ISA", "avx2")
    cpu_isa.cache_clear()
    try:
        assert auto_int8_activations(True, "auto")
        assert not auto_int8_activations(True, "float32")
    finally:
        monkeypatch.undo()
        cpu_isa.cache_clear()


def serve_the_readme_question(tmp_path) -> str:
    """`make serve`'s configuration (a small KV budget) in this process's environment, asked the
    README's question through the OpenAI SDK: the answer names Tokyo. Returns the server log."""
    from openai import OpenAI

    from tests.conftest import start_server, stop_server

    # ready, not just live: a kernel build for the cap may outlast the SDK's retries of a 503
    proc, base = start_server(["--kv-cache-memory", "0.2", "--max-model-len", "512"],
                              "/health/ready", tmp_path / "server.log")
    try:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        chat = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", temperature=0, max_tokens=12,
            messages=[{"role": "user", "content": "What is the capital of Japan?"}])
        assert "Tokyo" in chat.choices[0].message.content
    finally:
        stop_server(proc)
    return (tmp_path / "server.log").read_text()


@pytest.mark.extended          # its own server and kernel build; the choice is checked above
def test_a_host_without_bfloat16_units_serves_int8_activations_by_default(monkeypatch, tmp_path):
    """`make serve`'s configuration on an AVX-512 VNNI host without BF16 — this host with
    `CONTINUUM_CPU_HIDE=avx512_bf16` — serves the blocks with int8 activations, says so in the
    ready log, and answers the README's question as the bfloat16 default does elsewhere."""
    from engine.kernels.isa import cpu_flags

    if not {"avx512_vnni", "avx512_bf16"} <= cpu_flags():
        pytest.skip("needs AVX-512 VNNI and BF16 to hide (an EPYC Zen 4 / 5, an AMX Xeon)")
    monkeypatch.delenv("CONTINUUM_CPU_ISA", raising=False)     # a cap below avx512 has no VNNI
    monkeypatch.setenv("CONTINUUM_CPU_HIDE", "avx512_bf16")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI")
    log = serve_the_readme_question(tmp_path)
    assert "int8 activations (vnni), cpu isa: avx512 (vnni)" in log


@pytest.mark.extended          # its own server and kernel build; the choice is checked above
def test_an_avx2_host_serves_bfloat16_over_int8_products_by_default(monkeypatch, tmp_path):
    """`make serve`'s configuration at the AVX2 level — this host capped as `make test`'s second
    pass caps it — serves the blocks with int8 activations (`vpmaddubsw`) and a bfloat16 KV
    cache, says so in the ready log, and answers the README's question."""
    from engine.kernels.isa import LEVELS, host_isa

    if LEVELS.index(host_isa()) < LEVELS.index("avx2"):
        pytest.skip("needs AVX2 + FMA")
    for name, value in (("CONTINUUM_CPU_ISA", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2"),
                        ("ATEN_CPU_CAPABILITY", "avx2")):
        monkeypatch.setenv(name, value)
    log = serve_the_readme_question(tmp_path)
    assert "on cpu (bfloat16)" in log
    assert "int8 activations (avx2), cpu isa: avx2" in log


def test_flag_needs_quantized_weights(model_dir):
    """int8 activations over float weights is a one-line start error naming the flag."""
    from engine.device import resolve_device
    from engine.quant import resolve_quantization

    with pytest.raises(ValueError, match="--activation-quantization int8 needs quantized"):
        resolve_quantization("none", None, resolve_device("cpu"), "int8")
    with pytest.raises(ValueError, match="--activation-quantization must be one of"):
        resolve_quantization(None, None, resolve_device("cpu"), "fp8")


@pytest.mark.extended          # its own server; the path itself is checked above
def test_served_over_openai_with_the_flag(native, tmp_path):
    """`continuum serve --activation-quantization int8` (bfloat16): the ready log names the
    path, streamed and whole completions from the OpenAI SDK agree, a bad value of the flag is a
    one-line start error."""
    import subprocess
    import sys

    import openai

    from tests.conftest import start_server, stop_server

    log = tmp_path / "server.log"
    proc, base = start_server(["--activation-quantization", "int8", "--dtype", "bfloat16",
                               "--max-model-len", "512", "--kv-cache-memory", "0.25"],
                              "/health/ready", log)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x")
        model = client.models.list().data[0].id
        whole = client.completions.create(model=model, prompt="The capital of France is",
                                          max_tokens=12, temperature=0)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=12, temperature=0,
            stream=True))
        assert whole.usage.completion_tokens == 12 and streamed == whole.choices[0].text
    finally:
        stop_server(proc)
    assert f"int8 activations ({'avx2' if native.isa == 'avx2' else 'vnni'})" in log.read_text()
    bad = subprocess.run([sys.executable, "-m", "api", "serve", "--activation-quantization",
                          "fp8"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--activation-quantization" in bad.stderr
