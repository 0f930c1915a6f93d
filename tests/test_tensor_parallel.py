"""Tensor parallelism (`--tensor-parallel-size`): the Megatron split is exact algebra, three ranks
over gloo give the single rank's greedy tokens in float32 (all at once with chunked prefill, and
under swap and recompute preemption), a bad size is a one-line start error, and a server whose
rank dies fails its in-flight request and exits non-zero with the rank named — no hang, no
orphaned worker. SmolLM2-135M has 9 query heads, 3 KV heads and an MLP width of 1536, so N = 3.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from engine.config import EngineConfig
from engine.distributed.parallel import check_tensor_parallel, shard_weights
from engine.halt_poll import find_compiler
from engine.llm_engine import LLMEngine
from engine.models.llama import ModelConfig
from scheduler.request import SamplingParams
from tests.conftest import MODEL, start_server
from tests.test_engine_correctness import prompts, shared_prefix_prompts  # noqa: F401 (fixtures)

GREEDY = SamplingParams(max_tokens=24, temperature=0)


def tiny_config(**overrides) -> ModelConfig:
    cfg = dict(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=8,
               intermediate_size=12, num_layers=1, num_heads=6, num_kv_heads=3, head_dim=4,
               rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
               max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=False,
               sliding_window=None, eos_token_ids=(0,), bos_token_id=None)
    cfg.update(overrides)
    return ModelConfig(**cfg)


def test_shards_recombine_into_the_full_layers():
    """Column shards concatenate back to the full projections, row-parallel partial products
    sum to the full product, and the padded vocabulary shards hold every row exactly once."""
    torch.manual_seed(0)
    cfg, n, p = tiny_config(), 3, "model.layers.0."
    full = {"model.embed_tokens.weight": torch.randn(10, 8),
            p + "self_attn.q_proj.weight": torch.randn(24, 8),
            p + "self_attn.k_proj.weight": torch.randn(12, 8),
            p + "self_attn.v_proj.weight": torch.randn(12, 8),
            p + "self_attn.o_proj.weight": torch.randn(8, 24),
            p + "mlp.gate_proj.weight": torch.randn(12, 8),
            p + "mlp.up_proj.weight": torch.randn(12, 8),
            p + "mlp.down_proj.weight": torch.randn(8, 12),
            p + "input_layernorm.weight": torch.randn(8)}
    shards = [shard_weights(cfg, full, r, n) for r in range(n)]
    local = shards[0][0]
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 4)
    assert local.vocab_size == 10 and local.hidden_size == 8
    for name in ("q_proj", "k_proj", "v_proj"):
        key = p + f"self_attn.{name}.weight"
        assert torch.equal(torch.cat([s[key] for _, s in shards]), full[key])
    x = torch.randn(5, 24)
    key = p + "self_attn.o_proj.weight"
    partial = sum(x[:, r * 8:(r + 1) * 8] @ shards[r][1][key].T for r in range(n))
    torch.testing.assert_close(partial, x @ full[key].T)
    emb = torch.cat([s["model.embed_tokens.weight"] for _, s in shards])
    assert emb.shape == (12, 8)                      # ceil(10 / 3) = 4 rows each, 2 padded
    assert torch.equal(emb[:10], full["model.embed_tokens.weight"]) and not emb[10:].any()
    assert torch.equal(shards[1][1][p + "input_layernorm.weight"],
                       full[p + "input_layernorm.weight"])


def test_sizes_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 does not divide the "
                                         r"model's 9 attention heads"):
        check_tensor_parallel(tiny_config(num_heads=9), 2)
    with pytest.raises(ValueError, match=r"does not divide the model's 10 MLP intermediate"):
        check_tensor_parallel(tiny_config(intermediate_size=10), 3)
    check_tensor_parallel(tiny_config(), 3)


def test_an_accelerator_needs_one_device_per_rank(monkeypatch):
    from engine.device import Device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cuda = Device("cuda", torch.device("cuda"))
    with pytest.raises(ValueError, match=r"^--tensor-parallel-size 3 needs 3 cuda devices, "
                                         r"one per rank; 1 visible$"):
        cuda.check_world_size(3)
    cuda.check_world_size(1)
    Device("cpu", torch.device("cpu")).check_world_size(3)       # ranks share the cores


def test_cli_refuses_a_size_that_does_not_divide_the_heads():
    proc = subprocess.run([sys.executable, "-m", "api", "serve", "--tensor-parallel-size", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "continuum: error: --tensor-parallel-size 2 does not divide the model's 9 attention "
        "heads (it has 9 attention heads, 3 KV heads, MLP width 1536)")


def engine(**overrides) -> LLMEngine:
    cfg = dict(kv_cache_memory=0.25, max_model_len=2048, dtype="float32", device="cpu")
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg))


def run(eng: LLMEngine, prompt_lists, params: SamplingParams = GREEDY) -> list[list[int]]:
    try:
        return [choices[0] for choices in eng.generate(prompt_lists, params)]
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def single_rank(prompts, shared_prefix_prompts):  # noqa: F811 (fixtures)
    everything = list(prompts.values()) + shared_prefix_prompts
    return everything, run(engine(), everything)


def test_three_ranks_match_one_rank_with_chunked_prefill(prompts, shared_prefix_prompts):  # noqa: F811
    """Five 64-token chunks of a 320-token prompt beside the other prompts' prefills and
    decodes, and the shared system prompt's blocks hit in the prefix cache: every rank's shard
    in step, the single rank's tokens. (A subset of `single_rank`'s prompts with 12 tokens
    each: 3 ranks on 2 cores take ~0.4 s a step; the extended tests run them all.)"""
    some = [prompts["long"][:320], prompts["capital"], prompts["chinese"],
            *shared_prefix_prompts[:2]]
    params = SamplingParams(max_tokens=12, temperature=0)
    expected = run(engine(), some, params)
    eng = engine(tensor_parallel_size=3, max_num_batched_tokens=64)
    assert eng.model.cfg.num_kv_heads == 1 and eng.runner.kv_cache.shape[2] == 1
    if find_compiler() is not None and os.environ.get("CONTINUUM_TP_SHM") != "0":
        # the CPU ranks' collectives (test_tp_shm.py)
        assert eng._tp[0].transport == "shared memory"
    assert eng.model.quant_types == ["Q4_1", "Q8_0"]      # each rank's shard of the blocks
    assert run(eng, some, params) == expected
    assert eng.scheduler.counters.prefix_cache_hits > 0


@pytest.mark.extended    # make test keeps the chunked-prefill parity and the server run
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_three_ranks_match_one_rank_under_preemption(mode, single_rank):
    everything, expected = single_rank
    eng = engine(tensor_parallel_size=3, num_gpu_blocks_override=72, max_model_len=1100,
                 preemption_mode=mode, swap_space=0.25, max_num_batched_tokens=256)
    counters = eng.scheduler.counters
    assert run(eng, everything) == expected
    assert counters.num_preemptions > 0
    if mode == "swap":
        assert counters.swap_out_blocks > 0


def _worker_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "engine.distributed.worker"], capture_output=True,
                         text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.slow
@pytest.mark.extended      # ~30 s; TP parity and the TP server start stay in make test
def test_server_streams_then_a_dead_rank_ends_it(tmp_path, single_rank, tokenizer):
    """The OpenAI SDK streams from a 3-rank server (the single rank's greedy text: float32 as
    `single_rank`, whose tokens `--dtype auto`'s bfloat16 and, on AVX2, int8 activations need
    not keep); then a worker is killed mid-stream: that stream fails, the server exits non-zero
    within seconds naming the rank, and no worker is left behind."""
    from openai import OpenAI, APIError

    before = set(_worker_pids())
    log = tmp_path / "server.log"
    proc, base = start_server(["--tensor-parallel-size", "3", "--max-model-len", "2048",
                               "--kv-cache-memory", "0.25", "--dtype", "float32"],
                              "/health/ready", log)
    try:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        everything, expected = single_rank
        stream = client.completions.create(model=MODEL, prompt=tokenizer.decode(everything[0]),
                                           max_tokens=24, temperature=0, stream=True)
        text = "".join(c.choices[0].text for c in stream)
        assert text == tokenizer.decode(expected[0])
        workers = sorted(set(_worker_pids()) - before)
        assert len(workers) == 2
        stream = client.completions.create(model=MODEL, prompt="Count to one thousand: 1, 2,",
                                           max_tokens=1500, temperature=0, stream=True)
        received, failed = 0, None
        try:
            for chunk in stream:
                received += 1
                if received == 3:
                    os.kill(workers[0], signal.SIGKILL)
        except APIError as e:
            failed = e
        assert failed is not None, f"the stream ended normally after {received} chunks"
        assert received < 1000
        code = proc.wait(60)
        assert code != 0
        assert "tensor-parallel rank 1" in log.read_text() or \
            "tensor-parallel rank 2" in log.read_text()
        deadline = time.time() + 10
        while set(_worker_pids()) - before and time.time() < deadline:
            time.sleep(0.2)
        assert not set(_worker_pids()) - before, "a worker outlived its server"
    finally:
        if proc.poll() is None:
            proc.kill()
