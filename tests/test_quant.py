"""Quantized weights (`--quantization gguf | int8`): the block kernels (engine/kernels/quant.c)
of every type and build against gguf-py's numpy dequantization in float64; the GGUF reader
against transformers' own conversion; int8 against its dequantized model with its KL to float32
reported; a GGUF holding a type without a kernel, and mixed types in one fused projection,
served by a real server to the OpenAI SDK; a quantized draft for a float32 target.

The greedy parity of the embedded model served as its GGUF blocks (alone, concurrent, chunked,
prefix hits, both preemptions) is tests/test_engine_correctness.py: that is the default path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.checkpoints import random_blocks  # noqa: F401  (the tests' import of it)
from engine.quant.formats import KERNEL_TYPES, TYPE_IDS, QuantWeight, quantize_int8
from tests.greedy import ends_as_generate_would, eos_ids

GGUF_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]


def reference(w: QuantWeight) -> torch.Tensor:
    """float64 `[n, k]` from gguf-py's numpy dequantization (ggml's formulas)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    return torch.from_numpy(dequantize(w.data.numpy(), GGMLQuantizationType(w.qtype))
                            .astype(np.float64))


def assert_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias, rel: float) -> None:
    """y ≈ x @ w.T + bias, each output within `rel` of the sum of its products' magnitudes."""
    x64 = x.double()
    want = x64 @ w.T + (0 if bias is None else bias.double())
    scale = x64.abs() @ w.abs().T + 1e-30
    err = ((y.double() - want).abs() / scale).max().item()
    assert err < rel, err


@pytest.mark.parametrize("name", GGUF_TYPES)
@pytest.mark.parametrize("m", [1, 3, 5, 33])
def test_blocks_match_gguf_py(lib, name, m):
    """Every nest (1 and 3 rows fused, 5 and 33 in panels: 33 = four tiles of 8 rows and one of
    1 on AVX-512; 53 W rows: a whole panel of 48 and a partial one), strided x, bias."""
    k = 512 if KERNEL_TYPES[TYPE_IDS[name]][1] == 256 else 96
    w = random_blocks(name, 53, k, seed=m)
    wide = torch.randn(m, k + 8)
    x = wide[:, 3:3 + k]                                   # rows strided, columns contiguous
    bias = torch.randn(53) if m % 2 else None
    y = lib.quant_linear(x, w, bias, torch.float32)
    assert y.shape == (m, 53) and y.dtype == torch.float32
    assert_close(y, x, reference(w), bias, 1e-6)


@pytest.mark.parametrize("name", GGUF_TYPES)
@pytest.mark.parametrize("m", [1, 3, 8, 13, 29, 40])
def test_bfloat16_activations(lib, name, m):
    """A bfloat16 model's call: bfloat16 in and out. Above four rows an AVX512-BF16 host rounds
    the weights to bfloat16 as the bfloat16 model does and multiplies in bfloat16 pairs (8
    rows: the fused nest; 13, 29 and 40: panels, tiles of 8 rows and what is left)."""
    w = random_blocks(name, 70, 256, seed=m)
    x = torch.randn(m, 256).bfloat16()
    y = lib.quant_linear(x, w)
    assert y.dtype == torch.bfloat16
    ref = reference(w)
    assert_close(y.float(), x.float(), ref.float().bfloat16().double(), None, 1e-2)


AMX_SHAPES = {"Q8_0": [32, 96, 608], "Q4_0": [32, 608], "Q4_1": [96, 608], "Q4_K": [256, 768],
              "Q6_K": [256, 768], "I8": [5, 100, 600]}


@pytest.mark.parametrize("name", list(AMX_SHAPES))
@pytest.mark.parametrize("m", [1, 8, 16, 17, 33, 64, 100, 300])
def test_amx_tiles_match_gguf_py(amx_lib, name, m):
    """The AMX tile nest (quant_amx.c) at every row count (300: a chunk of 256 rows and the
    rest) for every block type: N of 1 to 96 (partial 16- and 32-row units), K of one step to
    an odd number of steps, int8's K not a multiple of 32; x strided with NaN past K (an edge
    read of x would leak it, as oneDNN #5717 did); bias on odd rows (float32 out). float32 out
    against the float64 product of gguf-py's weights rounded to bfloat16 (the bfloat16
    model's), bfloat16 out within its rounding."""
    lib = amx_lib
    for n in (1, 17, 53, 96):
        for k in AMX_SHAPES[name]:
            if name == "I8":
                w = quantize_int8(torch.randn(n, k))
                ref = w.dequantize().double()                     # q * scale: exact in bf16
            else:
                w = random_blocks(name, n, k, seed=m + n)
                ref = reference(w).float().bfloat16().double()
            wide = torch.full((m, k + 11), float("nan"), dtype=torch.bfloat16)
            wide[:, 3:3 + k] = torch.randn(m, k).bfloat16()
            x = wide[:, 3:3 + k]
            bias = torch.randn(n) if m % 2 else None
            y = lib.quant_linear(x, w, bias, torch.float32)
            assert torch.isfinite(y).all(), (name, n, k)
            assert_close(y, x.float(), ref, bias, 1e-5)
            yb = lib.quant_linear(x, w)            # no bias: the check's scale leaves it out
            assert yb.dtype == torch.bfloat16
            assert_close(yb.float(), x.float(), ref, None, 1e-2)


def test_int8_rows_and_padded_k(lib):
    """Per-channel int8 of a weight whose K is not a multiple of 32: padded with zeros, scaled
    per row; the lookup of rows (embedding) dequantizes the same values."""
    wf = torch.randn(50, 100)
    q = quantize_int8(wf)
    assert q.data.shape == (50, 128) and q.scale.shape == (50,)
    deq = q.dequantize()
    assert (deq - wf).abs().max() <= q.scale.max() / 2 + 1e-6         # half a step at most
    for m in (1, 7):
        x = torch.randn(m, 100)
        assert_close(lib.quant_linear(x, q, None, torch.float32), x, deq.double(), None, 1e-6)
    ids = torch.tensor([0, 49, 7, 7])
    assert torch.equal(lib.quant_embed(q, ids, torch.float32), deq[ids])
    with pytest.raises(IndexError):
        lib.quant_embed(q, torch.tensor([50]), torch.float32)


def test_embedding_rows_of_each_type(lib):
    for name in GGUF_TYPES:
        w = random_blocks(name, 9, 256)
        ids = torch.tensor([8, 0, 3])
        got = lib.quant_embed(w, ids, torch.float32)
        assert torch.allclose(got.double(), reference(w)[ids], rtol=1e-6, atol=1e-6), name


def test_a_type_without_kernel_is_refused_by_the_kernels(lib):
    w = QuantWeight(6, torch.zeros(4, 22, dtype=torch.uint8), (4, 32))          # Q5_0
    with pytest.raises(ValueError, match="no kernel"):
        lib.quant_linear(torch.zeros(1, 32), w)


def test_gguf_tensors_are_transformers_conversion(model_dir):
    """The reader's names, and llama.cpp's Q / K row order undone, as transformers converts the
    same file: every tensor dequantized equals the converted float32 checkpoint exactly."""
    from safetensors.torch import load_file

    from engine.loader import embedded_gguf_path
    from engine.quant.gguf_weights import read_gguf_weights

    ours, kept, _ = read_gguf_weights(embedded_gguf_path(), 9, 3)
    assert kept == ["Q4_1", "Q8_0"]
    theirs = load_file(str(model_dir / "model.safetensors"))
    assert set(ours) == set(theirs)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.embed_tokens.weight",
                 "model.layers.7.input_layernorm.weight"):
        t = ours[name]
        got = t.dequantize() if isinstance(t, QuantWeight) else t
        assert torch.equal(got, theirs[name]), name


# ----------------------------------------------------------------------------- models
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, a robot"]


def hf_int8_model(model_dir):
    """transformers' model with every 2-d weight replaced by its int8 dequantization: the
    model `--quantization int8` computes (up to the order of float32 sums)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(quantize_int8(p).dequantize())
    return model


def greedy_up_to_a_near_tie(logits, ours, tie=1e-3) -> bool:
    """Whether `ours` (n tokens) is the greedy continuation whose teacher-forced logits (or
    log-probabilities) `logits` `[n, vocab]` predict each of them: every token the argmax at its
    position up to the first one that is not, which must be within `tie` of the top (a near
    tie, where transformers' own `generate` would turn elsewhere and nothing after it can be
    compared)."""
    for row, token in zip(logits, ours):
        top = float(row.max())
        if int(row.argmax()) != token:
            return top - float(row[token]) < tie
    return True


def first_difference_is_a_near_tie(hf, prompt_ids, ours, ref, tie=1e-3) -> bool:
    i = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if i is None:
        return len(ours) == len(ref)
    with torch.inference_mode():
        top = hf(torch.tensor([prompt_ids + ref[:i]])).logits[0, -1].topk(2).values
    return float(top[0] - top[1]) < tie


def test_int8_serves_its_dequantized_model_and_stays_near_float32(model_dir, tokenizer):
    """`--quantization int8` from the float checkpoint: greedy tokens of transformers on the
    int8-dequantized weights (near ties aside), and per-token KL(float32 || int8) on the
    prompts and their float32 continuations — measured 0.0034 mean, 0.039 p99, 0.17 max over
    the correctness prompts (docs/quantization.md); bounded here at 0.01 / 0.1."""
    from transformers import AutoModelForCausalLM

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from scheduler.request import SamplingParams

    eng = LLMEngine(EngineConfig(kv_cache_memory=0.25, max_model_len=512, dtype="float32",
                                 device="cpu", quantization="int8"))
    assert eng.model.quant_types == ["I8"]
    hq = hf_int8_model(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = [tokenizer.encode(p) for p in PROMPTS]
    outs = [c[0] for c in eng.generate(ids, SamplingParams(max_tokens=16, temperature=0))]
    kls = []
    for p, out in zip(ids, outs):
        assert ends_as_generate_would(out, 16, eos_ids(hq)), out
        with torch.inference_mode():
            full = torch.tensor([p + out])
            a, b = hf(full).logits[0].log_softmax(-1), hq(full).logits[0].log_softmax(-1)
        assert greedy_up_to_a_near_tie(b[len(p) - 1:len(p) - 1 + len(out)], out), out
        kls.append((a.exp() * (a - b)).sum(-1))
    kl = torch.cat(kls)
    print(f"int8 KL to float32: mean {kl.mean():.4f}, p99 {kl.quantile(0.99):.4f}, "
          f"max {kl.max():.4f}")
    assert kl.mean() < 0.01 and kl.quantile(0.99) < 0.1


@pytest.mark.extended          # a second variant of the draft-model tests
def test_a_quantized_draft_for_a_float32_target(model_dir):
    """The GGUF's blocks as the draft of the float32 weights: the target's exact tokens."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.loader import embedded_gguf_path
    from scheduler.request import SamplingParams

    common = dict(kv_cache_memory=0.25, max_model_len=512, dtype="float32", device="cpu",
                  quantization="none")
    spec = {"method": "draft_model", "model": str(embedded_gguf_path()),
            "num_speculative_tokens": 3, "adaptive": False}
    eng = LLMEngine(EngineConfig(**common, speculative_config=spec))
    assert eng.runner.drafter.model.quant_types == ["Q4_1", "Q8_0"]
    assert eng.model.quant_types == []
    base = LLMEngine(EngineConfig(**common))
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=24, temperature=0)
    assert eng.generate(ids, params) == base.generate(ids, params)
    assert eng.scheduler.spec_counters.num_accepted_tokens > 0


def assert_same_directory(path) -> None:
    """engine/quant/gguf_tensors.py's tensor directory equals gguf-py's GGUFReader's (the
    reference): names, types, dims, bytes, architecture."""
    import gguf

    from engine.quant.gguf_tensors import read_gguf_tensors

    ref = gguf.GGUFReader(str(path))
    got = read_gguf_tensors(str(path))
    arch = ref.fields.get("general.architecture")
    assert got.architecture == (bytes(arch.parts[-1]).decode() if arch else "")
    assert [t.name for t in got.tensors] == [t.name for t in ref.tensors]
    for g, r in zip(got.tensors, ref.tensors):
        assert g.tensor_type == int(r.tensor_type), g.name
        assert g.dims == tuple(int(d) for d in r.shape.tolist()), g.name
        assert np.asarray(g.data).tobytes() == np.asarray(r.data).tobytes(), g.name


def test_tensor_directory_matches_gguf_py(tmp_path):
    """On the embedded model, and on a file with a value of every GGUF type (arrays of strings,
    of numbers, empty ones), an odd alignment and F32 / F16 / BF16 / Q8_0 tensors."""
    import gguf

    from engine.loader import embedded_gguf_path

    assert_same_directory(embedded_gguf_path())
    path = tmp_path / "every-type.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("general.alignment", 64)
    w.add_uint8("u8", 7)
    w.add_int8("i8", -7)
    w.add_uint16("u16", 700)
    w.add_int16("i16", -700)
    w.add_int32("i32", -70000)
    w.add_float32("f32", 0.5)
    w.add_bool("flag", True)
    w.add_uint64("u64", 1 << 40)
    w.add_int64("i64", -(1 << 40))
    w.add_float64("f64", 0.25)
    w.add_string("name", "ünïcödé")
    w.add_array("strings", ["a", "", "ccc" * 50])
    w.add_array("numbers", [1, 2, 3])
    w.add_array("floats", [0.5, 1.5])
    w.add_array("empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32.weight", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16.weight", rng.standard_normal((4, 8)).astype(np.float16))
    dense = rng.standard_normal((2, 64)).astype(np.float32)
    w.add_tensor("q8.weight", gguf.quants.quantize(dense, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("bf16.weight", gguf.quants.quantize(dense, gguf.GGMLQuantizationType.BF16),
                 raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_same_directory(path)


def test_a_truncated_gguf_is_a_load_error(tmp_path):
    from engine.loader import ModelLoadError, embedded_gguf_path
    from engine.quant.gguf_weights import read_gguf_weights

    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(embedded_gguf_path().read_bytes()[:1 << 20])
    with pytest.raises(ModelLoadError, match="cannot read GGUF tensors"):
        read_gguf_weights(bad, 9, 3)


def requantized_gguf(src, dst, types: dict[str, str]) -> None:
    """Copy the GGUF `src` to `dst` with the tensors whose llama.cpp name contains a key of
    `types` (e.g. "ffn_down") re-quantized to that type (gguf-py's quantizer), metadata kept."""
    import gguf
    from gguf.quants import dequantize, quantize

    reader = gguf.GGUFReader(str(src))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        target = next((v for key, v in types.items() if key in t.name), None)
        data, qtype = np.asarray(t.data), t.tensor_type
        if target is not None:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            dense = dequantize(data.reshape(shape[0], -1), qtype).reshape(shape)
            qtype = gguf.GGMLQuantizationType[target]
            data = quantize(dense.astype(np.float32), qtype)
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.extended          # a GGUF rewritten, converted and served: ~40 s
def test_mixed_and_kernelless_types_serve_over_openai(tmp_path, tokenizer):
    """A GGUF whose V projections are Q8_0 beside Q4_1 Q / K (one fused projection, two block
    types) and whose down projections are Q5_0 (no kernel): it loads, the log names the
    dequantized type and the served ones, and the OpenAI SDK gets transformers' greedy text
    on the same file."""
    import openai
    from transformers import AutoModelForCausalLM

    from engine.loader import embedded_gguf_path, resolve_model
    from tests.conftest import start_server, stop_server

    path = tmp_path / "mixed.gguf"
    requantized_gguf(embedded_gguf_path(), path, {"attn_v": "Q8_0", "ffn_down": "Q5_0"})
    log = tmp_path / "server.log"
    proc, base = start_server([str(path), "--max-model-len", "512", "--kv-cache-memory", "0.25"],
                              "/health/ready", log)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x")
        out = client.completions.create(model=client.models.list().data[0].id,
                                        prompt=PROMPTS[0], max_tokens=12, temperature=0)
        text = out.choices[0].text
        assert client.models.list().data       # still live
    finally:
        stop_server(proc)
    logged = log.read_text()
    assert "dequantized at load to the serving dtype: Q5_0 (30 tensors)" in logged
    assert "linear: gguf Q4_1/Q8_0 kernels" in logged
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model(str(path))),
                                              dtype=torch.float32).eval()
    p = tokenizer.encode(PROMPTS[0])
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                          attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          pad_token_id=hf.config.eos_token_id)[0, len(p):].tolist()
    ours = tokenizer.encode(text, add_special_tokens=False)
    assert text == tokenizer.decode(ref) or first_difference_is_a_near_tie(hf, p, ours, ref)
