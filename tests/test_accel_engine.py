"""The accelerator model runner (engine/accel) end to end on the CPU: the whole engine with the
CUDA attention backend's Triton kernels run by Triton's interpreter, decode steps replayed as a
CUDA graph would replay them, and the KV-cache memory arithmetic of --gpu-memory-utilization.

Model: a random-weight two-layer Llama (benchmarks/checkpoints.py `tiny`: 6 heads over 2 KV
heads, head_dim 32, float32), so that the interpreter stays fast; the reference is
transformers' greedy `generate` on the same checkpoint. No GPU runs here: the device check
(benchmarks/device_check.py) runs the same paths on one, bfloat16 and real graphs included."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (conftest sets it where no GPU is)",
                allow_module_level=True)

from benchmarks.checkpoints import build_checkpoint  # noqa: E402
from engine.accel.cuda_graphs import CudaGraphRunner, graph_buckets  # noqa: E402
from engine.accel.memory import kv_budget_bytes, profile_peak_step  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
SHARED = " ".join(f"item {i} costs {i * 3} coins;" for i in range(12))


@pytest.fixture(scope="module")
def tiny(model_dir, tmp_path_factory):
    return str(build_checkpoint(model_dir, tmp_path_factory.mktemp("tiny"), "tiny"))


@pytest.fixture(scope="module")
def prompts(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    texts = ["Hello", "The capital of France is", " ".join(str(i) for i in range(40)),
             SHARED + " What does item 3 cost?", SHARED + " And item 7?",
             "Once upon a time, in a land far away, there lived"]
    return [tok.encode(t) for t in texts]


@pytest.fixture(scope="module")
def reference(tiny, prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=MAX_TOKENS, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def engine(tiny, backend="triton", **overrides):
    cfg = dict(model=tiny, kv_cache_memory=0.02, max_model_len=512, dtype="float32",
               device="cpu", max_num_seqs=8)
    cfg.update(overrides)
    os.environ["CONTINUUM_ATTENTION_BACKEND"] = backend
    try:
        return LLMEngine(EngineConfig(**cfg))
    finally:
        del os.environ["CONTINUUM_ATTENTION_BACKEND"]


def run(eng, prompts):
    return [choices[0] for choices in eng.generate(list(prompts), GREEDY)]


def test_triton_backend_matches_transformers(tiny, prompts, reference):
    """The first step prefills every prompt at once (1 to ~110 tokens: the one-token prompt is
    a decode-shaped row beside them), and the second shared prompt reads the first one's
    cached blocks. The first 6 of the reference's 12 tokens: each
    decode step costs ~1 s in the interpreter (the extended tests below run all 12)."""
    eng = engine(tiny)
    assert eng.runner.backend.name == "triton" and eng.runner.kernels is None
    assert eng.runner.kv_cache.shape[2] == 2                  # head-major: [L, 2, KVH, ...]
    six = SamplingParams(max_tokens=6, temperature=0)
    assert [c[0] for c in eng.generate(list(prompts), six)] == [r[:6] for r in reference]
    assert eng.scheduler.counters.prefix_cache_hits > 0       # the two shared prompts


@pytest.mark.extended          # ~15 s in the interpreter: the round above, then every prompt again
def test_triton_backend_agrees_again_from_the_prefix_cache(tiny, prompts, reference):
    """A second round of the same prompts hits the prefix cache (every prompt's full blocks)
    and must still agree."""
    eng = engine(tiny)
    assert run(eng, prompts) == reference
    hits = eng.scheduler.counters.prefix_cache_hits
    assert run(eng, prompts) == reference
    assert eng.scheduler.counters.prefix_cache_hits > hits


@pytest.mark.extended          # ~70 s in the interpreter; make test keeps the kernels' own test
@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_triton_backend_over_an_8bit_cache_gives_the_cpu_kernels_tokens(tiny, prompts, kv):
    """`--kv-cache-dtype` through the accelerator runner: the cache is uint8 rows, the Triton
    kernels write and read them; greedy tokens equal the CPU kernels' over the same 8-bit
    cache (the same bytes, attended in float32), also on the prefix-cache round."""
    eng = engine(tiny, kv_cache_dtype=kv)
    assert eng.runner.backend.kv is not None and eng.runner.kv_cache.dtype == torch.uint8
    cpu = engine(tiny, backend="auto", kv_cache_dtype=kv)
    assert cpu.runner.backend is None
    expected = run(cpu, prompts)
    assert run(eng, prompts) == expected
    assert run(eng, prompts) == expected and eng.scheduler.counters.prefix_cache_hits > 0


@pytest.mark.extended
def test_chunked_prefill_and_swap_preemption(tiny, prompts, reference):
    """A 7-token step budget (every prompt chunked, chunks after their own prefix), then a pool
    of 9 blocks with swap preemption (the backend's block axis used by swap out and in)."""
    eng = engine(tiny, max_num_batched_tokens=7)
    assert run(eng, prompts) == reference
    eng = engine(tiny, num_gpu_blocks_override=9, preemption_mode="swap", swap_space=0.01,
                 max_model_len=130, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert run(eng, prompts) == reference
    assert eng.scheduler.counters.swap_out_blocks > 0


class ReplayByCall:
    """A stand-in for torch.cuda graphs on the CPU with a graph's contract: what the step does
    in Python is fixed at capture (the metadata object, launch grids, buffer views); a replay
    re-runs the captured closure, which may only read the buffers, into the captured output."""

    def __init__(self) -> None:
        self.captured, self.replays = [], 0

    def capture(self, step):
        out = step()
        self.captured.append(out.shape[0])
        return (step, out), out

    def replay(self, graph) -> None:
        step, out = graph
        out.copy_(step())
        self.replays += 1


# ~13 s in the interpreter; make test keeps the graph-less parity and both decode kernels' tests
@pytest.mark.extended
def test_decode_steps_replay_captured_graphs(tiny, prompts, reference):
    """Decode-only steps run as replays of the bucket's capture over the step buffers, padded
    to the bucket (3 decodes run in the 4 bucket), through the split-KV decode kernels;
    outputs equal eager ones and transformers'."""
    eng = engine(tiny)
    runner = eng.runner
    fake = ReplayByCall()
    runner.graphs = CudaGraphRunner(runner.model, runner.kv_cache, runner.buffers,
                                    runner.backend, 8, graph_factory=fake)
    runner.graphs.capture()
    assert fake.captured == [8, 4, 2, 1]                       # largest first
    assert run(eng, prompts[:3]) == reference[:3]
    assert fake.replays >= MAX_TOKENS - 2
    assert run(eng, prompts) == reference
    assert runner.graphs.bucket_for(3) == 4 and runner.graphs.bucket_for(9) is None
    # every bucket (8 x 2 KV heads < 128 programs) decodes by split-KV, its scratch per bucket
    assert {key[0] for key in runner.backend._parts} == {8, 4, 2, 1}


def test_graph_buckets():
    assert graph_buckets(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_buckets(1) == [1] and graph_buckets(4) == [1, 2, 4]


def test_kv_budget_arithmetic():
    gib = 1 << 30
    # 80 GiB card at 0.9: 72 - 3 (weights + peak) - 1 (context outside torch: 80 - 74 - 5)
    assert kv_budget_bytes(80 * gib, 74 * gib, 5 * gib, 3 * gib, 0.9) == 68 * gib
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.1 leaves no room"):
        kv_budget_bytes(80 * gib, 74 * gib, 5 * gib, 8 * gib, 0.1)


def test_profile_step_runs_the_largest_step(tiny):
    """The profile's step (every token of --max-num-batched-tokens over --max-num-seqs prompts,
    a one-block cache, nothing written) runs through the backend."""
    eng = engine(tiny)
    before = eng.runner.kv_cache.clone()
    profile_peak_step(eng.model, eng.runner.backend, eng.device, 40, 3, 16)
    assert torch.equal(eng.runner.kv_cache, before)


def test_gpu_memory_utilization_is_checked():
    with pytest.raises(ValueError, match="--gpu-memory-utilization must be in"):
        EngineConfig(gpu_memory_utilization=1.5)


def logprob_errors(eng, prompts, hf) -> list[float]:
    """Run `prompts` greedily with each sampled token's logprob; per prompt, the largest gap
    between the engine's logprob and transformers' float32 one for the same token after the
    same context (the engine's own output, so a divergence does not end the comparison)."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=0))
    toks = {r: [] for r in ids}
    lps = {r: [] for r in ids}
    while eng.has_unfinished_requests():
        for out in eng.step():
            for c in out.outputs:
                toks[out.request_id] += c.token_ids
                lps[out.request_id] += [lp.logprob for lp in c.logprobs]
    errors = []
    for rid, p in zip(ids, prompts):
        with torch.inference_mode():
            ref = hf(torch.tensor([p + toks[rid]])).logits[0].float().log_softmax(-1)
        errors.append(max(abs(lp - ref[len(p) - 1 + j, t].item())
                          for j, (t, lp) in enumerate(zip(toks[rid], lps[rid]))))
    return errors


def test_npu_backend_through_the_engine(tiny, prompts, monkeypatch):
    """The NPU backend (engine/accel/npu_attention.py) under the whole engine, against the
    stand-in torch_npu (tests/fake_torch_npu.py, which checks every operator call; no Ascend
    hardware has run this). The operators take float16 / bfloat16 only and this CPU has no
    float16 matmul, so bfloat16: each sampled token's logprob is compared with transformers'
    float32 one, and must be as close as the CPU path's at the same dtype (within 2x)."""
    from transformers import AutoModelForCausalLM

    from tests.fake_torch_npu import install

    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    cpu_errors = logprob_errors(engine(tiny, backend="auto", dtype="bfloat16"), prompts, hf)
    fake = install(monkeypatch)
    with pytest.raises(ValueError, match="runs float16 or bfloat16, not float32"):
        engine(tiny, backend="npu", dtype="float32")               # refused at start
    eng = engine(tiny, backend="npu", dtype="bfloat16", max_num_batched_tokens=48)
    cfg = eng.model.cfg
    assert eng.runner.kv_cache.shape[2:] == (eng.runner.kv_cache.shape[2], 16, cfg.num_kv_heads,
                                             cfg.head_dim)           # [L, 2, NB, BS, KVH, D]
    npu_errors = logprob_errors(eng, prompts, hf)
    profile_peak_step(eng.model, eng.runner.backend, eng.device, 40, 3, 16)   # real slots
    assert max(npu_errors) <= 2 * max(cpu_errors), (npu_errors, cpu_errors)
    ops = {name for name, _ in fake.calls}
    assert {"_npu_reshape_and_cache", "_npu_paged_attention",
            "npu_fused_infer_attention_score"} <= ops, ops


def test_interpreter_refuses_bfloat16_and_the_log_names_the_backend(tiny, caplog):
    """Triton's interpreter has no bfloat16 (its results would be wrong, silently): refused at
    start. The ready log names the attention path."""
    with pytest.raises(ValueError, match="interpreter has no bfloat16"):
        engine(tiny, dtype="bfloat16")
    with caplog.at_level("INFO", logger="continuum.engine"):
        engine(tiny)
    assert "attention: triton kernels, eager" in caplog.text


def _window_model(model_dir, tmp_path, architecture: str, window_cfg: dict):
    """(checkpoint path, two prompts' ids, transformers' greedy tokens for them) of a tiny
    random `architecture` model with `window_cfg`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(build_checkpoint(model_dir, tmp_path / "w", "tiny", architecture=architecture,
                                **window_cfg))
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok.encode(t) for t in ("The capital of France is", " ".join(map(str, range(15))))]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=MAX_TOKENS, do_sample=False,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    return path, prompts, ref


@pytest.mark.parametrize("architecture, window_cfg", [
    ("MistralForCausalLM", dict(sliding_window=8)),                       # every layer
    ("Qwen2ForCausalLM", dict(sliding_window=6, use_sliding_window=True,  # layer 1 only
                              max_window_layers=1))])
def test_sliding_window_layers_match_transformers(model_dir, tmp_path, architecture,
                                                  window_cfg):
    """With the Triton kernels the engine serves past a model's sliding window (the CPU paths
    cap max_model_len at it) and applies each layer's window as transformers does: prompts
    and outputs several windows long, decodes, a chunked prompt; where every layer has a
    window the blocks behind it are freed (the test below: so far that a cache smaller than
    one sequence serves it)."""
    path, prompts, ref = _window_model(model_dir, tmp_path, architecture, window_cfg)
    eng = engine(path, max_num_batched_tokens=16)
    assert eng.max_model_len == 512 and eng.model.cfg.sliding_window == window_cfg["sliding_window"]
    assert run(eng, prompts) == ref
    if architecture == "MistralForCausalLM":    # blocks behind every layer's window are freed
        assert eng.scheduler.kv.num_window_freed > 0
    else:                                       # a full layer reads every block: none freed
        assert eng.scheduler.cache_config.sliding_window == 0
        assert eng.scheduler.kv.num_window_freed == 0
    assert engine(path, backend="auto", max_model_len=None).max_model_len \
        == window_cfg["sliding_window"]                      # the CPU path: capped


@pytest.mark.extended          # ~6 s in the interpreter; the freeing itself is checked above
def test_a_cache_smaller_than_one_sequence_serves_a_windowed_model(model_dir, tmp_path):
    """Every layer has a window (Mistral): the blocks behind it are freed as decoding goes, so
    9 blocks of 4 tokens serve sequences longer than 36 tokens, with transformers' tokens."""
    path, prompts, ref = _window_model(model_dir, tmp_path, "MistralForCausalLM",
                                       dict(sliding_window=8))
    small = engine(path, max_num_batched_tokens=16, block_size=4, num_gpu_blocks_override=9)
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    assert small.num_gpu_blocks * 4 < longest and run(small, prompts) == ref
    assert small.scheduler.kv.num_window_freed > 0
