"""8-bit KV caches (`--kv-cache-dtype int8 | fp8 | fp8_e4m3 | fp8_e5m2`): the C kernels'
write and read against the torch path's rows and a float64 reference over the dequantized cache,
each build of the kernels; the real model's logprobs against the same engine with a
full-precision cache; the capacity at the same `--kv-cache-memory`; what touches KV (prefix
caching, chunked prefill, swap and recompute preemption, n-gram speculation) giving the same
tokens as the 8-bit engine alone; the server as a user runs it. The torch path against the
kernels over 8-bit caches: tests/test_cpu_kernels.py (the mixed step)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.kv_quant import KVQuant, resolve_kv_cache_dtype
from engine.llm_engine import LLMEngine
from scheduler.request import SamplingParams
from tests.conftest import pairs_build
from tests.test_cpu_kernels import reference_decode

KINDS = ["int8", "fp8_e4m3", "fp8_e5m2"]


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_write_gives_the_torch_paths_rows(lib, name, dtype):
    """kv_cache.c quantizes each (token, head) row as KVQuant.quantize does, byte for byte:
    int8 (the float16 scale, then x * (1 / scale) rounded to even), fp8 (x / scale rounded to
    nearest even as torch's float8 casts, saturated), here with fp8 scales 0.5 / 2, values
    past fp8's range and a zero row."""
    torch.manual_seed(0)
    kv = KVQuant(name, 0.5, 2.0) if name != "int8" else KVQuant(name)
    kvh, d, n = 3, 64, 40
    qkv = (torch.randn(n, (9 + 2 * kvh) * d) * 4).to(dtype)     # strided rows, as the model's
    qkv[0, 9 * d] = 1e5
    qkv[1, 12 * d:13 * d] = 0
    k = qkv[:, 9 * d:12 * d].view(n, kvh, d)
    v = qkv[:, 12 * d:].view(n, kvh, d)
    rb = kv.row_bytes(d)
    k_cache = torch.zeros(kvh, 8, 16, rb, dtype=torch.uint8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(128)[:n]
    lib.cache_write8(k, v, k_cache, v_cache, slots, kv)
    for cache, x, scale in ((k_cache, k, kv.k_scale), (v_cache, v, kv.v_scale)):
        got = cache.view(kvh, -1, rb)[:, slots].transpose(0, 1)
        assert torch.equal(got, kv.quantize(x, scale))


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (6, 2, 24)])
def test_paged_decode8_matches_reference_over_the_dequantized_cache(lib, name, dtype, tol,
                                                                      heads, kv_heads, head_dim):
    """paged_decode8 attends over exactly what the cache holds: against float64 attention
    over the torch path's dequantization of the same rows (fp8 with scales 0.25 / 3)."""
    torch.manual_seed(1)
    kv = KVQuant(name, 0.25, 3.0) if name != "int8" else KVQuant(name)
    bs, num_blocks = 16, 64
    lens = torch.tensor([1, 15, 16, 17, 100, 200], dtype=torch.int32)
    max_blocks = -(-int(lens.max()) // bs)
    k_rows = kv.quantize(torch.randn(kv_heads, num_blocks, bs, head_dim), kv.k_scale)
    v_rows = kv.quantize(torch.randn(kv_heads, num_blocks, bs, head_dim) * 2, kv.v_scale)
    tables = torch.stack([torch.randperm(num_blocks)[:max_blocks] for _ in lens]).int()
    q = torch.randn(len(lens), heads + kv_heads, head_dim).to(dtype)[:, :heads]
    out = torch.empty(len(lens), heads, head_dim, dtype=dtype)
    lib.paged_decode(q, k_rows, v_rows, tables, lens, head_dim ** -0.5, out, kv)
    k_ref = kv.dequantize(k_rows, torch.float64, kv.k_scale)
    v_ref = kv.dequantize(v_rows, torch.float64, kv.v_scale)
    ref = reference_decode(q, k_ref, v_ref, tables, lens, head_dim ** -0.5)
    assert (out.double() - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())


def prefill_run_over_8bit_cache(kernels, name: str, seed: int) -> tuple[int, float]:
    """One prefill run of 40 rows (contexts 11..50, one block table) of 9 heads over 3 KV heads
    through `kernels.paged_decode` over an 8-bit cache (fp8 scales 0.25 / 3): the rows the
    pair-product path took, and the largest error against float64 attention over the
    dequantized cache, relative to the largest output."""
    torch.manual_seed(seed)
    kv = KVQuant(name, 0.25, 3.0) if name != "int8" else KVQuant(name)
    heads, kv_heads, head_dim, bs, num_blocks = 9, 3, 64, 16, 64
    k_rows = kv.quantize(torch.randn(kv_heads, num_blocks, bs, head_dim), kv.k_scale)
    v_rows = kv.quantize(torch.randn(kv_heads, num_blocks, bs, head_dim), kv.v_scale)
    table = torch.randperm(num_blocks)[:4].int()
    lens = torch.arange(11, 51, dtype=torch.int32)            # one run of 40 rows
    tables = table.repeat(len(lens), 1)
    q = torch.randn(len(lens), heads, head_dim).bfloat16()
    out = torch.empty(len(lens), heads, head_dim, dtype=torch.bfloat16)
    before = kernels._fn["attention_amx_rows"]()
    kernels.paged_decode(q, k_rows, v_rows, tables, lens, head_dim ** -0.5, out, kv)
    paired = kernels._fn["attention_amx_rows"]() - before
    ref = reference_decode(q, kv.dequantize(k_rows, torch.float64, kv.k_scale),
                           kv.dequantize(v_rows, torch.float64, kv.v_scale), tables, lens,
                           head_dim ** -0.5)
    return paired, (out.double() - ref).abs().max().item() / ref.abs().max().item()


@pytest.mark.parametrize("name", KINDS)
def test_prefill_runs_on_amx_tiles_over_an_8bit_cache(amx_lib, name):
    """Prefill runs of 16 rows and more take the AMX tiles over an 8-bit cache too (its rows
    dequantized to bfloat16 as they are gathered)."""
    paired, err = prefill_run_over_8bit_cache(amx_lib, name, 2)
    assert paired == 40 and err < 2e-2


@pytest.mark.parametrize("name", KINDS)
def test_prefill_runs_in_bf16_pairs_over_an_8bit_cache(lib, request, name):
    """The same on each build: where it has AVX512-BF16 (vdpbf16ps register tiles on an EPYC or
    under the avx512 cap, tiles on an AMX host) the run is attended in pair products over the
    dequantized rows; elsewhere on the vector loops."""
    paired, err = prefill_run_over_8bit_cache(lib, name, 3)
    assert paired == (40 if pairs_build(request) else 0) and err < 2e-2


def test_the_flag_accepts_vllms_values_and_refuses_others():
    assert resolve_kv_cache_dtype("auto") is None
    assert resolve_kv_cache_dtype("fp8").name == "fp8_e4m3"          # vLLM's fp8 is e4m3
    assert resolve_kv_cache_dtype("int8").row_bytes(64) == 66
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, int8, fp8"):
        EngineConfig(kv_cache_dtype="fp4")


# ----------------------------------------------------------------------------- the real model
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, a fox",
           "List three primary colours:", "Water boils at a temperature of",
           "The quick brown fox jumps over", "In 1969, the first person to walk on",
           "import numpy as np\narr = np."]


def engine(**overrides) -> LLMEngine:
    cfg = dict(kv_cache_memory=0.25, max_model_len=512, dtype="float32", device="cpu")
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg))


@pytest.fixture(scope="module")
def reference(tokenizer):
    """The full-precision cache's greedy continuations (24 tokens) of PROMPTS."""
    from benchmarks.kv_cache_bench import greedy_paths
    return greedy_paths(engine(), [tokenizer.encode(p) for p in PROMPTS], 24)


@pytest.mark.parametrize("name,bound", [("int8", 0.02), ("fp8_e4m3", 0.1), ("fp8_e5m2", 0.2)])
def test_logprobs_stay_close_to_the_full_precision_cache(reference, name, bound):
    """Each token of the full-precision cache's greedy paths, teacher-forced (prompt logprobs
    of prompt + path, the 8-bit cache written and read as in decoding): mean |logprob
    difference| within the issue's bounds (int8 0.02; fp8, e4m3 as in vLLM, 0.1; e5m2, two
    mantissa bits, 0.2), against the full-precision cache measured the same way.
    benchmarks/kv_cache_bench.py measures it over 2,000+ tokens."""
    from benchmarks.kv_cache_bench import forced_logprobs
    full = forced_logprobs(engine(), reference)
    got = forced_logprobs(engine(kv_cache_dtype=name), reference)
    diffs = [abs(a - b) for a, b in zip(full, got)]
    assert len(diffs) == len(PROMPTS) * 24
    assert sum(diffs) / len(diffs) <= bound, sum(diffs) / len(diffs)


def test_an_8bit_cache_holds_about_twice_the_blocks_of_bfloat16():
    """The same --kv-cache-memory: int8 1.94x (66 bytes a row at head_dim 64 against 128), fp8
    2x the blocks of bfloat16."""
    blocks = {name: engine(dtype="bfloat16", kv_cache_dtype=name).scheduler.kv.pool.num_blocks
              for name in ("auto", "int8", "fp8_e5m2")}
    assert blocks["int8"] >= 1.9 * blocks["auto"] and blocks["fp8_e5m2"] >= 1.99 * blocks["auto"]


GREEDY24 = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def alone_long(tokenizer):
    """(four 6x prompts, the int8 engine's 24 greedy tokens of each, alone)."""
    prompts = [tokenizer.encode(p * 6) for p in PROMPTS[:4]]
    eng = engine(kv_cache_dtype="int8")                    # one engine, one prompt at a time
    return prompts, [eng.generate([p], GREEDY24)[0][0] for p in prompts]


TOUCHES_KV = {
    "prefix cache + chunked prefill": dict(max_num_batched_tokens=32),
    "recompute": dict(num_gpu_blocks_override=12, max_model_len=128, preemption_mode="recompute"),
    "swap": dict(num_gpu_blocks_override=12, max_model_len=128, preemption_mode="swap"),
    "ngram": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
}


# swap and ngram are second variants (~3 s each), run in CI's make test-stress
@pytest.mark.parametrize("what", [pytest.param(w, marks=pytest.mark.extended)
                                  if w in ("swap", "ngram") else w for w in TOUCHES_KV])
def test_what_touches_kv_gives_the_8bit_engines_own_tokens(alone_long, what):
    """Prefix-cache hits, chunked prefill, swap and recompute preemption and n-gram
    speculation, each on an int8 cache: the same greedy tokens as the int8 engine alone."""
    prompts, alone = alone_long
    eng = engine(kv_cache_dtype="int8", **TOUCHES_KV[what])
    twice = eng.generate(prompts + prompts, GREEDY24)    # the second copies hit the cache
    assert [c[0] for c in twice] == alone + alone
    kv = eng.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    counters = eng.scheduler.counters
    if what in ("swap", "recompute"):
        assert counters.num_preemptions > 0
    if what == "swap":
        assert counters.swap_out_blocks > 0


# ----------------------------------------------------------------------------- the server
def test_served_int8_cache_says_so_and_answers(tmp_path):
    """`continuum serve --kv-cache-dtype int8`: the ready log and `/metrics`
    (`continuum_cache_config_info`) name the cache's dtype and blocks; a streamed chat
    completion answers; a bad value is one line at start (exit 2)."""
    import subprocess
    import sys

    import httpx
    from openai import OpenAI

    from tests.conftest import MODEL, start_server, stop_server

    log = tmp_path / "server.log"
    proc, base = start_server(["--kv-cache-dtype", "int8", "--kv-cache-memory", "0.25"],
                              "/health/ready", log)
    try:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name a primary colour."}],
            max_tokens=12, temperature=0, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text.strip()
        body = httpx.get(f"{base}/metrics", timeout=5).text
        info = next(line for line in body.splitlines()
                    if line.startswith("continuum_cache_config_info{"))
        assert 'cache_dtype="int8"' in info and 'block_size="16"' in info
        ready = next(line for line in log.read_text().splitlines() if "engine ready" in line)
        assert "KV blocks of 16 tokens (int8," in ready
    finally:
        stop_server(proc)
    bad = subprocess.run([sys.executable, "-m", "api", "serve", "--kv-cache-dtype", "fp4"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "--kv-cache-dtype: invalid choice: 'fp4'" in bad.stderr


# ----------------------------------------------------------------------------- the rest of the engine
GREEDY8 = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def alone8(tokenizer):
    """(prompts, the int8 engine's greedy tokens of each, alone)."""
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    eng = engine(kv_cache_dtype="int8")                    # one engine, one prompt at a time
    return prompts, [eng.generate([p], GREEDY8)[0][0] for p in prompts]


# An 8-bit cache turns float32's order-of-sums noise (1e-6) into whole rounding steps: where
# the ranks' all-reduce or another ISA's kernels round a K/V element the other way, the steps
# cascade through the layers and move a logprob by up to ~0.03 (measured, AMD EPYC Zen 3, AVX2:
# one rank against three, and the AVX2 against the generic kernels, where the full-precision
# cache agrees to 1e-5). Greedy tokens may part there only at a near tie of the one-rank cache.
KV8_NEAR_TIE = 0.1       # nats: a top-2 logprob gap under which an 8-bit cache may flip


def top2(eng: LLMEngine, ids: list[int]) -> list[tuple[int, float]]:
    """`eng`'s two most likely next tokens after `ids`, with their logprobs."""
    eng.add_request("top2", ids, SamplingParams(max_tokens=1, temperature=0, logprobs=2))
    top = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            top = next((c.logprobs[0].top for c in out.outputs if c.logprobs), top)
    return top


@pytest.mark.extended          # ~12 s: three rank processes
def test_tensor_parallel_ranks_share_an_int8_cache(alone8):
    """Three ranks (one KV head each, their own int8 cache) give the one-rank int8 tokens, or
    part from them only where the one-rank cache's top two are within KV8_NEAR_TIE (the
    token taken then its second)."""
    prompts, alone = alone8
    eng = engine(kv_cache_dtype="int8", tensor_parallel_size=3)
    try:
        got = [c[0] for c in eng.generate(prompts, GREEDY8)]
    finally:
        eng.shutdown()
    one = engine(kv_cache_dtype="int8")
    for prompt, want, out in zip(prompts, alone, got):
        i = next((i for i, (a, b) in enumerate(zip(out, want)) if a != b), None)
        if i is None:
            assert out == want
            continue
        (first, lp1), (second, lp2) = top2(one, prompt + want[:i])
        assert (first, second) == (want[i], out[i]) and lp1 - lp2 < KV8_NEAR_TIE, \
            (i, want, out, (first, lp1), (second, lp2))


def test_a_draft_model_speculates_over_int8_caches(alone8):
    """The model as its own draft (its cache int8 as the target's): every draft accepted, the
    tokens those of the int8 engine alone."""
    from engine.loader import embedded_gguf_path
    prompts, alone = alone8
    eng = engine(kv_cache_dtype="int8", speculative_config={
        "method": "draft_model", "model": str(embedded_gguf_path()),
        "num_speculative_tokens": 3, "adaptive": False})
    assert [c[0] for c in eng.generate(prompts, GREEDY8)] == alone
    counters = eng.scheduler.spec_counters
    assert counters.num_draft_tokens > 0
    assert counters.num_accepted_tokens == counters.num_draft_tokens


def test_beam_search_runs_over_an_int8_cache(alone8, tokenizer):
    """vLLM's beam search (api/beam_search.py: one request per beam and step, prefix-cache
    hits on the int8 blocks): width 1 is the int8 engine's greedy path; width 3 gives three
    different beams, best first."""
    import asyncio

    from api.beam_search import BeamParams, beam_search
    from engine.async_llm import AsyncLLM
    prompts, alone = alone8
    llm = AsyncLLM(engine(kv_cache_dtype="int8"))

    async def search(width):
        params = BeamParams(width=width, max_tokens=8, temperature=0.0, ignore_eos=True)
        async for out in beam_search(llm, params, tokenizer, tokenizer.eos_token_id, "b",
                                     prompts[0]):
            return out

    try:
        one = asyncio.run(search(1))
        assert one.outputs[0].token_ids == alone[0][:8]
        three = asyncio.run(search(3))
        beams = [o.token_ids for o in three.outputs]
        assert len(beams) == 3 and len({tuple(b) for b in beams}) == 3
    finally:
        llm.shutdown()


@pytest.mark.extended          # ~8 s: a peft adapter built first
def test_lora_adapters_run_over_an_int8_cache(model_dir, tmp_path, alone8):
    """A peft adapter on an int8 cache: alone and in a batch with the base model the same
    tokens, which differ from the base's."""
    pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[test]')")
    from tests.test_lora import SPECS, make_adapter
    make_adapter(model_dir, tmp_path / "attn8", *SPECS["attn8"])
    prompts, alone = alone8
    eng = engine(kv_cache_dtype="int8", quantization="none", enable_lora=True,
                 lora_modules=(("attn8", str(tmp_path / "attn8")),), max_lora_rank=8)
    lora = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, lora_name="attn8")
    by_itself = eng.generate([prompts[0]], lora)[0][0]
    mixed = eng.generate([prompts[0], prompts[0]], [lora, GREEDY8])
    assert mixed[0][0] == by_itself != mixed[1][0]
