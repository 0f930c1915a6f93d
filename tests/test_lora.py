"""Multi-LoRA in the engine against the reference: adapters made here with `peft` on the
embedded model (non-zero B, fixed seeds, ranks 4/8/16, different target sets, one rsLoRA),
greedy tokens compared with transformers + peft in float32 (the adapter applied unmerged, and
merged into the weights) — alone, a mixed batch of four adapters and the base, with fewer
slots than adapters, with fewer host-memory adapters than adapters, under both preemptions,
with chunked prefill; prefix-cache blocks never shared across adapters; every bad adapter a
LoraError naming it. The server side is tests/test_lora_server.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.lora.adapter import LoraError, load_adapter
from scheduler.request import ParamError, SamplingParams
from tests.greedy import ends_as_generate_would, eos_ids, teacher_forced_argmax

peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[test]')")

MAX_TOKENS = 16
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name: (seed, rank, targets, rsLoRA)
SPECS = {"attn8": (1, 8, ["q_proj", "v_proj"], False),
         "all16": (2, 16, ALL, False),
         "mlp4": (3, 4, ["up_proj", "down_proj"], True),
         "ko8": (4, 8, ["k_proj", "o_proj", "gate_proj"], False)}


def make_adapter(model_dir, path, seed: int, rank: int, targets: list[str], rslora: bool):
    """A peft adapter with random non-zero A and B (lora_alpha = 4 x rank, so that it shows),
    saved to `path`; returns the peft model (float32, eval) over a base model of its own."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return add_adapter(base, path, seed, rank, targets, rslora).eval()


def add_adapter(base, path, seed: int, rank: int, targets: list[str], rslora: bool):
    """`make_adapter`'s adapter over the transformers model `base`, whose modules peft wraps in
    place (`unload()` on the result gives them back unchanged); saved to `path`."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=rank, lora_alpha=4 * rank, target_modules=targets, init_lora_weights=False,
        use_rslora=rslora))
    model.save_pretrained(str(path))
    return model


def hf_greedy(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(
            1, len(prompt), dtype=torch.long), max_new_tokens=MAX_TOKENS, do_sample=False,
            pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def prompt(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def adapters(model_dir, prompt, tmp_path_factory):
    """{name: (path, reference greedy tokens)}, None: the base model's. The tokens are the
    float32 engine's, all five in one batch, and each list is checked to be peft's greedy
    output (`check_peft_greedy`: one teacher-forced pass of the unmerged peft model, ~0.4 s,
    where transformers' `generate` took ~1.7 s an adapter)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for name, spec in SPECS.items():
        add_adapter(base, root / name, *spec).unload()    # the base's own modules back
    paths = {name: str(root / name) for name in SPECS}
    eng = engine({name: (path, None) for name, path in paths.items()}, quantization="none")
    names = [*SPECS, None]                        # one batch: a request per adapter, and base
    out = {name: (paths.get(name), tokens) for name, tokens in zip(names, run(eng, prompt, names))}
    eng.shutdown()
    for name, (path, tokens) in out.items():
        model = base if path is None else peft.PeftModel.from_pretrained(base, path)
        check_peft_greedy(model.eval(), prompt, tokens, name)
        if path is not None:
            model.unload()
    assert all(out[n][1] != out[None][1] for n in SPECS), "an adapter that changes nothing"
    return out


def check_peft_greedy(model, prompt: list[int], tokens: list[int], name) -> None:
    """Assert that `tokens` are `model`'s greedy continuation of `prompt`, up to MAX_TOKENS or
    its end-of-sequence token: one teacher-forced pass (`tests.greedy`), the argmax at every
    position the next token (what `generate` picks step by step, up to float32 summation
    order)."""
    eos = eos_ids(model)
    assert ends_as_generate_would(tokens, MAX_TOKENS, eos), (name, tokens)
    assert not eos & set(tokens[:-1]), (name, tokens)
    assert teacher_forced_argmax(model, [prompt], [tokens]) == [tokens], name


def engine(adapters, **overrides) -> LLMEngine:
    cfg = dict(kv_cache_memory=0.25, max_model_len=512, dtype="float32", device="cpu",
               enable_lora=True, lora_modules=tuple((n, adapters[n][0]) for n in SPECS),
               max_loras=4, max_lora_rank=16)
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg))


def run(eng, prompt, names) -> list[list[int]]:
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, lora_name=n) for n in names]
    return [choices[0] for choices in eng.generate([prompt] * len(names), params)]


MIXED = ["attn8", "all16", None, "mlp4", "ko8", "all16", None, "attn8"]


@pytest.mark.parametrize("quantization", ["none", pytest.param("gguf",
                                                                 marks=pytest.mark.extended)])
def test_each_alone_and_mixed_match_peft(adapters, prompt, quantization):
    """Each adapter alone, then mixed in one batch, gives peft's greedy tokens (the fixture's,
    checked against peft). GGUF: the kernels' base products differ from the float32 reference
    by summation order only; no near-tie met on this prompt."""
    eng = engine(adapters, quantization=quantization)
    if quantization != "none":        # float32 alone: test_unknown_adapter_is_refused's run
        for name in [*SPECS, None]:
            assert run(eng, prompt, [name]) == [adapters[name][1]], name
    assert run(eng, prompt, MIXED) == [adapters[n][1] for n in MIXED]


@pytest.mark.extended          # ~17 s; make test keeps the TP parity and the LoRA parity
def test_tensor_parallel_three_ranks(adapters, prompt):
    """Three ranks, each holding its shard of every adapter (B split by output row on Q/K/V and
    gate/up, A by input column on O and down): the mixed batch gives peft's tokens; an adapter
    loaded at run time reaches every rank before the next step, and unloading it refuses new
    requests for it."""
    eng = engine(adapters, tensor_parallel_size=3, quantization="none")
    try:
        assert eng.model.cfg.num_heads == 3 and eng.lora.slots.a[0]["o"].shape[-1] == 192
        assert run(eng, prompt, MIXED) == [adapters[n][1] for n in MIXED]
        eng.add_lora("late", adapters["ko8"][0])
        assert run(eng, prompt, ["late", "attn8"]) == [adapters["ko8"][1], adapters["attn8"][1]]
        eng.remove_lora("late")
        with pytest.raises(ParamError):
            eng.add_request("x", prompt, SamplingParams(lora_name="late"))
        assert run(eng, prompt, [None]) == [adapters[None][1]]
    finally:
        eng.shutdown()


@pytest.mark.extended
def test_fewer_slots_and_host_adapters_than_adapters(adapters, prompt):
    """Two slots, two adapters in host memory, four adapters mixed: requests of a third adapter
    wait for a slot, slots are reloaded (and adapters re-read from disk), outputs unchanged."""
    eng = engine(adapters, max_loras=2, max_cpu_loras=2)
    assert run(eng, prompt, MIXED) == [adapters[n][1] for n in MIXED]
    assert eng.lora.loads > 2 and len(eng.lora.cpu) == 2


@pytest.mark.extended
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(adapters, prompt, mode):
    # 10 blocks = 160 slots: 8 requests of ~50 tokens cannot all run, so some are preempted
    eng = engine(adapters, num_gpu_blocks_override=10, max_model_len=160, preemption_mode=mode,
                 swap_space=0.05, enable_prefix_caching=False)
    assert run(eng, prompt, MIXED) == [adapters[n][1] for n in MIXED]
    assert eng.scheduler.counters.num_preemptions > 0


@pytest.mark.extended
def test_chunked_prefill_at_7_token_budget(adapters, prompt):
    eng = engine(adapters, max_num_batched_tokens=7)
    assert run(eng, prompt, MIXED) == [adapters[n][1] for n in MIXED]


@pytest.mark.extended
def test_prefix_cache_is_per_adapter(adapters, prompt):
    eng = engine(adapters)
    counters = eng.scheduler.counters

    def hits(name):
        before = counters.prefix_cache_hits
        run(eng, prompt, [name])
        return counters.prefix_cache_hits - before

    full = len(prompt) // 16 * 16
    assert hits("attn8") == 0 and hits("all16") == 0 and hits(None) == 0
    assert hits("attn8") == hits("all16") == hits(None) == full


def test_unknown_adapter_is_refused(adapters, prompt):
    eng = engine(adapters)
    with pytest.raises(ParamError) as e:
        eng.add_request("x", prompt, SamplingParams(lora_name="nope"))
    assert e.value.param == "model" and "nope" in str(e.value)
    assert run(eng, prompt, ["mlp4"]) == [adapters["mlp4"][1]]


def _edit(src, dst, config=None, drop=None, rename=None, reshape=None):
    """A copy of adapter `src` at `dst` with its config updated, a key dropped, a key renamed,
    or a tensor replaced by one of another shape."""
    from safetensors.torch import load_file, save_file
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.update(config or {})
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "adapter_model.safetensors"))
    key = sorted(tensors)[0]
    if drop:
        del tensors[key]
    if rename:
        tensors[key.replace("q_proj", rename)] = tensors.pop(key)
    if reshape:
        tensors[key] = torch.zeros(tensors[key].shape[0], 7)
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


def test_bad_adapters_are_errors_naming_them(adapters, model_dir, tmp_path):
    from engine.models.llama import ModelConfig
    cfg = ModelConfig.from_dir(model_dir)
    src = Path(adapters["attn8"][0])
    cases = {
        "missing": (tmp_path / "nothing", "does not exist"),
        "rank": (src, "above --max-lora-rank 4"),
        "dora": (_edit(src, tmp_path / "dora", {"use_dora": True}), "DoRA"),
        "half": (_edit(src, tmp_path / "half", drop=True), "only"),
        "target": (_edit(src, tmp_path / "target", rename="lm_head"), "not supported on"),
        "shape": (_edit(src, tmp_path / "shape", reshape=True), "the model needs"),
    }
    for name, (path, words) in cases.items():
        with pytest.raises(LoraError) as e:
            load_adapter(name, path, cfg, max_rank=4 if name == "rank" else 16)
        assert repr(name) in str(e.value) and words in str(e.value), (name, str(e.value))
    with pytest.raises(LoraError):          # at engine start: the start fails naming it
        engine(adapters, lora_modules=(("dora", str(tmp_path / "dora")),))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sgmv_kernel_matches_torch(lib, dtype):
    """engine/kernels/lora.c on every build (AVX-512, AVX2 caps, portable) against the torch
    formula: random rows of 3 slots and the base (-1) in any order, 1 to 40 rows (tiles of 16
    and their remainders), a slot without this projection, zero-padded rank rows, two bands
    (a fused projection), strided x rows; weights in x's dtype; float32 within 1e-5, bfloat16
    within one rounding of the output plus one of each shrunk rank (AVX512-BF16 hosts round
    them to bfloat16 for vdpbf16ps, as vLLM's punica kernels do)."""
    check_sgmv(lib, dtype, rank=8, n_in=72, outs=(40, 24), rows=(1, 3, 16, 17, 40))


@pytest.mark.parametrize("n_in", [96, 576])
def test_sgmv_on_amx_tiles_matches_torch(amx_lib, n_in):
    """lora.c's bfloat16 products on AMX tiles (lora_amx.c: full tiles of 16 rows of one
    adapter, `in` a multiple of 32, R a multiple of 16): ranks 16 a band (R 32), a band of 300
    output columns (two expand chunks, the second partial), 16 to 64 rows mostly of one
    adapter, against the same torch formula and bound as the vector kernels."""
    check_sgmv(amx_lib, torch.bfloat16, rank=16, n_in=n_in, outs=(40, 300), rows=(16, 33, 64),
               slots_low=0)


def check_sgmv(lib, dtype, rank, n_in, outs, rows, slots_low=-1):
    """`lib.lora_sgmv` against torch: 4 slots (slot 1 with zero-padded rank rows, slot 2
    without this projection), two bands, row slots drawn from [slots_low, 4) (-1: the base),
    strided x rows."""
    g = torch.Generator().manual_seed(0)
    slots = 4
    bands = torch.tensor([[0, rank, 0, outs[0]], [rank, 2 * rank, outs[0], sum(outs)]],
                         dtype=torch.int32)
    a = torch.randn(slots, 2 * rank, n_in, generator=g)
    bt = torch.zeros(slots, 2 * rank, sum(outs))
    bt[:, :rank, :outs[0]] = torch.randn(slots, rank, outs[0], generator=g)
    bt[:, rank:, outs[0]:] = torch.randn(slots, rank, outs[1], generator=g)
    a[1, rank - 3:rank] = 0                              # slot 1: rank - 3 in the first band
    present = torch.tensor([1, 1, 0, 1], dtype=torch.int32)   # slot 2 lacks this projection
    for n in rows:
        row_slot = torch.randint(slots_low, slots, (n,), generator=g, dtype=torch.int32)
        if slots_low >= 0:
            row_slot[: n - n % 16] = 3                    # full tiles of one adapter
        x = torch.randn(n, 2 * n_in, generator=g).to(dtype)[:, :n_in]       # strided rows
        out = torch.randn(n, sum(outs), generator=g).to(dtype)
        want, spread = out.float().clone(), torch.zeros(n, sum(outs))
        for r in range(n):
            s = int(row_slot[r])
            if s >= 0 and present[s]:       # the weights as the kernel holds them
                t = x[r].float() @ a[s].to(dtype).float().T
                want[r] += t @ bt[s].to(dtype).float()
                spread[r] = t.abs() @ bt[s].to(dtype).float().abs()
        lib.lora_sgmv(x, out, row_slot, present, a.to(dtype), bt.to(dtype), bands)
        err = (out.float() - want).abs()
        if dtype == torch.float32:
            assert (err <= 1e-5 * (want.abs() + spread) + 1e-5).all(), (n, dtype)
        else:
            assert (err <= 2 ** -8 * (want.abs() + spread) + 1e-3).all(), (n, dtype)


@pytest.mark.extended
def test_forked_choices_and_structured_outputs_keep_the_adapter(adapters, prompt):
    """n > 1 forks after the prompt: every choice runs with the request's adapter (greedy: each
    is the adapter's reference); a grammar constrains an adapter's output as the base's."""
    from scheduler.request import StructuredOutputs

    eng = engine(adapters)
    [choices] = eng.generate([prompt], SamplingParams(n=3, max_tokens=MAX_TOKENS, temperature=0,
                                                      lora_name="all16"))
    assert choices == [adapters["all16"][1]] * 3
    so = StructuredOutputs("choice", json.dumps(["yes", "no", "maybe"]))
    for name in ("mlp4", None):
        [[ids]] = eng.generate([prompt], SamplingParams(max_tokens=4, temperature=0,
                                                        structured_outputs=so, lora_name=name))
        assert eng.tokenizer.decode(ids, skip_special_tokens=True) in ("yes", "no", "maybe")
