"""Scheduler rules, one test each, with hand-built runner outputs or the integer-cache fake runner.
Block size 4, 8–32 blocks."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.config import CacheConfig, SchedulerConfig
from scheduler.output import ModelRunnerOutput
from scheduler.request import (QueueFullError, Request, RequestStatus, RequestTooLongError,
                               SamplingParams)
from scheduler.scheduler import Scheduler
from tests.fake_runner import FakeRunner, check_invariants, run_steps

BS = 4


def make(num_blocks=32, num_cpu_blocks=0, prefix=True, **cfg):
    cfg.setdefault("max_model_len", 64)
    return Scheduler(SchedulerConfig(**cfg), CacheConfig(BS, num_blocks, num_cpu_blocks, prefix))


def req(rid, prompt_len=6, max_tokens=4, base=0, arrival=None, **params):
    extra = {"priority": params.pop("priority")} if "priority" in params else {}
    if arrival is not None:
        extra["arrival_time"] = arrival
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, **params)
    return Request(rid, [base + i for i in range(1, prompt_len + 1)], sp, eos_token_id=None, **extra)


def step(s, tokens=None):
    """One schedule + update; every sampling request gets `tokens` (default [1])."""
    out = s.schedule()
    sampled = {x.request_id: list(tokens or [1]) for x in out.scheduled if x.sample}
    return out, s.update_from_output(out, ModelRunnerOutput(sampled))


def counts(out):
    return {x.request_id: len(x.token_ids) for x in out.scheduled}


# ----------------------------------------------------------------------------- budgets, chunking
def test_chunked_prefill_splits_a_long_prompt_and_never_stalls_decodes():
    s = make(max_num_batched_tokens=8)
    s.add_request(req("a", prompt_len=3, max_tokens=10))
    step(s)                                                   # a: prefill, now decoding
    s.add_request(req("long", prompt_len=20, max_tokens=2))
    seen = []
    for _ in range(4):
        out, _ = step(s)
        seen.append(counts(out))
        assert out.scheduled[0].request_id == "a"             # running decode goes first
    assert seen == [{"a": 1, "long": 7}, {"a": 1, "long": 7}, {"a": 1, "long": 6}, {"a": 1, "long": 1}]


def test_max_num_seqs_bounds_the_batch():
    s = make(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        s.add_request(req(f"r{i}", prompt_len=2))
    out, _ = step(s)
    assert set(counts(out)) == {"r0", "r1"} and s.num_waiting == 1


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_it_fits_whole():
    s = make(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    s.add_request(req("a", prompt_len=40))
    s.add_request(req("b", prompt_len=30, base=1000))
    out, _ = step(s)
    assert counts(out) == {"a": 40}                           # b (30) does not fit the 24 left
    out, _ = step(s)
    assert counts(out) == {"a": 1, "b": 30}


# ----------------------------------------------------------------------------- policies
def test_fcfs_admits_in_arrival_order():
    s = make(max_num_seqs=1)
    s.add_request(req("late", arrival=2.0))
    s.add_request(req("early", arrival=1.0))
    out, _ = step(s)
    assert counts(out) == {"early": 6}


def test_priority_policy_lower_value_first_fcfs_within_level():
    s = make(max_num_seqs=1, policy="priority")
    s.add_request(req("low", priority=5, arrival=0.0))
    s.add_request(req("high-2", priority=-1, arrival=2.0))
    s.add_request(req("high-1", priority=-1, arrival=1.0))
    order = []
    while s.has_unfinished_requests():
        out, _ = step(s)
        order += [x.request_id for x in out.scheduled if x.is_new]
    assert order == ["high-1", "high-2", "low"]


def _admission_order(s):
    order = []
    while s.has_unfinished_requests():
        out, _ = step(s)
        order += [x.request_id for x in out.scheduled if x.is_new]
    return order


def test_sjf_runs_the_shortest_job_first():
    s = make(max_num_seqs=1, policy="sjf", max_model_len=64)
    s.add_request(req("long", prompt_len=20, max_tokens=30, arrival=0.0))     # job 50
    s.add_request(req("short", prompt_len=3, max_tokens=2, arrival=0.001))    # job 5
    s.add_request(req("mid", prompt_len=6, max_tokens=10, arrival=0.002))     # job 16
    assert _admission_order(s) == ["short", "mid", "long"]


def test_sjf_aging_bounds_how_long_a_long_job_is_passed_over():
    """aging 1 ms / token: `long` (job 50, arrival 0) ranks as 0.050 s, so a short job that
    arrives within 50 ms of it goes first and one arriving later does not."""
    s = make(max_num_seqs=1, policy="sjf", sjf_aging_ms_per_token=1.0)
    s.add_request(req("long", prompt_len=20, max_tokens=30, arrival=0.0))
    s.add_request(req("short-early", prompt_len=3, max_tokens=2, arrival=0.040))   # 0.045
    s.add_request(req("short-late", prompt_len=3, max_tokens=2, arrival=0.046))    # 0.051
    assert _admission_order(s) == ["short-early", "long", "short-late"]


def test_sjf_without_max_tokens_counts_up_to_max_model_len():
    s = make(max_num_seqs=1, policy="sjf", max_model_len=64)
    s.add_request(req("open", prompt_len=3, max_tokens=None, arrival=0.0))    # job 64
    s.add_request(req("capped", prompt_len=20, max_tokens=20, arrival=0.0))   # job 40
    assert _admission_order(s)[0] == "capped"


@settings(max_examples=60, deadline=None)
@given(jobs=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30),
                               st.integers(0, 200)), min_size=2, max_size=12))
def test_sjf_never_passes_a_request_over_for_one_arriving_past_its_aging_bound(jobs):
    """Any request Y admitted before an earlier request X arrived at most aging x job(X)
    after X (aging 1 ms per token; arrivals in ms)."""
    s = make(max_num_seqs=1, policy="sjf", max_model_len=64, num_blocks=64)
    arrival, job = {}, {}
    for i, (prompt, max_tokens, t_ms) in enumerate(jobs):
        rid = f"r{i}"
        arrival[rid], job[rid] = t_ms / 1000, prompt + max_tokens
        s.add_request(req(rid, prompt_len=prompt, max_tokens=max_tokens, base=100 * i,
                          arrival=t_ms / 1000))
    order = _admission_order(s)
    assert sorted(order) == sorted(arrival)
    for k, y in enumerate(order):
        for x in order[k + 1:]:
            if arrival[y] > arrival[x]:
                assert arrival[y] - arrival[x] <= job[x] / 1000 + 1e-9


@pytest.mark.parametrize("cfg", [dict(policy="lifo"), dict(policy="sjf",
                                                           sjf_aging_ms_per_token=0)])
def test_bad_policy_settings_are_refused(cfg):
    with pytest.raises(ValueError, match="--s"):
        SchedulerConfig(**cfg)


# ----------------------------------------------------------------------------- preemption
def _preempting_scheduler(mode, num_cpu_blocks=0, policy="fcfs"):
    # 8 blocks of 4 = 32 slots; three requests of 8 + 12 tokens cannot all fit.
    s = make(num_blocks=8, num_cpu_blocks=num_cpu_blocks, preemption_mode=mode,
             policy=policy, max_model_len=32, prefix=False)
    return s


def test_recompute_preempts_latest_arrival_and_keeps_its_tokens():
    s = _preempting_scheduler("recompute")
    for i in range(3):
        s.add_request(req(f"r{i}", prompt_len=8, max_tokens=12, base=100 * i, arrival=float(i)))
    preempted = []
    while not preempted:
        out, _ = step(s, [5])
        preempted = out.preempted_request_ids
    assert preempted == ["r2"]
    victim = next(r for _, r in s.waiting if r.request_id == "r2")
    assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert victim.num_output_tokens > 0 and not s.kv.holds_blocks("r2")


def test_priority_victim_is_lowest_priority_even_if_earlier():
    s = _preempting_scheduler("recompute", policy="priority")
    s.add_request(req("vip", prompt_len=8, max_tokens=12, priority=0, arrival=5.0))
    s.add_request(req("bulk", prompt_len=8, max_tokens=12, priority=9, arrival=0.0))
    s.add_request(req("mid", prompt_len=8, max_tokens=12, priority=1, arrival=1.0))
    victims = []
    for _ in range(12):
        out, _ = step(s, [5])
        victims += out.preempted_request_ids
    assert victims[0] == "bulk"


@pytest.mark.parametrize("mode,cpu", [("recompute", 0), ("swap", 32), ("swap", 2)])
def test_preempted_requests_produce_exactly_their_unpreempted_output(mode, cpu):
    def run(num_blocks, num_cpu):
        s = make(num_blocks=num_blocks, num_cpu_blocks=num_cpu, preemption_mode=mode,
                 max_model_len=32, prefix=True)
        for i in range(6):
            s.add_request(req(f"r{i}", prompt_len=5 + i, max_tokens=14, base=10 * (i % 2)))
        outputs = run_steps(s, FakeRunner(s), check=check_invariants)
        return outputs, s.counters

    reference, ref_counters = run(num_blocks=64, num_cpu=0)
    tight, counters = run(num_blocks=9, num_cpu=cpu)
    assert ref_counters.num_preemptions == 0 and counters.num_preemptions > 0
    if mode == "swap" and cpu == 32:
        assert counters.swap_out_blocks > 0 and counters.swap_in_blocks == counters.swap_out_blocks
    assert tight == reference


def test_swap_falls_back_to_recompute_when_cpu_pool_is_full():
    s = _preempting_scheduler("swap", num_cpu_blocks=1)
    for i in range(3):
        s.add_request(req(f"r{i}", prompt_len=8, max_tokens=12, base=100 * i, arrival=float(i)))
    while not s.counters.num_preemptions:
        step(s, [5])
    assert s.num_swapped == 0 and any(r.status == RequestStatus.PREEMPTED for _, r in s.waiting)


def test_swapped_requests_resume_before_new_ones_are_admitted():
    s = _preempting_scheduler("swap", num_cpu_blocks=32)
    for i in range(3):
        s.add_request(req(f"r{i}", prompt_len=8, max_tokens=12, base=100 * i, arrival=float(i)))
    while not s.num_swapped:
        step(s, [5])
    s.add_request(req("new", prompt_len=2, max_tokens=2, arrival=10.0))
    admitted_new_while_swapped = False
    while s.has_unfinished_requests():
        out, _ = step(s, [5])
        if any(x.request_id == "new" and x.is_new for x in out.scheduled) and s.num_swapped:
            admitted_new_while_swapped = True
        if out.blocks_to_swap_in:
            assert all(x.request_id != "new" for x in out.scheduled)
    assert not admitted_new_while_swapped


# ----------------------------------------------------------------------------- admission errors
def test_waiting_queue_is_bounded():
    s = make(max_waiting_requests=2)
    s.add_request(req("a"))
    s.add_request(req("b"))
    with pytest.raises(QueueFullError, match="waiting queue is full"):
        s.add_request(req("c"))
    assert s.num_waiting == 2


def test_length_check_names_both_numbers():
    s = make(max_model_len=16)
    with pytest.raises(RequestTooLongError, match=r"16 tokens.*requested 20 tokens \(10 in the "
                                                  r"prompt, 10 in the completion\)"):
        s.add_request(req("a", prompt_len=10, max_tokens=10))
    with pytest.raises(RequestTooLongError, match="prompt has 16 tokens"):
        s.add_request(req("b", prompt_len=16, max_tokens=None))
    assert not s.has_unfinished_requests()


def test_kv_cache_smaller_than_max_model_len_fails_at_start():
    with pytest.raises(ValueError, match="max_model_len"):
        make(num_blocks=4, max_model_len=32)


# ----------------------------------------------------------------------------- update and stop
def test_update_accepts_several_tokens_and_advances_computed_tokens():
    s = make()
    s.add_request(req("a", prompt_len=4, max_tokens=10))
    step(s)                                  # prefill; 1 output token
    r = s.requests["a"]
    out, outs = step(s, [7, 8, 9])           # e.g. two accepted draft tokens + a bonus token
    assert outs[0].new_token_ids == [7, 8, 9]
    assert r.num_computed_tokens == r.num_tokens - 1 == 7


@pytest.mark.parametrize("params,tokens,expect_tokens,reason,stop_reason", [
    ({}, [3, 2, 3, 3], [3, 2], "stop", None),                               # EOS = 2
    ({"ignore_eos": True, "max_tokens": 3}, [2, 2, 2, 2], [2, 2, 2], "length", None),
    ({"stop_token_ids": (5,)}, [4, 5, 6], [4, 5], "stop", 5),
    ({"min_tokens": 3}, [2, 2, 2, 2], [2, 2, 2], "stop", None),             # EOS held until 3
    ({"max_tokens": 2}, [4, 4, 4], [4, 4], "length", None),
])
def test_stop_conditions(params, tokens, expect_tokens, reason, stop_reason):
    s = make()
    params.setdefault("max_tokens", 10)
    sp = SamplingParams(temperature=0, **params)
    s.add_request(Request("a", [1, 1, 1], sp, eos_token_id=2))
    out = s.schedule()
    outs = s.update_from_output(out, ModelRunnerOutput({"a": tokens}))
    assert outs[0].new_token_ids == expect_tokens
    assert outs[0].status.finish_reason == reason and outs[0].stop_reason == stop_reason
    assert not s.has_unfinished_requests() and s.kv.num_free_blocks == 32


def test_max_model_len_caps_length():
    s = make(max_model_len=8)
    s.add_request(Request("a", [1] * 6, SamplingParams(max_tokens=None), eos_token_id=None))
    outs = []
    while s.has_unfinished_requests():
        outs += step(s)[1]
    assert outs[-1].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert sum(len(o.new_token_ids) for o in outs) == 2


def test_tokens_for_a_request_aborted_after_schedule_are_dropped():
    s = make()
    s.add_request(req("a"))
    out = s.schedule()
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert s.update_from_output(out, ModelRunnerOutput({"a": [1]})) == []
    assert s.schedule().finished_request_ids == ["a"]


# ----------------------------------------------------------------------------- abort in any state
def test_abort_in_every_state_frees_everything():
    s = make(num_blocks=8, num_cpu_blocks=8, preemption_mode="swap", max_model_len=32,
             max_num_batched_tokens=6)
    for i in range(4):
        s.add_request(req(f"r{i}", prompt_len=10, max_tokens=16, base=100 * i, arrival=float(i)))
    states = {}
    for _ in range(60):
        step(s, [5])
        for r in s.requests.values():
            mid_prefill = r.status == RequestStatus.RUNNING and r.num_computed_tokens < r.num_prompt_tokens
            states.setdefault("mid-prefill" if mid_prefill else r.status.name, r.request_id)
        if {"WAITING", "RUNNING", "SWAPPED"} <= set(states) and s.num_swapped:
            break
    assert {"WAITING", "SWAPPED", "mid-prefill"} <= set(states)
    finished = s.finish_requests(list(s.requests), RequestStatus.FINISHED_ABORTED)
    assert finished and not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == 8 and s.kv.cpu_pool.num_free_blocks == 8
    assert not s.kv.block_tables and not s.kv.cpu_tables
    assert set(s.schedule().finished_request_ids) >= set(finished)


def test_finish_requires_a_final_status():
    with pytest.raises(ValueError):
        make().finish_requests(["a"], RequestStatus.RUNNING)


# ----------------------------------------------------------------------------- fork (n > 1)
def test_n2_forks_after_the_prompt_and_copies_the_shared_partial_block():
    s = make()
    s.add_request(req("p", prompt_len=6, max_tokens=5, n=2))
    out = s.schedule()
    assert counts(out) == {"p": 5} and not out.scheduled[0].sample      # up to prompt - 1
    s.update_from_output(out, ModelRunnerOutput({}))
    out = s.schedule()
    assert counts(out) == {"p": 1, "p#1": 1}
    assert len(out.blocks_to_copy) == 1                                 # the partial block
    assert all(x.sample for x in out.scheduled)
    child = next(x for x in out.scheduled if x.request_id == "p#1")
    assert child.is_new and child.choice_index == 1
    assert s.kv.block_ids("p")[0] == s.kv.block_ids("p#1")[0]          # full block shared


def test_n2_with_fake_runner_gives_two_distinct_choices_and_frees_everything():
    s = make()
    s.add_request(req("p", prompt_len=9, max_tokens=6, n=2))
    outputs = run_steps(s, FakeRunner(s), check=check_invariants)
    assert set(outputs) == {"p", "p#1"} and outputs["p"] != outputs["p#1"]
    assert all(len(v) == 6 for v in outputs.values())
    assert s.kv.num_free_blocks == 32


def test_abort_of_the_parent_id_aborts_its_forks():
    s = make()
    s.add_request(req("p", prompt_len=3, max_tokens=8, n=3))
    for _ in range(3):
        step(s)
    assert {"p", "p#1", "p#2"} <= set(s.requests)
    assert sorted(s.finish_requests(["p"], RequestStatus.FINISHED_ABORTED)) == ["p", "p#1", "p#2"]
    assert s.kv.num_free_blocks == 32


# ----------------------------------------------------------------------------- prefix caching
def test_shared_prefix_is_computed_once_and_counted():
    s = make(num_blocks=32)
    system = list(range(200, 212))                     # 3 full blocks shared
    s.add_request(Request("a", system + [1, 2], SamplingParams(max_tokens=2)))
    run_steps(s, FakeRunner(s))
    s.add_request(Request("b", system + [3, 4], SamplingParams(max_tokens=2)))
    out = s.schedule()
    assert counts(out) == {"b": 2} and out.scheduled[0].start_position == 12
    assert s.counters.prefix_cache_queries == 28 and s.counters.prefix_cache_hits == 12


def test_prefix_cache_off_computes_everything():
    s = make(prefix=False)
    system = list(range(200, 212))
    s.add_request(Request("a", system + [1], SamplingParams(max_tokens=1)))
    run_steps(s, FakeRunner(s))
    s.add_request(Request("b", system + [3], SamplingParams(max_tokens=1)))
    assert counts(s.schedule()) == {"b": 13}


# ----------------------------------------------------------------------------- waiting for a grammar
def test_a_request_waits_for_its_grammar_then_runs_and_a_failed_grammar_fails_it():
    from concurrent.futures import Future

    from scheduler.request import StructuredOutputs

    compiles: dict[str, Future] = {}

    def compile_grammar(so):
        return compiles.setdefault(so.spec, Future())

    s = Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(BS, 32, 0, True),
                  compile_grammar=compile_grammar)
    s.add_request(req("ok", structured_outputs=StructuredOutputs("regex", "[a-z]+"),
                      arrival=0.0))
    s.add_request(req("bad", base=50, structured_outputs=StructuredOutputs("regex", "("),
                      arrival=1.0))
    s.add_request(req("free", base=100, arrival=2.0))
    assert s.requests["ok"].status == RequestStatus.WAITING_FOR_GRAMMAR
    out, _ = step(s)
    assert counts(out) == {"free": 6} and s.num_waiting == 2      # both wait, in the queue
    compiles["[a-z]+"].set_result(object())
    compiles["("].set_exception(ValueError("unbalanced parenthesis"))
    out, updates = step(s)
    assert counts(out) == {"free": 1, "ok": 6} and "bad" in out.finished_request_ids
    assert (updates[0].request_id, updates[0].status, updates[0].error) == \
        ("bad", RequestStatus.FINISHED_ERROR, "unbalanced parenthesis")
    assert "bad" not in s.requests and s.num_waiting == 0
    s.finish_requests(list(s.requests), RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == 32


def test_drafts_travel_in_the_runner_output_and_the_scheduler_keeps_them():
    s = make(num_speculative_tokens=2, spec_adaptive=False)
    s.add_request(req("a", max_tokens=8))
    s.add_request(req("b", base=50, max_tokens=1))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput({"a": [7], "b": [7]},
                                                draft_token_ids={"a": [8, 9], "b": [8]}))
    assert s.requests["a"].spec_token_ids == [8, 9] and "b" not in s.requests   # b finished
    (sr,) = s.schedule().scheduled
    assert sr.request_id == "a" and sr.token_ids == [7, 8, 9] and sr.num_drafts == 2


def test_snapshot_is_what_the_metrics_read():
    s = make(num_blocks=16, num_cpu_blocks=4)
    s.add_request(req("a"))
    step(s)
    snap = s.snapshot()
    assert (snap["num_running"], snap["num_waiting"], snap["num_swapped"]) == (1, 0, 0)
    assert snap["kv_cache_usage"] == 2 / 16 and snap["cpu_kv_cache_usage"] == 0.0
    assert snap["counters"]["prefix_cache_queries"] == 6 and snap["spec_decode"] is None
    assert snap["prefill_budget"] == s.config.max_num_batched_tokens
    assert "step_cost" in snap and "step_cost" not in s.snapshot(step_cost=False)
