"""Engine behaviour with the real model: seeded sampling, n > 1, aborts returning every block,
incremental detokenization, stop strings, the async layer, one failing request failing alone."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.async_llm import AsyncLLM, ProcessAsyncLLM, RequestFailedError
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.output_processor import OutputProcessor
from scheduler.output import RequestStepOutput
from scheduler.request import (QueueFullError, RequestStatus, RequestTooLongError,
                               SamplingParams)


@pytest.fixture(scope="module")
def eng():
    return LLMEngine(EngineConfig(kv_cache_memory=0.25, max_model_len=1024, device="cpu",
                                  max_waiting_requests=8))


def prompt(tokenizer, text):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def test_seeded_sampling_is_reproducible_across_runs_and_batches(eng, tokenizer):
    p = prompt(tokenizer, "Tell me a story about a dragon.")
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    alone = eng.generate([p], seeded)[0][0]
    again = eng.generate([p], seeded)[0][0]
    others = [prompt(tokenizer, f"Question number {i}?") for i in range(5)]
    batch = eng.generate([*others, p], [SamplingParams(max_tokens=16, temperature=1.0)] * 5
                         + [seeded])
    assert alone == again == batch[-1][0]
    other_seed = eng.generate([p], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95,
                                                  seed=99))[0][0]
    assert other_seed != alone


def test_n2_gives_two_choices(eng, tokenizer):
    p = prompt(tokenizer, "Name an animal.")
    (a, b), = eng.generate([p], SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=5,
                                               ignore_eos=True))
    assert len(a) == len(b) == 12 and a != b
    assert eng.scheduler.kv.num_free_blocks == eng.scheduler.kv.pool.num_blocks


def test_greedy_penalties_and_bias_change_the_output(eng, tokenizer):
    p = prompt(tokenizer, "Repeat the word 'cat' ten times.")
    base = eng.generate([p], SamplingParams(max_tokens=12, temperature=0))[0][0]
    banned = base[0]
    biased = eng.generate([p], SamplingParams(max_tokens=12, temperature=0,
                                              logit_bias={banned: -100.0}))[0][0]
    assert biased[0] != banned
    penalised = eng.generate([p], SamplingParams(max_tokens=12, temperature=0,
                                                 repetition_penalty=1.8))[0][0]
    assert penalised != base


def test_min_tokens_holds_eos_and_max_tokens_caps(eng, tokenizer):
    p = prompt(tokenizer, "Say only 'yes'.")
    out = eng.generate([p], SamplingParams(max_tokens=30, min_tokens=20, temperature=0))[0][0]
    assert len(out) >= 20 and eng.eos_token_id not in out[:19]
    out = eng.generate([p], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0][0]
    assert len(out) == 3


def test_logprobs_are_returned_with_top_alternatives(eng, tokenizer):
    p = prompt(tokenizer, "Hi")
    eng.add_request("lp", p, SamplingParams(max_tokens=3, temperature=0, logprobs=5))
    seen = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen += out.outputs[0].logprobs or []
    assert len(seen) == 3
    for lp in seen:
        assert len(lp.top) == 5 and lp.logprob <= 0
        assert lp.top[0][0] == lp.token_id             # greedy picks the top token
        assert abs(lp.top[0][1] - lp.logprob) < 1e-5


def test_abort_in_every_state_returns_every_block(tokenizer):
    eng = LLMEngine(EngineConfig(num_gpu_blocks_override=40, max_model_len=600, device="cpu",
                                 preemption_mode="swap", swap_space=0.1,
                                 max_num_batched_tokens=64, max_num_seqs=4))
    long = prompt(tokenizer, " ".join(["word"] * 300))
    for i in range(8):
        eng.add_request(f"r{i}", long[:200 + 20 * i], SamplingParams(max_tokens=200,
                                                                     ignore_eos=True))
    states = set()
    for _ in range(200):
        eng.step()
        s = eng.scheduler
        states |= {r.status for r in s.requests.values()}
        if {RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.SWAPPED} <= states \
                and s.num_swapped and s.num_waiting:
            break
    assert eng.scheduler.num_swapped and eng.scheduler.num_waiting and eng.scheduler.num_running
    eng.abort_request([f"r{i}" for i in range(8)])
    kv = eng.scheduler.kv
    assert not eng.has_unfinished_requests()
    assert kv.num_free_blocks == 40 and kv.cpu_pool.num_free_blocks == kv.cpu_pool.num_blocks
    assert eng.step() == []                             # runner drops their state
    assert not eng.runner.states


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_kv_cache_and_swap_pool_take_memory_only_as_used(eng):
    """`--kv-cache-memory` and `--swap-space` are zero pages the kernel maps on first touch
    (`engine.device.host_zeros`): a 4 GiB swap pool costs neither start-up time nor resident
    memory until blocks are swapped out (torch.zeros wrote every page: 3.7 s here), and both
    caches read as zeros. `eng` first: the model's own memory is resident already."""
    before = _rss_bytes()
    big = LLMEngine(EngineConfig(kv_cache_memory=0.5, max_model_len=1024, device="cpu",
                                 preemption_mode="swap", swap_space=4))
    runner = big.runner
    assert runner.cpu_cache.numel() * runner.cpu_cache.element_size() >= 3.9 * 2**30
    assert not runner.kv_cache.any() and not runner.cpu_cache[:, :, :, :64].any()
    assert _rss_bytes() - before < 1 << 30, (before, _rss_bytes())
    assert big.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0][0]
    big.shutdown()


def test_admission_errors(eng, tokenizer):
    with pytest.raises(RequestTooLongError, match="1024 tokens"):
        eng.add_request("too-long", [1] * 1000, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request("bad-token", [10**9], SamplingParams())
    for i in range(8):
        eng.add_request(f"q{i}", [1, 2, 3], SamplingParams(max_tokens=1))
    with pytest.raises(QueueFullError):
        eng.add_request("q-over", [1, 2, 3], SamplingParams(max_tokens=1))
    eng.abort_request([f"q{i}" for i in range(8)])
    assert not eng.has_unfinished_requests()


# --------------------------------------------------------------------------- output processing
def feed(op, rid, tokens, params, finish_at=None):
    texts, outs = [], []
    for i, t in enumerate(tokens):
        status = RequestStatus.FINISHED_LENGTH_CAPPED if i == finish_at else RequestStatus.RUNNING
        (out,), stopped = op.process([RequestStepOutput(rid, [t], status)]) or ([], [])
        texts.append(out.outputs[0].text)
        outs.append((out, stopped))
        if out.finished or stopped:
            break
    return texts, outs


def test_incremental_detokenization_never_emits_broken_utf8(tokenizer):
    op = OutputProcessor(tokenizer)
    text = "Emoji 🎉 and 世界, done."
    ids = tokenizer.encode(text)
    op.add_request("d", [1], SamplingParams(max_tokens=100), 0.0)
    texts, _ = feed(op, "d", ids, SamplingParams(), finish_at=len(ids) - 1)
    assert "".join(texts) == text
    assert all("\ufffd" not in t for t in texts)
    assert "" in texts                                 # a multi-byte char was held back


def test_stop_strings_are_held_back_and_cut(tokenizer):
    params = SamplingParams(max_tokens=100, stop=("STOP here",))
    op = OutputProcessor(tokenizer)
    op.add_request("s", [1], params, 0.0)
    ids = tokenizer.encode("Hello world STOP here and more")
    texts, outs = feed(op, "s", ids, params)
    out, stopped = outs[-1]
    assert "".join(texts) == "Hello world "
    assert stopped == ["s"] and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == "STOP here" and out.finished
    # A partial match that does not complete is released.
    op.add_request("p", [1], params, 0.0)
    ids = tokenizer.encode("I say STOP now")
    texts, outs = feed(op, "p", ids, params, finish_at=len(ids) - 1)
    assert "".join(texts) == "I say STOP now"


def test_stop_string_with_real_engine(eng, tokenizer):
    p = prompt(tokenizer, "Count from 1 to 10, separated by commas.")
    full = eng.generate([p], SamplingParams(max_tokens=30, temperature=0))[0][0]
    text = tokenizer.decode(full, skip_special_tokens=True)
    assert "5" in text, text
    eng.add_request("stop5", p, SamplingParams(max_tokens=30, temperature=0, stop=("5",)))
    got, last = "", None
    while eng.has_unfinished_requests():
        for out in eng.step():
            got += out.outputs[0].text
            last = out
    assert got == text[:text.index("5")] and last.outputs[0].finish_reason == "stop"
    assert eng.scheduler.kv.num_free_blocks == eng.scheduler.kv.pool.num_blocks


# --------------------------------------------------------------------------- async layer
def test_async_streams_aborts_and_isolates_failures(eng, tokenizer):
    p = prompt(tokenizer, "Write a long poem about autumn.")
    # Computed before the engine thread starts: LLMEngine is driven by one thread at a time.
    expected = eng.tokenizer.decode(
        eng.generate([p], SamplingParams(max_tokens=20, temperature=0))[0][0],
        skip_special_tokens=True)
    llm = AsyncLLM(eng)

    async def collect(rid, params):
        text = ""
        async for out in llm.generate(rid, p, params):
            text += out.outputs[0].text
        return text

    async def walk_away(rid):
        async for _ in llm.generate(rid, p, SamplingParams(max_tokens=200, ignore_eos=True)):
            break                                     # the consumer goes away after one delta

    async def main():
        ok = asyncio.create_task(collect("ok", SamplingParams(max_tokens=20, temperature=0)))
        await walk_away("gone")
        with pytest.raises(RequestTooLongError):
            await collect("too-long", SamplingParams(max_tokens=5000))
        return await ok

    try:
        assert asyncio.run(main()) == expected
        assert not eng.has_unfinished_requests()
        assert eng.scheduler.kv.num_free_blocks == eng.scheduler.kv.pool.num_blocks
    finally:
        llm.shutdown()


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(eng, tokenizer):
    p = prompt(tokenizer, "Hello")
    real_execute = eng.runner.execute
    calls = {"n": 0}

    def flaky(out):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected device fault")
        return real_execute(out)

    eng.runner.execute = flaky
    llm = AsyncLLM(eng)

    async def main():
        with pytest.raises(RequestFailedError, match="injected device fault"):
            async for _ in llm.generate("victim", p, SamplingParams(max_tokens=5)):
                pass
        text = ""
        async for out in llm.generate("survivor", p, SamplingParams(max_tokens=5, temperature=0)):
            text += out.outputs[0].text
        return text

    try:
        assert asyncio.run(main())
        assert llm.is_alive
    finally:
        llm.shutdown()
        eng.runner.execute = real_execute
    assert eng.scheduler.kv.num_free_blocks == eng.scheduler.kv.pool.num_blocks


def test_decode_groups_bound_padding_and_gather_size():
    from engine.model_runner import decode_groups

    # contexts 16..1024 tokens (1..64 blocks of 16), sorted
    lens = [16 * b for b in range(1, 65)]
    groups = decode_groups(lens, 16)
    assert groups[0][0] == 0 and groups[-1][1] == 64
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))       # a partition, in order
    for start, end in groups:
        longest = -(-lens[end - 1] // 16)
        assert end - start >= 8                                        # never tiny groups
        assert (end - start) * longest <= 512 or end - start == 8      # bounded gather
    assert decode_groups([100] * 64, 16) == [(0, 64)]                  # 7 blocks x 64 <= 512
    assert decode_groups([200] * 64, 16) == [(0, 25), (25, 64)]        # 13 x 39 <= 512 < 13 x 40
    assert decode_groups([100] * 5, 16) == [(0, 5)]
    assert decode_groups([], 16) == []


def test_clients_leaving_before_the_engine_acknowledges_leave_nothing_behind(tokenizer):
    """A consumer cancelled while its add is in flight to the engine process (a client that
    disconnects at once) must neither kill the reader thread nor leave its request running."""
    snapshots: list[dict] = []
    llm = ProcessAsyncLLM(EngineConfig(kv_cache_memory=0.05, max_model_len=256, device="cpu"),
                          on_stats=lambda _stats, snap: snap and snapshots.append(snap))
    p = prompt(tokenizer, "Tell me a story.")

    async def drain(rid, params):
        text = ""
        async for out in llm.generate(rid, p, params):
            text += out.outputs[0].text
        return text

    async def main():
        tasks = []
        for i in range(120):
            t = asyncio.create_task(drain(f"gone-{i}", SamplingParams(max_tokens=60,
                                                                      ignore_eos=True)))
            for _ in range(i % 4):                    # cancel at different points
                await asyncio.sleep(0)
            t.cancel()
            tasks.append(t)
        await asyncio.gather(*tasks, return_exceptions=True)
        return await drain("kept", SamplingParams(max_tokens=5, temperature=0))

    try:
        assert asyncio.run(main())
        assert llm.is_alive
        deadline = time.time() + 10
        while time.time() < deadline and not (
                snapshots and snapshots[-1]["num_running"] == snapshots[-1]["num_waiting"] == 0
                and snapshots[-1]["kv_cache_usage"] == 0):
            time.sleep(0.05)
        last = snapshots[-1]
        assert last["num_running"] == last["num_waiting"] == 0 and last["kv_cache_usage"] == 0
    finally:
        llm.shutdown()


def test_a_stop_string_found_in_the_front_end_finishes_the_sequence_in_the_core(tokenizer):
    """The engine core process never sees text: the front end's output processor finds the
    stop string and tells the core (`FinishSequences`), which must stop stepping the request
    at once rather than run on to max_tokens, and free its blocks."""
    steps: list = []
    snapshots: list[dict] = []

    def on_stats(stats, snap):
        steps.extend(stats)
        if snap is not None:                 # sent where due (EngineCoreProc.step), not every step
            snapshots.append(snap)

    llm = ProcessAsyncLLM(EngineConfig(kv_cache_memory=0.05, max_model_len=512, device="cpu"),
                          on_stats=on_stats)
    p = prompt(tokenizer, "Count from 1 to 10, separated by commas.")

    async def run(params):
        text, last = "", None
        async for out in llm.generate(f"s-{len(steps)}", p, params):
            text += out.outputs[0].text
            last = out.outputs[0]
        return text, last

    try:
        full, _ = asyncio.run(run(SamplingParams(max_tokens=30, temperature=0)))
        assert "5" in full, full
        time.sleep(0.5)                      # the last step's stats follow its outputs
        steps.clear()
        got, last = asyncio.run(run(SamplingParams(max_tokens=300, temperature=0,
                                                   ignore_eos=True, stop=("5",))))
        assert got == full[:full.index("5")]
        assert (last.finish_reason, last.stop_reason) == ("stop", "5")
        assert last.num_output_tokens < 30                  # usage ends at the stop string
        deadline = time.time() + 10
        while time.time() < deadline and not (snapshots[-1]["num_running"] == 0
                                              and snapshots[-1]["kv_cache_usage"] == 0):
            time.sleep(0.05)
        assert snapshots[-1]["num_running"] == 0 and snapshots[-1]["kv_cache_usage"] == 0
        assert len(steps) < 40, f"the core ran {len(steps)} steps for a stop at ~15 tokens"
        assert sum(s.num_generation_tokens for s in steps) == last.num_output_tokens
    finally:
        llm.shutdown()
