"""Speculative decoding with a draft model, on the real model. The target as its own draft
(float32) must accept every draft at temperature 0: any position whose draft K/V went missing or
stale — catch-up after a fully accepted step, chunked prefill, prefix-cache hits, copy-on-write,
swap or recompute preemption — would show as a rejection. A bfloat16 copy as the draft (the
cheap draft of a float32 target) must give float32's exact tokens with limits, stop strings,
n = 2 and seeded sampling. Then the server with the OpenAI SDK, and the start errors."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys

import pytest

import scheduler.scheduler as scheduler_module
from engine.loader import embedded_gguf_path
from scheduler.request import SamplingParams
from tests.conftest import KEY, MODEL, free_port, greedy, metric, start_server, stop_server
from tests.test_spec_decode_engine import (PARAGRAPH, assert_drained, chat, engine, expected,
                                           prompts, run)

__all__ = ["expected", "prompts"]          # module fixtures shared with the n-gram tests

OWN = {"method": "draft_model", "model": str(embedded_gguf_path()), "num_speculative_tokens": 4,
       "adaptive": False}
BF16 = dict(OWN, dtype="bfloat16", adaptive=True)


def all_accepted(eng) -> bool:
    c = eng.scheduler.spec_counters
    return c.num_draft_tokens > 0 and c.num_accepted_tokens == c.num_draft_tokens


def test_own_draft_accepts_everything_alone_and_concurrent(prompts, expected):
    eng = engine(speculative_config=OWN)
    assert run(eng, [prompts["copy"]]) == [expected["copy"]]
    assert run(eng, prompts.values()) == list(expected.values())
    assert all_accepted(eng), eng.scheduler.spec_counters
    assert eng.scheduler.spec_counters.num_drafts >= 30
    assert_drained(eng)


def test_own_draft_with_chunked_prefill_and_prefix_hits(prompts, expected):
    eng = engine(speculative_config=OWN, max_num_batched_tokens=7)
    names = ["shared0", "copy", "shared1"]
    assert run(eng, [prompts["shared0"]]) + run(eng, [prompts[n] for n in names[1:]]) \
        == [expected[n] for n in names]
    assert eng.scheduler.counters.prefix_cache_hits >= 3 * 16
    assert all_accepted(eng), eng.scheduler.spec_counters
    assert_drained(eng)


@pytest.mark.extended      # test_spec_decode_engine.test_preemption_matches stays in make test
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_own_draft_through_preemption(mode, prompts, tokenizer):
    long_copy = chat(tokenizer, "Repeat this text exactly:\n\n" + " ".join([PARAGRAPH] * 6))
    flags = dict(num_gpu_blocks_override=26, preemption_mode=mode, max_model_len=400,
                 swap_space=0.25, max_num_batched_tokens=256)
    eng, base = engine(speculative_config=OWN, **flags), engine(**flags)
    batch = [long_copy] + list(prompts.values())
    assert run(eng, batch) == run(base, batch)
    counters = eng.scheduler.counters
    assert counters.num_preemptions > 0
    assert (counters.num_preemptions_swap if mode == "swap"
            else counters.num_preemptions_recompute) > 0
    assert all_accepted(eng), eng.scheduler.spec_counters
    assert_drained(eng)


def sit_out(monkeypatch, skip) -> None:
    """Drop the drafts the scheduler chose where `skip(request_id, step)`, as adaptive
    speculation does when drafting stops paying: the draft then skips those requests."""
    real, steps = scheduler_module.plan_drafts, itertools.count()

    def plan(*args, **kwargs):
        step = next(steps)
        return {rid: k for rid, k in real(*args, **kwargs).items() if not skip(rid, step)}
    monkeypatch.setattr(scheduler_module, "plan_drafts", plan)


@pytest.mark.extended          # second variants (~19 s with the prefix-hit one): CI runs them
def test_own_draft_catches_up_after_sitting_out(monkeypatch, prompts, expected):
    """Requests draft one step in three: each time the draft must first compute the positions
    it skipped (prompt included), or a draft would be rejected."""
    sit_out(monkeypatch, lambda rid, step: step % 3 != 0)
    eng = engine(speculative_config=OWN)
    assert run(eng, prompts.values()) == list(expected.values())
    assert all_accepted(eng), eng.scheduler.spec_counters
    assert_drained(eng)


@pytest.mark.extended
def test_prefix_hit_on_blocks_the_draft_never_computed(monkeypatch, prompts, tokenizer):
    """A first turn decodes without drafting, so its output blocks hold the target's K/V only;
    the second turn's prompt (first prompt + answer + a new question) hits those blocks in the
    prefix cache, and the draft must recompute them rather than trust its cache there."""
    drafting = {"on": False}
    sit_out(monkeypatch, lambda rid, step: not drafting["on"])
    eng, base = engine(speculative_config=OWN), engine()
    first = prompts["copy"]
    answer = run(eng, [first], SamplingParams(max_tokens=64, temperature=0))[0]
    assert eng.scheduler.spec_counters.num_draft_tokens == 0
    drafting["on"] = True
    second = first + answer + tokenizer.encode("\nNow say it again, shorter.\n")
    hits = eng.scheduler.counters.prefix_cache_hits
    assert run(eng, [second]) == run(base, [second])
    assert eng.scheduler.counters.prefix_cache_hits - hits > len(first) + 16  # output blocks
    assert all_accepted(eng), eng.scheduler.spec_counters
    assert_drained(eng)


@pytest.mark.extended          # test_server_with_a_bfloat16_draft serves one in make test
def test_bfloat16_draft_gives_float32_tokens(prompts):
    """max_tokens, a stop string, n = 2 (copy-on-write of the draft's blocks too), seeded
    random sampling with penalties: the float32 target's tokens, run to run."""
    spec, base = engine(speculative_config=BF16), engine()
    assert spec.runner.drafter.model.dtype != spec.model.dtype
    cases = [SamplingParams(max_tokens=5, temperature=0),
             SamplingParams(max_tokens=40, temperature=0, stop=("never stalled",)),
             SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=42, n=2),
             SamplingParams(max_tokens=30, temperature=1.0, seed=7, frequency_penalty=0.5,
                            min_tokens=20)]
    for params in cases:
        want = run(base, [prompts["copy"]], params)
        assert run(spec, [prompts["copy"]], params) == want, params
        assert run(spec, [prompts["copy"]], params) == want, params
    greedy = run(base, prompts.values())
    assert run(spec, prompts.values()) == greedy
    assert_drained(spec)
    # Greedy, a bf16 copy agrees with float32 nearly everywhere (measured with every draft
    # verified: random sampling above accepts an argmax draft only as often as the target
    # draws its argmax, and adaptive k depends on timings).
    fixed = engine(speculative_config=dict(BF16, adaptive=False))
    assert run(fixed, prompts.values()) == greedy
    c = fixed.scheduler.spec_counters
    assert c.num_accepted_tokens >= 0.8 * c.num_draft_tokens > 0, c
    assert_drained(fixed)


# ----------------------------------------------------------------------------- start errors
@pytest.fixture(scope="module")
def other_vocab(model_dir, tmp_path_factory):
    """The embedded model with two tokens' ids swapped in its tokenizer: another vocabulary."""
    d = tmp_path_factory.mktemp("other-vocab")
    for f in model_dir.iterdir():
        if f.suffix == ".safetensors":
            (d / f.name).symlink_to(f)
        elif f.name != "tokenizer.json":
            shutil.copy(f, d / f.name)
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["the"], vocab["and"] = vocab["and"], vocab["the"]
    (d / "tokenizer.json").write_text(json.dumps(tok))
    return d


@pytest.mark.parametrize("change,words", [
    ({"model": "/nonexistent/draft"}, "cannot be loaded"),
    ({"dtype": "int8"}, "dtype must be auto, float32, bfloat16 or float16"),
])
def test_bad_draft_is_a_one_line_error(change, words):
    with pytest.raises(ValueError, match=words) as e:
        engine(speculative_config=dict(OWN, **change))
    assert "\n" not in str(e.value) and str(e.value).startswith("--speculative-config")


@pytest.mark.extended      # ~15 s of server start; test_bad_draft_is_a_one_line_error stays
def test_draft_with_another_vocabulary_fails_the_server_start(other_vocab, tmp_path):
    """As a user meets it: the server exits non-zero with the reason on one line."""
    spec = json.dumps(dict(OWN, model=str(other_vocab)))
    proc = subprocess.run([sys.executable, "-m", "api", "serve", "--port", str(free_port()),
                           "--speculative-config", spec],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if "another vocabulary" in ln]
    assert lines and ("'and'" in lines[0] or "'the'" in lines[0]), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- the server
@pytest.mark.extended      # ~31 s; the n-gram server test stays in make test
def test_server_with_a_bfloat16_draft(server, tmp_path):
    from openai import OpenAI

    proc, base = start_server(["--speculative-config", json.dumps(BF16)], "/health/ready",
                              tmp_path / "server.log")
    try:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        messages = [{"role": "user", "content": "Repeat this paragraph exactly:\n\n" + PARAGRAPH}]
        whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48,
                                               temperature=0, extra_body={"ignore_eos": True})
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=48, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if c.choices)
        assert text == whole.choices[0].message.content
        assert whole.usage.completion_tokens == 48
        plain = OpenAI(base_url=f"{server}/v1", api_key=KEY).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=48, temperature=0,
            extra_body={"ignore_eos": True})
        assert text == plain.choices[0].message.content          # float32's own tokens
        accepted = metric(base, "continuum_spec_decode_num_accepted_tokens_total")
        assert 0 < accepted <= metric(base, "continuum_spec_decode_num_draft_tokens_total")
        assert greedy(base) == greedy(server, KEY)
    finally:
        stop_server(proc)
