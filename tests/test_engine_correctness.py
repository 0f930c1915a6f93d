"""Greedy outputs of the engine are token-identical to transformers' `generate` (same weights,
float32) — alone, all at once, with chunked prefill at a 7-token budget, with prefix-cache hits,
under a KV pool small enough to preempt, in swap, recompute and auto modes, and with the SLO
options (target ITL, sjf, each tuning profile). Real model.

The engine serves the embedded GGUF as it is by default (`--quantization gguf`: its Q4_1 / Q8_0
blocks read by the kernels), transformers the same weights dequantized to float32: the products
are the same up to the order of float32 sums, so a token may differ only where the reference's
top two logits are within NEAR_TIE (`assert_greedy` counts such ties; none seen so far). The
float32 weight path (`--quantization none`) is checked too."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.profiles import TUNING_PROFILES, resolve_profile
from engine.llm_engine import LLMEngine
from scheduler.request import SamplingParams
from tests.greedy import ends_as_generate_would, eos_ids, teacher_forced_argmax

MAX_TOKENS = 24
NEAR_TIE = 1e-3          # logits: a top-2 gap below this may flip with the summation order
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
LONG_TEXT = " ".join(f"Fact {i}: the number {i} squared is {i * i}, and {i} plus {i} is {2 * i}."
                     for i in range(1, 35))
SYSTEM = ("You are Continuum's test assistant. You answer briefly and precisely, you never "
          "invent facts, and when you are unsure you say so. Keep every answer under three "
          "sentences and prefer plain words over jargon.")


def chat(tokenizer, user, system=None):
    msgs = ([{"role": "system", "content": system}] if system else []) + \
           [{"role": "user", "content": user}]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


@pytest.fixture(scope="module")
def prompts(tokenizer):
    raw = lambda text: tokenizer.encode(text)  # noqa: E731
    ps = {
        "short": raw("Hello"),
        "capital": chat(tokenizer, "What is the capital of France?"),
        "french": chat(tokenizer, "Écris une phrase sur la mer."),
        "chinese": chat(tokenizer, "请用一句话介绍长城。"),
        "german": chat(tokenizer, "Wie viele Tage hat eine Woche?"),
        "code": raw('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
        "code-chat": chat(tokenizer, "Write a Python function that reverses a string."),
        "long": chat(tokenizer, LONG_TEXT + "\n\nWhat is 7 squared, according to the text?"),
    }
    assert 900 <= len(ps["long"]) <= 1300, len(ps["long"])
    return ps


@pytest.fixture(scope="module")
def shared_prefix_prompts(tokenizer):
    return [chat(tokenizer, q, SYSTEM) for q in
            ("Name a primary colour.", "What is 2 + 2?", "Say hello in Spanish.")]


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_greedy(hf_model, prompt, max_tokens=MAX_TOKENS):
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                dtype=torch.long), max_new_tokens=max_tokens, do_sample=False,
                                pad_token_id=hf_model.config.eos_token_id)
    return out[0, len(prompt):].tolist()


def hf_verified(hf_model, prompts: list[list[int]], candidates: list[list[int]]):
    """transformers' greedy tokens for each prompt, found from a candidate continuation (the
    engine's) in one teacher-forced pass (`tests.greedy`): a candidate whose every token is
    the argmax at its position, and which ends as `generate` would end it, is the greedy
    continuation (up to float32 summation order). From the first position that differs, the
    rest is `hf_greedy`'s."""
    eos = eos_ids(hf_model)
    out = []
    for greedy, p, c in zip(teacher_forced_argmax(hf_model, prompts, candidates), prompts,
                            candidates):
        i = next((i for i, (a, b) in enumerate(zip(greedy, c)) if a != b), None)
        if i is None and ends_as_generate_would(c, MAX_TOKENS, eos):
            out.append(c)
            continue
        head = c if i is None else c[:i] + [greedy[i]]
        rest = [] if head[-1] in eos else hf_greedy(hf_model, p + head, MAX_TOKENS - len(head))
        out.append(head + rest)
    return out


@pytest.fixture(scope="module")
def named(prompts, shared_prefix_prompts):
    """Every prompt by the name its reference has: `prompts`' and shared0..2."""
    return dict(prompts, **{f"shared{i}": p for i, p in enumerate(shared_prefix_prompts)})


@pytest.fixture(scope="module")
def reference(hf_model, named, base_engine):
    """transformers' greedy tokens for every named prompt (`hf_verified`: from the engine's
    own output, all at once, checked in teacher-forced passes — the short prompts in one
    batch, the ~1k-token one alone; `generate` took ~18 s for them on an AVX2 Zen 3 host). A
    difference the passes' order of float32 sums makes is a near tie, which `assert_greedy`
    measures."""
    names = list(named)
    candidates = dict(zip(names, run(base_engine, [named[n] for n in names])))
    short = [n for n in names if n != "long"]
    ref = dict(zip(short, hf_verified(hf_model, [named[n] for n in short],
                                      [candidates[n] for n in short])))
    ref["long"] = hf_verified(hf_model, [named["long"]], [candidates["long"]])[0]
    return ref


@pytest.fixture(scope="module")
def assert_greedy(hf_model, named, reference):
    """assert_greedy(outputs, names): each output equals its reference, or first differs where
    the reference's top-2 logit gap is below NEAR_TIE (printed and counted)."""

    def check(outputs, names):
        assert len(outputs) == len(names)
        ties = []
        for out, name in zip(outputs, names):
            ref = reference[name]
            i = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), None)
            if i is None:
                assert len(out) == len(ref), name
                continue
            with torch.inference_mode():
                top = hf_model(torch.tensor([named[name] + ref[:i]])).logits[0, -1].topk(2)
            gap = float(top.values[0] - top.values[1])
            assert gap < NEAR_TIE, f"{name}: token {i} differs ({out[i]} vs {ref[i]}), gap {gap}"
            ties.append((name, i, gap))
        if ties:
            print("near ties:", ties)
        return ties
    return check


def engine(**overrides):
    cfg = dict(kv_cache_memory=0.5, max_model_len=2048, dtype="float32", device="cpu")
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg))


def run(eng, prompts):
    return [choices[0] for choices in eng.generate(list(prompts), GREEDY)]


@pytest.fixture(scope="module")
def base_engine():
    return engine()


def test_alone_matches_transformers(base_engine, prompts, assert_greedy):
    assert base_engine.model.quant_types == ["Q4_1", "Q8_0"]      # served as the GGUF's blocks
    for name, p in prompts.items():
        assert_greedy(run(base_engine, [p]), [name])


def test_all_at_once_matches_transformers(base_engine, prompts, assert_greedy):
    assert_greedy(run(base_engine, prompts.values()), list(prompts))


@pytest.mark.parametrize("alone", [False, pytest.param(True, marks=pytest.mark.extended)])
def test_float_weights_match_transformers(prompts, assert_greedy, alone):
    """`--quantization none`: the GGUF dequantized to float32 at load, oneDNN's (or the
    kernel's) GEMM; all prompts at once, and (the second variant) each alone."""
    eng = engine(quantization="none")
    assert eng.model.quant_types == [] and eng.model.linear_path != "quant"
    if alone:
        for name, p in prompts.items():
            assert_greedy(run(eng, [p]), [name])
    else:
        assert_greedy(run(eng, prompts.values()), list(prompts))


def test_kernel_path_is_in_use_on_cpu(base_engine):
    """Where a C compiler exists, the CPU engine attends with the compiled kernels (the tests
    above), built for the engine's ISA level (AVX2 under CONTINUUM_CPU_ISA=avx2, even on an
    AVX-512 host; AVX-512 loops with AMX tiles for the quantized linears on an AMX host, none
    under CONTINUUM_CPU_ISA=avx512); the pure-torch path, which CUDA and NPU use, is checked
    below."""
    from engine import kernels
    from engine.kernels.isa import cpu_isa

    if kernels.find_compiler() is not None:
        lib = base_engine.runner.kernels
        assert lib is not None
        # an AMX level's vector loops are AVX-512's, and its quantized linears take tiles
        assert lib.isa == ("avx512" if cpu_isa() == "amx" else cpu_isa())
        assert bool(lib.amx_rows) == (cpu_isa() == "amx")


@pytest.mark.parametrize("min_group", [None, 1, 2])
def test_pure_torch_path_and_decode_groups_match(base_engine, prompts, assert_greedy, monkeypatch,
                                                 min_group):
    """The pure-torch attention (no compiled kernels): default decode groups, then decodes
    split into many groups (the batched-matmul path at min_group 1, SDPA at 2)."""
    import engine.attention
    import engine.model_runner

    monkeypatch.setattr(base_engine.runner, "kernels", None)
    if min_group is None:
        assert_greedy(run(base_engine, prompts.values()), list(prompts))
        return
    monkeypatch.setattr(engine.model_runner, "SMALL_DECODE_BATCH", min_group)
    monkeypatch.setattr(engine.model_runner, "DECODE_GROUP_MAX_BLOCKS", 8)
    monkeypatch.setattr(engine.attention, "SMALL_DECODE_BATCH", min_group)
    assert_greedy(run(base_engine, prompts.values()), list(prompts))


@pytest.mark.parametrize("with_long", [False, pytest.param(True, marks=pytest.mark.extended)])
def test_chunked_prefill_at_7_token_budget_matches(prompts, assert_greedy, with_long):
    """Every prompt in 7-token chunks (block boundaries at every offset) beside the others'
    decodes; the ~1k-token prompt's ~180 chunks only in the extended tier (~9 s: the other
    budgets' tests chunk it at 32, 64 and 256)."""
    names = [n for n in prompts if with_long or n != "long"]
    eng = engine(max_num_batched_tokens=7)
    assert_greedy(run(eng, [prompts[n] for n in names]), names)


def test_prefix_cache_hits_are_exact(shared_prefix_prompts, assert_greedy):
    eng = engine()
    first = run(eng, shared_prefix_prompts[:1])
    rest = run(eng, shared_prefix_prompts[1:])
    assert eng.scheduler.counters.prefix_cache_hits >= 3 * 16       # the system prompt's blocks
    assert_greedy(first + rest, [f"shared{i}" for i in range(3)])


@pytest.mark.parametrize("mode", ["recompute", pytest.param("swap", marks=pytest.mark.extended),
                                  pytest.param("auto", marks=pytest.mark.extended)])
def test_preemption_is_exact(mode, prompts, assert_greedy):
    # 72 blocks = 1152 slots: the ~1k-token prompt (first, so it runs throughout) plus the
    # others do not fit, so later arrivals are preempted while it decodes.
    eng = engine(num_gpu_blocks_override=72, max_model_len=1100, preemption_mode=mode,
                 swap_space=0.25, max_num_batched_tokens=256)
    names = ["long"] + [n for n in prompts if n != "long"]
    outputs = run(eng, [prompts[n] for n in names])
    counters = eng.scheduler.counters
    assert counters.num_preemptions > 0
    if mode == "swap":
        assert counters.swap_out_blocks > 0
    assert counters.num_preemptions_swap + counters.num_preemptions_recompute \
        == counters.num_preemptions
    assert_greedy(outputs, names)
    assert eng.scheduler.kv.num_free_blocks == 72


@pytest.mark.parametrize("options", [
    pytest.param({"target_itl_ms": 1.0}, marks=pytest.mark.extended),
    pytest.param({"scheduling_policy": "sjf"}, marks=pytest.mark.extended),
    # low_latency sets the most (sjf, target auto, preemption auto); the others run in CI
    *(pytest.param({"profile": name}, marks=() if name == "low_latency"
                   else pytest.mark.extended) for name in TUNING_PROFILES)], ids=str)
def test_slo_options_are_exact(options, prompts, assert_greedy):
    """A 1 ms ITL target leaves no slack: prefill waits `patience` steps, then goes at the
    budget's floor (32-token chunks beside the decodes); sjf reorders; each profile sets its flags. Greedy tokens do not change."""
    if "profile" in options:
        options = resolve_profile(options["profile"], {})
    eng = engine(**options)
    assert_greedy(run(eng, prompts.values()), list(prompts))
    if options.get("target_itl_ms") == 1.0:
        assert eng.scheduler.latency.coefficients()[2] is not None
        assert eng.scheduler.prefill_budgeter.prefill_budget(0, starved=True) == 32


@pytest.mark.parametrize("quantization", [
    "none", pytest.param("gguf", marks=pytest.mark.extended)])    # gguf: its second variant
def test_bfloat16_engine_follows_float32_greedy(prompts, reference, quantization):
    """bfloat16 serves on every host (weights in bfloat16: on AVX2-only ones through the
    bfloat16-weight GEMM kernel, `CONTINUUM_CPU_ISA=avx2` in CI; or the GGUF blocks with
    bfloat16 activations): its greedy tokens follow the float32 reference until
    rounding tips a near tie (the "capital" prompt's top two float32 logits are 0.08 apart; a
    bfloat16 logit near 25 has a step of 0.125). Counted over all prompts: the tokens before each
    prompt's first difference are at least half of all tokens, and most first tokens agree.
    Activations stay bfloat16 (`--activation-quantization none`): where int8 activations are
    the default (AVX2, AVX-512 VNNI without bfloat16 units) they are a third rounding, checked
    by tests/test_quant_int8_activations.py (on an AVX2 EPYC Zen 3 they kept 87 of these 192
    tokens before a first difference)."""
    eng = engine(dtype="bfloat16", quantization=quantization, activation_quantization="none")
    outs = run(eng, prompts.values())
    same = [next((i for i, (a, b) in enumerate(zip(out, reference[name])) if a != b),
                 len(reference[name])) for name, out in zip(prompts, outs)]
    assert sum(same) >= 0.5 * MAX_TOKENS * len(prompts), (same, eng.model.linear_path)
    assert sum(s > 0 for s in same) >= len(prompts) - 2, (same, eng.model.linear_path)
